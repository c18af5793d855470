"""GPU: time a mixture-of-experts feed-forward's expert kernels at a real model's shapes.

usage: python tools/expert_bench.py [--model qwen3-30b-a3b|gpt-oss-20b] [--nt 1,2,4,8,512]
           [--paths auto|gemv,ragged,pallas] [--reps 20] [--layers 4] [--qtype Q4_K] [--jsonl F]

One row per (model, token count, path): microseconds per FFN call (gate + up + activation, then
down + routing weights + k-sum), the active weights (the distinct experts the call's tokens chose,
x their gate + up + down bytes) and those bytes per second, and the parity (rel err against the
kernels' references for up to 8 tokens; against the gemv path's own output beyond, where the
references would decode every pair's matrix). Paths: "gemv" (pallas/expert_gemv.py: the fused
gate+up+activation launch and the down+weights+sum launch), "ragged" / "pallas"
(pallas/expert_gemm.py: pairs sorted by expert, the grouped GEMM of that variant for gate, up and
down, XLA for the activation and the weighted sum); "auto" is what ops routes for the token count
(ops.EXPERT_GEMV_MAX_NT). To place that switch: --nt 8,16,32,64 --paths gemv,ragged,pallas.

Each timed executable runs `reps` calls, each on its own activations and random routing and on one
of `layers` weight copies in turn (so the experts stream from HBM, not the L2); on a GPU the time
is the device span of its kernels / reps (bench.kernel_timing), elsewhere the host clock.
Weights are random planes (speed does not depend on values). Not part of the package.
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import ops
from minfer_jax.pallas import expert_gemm, expert_gemv
from minfer_jax.pallas.expert_kernels import GLU_ACTIVATIONS
from minfer_jax.quant.planes import FORMATS, QType
from minfer_jax.sizes import round_up

from minfer_bench.bench import kernel_timing as KB


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int
    k: int  # experts per token
    d: int  # model width: gate / up inputs, down outputs
    ff: int  # one expert's hidden width
    qtype: str
    act: str
    biases: bool  # per-expert biases on gate, up, down (gpt-oss)


MODELS = {
    "qwen3-30b-a3b": Shape(128, 8, 2048, 768, "Q4_K", "silu", False),
    "gpt-oss-20b": Shape(32, 4, 2880, 2880, "MXFP4", "swiglu_oai", True),
    "tiny": Shape(8, 2, 256, 256, "Q4_K", "silu", True),  # a CPU smoke run with --interpret
}


def stacked(key, qtype: QType, e: int, n: int, k: int) -> dict:
    """Random planes of e experts' [n, k] weights, stacked [E, Npad, cols]."""
    npad = round_up(n, 128)
    flat = KB.random_planes(key, qtype, e * npad, k)
    return {name: p.reshape(e, npad, p.shape[-1]) for name, p in flat.items()}


def layer(key, s: Shape, qtype: QType) -> dict:
    kg, ku, kd, kb = jax.random.split(key, 4)
    w = {
        "gate": stacked(kg, qtype, s.experts, s.ff, s.d),
        "up": stacked(ku, qtype, s.experts, s.ff, s.d),
        "down": stacked(kd, qtype, s.experts, s.d, s.ff),
    }
    if s.biases:
        b1, b2, b3 = jax.random.split(kb, 3)
        w["gate_bias"] = jax.random.normal(b1, (s.experts, s.ff)) * 0.1
        w["up_bias"] = jax.random.normal(b2, (s.experts, s.ff)) * 0.1
        w["down_bias"] = jax.random.normal(b3, (s.experts, s.d)) * 0.1
    return w


def routing(key, t: int, s: Shape):
    """Distinct top-k experts per token (as a router's top_k gives) and softmax weights."""
    logits = jax.random.normal(key, (t, s.experts))
    weights, ids = jax.lax.top_k(logits, s.k)
    return ids.astype(jnp.int32), jax.nn.softmax(weights, axis=-1)


def ffn(path: str, s: Shape, qtype: QType, interpret: bool):
    """(x, ids, weights, w) -> [T, d]: the expert FFN through `path`."""

    def gemv(x, ids, rw, w):
        h = expert_gemv.expert_glu(
            x, w["gate"], w["up"], ids, gate_qtype=qtype, up_qtype=qtype, n_out=s.ff,
            act=s.act, gate_bias=w.get("gate_bias"), up_bias=w.get("up_bias"),
            interpret=interpret,
        )  # fmt: skip
        return expert_gemv.expert_down_sum(
            h, w["down"], ids, rw, qtype=qtype, n_out=s.d, bias=w.get("down_bias"),
            interpret=interpret,
        )  # fmt: skip

    def sorted_gemm(x, ids, rw, w):
        def mm(v, name, n):
            return expert_gemm.expert_matmul_sorted(
                v, w[name], ids, qtype=qtype, n_out=n, variant=path, interpret=interpret
            )

        g, u = mm(x, "gate", s.ff), mm(x, "up", s.ff)
        if s.biases:
            g, u = g + w["gate_bias"][ids], u + w["up_bias"][ids]
        y = mm(GLU_ACTIVATIONS[s.act](g, u), "down", s.d)
        if s.biases:
            y = y + w["down_bias"][ids]
        return jnp.sum(y * rw[..., None], axis=1)

    return gemv if path == "gemv" else sorted_gemm


