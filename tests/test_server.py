"""The OpenAI-compatible server (minfer_jax.server), run for real: scripts/serve.py in a subprocess.

The model is a tiny random-weight Qwen2 (2 layers, d_model 64) written as a GGUF file that carries
the real 0.5B's tokenizer and chat template (its tokenizer.* metadata): the real 0.5B decodes at a
few tokens/s on CI's busy 2 cores, this one at ~150, and what the server does with text (chat
template, stop strings, streaming, usage) is the same. Its text is gibberish, but greedy and
deterministic, which is all the comparisons need. Clients are the `openai` package and raw httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
SLOT_CTX = 512


# -- the model and the server processes ------------------------------------------------------------
def write_tiny_gguf(path: Path, tokenizer_meta: dict, seed: int = 1) -> None:
    """A 2-layer d_model-64 random Qwen2 with the given tokenizer.* metadata, as a GGUF file."""
    from minfer_bench.synthetic import (
        SYNTHETIC_CONFIGS,
        synthetic_model_from_config,
        write_gguf,
    )

    cfg = dataclasses.replace(
        SYNTHETIC_CONFIGS["qwen2.5-0.5b"],
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        head_dim=0,
    )  # 0: derived again from d_model / n_heads
    write_gguf(
        synthetic_model_from_config(cfg, "q8_0", seed=seed),
        path,
        progress=False,
        tokenizer=tokenizer_meta,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_SEED = 1  # -s: requests that give no seed draw one fixed sample, not a new one each run
PORT_TAKEN = "address already in use"  # uvicorn's bind error (errno 98), logged at error level


class ServerProcess:
    """scripts/serve.py on 127.0.0.1 and a free port, its output in a log file; -s SERVER_SEED
    (args may override it)."""

    def __init__(self, model: Path, log: Path, xla_cache: str, *args: str):
        self.log_path = log
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "MINFER_COMPILATION_CACHE": xla_cache}
        self.args = ["-m", str(model), "--log-level", "warning", "-s", str(SERVER_SEED), *args]
        self.health_seen: list[
            tuple[int, dict]
        ] = []  # (status, body) of each /health answer until ready
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(REPO / "scripts" / "serve.py"), "--port", str(self.port)]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*cmd, *self.args], stdout=self.log, stderr=subprocess.STDOUT, env=self.env
        )

    def wait_ready(self, timeout: float = 240.0, tries: int = 3) -> None:
        """Until /health says ok. free_port's port is free only when asked: a connection of
        the other test worker may take it before the server binds it, then the server starts
        again on another (at most `tries` times)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and tries > 1 and PORT_TAKEN in self.log_tail():
                self.log.close()
                tries -= 1
                self._start()
            assert self.proc.poll() is None, (
                f"server exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.02)  # the port is not open yet
                continue
            if not self.health_seen or self.health_seen[-1][0] != r.status_code:
                self.health_seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-n:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def tiny_model(real_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("server_model") / "tiny.gguf"
    write_tiny_gguf(
        path, {k: v for k, v in real_model.metadata.items() if k.startswith("tokenizer.")}
    )
    return path


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from minfer_jax.files.tokenizer import Tokenizer

    return Tokenizer.from_model(real_model)


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("server_xla_cache"))


@pytest.fixture(scope="module")
def server(tiny_model, xla_cache, tmp_path_factory):
    """8 slots of SLOT_CTX tokens; room for 64 queued requests (the concurrency test sends 64)."""
    s = ServerProcess(
        tiny_model,
        tmp_path_factory.mktemp("server_log") / "server.log",
        xla_cache,
        "-np",
        "8",
        "-c",
        str(8 * SLOT_CTX),
        "--max-queued",
        "64",
        "-a",
        "tiny",
    )
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(url: str, **kw) -> dict[str, float]:
    """GET /metrics parsed: {'name' or 'name{labels}': value}."""
    r = httpx.get(f"{url}/metrics", timeout=10, **kw)
    assert r.status_code == 200, r.text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in r.text.splitlines()
        if line and not line.startswith("#")
    }


