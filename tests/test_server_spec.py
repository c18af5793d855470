"""The server's speculative decoding per request and per slot (issue 55; server/speculation.py):
concurrent clients, some drafting and some not, get the text they get without speculation; the
reply's timings count the drafts; bad `speculative.*` values are a 400 naming the field; the plan
of a server started with --spec-type holds the verification executables, and one without none.

In process (starlette's TestClient under the openai client), on test_server.py's tiny random
Qwen2 with the real tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import types

import openai
import pytest

import minfer_jax
from minfer_jax.engine import spec_plan
from minfer_jax.engine.lookup import Speculation
from minfer_jax.server import schemas
from minfer_jax.server.speculation import request_speculation
from tests.test_server import write_tiny_gguf

pytestmark = pytest.mark.real_model
VERIFY_KEYS = (spec_plan.VerifyKey, spec_plan.VerifyBatchKey)


@pytest.fixture(scope="module")
def tiny(real_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_server_model") / "tiny.gguf"
    write_tiny_gguf(
        path, {k: v for k, v in real_model.metadata.items() if k.startswith("tokenizer.")}
    )
    return minfer_jax.load(str(path), kernels="xla", ctx_size=256, prefill_chunk=64)


def started(model, speculation):
    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    # seed: a request that gives none samples the same each run (plain's logprobs, the 400s)
    settings = ServerSettings(n_parallel=4, warmup=False, speculation=speculation, seed=0)
    app = create_app(settings, loader=lambda *args, **kwargs: model)
    http = TestClient(app, base_url="http://localhost")
    http.__enter__()
    deadline = time.monotonic() + 60
    while app.state.backend.status == "loading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return app, http


@pytest.fixture(scope="module")
def spec_server(tiny):
    app, http = started(tiny, Speculation(draft_max=7))
    client = openai.OpenAI(
        base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0
    )
    yield app, http, client
    http.__exit__(None, None, None)


def prompts(tokenizer):
    """Texts that quote a block (lookup drafts its repeat) and ones with nothing to copy."""
    block = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n"
    return [
        f"Repeat this code exactly:\n{block}\nHere it is again:\n{block[:20]}",
        "Once upon a time there was a small",
        f"{block}\n# the same once more\n{block[:12]}",
        "The capital of France is",
    ]


def test_concurrent_drafting_and_plain_requests_get_their_plain_text(tiny, spec_server):
    app, http, client = spec_server
    texts = prompts(tiny.tokenizer)

    def complete(i, text, speculate):
        extra = {} if speculate else {"speculative.n_max": 0}
        return client.completions.create(
            model="tiny", prompt=text, max_tokens=24, temperature=0, extra_body=extra
        )

    # requests 0 and 2 draft (the server's default), 1 and 3 turn it off: one batch mixes them
    # (this model's greedy text repeats, so its drafts are accepted: test_slot_spec.py has the
    # rejected ones)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [(i, t, i % 2 == 0) for i, t in enumerate(texts)]
        mixed = list(pool.map(lambda a: complete(*a), runs))
    alone = [complete(i, t, False) for i, t in enumerate(texts)]
    for a, b in zip(alone, mixed):
        assert b.choices[0].text == a.choices[0].text
    timings = [getattr(r, "timings", None) or r.model_extra.get("timings") for r in mixed]
    assert timings[1] is None and timings[3] is None  # no drafts, no timings
    assert (
        timings[0]["draft_n"] > 0 and 0 <= timings[0]["draft_n_accepted"] <= timings[0]["draft_n"]
    )
    keys = [k for k in tiny.compiled_keys() if isinstance(k, spec_plan.VerifyBatchKey)]
    assert keys  # rows verified together
    scrape = {
        line.split()[0]: float(line.split()[1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith("minfer_draft")
    }
    assert scrape["minfer_draft_tokens_total"] >= timings[0]["draft_n"] + timings[2]["draft_n"]
    plan = app.state.backend.scheduler.plan
    assert plan.draft_max == 7 and any(isinstance(k, VERIFY_KEYS) for k in plan.serving_keys())


@pytest.mark.parametrize(
    "field, value",
    [
        ("speculative.n_max", -1),
        ("speculative.n_min", -2),
        ("speculative.p_min", 1.5),
        ("speculative.n_max", "4"),
        ("speculative.type", "ngram-simple"),
    ],
)
def test_bad_speculative_values_are_a_400_naming_the_field(spec_server, field, value):
    _, _, client = spec_server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={field: value}
        )
    assert field in e.value.message and e.value.body["param"] == field


def test_drafts_refused_where_the_request_or_server_cannot_speculate(tiny, spec_server):
    _, _, client = spec_server
    with pytest.raises(openai.BadRequestError, match="logprobs") as e:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, logprobs=1, extra_body={"speculative.n_max": 3}
        )
    assert e.value.body["param"] == "speculative.n_max"
    plain = client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=1)
    assert plain.choices[0].logprobs is not None  # the server's default leaves such requests be
    app, http = started(tiny, None)
    try:
        assert not any(
            isinstance(k, VERIFY_KEYS) for k in app.state.backend.scheduler.plan.serving_keys()
        )
        r = http.post("/v1/completions", json={"prompt": "hi", "speculative.n_max": 4})
        assert r.status_code == 400 and "--spec-type" in r.json()["error"]["message"]
        ok = http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "speculative.n_max": 0}
        )
        assert ok.status_code == 200
    finally:
        http.__exit__(None, None, None)


def test_the_body_takes_llama_servers_dotted_names_and_counts_past_the_server_clamp():
    fields = {"speculative.n_max": 12, "speculative.n_min": 9, "speculative.p_min": 0.5}
    req = schemas.parse(schemas.CompletionRequest, json.dumps({"prompt": "hi", **fields}).encode())
    assert (req.spec_n_max, req.spec_n_min, req.spec_p_min) == (12, 9, 0.5)
    dense = types.SimpleNamespace(recurrent_layer_ids=(), family="qwen2")
    spec = request_speculation(Speculation(draft_max=7), req, dense, None, None)
    assert spec == Speculation(draft_max=7, draft_min=7)  # the server's most, n_min within it
