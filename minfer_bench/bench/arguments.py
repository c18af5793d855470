"""scripts/bench.py's flags: the argparse parser, its groups and their help text (bench/cli.py
checks the values and runs them)."""

from __future__ import annotations

import argparse

from minfer_jax.engine import options
from minfer_jax.engine.flags import StrictParser, add_llama_noops, add_llama_refusals
from minfer_jax.engine.spec_flags import SPEC_FLAGS, add_spec_flag

from minfer_bench.bench.fields import OUTPUT_FORMATS
from minfer_bench.bench.parsing import BenchError
from minfer_bench.synthetic import SYNTHETIC_CONFIGS


class _Parser(StrictParser):
    def error(self, message):  # one line, exit 2
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bench.py",
        description="minfer_jax benchmark: llama-bench compatible model tests (ppN, tgN, ppN+tgM) "
        "and per-shape kernel timings (--matmuls). Timing is taken around compiled "
        "executables after a warm-up run; see minfer_bench/bench/ for the exact "
        "definitions.",
        epilog="Multiple values can be given as comma lists or ranges (first-last, "
        "first-last+step, first-last*mult), as in llama-bench. Examples:\n"
        "  bench.py -m model.gguf -p 512 -n 128 -r 5\n"
        "  bench.py --synthetic qwen2.5-7b:q4_k_m -p 512 -n 128 -o md --out rows.json\n"
        "  bench.py --synthetic qwen2.5-0.5b:q4_k_m --write-gguf /tmp/s.gguf\n"
        "  bench.py --ggml-shapes\n"
        "  bench.py --matmuls --synthetic qwen2.5-7b:q4_k_m --nt 1,512\n"
        "  bench.py --shapes q4_k:4096x14336,q8_0:4096x14336 --nt 1,8,512",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_args(p.add_argument_group("model"))
    _test_args(p.add_argument_group("tests (llama-bench)"))
    _execution_args(p.add_argument_group("execution"))
    _kernel_args(p.add_argument_group("kernel mode"))
    _batched_args(p.add_argument_group("batched mode (llama-batched-bench)"))
    _spec_args(p.add_argument_group("speculative mode"))
    _startup_args(p.add_argument_group("startup mode"))
    _output_args(p.add_argument_group("output"))
    # llama-bench's -t / -ngl / -fa (lists there); -r is its repetitions, as here
    add_llama_noops(
        p.add_argument_group("llama-bench flags that mean nothing here"),
        ("threads", "gpu_layers", "flash_attn"),
    )
    refused = ("conversation", "no_conversation", "single_turn", "escape", "ignore_eos")
    add_llama_refusals(p, "bench.py", refused)
    return p


def _model_args(g) -> None:
    g.add_argument(
        "-m",
        "--model",
        action="append",
        default=[],
        metavar="FILE",
        help="GGUF model path (or 'default', or hf:<repo>:<file>); comma list or repeated",
    )
    g.add_argument(
        "--synthetic",
        action="append",
        default=[],
        metavar="SPEC",
        help="in-memory random-weight model '<config>:<ftype>' (configs: "
        + ", ".join(SYNTHETIC_CONFIGS)
        + "; ftypes: q4_k_m, q4_0, q8_0, q6_k, ...); comma list or repeated",
    )
    g.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="synthetic models only: override the layer count (quick runs)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of synthetic weights, random token ids and kernel inputs (default: 0)",
    )
    g.add_argument(
        "--write-gguf",
        default=None,
        metavar="PATH",
        help="write the (single) synthetic model as a GGUF file for llama.cpp, then exit; "
        "with -p/-n/-pg given explicitly, also run the benchmark",
    )


def _test_args(g) -> None:
    g.add_argument(
        "-p",
        "--n-prompt",
        action="append",
        default=None,
        metavar="N",
        help="prompt sizes for ppN tests (default: 512)",
    )
    g.add_argument(
        "-n",
        "--n-gen",
        action="append",
        default=None,
        metavar="N",
        help="generation lengths for tgN tests (default: 128)",
    )
    g.add_argument(
        "-pg",
        action="append",
        default=[],
        metavar="PP,TG",
        help="prefill PP tokens then generate TG, timed together: test 'ppPP+tgTG', t/s = (PP+TG) "
        "/ time; repeat the flag for several pairs",
    )
    g.add_argument(
        "-d",
        "--n-depth",
        action="append",
        default=None,
        metavar="N",
        help="tokens already in the cache before each timed test, filled untimed (list; default 0)",
    )
    g.add_argument(
        "-r",
        "--repetitions",
        type=int,
        default=None,
        metavar="N",
        help="timed runs per test (kernel mode: timed trials per case; --startup: cold + warm "
        "process pairs) (default: 5; --startup: 1)",
    )
    g.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        metavar="N",
        help="KV cache length for every test (default: smallest power of two >= prompt + gen)",
    )
    g.add_argument(
        "--no-warmup", action="store_true", help="skip the untimed warm-up run of each test/case"
    )


