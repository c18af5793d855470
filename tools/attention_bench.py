"""GPU: chunk (prefill) and decode attention, our Pallas kernels beside what jax ships, on one H200.

usage: PYTHONPATH=. python tools/attention_bench.py [--only chunk|decode] [--models 0.5b,7b]
           [--ts 512,1024,2048] [--starts 0,4096,16384,30720] [--batches 1,8,32]
           [--lengths 4096,16384,32768] [--nqs 1] [--splits 8,16,32,64] [--chunk-configs ...]
           [--decode-configs splits/bk/warps/stages,...] [--ours-only] [--reps 4] [--trials 2]
           [--check] [--out FILE.md]

Every candidate runs `reps` times unrolled in one executable, each call on its own f16 cache copy
(so K/V stream from HBM, not L2, and XLA cannot merge calls); a time is the device-timeline span of
the executable / reps (kernel_bench.device_span_us), best of --trials (2) traces. Caches are
[1 or B slots, Hkv, 32768, hd] (a 32k context), so the kernels must bound their own reads to
[0, len).

chunk: q [T, H, hd] at positions start .. start+T-1, keys [0, start+T). Candidates:
  ours bq/bk/w/s/split minfer_jax.pallas.attention.chunk_attention (one executable for all starts)
  cudnn mask           jax.nn.dot_product_attention(implementation="cudnn") with a [T, S] bool mask
                       (cuDNN's causal mask is top-left, no offset: the offset mask goes in as a
                       bias)
  cudnn causal/none    cuDNN's own causal mask: exact only at start 0; at start > 0 "no mask"
                       (T*S work instead of T*(S - T/2): an offset-causal cuDNN call, which jax does
                       not offer, would cost between (S - T/2) / S of it and all of it)
  pallas mha           jax.experimental.pallas.ops.gpu.attention.mha (no GQA: K/V repeated to H
                       heads; causal top-left only: causal at start 0, "no mask" as above otherwise)
  mgpu                 attention_mgpu.attention (Hopper Mosaic GPU; same causal caveat)
  xla                  the dense jnp path (attention.chunk_attention_reference) on the static slice
                       [0, S)
  external candidates get K/V already as [1, S, Hkv, hd] (their layout); the row "layout copy" is
  what gathering that from our cache costs per call.
decode: q [B, nq, H, hd], lengths all equal. Candidates: ours (k_splits list), jax's
  decode_attention.gqa (K/V as [B, 32768, Hkv, hd], kv_seq_len = lengths), cudnn with
  key_value_seq_lengths (those two at nq = 1 only), xla (decode_attention_reference over the whole
  slot). GB/s = K/V bytes of [0, len) per call / time.
--check: our kernels vs their references on f16 caches with junk past the visible range: max abs
  error, PASS/FAIL (tolerance 1e-2: p is rounded to f16 before the PV dot). Not part of the package.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from minfer_jax.pallas import attention as A
from minfer_jax.pallas import decode_attention as D

from minfer_bench.bench import kernel_timing as KB

MODELS = {
    "0.5b": (14, 2, 64),
    "1.5b": (12, 2, 128),
    "7b": (28, 4, 128),
    "32b": (40, 8, 128),
}  # H, Hkv, hd
MAX_LEN = 32768  # cache positions per slot (--max-len overrides it for smoke runs)
# block_q/block_k/warps/stages/k_splits (key-split programs: more of them where Hkv * row blocks is
# few)
CHUNK_CONFIGS = "64/64/4/2/1,128/64/4/2/1,128/128/8/2/1,64/64/4/2/4"
DECODE_SPLITS = [8, 16, 32, 64]
CHECK_TOL = 1e-2


@functools.cache
def unrolled(fn):
    """jit of [fn(*x) for x in xs]; cached per fn, so a kernel with traced positions compiles once
    for every start / length of one shape."""
    return jax.jit(lambda xs: [fn(*x) for x in xs])


TRIALS = 2  # device-span traces per timing (--trials); each trace costs host time, so few


def span_us(fn, inputs: list, trials: int | None = None) -> float:
    """Device time of one fn(*inputs[i]), from one executable running all of them unrolled."""
    exe = unrolled(fn)
    run = lambda: jax.block_until_ready(exe(inputs))  # noqa: E731
    run()
    spans = [KB.device_span_us(run) for _ in range(trials or TRIALS)]
    if spans[0] is None:  # no GPU trace (CPU smoke run): host clock
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e6 / len(inputs)
    return min(spans) / len(inputs)


def random_cache(key, n_slots, n_kv, head_dim, dtype=jnp.float16):
    kk, kv = jax.random.split(key)
    shape = (n_slots, n_kv, MAX_LEN, head_dim)
    return jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)


class Table:
    """Markdown rows, rewritten to --out after each one (a timeout keeps what was measured)."""

    def __init__(self, out: str | None):
        self.out, self.sections = out, []

    def section(self, title: str, header: list[str]):
        self.sections.append(
            [f"\n### {title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        )
        self._flush()

    def row(self, cells: list):
        line = "| " + " | ".join(str(c) for c in cells) + " |"
        self.sections[-1].append(line)
        print(line, flush=True)
        self._flush()

    def _flush(self):
        if self.out:
            with open(self.out, "w") as fh:
                fh.write("\n".join(line for s in self.sections for line in s) + "\n")


def tflops(flops: float):
    return lambda us: f"{flops / us / 1e6:.3g}"


def gbps(nbytes: float):
    return lambda us: f"{nbytes / us / 1e3:.4g}"


def attempt(table: Table, cells: list, run, rate):
    """One candidate's row: time run() and rate(us), or the error's first line."""
    try:
        us = run()
        table.row(cells + [f"{us:.1f}", rate(us)])
    except Exception as e:  # noqa: BLE001 - one failing candidate must not stop the others
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:160].replace("|", "/")
        table.row(cells + ["-", f"FAILED: {type(e).__name__}: {msg}"])


def external_chunk_candidates(h, hkv, hd, t, start):
    """(name, fn(q4, k4, v4)) for the candidates that take [1, T, H, hd] / [1, S, Hkv, hd]
    inputs."""
    s = start + t
    q_pos = start + jnp.arange(t)
    mask = (jnp.arange(s)[None, :] <= q_pos[:, None])[None, None]  # [1, 1, T, S]
    cands = [
        (
            "cudnn mask",
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, mask=mask, implementation="cudnn"
            ),
        )
    ]
    exact = start == 0
    cands.append(
        (
            f"cudnn {'causal' if exact else 'no mask (approx.)'}",
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=exact, implementation="cudnn"
            ),
        )
    )

    def pallas_mha(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as mha_mod

        rep = h // hkv
        bs = mha_mod.BlockSizes(block_q=128, block_k=64)
        return mha_mod.mha(
            q,
            jnp.repeat(k, rep, axis=2),
            jnp.repeat(v, rep, axis=2),
            None,
            sm_scale=hd**-0.5,
            causal=exact,
            block_sizes=bs,
        )

    def mgpu(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu as M

        cfg = M.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=exact)
        return M.attention(q * (hd**-0.5), k, v, cfg)  # it applies no sm_scale of its own

    kind = "causal" if exact else "no mask (approx.)"
    cands.append((f"pallas mha {kind}", pallas_mha))
    cands.append((f"mgpu {kind}", mgpu))
    return cands


def bthd_layout(k, v, s: int):
    """Slot 0's K/V [0, s) of our cache as [1, s, Hkv, hd], the layout cuDNN / mha / mgpu take."""
    return k[0, :, :s].transpose(1, 0, 2)[None], v[0, :, :s].transpose(1, 0, 2)[None]


