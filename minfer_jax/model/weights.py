"""Weight pytrees and loading: GGUF tensors -> device arrays, quantized (GPU), int8 (CPU) or dense.

Three storage modes, chosen per platform by `minfer_jax.load`:
- "quantized": every matrix stays in its GGUF format, repacked once into planes
  (quant.planes); the Pallas kernels read the planes directly. Device memory ~= file size.
- "int8" (the CPU's default): block-format matrices as int8 integers with a scale (and offset)
  per group (about 1.1-1.25 bytes per weight), bit-exact values that XLA's CPU dot decodes inside
  a one-row dot; the layer matrices also keep the dense f32 copy below for prefill (quant/
  int8_form.py decides, and says why).
- "dense": matrices are dequantized once at load (bit-exact f32, planes.dequantize). On a 2-core CPU
  XLA's dense dot beats any per-call dequantization by far, and its speed depends on dtype and
  orientation (docs/ARCHITECTURE.md has the table): square and narrowing matrices are stored
  [K, N], widening ones (N >= 2K: gate/up, the vocab head, the embedding) [N, K], both f32 by
  default (bf16 halves the bytes but ran slower inside the decode loop). The reference the int8
  form is checked against (`load(weights="dense")`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.files.gguf import QType, RawTensor
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.quant.int8_form import int8_weight, keeps_dense, takes_int8
from minfer_jax.quant.matrix import DenseWeight, QWeight, Weight
from minfer_jax.quant.planes import dequantize, repack

LOAD_THREADS = min(8, os.cpu_count() or 1)  # tensors repacked / dequantized at once


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNet:
    """One Gated DeltaNet layer's own weights (model/deltanet.py; its norms and FFN are the
    Layer's)."""

    # attn_qkv, attn_gate, ssm_beta, ssm_alpha (rows conv_dim | Hv dv | Hv | Hv), as one weight or
    # runs of one format (fused_runs); their outputs concatenated in that order
    proj: tuple
    dt_bias: jax.Array  # [Hv] ssm_dt.bias
    a: jax.Array  # [Hv] ssm_a = -exp(A_log)
    conv: jax.Array  # [conv_dim, K] f32 ssm_conv1d
    norm: jax.Array  # [dv] ssm_norm, one weight for every head
    out: Weight | None  # [d, Hv dv] ssm_out


