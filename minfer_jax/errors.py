"""The one exception family minfer_jax raises on purpose.

Every error a user can cause (a broken file, an unknown quant type, a missing model, a prompt
longer than the context, an argument out of range) is a `MinferError`, with a message that names the
file or tensor and what was expected. Anything else escaping the package is a bug.
"""


class MinferError(Exception):
    """Base class of every deliberate minfer_jax error."""


class GGUFError(MinferError):
    """The file is not a GGUF we can load: unreadable, truncated, inconsistent or unsupported."""


class UnsupportedError(GGUFError):
    """The file is valid GGUF but uses an architecture or tensor type minfer_jax does not
    support."""


class ModelNotFoundError(MinferError):
    """The model reference (path, built-in default, hf:repo:file) cannot be resolved to a file."""


class ContextOverflowError(MinferError):
    """The prompt (plus what must be generated) does not fit into the context."""


class TemplateError(MinferError):
    """The chat template failed to render or tried something the sandbox forbids."""


class InvalidArgumentError(MinferError, ValueError):
    """An argument of a public call (load, generate, logits, Sampler, Config, Impl, the CLI) is out
    of range.

    Also a ValueError, so callers written against the plain ValueError these calls raised before
    keep working.
    """
