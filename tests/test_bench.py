"""scripts/bench.py / minfer_bench.bench on CPU: output shape and fields (never speed), kernel mode,
errors."""

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from kernel_mode import KERNELS
from minfer_jax.sizes import pow2_at_least
from tests.configs import tiny_config

from minfer_bench.bench import cli, fields, kernel_cases, model_tests, parsing
from minfer_bench.synthetic import SYNTHETIC_CONFIGS, synthetic_model, synthetic_shapes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--synthetic", "qwen2.5-0.5b:q4_0", "--layers", "1"]


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True, scope="module")
def _no_persistent_cache():
    old = os.environ.get("MINFER_COMPILATION_CACHE")
    os.environ["MINFER_COMPILATION_CACHE"] = "off"  # never write a compilation cache from tests
    yield
    if old is None:
        os.environ.pop("MINFER_COMPILATION_CACHE", None)
    else:
        os.environ["MINFER_COMPILATION_CACHE"] = old


# --------------------------------------------------------------------------------------- model mode


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    paths = {ext: str(d / f"rows.{ext}") for ext in ("json", "csv", "jsonl", "md")}
    argv = (
        TINY
        + ["-p", "16", "-n", "4", "-pg", "16,4", "-r", "2", "-o", "md"]
        + [a for p in paths.values() for a in ("--out", p)]
    )
    rc, out, err = run_main(argv)
    files = {}
    for ext, p in paths.items():
        with open(p, encoding="utf-8") as fh:
            files[ext] = fh.read()
    return rc, out, err, files


def test_model_md(model_run):
    rc, out, err, files = model_run
    assert rc == 0, err
    assert files["md"] == out  # --out FILE.md holds exactly what stdout got
    lines = out.splitlines()
    assert lines[0].startswith("minfer_jax bench (model) | ")
    for part in (
        "device: cpu",
        "jax ",
        "kernels: xla",
        "cmd: scripts/bench.py --synthetic qwen2.5-0.5b:q4_0",
    ):
        assert part in lines[0]
    table = [ln for ln in lines if ln.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[:7] == [
        "model",
        "size",
        "params",
        "backend",
        "threads",
        "test",
        "t/s",
    ]  # llama-bench, CPU backend
    for col in ("compile s", "GB/s", "% bw", "peak mem", "ctx", "bucket"):
        assert col in head
    assert set(table[1].replace("|", "").replace(" ", "")) <= set("-:")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table[2:]]
    assert [r[head.index("test")] for r in rows] == ["pp16", "tg4", "pp16+tg4"]
    for r in rows:
        assert r[0] == "qwen2 ?B Q4_0"  # llama_model_desc: 1 layer is no known size
        assert r[1].endswith("MiB") and r[2].endswith(" M")
        assert " ± " in r[head.index("t/s")]
    assert rows[1][head.index("GB/s")] not in ("-", "n/a")
    assert lines[-1].startswith("build: ")


def test_model_json(model_run):
    rc, _, err, files = model_run
    assert rc == 0, err
    rows = json.loads(files["json"])
    assert len(rows) == 3
    for r in rows:
        keys = list(r)
        assert (
            keys[: len(fields.LLAMA_BENCH_FIELDS)] == fields.LLAMA_BENCH_FIELDS
        )  # llama-bench's fields, in order
        assert keys[-2:] == ["samples_ns", "samples_ts"]
        assert isinstance(r["avg_ns"], int) and isinstance(r["avg_ts"], float)
        assert isinstance(r["flash_attn"], bool) and isinstance(r["n_prompt"], int)
        assert r["backends"] == "JAX-CPU" and r["model_type"] == "qwen2 ?B Q4_0"
        assert r["model_filename"] == "synthetic:qwen2.5-0.5b:q4_0:layers=1"
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 2
        n_tok = r["n_prompt"] + r["n_gen"]
        assert r["avg_ns"] == sum(r["samples_ns"]) // 2
        assert r["avg_ts"] == pytest.approx(np.mean([1e9 * n_tok / s for s in r["samples_ns"]]))
        assert r["stddev_ts"] == pytest.approx(np.std(r["samples_ts"], ddof=1))
        assert r["compile_s"] > 0 and r["jax_version"] and r["kernels"] == "xla"
    pp, tg, pg = rows
    assert (pp["n_prompt"], pp["n_gen"], pp["n_ctx"], pp["bucket"]) == (16, 0, 16, 16)
    assert (tg["n_prompt"], tg["n_gen"], tg["n_ctx"], tg["bucket"]) == (0, 4, 4, None)
    assert (pg["n_prompt"], pg["n_gen"], pg["n_ctx"], pg["bucket"]) == (16, 4, 32, 16)
    assert [r["test"] for r in rows] == ["pp16", "tg4", "pp16+tg4"]
    assert tg["weight_gbps"] > 0 and pp["weight_gbps"] is None and pg["weight_gbps"] is None
    assert pp["matmul_tflops"] > 0
    assert tg["weight_gbps"] == pytest.approx(
        tg["weight_bytes_per_token"] * 4 / (tg["avg_ns"] * 1e-9) / 1e9
    )
    gm = synthetic_model("qwen2.5-0.5b:q4_0", layers=1)
    assert pp["model_size"] == sum(t.nbytes for t in gm.tensors.values())
    assert pp["model_n_params"] == sum(int(np.prod(t.shape)) for t in gm.tensors.values())