def wait_idle(url: str, timeout: float = 60.0, **kw) -> dict[str, float]:
    """Poll /metrics until no request runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url, **kw)
        if (
            m["minfer_kv_slots_used"]
            == m["minfer_requests_running"]
            == m["minfer_requests_queued"]
            == 0
        ):
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
        time.sleep(0.1)


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.real_model
def test_health_answers_503_while_loading_then_ok(server):
    statuses = [s for s, _ in server.health_seen]
    assert statuses[0] == 503 and statuses[-1] == 200, server.health_seen
    body = server.health_seen[0][1]
    assert (
        body["error"]["type"] == "unavailable_error" and body["error"]["message"] == "Loading model"
    )
    assert server.health_seen[-1][1] == {"status": "ok"}


@pytest.mark.real_model
def test_models_lists_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    meta = httpx.get(f"{server.url}/v1/models").json()["data"][0]["meta"]
    assert meta["n_parallel"] == 8 and meta["n_ctx"] == SLOT_CTX and meta["n_vocab"] == 151936


@pytest.mark.real_model
def test_completion_streamed_equals_non_streamed(client, tokenizer):
    prompt = "def fibonacci(n):"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == "tiny" and choice.text
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert 0 < full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert choice.finish_reason == ("length" if full.usage.completion_tokens == 24 else "stop")

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert (
        len([c for c in chunks if c.choices and c.choices[0].text]) >= 2
    )  # streamed in pieces, not at once

    ids = tokenizer.encode(prompt)  # a token-id prompt is the same prompt
    assert (
        client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
        .choices[0]
        .text
        == choice.text
    )
    none = client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert none.choices[0].text == "" and none.usage.completion_tokens == 0
    assert none.choices[0].finish_reason == "length"


@pytest.mark.real_model
def test_chat_applies_the_chat_template(server, client, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ]
    rendered = tokenizer.apply_chat_template(messages)
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in rendered and rendered.endswith(
        "<|im_start|>assistant\n"
    )
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special=False))
    # the same tokens as a plain completion of the rendered template: the template is what was
    # applied
    plain = client.completions.create(model="tiny", prompt=rendered, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    # the chat request's slot still held the prompt's K/V: only its last token was prefilled again
    assert plain.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1

    stream = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    )
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    parts = [
        {"type": "text", "text": "Name "},
        {"type": "text", "text": "a prime."},
    ]  # content as parts
    with_parts = client.chat.completions.create(
        model="tiny",
        max_tokens=20,
        temperature=0,
        messages=[messages[0], {"role": "user", "content": parts}],
    )
    assert with_parts.choices[0].message.content == chat.choices[0].message.content


@pytest.mark.real_model
def test_stop_strings_end_the_text_before_them(server, client):
    prompt = "The quick brown fox"
    text = (
        client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        .choices[0]
        .text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.find(stop)
    assert cut > 0, (text, stop)
    for stops in (stop, [stop, "\x00never"]):
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stops
        )
        assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
        streamed = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stops, stream=True
        )
        pieces = [c.choices[0] for c in streamed]
        assert "".join(p.text for p in pieces) == text[:cut] and pieces[-1].finish_reason == "stop"


BAD_REQUESTS = [  # (endpoint, raw body, param named in the error)
    ("completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("completions", b'{"prompt": "hi", "max_tokens": 4', None),  # not JSON
    ("completions", b'["prompt"]', None),
    ("completions", b'{"max_tokens": 4}', "prompt"),
    ("completions", b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
    ("completions", b'{"prompt": "hi", "max_tokens": 4.5}', "max_tokens"),
    ("completions", b'{"prompt": "hi", "stream": "yes"}', "stream"),
    ("completions", b'{"prompt": "hi", "top_p": 1.5}', "top_p"),
    ("completions", b'{"prompt": "hi", "temperature": -1}', "temperature"),
    ("completions", b'{"prompt": "hi", "max_tokens": -5}', "max_tokens"),
    ("completions", b'{"prompt": "hi", "seed": 1e400}', "seed"),
    ("completions", b'{"prompt": "hi", "stop": [1]}', "stop.0"),
    ("completions", b'{"prompt": "hi", "n": 0}', "n"),
    ("completions", b'{"prompt": "hi", "n": 1000}', "n"),
    ("completions", b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    ("completions", b'{"prompt": "hi", "logprobs": true}', "logprobs"),
    ("completions", b'{"prompt": ""}', "prompt"),
    ("completions", b'{"prompt": []}', "prompt"),
    ("completions", b'{"prompt": [1, true]}', "prompt.1"),
    ("completions", b'{"prompt": [151936]}', "prompt"),  # outside the vocabulary
    (
        "completions",
        json.dumps({"prompt": "hello " * SLOT_CTX}).encode(),
        "prompt",
    ),  # over the context
    ("chat/completions", b'{"messages": []}', "messages"),
    ("chat/completions", b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages.0.role"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', "messages.0.content"),
    (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
        "tools.0.function",
    ),
]


@pytest.mark.real_model
def test_malformed_requests_get_400_with_an_openai_error_body(server, client):
    for endpoint, raw, param in BAD_REQUESTS:
        r = httpx.post(
            f"{server.url}/v1/{endpoint}",
            content=raw,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, (raw, r.status_code, r.text)
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }, body
        err = body["error"]
        assert (
            err["type"] == "invalid_request_error" and err["code"] is None and err["param"] == param
        ), (raw, err)
        assert isinstance(err["message"], str) and len(err["message"]) > 10, err
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * SLOT_CTX, max_tokens=4)
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_idle(server.url)


async def _stream_text(
    client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int
) -> tuple[str, str]:
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    text, reason = [], None
    async for chunk in stream:
        text.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


async def _concurrently(url: str, prompts: list[list[int]], max_tokens: int):
    """All prompts streamed at once; also the most slots in use and requests queued seen
    meanwhile."""
    seen = {"slots": 0.0, "queued": 0.0}
    async with httpx.AsyncClient(timeout=10) as poller:

        async def poll():
            while True:
                text = (await poller.get(f"{url}/metrics")).text
                for name, key in (
                    ("minfer_kv_slots_used", "slots"),
                    ("minfer_requests_queued", "queued"),
                ):
                    seen[key] = max(
                        seen[key], float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
                    )
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(poll())
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        try:
            results = await asyncio.gather(*(_stream_text(client, p, max_tokens) for p in prompts))
        finally:
            watcher.cancel()
            await client.close()
    return results, seen


@pytest.mark.real_model
def test_64_concurrent_streaming_clients_each_get_their_own_text(server, client):
    # token-id prompts of 1..4 tokens, each ending in its own token
    # (the tiny model mostly echoes the last one)
    prompts = [[1000 + 97 * i, 5000 + 211 * i, 20000 + 1009 * i][-(1 + i % 3) :] for i in range(64)]
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0]
        for p in prompts
    ]
    assert len({a.text for a in alone}) >= 48, (
        "prompts should give distinct texts, or the test proves little"
    )
    t0 = time.perf_counter()
    results, seen = asyncio.run(_concurrently(server.url, prompts, 12))
    elapsed = time.perf_counter() - t0
    for i, ((text, reason), ref) in enumerate(zip(results, alone)):
        assert text == ref.text and reason == ref.finish_reason, (i, prompts[i], text, ref.text)
    assert seen["slots"] == 8 and seen["queued"] > 0, (
        seen
    )  # they really shared batches and waited in the queue
    print(
        f"64 streams in {elapsed:.1f} s; most slots used {seen['slots']:.0f}, most queued "
        f"{seen['queued']:.0f}"
    )
    wait_idle(server.url)


CLIENT_SCRIPT = r"""
import sys, httpx
body = {"prompt": sys.argv[2], "max_tokens": -1, "temperature": 0,
        "stream": sys.argv[3] == "stream"}
