"""The library calls on a loaded Model: `generate` and `generate_batch`, run through the Model's
scheduler (scheduler.py), the package's one host loop.

A prompt is text, token ids (a list, a NumPy or a JAX array of ints) or a chat: a list of
`{"role": ..., "content": ...}` messages (a system prompt first, if any) rendered with the model's
chat template. Sampling is a `Sampler`, or its fields as keywords: the fields not given take
Sampler's defaults (`generate(m, p, top_k=40)` samples at temperature 0.8, as `Sampler(top_k=40)`
does); with neither, decoding is greedy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard, Unpack

from minfer_jax import validate
from minfer_jax.engine import plan as plan_mod
from minfer_jax.engine.draft_model import speculation_for
from minfer_jax.engine.options import unknown_keyword
from minfer_jax.engine.runtime import Model
from minfer_jax.engine.sampling import Sampler, SamplerKeywords, sampler_of, within_context
from minfer_jax.engine.steps import GenerationResult
from minfer_jax.errors import InvalidArgumentError
from minfer_jax.files.prompts import encode_chat

Message = Mapping[str, Any]
Prompt = str | Sequence[int] | Sequence[Message] | Any  # Any: an array of token ids
SAMPLER_FIELDS = tuple(SamplerKeywords.__annotations__)


def _is_messages(prompt: Any) -> TypeGuard[Sequence[Message]]:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def _checked_messages(messages: Sequence[Message]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidArgumentError(
                f"message #{i} must have a str 'role' and a str 'content', got {dict(m)!r:.80}"
            )
        out.append({**m, "content": validate.text(f"message #{i} content", content)})
    return out


def prompt_ids(model: Model, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of a prompt: text tokenized (with chat=True wrapped in the chat template as one
    user message), messages rendered with the chat template, or token ids as given."""
    if _is_messages(prompt):
        if model.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer metadata: pass token ids")
        return encode_chat(model.tokenizer, _checked_messages(prompt), validate.INT32_MAX)
    if not isinstance(prompt, str):
        return validate.token_ids(prompt, model.config.vocab_size, "prompt")
    validate.text("prompt", prompt)
    if model.tokenizer is None:
        raise InvalidArgumentError("this model has no tokenizer metadata: pass token ids")
    if chat:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return model.tokenizer.encode(text, add_special=False)
    return model.tokenizer.encode(prompt)


def _sampler(model: Model, sampler: Sampler | None, settings: Mapping[str, Any]) -> Sampler:
    """generate()'s one sampler: the one given, or one built from its keywords; past the context
    or the vocabulary means all of it (validate.clamped_count; README "Extreme values")."""
    for name in settings:
        if name not in SAMPLER_FIELDS:
            known = ("sampler", "max_new_tokens", "seed", "stop", "chat", *SAMPLER_FIELDS)
            raise unknown_keyword(name, known, "generate()")
    if sampler is None:
        sampler = sampler_of(history_cap=model.ctx_size, vocab=model.config.vocab_size, **settings)
    elif settings:
        raise InvalidArgumentError(
            f"pass a sampler or its settings ({', '.join(settings)}), not both"
        )
    elif not isinstance(sampler, Sampler):
        raise InvalidArgumentError(
            f"sampler must be a minfer_jax.Sampler, got {type(sampler).__name__}"
        )
    return within_context(sampler, model.ctx_size, model.config.vocab_size)


def _model(model: Any) -> Model:
    if not isinstance(model, Model):
        raise InvalidArgumentError(
            f"model must be a minfer_jax.Model (from minfer_jax.load), got {type(model).__name__}"
        )
    return model