def test_model_csv_jsonl(model_run):
    rc, _, err, files = model_run
    assert rc == 0, err
    lines = files["csv"].splitlines()
    assert lines[0].split(",") == fields.MODEL_FIELDS
    assert all(
        ln.startswith('"') and ln.endswith('"') for ln in lines[1:]
    )  # llama-bench quotes every value
    rows = list(csv.DictReader(io.StringIO(files["csv"])))
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [("16", "0"), ("0", "4"), ("16", "4")]
    assert (
        rows[0]["flash_attn"] == "0"
        and rows[1]["weight_gbps"] != ""
        and rows[0]["weight_gbps"] == ""
    )
    jl = [json.loads(ln) for ln in files["jsonl"].splitlines()]
    assert [r["test"] for r in jl] == ["pp16", "tg4", "pp16+tg4"]


def test_write_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    rc, out, err = run_main(TINY + ["--write-gguf", str(path)])
    assert rc == 0, err
    assert out == ""  # no -p/-n/-pg given: write, then exit
    from minfer_jax.model.from_gguf import load_gguf

    back, mem = load_gguf(str(path)), synthetic_model("qwen2.5-0.5b:q4_0", layers=1)
    assert back.config == mem.config
    assert {n: (t.qtype, t.shape) for n, t in back.tensors.items()} == {
        n: (t.qtype, t.shape) for n, t in mem.tensors.items()
    }
    assert fields.model_type(back) == fields.model_type(mem)


# -------------------------------------------------------------------------------------- kernel mode


@pytest.mark.parametrize(
    "impl,kinds,tol", [("xla", ["xla", "xla"], 0.0), (KERNELS, ["gemv", "gemm"], 1e-3)]
)
def test_kernel_mode(impl, kinds, tol):
    rc, out, err = run_main(
        [
            "--shapes",
            "q4_0:128x256",
            "--nt",
            "1,16",
            "-r",
            "2",
            "--kernels",
            impl,
            "--kernel-reps",
            "2",
            "-o",
            "json",
            "--mem-bw",
            "100",
        ]
    )
    assert rc == 0, err
    assert "minfer_jax bench (kernels)" in err  # the header line goes to stderr for json
    rows = json.loads(out)
    assert [r["nt"] for r in rows] == [1, 16]
    assert [r["kernel"] for r in rows] == kinds
    for r in rows:
        assert list(r)[:-1] == fields.KERNEL_FIELDS and len(r["samples_us"]) == 2
        assert (r["qtype"], r["n_out"], r["n_in"], r["impl"], r["reps"]) == (
            "Q4_0",
            128,
            256,
            impl,
            2,
        )
        assert r["weight_bytes"] == 128 * 256 // 2 + 128 * 256 // 32 * 2
        assert r["avg_us"] > 0 and r["best_us"] <= max(r["samples_us"]) and r["compile_s"] > 0
        assert r["rel_err"] <= tol
        assert r["gbps"] == pytest.approx(r["weight_bytes"] / r["avg_us"] / 1e3)
        assert r["pct_mem_bw"] == pytest.approx(r["gbps"])  # --mem-bw 100 GB/s
        assert r["tflops"] == pytest.approx(2 * r["nt"] * 128 * 256 / r["avg_us"] / 1e6)
        assert r["ggml_us"] is None