DELTANET_PROJ_ROLES = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture-of-experts feed-forward's weights (model/moe.py): the router and the expert
    tensors (experts = E each), and the shared expert where the family has one (Qwen2-MoE)."""

    router: Weight  # ffn_gate_inp [E, d]
    gate: Weight  # ffn_gate_exps: E x [ff_exp, d]
    up: Weight  # ffn_up_exps: E x [ff_exp, d]
    down: Weight  # ffn_down_exps: E x [d, ff_exp]
    shared_gate_inp: jax.Array | None = None  # [d] ffn_gate_inp_shexp: the shared expert's gate
    shared_gate_up: tuple = ()  # ffn_gate_shexp / ffn_up_shexp, fused as Layer.gate_up
    shared_down: Weight | None = None  # ffn_down_shexp [d, ff_shexp]
    # gpt-oss's biases (f32): the router's [E] and each expert's [E, ff_exp] / [E, d]
    router_bias: jax.Array | None = None
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None
    # gemma4: the router input's per-channel scale [d] (ffn_gate_inp.scale) and each expert's
    # output scale [E] (ffn_down_exps.scale)
    router_scale: jax.Array | None = None
    down_scale: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerLayerInput:
    """gemma4's per-layer embedding block of one layer (model/gemma4.py)."""

    gate: Weight  # inp_gate [n_pl, d]
    proj: Weight  # proj [d, n_pl]
    post_norm: jax.Array  # post_norm [d]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """One decoder layer. Neighbouring projections that share a format are stored fused (one
    matmul launch; `fused_runs`): qkv holds [wq; wk; wv] as one [d + 2 kv, d] weight, or e.g.
    [wq; wk] and wv when v has another format, or the three apart; gate_up [wgate; wup] as one
    [2 ff, d] weight or the two apart. Their outputs, concatenated in order, are q | k | v."""

    attn_norm: jax.Array  # [d] f32
    # (w_qkv,), (w_qk, wv), (wq, w_kv) or (wq [qd, d], wk [kv, d], wv [kv, d]); () in a DeltaNet
    # layer
    qkv: tuple
    qkv_bias: jax.Array | None  # [qd + 2 kv] (Qwen2); None: no biases
    wo: Weight | None  # [d, qd]; None in a DeltaNet layer
    ffn_norm: jax.Array | None  # [d]; None where the family has none (gpt-oss, qwen35)
    gate_up: tuple = ()  # (w_gate_up,) or (w_gate [ff, d], w_up [ff, d]); () in a MoE layer
    w_down: Weight | None = None  # [d, ff]; None in a MoE layer
    q_norm: jax.Array | None = None  # [hd] per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: jax.Array | None = None
    post_attn_norm: jax.Array | None = None  # [d] RMSNorm of the attention / FFN output (Gemma 3)
    post_ffn_norm: jax.Array | None = None
    moe: Experts | None = None  # the mixture-of-experts FFN in place of gate_up / w_down
    wo_bias: jax.Array | None = None  # [d] attn_output.bias (gpt-oss)
    sinks: jax.Array | None = None  # [H] attn_sinks.weight: per-head sink logits (gpt-oss)
    mixer: DeltaNet | None = None  # a Gated DeltaNet layer's weights instead of attention (qwen35)
    # gemma4: the per-layer embedding block, the layer's output scale [1], and beside the experts
    # the norms pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2 (or ())
    per_layer: PerLayerInput | None = None
    out_scale: jax.Array | None = None
    moe_norms: tuple = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Weight  # token_embd [vocab, d]
    layers: list[Layer]
    out_norm: jax.Array  # [d]
    output: Weight | None  # [vocab, d]; None: tied to embed
    # [hd / 2] RoPE frequency divisors (Llama 3.1+ rope_freqs.weight)
    rope_freqs: jax.Array | None = None
    # gemma4's per-layer embeddings: per_layer_token_embd [vocab, L n_pl], per_layer_model_proj
    # [L n_pl, d], per_layer_proj_norm [n_pl]
    per_layer_embed: Weight | None = None
    per_layer_proj: Weight | None = None
    per_layer_norm: jax.Array | None = None
    # the MTP block (model/mtp.MtpParams), loaded for draft-mtp speculation (load(mtp=True))
    mtp: Any = None

    @property
    def head(self) -> Weight:
        return self.embed if self.output is None else self.output


def params_nbytes(p: Params) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(p)))


WEIGHT_MODES = ("quantized", "int8", "dense")


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    mode: str = "quantized"  # one of WEIGHT_MODES
    dense_dtype: str = "float32"  # dense square/narrowing matrices, stored [K, N]
    wide_dtype: str = "float32"  # dense widening matrices (N >= 2K) and token_embd, stored [N, K]
    fuse: bool = True  # neighbouring q/k/v and gate/up projections of one format as one weight


def _vector(t: RawTensor) -> np.ndarray:
    return np.asarray(dequantize(t.data, t.qtype, t.shape), np.float32)


def _matrix(tensors: list[RawTensor], opts: LoadOptions, device) -> Weight:
    """One weight from one tensor, or several tensors of one format stacked along the rows."""
    t = tensors[0]
    rows = sum(x.shape[0] for x in tensors)
    shape = (rows, t.shape[1])
    if opts.mode == "int8" and all(takes_int8(x.name, x.qtype) for x in tensors):
        dense = _dense(tensors, opts, device) if keeps_dense(t.name) else None
        return int8_weight(tensors, device, dense)
    if opts.mode != "quantized":  # "dense", and in "int8" the matrices int8_form leaves dense
        return _dense(tensors, opts, device)
    raw = np.concatenate([np.asarray(x.data) for x in tensors]) if len(tensors) > 1 else t.data
    planes = repack(raw, t.qtype, shape)
    return QWeight({n: jax.device_put(v, device) for n, v in planes.items()}, QType(t.qtype), shape)


def _dense(tensors: list[RawTensor], opts: LoadOptions, device) -> DenseWeight:
    """Tensors stacked along the rows, dequantized (bit-exact f32), in opts' dtype and layout."""
    t = tensors[0]
    w = jnp.concatenate([dequantize(x.data, x.qtype, x.shape) for x in tensors])  # [n, k] f32
    if t.name in EMBEDDING_TABLES or w.shape[0] >= 2 * t.shape[1]:
        return DenseWeight(
            jax.device_put(w.astype(jnp.dtype(opts.wide_dtype)), device), transposed=False
        )
    return DenseWeight(
        jax.device_put(w.T.astype(jnp.dtype(opts.dense_dtype)), device), transposed=True
    )


EMBEDDING_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")  # stored [vocab, d]