def bench_chunk(a, table: Table):
    table.section(
        f"chunk attention (prefill), f16 cache of {MAX_LEN} positions, one slot",
        ["model", "T", "start", "candidate", "us", "TFLOP/s"],
    )
    for model in a.models:
        h, hkv, hd = MODELS[model]
        caches = [random_cache(jax.random.PRNGKey(i), 1, hkv, hd) for i in range(a.reps)]
        ours = {
            c: functools.partial(
                A.chunk_attention,
                block_q=c[0],
                block_k=c[1],
                num_warps=c[2],
                num_stages=c[3],
                k_splits=c[4],
                interpret=a.interpret,
            )
            for c in a.chunk_configs
        }
        for t in a.ts:
            qs = [
                jax.random.normal(jax.random.PRNGKey(100 + i), (t, h, hd), jnp.float16)
                for i in range(a.reps)
            ]
            for start in a.starts:
                if start + t > MAX_LEN:
                    continue
                s = start + t
                flops = 4.0 * t * (start + (t + 1) / 2) * h * hd  # QK and PV over the visible keys
                cells = [model, t, start]
                start_a = jnp.int32(start)
                slot0 = jnp.int32(0)
                ins = [(q, k, v, slot0, start_a) for q, (k, v) in zip(qs, caches)]
                for (bq, bk, warps, stages, splits), fn in ours.items():
                    attempt(
                        table,
                        cells + [f"ours bq{bq} bk{bk} w{warps} s{stages} split{splits}"],
                        lambda fn=fn, ins=ins: span_us(fn, ins),
                        tflops(flops),
                    )
                layout = functools.partial(bthd_layout, s=s)
                attempt(
                    table,
                    cells + ["layout copy (K/V to [1, S, Hkv, hd])"],
                    lambda layout=layout, caches=caches: span_us(layout, caches),
                    lambda us: "n/a",
                )
                ext_in = [(q[None], *layout(k, v)) for q, (k, v) in zip(qs, caches)]
                for name, fn in external_chunk_candidates(h, hkv, hd, t, start):
                    attempt(
                        table,
                        cells + [name],
                        lambda fn=fn, ext_in=ext_in: span_us(fn, ext_in),
                        tflops(flops),
                    )
                xla_in = [
                    (q, k[:, :, :s], v[:, :, :s], slot0, start_a) for q, (k, v) in zip(qs, caches)
                ]
                attempt(
                    table,
                    cells + ["xla (dense, static slice [0, S))"],
                    lambda xla_in=xla_in: span_us(A.chunk_attention_reference, xla_in),
                    tflops(flops),
                )
                del ext_in, xla_in


