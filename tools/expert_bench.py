"""GPU: time a mixture-of-experts feed-forward through ops at a real model's layer shapes, per
expert path (pallas/expert_tuning.py), and print the path table the fastest ones give.

usage: python tools/expert_bench.py --suite [--out F.md] [--budget-s 75]
       python tools/expert_bench.py [--model qwen3-30b-a3b|gpt-oss-20b|tiny] [--nt 1,2,8,512]
           [--paths auto|gemv,gemv-split,gemv-pairs,ragged,pallas,dequant] [--reps 8]
           [--layers 4] [--qtype Q4_K] [--jsonl F] [--out F.md] [--max-bm 128] [--interpret]

Each case is one executable of `reps` calls of the layer's whole MoE feed-forward as the model
runs it (ops.matmul for the router, model.moe.route_tokens, ops.expert_glu, ops.expert_down_sum,
the residual add), with ops' expert path forced to one path at every token count. Every call has
its own activations (so its own routing) and one of `layers` weight copies in turn, so the
experts stream from HBM, not the L2; Qwen3-30B-A3B Q4_K_M's copies alternate its two down
formats (Q6_K, Q4_K) as its layers do. The time is the device span of the kernels / reps
(one profiler trace per case) below HOST_CLOCK_MIN_NT tokens, the host clock beyond.
Per row: us per call, the active weights (the distinct chosen experts' gate + up + down bytes,
plus the router's) and those bytes per second, the useful TFLOP/s (2 x tokens x (k x the three
expert matmuls + the router)), and the parity: rel err of the output (less the residual) against
the XLA reference route at REFERENCE_NTS tokens, against the first path's output elsewhere. A
case that fails (a lowering error, out of memory) is printed and skipped.

--suite: Qwen3-30B-A3B, the decode paths at 1, 2, 4, 8 tokens, the GEMM variants (and two GEMV
paths at 16 and 32, to place the switch) from 16 to 4096 tokens, most important first, no case
started after --budget-s seconds; "ragged" only up to RAGGED_MAX_NT tokens (XLA expands it into
a dense dot over E masked copies of the rows: expert_gemm's docstring). Then the fastest path per
token count and the EXPERT_PATHS table that gives, to paste into pallas/expert_tuning.py.
Weights are random planes (speed does not depend on values). Not part of the package.
"""

import argparse
import contextlib
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax import ops
from minfer_jax.model.config import Config
from minfer_jax.model.moe import route_tokens
from minfer_jax.pallas import expert_gemm, expert_tuning
from minfer_jax.quant.matrix import QWeight
from minfer_jax.quant.planes import FORMATS, QType
from minfer_jax.sizes import round_up

from minfer_bench.bench import kernel_timing as KB

HOST_CLOCK_MIN_NT = 256  # from here a call takes milliseconds: the host clock's overhead is noise
# token counts checked against the XLA reference route (each its own compile; it decodes per pair
# or tile): the decode counts and one prefill count anchor every path; the others are checked
# against the first path timed at their count
REFERENCE_NTS = frozenset({1, 2, 4, 8, 64})
RAGGED_MAX_NT = 512  # "ragged"'s masked dense expansion: [E, nt x k, d] f16, 2 GB at 512 tokens
SUITE_DECODE = (1, 2, 4, 8)
SUITE_GEMV_PATHS = ("gemv", "gemv-split", "gemv-pairs")
SUITE_GEMM_PATHS = ("pallas", "dequant", "ragged")
SUITE_PREFILL = (512, 4096, 16, 64, 2048, 1024, 256, 128, 32)  # most important first
SUITE_SWITCH = (16, 32)  # token counts where the GEMV paths are timed too


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int
    k: int  # experts per token
    d: int  # model width: gate / up inputs, down outputs
    ff: int  # one expert's hidden width
    qtype: str  # gate and up
    down_qtypes: tuple[str, ...]  # the down weight's, one per weight copy in turn
    act: str
    gating: str  # Config.expert_gating
    norm: bool  # Config.expert_weights_norm
    biases: bool  # per-expert biases on gate, up, down and the router (gpt-oss)


