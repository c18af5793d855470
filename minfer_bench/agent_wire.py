"""The agent load test's client side of the wire (agent_load.py): one case sent, its reply read
whole or streamed (OpenAI's chunks or Anthropic's events) into an Outcome, with every breach of
the wire contract noted in Outcome.problems."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from minfer_bench.agent_cases import Case, Choice, Outcome

CANCEL_ABANDON_S = 0.5  # a non-streamed request to be abandoned waits this long


async def send(client, url: str, case: Case) -> Outcome:
    """Send one case and read its reply (or cancel it as the case says)."""
    target = f"{url}/v1/{case.endpoint}"
    if not case.stream:
        if case.cancel_after == 0:
            try:
                r = await asyncio.wait_for(client.post(target, json=case.body), CANCEL_ABANDON_S)
            except TimeoutError:
                return Outcome(200)
            return Outcome(r.status_code, body=r.text)
        r = await client.post(target, json=case.body)
        if r.status_code != 200:
            return Outcome(r.status_code, body=r.text)
        try:
            data = r.json()
        except ValueError:
            return Outcome(r.status_code, problems=[f"reply is not JSON: {r.text[:200]}"])
        if case.endpoint == "messages":
            return anthropic_whole(data)
        return openai_whole(data, case.endpoint)
    async with client.stream("POST", target, json=case.body) as r:
        if r.status_code != 200:
            return Outcome(r.status_code, body=(await r.aread()).decode(errors="replace"))
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if case.cancel_after is not None and len(events) >= case.cancel_after:
                    return Outcome(200)  # leaving the block closes the connection mid-stream
    if case.endpoint == "messages":
        return anthropic_stream(events)
    usage = bool((case.body.get("stream_options") or {}).get("include_usage"))
    return openai_stream(events, case.endpoint, usage)


def _usage_problems(usage, prompt="prompt_tokens", output="completion_tokens") -> list[str]:
    if not isinstance(usage, dict):
        return [f"usage {usage!r}"]
    counts: list[Any] = [usage.get(prompt), usage.get(output)]
    if not all(isinstance(v, int) and v >= 0 for v in counts):
        return [f"usage counts {usage}"]
    if "total_tokens" in usage and usage["total_tokens"] != sum(counts):
        return [f"usage total {usage}"]
    return []


def _openai_choice(c: dict, chat: bool) -> Choice:
    if not chat:
        lp = c.get("logprobs")
        return Choice(c.get("text") or "", finish=c.get("finish_reason"),
                      logprobs=None if lp is None else lp["token_logprobs"])  # fmt: skip
    m = c["message"]
    calls = [[t["function"]["name"], t["function"]["arguments"]] for t in m.get("tool_calls") or []]
    lp = c.get("logprobs")
    return Choice(m.get("content") or "", m.get("reasoning_content") or "", calls,
                  c.get("finish_reason"), None if lp is None else lp["content"])  # fmt: skip


def openai_whole(data: dict, endpoint: str) -> Outcome:
    chat = endpoint.startswith("chat")
    out = Outcome(200, usage=data.get("usage"), timings=data.get("timings"))
    want = "chat.completion" if chat else "text_completion"
    if data.get("object") != want:
        out.problems.append(f"object {data.get('object')!r}")
    choices = data.get("choices") or []
    if [c.get("index") for c in choices] != list(range(len(choices))) or not choices:
        out.problems.append(f"choice indices {[c.get('index') for c in choices]}")
    try:
        out.choices = [_openai_choice(c, chat) for c in choices]
    except (KeyError, TypeError) as e:
        out.problems.append(f"choice shape: {type(e).__name__} {e}")
    out.problems += _usage_problems(out.usage)
    return out


def _apply_delta(choice: Choice, calls: dict, delta: dict, problems: list[str]) -> None:
    choice.text += delta.get("content") or ""
    choice.reasoning += delta.get("reasoning_content") or ""
    for t in delta.get("tool_calls") or []:
        i = t.get("index")
        fn = t.get("function") or {}
        if i not in calls:
            if not t.get("id") or not fn.get("name"):
                problems.append(f"first delta of tool call {i} without id or name: {t}")
            calls[i] = [fn.get("name"), ""]
        calls[i][1] += fn.get("arguments") or ""


def openai_stream(events: list[str], endpoint: str, usage: bool = True) -> Outcome:
    """OpenAI's chunks: one id, choices by index each finishing once, then usage (where asked),
    then [DONE]."""
    chat = endpoint.startswith("chat")
    out = Outcome(200)
    if not events or events[-1] != "[DONE]":
        out.problems.append(f"stream does not end with [DONE]: {events[-2:]}")
    choices: dict[int, Choice] = {}
    calls: dict[int, dict] = {}
    ids = set()
    for raw in events:
        if raw == "[DONE]":
            continue
        data = json.loads(raw)
        if "error" in data:
            out.problems.append(f"error event {data['error']}")
            continue
        ids.add(data.get("id"))
        if out.usage is not None:
            out.problems.append("a chunk after the usage chunk")
        if data.get("usage"):
            out.usage, out.timings = data["usage"], data.get("timings")
        for c in data.get("choices") or []:
            i = c["index"]
            choice = choices.setdefault(i, Choice(logprobs=[] if c.get("logprobs") else None))
            calls.setdefault(i, {})
            if choice.finish is not None:
                out.problems.append(f"choice {i} chunk after its finish_reason")
            if c.get("finish_reason") is not None:
                choice.finish = c["finish_reason"]
            lp = c.get("logprobs")
            if lp:
                choice.logprobs = (choice.logprobs or []) + (
                    lp["content"] if chat else lp["token_logprobs"]
                )
            if chat:
                _apply_delta(choice, calls[i], c.get("delta") or {}, out.problems)
            else:
                choice.text += c.get("text") or ""
    if len(ids) > 1:
        out.problems.append(f"{len(ids)} ids in one stream")
    out.choices = [choices[i] for i in sorted(choices)]
    if sorted(choices) != list(range(len(choices))) or not choices:
        out.problems.append(f"choice indices {sorted(choices)}")
    for i, choice in enumerate(out.choices):
        choice.calls = [calls[i][k] for k in sorted(calls.get(i, {}))]
        if choice.finish is None:
            out.problems.append(f"choice {i} never finished")
    out.problems += _usage_problems(out.usage) if usage else []
    return out


def _blocks_choice(blocks: list[dict], stop: str | None, problems: list[str]) -> Choice:
    choice = Choice(finish=stop)
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            choice.text += b["text"]
        elif kind == "thinking":
            choice.reasoning += b["thinking"]
        elif kind == "tool_use":
            if not b.get("id") or not isinstance(b.get("input"), dict):
                problems.append(f"tool_use block {b}")
            choice.calls.append([b.get("name"), b.get("input")])
        else:
            problems.append(f"content block of type {kind!r}")
    return choice


def anthropic_whole(data: dict) -> Outcome:
    out = Outcome(200, usage=data.get("usage"))
    if data.get("type") != "message" or data.get("role") != "assistant":
        out.problems.append(f"type {data.get('type')!r} role {data.get('role')!r}")
    out.choices = [_blocks_choice(data.get("content") or [], data.get("stop_reason"), out.problems)]
    out.choices[0].stop_sequence = data.get("stop_sequence")
    out.problems += _usage_problems(out.usage, "input_tokens", "output_tokens")
    return out


def anthropic_stream(events: list[str]) -> Outcome:
    """Anthropic's events: message_start, per block start / deltas / stop with indices in order,
    message_delta (stop_reason, usage), message_stop last."""
    out = Outcome(200)
    parsed = [json.loads(e) for e in events]
    kinds = [e.get("type") for e in parsed]
    if kinds[:1] != ["message_start"] or kinds[-1:] != ["message_stop"]:
        out.problems.append(f"events begin {kinds[:1]} and end {kinds[-1:]}")
    if kinds.count("message_delta") != 1:
        out.problems.append(f"{kinds.count('message_delta')} message_delta events")
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    open_index, stop, sequence = None, None, None
    for e in parsed:
        kind = e.get("type")
        if kind == "error":
            out.problems.append(f"error event {e.get('error')}")
        elif kind == "content_block_start":
            if open_index is not None or e["index"] != len(blocks):
                out.problems.append(f"block {e['index']} starts, {open_index} open")
            open_index = e["index"]
            blocks.append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            if e["index"] != open_index:
                out.problems.append(f"delta of block {e['index']}, {open_index} open")
                continue
            d, block = e["delta"], blocks[open_index]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "input_json_delta":
                partial[open_index] = partial.get(open_index, "") + d["partial_json"]
        elif kind == "content_block_stop":
            if e["index"] != open_index:
                out.problems.append(f"stop of block {e['index']}, {open_index} open")
            open_index = None
        elif kind == "message_delta":
            stop, sequence = e["delta"].get("stop_reason"), e["delta"].get("stop_sequence")
            out.usage = e.get("usage")
    for i, text in partial.items():
        try:
            blocks[i]["input"] = json.loads(text)
        except ValueError:
            out.problems.append(f"tool_use {i} input is not JSON: {text!r}")
    out.choices = [_blocks_choice(blocks, stop, out.problems)]
    out.choices[0].stop_sequence = sequence
    if out.usage is None or not isinstance(out.usage.get("output_tokens"), int):
        out.problems.append(f"message_delta usage {out.usage}")
    return out
