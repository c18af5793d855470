"""`bench.py --startup`: where a start's seconds go, cold and warm, phase by phase.

Each run is a fresh process: the CLI's run command (`scripts/generate.py -p "def fibonacci(n):"
-n 64 --temp 0 --verbose`) timed from spawn to its first byte of text, or with --server
`python -m minfer_jax.server` timed from spawn until /health answers 200. A cold run gets empty
cache directories (MINFER_COMPILATION_CACHE: JAX's cache and the executable store;
MINFER_WEIGHTS_CACHE); the warm run after it reuses them. The OS page cache is not dropped, so
"cold" is a fresh cache on a machine that has read the model file before. The phases come from the
process's own `startup: <phase> <seconds> s` lines (CLI --verbose, the server's log); what they do
not cover is shown as "other" (e.g. the first prefill before the first text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from minfer_bench.bench.parsing import BenchError

REPO = Path(__file__).resolve().parents[2]
PROMPT = "def fibonacci(n):"
DEFAULT_TOKENS = 64
_PHASE = re.compile(r"startup: (.+) (\d+(?:\.\d+)?) s$")
_EXE = re.compile(
    r"executable (.+) \(([\w-]+): lower ([\d.]+), compile ([\d.]+), store load ([\d.]+), save "
    r"([\d.]+)\)"
)
EXE_STEPS = ("lower", "compile", "store load", "save")
FIRST_TEXT = "first text after the process started"


@dataclasses.dataclass
class Run:
    kind: str  # "cold" | "warm"
    ready_s: float | None  # CLI: first byte of text; server: /health 200 (None: never)
    wall_s: float
    returncode: int | None
    phases: dict[str, float]  # the process's own phase lines, executables left out
    executables: list[dict]  # label, source and the seconds of each step
    log_tail: str = ""

    @property
    def exe_totals(self) -> dict[str, float]:
        return {step: sum(e[step] for e in self.executables) for step in EXE_STEPS}

    @property
    def other_s(self) -> float | None:
        """Seconds to ready that no phase line accounts for."""
        if self.ready_s is None:
            return None
        return self.ready_s - sum(self.phases.values()) - sum(self.exe_totals.values())


def parse_log(text: str) -> tuple[dict[str, float], list[dict]]:
    """`startup:` lines -> (phase seconds, executables); anything else in the log is ignored."""
    phases, exes = {}, []
    for line in text.splitlines():
        m = _PHASE.search(line.rstrip())
        if not m:
            continue
        name, seconds = m.group(1), float(m.group(2))
        e = _EXE.fullmatch(name)
        if e:
            exes.append(
                dict(
                    label=e.group(1),
                    source=e.group(2),
                    **{step: float(e.group(i + 3)) for i, step in enumerate(EXE_STEPS)},
                )
            )
        elif name != FIRST_TEXT:
            phases[name] = phases.get(name, 0.0) + seconds
    return phases, exes


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["MINFER_COMPILATION_CACHE"] = str(cache / "xla")
    env["MINFER_WEIGHTS_CACHE"] = str(cache / "weights")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(cmd: list[str], cache: Path, kind: str, timeout: float) -> Run:
    """One CLI process: seconds from spawn to its first byte on stdout, and its phase lines."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=_env(cache)
        )
        first = None
        try:
            if proc.stdout.read(1):
                first = time.perf_counter() - t0
            proc.stdout.read()
            proc.wait(timeout=max(timeout - (time.perf_counter() - t0), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        wall = time.perf_counter() - t0
        log.seek(0)
        text = log.read()
    phases, exes = parse_log(text)
    return Run(kind, first, wall, proc.returncode, phases, exes, text[-2000:])


def run_server(cmd: list[str], port: int, cache: Path, kind: str, timeout: float) -> Run:
    """One server process: seconds from spawn until /health is 200, then it is stopped."""
    url = f"http://127.0.0.1:{port}/health"
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(cache)
        )
        ready = None
        try:
            while time.perf_counter() - t0 < timeout and proc.poll() is None:
                with contextlib.suppress(urllib.error.URLError, OSError, TimeoutError):
                    with urllib.request.urlopen(url, timeout=2) as r:
                        if r.status == 200:
                            ready = time.perf_counter() - t0
                            break
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        wall = time.perf_counter() - t0
        log.seek(0)
        text = log.read()
    phases, exes = parse_log(text)
    return Run(kind, ready, wall, proc.returncode, phases, exes, text[-2000:])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[Run], kind: str) -> dict:
    """Median over the runs of one kind, per phase."""
    rs = [r for r in runs if r.kind == kind]
    names = list(dict.fromkeys(n for r in rs for n in r.phases))
    return dict(
        runs=len(rs),
        ready_s=_median([r.ready_s for r in rs]),
        wall_s=_median([r.wall_s for r in rs]),
        other_s=_median([r.other_s for r in rs]),
        phases={n: _median([r.phases.get(n, 0.0) for r in rs]) for n in names},
        executables={step: _median([r.exe_totals[step] for r in rs]) for step in EXE_STEPS},
        from_store=_median([sum(e["source"] == "store" for e in r.executables) for r in rs]),
        compiled=_median([sum(e["source"] != "store" for e in r.executables) for r in rs]),
    )


