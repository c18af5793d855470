"""What every command line (generate, serve, bench) shares about reading flags: no prefix matching
at all, and llama.cpp's flags either taken or refused by name.

argparse's allow_abbrev=False stops `--temp` being read from `--te`, but not a single-dash flag
from a prefix (`-t` was `-tp`) nor `-ngl` from `-n gl`: `StrictParser` takes a flag only whole,
and a short flag's attached value (`-n64`, `-s-1`) only when it does not start with a letter.
llama.cpp's flags that mean nothing here are accepted with one note on stderr (`add_llama_noops`);
those that mean nothing to one tool are refused with a line naming them (`add_llama_refusals`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that reads a flag only as it is spelled (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def _get_option_tuples(self, option_string):
        # only `-xVALUE` for a one-letter flag -x: never a longer flag from its prefix
        if option_string[:1] not in self.prefix_chars or option_string[1:2] in self.prefix_chars:
            return []
        short, rest = option_string[:2], option_string[2:]
        action = self._option_string_actions.get(short)
        if action is None or not rest or rest[0].isalpha() or action.nargs == 0:
            return []
        return [(action, short, rest)]


@dataclasses.dataclass(frozen=True)
class LlamaFlag:
    names: tuple[str, ...]
    meaning: str  # what it does in llama.cpp
    nargs: str | int | None  # None: one value, "?": an optional value, 0: none


# llama.cpp's flags that change nothing in minfer_jax, and why
NOOPS = {
    "threads": (
        LlamaFlag(("-t", "--threads"), "CPU thread count", None),
        "XLA sizes its own CPU thread pool",
    ),
    "gpu_layers": (
        LlamaFlag(("-ngl", "--gpu-layers", "--n-gpu-layers"), "layers offloaded to the GPU", None),
        "every layer runs on the device JAX uses",
    ),
    "flash_attn": (
        LlamaFlag(("-fa", "--flash-attn"), "flash attention", "?"),
        "attention is always fused (Pallas kernels on a GPU, one XLA op elsewhere)",
    ),
    "jinja": (
        LlamaFlag(("--jinja",), "Jinja chat templates", 0),
        "the chat template always runs through Jinja",
    ),
}
# llama-cli's flags of the interactive front end, for the tools that have none
CLI_ONLY = {
    "conversation": LlamaFlag(("-cnv", "--conversation"), "llama-cli's conversation mode", 0),
    "no_conversation": LlamaFlag(("-no-cnv", "--no-conversation"), "llama-cli's plain mode", 0),
    "single_turn": LlamaFlag(("-st", "--single-turn"), "llama-cli's one-turn chat", 0),
    "reverse_prompt": LlamaFlag(("-r", "--reverse-prompt"), "llama-cli's reverse prompt", None),
    "escape": LlamaFlag(("-e", "--escape"), "llama-cli's escape processing", 0),
    "ignore_eos": LlamaFlag(("--ignore-eos",), "llama-cli's --ignore-eos", 0),
}


class _NoOp(argparse.Action):
    """A llama.cpp flag that means nothing here: one note on stderr, however often it is given."""

    def __init__(self, option_strings, dest, why: str, meaning: str, **kwargs):
        self.why, self.meaning = why, meaning
        super().__init__(option_strings, dest, default=None, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is None:
            sys.stderr.write(
                f"note: {option_string} ({self.meaning} in llama.cpp) means nothing here: "
                f"{self.why}; ignored\n"
            )
        setattr(namespace, self.dest, values if values is not None else True)


class _Refused(argparse.Action):
    def __init__(self, option_strings, dest, why: str, **kwargs):
        self.why = why
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, self.why)


def _nargs(flag: LlamaFlag) -> dict:
    return {} if flag.nargs is None else {"nargs": flag.nargs}


def add_llama_noops(parser, names: tuple[str, ...] = tuple(NOOPS)) -> None:
    """llama.cpp's flags that change nothing here, taken with a note (NOOPS' keys)."""
    for name in names:
        flag, why = NOOPS[name]
        parser.add_argument(
            *flag.names,
            dest=f"llama_{name}",
            action=_NoOp,
            why=why,
            meaning=flag.meaning,
            help=f"llama.cpp's {flag.meaning}: accepted, means nothing here ({why})",
            **_nargs(flag),
            **({} if flag.nargs == 0 else {"metavar": "X"}),
        )


def add_llama_refusals(
    parser, tool: str, names: tuple[str, ...] = tuple(CLI_ONLY), hints: dict | None = None
) -> None:
    """llama-cli's flags a tool has no use for: each refused with a line naming it (hints: what
    to do instead, by CLI_ONLY's key)."""
    for name in names:
        flag = CLI_ONLY[name]
        hint = (hints or {}).get(name, "it is minfer-generate's")
        parser.add_argument(
            *flag.names,
            dest=f"refused_{name}",
            action=_Refused,
            why=f"{flag.meaning} is not a flag of {tool} ({hint})",
            help=argparse.SUPPRESS,
            **_nargs(flag),
        )