def test_kernel_mode_md():
    rc, out, err = run_main(
        [
            "--shapes",
            "q8_0:128x64",
            "--nt",
            "2",
            "-r",
            "1",
            "--kernel-reps",
            "2",
            "--mem-bw",
            "none",
        ]
    )
    assert rc == 0, err
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[:6] == ["type", "out x in", "nt", "kernel", "tensors", "us"]
    row = [c.strip() for c in table[2].strip("|").split("|")]
    assert row[:4] == ["Q8_0", "128 x 64", "2", "xla"] and row[head.index("% bw")] == "n/a"


def test_model_kernel_cases():
    types_, shapes, tied, label = synthetic_shapes("qwen2.5-7b:q4_k_m", None)
    cases = kernel_cases.model_matmul_cases(types_, shapes, tied, [1, 512], label)
    # the matmuls one decode step runs, as the loader fuses them: q/k/v in one (14 layers) or
    # q+k and v (the 14 whose v is Q6_K), gate+up, attn_output, ffn_down; plus the head
    assert sum(c.count for c in cases) == 4 * 28 + 14 + 1
    assert len({(c.qtype, c.n, c.k) for c in cases}) == len(cases)
    by = {(c.qtype.name, c.n, c.k): c for c in cases}
    assert by[("Q4_K", 3584, 3584)].tensors == "attn_output x28"
    assert by[("Q4_K", 3584 + 2 * 512, 3584)].tensors == "attn_q+attn_k+attn_v x14"
    assert by[("Q4_K", 3584 + 512, 3584)].tensors == "attn_q+attn_k x14"
    assert by[("Q6_K", 512, 3584)].tensors == "attn_v x14"
    assert by[("Q4_K", 2 * 18944, 3584)].tensors == "ffn_gate+ffn_up x28"
    assert by[("Q6_K", 152064, 3584)].tensors == "output"
    assert {c.qtype.name for c in cases if "ffn_down" in c.tensors} == {"Q4_K", "Q6_K"}
    assert all(c.nts == (1, 512) for c in cases)
    # tied head (0.5B): token_embd is the head's matrix
    t2, s2, tied2, _ = synthetic_shapes("qwen2.5-0.5b:q4_k_m", 2)
    assert tied2 and any(
        c.tensors == "output" and c.n == 151936
        for c in kernel_cases.model_matmul_cases(t2, s2, tied2, [1], "")
    )


def test_kernel_cases_are_the_loaders_weights():
    """model_matmul_cases counts exactly the weights load_params builds: same fusion, types,
    shapes."""
    import collections

    from minfer_jax.model.weights import load_params

    from minfer_bench.quant_mix import tensor_types
    from minfer_bench.synthetic import synthetic_model_from_config

    cfg = tiny_config()
    types_ = tensor_types(
        cfg, "q4_k_m"
    )  # layer 2: Q6_K attn_v and ffn_down beside Q4_K -> [q; k] and v
    assert (
        types_["blk.2.attn_v.weight"]
        != types_["blk.2.attn_q.weight"]
        == types_["blk.0.attn_v.weight"]
    )
    gm = synthetic_model_from_config(cfg, types_, seed=0)
    params = load_params(gm)
    loaded = collections.Counter(
        (w.qtype, *w.shape)
        for layer in params.layers
        for w in (*layer.qkv, layer.wo, *layer.gate_up, layer.w_down)
    )
    loaded[(params.head.qtype, *params.head.shape)] += 1
    cases = kernel_cases.model_matmul_cases(
        {n: t.qtype for n, t in gm.tensors.items()},
        {n: t.shape for n, t in gm.tensors.items()},
        cfg.tied_output,
        [1],
        "",
    )
    assert {(c.qtype, c.n, c.k): c.count for c in cases} == dict(loaded)
    assert any(c.tensors == "attn_q+attn_k" for c in cases) and any(
        c.tensors == "attn_q+attn_k+attn_v x2" for c in cases
    )


def test_ggml_cases():
    cases = kernel_cases.ggml_cases(None)
    assert sum(len(c.nts) for c in cases) == 13  # the 13 rows of ggml's MUL_MAT table
    assert {(c.qtype.name, c.n, c.k) for c in cases} >= {
        ("Q4_K", 4096, 4096),
        ("Q4_K", 14336, 4096),
    }
    assert all(c.nts == (1,) for c in kernel_cases.ggml_cases([1]))


# ----------------------------------------------------------------------------------- parsing, names