def _cell(v) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def markdown(result: dict) -> str:
    cold, warm = result["cold"], result["warm"]
    ready = "first text" if result["mode"] == "cli" else "/health 200"
    rows = [
        (f"phase (median of {cold['runs']} / {warm['runs']} runs, s)", "cold", "warm"),
        ("---", "---:", "---:"),
    ]
    for n in dict.fromkeys([*cold["phases"], *warm["phases"]]):
        rows.append((n, _cell(cold["phases"].get(n)), _cell(warm["phases"].get(n))))
    for step in EXE_STEPS:
        rows.append(
            (
                f"executables: {step}",
                _cell(cold["executables"][step]),
                _cell(warm["executables"][step]),
            )
        )
    rows.append(
        (
            "executables from the store / compiled",
            f"{_cell(cold['from_store'])} / {_cell(cold['compiled'])}",
            f"{_cell(warm['from_store'])} / {_cell(warm['compiled'])}",
        )
    )
    rows.append((f"other (until {ready})", _cell(cold["other_s"]), _cell(warm["other_s"])))
    rows.append((f"**{ready}**", f"**{_cell(cold['ready_s'])}**", f"**{_cell(warm['ready_s'])}**"))
    rows.append(("process wall time", _cell(cold["wall_s"]), _cell(warm["wall_s"])))
    head = (
        f"startup, {result['mode']}: `{shlex.join(result['command'])}`\n"
        f"({result['platform']}; cold: empty cache directories, warm: the same directories "
        "again)\n\n"
    )
    return head + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows) + "\n"


def _synthetic_gguf(spec: str, layers: int | None, seed: int, directory: Path, log) -> Path:
    """A synthetic model written as a GGUF (with the placeholder tokenizer), so the run reads a file
    as a user's would (and the weights cache applies); an existing file of the same name is
    reused."""
    from minfer_bench import synthetic

    path = directory / f"{spec.replace(':', '-')}-seed{seed}{f'-{layers}L' if layers else ''}.gguf"
    if not path.exists():
        log(f"writing {spec} as {path}")
        tmp = path.with_suffix(".tmp")
        synthetic.write_gguf(
            synthetic.synthetic_model(spec, seed=seed, layers=layers), tmp, progress=False
        )
        os.replace(tmp, path)
    return path


def _platform() -> str:
    """The device the runs used, asked of a fresh process (this one never starts a backend: on a GPU
    it would hold the memory the runs need)."""
    code = (
        "import os, jax; d = jax.devices()[0]; "
        "print(f'jax {jax.__version__}, {d.platform} ({d.device_kind}), {os.cpu_count()} CPU "
        "cores')"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
        )
        return out.stdout.strip() or "unknown device"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown device"


def _kinds(which: str) -> tuple[str, ...]:
    return {"both": ("cold", "warm"), "cold": ("cold",), "warm": ("warm",)}[which]


def run(args, log) -> int:
    """The --startup mode of bench.py (args: its parsed flags)."""
    if args.output not in ("md", "json"):
        raise BenchError("--startup prints md or json (-o md|json)")
    models = [m.strip() for v in args.model for m in v.split(",") if m.strip()]
    synths = [m.strip() for v in args.synthetic for m in v.split(",") if m.strip()]
    if len(models) + len(synths) > 1:
        raise BenchError("--startup times one model at a time")
    kinds = _kinds(args.startup_runs)
    kept = Path(args.startup_cache) if args.startup_cache else None
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
        if "cold" in kinds and any(p.name != "models" for p in kept.iterdir()):
            raise BenchError(
                f"--startup-cache {kept} is not empty: a cold run needs empty caches "
                "(use --startup-runs warm, or an empty directory)"
            )
        if args.repetitions > 1 and "cold" in kinds:
            raise BenchError("--startup-cache keeps one cache: give -r 1, or --startup-runs warm")
    reps = args.repetitions
    work = Path(tempfile.mkdtemp(prefix="minfer-startup-", dir=args.startup_dir))
    try:
        model = models[0] if models else None
        if synths:
            model_dir = (kept or work) / "models"
            model_dir.mkdir(exist_ok=True)
            model = str(_synthetic_gguf(synths[0], args.layers, args.seed, model_dir, log))
        runs, cmd = [], []
        for i in range(reps):
            cache = kept or work / f"cache{i}"
            for kind in kinds:
                log(f"run {i + 1}/{reps} ({kind})")
                if args.server:
                    port = _free_port()
                    cmd = [
                        sys.executable,
                        "-m",
                        "minfer_jax.server",
                        "--port",
                        str(port),
                        "-np",
                        str(args.parallel),
                        "-c",
                        str(args.ctx_size or 0),
                    ]
                    cmd += ["-m", model] if model else []
                    r = run_server(cmd, port, cache, kind, args.startup_timeout)
                else:
                    n = str(args.n_gen[0] if args.n_gen else DEFAULT_TOKENS)
                    cmd = (
                        [
                            sys.executable,
                            str(REPO / "scripts" / "generate.py"),
                            "-p",
                            PROMPT,
                            "-n",
                            n,
                            "--temp",
                            "0",
                            "--verbose",
                        ]
                        + (["-m", model] if model else [])
                        + (["-c", str(args.ctx_size)] if args.ctx_size else [])
                    )
                    r = run_cli(cmd, cache, kind, args.startup_timeout)
                if r.ready_s is None:
                    sys.stderr.write(
                        f"bench.py: {kind} run {i + 1} never became ready (exit {r.returncode}); "
                        f"its log ends with:\n{r.log_tail}\n"
                    )
                runs.append(r)
        shown = [os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd[1:]]
        result = dict(
            mode="server" if args.server else "cli",
            command=["python", *shown],
            platform=_platform(),
            **{k: summarize(runs, k) for k in ("cold", "warm")},
            runs=[
                {k: v for k, v in dataclasses.asdict(r).items() if k != "log_tail"} for r in runs
            ],
        )
        sys.stdout.write(
            json.dumps(result, indent=1) + "\n" if args.output == "json" else markdown(result)
        )
        return 0 if all(r.ready_s is not None for r in runs) else 1
    finally:
        if not args.startup_keep:
            shutil.rmtree(work, ignore_errors=True)
