"""Gemma 4 text models (Gemma-4-31B, Gemma-4-26B-A4B, E2B / E4B): `general.architecture = gemma4`.

llama.cpp's models/gemma4.cpp. The input rows are token_embd[tok] . sqrt(d). Layer il:
  q = rope(rms(Wq h) . q_norm), k = rope(rms(Wk h) . k_norm), v = rms(Wv h) (no weight; a layer
  without attn_v takes V = Wk h, before k_norm), h = rms(x) . attn_norm, attention scale 1;
  x += rms(Wo attn) . post_attention_norm;
  x += rms(ffn) . post_ffw_norm, ffn = GeGLU(rms(x) . ffn_norm) (tanh GELU), or with experts
  rms(GeGLU(..)) . post_ffw_norm_1 + rms(experts(rms(x) . pre_ffw_norm_2)) . post_ffw_norm_2,
  the router reading rms(x) / sqrt(d) . ffn_gate_inp.scale, softmax, top-k renormalised, each
  expert's output times ffn_down_exps.scale[e];
  with per-layer embeddings x += rms(proj (gelu(inp_gate x) * e_il)) . post_norm;
  x *= layer_output_scale where the file has it.
Sliding-window layers (attention.sliding_window_pattern) have their own head dim, KV heads and
RoPE base (rope.freq_base_swa, default 1e4); the full layers rotate with rope_freqs.weight, whose
1e30 entries leave all but the first pairs unrotated ("proportional" RoPE). The last
attention.shared_kv_layers layers compute q only and attend to the cache of the last cached layer
of their kind (Config.kv_source). The logits are c tanh(l / c), c = final_logit_softcapping
(absent: 30, as llama.cpp). The files hold text weights only: vision and audio towers come in a
separate mmproj file, which is not read (and no input of those kinds is supported).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minfer_jax import ops, residual
from minfer_jax.errors import UnsupportedError
from minfer_jax.model import layers, moe, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import GEMMA4_MOE_NORMS, Layer, Params
from minfer_jax.quant.matrix import embed_rows

ARCHITECTURE = "gemma4"
MODELS = "Gemma 4 text models (31B, 26B-A4B, E2B / E4B)"

DEFAULT_SOFTCAP = 30.0  # llama.cpp's f_final_logit_softcapping when the key is absent
SWA_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa default


def _per_layer(md, key: str, n: int, default=None) -> tuple[int, ...]:
    """An int key that may hold one value or one per layer (llama.cpp's get_key_or_arr)."""
    v = md.meta.get(f"{md.arch}.{key}", default)
    values = list(v) if isinstance(v, list) else [md.int(key, default)] * n
    if len(values) != n or min(values) <= 0:
        raise UnsupportedError(f"{md.path}: {md.arch}.{key} holds {values!r:.80} for {n} layers")
    return tuple(int(x) for x in values)


def _by_kind(md, key: str, values: tuple[int, ...], swa: tuple[bool, ...]) -> tuple[int, int]:
    """(full layers' value, sliding layers' value) of a per-layer key, one value per kind."""
    full = {v for v, s in zip(values, swa) if not s} or {values[0]}
    local = {v for v, s in zip(values, swa) if s} or full
    if len(full) > 1 or len(local) > 1:
        raise UnsupportedError(f"{md.path}: {md.arch}.{key} varies within a kind of layer")
    return full.pop(), local.pop()


def _head_dims(md) -> tuple[int, int]:
    """(full, sliding) head dims; K and V must match and RoPE must cover the whole head."""
    full, swa = md.int("attention.key_length"), md.int("attention.key_length_swa")
    if (
        md.int("attention.value_length", full) != full
        or md.int("attention.value_length_swa", swa) != swa
    ):
        raise UnsupportedError(f"{md.path}: gemma4 needs key_length == value_length (llama.cpp)")
    rot, rot_swa = md.int("rope.dimension_count", full), md.int("rope.dimension_count_swa", swa)
    if (rot, rot_swa) != (full, swa):
        raise UnsupportedError(
            f"{md.path}: RoPE over {rot} / {rot_swa} of the {full} / {swa} head dimensions "
            "(full / sliding) is not supported"
        )
    return full, swa


def _experts(md, names: frozenset[str], n_layers: int) -> dict:
    """The experts' Config fields: every layer with ffn_gate_inp, or none."""
    with_router = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(n_layers)]
    n_experts = md.int("expert_count", default=0)
    if not any(with_router) and n_experts <= 0:
        return {}
    if not all(with_router) or n_experts <= 0:
        raise UnsupportedError(
            f"{md.path}: experts on {sum(with_router)} of {n_layers} layers (expert_count "
            f"{n_experts}): only all or none is supported"
        )
    fields = schema.moe_fields(
        md, weights_norm=True, expert_ff=md.int("expert_feed_forward_length")
    )
    fused = "blk.0.ffn_gate_up_exps.weight" in names
    return {**fields, "expert_act": "gelu_tanh", "expert_gate_up_fused": fused}


