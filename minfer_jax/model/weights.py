"""Weight pytrees and loading: GGUF tensors -> device arrays, quantized (GPU) or dense (CPU).

Two storage modes, chosen per platform by `minfer_jax.load`:
- "quantized": every matrix stays in its GGUF format, repacked once into planes
  (quant.planes); the Pallas kernels read the planes directly. Device memory ~= file size.
- "dense": matrices are dequantized once at load (bit-exact f32, quant.ggml). On a 2-core CPU
  XLA's dense dot beats any per-call dequantization by far, and its speed depends on dtype and
  orientation (docs/ARCHITECTURE.md has the table): square and narrowing matrices are stored f32
  as [K, N] (x @ W at ~45 GB/s; bf16 runs at 1-9 GB/s there), widening ones (N >= 2K: gate, up,
  the vocab head and the embedding) bf16 as [N, K] (~28 GB/s of bf16, half the bytes of f32).
  This is what makes CPU generation usable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.gguf import GGUFModel, QType, RawTensor
from minfer_jax.model.config import Config
from minfer_jax.quant import ggml
from minfer_jax.quant.planes import get_format, repack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
    """A [n, k] matrix in its quantized device layout: planes [Npad, k / wpc] (quant.planes)."""

    planes: dict[str, jax.Array]
    qtype: QType = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.planes.values()))

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantized rows ids [...] -> [..., k] f32 (embedding lookup without a dense table)."""
        from minfer_jax.quant.planes import decode

        flat = ids.reshape(-1)
        vals = decode(self.qtype, {n: p[flat] for n, p in self.planes.items()}, jnp.float32)
        return vals.reshape(*ids.shape, self.shape[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A dequantized [n, k] matrix, stored as [n, k] (transposed=False) or [k, n] (transposed=True)."""

    w: jax.Array
    transposed: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(reversed(self.w.shape)) if self.transposed else tuple(self.w.shape)

    @property
    def nbytes(self) -> int:
        return int(self.w.size * self.w.dtype.itemsize)


Weight = QWeight | DenseWeight


def embed_rows(w: Weight, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table as f32: ids [...] -> [..., d]."""
    if isinstance(w, QWeight):
        return w.rows(ids)
    if w.transposed:
        raise ValueError("embedding tables are stored [vocab, d]")
    return w.w[ids].astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    attn_norm: jax.Array  # [d] f32
    wq: Weight  # [d, d]
    bq: jax.Array  # [d]
    wk: Weight  # [kv, d]
    bk: jax.Array  # [kv]
    wv: Weight  # [kv, d]
    bv: jax.Array  # [kv]
    wo: Weight  # [d, d]
    ffn_norm: jax.Array  # [d]
    w_gate: Weight  # [ff, d]
    w_up: Weight  # [ff, d]
    w_down: Weight  # [d, ff]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Weight  # token_embd [vocab, d]
    layers: list[Layer]
    out_norm: jax.Array  # [d]
    output: Weight | None  # [vocab, d]; None: tied to embed

    @property
    def head(self) -> Weight:
        return self.embed if self.output is None else self.output


def params_nbytes(p: Params) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(p)))


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    mode: str = "quantized"  # "quantized" | "dense"
    dense_dtype: str = "float32"  # dense square/narrowing matrices, stored [K, N]
    wide_dtype: str = "float32"  # dense widening matrices (N >= 2K) and token_embd, stored [N, K]


def _vector(t: RawTensor) -> np.ndarray:
    return np.asarray(ggml.dequantize(t.data, t.qtype, t.shape), np.float32)


def _matrix(t: RawTensor, opts: LoadOptions, device) -> Weight:
    if opts.mode == "dense":
        w = ggml.dequantize(t.data, t.qtype, t.shape)  # [n, k] f32, bit-exact
        n, k = t.shape
        if t.name == "token_embd.weight" or n >= 2 * k:
            return DenseWeight(jax.device_put(w.astype(jnp.dtype(opts.wide_dtype)), device), transposed=False)
        return DenseWeight(jax.device_put(w.T.astype(jnp.dtype(opts.dense_dtype)), device), transposed=True)
    planes = repack(t.data, t.qtype, t.shape)
    get_format(t.qtype)  # raises UnsupportedError for a type without a device layout
    return QWeight({n: jax.device_put(v, device) for n, v in planes.items()}, QType(t.qtype), tuple(t.shape))


def tensor_names(cfg: Config) -> list[str]:
    names = ["token_embd.weight"]
    for i in range(cfg.n_layers):
        names += [f"blk.{i}.{n}" for n in (
            "attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
            "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
            "ffn_down.weight")]
    names += ["output_norm.weight"] + ([] if cfg.tied_output else ["output.weight"])
    return names


def load_params(model: GGUFModel, opts: LoadOptions = LoadOptions(), *, device=None,
                progress: Callable[[Iterable], Iterable] | None = None) -> Params:
    """Build Params from a validated GGUF, tensor by tensor (peak host memory: one tensor)."""
    if opts.mode not in ("quantized", "dense"):
        raise ValueError(f"LoadOptions.mode must be 'quantized' or 'dense', got {opts.mode!r}")
    cfg = model.config
    device = device or jax.devices()[0]
    names = tensor_names(cfg)
    it = progress(names) if progress else names
    loaded: dict[str, object] = {}
    for name in it:
        t = model.tensors[name]
        loaded[name] = jax.device_put(_vector(t), device) if len(t.shape) == 1 else _matrix(t, opts, device)
    layers = []
    for i in range(cfg.n_layers):
        g = lambda n: loaded[f"blk.{i}.{n}"]  # noqa: E731
        layers.append(Layer(
            attn_norm=g("attn_norm.weight"), wq=g("attn_q.weight"), bq=g("attn_q.bias"),
            wk=g("attn_k.weight"), bk=g("attn_k.bias"), wv=g("attn_v.weight"), bv=g("attn_v.bias"),
            wo=g("attn_output.weight"), ffn_norm=g("ffn_norm.weight"), w_gate=g("ffn_gate.weight"),
            w_up=g("ffn_up.weight"), w_down=g("ffn_down.weight")))
    return Params(embed=loaded["token_embd.weight"], layers=layers, out_norm=loaded["output_norm.weight"],
                  output=None if cfg.tied_output else loaded["output.weight"])
