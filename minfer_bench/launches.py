"""The Pallas kernels a decode step launches, per family, read from its traced jaxpr (no lowering,
so it runs on a CPU): the proof that moving a fusion choice changed no kernel launch.

`decode_launches(spec)` traces model/decoder.forward_decode of a tiny synthetic model with
kernels="pallas" and impl.fused_decode on and returns the pallas_call names in program order;
`python -m minfer_bench.launches` prints them for every family (FAMILY_SPECS), fused decode on
and off; `--json` as the table tests/data/decode_launches.json holds; `--hashes` a digest of each
step's whole jaxpr, to compare two trees (PYTHONPATH=<tree> for each).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json

import jax
import jax.numpy as jnp

from minfer_jax import ops
from minfer_jax.model.cache import init_cache
from minfer_jax.model.config import Config
from minfer_jax.model.decoder import forward_chunk, forward_decode
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.weights import load_params

from minfer_bench.synthetic import synthetic_model, synthetic_model_from_config
from minfer_bench.synthetic_gemma4 import gemma4_model
from minfer_bench.synthetic_qwen35 import qwen35_model

# tests/configs.tiny_config(n_layers=2) (test_model_kernels.py's): a qwen2 model with biases
QWEN2_TINY = Config(2, 256, 4, 2, 512, 512, 300, 1e6, 1e-6, False)
# one tiny model of each family
FAMILY_SPECS = {
    "qwen2": "tiny",
    "llama": "llama-tiny:q4_k_m",
    "llama-moe": "mixtral-tiny:q4_k_m",
    "qwen3": "qwen3-tiny:q4_k_m",
    "gemma3": "gemma3-tiny:q4_k_m",
    "qwen3moe": "qwen3moe-tiny:q4_k_m",
    "qwen2moe": "qwen2moe-tiny:q4_k_m",
    "gpt-oss": "gpt-oss-tiny:q4_k_m",
    "qwen35": "qwen35-tiny",
    "qwen35moe": "qwen35moe-tiny",
    "gemma4": "gemma4-tiny",
    "gemma4moe": "gemma4moe-tiny",
}


def family_model(spec: str) -> GGUFModel:
    """The tiny synthetic model of a FAMILY_SPECS value."""
    if spec == "tiny":
        return synthetic_model_from_config(QWEN2_TINY, "q4_k_m", seed=5)
    if spec.startswith("qwen35"):
        return qwen35_model(spec)
    if spec.startswith("gemma4"):
        return gemma4_model(spec)
    return synthetic_model(spec)


def _pallas_names(jaxpr) -> list[str]:
    """The pallas_call names of a (closed) jaxpr in program order, inner jaxprs included, each
    with its operands' shapes (e.g. a GEMV given the rows' sums of squares has one more)."""
    names: list[str] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            info = eqn.params.get("name_and_src_info")
            shapes = ",".join("x".join(map(str, v.aval.shape)) for v in eqn.invars)
            names.append(f"{getattr(info, 'name', None) or eqn.params.get('name')}({shapes})")
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names.extend(_pallas_names(inner))
    return names


def decode_launches(gm: GGUFModel, fused: bool = True, rows: int = 2) -> list[str]:
    """The Pallas kernels one decode step of `rows` rows launches, in order (fused:
    impl.fused_decode)."""
    cfg = gm.config
    params = load_params(gm)
    cache = init_cache(cfg, n_slots=4, max_len=64, dtype=jnp.float16)
    impl = ops.Impl(kernels="pallas", fused_decode=fused)
    step = functools.partial(forward_decode, cfg=cfg, impl=impl)
    tokens = jnp.arange(rows, dtype=jnp.int32)
    closed = jax.make_jaxpr(step)(params, tokens, tokens, tokens + 3, cache)
    return _pallas_names(closed.jaxpr)


def jaxpr_hashes(gm: GGUFModel) -> dict[str, str]:
    """A digest of the whole jaxpr of a decode step (kernels "pallas" fused and not, "xla") and of
    a 16-token chunk (both kernel modes): two trees' digests equal means the same traced program."""
    cfg, params = gm.config, load_params(gm)
    cache = init_cache(cfg, n_slots=4, max_len=128, dtype=jnp.float16)
    rows, chunk = jnp.arange(2, dtype=jnp.int32), jnp.arange(16, dtype=jnp.int32)
    out = {}
    for kernels, fused in (("pallas", True), ("pallas", False), ("xla", True)):
        impl = ops.Impl(kernels=kernels, fused_decode=fused)
        step = functools.partial(forward_decode, cfg=cfg, impl=impl)
        closed = jax.make_jaxpr(step)(params, rows, rows, rows + 3, cache)
        out[f"decode {kernels}{'' if fused else ' unfused'}"] = closed
    for kernels in ("pallas", "xla"):
        step = functools.partial(forward_chunk, cfg=cfg, impl=ops.Impl(kernels=kernels))
        out[f"chunk {kernels}"] = jax.make_jaxpr(step)(params, chunk, 0, 0, cache)
    return {k: hashlib.sha1(str(v).encode()).hexdigest()[:12] for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILY_SPECS))
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.add_argument("--hashes", action="store_true", help="whole-jaxpr digests (jaxpr_hashes)")
    args = parser.parse_args(argv)
    if args.hashes:
        for name in args.families.split(","):
            for mode, digest in jaxpr_hashes(family_model(FAMILY_SPECS[name])).items():
                print(f"{name} {mode} {digest}")
        return
    table = {}
    for name in args.families.split(","):
        gm = family_model(FAMILY_SPECS[name])
        for fused in (True, False):
            table[f"{name}{'' if fused else ' unfused'}"] = decode_launches(gm, fused)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    for name, launches in table.items():
        print(f"{name}: {len(launches)} launches: {' '.join(launches)}")


if __name__ == "__main__":
    main()
