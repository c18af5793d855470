"""minfer_jax: GGUF inference in JAX (Qwen2, Llama, Qwen3, Gemma 3), Pallas quantized matmuls.

Usage:

    import minfer_jax
    model = minfer_jax.load()                      # built-in Qwen2.5-Coder-0.5B (the `model` extra)
    out = minfer_jax.generate(model, "def fibonacci(n):", max_new_tokens=32)
    print(out.text)
"""

from minfer_jax.engine.plan import Plan
from minfer_jax.engine.runtime import Model, generate, generate_batch, load
from minfer_jax.engine.sampling import GREEDY, Sampler
from minfer_jax.engine.scheduler import Request, Scheduler
from minfer_jax.engine.steps import (
    GenerationResult,
    SlotState,
    StopReason,
    decode_chunk,
    prefill_chunk,
    prompt_logits,
)
from minfer_jax.errors import (
    ContextOverflowError,
    GGUFError,
    InvalidArgumentError,
    MinferError,
    ModelNotFoundError,
    TemplateError,
    UnsupportedError,
)
from minfer_jax.model.config import Config
from minfer_jax.ops import Impl
from minfer_jax.version import __version__

__all__ = [
    "__version__",
    "Config",
    "ContextOverflowError",
    "GGUFError",
    "GREEDY",
    "GenerationResult",
    "Impl",
    "InvalidArgumentError",
    "MinferError",
    "Model",
    "ModelNotFoundError",
    "Plan",
    "Request",
    "Sampler",
    "Scheduler",
    "SlotState",
    "StopReason",
    "TemplateError",
    "UnsupportedError",
    "decode_chunk",
    "generate",
    "generate_batch",
    "load",
    "prefill_chunk",
    "prompt_logits",
]