Q30 = Shape(128, 8, 2048, 768, "Q4_K", ("Q6_K", "Q4_K"), "silu", "softmax", True, False)
GOSS = Shape(32, 4, 2880, 2880, "MXFP4", ("MXFP4",), "swiglu_oai", "softmax_weight", False, True)
MODELS = {
    "qwen3-30b-a3b": Q30,
    "gpt-oss-20b": GOSS,
    "tiny": Shape(8, 2, 256, 256, "Q4_K", ("Q6_K", "Q4_K"), "silu", "softmax", True, True),
}


def config(s: Shape) -> Config:
    """A Config holding the routing fields route_tokens reads (the rest: any valid values)."""
    return Config(
        n_layers=1, d_model=s.d, n_heads=2, n_kv_heads=2, d_ff=s.ff, context_length=4096,
        vocab_size=32, rope_theta=1e4, rms_eps=1e-6, tied_output=True, family="qwen3moe",
        n_experts=s.experts, n_experts_used=s.k, d_ff_expert=s.ff, expert_weights_norm=s.norm,
        expert_gating=s.gating, expert_act=s.act,
    )  # fmt: skip


def stacked(key, qtype: QType, e: int, n: int, k: int) -> QWeight:
    """Random planes of e experts' [n, k] weights, stacked [E, Npad, cols]."""
    npad = round_up(n, 128)
    flat = KB.random_planes(key, qtype, e * npad, k)
    return QWeight({m: p.reshape(e, npad, p.shape[-1]) for m, p in flat.items()}, qtype, (n, k), e)


def layer(key, s: Shape, qtype: QType, down_qtype: QType) -> dict:
    kr, kg, ku, kd, kb = jax.random.split(key, 5)
    router = KB.random_planes(kr, QType.F32, s.experts, s.d)  # ffn_gate_inp: F32 in the GGUFs
    w = {
        "router": QWeight(router, QType.F32, (s.experts, s.d)),
        "gate": stacked(kg, qtype, s.experts, s.ff, s.d),
        "up": stacked(ku, qtype, s.experts, s.ff, s.d),
        "down": stacked(kd, down_qtype, s.experts, s.d, s.ff),
    }
    if s.biases:
        b = jax.random.split(kb, 4)
        w["router_bias"] = jax.random.normal(b[0], (s.experts,)) * 0.1
        w["gate_bias"] = jax.random.normal(b[1], (s.experts, s.ff)) * 0.1
        w["up_bias"] = jax.random.normal(b[2], (s.experts, s.ff)) * 0.1
        w["down_bias"] = jax.random.normal(b[3], (s.experts, s.d)) * 0.1
    return w


def router(x, w, impl: ops.Impl, cfg: Config):
    logits = ops.matmul(x, w["router"], impl)
    if "router_bias" in w:
        logits = logits + w["router_bias"]
    return route_tokens(logits, cfg)


def moe_ffn(impl: ops.Impl, cfg: Config):
    """(x [T, d], w) -> x + the layer's MoE FFN of x, as model/moe.py runs it after the norm."""

    def ffn(x, w):
        ids, rw = router(x, w, impl, cfg)
        h = ops.expert_glu(
            x, w["gate"], w["up"], ids, cfg.expert_act, impl, w.get("gate_bias"), w.get("up_bias")
        )
        return x + ops.expert_down_sum(h, w["down"], ids, rw, impl, w.get("down_bias"))

    return ffn


@contextlib.contextmanager
def forced_path(path: str | None):
    """ops' expert path table set to `path` at every token count (None: unchanged)."""
    saved = expert_tuning.EXPERT_PATHS
    if path is not None:
        expert_tuning.EXPERT_PATHS = ((None, path),)
    try:
        yield
    finally:
        expert_tuning.EXPERT_PATHS = saved


