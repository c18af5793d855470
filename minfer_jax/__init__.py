"""minfer_jax: GGUF inference in JAX (Qwen2, Llama, Qwen3, Gemma 3), Pallas quantized matmuls.

Usage:

    import minfer_jax
    model = minfer_jax.load()                      # built-in Qwen2.5-Coder-0.5B (the `model` extra)
    out = minfer_jax.generate(model, "def fibonacci(n):", max_new_tokens=32)
    print(out.text)

The step functions (prefill_chunk, decode_chunk, prompt_logits) and what a jitted loop of one's
own needs (SlotState / init_slot_state, RowSettings, SamplerMode and its modes, KVCache /
init_cache, Params, Config, Impl) are exported here; README.md, "Your own jitted loop".
"""

from minfer_jax.engine.draft_model import DraftModel, load_draft
from minfer_jax.engine.generation import generate, generate_batch
from minfer_jax.engine.options import Options
from minfer_jax.engine.plan import Plan
from minfer_jax.engine.request import Request
from minfer_jax.engine.runtime import Model, load
from minfer_jax.engine.sampling import (
    FULL_MODE,
    GREEDY,
    GREEDY_MODE,
    LOGPROBS_MODE,
    SAMPLED_MODE,
    RowSettings,
    Sampled,
    Sampler,
    SamplerMode,
    TokenLogprobs,
)
from minfer_jax.engine.scheduler import Scheduler
from minfer_jax.engine.steps import (
    GenerationResult,
    SlotState,
    StopReason,
    TokenLogprob,
    decode_chunk,
    init_slot_state,
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
from minfer_jax.model.cache import KVCache, init_cache
from minfer_jax.model.config import Config
from minfer_jax.model.weights import Params
from minfer_jax.ops import Impl
from minfer_jax.version import __version__

__all__ = [
    "__version__",
    "Config",
    "ContextOverflowError",
    "DraftModel",
    "FULL_MODE",
    "GGUFError",
    "GREEDY",
    "GREEDY_MODE",
    "GenerationResult",
    "Impl",
    "InvalidArgumentError",
    "KVCache",
    "LOGPROBS_MODE",
    "MinferError",
    "Model",
    "ModelNotFoundError",
    "Options",
    "Params",
    "Plan",
    "Request",
    "RowSettings",
    "SAMPLED_MODE",
    "Sampled",
    "Sampler",
    "SamplerMode",
    "Scheduler",
    "SlotState",
    "StopReason",
    "TemplateError",
    "TokenLogprob",
    "TokenLogprobs",
    "UnsupportedError",
    "decode_chunk",
    "generate",
    "generate_batch",
    "init_cache",
    "init_slot_state",
    "load",
    "load_draft",
    "prefill_chunk",
    "prompt_logits",
]
