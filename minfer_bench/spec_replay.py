"""A drafter that replays a known continuation, with mistakes placed on purpose: verification must
give the plain tokens whatever it is fed (tests/test_speculative.py, tools/spec_check.py)."""

from __future__ import annotations

from minfer_jax.engine.lookup import Drafter, Speculation


class ReplayDrafter(Drafter):
    """Drafts of up to draft_max tokens from `tokens` (the plain run's output after a prompt of
    prompt_len tokens), in turn: the last token wrong, the first token wrong, all right."""

    def __init__(self, prompt_len: int, tokens: list[int], vocab: int, draft_max: int = 3):
        super().__init__(Speculation(draft_max=draft_max))
        self.prompt_len, self.tokens, self.vocab, self.turn = prompt_len, tokens, vocab, 0

    def propose(self, seq: list[int], room: int) -> list[int]:
        done = len(seq) - self.prompt_len
        k = min(self.spec.draft_max, room - 1)
        draft = (self.tokens[done:] + [0] * k)[:k]
        self.turn += 1
        wrong = {1: k - 1, 2: 0}.get(self.turn % 3)  # which draft token to spoil, if any
        if wrong is not None and draft:
            draft[wrong] = (draft[wrong] + 1) % self.vocab
        return draft


def replayed(model, prompt, plain_tokens, draft_max=3, sampler=None, seed=0, decode_steps=16):
    """generate()'s result for prompt with the ReplayDrafter's drafts in place of lookup's."""
    sched = model.scheduler(1, decode_steps=decode_steps)
    spec = Speculation(draft_max=draft_max)
    req = sched.submit(
        prompt, max_new_tokens=len(plain_tokens), sampler=sampler, seed=seed, speculation=spec
    )
    req.drafter = ReplayDrafter(len(prompt), plain_tokens, model.config.vocab_size, draft_max)
    sched.run([req])
    return req.result()