def jax_gqa(q, k, v, lengths):
    """jax's Pallas flash-decoding: q [B, 1, H, hd], k/v [B, S, Hkv, hd]."""
    from jax.experimental.pallas.ops.gpu import decode_attention as G

    return G.gqa(q[:, 0], k, v, kv_seq_len=lengths, k_splits=16)


def cudnn_decode(q, k, v, lengths):
    """cuDNN with a key padding mask: q [B, 1, H, hd], k/v [B, S, Hkv, hd]."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        query_seq_lengths=jnp.ones_like(lengths),
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )


def bench_decode(a, table: Table):
    table.section(
        f"decode attention, f16 caches of {MAX_LEN} positions per slot, all rows at one length",
        ["model", "B", "nq", "len", "candidate", "us", "K/V GB/s"],
    )
    for model in a.models:
        h, hkv, hd = MODELS[model]
        for b in a.batches:
            copy_bytes = 2 * b * hkv * MAX_LEN * hd * 2
            reps = max(2, min(a.reps, int(24e9 // copy_bytes)))
            caches = [random_cache(jax.random.PRNGKey(i), b, hkv, hd) for i in range(reps)]
            ext_caches = [
                (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) for k, v in caches
            ]  # [B, S, Hkv, hd]
            slots = jnp.arange(b, dtype=jnp.int32)
            ours = {
                f"ours k_splits {n} bk64": functools.partial(
                    D.decode_attention, k_splits=n, interpret=a.interpret
                )
                for n in a.splits
            } | {
                f"ours {'/'.join(map(str, c))}": functools.partial(
                    D.decode_attention,
                    k_splits=c[0] if c[0] > 0 else None,  # -1: decode_config's default
                    row_programs=c[0] == 0,  # splits 0: one program per query row
                    block_k=c[1],
                    num_warps=c[2],
                    num_stages=c[3],
                    interpret=a.interpret,
                )
                for c in a.decode_configs
            }
            for nq in a.nqs:
                qs = [
                    jax.random.normal(jax.random.PRNGKey(200 + i), (b, nq, h, hd), jnp.float16)
                    for i in range(reps)
                ]
                for length in a.lengths:
                    cells = [model, b, nq, length]
                    rate = gbps(2.0 * b * hkv * length * hd * 2)
                    lens = jnp.full((b,), length, jnp.int32)
                    ins = [(q, k, v, slots, lens) for q, (k, v) in zip(qs, caches)]
                    for name, fn in ours.items():
                        attempt(
                            table,
                            cells + [name],
                            lambda fn=fn, ins=ins: span_us(fn, ins),
                            rate,
                        )
                    # jax's gqa and this cuDNN call have no causal offset for several tokens
                    if nq == 1 and not a.ours_only:
                        ext_in = [(q, k, v, lens) for q, (k, v) in zip(qs, ext_caches)]
                        attempt(
                            table,
                            cells + ["jax pallas decode_attention.gqa k_splits 16"],
                            lambda ext_in=ext_in: span_us(jax_gqa, ext_in),
                            rate,
                        )
                        attempt(
                            table,
                            cells + ["cudnn key_value_seq_lengths"],
                            lambda ext_in=ext_in: span_us(cudnn_decode, ext_in),
                            rate,
                        )
                    if a.ours_only:
                        continue
                    attempt(
                        table,
                        cells + ["xla (dense over the whole slot)"],
                        lambda ins=ins: span_us(D.decode_attention_reference, ins),
                        rate,
                    )
            del caches, ext_caches


def junk_cache(key, n_slots, n_kv, max_len, hd, visible: dict[int, int]):
    """f16 k/v: random below visible[slot], 3e4 / -3e4 junk elsewhere."""
    k, v = (
        jax.random.normal(kk, (n_slots, n_kv, max_len, hd), jnp.float16)
        for kk in jax.random.split(key)
    )
    mask = np.zeros((n_slots, 1, max_len, 1), bool)
    for slot, n in visible.items():
        mask[slot, 0, :n] = True
    return jnp.where(mask, k, jnp.float16(3e4)), jnp.where(mask, v, jnp.float16(-3e4))


def run_checks(interpret: bool = False) -> bool:
    """Our kernels vs their references at a few shapes on f16 caches; prints PASS/FAIL lines."""
    ok = True

    def report(name, got, ref):
        nonlocal ok
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
        good = bool(np.isfinite(err)) and err < CHECK_TOL
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} {name}: max abs err {err:.2e}", flush=True)

    chunk_cases = [
        ("0.5b", 64, 4097 - 64, {}),
        ("0.5b", 512, 1000, {}),
        ("7b", 512, 3000, {}),
        ("7b", 16, 0, {"block_q": 16, "block_k": 16}),
        ("1.5b", 256, 255, {"block_q": 128, "block_k": 128}),
        ("32b", 128, 700, {}),
        ("7b", 2048, 4096, {"block_q": 128, "block_k": 128, "num_warps": 8}),
        ("0.5b", 1024, 5000, {"k_splits": 4}),
        ("7b", 512, 7000, {"k_splits": 2, "num_stages": 3}),
    ]
    for model, t, start, blocks in chunk_cases:
        h, hkv, hd = MODELS[model]
        try:
            k, v = junk_cache(jax.random.PRNGKey(t), 3, hkv, 8192, hd, {1: start + t})
            q = jax.random.normal(jax.random.PRNGKey(start), (t, h, hd), jnp.float16)
            got = A.chunk_attention(
                q, k, v, jnp.int32(1), jnp.int32(start), interpret=interpret, **blocks
            )
            report(
                f"chunk {model} T={t} start={start} {blocks}",
                got,
                A.chunk_attention_reference(q, k, v, jnp.int32(1), jnp.int32(start)),
            )
        except Exception:  # noqa: BLE001
            ok = False
            print(
                f"FAIL chunk {model} T={t} start={start}: "
                f"{traceback.format_exc().splitlines()[-1]}",
                flush=True,
            )
    decode_cases = [
        ("0.5b", (1, 17, 4097), 1, None),
        ("7b", (255, 4097, 8), 8, 8),
        ("0.5b", (300, 9000), 3, 64),
        ("32b", (5000,), 1, None),
    ]
    for model, lengths, nq, splits in decode_cases:
        h, hkv, hd = MODELS[model]
        try:
            slots = list(range(len(lengths)))[::-1]
            k, v = junk_cache(
                jax.random.PRNGKey(nq), len(lengths), hkv, 9216, hd, dict(zip(slots, lengths))
            )
            q = jax.random.normal(jax.random.PRNGKey(7), (len(lengths), nq, h, hd), jnp.float16)
            s_a, l_a = jnp.array(slots, jnp.int32), jnp.array(lengths, jnp.int32)
            got = D.decode_attention(q, k, v, s_a, l_a, k_splits=splits, interpret=interpret)
            report(
                f"decode {model} lengths={lengths} nq={nq} k_splits={splits}",
                got,
                D.decode_attention_reference(q, k, v, s_a, l_a),
            )
        except Exception:  # noqa: BLE001
            ok = False
            print(
                f"FAIL decode {model} lengths={lengths} nq={nq}: "
                f"{traceback.format_exc().splitlines()[-1]}",
                flush=True,
            )
    print("CHECK", "PASS" if ok else "FAIL", flush=True)
    return ok


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    global MAX_LEN, TRIALS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["chunk", "decode", "none"], default=None)
    ap.add_argument("--models", default="0.5b,7b")
    ap.add_argument("--ts", type=ints, default=[512, 1024, 2048])
    ap.add_argument("--starts", type=ints, default=[0, 4096, 16384, 30720])
    ap.add_argument("--batches", type=ints, default=[1, 8, 32])
    ap.add_argument("--lengths", type=ints, default=[4096, 16384, 32768])
    ap.add_argument("--splits", type=ints, default=DECODE_SPLITS)
    ap.add_argument("--nqs", type=ints, default=[1], help="decode query tokens per row (1..8)")
    ap.add_argument(
        "--chunk-configs", default=CHUNK_CONFIGS, help="bq/bk/warps/stages/splits,... for ours"
    )
    ap.add_argument(
        "--decode-configs",
        default="",
        help="splits/block_k/warps/stages,... more decode candidates of ours (splits 0: one "
        "program per query row, DecodeConfig.row_programs; -1: the default splits)",
    )
    ap.add_argument(
        "--ours-only", action="store_true", help="decode: no jax / cuDNN / XLA candidates"
    )
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="our kernels interpreted (CPU smoke run of this script)",
    )
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    MAX_LEN, TRIALS = a.max_len, a.trials
    a.decode_configs = [
        tuple(int(x) for x in c.split("/")) for c in a.decode_configs.split(",") if c
    ]
    a.chunk_configs = [tuple(int(x) for x in c.split("/")) for c in a.chunk_configs.split(",") if c]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    ok = run_checks(a.interpret) if a.check else True
    table = Table(a.out)
    if a.only in (None, "chunk"):
        bench_chunk(a, table)
    if a.only in (None, "decode"):
        bench_decode(a, table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
