"""llama-bench's vocabulary: its field schema and types, test names, model descriptions.

Mirrors ggml-org/llama.cpp tools/llama-bench/llama-bench.cpp (test::get_fields(),
test::get_field_type(), the markdown test label) and llama_model_desc / llama_model_size /
llama_model_n_params, so minfer_jax's rows read like llama-bench's; our own columns follow.
"""

from __future__ import annotations

import math

# llama-bench's test::get_fields(), in order (ggml-org/llama.cpp tools/llama-bench/llama-bench.cpp).
LLAMA_BENCH_FIELDS = [
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "cpu_mask",
    "cpu_strict",
    "poll",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "n_cpu_moe",
    "split_mode",
    "main_gpu",
    "no_kv_offload",
    "flash_attn",
    "devices",
    "tensor_split",
    "tensor_buft_overrides",
    "use_mmap",
    "embeddings",
    "no_op_offload",
    "no_host",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
]
# test::get_field_type(): everything else is a STRING.
INT_FIELDS = {
    "build_number",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "poll",
    "model_size",
    "model_n_params",
    "n_gpu_layers",
    "main_gpu",
    "n_prompt",
    "n_gen",
    "n_depth",
    "avg_ns",
    "stddev_ns",
    "no_op_offload",
    "n_cpu_moe",
}
BOOL_FIELDS = {"no_kv_offload", "cpu_strict", "flash_attn", "use_mmap", "embeddings", "no_host"}
FLOAT_FIELDS = {"avg_ts", "stddev_ts"}

# minfer_jax's columns, appended after llama-bench's (None = not applicable -> "" / null / n/a).
MODEL_EXTRA_FIELDS = [
    "test",
    "jax_version",
    "device",
    "kernels",
    "weight_mode",
    "n_ctx",
    "bucket",
    "compile_s",
    "weight_bytes_per_token",
    "weight_gbps",
    "mem_bw_gbps",
    "pct_mem_bw",
    "matmul_tflops",
    "peak_mem_bytes",
    "command",
]
MODEL_FIELDS = LLAMA_BENCH_FIELDS + MODEL_EXTRA_FIELDS

KERNEL_FIELDS = [
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "jax_version",
    "device",
    "model_filename",
    "qtype",
    "n_out",
    "n_in",
    "nt",
    "kernel",
    "impl",
    "tensors",
    "count",
    "weight_bytes",
    "reps",
    "test_time",
    "avg_us",
    "stddev_us",
    "best_us",
    "gbps",
    "mem_bw_gbps",
    "pct_mem_bw",
    "tflops",
    "rel_err",
    "compile_s",
    "ggml_us",
    "speedup_vs_ggml",
    "command",
]

OUTPUT_FORMATS = ("md", "csv", "json", "jsonl")


def test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's markdown test label ("pp512", "tg128 @ d4096")."""
    if n_prompt > 0 and n_gen == 0:
        name = f"pp{n_prompt}"
    elif n_gen > 0 and n_prompt == 0:
        name = f"tg{n_gen}"
    else:
        name = f"pp{n_prompt}+tg{n_gen}"
    return f"{name} @ d{n_depth}" if n_depth else name


# llama_ftype_name() for the file types minfer_jax can hold (src/llama-model-loader.cpp).
_FTYPE_NAMES = {
    0: "all F32",
    1: "F16",
    32: "BF16",
    2: "Q4_0",
    3: "Q4_1",
    8: "Q5_0",
    9: "Q5_1",
    7: "Q8_0",
    10: "Q2_K - Medium",
    21: "Q2_K - Small",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    38: "MXFP4 MoE",
}
_FTYPE_GUESSED = 1024