def _execution_args(g) -> None:
    options.add_arguments(g)  # --kernels, --gemm, --weights, --deterministic, --precise, ...
    g.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="disable JAX's persistent compilation cache (compile times then always mean a fresh "
        "compile)",
    )
    g.add_argument(
        "--mem-bw",
        default="auto",
        metavar="auto|measure|none|GBPS",
        help="device memory bandwidth for '%% bw': auto = on a GPU the table (H200: 4200 GB/s, "
        "H100: 3350, H100 PCIe: 2000, H100 NVL: 3900) else measured (ten dependent sums over "
        "1 GiB of f32 in one executable), on a CPU none; measure; a number in GB/s; or none "
        "(default: auto)",
    )


def _kernel_args(g) -> None:
    g.add_argument(
        "--matmuls",
        action="store_true",
        help="kernel mode: time each distinct (type, out, in) matmul the model(s) run (fused "
        "q/k/v and gate/up as loaded) instead of whole-model tests",
    )
    g.add_argument(
        "--shapes",
        default=None,
        metavar="LIST",
        help="explicit kernel cases TYPE:OUTxIN, comma separated, e.g. "
        "q4_k:4096x14336,q8_0:4096x14336",
    )
    g.add_argument(
        "--ggml-shapes",
        action="store_true",
        help="the cases of ggml's MUL_MAT table (Q4_0/Q5_0/Q8_0/Q4_K/Q6_K 4096x14336, Q4_K "
        "4096x4096 and 14336x4096; nt 1, and 8/512 where ggml lists them), with ggml's times",
    )
    g.add_argument(
        "--nt",
        default=None,
        metavar="LIST",
        help="token counts per kernel case (default: 1,512; --ggml-shapes: ggml's own)",
    )
    g.add_argument(
        "--kernel-reps",
        type=int,
        default=None,
        metavar="N",
        help="matmul calls unrolled in one timed executable, each on its own weight copy; per-call "
        "time = the executable's span on the device timeline / N (default: up to 40, "
        "fewer for big matrices)",
    )


def _batched_args(g) -> None:
    g.add_argument(
        "--batched",
        action="store_true",
        help="llama-batched-bench's table: B sequences of -npp prompt tokens, -ntg decoded "
        "together",
    )
    g.add_argument(
        "-npp",
        action="append",
        default=None,
        metavar="N",
        help="prompt tokens per sequence (default 512)",
    )
    g.add_argument(
        "-ntg",
        action="append",
        default=None,
        metavar="N",
        help="tokens generated per sequence (default 128)",
    )
    g.add_argument(
        "-npl",
        action="append",
        default=None,
        metavar="B",
        help="sequences decoded at once, a list (default 1,2,4,8,16,32)",
    )


def _spec_args(g) -> None:
    g.add_argument(
        "--spec",
        metavar="TYPE",
        choices=["ngram-simple", "lookup", "draft", "draft-simple"],
        help="speculative decoding (prompt lookup, or a draft model with -md) against plain "
        "decode on the named workloads code-edit and text (greedy, -n tokens, best of -r), then "
        "the verification step's cost per draft bucket at depth -d",
    )
    meaning = {dest: flag.meaning for dest, flag in SPEC_FLAGS.items()}
    add_spec_flag(
        g,
        "model_draft",
        "--spec draft: the draft model, a GGUF path or a synthetic spec "
        "(synthetic:qwen2.5-0.5b:q8_0), loaded with the target's options",
    )
    add_spec_flag(g, "draft_p_min", "--spec draft: " + meaning["draft_p_min"])
    add_spec_flag(g, "draft_max", "--spec: " + meaning["draft_max"])
    add_spec_flag(g, "draft_min", "--spec: " + meaning["draft_min"])


def _startup_args(g) -> None:
    g.add_argument(
        "--startup",
        action="store_true",
        help="time fresh processes phase by phase, cold (empty cache directories) then warm: the "
        "CLI's run command until its first text, or with --server the server until /health "
        "is 200; -m MODEL (default: the built-in model) or --synthetic SPEC, -n tokens "
        "(default 64)",
    )
    g.add_argument(
        "--server",
        action="store_true",
        help="--startup: time `python -m minfer_jax.server` instead",
    )
    g.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="--startup --server: slots (-np)",
    )
    g.add_argument(
        "--startup-timeout",
        type=float,
        default=1200.0,
        metavar="S",
        help="--startup: give up on a process after S seconds (default 1200)",
    )
    g.add_argument(
        "--startup-dir",
        default=None,
        metavar="DIR",
        help="--startup: where the runs' cache directories go (default: the system's temp "
        "directory)",
    )
    g.add_argument(
        "--startup-keep",
        action="store_true",
        help="--startup: keep the cache directories afterwards",
    )
    g.add_argument(
        "--startup-runs",
        choices=("both", "cold", "warm"),
        default="both",
        help="--startup: which runs, each repetition (default both: cold, then warm on its caches)",
    )
    g.add_argument(
        "--startup-cache",
        default=None,
        metavar="DIR",
        help="--startup: use and keep this cache directory (a cold run needs it empty), e.g. to "
        "time cold and warm in two invocations; synthetic models are written under DIR/models",
    )


def _output_args(g) -> None:
    g.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default="md",
        help="format printed to stdout (default: md)",
    )
    g.add_argument(
        "--out",
        action="append",
        default=[],
        metavar="FILE",
        help="also write to FILE; format from its extension (.md .csv .json .jsonl), else -o; "
        "repeatable",
    )
    g.add_argument(
        "--progress", action="store_true", help="print progress (compiles, runs) to stderr"
    )