def config_from_metadata(md) -> Config:
    names = md.tensor_names
    n_layers = md.int("block_count")
    swa = tuple(bool(s) for s in md.list("attention.sliding_window_pattern"))
    if len(swa) != n_layers:
        raise UnsupportedError(f"{md.path}: sliding_window_pattern has {len(swa)} entries")
    if "blk.0.attn_qkv.weight" in names:
        raise UnsupportedError(f"{md.path}: a fused attn_qkv tensor is not supported")
    full_hd, swa_hd = _head_dims(md)
    n_heads = md.int("attention.head_count")
    kv_full, kv_swa = _by_kind(
        md, "head_count_kv", _per_layer(md, "attention.head_count_kv", n_layers, n_heads), swa
    )
    ff = _per_layer(md, "feed_forward_length", n_layers)
    shared = md.int("attention.shared_kv_layers", default=0)
    cfg = Config(
        n_layers=n_layers,
        d_model=md.int("embedding_length"),
        n_heads=n_heads,
        n_kv_heads=kv_full,
        d_ff=ff[0],
        context_length=md.int("context_length"),
        vocab_size=md.vocab_size,
        rope_theta=md.positive_float("rope.freq_base", default=10000.0),
        rms_eps=md.positive_float("attention.layer_norm_rms_epsilon"),
        tied_output=md.tied,
        family=ARCHITECTURE,
        head_dim=full_hd,
        rope_freq_factors=not all(swa),
        attn_scale=1.0,
        sliding_window=md.int("attention.sliding_window"),
        rope_theta_local=md.positive_float("rope.freq_base_swa", default=SWA_ROPE_THETA),
        swa_layers=swa,
        head_dim_swa=swa_hd,
        n_kv_heads_swa=kv_swa,
        shared_kv_layers=shared,
        layer_d_ff=ff if len(set(ff)) > 1 else (),
        v_from_k=tuple(
            f"blk.{i}.attn_v.weight" not in names and i < n_layers - shared for i in range(n_layers)
        ),
        per_layer_dim=md.int("embedding_length_per_layer_input"),
        final_softcap=md.float("final_logit_softcapping", default=DEFAULT_SOFTCAP),
        layer_out_scale="blk.0.layer_output_scale.weight" in names,
        **schema.rope_scaling_fields(md),
        **_experts(md, names, n_layers),
    )
    if not cfg.sliding_window:
        raise UnsupportedError(f"{md.path}: gemma4 file with attention.sliding_window 0")
    return cfg