def _packed_table(t: RawTensor, device) -> QWeight:
    """A table only ever gathered from (gemma4's per_layer_token_embd: vocab x L n_pl, 262144 x
    10752 on E4B) kept in its file format in every mode: only the gathered rows are decoded
    (embed_rows), where a dense f32 copy would be 11 GB."""
    planes = {n: jax.device_put(v, device) for n, v in repack(t.data, t.qtype, t.shape).items()}
    return QWeight(planes, QType(t.qtype), (t.shape[0], t.shape[1]))


def expert_halves(t: RawTensor) -> tuple[RawTensor, RawTensor]:
    """A fused ffn_gate_up_exps [E, 2 ff, k] as its gate and up halves (each expert's rows
    [gate | up]; a quantized row is whole blocks of its own, so the halves are byte slices)."""
    e, n2, k = t.shape
    data = np.asarray(t.data).reshape(e, n2, -1)
    half = n2 // 2
    return tuple(  # type: ignore[return-value]
        RawTensor(t.name, t.qtype, (e, half, k), np.ascontiguousarray(part).reshape(e * half, -1))
        for part in (data[:, :half], data[:, half:])
    )


def _expert_matrix(t: RawTensor, opts: LoadOptions, device) -> Weight:
    """An expert tensor (numpy shape [E, n, k]) as one weight with a leading expert axis: dense
    [E, n, k], or each expert repacked and every plane stacked ([E, Npad, k / wpc])."""
    e, n, k = t.shape
    if opts.mode != "quantized":  # expert tensors stay dense f32 in "int8" too
        w = dequantize(t.data, t.qtype, (e * n, k)).reshape(e, n, k)  # bit-exact f32
        w = w.astype(jnp.dtype(opts.dense_dtype))
        return DenseWeight(jax.device_put(w, device), transposed=False, experts=e)
    raw = np.asarray(t.data).reshape(e, n, -1)
    per_expert = [repack(raw[i], t.qtype, (n, k)) for i in range(e)]
    planes = {name: np.stack([p[name] for p in per_expert]) for name in per_expert[0]}
    return QWeight(
        {name: jax.device_put(v, device) for name, v in planes.items()},
        QType(t.qtype),
        (n, k),
        experts=e,
    )