with httpx.Client(timeout=300) as c:
    with c.stream("POST", sys.argv[1] + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            pass
"""


@pytest.mark.real_model
def test_clients_killed_mid_stream_free_every_slot(server, client):
    before = metrics(server.url)
    ref = client.completions.create(
        model="tiny", prompt="after the storm", max_tokens=16, temperature=0
    ).choices[0]
    # 10 client processes on 8 slots (two wait in the queue), streaming and not, killed once
    # connected
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CLIENT_SCRIPT,
                server.url,
                f"victim {i}",
                "stream" if i % 3 else "wait",
            ]
        )
        for i in range(10)
    ]
    try:
        deadline = time.monotonic() + 60
        while True:  # until all 10 are in: 8 holding a slot, 2 waiting for one
            busy = metrics(server.url)
            if (busy["minfer_kv_slots_used"], busy["minfer_requests_queued"]) == (8, 2):
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), busy
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # and clients of this process that hang up mid-stream (the openai client, then raw httpx)
    stream = client.completions.create(
        model="tiny", prompt="hang up", max_tokens=-1, temperature=0, stream=True
    )
    next(iter(stream))
    stream.close()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1, "stream": True},
    ) as r:
        next(r.iter_lines())
    idle = wait_idle(server.url)
    cancelled = 'minfer_requests_finished_total{reason="cancelled"}'
    finished = {k: idle[k] - before[k] for k in idle if k.startswith("minfer_requests_finished")}
    assert finished[cancelled] == 12, str(finished)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    again = client.completions.create(
        model="tiny", prompt="after the storm", max_tokens=16, temperature=0
    ).choices[0]
    assert again.text == ref.text


@pytest.mark.real_model
def test_metrics_are_prometheus_text(server, client):
    for _ in range(2):  # the second reuses the first's prompt from its slot
        client.completions.create(
            model="tiny", prompt="count the tokens", max_tokens=8, temperature=0
        )
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith(
        "text/plain; version=0.0.4"
    )
    declared: dict[str, str] = {}
    helped = set()
    for line in r.text.rstrip("\n").split("\n"):
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge") and name in helped, line
            assert name.endswith("_total") == (kind == "counter"), line
            declared[name] = kind
        else:
            m = re.fullmatch(
                r'([a-z_]+)(\{[a-z_]+="[a-z_]+"(,[a-z_]+="[a-z_]+")*\})? '
                r"(-?[0-9.]+(e[-+]?[0-9]+)?)",
                line,
            )
            assert m and m.group(1) in declared, line
    for name in (
        "tokens_per_second",
        "tokens_generated_total",
        "requests_total",
        "requests_running",
        "requests_queued",
        "kv_slots_used",
        "kv_slots_capacity",
    ):
        assert f"minfer_{name}" in declared, name
    m = metrics(server.url)
    assert m["minfer_kv_slots_capacity"] == 8 and m["minfer_ready"] == 1
    assert m["minfer_tokens_generated_total"] > 0 and m["minfer_tokens_per_second"] > 0
    assert m["minfer_requests_total"] >= sum(
        v for k, v in m.items() if k.startswith("minfer_requests_finished")
    )
    assert (
        0 < m["minfer_prompt_tokens_cached_total"] < m["minfer_prompt_tokens_total"]
    )  # the second request's reuse


@pytest.mark.real_model
def test_load_test_reports_its_figures(server, tmp_path, capsys):
    from minfer_bench import load_test

    out = tmp_path / "load.json"
    rc = load_test.main(
        [
            "--url",
            server.url,
            "--clients",
            "4",
            "--requests",
            "8",
            "--max-tokens",
            "8",
            "--prompt-tokens",
            "24",
            "--json",
            str(out),
        ]
    )
    table = capsys.readouterr().out
    assert rc == 0 and "| TTFT p50 ms |" in table, table
    s = json.loads(out.read_text())
    assert s["ok"] == 8 and s["failed"] == 0 and 8 <= s["completion_tokens"] <= 64, s
    assert s["tokens_per_s"] > 0 and 0 < s["ttft_ms_p50"] <= s["ttft_ms_p99"], s
    assert s["itl_ms_p50"] <= s["itl_ms_p99"] and s["tpot_ms_p50"] > 0, s
    assert (
        load_test.main(["--url", "http://192.0.2.1:8080", "--requests", "1"]) == 2
    )  # loopback only
    assert "must point at this machine" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_server(tiny_model, xla_cache, tmp_path_factory):
    """One slot, one queued request, an API key, no warm-up."""
    s = ServerProcess(
        tiny_model,
        tmp_path_factory.mktemp("small_log") / "server.log",
        xla_cache,
        "-np",
        "1",
        "-c",
        "256",
        "--max-queued",
        "1",
        "--api-key",
        "sesame",
        "--no-warmup",
    )
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.mark.real_model
def test_a_full_queue_gets_429_and_the_api_key_is_checked(small_server):
    url, auth = small_server.url, {"Authorization": "Bearer sesame"}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200  # /health needs no key
    body = {"prompt": "keep going", "max_tokens": -1, "temperature": 0, "stream": True}
    with httpx.Client(headers=auth, timeout=60) as c:
        with (
            c.stream("POST", f"{url}/v1/completions", json=body) as first,
            c.stream("POST", f"{url}/v1/completions", json=body) as second,
        ):
            assert first.status_code == second.status_code == 200
            r = c.post(f"{url}/v1/completions", json={"prompt": "one too many", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert (
                r.json()["error"]["type"] == "rate_limit_error"
                and "limit is 2" in r.json()["error"]["message"]
            )
    wait_idle(url, headers=auth)
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0).completions.create(
        model="x", prompt="now there is room", max_tokens=4, temperature=0
    )
    assert ok.usage.completion_tokens <= 4 and ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.real_model
def test_shutdown_ends_queued_requests_at_once_with_503(tiny_model, xla_cache, tmp_path):
    """SIGINT with a request running and one queued: the queued one gets 503 at once (not a
    reset after uvicorn's grace period), the running one streams until that period ends, and the
    server exits."""
    import threading

    s = ServerProcess(
        tiny_model, tmp_path / "server.log", xla_cache,
        "-np", "1", "-c", "32768", "--max-queued", "1", "--no-warmup",
    )  # fmt: skip
    try:
        s.wait_ready()
        endless = {"prompt": "keep going", "max_tokens": -1, "temperature": 0, "stream": True}
        queued: dict = {}

        def post_queued() -> None:
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}, timeout=60)
            queued.update(status=r.status_code, body=r.json(), at=time.monotonic())

        with httpx.stream("POST", f"{s.url}/v1/completions", json=endless, timeout=60) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            waiter = threading.Thread(target=post_queued)
            waiter.start()
            deadline = time.monotonic() + 30
            while metrics(s.url)["minfer_requests_queued"] < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.05)
            signalled = time.monotonic()
            s.proc.send_signal(signal.SIGINT)
            waiter.join(30)
            assert queued, "the queued request got no answer within 30 s"
            assert queued["status"] == 503 and "shutting down" in queued["body"]["error"]["message"]
            assert queued["at"] - signalled < 4  # before the grace period (5 s) ends
            assert next(line for line in lines if line.startswith("data: "))  # still streaming
            with contextlib.suppress(httpx.HTTPError):  # cut at the end of the grace period
                for _ in lines:
                    pass
        assert s.proc.wait(30) == 130  # EXIT_INTERRUPTED
    finally:
        s.stop()


@pytest.mark.real_model
def test_serve_script_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MINFER_COMPILATION_CACHE": "off"}
    script = str(REPO / "scripts" / "serve.py")
    bad = subprocess.run(
        [sys.executable, script, "-np", "0"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: -np/--parallel must be in 1..64, got 0"
    ], bad.stderr
    missing = subprocess.run(
        [
            sys.executable,
            script,
            "-m",
            str(tmp_path / "nope.gguf"),
            "--port",
            "0",  # any free port: this run fails at the load
            "--log-level",
            "critical",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert missing.returncode == 1 and "error: the model failed to load" in missing.stderr, (
        missing.stderr
    )


def test_synthetic_models_get_a_placeholder_tokenizer():
    """minfer_bench.serve -m synthetic:<spec> (the H200 load benchmarks' 7B): real shapes, text to
    stream."""
    from minfer_jax import Options, generate
    from minfer_jax.server.backend import ServerSettingsError

    from minfer_bench.serve import load_model

    model = load_model("synthetic:qwen2.5-0.5b:q8_0:layers=1:seed=3", Options(ctx_size=64))
    assert model.config.n_layers == 1 and model.tokenizer is not None
    out = generate(model, [1, 2, 3], max_new_tokens=2)
    assert out.text == model.tokenizer.decode(out.tokens, skip_special=True) and out.text
    with pytest.raises(ServerSettingsError, match="layers="):
        load_model("synthetic:qwen2.5-0.5b:q8_0:layers=x", Options())


@pytest.mark.real_model
def test_a_wrong_method_gets_405_naming_the_allowed_ones(server):
    """RFC 9110: a 405 carries Allow (the error handler used to drop it)."""
    for method, path, allowed in (
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
    ):
        r = httpx.request(
            method, f"{server.url}{path}", headers={"Content-Type": "application/json"}
        )
        methods = set(r.headers.get("allow", "").split(", "))  # the router's order is a set's
        assert r.status_code == 405 and methods == set(allowed.split(", ")), (method, r.headers)
        assert r.json()["error"]["message"] == "Method Not Allowed"
    for path in ("/health", "/v1/models", "/metrics"):  # HEAD wherever GET: headers, no body
        got, head = httpx.get(f"{server.url}{path}"), httpx.head(f"{server.url}{path}")
        assert head.status_code == got.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == got.headers["content-type"], path


def test_the_api_key_is_compared_as_the_bytes_sent():
    """A non-ASCII --api-key: curl sends it as UTF-8, which the header holds as latin-1 text; and
    one from undecodable argv bytes (a surrogate escape) is refused cleanly, not with a 500."""
    from types import SimpleNamespace

    from starlette.requests import Request

    from minfer_jax.server.app import ApiError, _authorize
    from minfer_jax.server.backend import ServerSettings

    def request(auth: bytes) -> Request:
        return Request({"type": "http", "headers": [(b"authorization", auth)]})

    for key, sent in (("clé", "Bearer clé".encode()), ("\udcff", b"Bearer \xff")):
        backend = SimpleNamespace(settings=ServerSettings(api_key=key))
        _authorize(backend, request(sent))  # the right key passes
        with pytest.raises(ApiError) as refused:
            _authorize(backend, request(b"Bearer wrong"))
        assert refused.value.status == 401


def test_v1_routes_say_the_model_failed_to_load_not_loading():
    """After a failed load /health says so (500), and the /v1 routes must not claim it is still
    loading (503 'Loading model' forever)."""
    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    def loader(*args, **kwargs):
        raise FileNotFoundError("nope.gguf")

    app = create_app(ServerSettings(), loader=loader)
    with TestClient(app, base_url="http://localhost") as c:
        deadline = time.monotonic() + 10
        while app.state.backend.status == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        health = c.get("/health")
        assert health.status_code == 500 and "nope.gguf" in health.json()["error"]["message"]
        for r in (
            c.get("/v1/models"),
            c.post("/v1/completions", json={"prompt": "hi"}),
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
        ):
            err = r.json()["error"]
            assert r.status_code == 500 and err["type"] == "server_error", r.text
            assert "failed to load" in err["message"] and "nope.gguf" in err["message"], err


@pytest.mark.real_model
def test_include_usage_puts_a_null_usage_on_every_other_chunk(server):
    """OpenAI: with stream_options.include_usage, every chunk but the last carries "usage": null
    (clients that check their shapes strictly expect the field); without it, no chunk has one."""
    for endpoint, body in (
        ("completions", {"prompt": "hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        for include in (True, False):
            sent = {**body, "max_tokens": 3, "stream": True}
            if include:
                sent["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=sent, timeout=60) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events
            chunks = [json.loads(e) for e in events[:-1]]
            if include:
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"]
                assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
            else:
                assert all("usage" not in c for c in chunks), chunks


# -- agents: constrained output and the request fields (issue 54) ----------------------------------
def _post(server, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)


# -- logprobs and n > 1 choices (issue 54 item 4) -------------------------------------------------
def _ids_of(tokenizer, entries) -> list[int]:
    """The token ids of chat logprobs entries, from their bytes (each names one token here)."""
    wanted = {bytes(e.bytes) for e in entries}
    by_bytes: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes([i])
        if raw in wanted:
            by_bytes.setdefault(raw, []).append(i)
    assert all(len(by_bytes[bytes(e.bytes)]) == 1 for e in entries)
    return [by_bytes[bytes(e.bytes)][0] for e in entries]


@pytest.mark.real_model
def test_chat_logprobs_are_the_models_log_softmax(client, tokenizer, tiny_model):
    """Each content token's logprob and top_logprobs against log_softmax of the logits the same
    model file gives in this process (prompt_logits over prompt + reply at once); greedy: the
    chosen token is the most likely; streamed chunks carry the same logprobs."""
    import jax
    import numpy as np

    import minfer_jax

    messages = [{"role": "user", "content": "Name a prime."}]
    ask = dict(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True)
    chat = client.chat.completions.create(**ask, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens > 0
    ids = _ids_of(tokenizer, content)
    assert tokenizer.decode(ids, skip_special=True) == chat.choices[0].message.content
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special=False)
    model = minfer_jax.load(str(tiny_model), ctx_size=64)
    logits = model.logits(prompt + ids)[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
    reference = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for row, token, entry in zip(reference, ids, content):
        assert entry.logprob == pytest.approx(row[token], abs=1e-3)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 5
        assert tops == pytest.approx(sorted(row, reverse=True)[:5], abs=1e-3)
        assert entry.top_logprobs[0].bytes == entry.bytes  # greedy: the most likely token
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
    streamed = list(client.chat.completions.create(**ask, top_logprobs=5, stream=True))
    pieces = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, len(e.top_logprobs)) for e in pieces] == [
        (e.token, e.bytes, 5) for e in content
    ]
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=1e-5)
    bare = client.chat.completions.create(**ask).choices[0].logprobs.content  # no top_logprobs
    assert [e.top_logprobs for e in bare] == [[]] * len(content)


@pytest.mark.real_model
def test_completions_logprobs_streamed_and_not(client):
    ask = dict(model="tiny", prompt="def fibonacci(n):", max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**ask)
    lp = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n > 0
    assert all(x <= 0 for x in lp.token_logprobs)
    # greedy: each token is its step's most likely, and the offsets walk the tokens' text
    assert [max(top.values()) for top in lp.top_logprobs] == pytest.approx(lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    streamed = list(client.completions.create(**ask, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [x for p in parts for x in p.text_offset] == lp.text_offset


@pytest.mark.real_model
def test_n_choices_share_one_prefill_streamed_and_not(server, client):
    """n choices: one prefill (the others copy its K/V and prefill their last prompt token), an
    index each, usage counting the prompt once; greedy choices agree, sampled ones differ and are
    reproducible with a seed; streamed choices reassemble to the whole reply's."""
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    cached_before = metrics(server.url)["minfer_prompt_tokens_cached_total"]
    greedy = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    one = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=1)
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 12 or greedy.choices[0].finish_reason == "stop"
    shared = metrics(server.url)["minfer_prompt_tokens_cached_total"] - cached_before
    assert shared >= greedy.usage.prompt_tokens - 1  # the second choice's prompt came copied

    ask = dict(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=7)
    sampled = client.completions.create(**ask, n=2)
    texts = [c.text for c in sampled.choices]
    assert texts[0] != texts[1] and [c.index for c in sampled.choices] == [0, 1]
    assert [c.text for c in client.completions.create(**ask, n=2).choices] == texts
    assert client.completions.create(**ask).choices[0].text == texts[0]  # choice 0: the seed's
    chunks = list(
        client.completions.create(
            **ask, n=2, logprobs=1, stream=True, stream_options={"include_usage": True}
        )
    )
    by_index: dict[int, list] = {0: [], 1: []}
    for c in chunks[:-1]:
        by_index[c.choices[0].index].append(c.choices[0])
    assert ["".join(p.text for p in by_index[i]) for i in range(2)] == texts
    assert [by_index[i][-1].finish_reason for i in range(2)] == [
        c.finish_reason for c in sampled.choices
    ]
    assert chunks[-1].usage.completion_tokens == sampled.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == sampled.usage.prompt_tokens
    logprobs = [[t for p in by_index[i] if p.logprobs for t in p.logprobs.tokens] for i in range(2)]
    assert sum(len(t) for t in logprobs) == sampled.usage.completion_tokens


@pytest.mark.real_model
def test_response_format_json_schema_replies_validate_streamed_and_not(server, client):
    from tests.test_constrained import SCHEMA, validate

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe a thing in JSON."}]
    full = client.chat.completions.create(
        model="tiny", messages=messages, response_format=fmt, max_tokens=120, temperature=0
    )
    text = full.choices[0].message.content
    validate(json.loads(text), SCHEMA)
    assert full.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model="tiny",
        messages=messages,
        response_format=fmt,
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # json_object: any object (the random model's strings run on: only its start is checked);
    # llama-server's json_object with a schema
    anything = client.chat.completions.create(
        model="tiny", messages=messages, response_format={"type": "json_object"}, max_tokens=4
    )
    assert anything.choices[0].message.content.startswith("{")
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_object", "schema": small}
    reply = client.chat.completions.create(
        model="tiny", messages=messages, response_format=fmt, max_tokens=20, temperature=0
    )
    assert json.loads(reply.choices[0].message.content).keys() == {"ok"}


@pytest.mark.real_model
def test_llama_server_json_schema_and_grammar_fields_constrain_completions(server):
    schema = {"type": "array", "items": {"enum": ["x", "yz"]}, "minItems": 2, "maxItems": 4}
    r = _post(server, "completions", {"prompt": "hi", "json_schema": schema, "max_tokens": 40})
    assert r.status_code == 200, r.text
    value = json.loads(r.json()["choices"][0]["text"])
    assert 2 <= len(value) <= 4 and set(value) <= {"x", "yz"}
    gbnf = 'root ::= "yes" | "no"'
    body = {"prompt": "hi", "grammar": gbnf, "max_tokens": 8, "temperature": 1.0, "seed": 1}
    r = _post(server, "completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    # ignore_eos: read (a wrong type is a 400), and the reply runs to max_tokens
    r = _post(server, "completions", {"prompt": "hi", "ignore_eos": True, "max_tokens": 12})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text


# hostile schemas and grammars (tests/hostile_grammars.py) through the server: a few by field, and
# the costliest compiled while a stream runs
HOSTILE_BY_FIELD = [  # (case, the field that carries it)
    ("objects nested 100 deep", "response_format"),
    ("a reference chain of 3000", "json_schema"),
    ("the root referring to itself", "response_format"),
    ("pattern with a backreference", "json_schema"),
    ("GBNF undefined rule", "grammar"),
    ("GBNF 3000 rules chained", "grammar"),
    ("the schema true", "json_schema"),
    ("pattern (a+)+$", "response_format"),
]
HOSTILE_SLOW = [  # the costliest to compile: refused after it (no batch work), or compiled
    "5000 properties (too many items per token)",
    "Lark 21000 alternatives (too many items per token)",
    "GBNF 500 rules chained back to the root",
    "GBNF 10000 alternatives",
    "an object reference chain of 990 (a deep stack)",
]
MAX_GAP_S = 0.100  # issue 54: a compile blocks no other stream for more than 100 ms
STALL_S = 1.0  # the slowest of HOSTILE_SLOW compiles for ~3 s: a stream waiting for it would show
# the machine's other work can change a token's time between the two windows by itself: on the
# shared 2-core machine the median went 0.113 -> 0.213 s (2026-12-07, other engineers' jobs), a
# failure by chance; a compile that blocks the stream adds its own length (>= MAX_GAP_S) instead
LOAD_SWING = 3.0


def _hostile_body(name: str, field: str | None = None) -> dict:
    from tests.hostile_grammars import CASES

    case = {c.name: c for c in CASES}[name]
    field = field or case.kind
    value = case.build()
    if field == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
        messages = [{"role": "user", "content": "hi"}]
        return {"messages": messages, field: fmt, "max_tokens": 1, "temperature": 0}
    return {"prompt": "hi", field: value, "max_tokens": 1, "temperature": 0}


@pytest.mark.real_model
def test_hostile_grammars_through_the_server(server):
    from tests.hostile_grammars import CASES

    says = {c.name: c.says for c in CASES}
    for name, field in HOSTILE_BY_FIELD:
        body = _hostile_body(name, field)
        r = _post(server, "chat/completions" if "messages" in body else "completions", body)
        if says[name] is None:
            assert r.status_code == 200, (name, r.text[:300])
            continue
        assert r.status_code == 400, (name, r.text[:300])
        error = r.json()["error"]
        assert says[name].lower() in error["message"].lower() and error["param"] == field, error


@pytest.mark.real_model
def test_a_stream_keeps_its_pace_while_hostile_grammars_compile(server):
    """The costliest cases of the table compile (two requests at a time) while a reply streams.
    Its median gap between tokens grows by at most MAX_GAP_S past LOAD_SWING times its median
    before, and at most one gap exceeds the largest before by STALL_S (a compile the stream waited
    for would, once per slow request).
    On a shared 2-core CPU, gaps of 0.2-1 s come and go with or without compiles (the machine's
    other work): the printed figures on a quiet machine are the 100 ms check
    (pytest -s -k keeps_its_pace tests/test_server.py). The client hangs up at the first token
    after the compiles: the stream's length only has to outlast them."""
    from tests.hostile_grammars import CASES

    says = {c.name: c.says for c in CASES}
    arrivals: list[float] = []
    window: list[float] = []
    statuses: list[tuple[str, int]] = []

    def send(names: list[str]) -> None:
        for name in names:
            r = _post(server, "completions", _hostile_body(name))
            statuses.append((name, r.status_code))

    def attack() -> None:
        while len(arrivals) < 60:  # the stream runs: its pace before, then the compiles
            time.sleep(0.005)
        window.append(time.perf_counter())
        senders = [
            threading.Thread(target=send, args=(HOSTILE_SLOW,)),
            threading.Thread(target=send, args=(HOSTILE_SLOW[::-1],)),
        ]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        window.append(time.perf_counter())

    body = {"prompt": "hi", "max_tokens": SLOT_CTX - 8, "ignore_eos": True, "stream": True}
    attacker = threading.Thread(target=attack)
    attacker.start()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
            if len(window) == 2 and arrivals[-1] > window[1]:
                break  # the compiles are over: the rest of the stream would measure nothing
    attacker.join()
    wait_idle(server.url, 120)  # the hung-up stream ends before the next test counts slots
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    before = sorted(g for t, g in gaps[5:] if t < window[0])  # the first few: the prefill
    during = sorted(g for t, g in gaps if window[0] <= t <= window[1])
    print(
        f"{len(during)} tokens during {window[1] - window[0]:.2f} s of compiles: gap median "
        f"{during[len(during) // 2] * 1e3:.1f} ms, largest {during[-1] * 1e3:.1f} ms (before: "
        f"{before[len(before) // 2] * 1e3:.1f} / {before[-1] * 1e3:.1f} ms)"
    )
    assert all((code == 200) == (says[name] is None) for name, code in statuses), statuses
    assert len(statuses) == 2 * len(HOSTILE_SLOW) and len(during) >= 10, (statuses, during)
    bound = before[len(before) // 2] * LOAD_SWING + MAX_GAP_S
    assert during[len(during) // 2] <= bound, (before, during)
    # a compile the stream waited for would stall it once per slow request (4 of them): one
    # stall is the machine's noise (swapping, other processes), more would be a compile
    stalls = [g for g in during if g > before[-1] + STALL_S]
    assert len(stalls) <= 1, (before[-5:], stalls)


FORMERLY_IGNORED = [  # (endpoint, extra fields, param named in the 400)
    ("completions", {"ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"grammar": "root ::= missing"}, "grammar"),
    ("completions", {"json_schema": {"type": "nope"}}, "json_schema"),
    ("completions", {"mirostat": 2}, "mirostat"),
    ("completions", {"typical_p": 0.5}, "typical_p"),
    ("completions", {"n_probs": 5}, "n_probs"),
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("completions", {"messages": []}, "messages"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"json_schema": {}, "grammar": 'root ::= "a"'}, None),
    ("chat/completions", {"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
]


@pytest.mark.real_model
def test_no_field_is_dropped_in_silence(server):
    """Each field a client may send is honoured or refused with a 400 naming it; fields that only
    describe the caller (and cache_prompt: prefix reuse is always on) are accepted."""
    base = {
        "completions": {"prompt": "hi", "max_tokens": 2},
        "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    }
    for endpoint, extra, param in FORMERLY_IGNORED:
        r = _post(server, endpoint, {**base[endpoint], **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    message = {"role": "user", "content": "hi", "audio": {"id": "x"}}
    r = _post(server, "chat/completions", {"messages": [message], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.audio"
    accepted = {"user": "u", "metadata": {"a": "b"}, "cache_prompt": True, "store": False}
    for endpoint, body in base.items():
        r = _post(server, endpoint, {**body, **accepted, "mirostat": 0, "typical_p": 1.0})
        assert r.status_code == 200, r.text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}


def _valid_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f"), args
    assert isinstance(args["city"], str) and len(args["city"]) <= 20


@pytest.mark.real_model
def test_forced_tool_calls_validate_streamed_and_not_and_results_feed_back(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[CLOCK, WEATHER],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _valid_weather_args(call.function.arguments)

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[CLOCK, WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices[0].delta.tool_calls or []:
            got = calls.setdefault(c.index, {"name": "", "arguments": ""})
            got["name"] += c.function.name or ""
            got["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0], calls
    assert calls[0]["name"] in ("get_weather", "clock")
    if calls[0]["name"] == "get_weather":
        _valid_weather_args(calls[0]["arguments"])

    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    again = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert again.usage.prompt_tokens > full.usage.prompt_tokens + 10  # the call and its result
    bad = {"type": "function", "function": {"name": "nowhere"}}
    with pytest.raises(openai.BadRequestError, match="nowhere"):
        client.chat.completions.create(
            model="tiny", messages=messages, tools=[WEATHER], tool_choice=bad, max_tokens=4
        )


@pytest.mark.real_model
def test_anthropic_messages_api_with_a_system_prompt_tools_and_its_stream(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "input_schema": WEATHER["function"]["parameters"],
        "description": "The weather in a city",
    }
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    forced = client.messages.create(
        model="tiny",
        system="You are terse.",
        messages=messages,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=60,
        extra_body={"temperature": 0},
    )
    assert forced.stop_reason == "tool_use" and forced.role == "assistant", forced
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    _valid_weather_args(json.dumps(use.input))
    history = messages + [
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}],
        },
    ]
    count = client.messages.count_tokens(model="tiny", messages=history, tools=[tool])
    assert count.input_tokens > forced.usage.input_tokens
    with client.messages.stream(
        model="tiny", messages=history, tools=[tool], max_tokens=6, extra_body={"temperature": 0}
    ) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert names[-2] == "message_delta" and "content_block_start" in names, names
    assert names.index("content_block_start") < names.index("content_block_stop"), names
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "tiny", "messages": messages})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.text


@pytest.mark.real_model
def test_a_forced_call_cut_by_max_tokens_shows_none_of_its_framing(server, client):
    """A forced call cut at max_tokens 5 showed '<tool_call>\\n{"name":' as the reply's content,
    whole and streamed, and as an Anthropic text block."""
    import anthropic

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ask = dict(model="tiny", messages=messages, tools=[WEATHER], tool_choice="required",
               max_tokens=5, temperature=0)  # fmt: skip
    full = client.chat.completions.create(**ask).choices[0]
    assert full.finish_reason == "length" and not full.message.tool_calls, full
    assert not full.message.content, full
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    messages_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    ask = dict(model="tiny", messages=messages, tools=[tool], tool_choice={"type": "any"},
               max_tokens=5, extra_body={"temperature": 0})  # fmt: skip
    whole = messages_client.messages.create(**ask)
    assert whole.stop_reason == "max_tokens" and whole.content == [], whole
    with messages_client.messages.stream(**ask) as stream:
        assert stream.get_final_message().content == []


def test_an_assistant_message_last_is_a_prefill_the_reply_continues(client, tokenizer):
    """As llama-server and Anthropic's API take it: the prompt ends with the template's generation
    prompt and the message's text, not with that message closed and a new turn opened."""
    messages = [{"role": "user", "content": "Name a colour."}]
    prefill = "The colour is"
    opened = tokenizer.apply_chat_template(messages)
    want = len(tokenizer.encode(opened, add_special=False)) + len(
        tokenizer.encode(prefill, add_special=False, parse_special=False)
    )
    reply = client.chat.completions.create(
        model="tiny", messages=[*messages, {"role": "assistant", "content": prefill}],
        max_tokens=1, temperature=0,
    )  # fmt: skip
    assert reply.usage.prompt_tokens == want
    thought = {"role": "assistant", "content": prefill, "reasoning_content": "hm"}
    with pytest.raises(openai.BadRequestError, match="reasoning_content"):  # never dropped
        client.chat.completions.create(model="tiny", messages=[*messages, thought], max_tokens=1)