def _attention_shapes(cfg: Config, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's attention tensors: q always; k, its norm and v where the layer has its own cache
    (v absent: K = V)."""
    d, hd, p = cfg.d_model, cfg.layer_head_dim(i), f"blk.{i}."
    kv = cfg.layer_kv_heads(i) * hd
    shapes = {
        p + "attn_norm.weight": (d,),
        p + "attn_q.weight": (cfg.n_heads * hd, d),
        p + "attn_q_norm.weight": (hd,),
        p + "attn_output.weight": (d, cfg.n_heads * hd),
        p + "post_attention_norm.weight": (d,),
    }
    if cfg.kv_source(i) == i:
        shapes.update({p + "attn_k.weight": (kv, d), p + "attn_k_norm.weight": (hd,)})
        if not cfg.v_from_k[i]:
            shapes[p + "attn_v.weight"] = (kv, d)
    return shapes


def _ffn_shapes(cfg: Config, i: int) -> dict[str, tuple[int, ...]]:
    """The dense GeGLU (always), the experts beside it, the per-layer embedding block, the scale."""
    d, ff, p = cfg.d_model, cfg.layer_ff(i), f"blk.{i}."
    shapes = {
        p + "ffn_norm.weight": (d,),
        p + "ffn_gate.weight": (ff, d),
        p + "ffn_up.weight": (ff, d),
        p + "ffn_down.weight": (d, ff),
        p + "post_ffw_norm.weight": (d,),
    }
    if cfg.n_experts:
        e, fe = cfg.n_experts, cfg.d_ff_expert
        shapes.update({f"{p}{n}.weight": (d,) for n in GEMMA4_MOE_NORMS})
        shapes.update({p + "ffn_gate_inp.weight": (e, d), p + "ffn_gate_inp.scale": (d,)})
        if cfg.expert_gate_up_fused:
            shapes[p + "ffn_gate_up_exps.weight"] = (e, 2 * fe, d)
        else:
            shapes.update({f"{p}ffn_{r}_exps.weight": (e, fe, d) for r in ("gate", "up")})
        shapes.update({p + "ffn_down_exps.weight": (e, d, fe), p + "ffn_down_exps.scale": (e,)})
    if cfg.per_layer_dim:
        n = cfg.per_layer_dim
        shapes.update(
            {p + "inp_gate.weight": (n, d), p + "proj.weight": (d, n), p + "post_norm.weight": (d,)}
        )
    if cfg.layer_out_scale:
        shapes[p + "layer_output_scale.weight"] = (1,)
    return shapes


def tensor_shapes(cfg: Config):
    d, n = cfg.d_model, cfg.per_layer_dim
    yield "token_embd.weight", (cfg.vocab_size, d)
    yield "output_norm.weight", (d,)
    if not cfg.tied_output:
        yield "output.weight", (cfg.vocab_size, d)
    if cfg.rope_freq_factors:  # one tensor for every full layer
        yield "rope_freqs.weight", (cfg.head_dim // 2,)
    if n:
        yield "per_layer_token_embd.weight", (cfg.vocab_size, cfg.n_layers * n)
        yield "per_layer_model_proj.weight", (cfg.n_layers * n, d)
        yield "per_layer_proj_norm.weight", (n,)
    for i in range(cfg.n_layers):
        yield from _attention_shapes(cfg, i).items()
        yield from _ffn_shapes(cfg, i).items()


def embed(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    return layers.embed(params, tokens, cfg) * math.sqrt(cfg.d_model)


def per_layer_inputs(
    params: Params, tokens: jax.Array, x: jax.Array, cfg: Config, impl: ops.Impl
) -> jax.Array | None:
    """Each layer's per-layer embedding input [L, T, n_pl] (None without them): (rms(proj x /
    sqrt(d)) . per_layer_proj_norm + per_layer_token_embd[tok] sqrt(n_pl)) / sqrt(2), x the scaled
    input rows."""
    n, n_layers = cfg.per_layer_dim, cfg.n_layers
    if not n:
        return None
    assert params.per_layer_embed is not None and params.per_layer_proj is not None
    t = tokens.shape[0]
    token_part = embed_rows(params.per_layer_embed, tokens).reshape(t, n_layers, n) * math.sqrt(n)
    proj = ops.matmul(x, params.per_layer_proj, impl) * (1.0 / math.sqrt(cfg.d_model))
    proj = ops.rms_norm(proj.reshape(t, n_layers, n), params.per_layer_norm, cfg.rms_eps)
    return jnp.swapaxes((proj + token_part) * (1.0 / math.sqrt(2.0)), 0, 1)


def _rope(x: jax.Array, i: int, call: layers.LayerCall) -> jax.Array:
    """NeoX RoPE with the layer kind's base; full layers divide by rope_freqs ("proportional")."""
    cfg = call.cfg
    factors = None if cfg.is_local(i) else call.rope_freqs
    return layers.rope_neox(
        x, call.positions, cfg.layer_rope_theta(i), factors, cfg.layer_rope_scale(i)
    )


