"""scripts/bench.py's command line: its flags' checks and the two modes' run loops (the flags
themselves: bench/arguments.py).

Model mode (the default) runs llama-bench's tests (bench.model_tests); kernel mode (--matmuls,
--shapes, --ggml-shapes) times matmul cases (bench.kernel_cases). Every bad input fails with one
line and exit status 2 before anything heavy runs; a test or case that fails at run time is
reported on stderr while the others go on (exit status 1).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence

from minfer_jax import ops
from minfer_jax.engine import options
from minfer_jax.errors import MinferError

from minfer_bench.bench.arguments import build_parser
from minfer_bench.bench.env import Env, ensure_mem_bw, header_line, make_env
from minfer_bench.bench.fields import KERNEL_FIELDS, MODEL_FIELDS, model_type
from minfer_bench.bench.kernel_cases import (
    KernelCase,
    ggml_cases,
    model_matmul_cases,
    run_kernel_case,
)
from minfer_bench.bench.model_tests import (
    ModelBench,
    ModelSource,
    TestSpec,
    build_tests,
    context_for,
)
from minfer_bench.bench.parsing import BenchError, parse_int_range, parse_pg, parse_shapes
from minfer_bench.bench.printers import Outputs, kernel_md_columns, model_md_columns, open_outputs
from minfer_bench.synthetic import SYNTHETIC_CONFIGS


def _split_list(values: Iterable[str]) -> list[str]:
    return [x.strip() for v in values for x in str(v).split(",") if x.strip()]


def _int_lists(values: list[str] | None, default: list[int], what: str) -> list[int]:
    if values is None:
        return list(default)
    out: list[int] = []
    for v in values:
        out += parse_int_range(v, what)
    return out


def _load_source(kind: str, ref: str, layers: int | None, seed: int, progress: bool) -> ModelSource:
    if kind == "synthetic":
        from minfer_bench.synthetic import synthetic_model

        gm = synthetic_model(ref, seed=seed, layers=layers)
        return ModelSource(gm.path, gm)
    from minfer_jax.files.model_source import resolve_model
    from minfer_jax.model.from_gguf import load_gguf

    path = resolve_model(ref, progress=progress)
    return ModelSource(ref, load_gguf(path))


def _validate(args) -> None:
    if args.repetitions is None:
        args.repetitions = 1 if args.startup else 5
    if args.repetitions < 1:
        raise BenchError(f"-r must be >= 1, got {args.repetitions}")
    if args.server and not args.startup:
        raise BenchError("--server applies to --startup")
    if args.parallel < 1:
        raise BenchError(f"-np must be >= 1, got {args.parallel}")
    if args.ctx_size is not None and args.ctx_size < 1:
        raise BenchError(f"-c must be >= 1, got {args.ctx_size}")
    if args.layers is not None and args.layers < 1:
        raise BenchError(f"--layers must be >= 1, got {args.layers}")
    if args.layers is not None and not args.synthetic:
        raise BenchError("--layers applies to --synthetic models only")
    if args.kernel_reps is not None and args.kernel_reps < 1:
        raise BenchError(f"--kernel-reps must be >= 1, got {args.kernel_reps}")
    if args.write_gguf and len(_split_list(args.synthetic)) != 1:
        raise BenchError("--write-gguf needs exactly one --synthetic model")


def _default_impl() -> str:
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "xla"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BenchError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    except MinferError as e:  # unknown synthetic spec, missing/broken model, context overflow
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"bench.py: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


@dataclasses.dataclass(frozen=True)
class _Request:
    """What the command line asks for, parsed and checked."""

    models: list[str]
    synths: list[str]
    shapes: list  # [(QType, out, in)] from --shapes
    kernel_mode: bool
    nts: list[int] | None  # --nt
    tests: list[TestSpec]
    explicit_tests: bool  # -p / -n / -pg given (--write-gguf then also runs them)


def _request(args) -> _Request:
    shapes = parse_shapes(args.shapes) if args.shapes else []
    nts = parse_int_range(args.nt, "--nt") if args.nt else None
    if nts is not None and any(n < 1 for n in nts):
        raise BenchError("--nt values must be >= 1")
    prompts = _int_lists(args.n_prompt, [512], "-p")
    gens = _int_lists(args.n_gen, [128], "-n")
    pgs = [parse_pg(s) for s in args.pg]
    depths = _int_lists(args.n_depth, [0], "-d")
    if any(d < 0 for d in depths):
        raise BenchError("-d values must be >= 0")
    req = _Request(
        models=_split_list(args.model),
        synths=_split_list(args.synthetic),
        shapes=shapes,
        kernel_mode=args.matmuls or bool(shapes) or args.ggml_shapes,
        nts=nts,
        tests=build_tests(prompts, gens, pgs, depths),
        explicit_tests=args.n_prompt is not None or args.n_gen is not None or bool(args.pg),
    )
    _check_inputs(args, req)
    return req


def _check_inputs(args, req: _Request) -> None:
    """Resolve inputs cheaply before anything heavy (every bad input fails here with exit 2)."""
    from minfer_bench.synthetic import parse_spec

    for s in req.synths:
        parse_spec(s)
    for m in req.models:
        if m.strip() not in ("default",) and not m.startswith("hf:") and not os.path.exists(m):
            raise BenchError(f"model file not found: {m}")
    if args.write_gguf and req.kernel_mode:
        raise BenchError("--write-gguf cannot be combined with kernel mode")
    if req.kernel_mode:
        if args.matmuls and not (req.models or req.synths or req.shapes or args.ggml_shapes):
            raise BenchError(
                "--matmuls needs -m MODEL, --synthetic SPEC, --shapes LIST or --ggml-shapes"
            )
    elif not (req.models or req.synths):
        raise BenchError(
            "give -m MODEL or --synthetic SPEC (or --matmuls/--shapes/--ggml-shapes for kernel "
            "mode)"
        )
    if not req.kernel_mode and not req.tests and not args.write_gguf:
        raise BenchError("no tests: every -p/-n/-pg value is 0")
    if not req.kernel_mode:
        limits = [SYNTHETIC_CONFIGS[parse_spec(s)[0]].context_length for s in req.synths] or [
            1 << 62
        ]
        for t in (
            req.tests
        ):  # N > context -> exit 2 before loading anything (files: checked after reading them)
            context_for(t, args.ctx_size, min(limits))


def _kernel_impl(args) -> str:
    impl = _default_impl() if args.kernels == "auto" else args.kernels
    import jax

    if impl == "pallas" and jax.default_backend() != "gpu":
        raise BenchError(
            f"--kernels pallas needs a GPU (backend here: {jax.default_backend()}); "
            "use interpret or xla"
        )
    return impl


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    if args.startup:
        from minfer_bench.bench import startup

        log = (
            (lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
            if args.progress
            else (lambda s: None)
        )
        return startup.run(args, log)
    req = _request(args)
    log = (
        (lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
        if args.progress
        else (lambda s: None)
    )
    if args.no_compile_cache:
        from minfer_jax.engine.runtime import COMPILATION_CACHE_ENV

        os.environ[COMPILATION_CACHE_ENV] = "off"
    impl = _kernel_impl(args)
    command = " ".join(shlex.quote(a) for a in ["scripts/bench.py", *argv])
    preloaded: dict[tuple[str, str], ModelSource] = {}
    if args.write_gguf:
        preloaded = _write_gguf(args, req.synths[0])
        if not req.explicit_tests:
            return 0
    env = make_env(args.mem_bw, command)
    if args.batched:
        return _run_batched(args, req, impl, log)
    if args.spec:
        return _run_spec(args, req, log)
    if req.kernel_mode:
        return _run_kernels(args, req, env, impl, log)
    return _run_models(args, req, env, impl, log, preloaded)


def _write_gguf(args, spec: str) -> dict[tuple[str, str], ModelSource]:
    """--write-gguf: build the synthetic model, write it; it is then reused by the model tests."""
    from minfer_bench.synthetic import write_gguf

    src = _load_source("synthetic", spec, args.layers, args.seed, args.progress)
    write_gguf(src.gguf, args.write_gguf, progress=args.progress)
    size = os.path.getsize(args.write_gguf)
    print(
        f"wrote {src.label} ({model_type(src.gguf)}) to {args.write_gguf} ({size} bytes)",
        file=sys.stderr,
    )
    return {("synthetic", spec): src}


def _footer(env: Env) -> str:
    return f"build: {env.build_commit} ({env.build_number})"


def _report_failure(what: str, e: Exception) -> None:
    """One stderr line for a test/case that failed while the run goes on."""
    first = str(e).splitlines()[0] if str(e) else ""
    print(f"bench.py: {what} failed: {type(e).__name__}: {first}"[:2000], file=sys.stderr)


# ---- kernel mode ---------------------------------------------------------------------------


def _kernel_cases(args, req: _Request) -> list[KernelCase]:
    """--ggml-shapes, then --shapes, then every synthetic model's and model file's matmuls."""
    from minfer_bench.synthetic import synthetic_shapes

    cases: list[KernelCase] = []
    default_nts = req.nts or [1, 512]
    if args.ggml_shapes:
        cases += ggml_cases(req.nts)
    for qt, n, k in req.shapes:
        cases.append(KernelCase(qt, n, k, tuple(default_nts), source="--shapes"))
    for s in req.synths:
        types, shp, tied, label = synthetic_shapes(s, args.layers)
        cases += model_matmul_cases(types, shp, tied, default_nts, label)
    for m in req.models:
        from minfer_jax.files.model_source import resolve_model
        from minfer_jax.model.from_gguf import load_gguf

        gm = load_gguf(resolve_model(m, progress=args.progress))
        cases += model_matmul_cases(
            {n: t.qtype for n, t in gm.tensors.items()},
            {n: t.shape for n, t in gm.tensors.items()},
            gm.config.tied_output,
            default_nts,
            m,
        )
    return cases


def _run_kernels(args, req: _Request, env: Env, impl: str, log: Callable[[str], None]) -> int:

    cases = _kernel_cases(args, req)
    if any(nt <= ops.GEMV_MAX_NT for c in cases for nt in c.nts):
        ensure_mem_bw(env)
    out = open_outputs(
        args.output,
        args.out,
        KERNEL_FIELDS,
        kernel_md_columns(env),
        ("samples_us",),
        header_line(env, "kernels", impl),
        footer=_footer(env),
    )
    failed = 0
    try:
        for case in cases:
            for nt in case.nts:
                log(f"kernel {case.qtype.name} {case.n}x{case.k} nt={nt} ({impl})")
                try:
                    row = run_kernel_case(
                        case,
                        nt,
                        env,
                        impl=impl,
                        gemm=args.gemm,
                        trials=args.repetitions,
                        reps=args.kernel_reps,
                        warmup=not args.no_warmup,
                        seed=args.seed,
                    )
                except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                    failed += 1
                    _report_failure(f"case {case.qtype.name}:{case.n}x{case.k} nt={nt}", e)
                    continue
                out.row(row)
    finally:
        out.close()
    return 1 if failed else 0


# ---- model mode ----------------------------------------------------------------------------


def _run_models(
    args,
    req: _Request,
    env: Env,
    impl: str,
    log: Callable[[str], None],
    preloaded: dict[tuple[str, str], ModelSource],
) -> int:
    from minfer_jax.engine.runtime import load

    sources = [("model", m) for m in req.models] + [("synthetic", s) for s in req.synths]
    if any(t.n_gen and not t.n_prompt for t in req.tests):
        ensure_mem_bw(env)
    out: Outputs | None = None
    failed = 0
    try:
        for kind, ref in sources:
            log(f"loading {ref}")
            t0 = time.perf_counter()
            src = preloaded.pop((kind, ref), None) or _load_source(
                kind, ref, args.layers if kind == "synthetic" else None, args.seed, args.progress
            )
            ctxs = [
                context_for(t, args.ctx_size, src.gguf.config.context_length) for t in req.tests
            ]
            opts = options.from_arguments(args, ctx_size=max(ctxs), progress=args.progress)
            model = load(options=opts, device=env.device, gguf_model=src.gguf)
            log(
                f"loaded {src.label} in {time.perf_counter() - t0:.1f} s: {model.weight_mode} "
                f"weights, {model.weight_nbytes / 1e9:.3f} GB on the device"
            )
            if out is None:
                out = open_outputs(
                    args.output,
                    args.out,
                    MODEL_FIELDS,
                    model_md_columns(env),
                    ("samples_ns", "samples_ts"),
                    header_line(env, "model", impl),
                    footer=_footer(env),
                )
            failed += _run_tests(
                ModelBench(
                    model,
                    src,
                    env,
                    reps=args.repetitions,
                    ctx=args.ctx_size,
                    seed=args.seed,
                    warmup=not args.no_warmup,
                    log=log,
                ),
                req.tests,
                out,
            )
            del model  # before the next model loads
    finally:
        if out is not None:
            out.close()
    return 1 if failed else 0


def _run_batched(args, req: _Request, impl: str, log: Callable[[str], None]) -> int:
    from minfer_jax.engine.runtime import load

    from minfer_bench.bench import batched

    pps, tgs = _int_lists(args.npp, [512], "-npp"), _int_lists(args.ntg, [128], "-ntg")
    npls = _int_lists(args.npl, [1, 2, 4, 8, 16, 32], "-npl")
    if min(pps) < 1 or min(tgs) < 0 or not all(1 <= b <= 64 for b in npls):
        raise BenchError("-npp must be >= 1, -ntg >= 0 and -npl values in 1..64")
    files = [open(f, "w") for f in args.out]
    try:
        for src in _sources(args, req):
            need = max(pps) + max(tgs) + 1
            if need > src.gguf.config.context_length:
                raise BenchError(
                    f"-npp + -ntg = {need - 1} tokens exceed the model's context "
                    f"{src.gguf.config.context_length}"
                )
            opts = options.from_arguments(args, ctx_size=need, progress=args.progress)
            model = load(options=opts, gguf_model=src.gguf)
            batched.run(model, src.label, pps, tgs, npls, seed=args.seed, out_files=files, log=log)
            del model
    finally:
        for f in files:
            f.close()
    return 0


def _sources(args, req: _Request):
    """The requested files, then the synthetic specs, each loaded when its turn comes."""
    for kind, ref in [("model", m) for m in req.models] + [("synthetic", s) for s in req.synths]:
        yield _load_source(
            kind, ref, args.layers if kind == "synthetic" else None, args.seed, args.progress
        )


def _run_spec(args, req: _Request, log: Callable[[str], None]) -> int:
    from minfer_jax.engine.runtime import load

    from minfer_bench.bench import speculative

    n_gen = _int_lists(args.n_gen, [256], "-n")[0]
    depth = _int_lists(args.n_depth, [0], "-d")[0]
    drafts = args.spec in ("draft", "draft-simple")
    if drafts != (args.model_draft is not None):
        raise BenchError("--spec draft takes a draft model (-md), and -md only --spec draft")
    files = [open(f, "w") for f in args.out]
    try:
        for src in _sources(args, req):
            ctx = min(src.gguf.config.context_length, max(4096, depth + 128))
            opts = options.from_arguments(args, ctx_size=ctx, progress=args.progress)
            model = load(options=opts, gguf_model=src.gguf)
            spec = {"speculative": args.spec, "draft_max": args.draft_max}
            if args.draft_min is not None:
                spec["draft_min"] = args.draft_min
            if drafts:
                spec.update(draft_model=_draft_model(args, model), draft_p_min=args.draft_p_min)
            speculative.run(
                model, src.label, spec=spec, n_gen=n_gen, reps=args.repetitions or 3,
                depth=depth, seed=args.seed, out_files=files, log=log,
            )  # fmt: skip
            del model
    finally:
        for f in files:
            f.close()
    return 0


def _draft_model(args, target):
    """-md's DraftModel beside target: a GGUF path or a synthetic spec, the target's options."""
    from minfer_jax.engine.draft_model import load_draft

    ref = args.model_draft
    kind = "synthetic" if ref.lower().startswith("synthetic:") else "model"
    source = _load_source(kind, ref, None, args.seed, args.progress)
    return load_draft(target, gguf_model=source.gguf)


def _run_tests(mb: ModelBench, tests: list[TestSpec], out: Outputs) -> int:
    """Every test on one model; returns how many failed (bad input still ends the run)."""
    failed = 0
    for t in tests:
        try:
            row = mb.run(t)
        except BenchError:
            raise
        except Exception as e:  # noqa: BLE001 - report, keep going with the other tests
            failed += 1
            _report_failure(f"test {t.name} on {mb.source.label}", e)
            continue
        out.row(row)
    return failed
