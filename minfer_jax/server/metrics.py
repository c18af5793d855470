"""GET /metrics: the server's state in Prometheus' text exposition format (version 0.0.4).

Counters end in `_total`; gauges are read at scrape time. Reading the scheduler's queues from the
event loop's thread is safe: each `len()` is one atomic read under the GIL (a scrape may see a
request move from one queue to the next, never a torn value).
"""

from __future__ import annotations

from minfer_jax.engine.steps import StopReason

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "minfer_"
STOP_REASONS = tuple(r.value for r in StopReason)  # each shown, 0 until one finishes so


def _family(
    name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]
) -> list[str]:
    lines = [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    for labels, value in samples:
        tag = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        lines.append(
            f"{PREFIX}{name}{{{tag}}} {_number(value)}"
            if tag
            else f"{PREFIX}{name} {_number(value)}"
        )
    return lines


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _counts(backend) -> dict:
    """The numbers of one exposition, read at once (zeros before the model has loaded)."""
    sched = backend.scheduler
    with backend.lock:
        c = dict(
            requests_total=backend.requests_total,
            prompt_total=backend.prompt_tokens_total,
            cached_total=backend.prompt_tokens_cached,
            finished=dict(backend.finish_reasons),
            drafted=backend.drafted,
            accepted=backend.accepted,
            preparing=backend.preparing,
        )
        live = backend.live
    if sched is None:
        return c | dict.fromkeys(
            ("queued", "running", "used", "tokens_out", "stand_ins", "compiled", "planned"), 0
        )
    running = len(sched.prefilling) + len(sched.decoding)
    compiled = len(backend.model.compiled_keys())
    return c | dict(
        running=running,
        queued=max(live - running, 0),  # accepted, not done, holding no slot (or being admitted)
        used=backend.settings.n_parallel - len(sched.free_slots),
        tokens_out=sched.tokens_out,
        stand_ins=sched.stand_ins,
        compiled=compiled,
        planned=(
            len({*sched.plan.serving_keys(), *sched.plan.ready_keys()})
            if backend.settings.warmup
            else compiled
        ),
    )


# counters and gauges of one unlabelled sample: (name, type, help, key of _counts)
SIMPLE = [
    (
        "tokens_generated_total",
        "counter",
        "Tokens generated (sampled and delivered) since start.",
        "tokens_out",
    ),
    (
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of accepted requests since start.",
        "prompt_total",
    ),
    (
        "prompt_tokens_cached_total",
        "counter",
        "Prompt tokens whose K/V a slot still held from an earlier request (not prefilled again).",
        "cached_total",
    ),
    (
        "draft_tokens_total",
        "counter",
        "Tokens drafted by speculative decoding (--spec-type) for finished requests.",
        "drafted",
    ),
    ("draft_tokens_accepted_total", "counter", "Of those, tokens the model accepted.", "accepted"),
    (
        "requests_total",
        "counter",
        "Requests accepted (queued for generation) since start.",
        "requests_total",
    ),
]
LOAD = [
    (
        "requests_running",
        "gauge",
        "Requests holding a KV slot (prefilling or decoding).",
        "running",
    ),
    ("requests_queued", "gauge", "Requests accepted and waiting for a KV slot.", "queued"),
    (
        "requests_preparing",
        "gauge",
        "Requests read but not queued yet: being parsed, tokenized or their grammar compiled "
        "(a request of n choices until its last is queued).",
        "preparing",
    ),
    ("kv_slots_used", "gauge", "KV cache slots in use.", "used"),
]
EXECUTABLES = [
    (
        "executables_compiled",
        "gauge",
        "Executables compiled or loaded (the rest compile in the background after start).",
        "compiled",
    ),
    (
        "executables_planned",
        "gauge",
        "Executables a server compiles in all (plan.serving_keys).",
        "planned",
    ),
    (
        "stand_in_dispatches_total",
        "counter",
        "Steps run on a larger compiled executable while their own was still compiling.",
        "stand_ins",
    ),
]


def _simple(table, c) -> list[str]:
    lines = []
    for name, kind, text, key in table:
        lines += _family(name, kind, text, [({}, c[key])])
    return lines


def render(backend) -> str:
    """The exposition text for one Backend (zeros before the model has loaded)."""
    s, c = backend.settings, _counts(backend)
    finished = c["finished"]
    lines = []
    lines += _family(
        "ready",
        "gauge",
        "1 once the model is loaded and the server accepts requests.",
        [({}, float(backend.ready.is_set()))],
    )
    lines += _family(
        "tokens_per_second",
        "gauge",
        f"Tokens generated per second over the last {backend.throughput.window:g} s, all requests.",
        [({}, backend.throughput.rate(c["tokens_out"]))],
    )
    lines += _simple(SIMPLE, c)
    lines += _family(
        "requests_finished_total",
        "counter",
        "Requests finished, by stop reason.",
        [({"reason": r}, finished.get(r, 0)) for r in sorted(set(STOP_REASONS) | set(finished))],
    )
    lines += _simple(LOAD, c)
    lines += _family(
        "kv_slots_capacity", "gauge", "KV cache slots in all (-np).", [({}, s.n_parallel)]
    )
    lines += _simple(EXECUTABLES, c)
    return "\n".join(lines) + "\n"