def attention(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> jax.Array:
    """The layer's attention of rms(x) . attn_norm -> [T, H hd]; a shared-KV layer hands the
    decoder q only (its source layer's cache holds K / V)."""
    cfg, eps = call.cfg, call.cfg.rms_eps
    t, hd, n_kv = x.rows.shape[0], cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
    out = jnp.concatenate(residual.norm_matmuls(x, layer.attn_norm, eps, layer.qkv, call.impl), -1)
    qd = cfg.n_heads * hd
    q = _rope(ops.rms_norm(out[:, :qd].reshape(t, cfg.n_heads, hd), layer.q_norm, eps), i, call)
    if cfg.kv_source(i) != i:
        return call.attend(q, None, None)
    k = out[:, qd : qd + n_kv * hd].reshape(t, n_kv, hd)
    v = k if cfg.v_from_k[i] else out[:, qd + n_kv * hd :].reshape(t, n_kv, hd)
    k = _rope(ops.rms_norm(k, layer.k_norm, eps), i, call)
    return call.attend(q, k, ops.rms_norm(v, jnp.float32(1.0), eps))


def geglu(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> jax.Array:
    """down(gelu_tanh(gate h) * up h), h = rms(x) . ffn_norm: the dense MLP of the layer's width
    [T, d]."""
    act = layers.gated_act(x, layer, call, "gelu_tanh", d_ff=call.cfg.layer_ff(i))
    return ops.matmul(act, layer.w_down, call.impl)


def experts(x: jax.Array, layer: Layer, call: layers.LayerCall) -> jax.Array:
    """The expert branch [T, d] (before its post norm): router on rms(x) / sqrt(d) . scale, GeGLU
    experts on rms(x) . pre_ffw_norm_2, each output times its expert's scale."""
    cfg, impl, ex = call.cfg, call.impl, layer.moe
    assert ex is not None and ex.router_scale is not None and ex.down_scale is not None
    router_in = ops.rms_norm(x, ex.router_scale / math.sqrt(cfg.d_model), cfg.rms_eps)
    ids, weights = moe.route_tokens(ops.matmul(router_in, ex.router, impl), cfg)
    h = ops.rms_norm(x, layer.moe_norms[0], cfg.rms_eps)
    act = ops.expert_glu(h, ex.gate, ex.up, ids, cfg.expert_act, impl)  # [T, k, F]
    return ops.expert_down_sum(act, ex.down, ids, weights * ex.down_scale[ids], impl)


def ffn(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> jax.Array:
    """The FFN's output before post_ffw_norm: the dense MLP, or it and the experts, each normed."""
    assert layer.ffn_norm is not None
    mlp = geglu(x, layer, i, call)
    if layer.moe is None:
        return mlp
    eps, (_, post_mlp, post_experts) = call.cfg.rms_eps, layer.moe_norms
    mixed = ops.rms_norm(experts(x.rows, layer, call), post_experts, eps)
    return ops.rms_norm(mlp, post_mlp, eps) + mixed


def per_layer_embedding(x: jax.Array, layer: Layer, call: layers.LayerCall) -> jax.Array:
    """rms(proj (gelu_tanh(inp_gate x) * e_il)) . post_norm [T, d], added to the residual."""
    ple = layer.per_layer
    assert ple is not None and call.layer_input is not None
    gated = layers.gelu_tanh(ops.matmul(x, ple.gate, call.impl)) * call.layer_input
    return ops.rms_norm(ops.matmul(gated, ple.proj, call.impl), ple.post_norm, call.cfg.rms_eps)


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    # each product is normed before its add: no add epilogue (its gated activation takes one)
    eps = call.cfg.rms_eps
    att = ops.matmul(attention(x, layer, i, call), layer.wo, call.impl)
    h = x + ops.rms_norm(att, layer.post_attn_norm, eps)
    h = h + ops.rms_norm(ffn(h, layer, i, call), layer.post_ffn_norm, eps)
    if layer.per_layer is not None:
        h = h + per_layer_embedding(h.rows, layer, call)
    return h if layer.out_scale is None else h * layer.out_scale
