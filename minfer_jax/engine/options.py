"""The options of a load, checked in one place (runtime.load and every command line read them)."""

from __future__ import annotations

from typing import Any

from minfer_jax import ops, validate
from minfer_jax.engine.plan import Plan, PlanError
from minfer_jax.errors import InvalidArgumentError

LOAD_WEIGHT_MODES = ("quantized", "dense")


def load_arguments(
    *,
    ctx_size: Any,
    weights: Any,
    kernels: Any,
    gemm: Any,
    prefill_chunk: Any,
    platform: str,
    deterministic: Any = False,
    precise: Any = False,
) -> None:
    """runtime.load's options (ctx_size past the trained context is clamped to it once the file is
    read)."""
    if ctx_size is not None:
        validate.clamped_count(
            "ctx_size", ctx_size, validate.INT32_MAX, all_of="the trained context", minus_one=False
        )
        if ctx_size == 0:
            raise InvalidArgumentError("ctx_size must be >= 1 (or None for the default), got 0")
    if prefill_chunk is not None:
        try:
            Plan(ctx=1, chunk=prefill_chunk)  # the plan decides which chunk sizes exist
        except PlanError as e:
            raise InvalidArgumentError(
                f"prefill_chunk (tokens per prefill executable): {e}"
            ) from None
    for name, value in (("deterministic", deterministic), ("precise", precise)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
    if weights is not None:
        validate.choice("weights", weights, LOAD_WEIGHT_MODES)
    if kernels is not None:
        validate.choice("kernels", kernels, ops.KERNELS.names)
        if kernels == "pallas" and platform != "gpu":
            raise InvalidArgumentError(
                f"kernels='pallas' needs a GPU, but the device is {platform}; "
                "use kernels='interpret' (slow) or 'xla'"
            )
    validate.choice("gemm", gemm, ops.GEMMS.names)