def generate(
    model: Model,
    prompt: Prompt,
    *,
    sampler: Sampler | None = None,
    max_new_tokens: int = 128,
    seed: int = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    decode_steps: int = plan_mod.DECODE_STEPS,
    json_schema=None,
    grammar: str | None = None,
    ignore_eos: bool = False,
    speculative: str | None = None,
    draft_max: int | None = None,
    draft_min: int | None = None,
    draft_model: Any = None,
    draft_p_min: float | None = None,
    logprobs: int | None = None,
    **settings: Unpack[SamplerKeywords],
) -> GenerationResult:
    """Generate from a prompt: text (with chat=True wrapped in the chat template), a list of chat
    messages, or token ids (a list, NumPy or JAX array).

    sampler: how tokens are drawn; or its fields as keywords (temperature=0.7, top_k=40), the
    others at Sampler's defaults; neither: greedy. decode_steps: tokens per decode executable
    (text streams to on_text once per such chunk). max_new_tokens and repeat_last_n of -1 or past
    the context mean the context, top_k past the vocabulary the vocabulary (clamped, as in
    llama.cpp). json_schema (a dict) or grammar (GBNF text, or llguidance's Lark opening with
    %llguidance) constrain the reply (the `grammar` extra: llguidance); ignore_eos never samples an
    end-of-sequence token. speculative="lookup" (llama.cpp's "ngram-simple") drafts tokens from
    the prompt and output so far and verifies up to draft_max (1..15, default 7) of them in one
    step, skipping drafts shorter than draft_min: the same tokens as without it (greedy), the same
    distribution (sampled); result.speculation counts what it did. speculative="draft" (llama.cpp's
    "draft-simple") drafts with draft_model instead, a smaller model of the same vocabulary (a
    GGUF path, loaded once with this model's options; a loaded Model; or a DraftModel from
    load_draft, which keeps its KV cache between calls), each drafted token's probability at least
    draft_p_min (default 0.75). speculative="draft-mtp" (alias "mtp"; a model loaded with
    mtp=True) drafts draft_max (default 3) tokens a step with the file's MTP block. The hybrids
    (qwen35, qwen35moe) speculate too (their recurrent state rolls back per token). logprobs
    (0..20): the result's
    `logprobs` holds each token's log-probability under the model's distribution (raw logits:
    before the temperature and the filters) and this many most likely alternatives. An unknown
    keyword is an
    InvalidArgumentError naming it.
    """
    model = _model(model)
    validate.generate_arguments(
        max_new_tokens=max_new_tokens, seed=seed, stop=stop, chat=chat, on_text=on_text
    )
    sampler = _sampler(model, sampler, settings)
    speculation = speculation_for(
        model, speculative, draft_max, draft_min, draft_model=draft_model, p_min=draft_p_min
    )
    if speculation is not None and speculation.on_device and not model.has_mtp:
        raise InvalidArgumentError(
            f"speculative={speculative!r} drafts with the file's MTP block: load the model with "
            "minfer_jax.load(..., mtp=True) (a Qwen3.5 / 3.6 file that carries one)"
        )
    max_new_tokens = validate.clamped_count(
        "max_new_tokens", max_new_tokens, model.ctx_size, all_of="the context"
    )
    constraint = model.constraint(json_schema=json_schema, grammar=grammar, ignore_eos=ignore_eos)
    sched = model.scheduler(1, decode_steps=decode_steps)
    req = sched.submit(
        prompt_ids(model, prompt, chat),
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        seed=seed,
        stop=stop,
        on_text=on_text,
        constraint=constraint,
        speculation=speculation,
        logprobs=logprobs,
    )
    sched.run([req])
    return req.result()


def generate_batch(
    model: Model,
    prompts: Sequence[Prompt],
    *,
    sampler: Sampler | None = None,
    max_new_tokens: int = 128,
    seed: int | Sequence[int] = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    max_batch: int = plan_mod.MAX_SEQS,
    decode_steps: int = plan_mod.DECODE_STEPS,
    **settings: Unpack[SamplerKeywords],
) -> list[GenerationResult]:
    """generate() for many prompts at once, decoded together; one result per prompt, in order.

    prompts: a list of prompts (each as generate() takes it), never one string. seed: one for all
    prompts or one per prompt. A prompt equal to an earlier one shares its prefill (n choices of
    one prompt: pass it n times with n seeds). A sequence gets the tokens it gets alone when the
    model was loaded with deterministic=True (any batch, any platform) and on the CPU's default
    path; on the GPU's default kernels a batch can part from the lone tokens at near ties (README,
    "Batch invariance").
    """
    model = _model(model)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise InvalidArgumentError(
            f"prompts must be a list of prompts (use generate() for one), got "
            f"{type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        return []
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts):
        raise InvalidArgumentError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    validate.generate_arguments(
        max_new_tokens=max_new_tokens, seed=0, stop=stop, chat=chat, on_text=None
    )
    seeds = [validate.seed(s) for s in seeds]
    validate.integer("max_batch", max_batch, 1, plan_mod.MAX_SEQS)
    sampler = _sampler(model, sampler, settings)
    max_new_tokens = validate.clamped_count(
        "max_new_tokens", max_new_tokens, model.ctx_size, all_of="the context"
    )
    sched = model.scheduler(min(len(prompts), max_batch), decode_steps=decode_steps)
    reqs: list = []
    firsts: dict[tuple[int, ...], Any] = {}  # prompt -> its first request (the leader)
    for p, s in zip(prompts, seeds):
        ids = prompt_ids(model, p, chat)
        req = sched.submit(
            ids,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            seed=s,
            stop=stop,
            leader=firsts.get(tuple(ids)),
        )
        firsts.setdefault(tuple(ids), req)
        reqs.append(req)
    sched.run(reqs)
    return [r.result() for r in reqs]
