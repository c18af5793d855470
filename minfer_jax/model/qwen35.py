"""Qwen3.5 / 3.6 dense models (Qwen3.6-27B): `general.architecture = qwen35`, a hybrid.

llama.cpp's models/qwen35.cpp: x += mixer(rms(x) . attn_norm); x += SwiGLU(rms(x) .
post_attention_norm) (the file's name for the pre-FFN norm, Layer.post_attn_norm here). The mixer of
three of every four layers (`attention.recurrent_layers`, else layer i is DeltaNet unless (i + 1) %
full_attention_interval == 0) is Gated DeltaNet (model/deltanet.py, its state carried by the
decoder); the others are gated full attention: attn_q's rows are per head [q_h | gate_h], q and k
get per-head RMSNorms, then NeoX RoPE on the first rope.dimension_count dims of each head (text
IMRoPE: every section takes the token's position), GQA with scale head_dim^-0.5, and
out = attn_output . (attn * sigmoid(gate)). The file appends nextn_predict_layers MTP blocks after
the trunk (`blk.{n_layers}.*`): they load (for speculative decoding) but never run here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax import ops, residual
from minfer_jax.errors import UnsupportedError
from minfer_jax.model import layers, schema
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Layer

ARCHITECTURE = "qwen35"
MODELS = "Qwen3.5 / 3.6 dense models"
FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default

embed = layers.embed


def _recurrent_layers(md, n_all: int, n_trunk: int) -> tuple[bool, ...]:
    flags = md.list("attention.recurrent_layers", default=[])
    if not flags:
        every = md.int("full_attention_interval", default=FULL_ATTENTION_INTERVAL)
        if every < 1:
            raise UnsupportedError(f"{md.path}: full_attention_interval {every} < 1")
        return tuple((i + 1) % every != 0 for i in range(n_trunk))
    if len(flags) != n_all:
        raise UnsupportedError(
            f"{md.path}: attention.recurrent_layers has {len(flags)} entries for {n_all} blocks"
        )
    return tuple(bool(f) for f in flags[:n_trunk])


def _check_rope_sections(md, rope_dims: int) -> None:
    """Text IMRoPE is plain partial RoPE when every pair takes a t / h / w section (all hold the
    token's position; the fourth, position 0, would leave a pair unrotated): ggml-cpu's imrope
    rule, pair i in sector s = i % sum(sections) takes section s % 3 while s < 3 x its size."""
    sections = [int(x) for x in md.list("rope.dimension_sections", default=[0, 0, 0, 0])]
    total = sum(sections)
    if len(sections) != 4 or min(sections) < 0 or total <= 0:
        raise UnsupportedError(f"{md.path}: rope.dimension_sections {sections} (want 4 sizes)")
    for pair in range(rope_dims // 2):
        s = pair % total
        if s >= 3 * sections[s % 3]:
            raise UnsupportedError(
                f"{md.path}: rope.dimension_sections {sections} leave RoPE pair {pair} of "
                f"{rope_dims // 2} on the fourth section (not supported for text)"
            )


def config_from_metadata(
    md, family: str = ARCHITECTURE, d_ff_default: int | None = None, **moe_fields
) -> Config:
    """The Config of a qwen35 file, or (family, moe_fields) of a qwen35moe one: qwen35's layers
    with a mixture-of-experts FFN, whose feed_forward_length may be absent (d_ff_default)."""
    fields = {**schema.common_fields(md, d_ff_default), **schema.head_dim_field(md)}
    n_all, mtp = fields["n_layers"], md.int("nextn_predict_layers", default=0)
    if not 0 <= mtp < n_all:
        raise UnsupportedError(f"{md.path}: nextn_predict_layers {mtp} of {n_all} blocks")
    fields["n_layers"] = n_all - mtp
    state, groups, v_heads = (
        md.int("ssm.state_size"),
        md.int("ssm.group_count"),
        md.int("ssm.time_step_rank"),
    )
    if md.int("ssm.inner_size") != v_heads * state:
        raise UnsupportedError(f"{md.path}: ssm.inner_size is not time_step_rank x state_size")
    rope_dims = md.int("rope.dimension_count")
    _check_rope_sections(md, rope_dims)
    cfg = Config(
        family=family,
        rope_dims=rope_dims,
        recurrent_layers=_recurrent_layers(md, n_all, fields["n_layers"]),
        ssm_conv_kernel=md.int("ssm.conv_kernel"),
        ssm_state=state,
        ssm_groups=groups,
        ssm_v_heads=v_heads,
        mtp_layers=mtp,
        **fields,
        **moe_fields,
    )
    if state & (state - 1) or state < 16:
        raise UnsupportedError(f"{md.path}: ssm.state_size {state} is not a power of two >= 16")
    return cfg


def layer_shapes(cfg: Config, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's tensors: the norms, DeltaNet's or gated attention's own, then the FFN (dense, or
    with cfg.n_experts qwen35moe's experts and shared expert)."""
    d, ff, hd, p = cfg.d_model, cfg.d_ff, cfg.head_dim, f"blk.{i}."
    shapes = {p + "attn_norm.weight": (d,), p + "post_attention_norm.weight": (d,)}
    if cfg.is_recurrent(i):
        n_v, vd = cfg.ssm_v_heads, cfg.ssm_v_heads * cfg.ssm_state
        shapes.update(
            {
                p + "attn_qkv.weight": (cfg.ssm_conv_dim, d),
                p + "attn_gate.weight": (vd, d),
                p + "ssm_beta.weight": (n_v, d),
                p + "ssm_alpha.weight": (n_v, d),
                p + "ssm_dt.bias": (n_v,),
                p + "ssm_a": (n_v,),
                p + "ssm_conv1d.weight": (cfg.ssm_conv_dim, cfg.ssm_conv_kernel),
                p + "ssm_norm.weight": (cfg.ssm_state,),
                p + "ssm_out.weight": (d, vd),
            }
        )
    else:
        shapes.update(
            {
                p + "attn_q.weight": (2 * cfg.q_dim, d),
                p + "attn_k.weight": (cfg.kv_dim, d),
                p + "attn_v.weight": (cfg.kv_dim, d),
                p + "attn_q_norm.weight": (hd,),
                p + "attn_k_norm.weight": (hd,),
                p + "attn_output.weight": (d, cfg.q_dim),
            }
        )
    if cfg.n_experts:  # qwen35moe
        shapes.update(schema.moe_shapes(cfg, i))
        return shapes
    shapes.update(
        {
            p + "ffn_gate.weight": (ff, d),
            p + "ffn_up.weight": (ff, d),
            p + "ffn_down.weight": (d, ff),
        }
    )
    return shapes


def mtp_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The MTP block after the trunk (blk.{n_layers}): a gated-attention block (with the trunk's
    FFN kind) plus nextn.* (llama.cpp models/qwen35.cpp load_block_mtp); the optional
    nextn.embed_tokens / shared_head_head are not listed (model/mtp.py takes them where present)."""
    d, i = cfg.d_model, cfg.n_layers
    attention = dataclasses.replace(cfg, recurrent_layers=(), mtp_layers=0)
    shapes = {n.replace("blk.0.", f"blk.{i}."): s for n, s in layer_shapes(attention, 0).items()}
    p = f"blk.{i}.nextn."
    shapes.update(
        {
            p + "eh_proj.weight": (d, 2 * d),
            p + "enorm.weight": (d,),
            p + "hnorm.weight": (d,),
            p + "shared_head_norm.weight": (d,),
        }
    )
    return shapes


def tensor_shapes(cfg: Config):
    yield from schema.global_shapes(cfg)
    for i in range(cfg.n_layers):
        yield from layer_shapes(cfg, i).items()


def _rope_partial(x: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """NeoX RoPE on the first rope_dims of each head (frequencies of rope_dims), the rest as is."""
    n = cfg.rope_dims or cfg.head_dim
    rotated = layers.rope_neox(x[..., :n], positions, cfg.rope_theta)
    return jnp.concatenate([rotated, x[..., n:]], axis=-1)


def _gated_attention(x: residual.Stream, layer: Layer, call: layers.LayerCall) -> jax.Array:
    """rms(x) . attn_norm through q (+ gate), k, v -> attention * sigmoid(gate) [T, H hd]."""
    cfg, eps = call.cfg, call.cfg.rms_eps  # q / k norms, gate, partial RoPE: XLA's q / k / v
    t, qd, kv, hd = x.rows.shape[0], cfg.q_dim, cfg.kv_dim, cfg.head_dim
    out = jnp.concatenate(
        residual.norm_matmuls(x, layer.attn_norm, eps, layer.qkv, call.impl), axis=-1
    )
    q_gate = out[:, : 2 * qd].reshape(t, cfg.n_heads, 2 * hd)
    q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(t, qd)
    k = out[:, 2 * qd : 2 * qd + kv].reshape(t, cfg.n_kv_heads, hd)
    v = out[:, 2 * qd + kv :].reshape(t, cfg.n_kv_heads, hd)
    q, k = ops.rms_norm(q, layer.q_norm, eps), ops.rms_norm(k, layer.k_norm, eps)  # per head
    q, k = _rope_partial(q, call.positions, cfg), _rope_partial(k, call.positions, cfg)
    return call.attend(q, k, v) * jax.nn.sigmoid(gate)


def add_mixer(x: residual.Stream, layer: Layer, call: layers.LayerCall) -> residual.Stream:
    """x + the layer's mixer of rms(x) . attn_norm: Gated DeltaNet (its state through the
    decoder's call.recur) or gated attention. qwen35moe's layers are this, then their MoE FFN."""
    cfg, mixer = call.cfg, layer.mixer
    if mixer is None:
        att = _gated_attention(x, layer, call)
        return residual.add_product(x, att, layer.wo, "attn_out", call.impl)
    proj = jnp.concatenate(
        residual.norm_matmuls(x, layer.attn_norm, cfg.rms_eps, mixer.proj, call.impl), axis=-1
    )
    return residual.add_product(x, call.recur(proj, mixer), mixer.out, "attn_out", call.impl)


def block(x: residual.Stream, layer: Layer, i: int, call: layers.LayerCall) -> residual.Stream:
    x = add_mixer(x, layer, call)
    ffn_in = layers.gated_act(x, layer, call, norm=layer.post_attn_norm)  # the pre-FFN norm
    return residual.add_product(x, ffn_in, layer.w_down, "ffn_out", call.impl)