def device_spans_us(run, trials: int) -> list[float] | None:
    """run() `trials` times under one profiler trace -> each run's kernel span in us (None
    without GPU events, or when the runs' kernel counts differ)."""
    events = KB.device_kernel_events(lambda: [run() for _ in range(trials)])
    if not events or len(events) % trials:
        return None
    per = len(events) // trials
    chunks = [events[i * per : (i + 1) * per] for i in range(trials)]
    return [(max(s + d for s, d, _ in c) - c[0][0]) / 1e3 for c in chunks]


def time_case(fn, inputs, layers, nt: int, trials: int = 5):
    """(best us per call, the first call's output) of len(inputs) unrolled calls in one
    executable."""

    def loop(inputs, layers):
        return [fn(x, layers[r % len(layers)]) for r, x in enumerate(inputs)]

    exe = jax.jit(loop).lower(inputs, layers).compile()
    first = exe(inputs, layers)[0]

    def run():
        jax.block_until_ready(exe(inputs, layers))

    run()
    spans = None
    if nt < HOST_CLOCK_MIN_NT and jax.devices()[0].platform == "gpu":
        spans = device_spans_us(run, trials)
    if spans is None:
        spans = []
        for _ in range(trials):
            t0 = time.perf_counter()
            run()
            spans.append((time.perf_counter() - t0) * 1e6)
    return min(spans) / len(inputs), first


def weight_nbytes(w: QWeight) -> int:
    return KB.weight_nbytes(w.qtype, *w.shape)


def active_bytes(ids: np.ndarray, w: dict) -> int:
    """The distinct chosen experts' gate + up + down bytes, and the router's."""
    per_expert = sum(weight_nbytes(w[m]) for m in ("gate", "up", "down"))
    return len(np.unique(ids)) * per_expert + weight_nbytes(w["router"])


def useful_flops(nt: int, s: Shape) -> int:
    return 2 * nt * (s.k * 3 * s.d * s.ff + s.d * s.experts)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@dataclasses.dataclass
class Model:
    name: str
    s: Shape
    cfg: Config
    layers: list
    impl: ops.Impl
    reps: int
    inputs: dict = dataclasses.field(default_factory=dict)  # nt -> [x] per call
    nbytes: dict = dataclasses.field(default_factory=dict)  # nt -> mean active bytes per call
    want: dict = dataclasses.field(default_factory=dict)  # nt -> (parity target, its label)
    x_scale: float = 1.0  # activations' scale (build)


def build(name: str, a) -> Model:
    s = MODELS[name]
    names = [a.qtype or s.qtype, *s.down_qtypes]
    unknown = [q for q in names if q not in {f.name for f in FORMATS}]
    if unknown:
        raise SystemExit(f"{name}: formats {unknown} are not known to quant.planes (try --qtype)")
    keys = jax.random.split(jax.random.PRNGKey(0), a.layers)
    downs = [QType[s.down_qtypes[i % len(s.down_qtypes)]] for i in range(a.layers)]
    layers = [layer(kk, s, QType[names[0]], dq) for kk, dq in zip(keys, downs)]
    impl = ops.Impl(kernels="interpret" if a.interpret else "pallas")
    m = Model(name, s, config(s), layers, impl, a.reps)
    # activations scaled so that the gate products are O(1), as in a model: random weights give
    # products in the thousands, whose GLU overflows the grouped GEMMs' f16 rows
    x = jax.random.normal(jax.random.PRNGKey(1), (8, s.d), jnp.float32)
    ids = router(x, layers[0], ops.Impl(), m.cfg)[0]
    gate = ops.expert_matmul(x, layers[0]["gate"], ids, ops.Impl())
    m.x_scale = 4.0 / float(jnp.max(jnp.abs(gate)))
    return m