def load_experts(model: GGUFModel, layer: int, opts: LoadOptions, device) -> Experts | None:
    """Layer `layer`'s mixture-of-experts weights, or None where the file has no experts there."""
    t, p = model.tensors, f"blk.{layer}."
    if p + "ffn_gate_inp.weight" not in t:
        return None
    shared = p + "ffn_gate_inp_shexp.weight"

    def bias(role):  # gpt-oss: ffn_gate_inp.bias [E], ffn_*_exps.bias [E, width]
        name = f"{p}{role}.bias"
        return jax.device_put(_vector(t[name]), device) if name in t else None

    def scale(role):  # gemma4: ffn_gate_inp.scale [d], ffn_down_exps.scale [E]
        name = f"{p}{role}.scale"
        return jax.device_put(_vector(t[name]), device) if name in t else None

    fused = p + "ffn_gate_up_exps.weight"
    gate, up = (
        expert_halves(t[fused])
        if fused in t
        else (t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"])
    )
    return Experts(
        router=_matrix([t[p + "ffn_gate_inp.weight"]], opts, device),
        gate=_expert_matrix(gate, opts, device),
        up=_expert_matrix(up, opts, device),
        down=_expert_matrix(t[p + "ffn_down_exps.weight"], opts, device),
        shared_gate_inp=jax.device_put(_vector(t[shared]), device) if shared in t else None,
        shared_gate_up=(
            _group(model, [f"{p}{r}_shexp.weight" for r in GATE_UP_ROLES], opts, device)
            if shared in t
            else ()
        ),
        shared_down=(
            _matrix([t[p + "ffn_down_shexp.weight"]], opts, device) if shared in t else None
        ),
        router_bias=bias("ffn_gate_inp"),
        gate_bias=bias("ffn_gate_exps"),
        up_bias=bias("ffn_up_exps"),
        down_bias=bias("ffn_down_exps"),
        router_scale=scale("ffn_gate_inp"),
        down_scale=scale("ffn_down_exps"),
    )


def fused_runs(qtypes: Sequence, *, fuse: bool = True, dense: bool = False) -> list[list[int]]:
    """Which of a row-stacked group's tensors (q, k, v or gate, up, in order) become one weight:
    runs of neighbours that share a format (all of them for dense weights, none without `fuse`).
    Q4_K / Q4_K / Q6_K -> [[0, 1], [2]]: two matmul launches instead of three."""
    if not fuse:
        return [[i] for i in range(len(qtypes))]
    if dense:
        return [list(range(len(qtypes)))]
    runs: list[list[int]] = []
    for i, q in enumerate(qtypes):
        if runs and qtypes[runs[-1][-1]] == q:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


# A layer's row-stacked groups (Layer.qkv, Layer.gate_up), in output order, and its lone matrices.
QKV_ROLES = ("attn_q", "attn_k", "attn_v")
GATE_UP_ROLES = ("ffn_gate", "ffn_up")
_LAYER_MATMULS = (QKV_ROLES, ("attn_output",), GATE_UP_ROLES, ("ffn_down",))
# gemma4's norms beside its experts, in Layer.moe_norms' order
GEMMA4_MOE_NORMS = ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")


@dataclasses.dataclass(frozen=True)
class LayerMatmul:
    """One weight of a layer as load_params stores it: one matmul launch."""

    names: tuple[str, ...]  # GGUF tensors stacked along the rows, in order
    qtype: QType
    n: int  # out: the members' rows added up
    k: int  # in
    role: str  # the members' roles joined by "+", e.g. "attn_q+attn_k"


def layer_matmuls(
    qtypes: Mapping[str, QType],
    shapes: Mapping[str, Sequence[int]],
    layer: int,
    *,
    fuse: bool = True,
    dense: bool = False,
) -> list[LayerMatmul]:
    """The matmuls of layer `layer` as loaded (q/k/v and gate/up fused as `fused_runs` says), from
    tensor types and shapes alone, in the order a token meets them (ops.matmul's: a mixture of
    experts' router and expert tensors are not among them)."""
    out = []
    for all_roles in _LAYER_MATMULS:
        # a mixture-of-experts layer has no dense FFN; a gemma4 layer may lack attn_v (K = V)
        # or, sharing an earlier layer's cache, attn_k too
        roles = tuple(r for r in all_roles if f"blk.{layer}.{r}.weight" in qtypes)
        names = [f"blk.{layer}.{r}.weight" for r in roles]
        if not names:
            continue
        for run in fused_runs([qtypes[n] for n in names], fuse=fuse, dense=dense):
            members = tuple(names[i] for i in run)
            out.append(
                LayerMatmul(
                    members,
                    QType(qtypes[members[0]]),
                    sum(int(shapes[n][0]) for n in members),
                    int(shapes[members[0]][1]),
                    "+".join(roles[i] for i in run),
                )
            )
    return out


def _group(model: GGUFModel, names: list[str], opts: LoadOptions, device) -> tuple:
    """The weights of a row-stacked group, fused as `fused_runs` says."""
    ts = [model.tensors[n] for n in names]
    runs = fused_runs([t.qtype for t in ts], fuse=opts.fuse, dense=opts.mode != "quantized")
    return tuple(_matrix([ts[i] for i in run], opts, device) for run in runs)


def _deltanet(model: GGUFModel, p: str, opts: LoadOptions, device) -> DeltaNet:
    """The Gated DeltaNet weights of the layer whose tensors start with p."""
    t = model.tensors
    return DeltaNet(
        proj=_group(model, [f"{p}{r}.weight" for r in DELTANET_PROJ_ROLES], opts, device),
        dt_bias=jax.device_put(_vector(t[p + "ssm_dt.bias"]), device),
        a=jax.device_put(_vector(t[p + "ssm_a"]), device),
        conv=jax.device_put(_vector(t[p + "ssm_conv1d.weight"]), device),
        norm=jax.device_put(_vector(t[p + "ssm_norm.weight"]), device),
        out=_matrix([t[p + "ssm_out.weight"]], opts, device),
    )


def _per_layer_input(model: GGUFModel, p: str, opts: LoadOptions, device) -> PerLayerInput | None:
    """gemma4's per-layer embedding block of the layer whose tensors start with p, or None."""
    t = model.tensors
    if p + "inp_gate.weight" not in t:
        return None
    return PerLayerInput(
        gate=_matrix([t[p + "inp_gate.weight"]], opts, device),
        proj=_matrix([t[p + "proj.weight"]], opts, device),
        post_norm=jax.device_put(_vector(t[p + "post_norm.weight"]), device),
    )


def load_params(
    model: GGUFModel,
    opts: LoadOptions = LoadOptions(),
    *,
    device=None,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> Params:
    """Build Params from a validated GGUF, layer by layer (peak host memory: one layer)."""
    if opts.mode not in WEIGHT_MODES:
        raise ValueError(f"LoadOptions.mode must be one of {WEIGHT_MODES}, got {opts.mode!r}")
    cfg = model.config
    device = device or jax.devices()[0]
    t = model.tensors

    def vec(name):
        return jax.device_put(_vector(t[name]), device)

    def optional_vec(name):  # a tensor only some families have (load_gguf keeps only the family's)
        return vec(name) if name in t else None

    def optional_matrix(name):
        return _matrix([t[name]], opts, device) if name in t else None

    def layer(i):
        return load_layer(model, i, opts, device)

    # Repacking is numpy work that releases the GIL: layers in parallel (a 7B's 4.4 GB took minutes
    # on one core); at most a few layers' host copies live at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        embed = pool.submit(_matrix, [t["token_embd.weight"]], opts, device)
        output = (
            None if cfg.tied_output else pool.submit(_matrix, [t["output.weight"]], opts, device)
        )
        layers = pool.map(layer, range(cfg.n_layers))
        layers = list(progress(layers) if progress else layers)
        return Params(
            embed=embed.result(),
            layers=layers,
            out_norm=vec("output_norm.weight"),
            output=None if output is None else output.result(),
            rope_freqs=optional_vec("rope_freqs.weight"),
            per_layer_embed=(
                _packed_table(t["per_layer_token_embd.weight"], device)
                if "per_layer_token_embd.weight" in t
                else None
            ),
            per_layer_proj=optional_matrix("per_layer_model_proj.weight"),
            per_layer_norm=optional_vec("per_layer_proj_norm.weight"),
        )


def load_layer(model: GGUFModel, i: int, opts: LoadOptions, device) -> Layer:
    """Layer i's weights (blk.{i}.*): also an MTP block after the trunk (model/mtp.py)."""
    t, p = model.tensors, f"blk.{i}."

    def vec(name):
        return jax.device_put(_vector(t[name]), device)

    def optional_vec(name):  # a tensor only some families have (load_gguf keeps only the family's)
        return vec(name) if name in t else None

    def biases(p):
        names = [f"{p}{r}.bias" for r in QKV_ROLES]
        return jnp.concatenate([vec(n) for n in names]) if names[0] in t else None

    recurrent = p + "ssm_a" in t
    dense_ffn = p + "ffn_down.weight" in t
    moe_norms = [f"{p}{n}.weight" for n in GEMMA4_MOE_NORMS]
    return Layer(
        attn_norm=vec(p + "attn_norm.weight"),
        qkv=()
        if recurrent
        else _group(
            model, [f"{p}{r}.weight" for r in QKV_ROLES if f"{p}{r}.weight" in t], opts, device
        ),  # fmt: skip
        qkv_bias=biases(p),
        wo=None if recurrent else _matrix([t[p + "attn_output.weight"]], opts, device),
        ffn_norm=optional_vec(p + "ffn_norm.weight"),
        gate_up=(
            _group(model, [f"{p}{r}.weight" for r in GATE_UP_ROLES], opts, device)
            if dense_ffn
            else ()
        ),
        w_down=_matrix([t[p + "ffn_down.weight"]], opts, device) if dense_ffn else None,
        q_norm=optional_vec(p + "attn_q_norm.weight"),
        k_norm=optional_vec(p + "attn_k_norm.weight"),
        post_attn_norm=optional_vec(p + "post_attention_norm.weight"),
        post_ffn_norm=optional_vec(p + "post_ffw_norm.weight"),
        moe=load_experts(model, i, opts, device),
        wo_bias=optional_vec(p + "attn_output.bias"),
        sinks=optional_vec(p + "attn_sinks.weight"),
        mixer=_deltanet(model, p, opts, device) if recurrent else None,
        per_layer=_per_layer_input(model, p, opts, device),
        out_scale=optional_vec(p + "layer_output_scale.weight"),
        moe_norms=tuple(vec(n) for n in moe_norms) if moe_norms[0] in t else (),
    )


def load_matrix(model: GGUFModel, name: str, opts: LoadOptions, device) -> Weight:
    """One named matrix of the file as load_params stores it."""
    return _matrix([model.tensors[name]], opts, device)


def load_vector(model: GGUFModel, name: str, device) -> jax.Array:
    """One named norm or bias of the file, f32 on the device."""
    return jax.device_put(_vector(model.tensors[name]), device)
