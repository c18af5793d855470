"""Tensor parallelism: the weights and the KV cache split over a 1-D device mesh (axis "tp").

Megatron-style split (docs/ARCHITECTURE.md, "Tensor parallelism"), decided here as data:
- q/k/v and gate/up split by output rows: shard s holds its own heads' q/k/v rows (fused groups
  re-stacked per shard, so [q_s; k_s; v_s] stays one weight) and its slice of d_ff;
- o and down split along their input K, then one all-reduce (psum) each; a shard's K slice is
  a window of whole GGUF blocks: the ff split falls on block boundaries (shards padded with zero
  rows/blocks to one width), o's window covers the blocks its heads touch (activations placed at
  their offset in a zero vector; a straddling block is held by both neighbours);
- KV heads (and the cache) split by head; when TP exceeds the KV heads each shard holds a copy of
  the one KV head its query heads read;
- the output head split by vocabulary: greedy argmax per shard, then (max, index) pairs combined;
- mixture of experts: every shard holds every expert, each expert's width split as the dense
  FFN's (gate/up experts by rows, down experts by a K window, the shared expert likewise) and the
  router whole, so the routing runs on each shard unchanged and one all-reduce adds the layer's
  partial outputs. Splitting the expert axis instead would leave a shard idle whenever no token
  of a step picked its experts (decode picks k of E per token) and need the routing exchanged.
Every Params leaf is stored as the shards' local arrays concatenated along axis 0 (replicated
ones as TP copies), so one PartitionSpec P("tp") splits the whole tree; each shard's layer runs
the unchanged model code (model/decoder.py and the family module, with a local Config) inside
shard_map, the Pallas kernels on local planes through the one ops.route.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from minfer_jax import ops
from minfer_jax.engine import sampling
from minfer_jax.errors import MinferError
from minfer_jax.files.gguf import RawTensor
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.weights import LoadOptions, Params, load_params
from minfer_jax.quant.planes import get_format
from minfer_jax.sizes import round_up

AXIS = "tp"
PARAMS_SPEC = P(AXIS)  # every Params leaf: shards concatenated along axis 0
CACHE_SPEC = P(None, AXIS)  # [n_slots, heads, max_len, head_dim]: split by KV head
REPLICATED = P()


class ShardingError(MinferError, ValueError):
    """A tensor-parallel degree the devices or the model's head counts do not allow."""


def make_mesh(degree: int, devices=None) -> Mesh:
    """A 1-D mesh over the first `degree` devices (all processes' devices under jax.distributed)."""
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= len(devices):
        raise ShardingError(
            f"tensor_parallel must be an integer in 1..{len(devices)} (devices), got {degree!r}"
        )
    return Mesh(np.asarray(devices[:degree]), (AXIS,))


@dataclasses.dataclass(frozen=True)
class Split:
    """Which rows / K window of every matrix shard s holds (pure data, from config + formats)."""

    degree: int
    heads: int  # query heads per shard
    kv_heads: int  # KV heads per shard (1 copy each when degree > n_kv_heads)
    kv_first: tuple[int, ...]  # first KV head of each shard
    ff_ranges: tuple[tuple[int, int], ...]  # d_ff rows [a, b) each shard owns (block-aligned)
    ff_width: int  # local d_ff: the widest shard's rows, in whole down blocks
    o_starts: tuple[int, ...]  # first K column of each shard's o window (block-aligned)
    o_width: int  # o's local K
    o_offsets: tuple[int, ...]  # where the shard's attention output sits inside its o window
    vocab_local: int  # head rows per shard (the last padded with zero rows)
    # mixture of experts: each expert's rows [a, b) per shard and the local expert width (as
    # ff_ranges / ff_width), and the same for the shared expert (Qwen2-MoE); () / 0 without
    expert_ranges: tuple[tuple[int, int], ...] = ()
    expert_width: int = 0
    shared_ranges: tuple[tuple[int, int], ...] = ()
    shared_width: int = 0


