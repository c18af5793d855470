"""llama.cpp's per-tensor type choice: which GGML type each tensor of a Qwen2 model gets under a
llama.cpp file type ("q4_k_m", "q4_0", "q8_0", ...), mirroring llama.cpp's `src/llama-quant.cpp`.

`tensor_types(cfg, ftype)` is the type mix of synthetic.py's models; `FTYPES` the file types
it mirrors.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from minfer_jax.errors import MinferError, UnsupportedError
from minfer_jax.files.gguf import SUPPORTED_TYPES
from minfer_jax.model.config import Config
from minfer_jax.model.from_gguf import expected_shapes

QType = GGMLQuantizationType


class SyntheticSpecError(MinferError, ValueError):
    """A synthetic model spec, config name, file type or type table that cannot be built."""


# File types (llama_ftype) we can mirror: every non-IQ type whose mix stays inside the formats
# minfer_jax runs. Q2_K_S is left out: llama.cpp refuses it without an importance matrix
# (tensor_requires_imatrix), and every IQ* file type produces IQ formats.
FTYPES: dict[str, LlamaFileType] = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "q4_1": LlamaFileType.MOSTLY_Q4_1,
    "q5_0": LlamaFileType.MOSTLY_Q5_0,
    "q5_1": LlamaFileType.MOSTLY_Q5_1,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q2_k": LlamaFileType.MOSTLY_Q2_K,
    "q3_k_s": LlamaFileType.MOSTLY_Q3_K_S,
    "q3_k_m": LlamaFileType.MOSTLY_Q3_K_M,
    "q3_k_l": LlamaFileType.MOSTLY_Q3_K_L,
    "q4_k_s": LlamaFileType.MOSTLY_Q4_K_S,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
    "q5_k_s": LlamaFileType.MOSTLY_Q5_K_S,
    "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M,
    "q6_k": LlamaFileType.MOSTLY_Q6_K,
    "mxfp4_moe": LlamaFileType.MOSTLY_MXFP4_MOE,
}

F = LlamaFileType

# llama_ftype_get_default_type(): the type every quantizable tensor starts from.
DEFAULT_TYPE: dict[LlamaFileType, QType] = {
    F.ALL_F32: QType.F32,
    F.MOSTLY_F16: QType.F16,
    F.MOSTLY_BF16: QType.BF16,
    F.MOSTLY_Q4_0: QType.Q4_0,
    F.MOSTLY_Q4_1: QType.Q4_1,
    F.MOSTLY_Q5_0: QType.Q5_0,
    F.MOSTLY_Q5_1: QType.Q5_1,
    F.MOSTLY_Q8_0: QType.Q8_0,
    F.MOSTLY_Q2_K: QType.Q2_K,
    F.MOSTLY_Q3_K_S: QType.Q3_K,
    F.MOSTLY_Q3_K_M: QType.Q3_K,
    F.MOSTLY_Q3_K_L: QType.Q3_K,
    F.MOSTLY_Q4_K_S: QType.Q4_K,
    F.MOSTLY_Q4_K_M: QType.Q4_K,
    F.MOSTLY_Q5_K_S: QType.Q5_K,
    F.MOSTLY_Q5_K_M: QType.Q5_K,
    F.MOSTLY_Q6_K: QType.Q6_K,
    F.MOSTLY_MXFP4_MOE: QType.MXFP4,
}

# tensor_type_fallback(): the type used when a row (ne[0] = in_features) is not a whole number of
# blocks of the chosen type. The current table (ggml-org/llama.cpp master, src/llama-quant.cpp):
#   Q2_0, Q2_K, Q3_K, TQ1_0, TQ2_0 -> Q4_0;  Q4_K -> Q5_0;  Q5_K -> Q5_1;  Q6_K -> Q8_0;
#   (IQ1_S..IQ4_XS -> IQ4_NL); anything else throws "no tensor type fallback is defined".
# Older releases (the inline `convert_incompatible_tensor` switch, e.g. ggerganov/llama.cpp
# 059325d9) sent Q2_K and Q3_K to IQ4_NL instead.
# Either way, if the fallback still does not divide the row (ncols % 32), the tensor becomes F16.
_FALLBACK_CURRENT = {
    QType.Q2_K: QType.Q4_0,
    QType.Q3_K: QType.Q4_0,
    QType.Q4_K: QType.Q5_0,
    QType.Q5_K: QType.Q5_1,
    QType.Q6_K: QType.Q8_0,
}
_FALLBACK_LEGACY = {
    QType.Q2_K: QType.IQ4_NL,
    QType.Q3_K: QType.IQ4_NL,
    QType.Q4_K: QType.Q5_0,
    QType.Q5_K: QType.Q5_1,
    QType.Q6_K: QType.Q8_0,
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.")


def _layer(name: str) -> int:
    """sscanf(name, "blk.%d.", &layer) with layer = -1 when it does not match."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else -1


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama_tensor_get_type_impl: use_more_bits lambda (C++ integer division; i >= n/8 here
    # whenever the modulo is reached, so Python's % agrees with C's).
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def _is_attn_v(name: str) -> bool:
    """llama-quant.cpp's category_is_attn_v: attn_v, and the fused attn_qkv (qwen35's DeltaNet
    input projection), which take attn_v's rules and counter."""
    return "attn_v.weight" in name or "attn_qkv.weight" in name


def parse_ftype(ftype: str | LlamaFileType) -> LlamaFileType:
    if isinstance(ftype, LlamaFileType):
        if ftype not in DEFAULT_TYPE:
            raise SyntheticSpecError(
                f"file type {ftype.name} is not supported here; valid: {', '.join(FTYPES)}"
            )
        return ftype
    key = str(ftype).strip().lower()
    if key not in FTYPES:
        raise SyntheticSpecError(f"unknown file type {ftype!r}; valid: {', '.join(FTYPES)}")
    return FTYPES[key]


def tensor_types(
    cfg: Config,
    ftype: str | LlamaFileType,
    *,
    layer_order: Literal["numeric", "lexicographic"] = "numeric",
    fallback: Literal["current", "legacy"] = "current",
) -> dict[str, QType]:
    """The GGML type llama-quantize gives each tensor of a Qwen2 model `cfg` under `ftype`.

    Mirrors ggml-org/llama.cpp src/llama-quant.cpp for LLM_ARCH_QWEN2, no imatrix, no overrides
    (--output-tensor-type, --token-embedding-type, --tensor-type, --pure): llama_tensor_get_type
    (tensor_allows_quantization, then llama_tensor_get_type_impl, then tensor_type_fallback).
    Sources are assumed F32 for 1-D tensors (norms, biases: never quantized, what
    convert_hf_to_gguf.py writes) -- they are reported as F32.

    The attn_v and ffn_down rules depend on counters (i_attention_wv, i_ffn_down) that advance in
    the order llama-quantize visits tensors:
      - layer_order="numeric" (current llama.cpp): llama_model_loader::weights_map is a std::map
        ordered by weight_name_comparer (layer number, then name), so layer i is visited i-th.
      - layer_order="lexicographic": the order older llama-quantize builds walked (the file order
        of a convert_hf_to_gguf.py output, i.e. blk.0, blk.1, blk.10, ..., blk.19, blk.2, blk.20,
        ...; cf. ggml-org/llama.cpp issue #9005). The real Qwen2.5-Coder-0.5B Q4_K_M file was made
        this way: its Q6_K/Q8_0 attn_v/ffn_down layers are use_more_bits(k) of the k-th layer in
        string order.
    fallback selects tensor_type_fallback's table (see _FALLBACK_CURRENT / _FALLBACK_LEGACY).

    Raises SyntheticSpecError for an unknown ftype and UnsupportedError when the mix would
    contain a type minfer_jax cannot run (e.g. IQ4_NL from the legacy fallback).
    """
    ft = parse_ftype(ftype)
    fallback_table = {"current": _FALLBACK_CURRENT, "legacy": _FALLBACK_LEGACY}[fallback]
    shapes = expected_shapes(cfg)
    if layer_order == "numeric":
        visit = sorted(shapes, key=lambda n: (_layer(n), n))  # weight_name_comparer
    elif layer_order == "lexicographic":
        visit = sorted(shapes)
    else:
        raise SyntheticSpecError(
            f"layer_order must be 'numeric' or 'lexicographic', got {layer_order!r}"
        )
    state = _QuantizeState.of(cfg, ft, shapes)
    out: dict[str, QType] = {}
    for name in visit:
        out[name] = _tensor_type(state, name, shapes[name], fallback_table)
    return {name: out[name] for name in shapes}


@dataclasses.dataclass
class _QuantizeState:
    """llama-quant.cpp's quantize_state_impl for one model: the counts, and the counters that
    advance as attn_v / ffn_down tensors are visited."""

    ft: LlamaFileType
    n_attention_wv: int
    n_ffn_down: int
    n_gqa: int
    is_70b: bool
    has_tied_embeddings: bool
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    n_expert: int = 0

    @classmethod
    def of(cls, cfg: Config, ft: LlamaFileType, shapes: dict) -> _QuantizeState:
        # init_quantize_state_counters(): count attn_v tensors, detect tied embeddings.
        return cls(
            ft=ft,
            n_attention_wv=sum(1 for n in shapes if _is_attn_v(n)),
            n_ffn_down=cfg.n_layers,  # qs.n_ffn_down = hparams.n_layer
            n_gqa=cfg.n_heads // cfg.layer_kv_heads(0),  # llama.cpp: hparams.n_gqa() of layer 0
            is_70b=cfg.n_layers
            == 80,  # llama_model_qwen2::load_arch_hparams: case 80 -> LLM_TYPE_70B
            has_tied_embeddings="output.weight" not in shapes,
            n_expert=cfg.n_experts,
        )


def _tensor_type(state: _QuantizeState, name: str, shape: tuple, fallback_table: dict) -> QType:
    """llama_tensor_get_type() for one tensor, in visiting order."""
    # tensor_allows_quantization(): 2-D, ends with "weight", not a *_norm.weight.
    if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return QType.F32
    if "ffn_gate_inp.weight" in name:  # the MoE router is never quantized (llama-quant.cpp:306)
        return QType.F32
    if "ssm_conv1d" in name:  # DeltaNet's conv kernel: kept as converted, F32 (llama-quant.cpp:324)
        return QType.F32
    if state.ft == F.MOSTLY_MXFP4_MOE:  # expert (3-D) tensors MXFP4, every other one Q8_0
        return QType.MXFP4 if len(shape) == 3 else QType.Q8_0
    ne0 = shape[-1]  # ggml ne[0] = in_features (the row length)
    new_type = DEFAULT_TYPE[state.ft]
    if new_type in (QType.F32, QType.F16, QType.BF16):  # ggml_is_quantized(default) is false
        return new_type
    new_type = _type_impl(state, name, new_type, ne0)
    # tensor_type_fallback()
    if ne0 % GGML_QUANT_SIZES[new_type][0] != 0:
        if new_type not in fallback_table:
            raise UnsupportedError(
                f"{name}: row length {ne0} is not a multiple of the {new_type.name} block size and "
                "llama-quantize would abort ('no tensor type fallback is defined for type "
                f"{new_type.name}')"
            )
        new_type = fallback_table[new_type]
        if ne0 % GGML_QUANT_SIZES[new_type][0] != 0:
            new_type = QType.F16
    if new_type not in SUPPORTED_TYPES:
        raise UnsupportedError(
            f"{name}: llama.cpp would store this tensor ({state.ft.name}, row length {ne0}) as "
            f"{new_type.name}, which minfer_jax does not support"
        )
    return new_type


def _type_impl(state: _QuantizeState, name: str, new_type: QType, ne0: int) -> QType:
    """llama_tensor_get_type_impl() for Qwen2 and the MoE / hybrid families here (not Falcon:
    those branches are left out; no attn_kv_b, so category_is_attn_v() is attn_v or attn_qkv)."""
    ft = state.ft
    if name == "output.weight" or (state.has_tied_embeddings and name == "token_embd.weight"):
        # OUTPUT (or a tied TOKEN_EMBD): Q8_0 when the row does not divide the default type's
        # block, else Q6_K unless the default is Q8_0 (IQ ftypes -> Q5_K: not mirrored).
        qk_k = GGML_QUANT_SIZES[new_type][0]
        if ne0 % qk_k != 0:
            return QType.Q8_0
        if new_type != QType.Q8_0:
            return QType.Q6_K
        return new_type
    if name == "token_embd.weight":
        return new_type  # only IQ/TQ/Q2_0 ftypes change it
    if state.n_expert == 8 and (_is_attn_v(name) or "attn_k.weight" in name):
        return _moe_attn_kv_type(state, name, new_type)
    if _is_attn_v(name):
        new_type = _attn_v_type(state, new_type)
        state.i_attention_wv += 1
        return new_type
    if "ffn_down" in name:
        # layer_info(): with experts the layer index is parsed from the name
        i_layer = _layer(name) if state.n_expert > 1 else state.i_ffn_down
        new_type = _ffn_down_type(ft, new_type, i_layer, state.n_ffn_down)
        state.i_ffn_down += 1
        return new_type
    if "attn_output.weight" in name and state.n_expert == 8:
        return QType.Q5_K if ft in _MOE8_ATTN_OUTPUT_Q5_K else new_type
    if "attn_output.weight" in name:
        if ft == F.MOSTLY_Q2_K:
            new_type = QType.Q3_K
        elif ft == F.MOSTLY_Q3_K_M:
            new_type = QType.Q4_K
        elif ft == F.MOSTLY_Q3_K_L:
            new_type = QType.Q5_K
        return new_type
    # attn_q / attn_k / ffn_gate / ffn_up: only IQ ftypes or MoE change them.
    return new_type


# Eight experts: attn_output goes to Q5_K under these ftypes (llama-quant.cpp; the IQ ones too)
_MOE8_ATTN_OUTPUT_Q5_K = frozenset(
    getattr(F, n)
    for n in (
        "MOSTLY_Q2_K",
        "MOSTLY_Q3_K_S",
        "MOSTLY_Q3_K_M",
        "MOSTLY_Q4_K_S",
        "MOSTLY_Q4_K_M",
        "MOSTLY_IQ3_XS",
        "MOSTLY_IQ3_XXS",
        "MOSTLY_IQ3_S",
        "MOSTLY_IQ3_M",
        "MOSTLY_IQ4_NL",
        "MOSTLY_IQ4_XS",
    )
)


def _moe_attn_kv_type(state: _QuantizeState, name: str, new_type: QType) -> QType:
    """Eight experts (Mixtral): attn_v and attn_k go to Q8_0 (llama-quant.cpp:599-609)."""
    if _is_attn_v(name):
        state.i_attention_wv += 1
    return QType.Q8_0


def _attn_v_type(state: _QuantizeState, new_type: QType) -> QType:
    ft, i = state.ft, state.i_attention_wv
    if ft == F.MOSTLY_Q2_K:
        new_type = QType.Q4_K if state.n_gqa >= 4 else QType.Q3_K
    elif ft == F.MOSTLY_Q3_K_M:
        new_type = QType.Q5_K if i < 2 else QType.Q4_K
    elif ft == F.MOSTLY_Q3_K_L:
        new_type = QType.Q5_K
    elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _use_more_bits(i, state.n_attention_wv):
        new_type = QType.Q6_K
    elif ft == F.MOSTLY_Q4_K_S and i < 4:
        new_type = QType.Q5_K
    if state.is_70b and new_type in (QType.Q3_K, QType.Q4_K):
        new_type = QType.Q5_K
    return new_type


def _ffn_down_type(ft: LlamaFileType, new_type: QType, i_layer: int, n_layer: int) -> QType:
    # layer_info(): n_expert <= 1 -> i_layer is the ffn_down counter
    if ft == F.MOSTLY_Q2_K:
        new_type = QType.Q3_K
    elif ft == F.MOSTLY_Q3_K_M:
        # arch != FALCON -> Q4_K after the first n/16 layers
        new_type = QType.Q5_K if i_layer < n_layer // 16 else QType.Q4_K
    elif ft == F.MOSTLY_Q3_K_L:
        new_type = QType.Q5_K
    elif ft == F.MOSTLY_Q4_K_M:
        if _use_more_bits(i_layer, n_layer):
            new_type = QType.Q6_K
    elif ft == F.MOSTLY_Q5_K_M and _use_more_bits(i_layer, n_layer):
        new_type = QType.Q6_K
    elif ft == F.MOSTLY_Q4_K_S and i_layer < n_layer // 8:
        new_type = QType.Q5_K
    # (Q4_0/Q5_0 -> Q4_1/Q5_1 on the first n/8 layers only with an imatrix: not mirrored)
    return new_type