def test_parse_helpers():
    assert parsing.parse_int_range("128,512") == [128, 512]
    assert parsing.parse_int_range("16-128*2") == [16, 32, 64, 128]
    assert parsing.parse_int_range("1-3,8-16+4") == [1, 2, 3, 8, 12, 16]
    assert parsing.parse_pg("512,128") == (512, 128)
    assert [t.name for t in model_tests.build_tests([512, 0], [128], [(512, 128)])] == [
        "pp512",
        "tg128",
        "pp512+tg128",
    ]
    assert pow2_at_least(1) == 1 and pow2_at_least(20) == 32 and pow2_at_least(512) == 512
    assert [
        (q.name, n, k) for q, n, k in parsing.parse_shapes("q4_k:4096x14336,Q8_0:4096x14336")
    ] == [("Q4_K", 4096, 14336), ("Q8_0", 4096, 14336)]


def test_model_type_names():
    def desc(cfg_name, ftype):
        return fields.model_type(
            types.SimpleNamespace(
                config=SYNTHETIC_CONFIGS[cfg_name],
                metadata={"general.architecture": "qwen2", "general.file_type": ftype},
            )
        )

    assert desc("qwen2.5-7b", 15) == "qwen2 7B Q4_K - Medium"
    assert (
        desc("qwen2.5-0.5b", 15) == "qwen2 1B Q4_K - Medium"
    )  # llama.cpp's name for 24 layers, n_embd 896
    assert desc("qwen2.5-1.5b", 2) == "qwen2 1.5B Q4_0"
    assert desc("qwen2.5-14b", 7) == "qwen2 14B Q8_0"
    assert desc("qwen2.5-3b", 15 | 1024) == "qwen2 3B Q4_K - Medium (guessed)"


@pytest.mark.parametrize(
    "cfg_name,want",
    [  # llama-bench's model_type of the same files (H200, 2026-12-02); 30 layers: llama.cpp's 256M
        ("llama3.1-8b", "llama 8B Q4_K - Medium"),
        ("qwen3-8b", "qwen3 8B Q4_K - Medium"),
        ("gemma3-1b", "gemma3 1B Q4_K - Medium"),
        ("smollm2-135m", "llama 256M Q4_K - Medium"),
        ("gemma3-tiny", "gemma3 ?B Q4_K - Medium"),
        ("qwen3-30b-a3b", "qwen3moe 30B.A3B Q4_K - Medium"),
        ("mixtral-8x7b", "llama 8x7B Q4_K - Medium"),
        ("qwen3.6-35b-a3b", "qwen35moe 35B.A3B Q4_K - Medium"),  # llama.cpp's qwen35moe.cpp
    ],
)
def test_model_type_names_of_the_families(cfg_name, want):
    cfg = SYNTHETIC_CONFIGS[cfg_name]
    md = {"general.architecture": cfg.family, "general.file_type": 15}
    assert fields.model_type(types.SimpleNamespace(config=cfg, metadata=md)) == want


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--synthetic", "qwen2.5-9b:q4_k_m"], "bad synthetic model spec"),
        (["--synthetic", "qwen2.5-7b:q9_z"], "bad synthetic model spec"),
        (["-m", "/nonexistent/model.gguf"], "not found"),
        (TINY + ["-p", "64", "-c", "32"], "more than -c 32"),
        (TINY + ["-n", "40", "-c", "32"], "more than -c 32"),
        (TINY + ["-p", "40000"], "trained context"),
        (TINY + ["-p", "abc"], "-p"),
        (TINY + ["-pg", "512"], "-pg"),
        (TINY + ["-r", "0"], "-r"),
        (["--shapes", "q4_0:128x100"], "block"),
        (["--shapes", "zz9:128x256"], "unknown weight type"),
        (["--shapes", "q4_0-128x256"], "TYPE:OUTxIN"),
        (["--shapes", "q4_0:128x256", "--nt", "0"], "--nt"),
        (["--shapes", "q4_0:128x256", "--kernels", "cuda"], "invalid choice"),
        ([], "give -m MODEL or --synthetic"),
        (["--matmuls"], "--matmuls needs"),
        (["--bogus-flag"], "unrecognized"),
        (TINY + ["--spec", "draft"], "takes a draft model (-md)"),
        (TINY + ["--spec", "lookup", "-md", "d.gguf"], "-md only --spec draft"),
        (["-m", "/tmp/x.gguf", "--layers", "2"], "--layers"),
        (
            [
                "--synthetic",
                "qwen2.5-0.5b:q4_0,qwen2.5-1.5b:q4_0",
                "--write-gguf",
                "/tmp/never.gguf",
            ],
            "exactly one",
        ),
    ],
)
def test_errors(argv, needle):
    rc, out, err = run_main(argv)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.py: error: ") and needle in lines[0], err