def _blocks_of(model: GGUFModel, role: str) -> int:
    """The widest GGUF block along K of one role over all layers (1 for float formats; 1 where
    the model has no such tensor)."""
    names = (f"blk.{i}.{role}.weight" for i in range(model.config.n_layers))
    return max(
        (get_format(model.tensors[n].qtype).block for n in names if n in model.tensors), default=1
    )


def split_of(model: GGUFModel, degree: int) -> Split:
    """The split of a GGUF's matrices (block widths from its ffn_down / attn_output formats)."""
    return plan_split(
        model.config,
        degree,
        o_block=_blocks_of(model, "attn_output"),
        ff_block=_blocks_of(model, "ffn_down"),
        expert_block=_blocks_of(model, "ffn_down_exps"),
        shared_block=_blocks_of(model, "ffn_down_shexp"),
    )


def _width_split(width: int, block: int, n: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """Rows [a, b) of a width split over n shards in whole blocks, and the widest shard's rows."""
    nb = width // block
    counts = [nb // n + (s < nb % n) for s in range(n)]  # whole down blocks per shard
    starts = np.cumsum([0] + counts)
    ranges = tuple((int(starts[s]) * block, int(starts[s + 1]) * block) for s in range(n))
    return ranges, max(counts) * block


def plan_split(
    cfg: Config,
    degree: int,
    *,
    o_block: int,
    ff_block: int,
    expert_block: int = 1,
    shared_block: int = 1,
) -> Split:
    """Shard rows and K windows for `degree` shards; K splits fall on o_block / ff_block weights
    (expert_block / shared_block: a mixture of experts' down experts / shared down)."""
    n = degree
    if cfg.recurrent_layers:  # the DeltaNet layers' heads and state are not split (yet)
        raise ShardingError(f"tensor_parallel is not supported for the hybrid family {cfg.family}")
    if n > 1 and cfg.family == "gpt-oss":  # its per-head sinks and o bias are not split here
        raise ShardingError("tensor parallelism does not support gpt-oss models yet")
    if n > 1 and cfg.family == "gemma4":  # per-layer head shapes and embeddings are not split
        raise ShardingError("tensor parallelism does not support gemma4 models yet")
    if cfg.n_heads % n:
        raise ShardingError(
            f"tensor_parallel {n} does not divide the model's {cfg.n_heads} query heads"
        )
    if cfg.n_kv_heads % n and n % cfg.n_kv_heads:
        raise ShardingError(
            f"tensor_parallel {n} and the model's {cfg.n_kv_heads} KV heads: one must divide the "
            "other"
        )
    heads, hd = cfg.n_heads // n, cfg.head_dim
    kv_heads = max(1, cfg.n_kv_heads // n)
    kv_first = tuple(
        s * kv_heads if cfg.n_kv_heads >= n else s * cfg.n_kv_heads // n for s in range(n)
    )
    ff_ranges, ff_width = _width_split(cfg.d_ff, ff_block, n) if not cfg.n_experts else ((), 0)
    expert_ranges, expert_width = (
        _width_split(cfg.d_ff_expert, expert_block, n) if cfg.n_experts else ((), 0)
    )
    shared_ranges, shared_width = (
        _width_split(cfg.d_ff_shared, shared_block, n) if cfg.d_ff_shared else ((), 0)
    )
    ob = o_block
    owned = [(s * heads * hd, (s + 1) * heads * hd) for s in range(n)]
    o_starts = tuple(a // ob * ob for a, _ in owned)
    o_width = max(round_up(b, ob) - w for (_, b), w in zip(owned, o_starts))
    return Split(
        degree=n,
        heads=heads,
        kv_heads=kv_heads,
        kv_first=kv_first,
        ff_ranges=ff_ranges,
        ff_width=ff_width,
        o_starts=o_starts,
        o_width=o_width,
        o_offsets=tuple(a - w for (a, _), w in zip(owned, o_starts)),
        vocab_local=-(-cfg.vocab_size // n),
        expert_ranges=expert_ranges,
        expert_width=expert_width,
        shared_ranges=shared_ranges,
        shared_width=shared_width,
    )


def local_config(cfg: Config, split: Split) -> Config:
    """The Config one shard's layer math runs with: its heads, KV heads and d_ff slice (d_model, the
    residual width, stays whole; the shard's q width is its q_dim, heads x head_dim)."""
    return dataclasses.replace(
        cfg,
        n_heads=split.heads,
        n_kv_heads=split.kv_heads,
        d_ff=split.ff_width or cfg.d_ff,
        tied_output=False,
        d_ff_expert=split.expert_width,
        d_ff_shared=split.shared_width,
    )


# -- raw GGUF tensors cut per shard (before any repacking: whole rows and whole blocks) ---------
def _rows(t: RawTensor, a: int, b: int, n_out: int) -> RawTensor:
    """Rows [a, b) of t, zero rows appended up to n_out (zero bytes decode to zero in every
    format)."""
    data = np.asarray(t.data)[a:b]
    pad = np.zeros((n_out - (b - a), *data.shape[1:]), data.dtype)
    return RawTensor(t.name, t.qtype, (n_out, *t.shape[1:]), np.concatenate([data, pad]))


def _k_window(t: RawTensor, k0: int, width: int) -> RawTensor:
    """Columns [k0, k0 + width) of a [n, K] matrix (block-aligned), zero blocks past K."""
    data = np.ascontiguousarray(t.data)
    rows, k = t.shape
    as_bytes = data.view(np.uint8).reshape(rows, -1)
    per_weight = as_bytes.shape[1] / k  # bytes per weight, averaged over a block
    lo, hi = int(k0 * per_weight), int((k0 + width) * per_weight)
    padded = np.pad(as_bytes, ((0, 0), (0, max(0, hi - as_bytes.shape[1]))))
    window = np.ascontiguousarray(padded[:, lo:hi]).view(data.dtype)
    return RawTensor(t.name, t.qtype, (rows, width), window)


def _per_expert(cut, t: RawTensor, *args) -> RawTensor:
    """cut (_rows or _k_window) applied to each expert of an [E, n, k] tensor."""
    e = t.shape[0]
    data = np.asarray(t.data)
    parts = [cut(RawTensor(t.name, t.qtype, t.shape[1:], data[i]), *args) for i in range(e)]
    return RawTensor(t.name, t.qtype, (e, *parts[0].shape), np.stack([p.data for p in parts]))


def _moe_tensors(t: dict[str, RawTensor], p: str, split: Split, s: int) -> dict[str, RawTensor]:
    """Layer prefix p's mixture-of-experts tensors for shard s: the router (and the shared
    expert's gate vector) whole, every expert's slice of its width, the shared expert's slice."""
    out = {p + "ffn_gate_inp.weight": t[p + "ffn_gate_inp.weight"]}
    ea, eb = split.expert_ranges[s]
    for r in ("ffn_gate_exps", "ffn_up_exps"):
        out[f"{p}{r}.weight"] = _per_expert(_rows, t[f"{p}{r}.weight"], ea, eb, split.expert_width)
    down = t[p + "ffn_down_exps.weight"]
    out[p + "ffn_down_exps.weight"] = _per_expert(_k_window, down, ea, split.expert_width)
    if split.shared_ranges:
        sa, sb = split.shared_ranges[s]
        out[p + "ffn_gate_inp_shexp.weight"] = t[p + "ffn_gate_inp_shexp.weight"]
        for r in ("ffn_gate_shexp", "ffn_up_shexp"):
            out[f"{p}{r}.weight"] = _rows(t[f"{p}{r}.weight"], sa, sb, split.shared_width)
        shared_down = t[p + "ffn_down_shexp.weight"]
        out[p + "ffn_down_shexp.weight"] = _k_window(shared_down, sa, split.shared_width)
    return out


_REPLICATED_LAYER_VECTORS = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "post_attention_norm.weight",
    "post_ffw_norm.weight",
)


def shard_tensors(model: GGUFModel, split: Split, s: int) -> dict[str, RawTensor]:
    """Shard s's tensors under the GGUF names, so load_params builds its Params unchanged."""
    cfg, hd, t = model.config, model.config.head_dim, model.tensors
    out: dict[str, RawTensor] = {
        n: t[n] for n in ("token_embd.weight", "output_norm.weight", "rope_freqs.weight") if n in t
    }
    head = t["token_embd.weight" if cfg.tied_output else "output.weight"]
    va, vb = s * split.vocab_local, min((s + 1) * split.vocab_local, cfg.vocab_size)
    out["output.weight"] = dataclasses.replace(
        _rows(head, va, vb, split.vocab_local), name="output.weight"
    )
    qa, kva = s * split.heads * hd, split.kv_first[s] * hd
    qn, kvn = split.heads * hd, split.kv_heads * hd
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        for (
            name
        ) in _REPLICATED_LAYER_VECTORS:  # norms (per-head q/k norms: the same [hd] on every shard)
            if p + name in t:
                out[p + name] = t[p + name]
        for part in ("weight", "bias"):
            if f"{p}attn_q.{part}" not in t:  # no q/k/v biases outside Qwen2
                continue
            out[f"{p}attn_q.{part}"] = _rows(t[f"{p}attn_q.{part}"], qa, qa + qn, qn)
            for r in ("attn_k", "attn_v"):
                out[f"{p}{r}.{part}"] = _rows(t[f"{p}{r}.{part}"], kva, kva + kvn, kvn)
        out[p + "attn_output.weight"] = _k_window(
            t[p + "attn_output.weight"], split.o_starts[s], split.o_width
        )
        if cfg.n_experts:
            out.update(_moe_tensors(t, p, split, s))
            continue
        fa, fb = split.ff_ranges[s]
        for r in ("ffn_gate", "ffn_up"):
            out[f"{p}{r}.weight"] = _rows(t[f"{p}{r}.weight"], fa, fb, split.ff_width)
        out[p + "ffn_down.weight"] = _k_window(t[p + "ffn_down.weight"], fa, split.ff_width)
    return out


def _assemble(mesh: Mesh, *leaves: jax.Array) -> jax.Array:
    """One global array from each local shard's leaf (on its device), concatenated along axis 0."""
    shape = (leaves[0].shape[0] * mesh.devices.size, *leaves[0].shape[1:])
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, PARAMS_SPEC), list(leaves)
    )


def shard_params(
    model: GGUFModel, split: Split, mesh: Mesh, opts: LoadOptions = LoadOptions()
) -> Params:
    """Params whose leaves are split over the mesh (static shapes: one shard's), built shard by
    shard on the shard's own device (this process's devices only: the multi-host path)."""
    local_cfg = local_config(model.config, split)
    shards = [
        load_params(
            dataclasses.replace(model, config=local_cfg, tensors=shard_tensors(model, split, s)),
            opts,
            device=dev,
        )
        for s, dev in enumerate(mesh.devices.flat)
        if dev.process_index == jax.process_index()
    ]
    return jax.tree.map(functools.partial(_assemble, mesh), *shards)


# -- the in-shard hooks (model/layers.py / steps.py `par`) and the shard_map wrappers --------------
@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Static (hashable) description of a split model; its methods run inside shard_map."""

    mesh: Mesh
    split: Split
    config: Config  # the whole model's
    local: Config  # one shard's (local_config)

    @property
    def degree(self) -> int:
        return self.split.degree

    def row_matmul(self, which: str, x: jax.Array, w, impl: ops.Impl) -> jax.Array:
        """o / down on this shard's K slice, then the all-reduce of the partial products."""
        if which == "attn_out" and (self.split.o_width != x.shape[-1] or any(self.split.o_offsets)):
            off = jnp.asarray(self.split.o_offsets, jnp.int32)[jax.lax.axis_index(AXIS)]
            zeros = jnp.zeros((*x.shape[:-1], self.split.o_width), x.dtype)
            x = jax.lax.dynamic_update_slice_in_dim(zeros, x, off, axis=x.ndim - 1)
        return jax.lax.psum(ops.matmul(x, w, impl), AXIS)

    def all_reduce(self, x: jax.Array) -> jax.Array:
        """The shards' partial outputs added up (a mixture of experts' layer output)."""
        return jax.lax.psum(x, AXIS)

    def _vocab_ids(self) -> jax.Array:
        return jax.lax.axis_index(AXIS) * self.split.vocab_local + jnp.arange(
            self.split.vocab_local
        )

    def full_logits(self, local: jax.Array) -> jax.Array:
        """[..., vocab / TP] per shard -> [..., vocab] (the padding rows dropped)."""
        return jax.lax.all_gather(local, AXIS, axis=local.ndim - 1, tiled=True)[
            ..., : self.config.vocab_size
        ]

    def sample_rows(
        self, local: jax.Array, positions, rows, history, mode: sampling.SamplerMode
    ) -> jax.Array:
        """Greedy batches: argmax per shard, then the TP (max, index) pairs; else over gathered
        logits."""
        if mode.sampled or mode.penalty:
            return sampling.sample_rows(self.full_logits(local), positions, rows, history, mode)
        ids = self._vocab_ids()
        allowed = (ids < self.config.vocab_size)[None, :] & sampling.allowed_bits(rows.mask, ids)
        masked = jnp.where(allowed, local.astype(jnp.float32), -jnp.inf)  # [B, Vl]
        best = jnp.max(masked, axis=-1)  # [B]
        where = ids[jnp.argmax(masked, axis=-1)]
        all_best = jax.lax.all_gather(best, AXIS)  # [TP, B]: the first shard holding the max wins,
        all_where = jax.lax.all_gather(where, AXIS)  # as jnp.argmax's first maximum does
        return jnp.take_along_axis(all_where, jnp.argmax(all_best, axis=0)[None], axis=0)[0].astype(
            jnp.int32
        )

    # -- the cache --------------------------------------------------------------------------
    def cache_shape(self, n_slots: int, max_len: int) -> tuple[int, int, int, int]:
        return (n_slots, self.degree * self.split.kv_heads, max_len, self.config.head_dim)

    def cache_spec(self, n_slots: int, max_len: int, dtype) -> KVCache:
        spec = jax.ShapeDtypeStruct(
            self.cache_shape(n_slots, max_len),
            jnp.dtype(dtype),
            sharding=NamedSharding(self.mesh, CACHE_SPEC),
        )
        # abstract (for lowering), typed as the arrays it stands for
        specs = cast(tuple[jax.Array, ...], (spec,) * self.config.n_layers)
        return KVCache(k=specs, v=specs)

    def init_cache(self, n_slots: int, max_len: int, dtype=jnp.float32) -> KVCache:
        zeros = jax.jit(
            lambda: jnp.zeros(self.cache_shape(n_slots, max_len), dtype),
            out_shardings=NamedSharding(self.mesh, CACHE_SPEC),
        )
        return KVCache(
            k=tuple(zeros() for _ in range(self.config.n_layers)),
            v=tuple(zeros() for _ in range(self.config.n_layers)),
        )

    # -- engine step functions over the mesh --------------------------------------------------
    def shard_step(self, fn, kind: str):
        """engine.prefill_chunk / decode_chunk / prompt_logits / verify_chunk (cfg, impl, mode
        bound) over the mesh."""
        r, c = REPLICATED, CACHE_SPEC
        in_specs, out_specs = {
            "prefill": ((PARAMS_SPEC, c, r, r, r, r, r, r, r), (r, r, c)),
            "decode": ((PARAMS_SPEC, c, r, r, r, r), (r, r, c)),
            "logits": ((PARAMS_SPEC, c, r, r, r), (r, c)),
            "verify": ((PARAMS_SPEC, c, r, r, r, r, r, r), (r, r, r, c)),
        }[kind]
        return jax.shard_map(
            functools.partial(fn, par=self),
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,
        )  # pallas_call has no replication rule


def tensor_parallel(model: GGUFModel, degree: int, devices=None) -> TensorParallel:
    split = split_of(model, degree)
    return TensorParallel(
        make_mesh(degree, devices), split, model.config, local_config(model.config, split)
    )