def calls_for(m: Model, nt: int) -> list:
    """The activations of each call at nt tokens (fewer calls for long prefill), their active
    bytes and the parity target (the XLA route at REFERENCE_NTS), made once per nt."""
    if nt not in m.inputs:
        reps = m.reps if nt < HOST_CLOCK_MIN_NT else max(2, min(m.reps, 2048 // nt))
        keys = jax.random.split(jax.random.PRNGKey(nt), reps)
        m.inputs[nt] = [jax.random.normal(kk, (nt, m.s.d)) * m.x_scale for kk in keys]
        route = jax.jit(lambda x, w: router(x, w, ops.Impl(), m.cfg)[0])
        per_call = [m.layers[r % len(m.layers)] for r in range(reps)]
        m.nbytes[nt] = np.mean(
            [active_bytes(np.asarray(route(x, w)), w) for x, w in zip(m.inputs[nt], per_call)]
        )
        if nt in REFERENCE_NTS:
            ref = jax.jit(moe_ffn(ops.Impl(), m.cfg))(m.inputs[nt][0], m.layers[0])
            m.want[nt] = (ref - m.inputs[nt][0], "xla")
    return m.inputs[nt]


def run_case(m: Model, nt: int, path: str) -> dict:
    inputs = calls_for(m, nt)
    with forced_path(None if path == "auto" else path):
        label = ops.expert_kernel_path(nt)
        us, first = time_case(moe_ffn(m.impl, m.cfg), inputs, m.layers, nt)
    out = first - inputs[0]
    want, against = m.want.setdefault(nt, (out, label))
    nbytes, flops = m.nbytes[nt], useful_flops(nt, m.s)
    row = dict(model=m.name, nt=nt, path=label, us=round(us, 2), active_mb=round(nbytes / 1e6, 2),
               gbps=round(nbytes / us / 1e3, 1), tflops=round(flops / us / 1e6, 2),
               rel_err=rel_err(out, want), against=against)  # fmt: skip
    print(
        f"{m.name:14s} T={nt:<5d} {label:10s} {us:10.1f} us  {nbytes / 1e6:8.1f} MB  "
        f"{row['gbps']:7.1f} GB/s  {row['tflops']:6.2f} TFLOP/s  "
        f"rel err {row['rel_err']:.2e} vs {against}",
        flush=True,
    )
    return row


def suite_plan() -> list[tuple[int, str]]:
    """(nt, path) of --suite, most important first: decode, pp512 and pp4096, the rest."""
    plan = [(nt, p) for nt in SUITE_DECODE for p in SUITE_GEMV_PATHS]
    for nt in SUITE_PREFILL:
        paths = [p for p in SUITE_GEMM_PATHS if p != "ragged" or nt <= RAGGED_MAX_NT]
        plan += [(nt, p) for p in paths + (list(SUITE_GEMV_PATHS) if nt in SUITE_SWITCH else [])]
    return plan


def proposed_table(rows: list[dict], max_err: float = 0.05) -> tuple:
    """EXPERT_PATHS from the fastest path per token count (rows with rel err under max_err): the
    fastest GEMV paths up to the first count where a GEMM variant wins, the fastest GEMM variant
    from there on, neighbouring counts of one path merged."""
    ok = [r for r in rows if r["rel_err"] < max_err]
    best: list[tuple[int, str]] = []
    gemm_from = None
    for nt in sorted({r["nt"] for r in ok}):
        at = sorted((r["us"], r["path"]) for r in ok if r["nt"] == nt)
        if gemm_from is None and at[0][1] not in expert_tuning.GEMV_PATHS:
            gemm_from = nt
        if gemm_from is not None:
            at = [a for a in at if a[1] not in expert_tuning.GEMV_PATHS] or at
        best.append((nt, at[0][1]))
    table: list[tuple[int | None, str]] = []
    for nt, path in best:
        if table and table[-1][1] == path:
            table[-1] = (nt, path)
        else:
            table.append((nt, path))
    if table:
        table[-1] = (None, table[-1][1])
    return tuple(table)


def proposal(rows: list[dict]) -> str:
    """proposed_table as a line to paste, or why ops could not follow it."""
    table = proposed_table(rows)
    try:
        expert_tuning.check_table(table)
    except ValueError as e:
        return f"none valid from these rows ({e})"
    return f"EXPERT_PATHS = {table!r}"


def write_table(rows: list[dict], skipped: list[str], out: str, argv: str) -> None:
    dev = jax.devices()[0]
    lines = [
        f"# expert_bench: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, "
        f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}",
        f"command: python tools/expert_bench.py {argv}",
        "",
        "| model | T | path | us / FFN | active MB | GB/s | TFLOP/s | rel err | vs |",
        "| --- | --: | --- | --: | --: | --: | --: | --: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nt']} | {r['path']} | {r['us']:.1f} | {r['active_mb']:.1f} | "
            f"{r['gbps']:.1f} | {r['tflops']:.2f} | {r['rel_err']:.1e} | {r['against']} |"
        )
    lines += ["", f"not run (budget or failure): {', '.join(skipped) or 'none'}", ""]
    lines += [f"proposed: {proposal(rows)}", ""]
    with open(out, "w") as f:
        f.write("\n".join(lines))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--suite", action="store_true", help="the q30 plan, every path (docstring)")
    add("--model", default="qwen3-30b-a3b", help=", ".join(MODELS))
    add("--nt", default="1,2,4,8,512")
    add("--paths", default="auto", help="auto or some of " + ", ".join(expert_tuning.PATHS))
    add("--reps", type=int, default=8, help="calls per executable (fewer past 256 tokens)")
    add("--layers", type=int, default=4, help="weight copies the calls cycle through")
    add("--qtype", default=None, help="override the gate / up format")
    add("--budget-s", type=float, default=75.0, help="--suite: no case started after")
    add("--jsonl", default=None)
    add("--out", default=None, help="the markdown table (and proposed EXPERT_PATHS)")
    add("--interpret", action="store_true", help="Pallas' interpreter (CPU smoke run)")
    add("--max-bm", type=int, default=None, help="expert_gemm.MAX_BM: token-block rows' cap")
    return ap.parse_args()


def main():
    a = parse_args()
    if a.max_bm:  # the blocked variants' token-block cap, read at trace time
        expert_gemm.MAX_BM = a.max_bm
    if a.suite:
        models, plan = ["qwen3-30b-a3b"], suite_plan()
    else:
        paths = a.paths.split(",")
        bad = [p for p in paths if p not in ("auto", *expert_tuning.PATHS)]
        if bad:
            raise SystemExit(f"--paths: {bad} not among auto, {', '.join(expert_tuning.PATHS)}")
        models = a.model.split(",")
        plan = [(int(nt), p) for nt in a.nt.split(",") for p in paths]
    rows, skipped, t0 = [], [], time.perf_counter()
    for name in models:
        if name not in MODELS:
            raise SystemExit(f"--model: {name!r} is not one of {', '.join(MODELS)}")
        m = build(name, a)
        for nt, path in plan:
            if a.suite and time.perf_counter() - t0 > a.budget_s:
                print(f"T={nt} {path}: not started (--budget-s {a.budget_s:.0f} spent)", flush=True)
                skipped.append(f"{path}@{nt}")
                continue
            try:
                rows.append(run_case(m, nt, path))
            except Exception as e:  # one path's failure must not cost the others' numbers
                print(f"T={nt} {path}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                skipped.append(f"{path}@{nt} (failed)")
            if a.out:  # after every case: a timeout keeps what was measured
                write_table(rows, skipped, a.out, " ".join(sys.argv[1:]))
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if a.out:
        write_table(rows, skipped, a.out, " ".join(sys.argv[1:]))
    print(f"proposed: {proposal(rows)}")


if __name__ == "__main__":
    main()
