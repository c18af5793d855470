"""minfer_bench.quant_mix's tensor types against llama-quantize's, for the MoE families.

Writes each tiny MoE config with the real models' layer counts (and 16 / 8 / 8 experts) as F16,
quantizes it with llama.cpp (llama-cpp-python's llama_model_quantize, same process) to Q4_K_M and
prints every tensor whose type differs from quant_mix.tensor_types; also the real-shape
Qwen3.6-35B-A3B (qwen35moe) and Qwen3.6-27B (qwen35) narrowed to d_model 256, 512 tokens, an FFN of
512 and 16 experts (their 40 / 64 layers and DeltaNet tensors kept). Run from the repository root
in a venv with llama-cpp-python:

    PYTHONPATH=. python tools/quant_mix_vs_llama_cpp.py
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import tempfile

import llama_cpp
from gguf import GGMLQuantizationType, GGUFReader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer_bench.quant_mix import tensor_types  # noqa: E402
from minfer_bench.synthetic import (  # noqa: E402
    SYNTHETIC_CONFIGS,
    synthetic_model_from_config,
    write_gguf,
)

CASES = (("qwen3moe-tiny", 48, 16), ("mixtral-tiny", 32, 8), ("qwen2moe-tiny", 24, 8))
# real-shape configs made small where no rule looks: d_model 256, a 512-token vocab, an FFN of
# 512, 16 experts (none for a dense one)
NARROWED = (("qwen3.6-35b-a3b", 16), ("qwen3.6-27b", 0))
Q4_K_M = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def main() -> int:
    differing = 0
    configs = [
        (name, dataclasses.replace(SYNTHETIC_CONFIGS[name], n_layers=layers, n_experts=experts))
        for name, layers, experts in CASES
    ] + [
        (
            name,
            dataclasses.replace(
                SYNTHETIC_CONFIGS[name], d_model=256, vocab_size=512, d_ff=512, n_experts=n
            ),
        )
        for name, n in NARROWED
    ]
    for name, cfg in configs:
        layers, experts = cfg.n_layers, cfg.n_experts
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "f16.gguf"), os.path.join(tmp, "q4_k_m.gguf")
            write_gguf(synthetic_model_from_config(cfg, "f16", 0), src, progress=False)
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = Q4_K_M, 2
            rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
            if rc:
                raise SystemExit(f"{name}: llama_model_quantize failed ({rc})")
            got = {t.name: GGMLQuantizationType(t.tensor_type) for t in GGUFReader(dst).tensors}
        want = tensor_types(cfg, "q4_k_m")
        diff = {n: (got[n].name, want[n].name) for n in want if got.get(n) != want[n]}
        differing += len(diff)
        print(f"{name} ({layers} layers, {experts} experts): {len(diff)} differ (llama.cpp, ours)")
        for n, pair in list(diff.items())[:20]:
            print(f"  {n}: {pair}")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
