r"""A synthetic real-shape model (minfer_bench.synthetic spec, cut to a few layers) against
llama.cpp on the CPU: both read the same GGUF; prints the distance of our logits from llama.cpp's
at every position of a short prompt, in units of llama.cpp's logit std, and where the argmax
agrees. llama-cpp-python must be importable in this python (f32 KV cache; its matmuls quantize
activations to 8 bits, so expect ~0.1-0.2 std on Q4_K_M files).

    PYTHONPATH=. python tools/real_shape_vs_llama_cpp.py gemma-4-26b-a4b:q4_k_m --layers 6
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import minfer_jax  # noqa: E402

from minfer_bench.synthetic import synthetic_model, write_gguf  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("spec", help="a synthetic spec, e.g. gemma-4-e4b:q4_k_m")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=11)
    args = ap.parse_args(argv)
    from llama_cpp import Llama  # the reference; not a dependency of the package

    ids = list(range(1, args.tokens + 1))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.gguf")
        write_gguf(synthetic_model(args.spec, layers=args.layers), path, progress=False)
        llm = Llama(path, n_ctx=128, logits_all=True, verbose=False, type_k=0, type_v=0)
        llm.eval(ids)
        ref = np.array(llm.scores[: len(ids)], np.float32)
        del llm
        ours = minfer_jax.load(path, kernels="xla", weights="quantized", ctx_size=64).logits(ids)
    dist = np.abs(ours - ref).max(-1) / ref.std()
    print(f"{args.spec} x {args.layers} layers: max |ours - llama.cpp| / std per position")
    print(" ".join(f"{d:.3f}" for d in dist))
    print(f"argmax equal at {int((ours.argmax(-1) == ref.argmax(-1)).sum())} / {len(ids)}")


if __name__ == "__main__":
    main()
