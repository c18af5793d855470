"""GPU: where a decode step's time goes (issue 52's step profile; not part of the package).

usage: python tools/step_profile.py -m FILE.gguf [-p 512] [--short 16] [--long 80] [--json F]

Greedy decode of random prompt ids, traced twice with jax.profiler (CUPTI): once for `--short`
new tokens and once for `--long`. The difference of the two traces is `long - short` decode
tokens with the prompt's prefill and the fixed costs cancelled, so each row below is per decoded
token: kernel launches, device microseconds and their share, by kind of kernel (the name CUPTI
reports: our Pallas kernels by their function names, cuBLAS, XLA's fusions). The active weight
bytes of one token (every tensor once, the expert tensors at n_used / n_expert, the token
embedding's one row) over the step's device time gives the bytes per second the step streams.
"""

import argparse
import collections
import json
import re
import sys
import time

import gguf
import numpy as np

import minfer_jax

from minfer_bench.bench import kernel_timing as KB

# first match wins: (kind, pattern on the kernel's name)
KINDS = [
    ("expert GEMV (decode)", r"expert_glu|expert_down_sum|expert.*gemv"),
    ("expert GEMM / ragged", r"expert|ragged|grouped"),
    ("router", r"router|top_?k"),
    ("delta rule", r"delta"),
    ("attention", r"attention|attn|flash"),
    ("GEMV (Pallas)", r"gemv"),
    ("GEMM (Pallas)", r"gemm|matmul"),
    ("epilogues (Pallas)", r"split_sums|residual|rms|epilog"),
    ("cuBLAS", r"cublas|sm90_xmma|gemm_|cutlass|nvjet"),
    ("XLA fusions", r"fusion|loop_|input_|wrapped|reduce|copy|concatenate|slice|scatter|gather"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def active_weight_bytes(path: str) -> tuple[int, int]:
    """(bytes one decode token reads, the file's tensor bytes): experts at n_used / n_expert, the
    token embedding one row unless it is also the output head."""
    reader = gguf.GGUFReader(path)
    fields = {f.name: f for f in reader.fields.values()}

    def meta_int(suffix):
        for name, f in fields.items():
            if name.endswith(suffix):
                return int(f.parts[f.data[0]][0])
        return None

    n_expert, n_used = meta_int(".expert_count"), meta_int(".expert_used_count")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    total = active = 0
    for t in reader.tensors:
        nbytes = int(t.n_bytes)
        total += nbytes
        if "_exps" in t.name and n_expert:
            active += nbytes * n_used // n_expert
        elif t.name == "token_embd.weight" and not tied:
            active += nbytes // int(t.shape[-1])
        elif t.name.startswith("per_layer_token_embd"):
            active += nbytes // int(t.shape[-1])
        else:
            active += nbytes
    return active, total


def traced(model, ids, n: int) -> tuple[list, float]:
    """The GPU kernels of one greedy generate() of n tokens; ids must be new to the model (a slot
    holding their prefix would skip part of the prefill, which then no longer cancels)."""
    t0 = time.perf_counter()
    events = KB.device_kernel_events(
        lambda: minfer_jax.generate(model, ids, max_new_tokens=n, ignore_eos=True)
    )
    return events, time.perf_counter() - t0


def by_kind(events) -> dict[str, list[float]]:
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for _, dur, name in events:
        row = out[kind_of(name)]
        row[0] += 1
        row[1] += dur / 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens (random ids)")
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--top", type=int, default=12, help="the most expensive kernels to list")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    if args.long <= args.short:
        ap.error("--long must exceed --short")
    model = minfer_jax.load(args.model)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 100, size=args.prompt).tolist() for _ in range(3)]
    minfer_jax.generate(model, prompts[0], max_new_tokens=args.long, ignore_eos=True)  # compile
    short, _ = traced(model, prompts[1], args.short)
    long_, wall = traced(model, prompts[2], args.long)
    if not long_:
        print("no GPU kernel events in the trace (a GPU and CUPTI are needed)", file=sys.stderr)
        return 1
    tokens = args.long - args.short
    a, b = by_kind(short), by_kind(long_)
    rows = []
    for kind in sorted(set(a) | set(b), key=lambda k: -(b[k][1] - a[k][1])):
        launches = (b[kind][0] - a[kind][0]) / tokens
        us = (b[kind][1] - a[kind][1]) / tokens
        rows.append({"kind": kind, "launches": launches, "us": us})
    step_us = sum(r["us"] for r in rows)
    active, total = active_weight_bytes(args.model)
    names_a = collections.Counter(n for _, _, n in short)
    names_b = collections.Counter(n for _, _, n in long_)
    dur_b = collections.defaultdict(float)
    dur_a = collections.defaultdict(float)
    for _, d, n in long_:
        dur_b[n] += d / 1e3
    for _, d, n in short:
        dur_a[n] += d / 1e3
    print(
        f"{args.model}: {model.config.n_layers} layers, prompt {args.prompt}, decode tokens "
        f"{args.short} vs {args.long}; last traced call {wall:.2f} s wall"
    )
    print("| kind | launches / token | device us / token | share |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        share = 100 * r["us"] / step_us if step_us else 0.0
        print(f"| {r['kind']} | {r['launches']:.1f} | {r['us']:.1f} | {share:.1f} % |")
    launches = sum(r["launches"] for r in rows)
    print(f"| all | {launches:.1f} | {step_us:.1f} | 100 % |")
    print(
        f"\nactive weights per token {active / 2**20:.1f} MiB of {total / 2**30:.2f} GiB; "
        f"over the kernels' device time {active / step_us / 1e3:.0f} GB/s "
        f"({1e6 / step_us:.0f} tokens/s if nothing but the kernels ran)"
    )
    print(f"\nthe {args.top} costliest kernels per token:")
    top = sorted(dur_b, key=lambda n: -(dur_b[n] - dur_a[n]))[: args.top]
    for n in top:
        per = (dur_b[n] - dur_a[n]) / tokens
        count = (names_b[n] - names_a[n]) / tokens
        print(f"  {per:8.1f} us  x{count:5.1f}  {kind_of(n):22s} {n[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "active_bytes": active, "step_us": step_us}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
