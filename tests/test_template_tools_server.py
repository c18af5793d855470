"""The agent server on the tool-call formats of real templates beyond Qwen's and harmony
(Mistral's three, Gemma 4's, DeepSeek R1's): a forced call comes back as an OpenAI tool call, its
markers written as the vocabulary's control tokens, and the call with its result renders into the
next prompt (Mistral's templates take back only 9-character ids). A tiny random Qwen2 whose
vocabulary is the real one plus those markers as control tokens (as real Mistral and Gemma 4
files type them): whatever parses is the grammar's doing."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
USER = {"role": "user", "content": "Weather in Paris?"}
CTX = 2048  # Mistral Small 3.2's template writes a long system prompt


@pytest.fixture(scope="module")
def tiny(real_model):
    """A tiny random Qwen2 with the real 0.5B's vocabulary plus the markers as control tokens."""
    import minfer_jax
    from minfer_jax.files.vocabulary import FORMAT_MARKERS

    from minfer_bench.synthetic import SYNTHETIC_CONFIGS, synthetic_model_from_config

    meta = real_model.metadata
    known = set(meta["tokenizer.ggml.tokens"])
    markers = [m for m in FORMAT_MARKERS if m not in known]  # the product's list, not a copy
    tokens = [*meta["tokenizer.ggml.tokens"], *markers]
    cfg = dataclasses.replace(
        SYNTHETIC_CONFIGS["qwen2.5-0.5b"],
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        head_dim=0,
        vocab_size=len(tokens),
    )
    gm = synthetic_model_from_config(cfg, "q8_0", seed=3)
    gm.metadata.update({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    types = [*meta["tokenizer.ggml.token_type"], *[3] * len(markers)]
    gm.metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    return minfer_jax.load(gguf_model=gm, kernels="xla", ctx_size=CTX, progress=False)


@pytest.fixture(scope="module")
def http(tiny):
    """One server for every template (each test sets the model's template; the app reads it per
    request)."""
    from starlette.testclient import TestClient

    from minfer_jax.server.app import create_app
    from minfer_jax.server.backend import ServerSettings

    settings = ServerSettings(warmup=False, ctx_size=CTX, seed=0)  # -s: unseeded requests repeat
    app = create_app(settings, loader=lambda *args, **kwargs: tiny)
    with TestClient(app, base_url="http://localhost") as client:
        for _ in range(600):  # the model loads in a thread after the app starts
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        yield client


@pytest.mark.parametrize(
    "name, markers",
    [
        ("mistralai-Mistral-Nemo-Instruct-2407", {"[TOOL_CALLS]"}),
        ("Mistral-Small-3.2-24B-Instruct-2506", {"[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"}),
        ("unsloth-mistral-Devstral-Small-2507", {"[TOOL_CALLS]", "[ARGS]"}),
        ("google-gemma-4-31B-it", {"<|tool_call>", "<tool_call|>", '<|"|>'}),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"}),
    ],
)
def test_a_forced_call_and_its_result_through_the_server(tiny, http, monkeypatch, name, markers):
    from minfer_jax.server import tools
    from minfer_jax.server.schemas import ChatCompletionRequest

    template = (TEMPLATES / f"{name}.jinja").read_text("utf-8")
    monkeypatch.setattr(tiny.tokenizer, "chat_template", template)
    request = {
        "model": "m",
        "messages": [USER],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 0,
    }
    fmt, _ = tools.tool_setup(tiny, ChatCompletionRequest.model_validate(request))
    bound = {text for text, _ in fmt.marks.control}
    assert markers <= bound, bound  # the grammar names these tokens by id, never their spelling
    reply = http.post("/v1/chat/completions", json=request)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and set(args) == {"city", "days"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 6 and 1 <= args["days"] <= 9
    if "istral" in name:
        assert len(call["id"]) == 9 and call["id"].isalnum()
    history = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21 C"},
    ]
    again = http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": history, "tools": [WEATHER], "max_tokens": 2},
    )
    assert again.status_code == 200, again.text
    before, after = reply.json()["usage"], again.json()["usage"]
    assert after["prompt_tokens"] > before["prompt_tokens"] + 5  # the call and its result