def test_bench_spells_the_draft_flags_as_the_engine_does():
    """-md and the draft sizes are declared once (engine/spec_flags.py): bench.py and the CLI take
    the same spellings, types and defaults."""
    from minfer_jax.cli.arguments import build_parser as cli_parser
    from minfer_jax.engine.spec_flags import SPEC_FLAGS

    from minfer_bench.bench.arguments import build_parser as bench_parser

    bench = {a.dest: a for a in bench_parser()._actions}
    engine = {a.dest: a for a in cli_parser()._actions}
    for dest, flag in SPEC_FLAGS.items():
        assert bench[dest].option_strings == engine[dest].option_strings == list(flag.names)
        assert bench[dest].type is engine[dest].type and bench[dest].default is None
    args = bench_parser().parse_args(["--spec", "lookup", "--draft-n", "3", "--draft-min", "2"])
    assert (args.draft_max, args.draft_min) == (3, 2)


def test_kernel_impl_pallas_only_on_a_gpu():
    import jax

    rc, out, err = run_main(
        [
            "--shapes",
            "q4_0:128x256",
            "--kernels",
            "pallas",
            "--nt",
            "1",
            "-r",
            "1",
            "--kernel-reps",
            "2",
            "-o",
            "json",
            "--mem-bw",
            "none",
        ]
    )
    if jax.default_backend() == "gpu":
        assert rc == 0 and [r["impl"] for r in json.loads(out)] == ["pallas"], err
    else:
        assert rc == 2 and out == "" and "needs a GPU" in err


def test_script_help_and_error_exit_code():
    script = os.path.join(REPO, "scripts", "bench.py")
    r = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    for flag in (
        "-p",
        "-n",
        "-pg",
        "-r",
        "-o",
        "--out",
        "--synthetic",
        "--layers",
        "--write-gguf",
        "--matmuls",
        "--shapes",
        "--ggml-shapes",
        "--nt",
        "--kernels",
        "-c",
    ):
        assert flag in r.stdout
    r = subprocess.run(
        [sys.executable, script, "--synthetic", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    help_text = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    r = subprocess.run(
        [sys.executable, "-m", "minfer_bench.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert (
        r.returncode == 0 and r.stdout == help_text
    )  # python -m minfer_bench.bench is the same command line


def test_device_timeline_is_empty_without_gpu_events_and_inside_another_trace(tmp_path):
    """kernel_timing reads kernel times off the device timeline; on a CPU (no GPU events) or under a
    caller's own profiler session it returns nothing, runs the work exactly once, and run_case
    falls back to the host clock."""
    import jax
    import jax.numpy as jnp

    from minfer_bench.bench import kernel_timing as kb

    calls = []
    f = jax.jit(lambda x: x * 2)

    def run():
        calls.append(1)
        f(jnp.ones(3)).block_until_ready()

    assert kb.device_kernel_events(run) == [] and kb.device_span_us(run) is None
    with jax.profiler.trace(str(tmp_path)):
        assert kb.device_kernel_events(run) == []
    assert len(calls) == 3


def test_mem_bw_table_and_measurement():
    """auto takes the table for the cards in it (the specific H100s before the SXM one) and
    measures elsewhere: several dependent reads in one executable, a positive rate."""
    from minfer_bench.bench import env

    assert env.table_key("NVIDIA H200") == "H200"
    assert env.table_key("NVIDIA H100 80GB HBM3") == "H100"
    assert env.table_key("NVIDIA H100 PCIe") == "H100 PCIe"
    assert env.table_key("NVIDIA H100 NVL") == "H100 NVL"
    assert env.table_key("NVIDIA A10") is None
    assert env.measure_mem_bw(nbytes=1 << 20, trials=1, reads=3) > 0


def test_no_percent_of_bandwidth_on_a_cpu():
    """A CPU's caches serve a small model faster than its measured memory bandwidth ('% bw 183.8'
    on the 2-core CPU): auto gives no bandwidth there, so '% bw' reads n/a; a number counts."""
    import jax

    from minfer_bench.bench import env

    assert jax.default_backend() == "cpu"
    cpu = env.make_env("auto")
    assert cpu.mem_bw is None and cpu.mem_bw_source == "n/a"
    assert env.make_env("100").mem_bw == 100e9
