"""Small synthetic Qwen3.5 / 3.6 (`qwen35`) models for the parity tests: F32 weights whose gates and
decays are in the ranges a trained model's are (ssm_a = -exp(N(0, 1)), so some heads forget within
a few tokens and others hold on past a 64-token chunk), and the MTP block the converter appends.

`QWEN35_TINY` names the variants (v heads 2x and 3x the q/k heads, tied and untied output, with and
without an MTP block; `qwen35moe` with experts and the shared expert, also with Q8_0 experts:
"qwen35moe-tiny:q8_0-experts"); `qwen35_model(name, seed)` builds one in memory (a GGUFModel: the
trunk's tensors as load_gguf would return them, the MTP block's too, which load_gguf leaves out),
and synthetic.write_gguf writes it (its metadata: synthetic._hybrid_metadata).
"""

from __future__ import annotations

import zlib

import numpy as np
from gguf.quants import quantize

from minfer_jax.files.gguf import QType, RawTensor
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import expected_shapes
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.qwen35 import mtp_shapes

from minfer_bench.synthetic import _metadata

_EPS = float(np.float32(1e-6))
_TINY = dict(
    family="qwen35",
    n_layers=4,  # DeltaNet, DeltaNet, DeltaNet, gated attention
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    d_ff=512,
    context_length=2048,
    vocab_size=320,
    rope_theta=10000000.0,
    rms_eps=_EPS,
    head_dim=64,
    rope_dims=16,  # a quarter of the head, as Qwen3.6's 64 of 256
    recurrent_layers=(True, True, True, False),
    ssm_conv_kernel=4,
    ssm_state=32,
    ssm_groups=2,
)
# qwen35moe: 8 experts, 2 used, and the shared expert (Qwen3.6-35B-A3B: 256, 8, one shared)
_MOE = dict(
    family="qwen35moe",
    n_experts=8,
    n_experts_used=2,
    d_ff_expert=128,
    d_ff_shared=256,
    expert_weights_norm=True,
)
QWEN35_TINY: dict[str, Config] = {
    "qwen35-tiny": Config(**_TINY, tied_output=True, ssm_v_heads=4),
    "qwen35-tiny-v3-mtp": Config(**_TINY, tied_output=False, ssm_v_heads=6, mtp_layers=1),
    "qwen35moe-tiny": Config(**{**_TINY, **_MOE}, tied_output=False, ssm_v_heads=4, mtp_layers=1),
}
# The variants whose expert tensors also come as Q8_0 (the rest F32): "<name>:q8_0-experts"
EXPERT_TYPES = ("f32", "q8_0-experts")
MATRIX_RMS = 0.05


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor's random values, by what it holds."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.standard_normal(shape))  # -exp(A_log)
    if name.endswith("ssm_dt.bias"):
        return rng.standard_normal(shape)
    if name.endswith("ssm_conv1d.weight"):
        return 0.3 * rng.standard_normal(shape)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    return MATRIX_RMS * rng.standard_normal(shape)


def _tensor(tname: str, shape: tuple[int, ...], seed: int, experts: QType) -> RawTensor:
    rng = np.random.default_rng([seed, zlib.crc32(tname.encode())])
    data = _values(tname, shape, rng).astype(np.float32)
    if len(shape) == 3 and experts != QType.F32:  # the same values, quantized as llama.cpp does
        return RawTensor(tname, experts, shape, quantize(data, experts))
    return RawTensor(tname, QType.F32, shape, data)


def qwen35_model(name: str, seed: int = 0) -> GGUFModel:
    """The model QWEN35_TINY[name] with random weights (each tensor from (seed, its name)), all
    F32, or with its expert tensors Q8_0 for name "<variant>:q8_0-experts"."""
    variant, _, types = name.partition(":")
    if variant not in QWEN35_TINY or types not in ("", *EXPERT_TYPES):
        raise ValueError(f"unknown synthetic qwen35 model {name!r}")
    cfg = QWEN35_TINY[variant]
    shapes = dict(expected_shapes(cfg))
    for _ in range(cfg.mtp_layers):
        shapes.update(mtp_shapes(cfg))
    experts = QType.Q8_0 if types == "q8_0-experts" else QType.F32
    tensors = {tname: _tensor(tname, shape, seed, experts) for tname, shape in shapes.items()}
    return GGUFModel(
        path=f"synthetic:{name}",
        config=cfg,
        metadata=_metadata(cfg, f"synthetic {name}", 0),
        tensors=tensors,
        file_size=sum(t.nbytes for t in tensors.values()),
    )
