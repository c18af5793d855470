"""`python -m minfer_bench.serve`: the server's command line (minfer_jax.server.cli, the same
flags) whose -m also takes 'synthetic:<config>:<ftype>[:layers=N][:seed=S]': random weights of real
shapes (synthetic.py) with a placeholder tokenizer, for load benchmarks whose prompts are token ids
and whose text is never read."""

from __future__ import annotations

import sys

from minfer_jax.engine.options import Options
from minfer_jax.engine.runtime import Model, load
from minfer_jax.server.backend import ServerSettingsError
from minfer_jax.server.cli import main as server_main

from minfer_bench import synthetic


def load_model(ref: str | None, options: Options) -> Model:
    """minfer_jax.load(ref), or a synthetic model for 'synthetic:<config>:<ftype>[...]'."""
    if not (ref or "").startswith("synthetic:"):
        return load(ref, options)
    parts, extra = (ref or "").split(":"), {}
    while parts[-1].startswith(("layers=", "seed=")):
        key, _, value = parts.pop().partition("=")
        if not value.isdigit():
            raise ServerSettingsError(
                f"{ref!r}: {key}= needs a non-negative integer, got {value!r}"
            )
        extra[key] = int(value)
    gm = synthetic.synthetic_model(":".join(parts), **extra)
    tokenizer = synthetic.placeholder_tokenizer(gm.config.vocab_size, gm.config.family)
    gm.metadata = {**gm.metadata, **tokenizer}
    return load(options=options, gguf_model=gm)


def main(argv: list[str] | None = None) -> int:
    return server_main(argv, loader=load_model)


if __name__ == "__main__":
    sys.exit(main())
