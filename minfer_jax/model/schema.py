"""The GGUF side every family shares: hyper-parameter reads and tensor tables.

Family modules (qwen2.py, llama.py, qwen3.py, gemma3.py) build their Config and tensor list from
these; `md` is files.gguf.MetadataView (typed reads of `{arch}.<key>` that raise GGUFError).
"""

from __future__ import annotations

from collections.abc import Iterator

from minfer_jax.errors import UnsupportedError
from minfer_jax.model.config import Config


def global_shapes(cfg: Config) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield "token_embd.weight", (cfg.vocab_size, cfg.d_model)
    yield "output_norm.weight", (cfg.d_model,)
    if not cfg.tied_output:
        yield "output.weight", (cfg.vocab_size, cfg.d_model)
    if cfg.rope_freq_factors:
        yield "rope_freqs.weight", (cfg.head_dim // 2,)


def layer_shapes(
    cfg: Config, i: int, *, bias: bool = False, qk_norm: bool = False, post_norms: bool = False
) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors: attention and gated FFN (or, with cfg.n_experts, the mixture of experts:
    moe_shapes), with q/k/v biases (Qwen2), per-head q/k norms (Qwen3, Gemma 3) and the norms after
    attention and FFN (Gemma 3) where the family has them."""
    d, qd, kv, ff, hd = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff, cfg.head_dim
    p = f"blk.{i}."
    shapes = {p + "attn_norm.weight": (d,), p + "attn_q.weight": (qd, d)}
    if bias:
        shapes[p + "attn_q.bias"] = (qd,)
    shapes[p + "attn_k.weight"] = (kv, d)
    if bias:
        shapes[p + "attn_k.bias"] = (kv,)
    shapes[p + "attn_v.weight"] = (kv, d)
    if bias:
        shapes[p + "attn_v.bias"] = (kv,)
    if qk_norm:
        shapes[p + "attn_q_norm.weight"] = (hd,)
        shapes[p + "attn_k_norm.weight"] = (hd,)
    shapes[p + "attn_output.weight"] = (d, qd)
    if post_norms:
        shapes[p + "post_attention_norm.weight"] = (d,)
    shapes[p + "ffn_norm.weight"] = (d,)
    if cfg.n_experts:
        shapes.update(moe_shapes(cfg, i))
    else:
        shapes.update(
            {
                p + "ffn_gate.weight": (ff, d),
                p + "ffn_up.weight": (ff, d),
                p + "ffn_down.weight": (d, ff),
            }
        )
    if post_norms:
        shapes[p + "post_ffw_norm.weight"] = (d,)
    return shapes


def common_fields(md) -> dict:
    """The hyper-parameters every family reads the same way (`{arch}.block_count`, ...).

    md: files.gguf.MetadataView (typed reads of `{arch}.<key>` that raise GGUFError)."""
    n_heads = md.int("attention.head_count")
    return dict(
        n_layers=md.int("block_count"),
        d_model=md.int("embedding_length"),
        n_heads=n_heads,
        n_kv_heads=md.int("attention.head_count_kv", default=n_heads),
        d_ff=md.int("feed_forward_length"),
        context_length=md.int("context_length"),
        vocab_size=md.vocab_size,
        rope_theta=md.positive_float("rope.freq_base", default=10000.0),
        rms_eps=md.positive_float("attention.layer_norm_rms_epsilon", default=1e-6),
        tied_output=md.tied,
    )


def head_dim_field(md) -> dict:
    """head_dim from attention.key_length when the file states one (it must equal value_length)."""
    k = md.int("attention.key_length", default=0)
    v = md.int("attention.value_length", default=k)
    if k and v != k:
        raise UnsupportedError(
            f"{md.path}: attention.key_length {k} != attention.value_length {v} is not supported"
        )
    return {"head_dim": k} if k else {}


def rope_scaling_fields(md, yarn: bool = False) -> dict:
    """Linear RoPE scaling (`rope.scaling.type` = linear, `rope.scaling.factor`), and YaRN
    (`yarn`, with `rope.scaling.original_context_length`) where the family applies it (yarn);
    other kinds refused."""
    kind = md.str("rope.scaling.type", default="none")
    factor = md.positive_float("rope.scaling.factor", default=1.0)
    if kind == "none" or factor == 1.0:
        return {}
    if kind == "yarn" and yarn:
        orig = md.int("rope.scaling.original_context_length", default=0)
        if orig <= 0 or factor < 1.0:
            raise UnsupportedError(
                f"{md.path}: YaRN RoPE scaling needs a factor > 1 and "
                f"rope.scaling.original_context_length (got {factor}, {orig})"
            )
        return {"yarn_factor": factor, "yarn_orig_ctx": orig}
    if kind != "linear":
        known = "'linear', 'yarn'" if yarn else "'linear'"
        raise UnsupportedError(f"{md.path}: RoPE scaling {kind!r} is not supported (only {known})")
    return {"rope_scale": 1.0 / factor}


def check_full_rotary(md, cfg: Config) -> None:
    """RoPE over the whole head (rope.dimension_count = head_dim); partial rotary is not
    supported."""
    n = md.int("rope.dimension_count", default=cfg.head_dim)
    if n != cfg.head_dim:
        raise UnsupportedError(
            f"{md.path}: RoPE over {n} of {cfg.head_dim} head dimensions is not supported"
        )


def moe_shapes(cfg: Config, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's mixture-of-experts tensors (numpy order): the router, the three expert tensors
    [E, out, in] and, with cfg.d_ff_shared, Qwen2-MoE's gated shared expert."""
    d, e, ff, sh = cfg.d_model, cfg.n_experts, cfg.d_ff_expert, cfg.d_ff_shared
    p = f"blk.{i}."
    shapes = {
        p + "ffn_gate_inp.weight": (e, d),
        p + "ffn_gate_exps.weight": (e, ff, d),
        p + "ffn_up_exps.weight": (e, ff, d),
        p + "ffn_down_exps.weight": (e, d, ff),
    }
    if sh:
        shapes.update(
            {
                p + "ffn_gate_inp_shexp.weight": (d,),
                p + "ffn_gate_shexp.weight": (sh, d),
                p + "ffn_up_shexp.weight": (sh, d),
                p + "ffn_down_shexp.weight": (d, sh),
            }
        )
    return shapes


def moe_fields(
    md, *, weights_norm: bool, expert_ff: int, shared_ff: int = 0, gating: str = "softmax"
) -> dict:
    """The mixture-of-experts Config fields from `{arch}.expert_count` / `expert_used_count`
    (expert_ff, shared_ff: the family's widths, read by it with its own fallbacks); {} for a file
    without experts. Routing (gating, weights_norm) is fixed per architecture, as in llama.cpp,
    which reads none of the expert_gating_func / expert_weights_norm keys for these families."""
    n = md.int("expert_count", default=0)
    if n <= 0:
        return {}
    return dict(
        n_experts=n,
        n_experts_used=md.int("expert_used_count", default=0),
        d_ff_expert=expert_ff,
        d_ff_shared=shared_ff,
        expert_weights_norm=weights_norm,
        expert_gating=gating,
    )