def reference(s: Shape, qtype: QType):
    def ref(x, ids, rw, w):
        h = expert_gemv.expert_glu_reference(
            x, w["gate"], w["up"], ids, gate_qtype=qtype, up_qtype=qtype, n_out=s.ff,
            act=s.act, gate_bias=w.get("gate_bias"), up_bias=w.get("up_bias"),
        )  # fmt: skip
        return expert_gemv.expert_down_sum_reference(
            h, w["down"], ids, rw, qtype=qtype, n_out=s.d, bias=w.get("down_bias")
        )

    return ref


def time_calls(fn, inputs, layers, reps: int, trials: int = 5) -> float:
    """Best us per call of `reps` unrolled calls in one executable."""

    def loop(inputs, layers):
        return [fn(*inp, layers[r % len(layers)]) for r, inp in enumerate(inputs)]

    exe = jax.jit(loop).lower(inputs, layers).compile()

    def run():
        jax.block_until_ready(exe(inputs, layers))

    run()
    samples = []
    for _ in range(trials):
        span = KB.device_span_us(run) if jax.devices()[0].platform == "gpu" else None
        if span is None:
            t0 = time.perf_counter()
            run()
            span = (time.perf_counter() - t0) * 1e6
        samples.append(span / reps)
    return min(samples)


def active_bytes(ids: np.ndarray, s: Shape, qtype: QType) -> int:
    """The distinct chosen experts' gate + up + down bytes."""
    per_expert = 2 * KB.weight_nbytes(qtype, s.ff, s.d) + KB.weight_nbytes(qtype, s.d, s.ff)
    return len(np.unique(ids)) * per_expert


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_model(name: str, nts: list[int], paths: list[str], a) -> list[dict]:
    s = MODELS[name]
    qname = a.qtype or s.qtype
    if qname not in {q.name for q in FORMATS}:
        raise SystemExit(f"{name}: format {qname} is not known to quant.planes (try --qtype)")
    qtype = QType[qname]
    key = jax.random.PRNGKey(0)
    layers = [layer(kk, s, qtype) for kk in jax.random.split(key, a.layers)]
    rows = []
    for nt in nts:
        keys = jax.random.split(jax.random.PRNGKey(nt), 2 * a.reps)
        inputs = []
        for r in range(a.reps):
            ids, rw = routing(keys[2 * r], nt, s)
            inputs.append((jax.random.normal(keys[2 * r + 1], (nt, s.d)), ids, rw))
        nbytes = int(np.mean([active_bytes(np.asarray(i[1]), s, qtype) for i in inputs]))
        want = None
        if nt <= ops.EXPERT_GEMV_MAX_NT:
            want = jax.jit(reference(s, qtype))(*inputs[0], layers[0])
        for path in paths:
            path = ops.expert_kernel_path(nt) if path == "auto" else path
            fn = ffn(path, s, qtype, a.interpret)
            us = time_calls(fn, inputs, layers, a.reps)
            got = jax.jit(fn)(*inputs[0], layers[0])
            if want is None:
                want = (
                    got
                    if path == "gemv"
                    else jax.jit(ffn("gemv", s, qtype, a.interpret))(*inputs[0], layers[0])
                )
            row = dict(model=name, qtype=qname, nt=nt, path=path, us=round(us, 2),
                       active_mb=round(nbytes / 1e6, 2), gbps=round(nbytes / us / 1e3, 1),
                       rel_err=rel_err(got, want))  # fmt: skip
            print(
                f"{name:14s} {qname:6s} T={nt:<4d} {path:7s} {us:10.1f} us  "
                f"{nbytes / 1e6:8.1f} MB active  {nbytes / us / 1e3:8.1f} GB/s  "
                f"rel err {row['rel_err']:.2e}",
                flush=True,
            )
            rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b,gpt-oss-20b", help=", ".join(MODELS))
    ap.add_argument("--nt", default="1,2,4,8,512")
    ap.add_argument("--paths", default="auto", help="auto or a list of gemv, ragged, pallas")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4, help="weight copies the calls cycle through")
    ap.add_argument("--qtype", default=None, help="override the model's expert format")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--interpret", action="store_true", help="Pallas' interpreter (CPU smoke run)")
    a = ap.parse_args()
    nts = [int(v) for v in a.nt.split(",")]
    paths = a.paths.split(",")
    for p in paths:
        if p not in ("auto", "gemv", *expert_gemm.VARIANTS):
            raise SystemExit(f"--paths: {p!r} is not auto, gemv, ragged or pallas")
    rows = []
    for name in a.model.split(","):
        if name not in MODELS:
            raise SystemExit(f"--model: {name!r} is not one of {', '.join(MODELS)}")
        rows += run_model(name, nts, paths, a)
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
