"""Bench output: llama-bench's markdown table, csv, json and jsonl, row by row, to stdout and
files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TextIO

from minfer_bench.bench.env import Env
from minfer_bench.bench.fields import BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS
from minfer_bench.bench.parsing import BenchError


def _fmt_bytes_llama(n: int) -> str:
    if n < 1024**3:
        return f"{n / 1024 / 1024:.2f} MiB"
    return f"{n / 1024**3:.2f} GiB"


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def _na(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, fmt)


def _fmt_mem(v) -> str:
    return "n/a" if v is None else _fmt_bytes_llama(int(v))


@dataclasses.dataclass
class Column:
    title: str
    width: int  # llama-bench convention: negative = left-aligned
    value: Callable[[dict], str]


def model_md_columns(env: Env) -> list[Column]:
    """llama-bench's markdown fields (model, size, params, backend, ngl | threads, test, t/s), then
    ours."""
    cols = [
        Column("model", -30, lambda r: r["model_type"]),
        Column("size", 10, lambda r: _fmt_bytes_llama(r["model_size"])),
        Column("params", 10, lambda r: _fmt_params(r["model_n_params"])),
        Column("backend", -10, lambda r: r["backends"]),
    ]
    if not env.is_cpu_backend:
        cols.append(Column("ngl", 3, lambda r: str(r["n_gpu_layers"])))
    else:
        cols.append(Column("threads", 7, lambda r: str(r["n_threads"])))
    cols += [
        Column("test", 15, lambda r: r["test"]),
        Column("t/s", 20, lambda r: f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"),
        Column("ctx", 6, lambda r: str(r["n_ctx"])),
        Column("bucket", 6, lambda r: "-" if r["bucket"] is None else str(r["bucket"])),
        Column("compile s", 9, lambda r: f"{r['compile_s']:.2f}"),
        Column(
            "GB/s",
            8,
            lambda r: _na(r["weight_gbps"], ".1f") if r["n_gen"] and not r["n_prompt"] else "-",
        ),
        Column(
            "% bw",
            6,
            lambda r: _na(r["pct_mem_bw"], ".1f") if r["n_gen"] and not r["n_prompt"] else "-",
        ),
        Column(
            "TFLOP/s",
            8,
            lambda r: _na(r["matmul_tflops"], ".2f") if r["n_prompt"] and not r["n_gen"] else "-",
        ),
        Column("peak mem", 10, lambda r: _fmt_mem(r["peak_mem_bytes"])),
    ]
    return cols


def kernel_md_columns(env: Env) -> list[Column]:
    def gemv(r):
        return r["kernel"] in ("gemv", "xla") and r["nt"] <= _gemv_max_nt()

    return [
        Column("type", -5, lambda r: r["qtype"]),
        Column("out x in", 13, lambda r: f"{r['n_out']} x {r['n_in']}"),
        Column("nt", 5, lambda r: str(r["nt"])),
        Column("kernel", -7, lambda r: r["kernel"]),
        Column("tensors", -24, lambda r: r["tensors"] or "-"),
        Column("us", 18, lambda r: f"{r['avg_us']:.2f} ± {r['stddev_us']:.2f}"),
        Column("best us", 9, lambda r: f"{r['best_us']:.2f}"),
        Column("GB/s", 8, lambda r: _na(r["gbps"], ".1f") if gemv(r) else "-"),
        Column("% bw", 6, lambda r: _na(r["pct_mem_bw"], ".1f") if gemv(r) else "-"),
        Column("TFLOP/s", 8, lambda r: _na(r["tflops"], ".2f")),
        Column("rel err", 8, lambda r: _na(r["rel_err"], ".1e")),
        Column("compile s", 9, lambda r: f"{r['compile_s']:.2f}"),
        Column("ggml us", 8, lambda r: _na(r["ggml_us"], ".1f")),
        Column(
            "vs ggml",
            8,
            lambda r: "-" if r["speedup_vs_ggml"] is None else f"{r['speedup_vs_ggml']:.2f}x",
        ),
    ]


def _gemv_max_nt() -> int:
    from minfer_jax import ops

    return ops.GEMV_MAX_NT


def _csv_value(field: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"  # std::to_string(bool)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:f}" if field in FLOAT_FIELDS else repr(v)
    if isinstance(v, (list, tuple)):
        return ";".join(str(x) for x in v)
    return str(v)


def _json_value(field: str, v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if field in BOOL_FIELDS:
        return bool(v)
    if field in INT_FIELDS and v is not None:
        return int(v)
    if field in FLOAT_FIELDS and v is not None:
        return float(v)
    return v


class Printer:
    """Writes one output format to one stream, row by row (as llama-bench's printers do)."""

    def __init__(
        self,
        fmt: str,
        fh: TextIO,
        fields: list[str],
        columns: list[Column],
        header: str | None,
        samples: tuple[str, ...],
        footer: str | None,
    ):
        self.fmt, self.fh, self.fields, self.columns = fmt, fh, fields, columns
        self.header, self.samples, self.footer_text = header, samples, footer
        self.first = True

    def _w(self, s: str) -> None:
        self.fh.write(s)
        self.fh.flush()

    def start(self) -> None:
        if self.fmt == "md":
            if self.header:
                self._w(self.header + "\n\n")
            self._w(
                "|"
                + "".join(
                    f" {c.title:{'<' if c.width < 0 else '>'}{abs(c.width)}} |"
                    for c in self.columns
                )
                + "\n"
            )
            self._w(
                "|"
                + "".join(
                    f" {'-' * (abs(c.width) - 1)}{':' if c.width > 0 else '-'} |"
                    for c in self.columns
                )
                + "\n"
            )
        elif self.fmt == "csv":
            self._w(",".join(self.fields) + "\n")
        elif self.fmt == "json":
            self._w("[\n")

    def row(self, r: dict) -> None:
        if self.fmt == "md":
            self._w(
                "|"
                + "".join(
                    f" {c.value(r):{'<' if c.width < 0 else '>'}{abs(c.width)}} |"
                    for c in self.columns
                )
                + "\n"
            )
        elif self.fmt == "csv":
            vals = [_csv_value(f, r.get(f)) for f in self.fields]
            self._w(",".join('"' + v.replace('"', '""') + '"' for v in vals) + "\n")
        else:
            obj = {f: _json_value(f, r.get(f)) for f in self.fields}
            for s in self.samples:
                obj[s] = r.get(s, [])
            if self.fmt == "jsonl":
                self._w(json.dumps(obj, ensure_ascii=False) + "\n")
            else:
                text = json.dumps(obj, indent=2, ensure_ascii=False).replace("\n", "\n  ")
                self._w(("" if self.first else ",\n") + "  " + text)
        self.first = False

    def finish(self) -> None:
        if self.fmt == "md" and self.footer_text:
            self._w("\n" + self.footer_text + "\n")
        elif self.fmt == "json":
            self._w("\n]\n")


def _format_for_path(path: str, default: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return {"md": "md", "markdown": "md", "csv": "csv", "json": "json", "jsonl": "jsonl"}.get(
        ext, default
    )


class Outputs:
    """stdout in -o's format plus every --out file: row() writes to all, close() finishes them."""

    def __init__(self, printers: list[Printer], files: list[TextIO]):
        self.printers, self.files = printers, files

    def row(self, r: dict) -> None:
        for pr in self.printers:
            pr.row(r)

    def close(self) -> None:
        for pr in self.printers:
            pr.finish()
        for fh in self.files:
            fh.close()


def open_outputs(
    fmt: str,
    paths: list[str],
    fields: list[str],
    columns: list[Column],
    samples: tuple[str, ...],
    header: str,
    footer: str | None = None,
) -> Outputs:
    """Start a printer on stdout (format `fmt`) and one per --out path
    (format from its extension)."""
    printers = []
    files = []
    if fmt != "md":
        print(
            header, file=sys.stderr
        )  # csv/json stay machine-readable; the same facts are in every row
    printers.append(Printer(fmt, sys.stdout, fields, columns, header, samples, footer))
    for path in paths:
        try:
            fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by Outputs.close after the last row
        except OSError as e:
            raise BenchError(f"cannot write --out {path}: {e.strerror or e}") from None
        files.append(fh)
        printers.append(
            Printer(_format_for_path(path, fmt), fh, fields, columns, header, samples, footer)
        )
    for pr in printers:
        pr.start()
    return Outputs(printers, files)