def _qwen2_type_name(cfg) -> str:
    """llm_type_name(type) as llama_model_qwen2::load_arch_hparams picks it (by layer count).

    Note llama.cpp calls Qwen2.5-0.5B (24 layers, n_embd 896 != 1024) '1B'.
    """
    n = cfg.n_layers
    if n == 24:
        return "0.5B" if cfg.d_model == 1024 else "1B"
    if n == 28:
        return "1.5B" if cfg.d_model == 1536 else "7B"
    if n == 40:
        return "4B" if cfg.n_heads == 20 else "13B"
    return {32: "7B", 36: "3B", 48: "14B", 64: "32B", 80: "70B"}.get(n, "?B")


def _llama_type_name(cfg) -> str:
    """llama.cpp's models/llama.cpp: by layer count (32 layers by vocabulary, 80 by kv heads);
    eight experts (Mixtral): 8x7B / 8x22B."""
    n = cfg.n_layers
    if cfg.n_experts == 8:
        return {32: "8x7B", 56: "8x22B"}.get(n, "?B")
    if n == 32:
        return "3B" if cfg.vocab_size == 49152 else "7B" if cfg.vocab_size < 40000 else "8B"
    if n == 80:
        return "65B" if cfg.n_heads == cfg.n_kv_heads else "70B"
    sizes = {
        16: "1B",
        22: "1B",
        26: "3B",
        28: "3B",
        30: "256M",
        36: "8B",
        40: "13B",
        48: "34B",
        60: "30B",
    }
    return sizes.get(n, "?B")


def _qwen3_type_name(cfg) -> str:
    """llama.cpp's models/qwen3.cpp (by layer count, then width)."""
    n = cfg.n_layers
    if n == 28:
        return "0.6B" if cfg.d_model == 1024 else "1.7B"
    if n == 36:
        return "4B" if cfg.d_model == 2560 else "8B"
    return {40: "14B", 64: "32B"}.get(n, "?B")


def _gemma3_type_name(cfg) -> str:
    """llama.cpp's models/gemma3.cpp (by layer count)."""
    return {18: "270M", 26: "1B", 32: "8B", 34: "4B", 48: "12B", 62: "27B"}.get(cfg.n_layers, "?B")


def _moe_type_name(arch: str):
    """llama.cpp's models/qwen3moe.cpp and qwen2moe.cpp (by layer count)."""
    names = {
        "qwen3moe": {48: "30B.A3B", 94: "235B.A22B"},
        "qwen2moe": {24: "A2.7B", 28: "57B.A14B"},
    }[arch]
    return lambda cfg: names.get(cfg.n_layers, "?B")


_TYPE_NAMES = {
    "qwen3moe": _moe_type_name("qwen3moe"),
    "qwen2moe": _moe_type_name("qwen2moe"),
    "qwen2": _qwen2_type_name,
    "llama": _llama_type_name,
    "qwen3": _qwen3_type_name,
    "gemma3": _gemma3_type_name,
    # llama_model_openai_moe::load_arch_hparams
    "gpt-oss": lambda cfg: {24: "20B", 36: "120B"}.get(cfg.n_layers, "?B"),
}


def model_type(gmodel) -> str:
    """llama_model_desc(): '<arch> <size> <ftype name>', e.g. 'qwen2 7B Q4_K - Medium'."""
    arch = gmodel.metadata.get("general.architecture", "qwen2")
    ft = gmodel.metadata.get("general.file_type")
    if ft is None:
        name = "unknown, may not work"
    else:
        ft = int(ft)
        base = _FTYPE_NAMES.get(ft & ~_FTYPE_GUESSED, "unknown, may not work")
        name = base + (" (guessed)" if ft & _FTYPE_GUESSED else "")
    size = _TYPE_NAMES.get(arch, lambda _: "?B")(gmodel.config)
    return f"{arch} {size} {name}"


def model_size_params(gmodel) -> tuple[int, int]:
    """(llama_model_size, llama_model_n_params): tensor bytes and elements over all tensors."""
    size = sum(t.nbytes for t in gmodel.tensors.values())
    n_params = sum(int(math.prod(t.shape)) for t in gmodel.tensors.values())
    return int(size), int(n_params)
