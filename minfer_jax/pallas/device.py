"""The GPU the kernels are traced for, read once per process: its SM count, and whether the
tuning tables (every number in them measured on TUNED_ON) apply to it.

Kernel configs stay static: `current()` is read at trace time by the choose_config functions.
Another GPU gets the tables' safe defaults instead of H200 numbers: program-count targets
scaled to its SMs (`programs`), at most GENERIC_MAX_STAGES pipeline stages (an H200 block has
227 KB of shared memory, many GPUs about 100 KB), and the GEMV rows' measured toggles off
(gemv_tuning.row). On a CPU (interpret mode) the tuned GPU is assumed, so CPU tests trace the
configs the H200 runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

TUNED_ON = "H200"  # the GPU every tuning table was measured on (its device_kind contains this)
# GPUs that take the tables too: the H100 is the same Hopper SM with the same 227 KB of shared
# memory a block, and the tables beat the safe defaults there (docs/BENCHMARKS.md, [D-hopper])
TUNED_KINDS = (TUNED_ON, "H100")
TUNED_SMS = 132  # its streaming multiprocessors
GENERIC_MAX_STAGES = 2  # software-pipeline stages on an untuned GPU (fits ~100 KB of shared memory)
TUNED_SHARED_MEMORY = 232_448  # bytes of shared memory one block may use on the tuned GPU (227 KB)
GENERIC_SHARED_MEMORY = 101_376  # ... on an untuned one (99 KB, as on the L4 / L40)


@dataclasses.dataclass(frozen=True)
class Gpu:
    kind: str  # jax's device_kind, e.g. "NVIDIA H200"
    sms: int  # streaming multiprocessors (jax's core_count)

    @property
    def tuned(self) -> bool:
        """Whether the tuning tables apply to this GPU (TUNED_KINDS)."""
        return any(name in self.kind for name in TUNED_KINDS)


TUNED = Gpu(kind=f"NVIDIA {TUNED_ON}", sms=TUNED_SMS)


@functools.cache
def current() -> Gpu:
    """The default device's GPU (TUNED off a GPU; its SM count TUNED_SMS if jax does not say)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # no backend at all: nothing runs on a GPU
        return TUNED
    if dev.platform != "gpu":
        return TUNED
    sms = getattr(dev, "core_count", None)
    return Gpu(
        kind=str(getattr(dev, "device_kind", "")),
        sms=sms if isinstance(sms, int) and sms > 0 else TUNED_SMS,
    )


def programs(on_tuned: int) -> int:
    """A program-count target measured on the tuned GPU, scaled to this GPU's SMs
    (unchanged there)."""
    return max(1, on_tuned * current().sms // TUNED_SMS)


def stages(on_tuned: int) -> int:
    """A tile's pipeline stages: as measured on the tuned GPU, else at most GENERIC_MAX_STAGES."""
    return on_tuned if current().tuned else min(on_tuned, GENERIC_MAX_STAGES)


def shared_memory() -> int:
    """Bytes of shared memory one block may use: the tuned GPU's, else GENERIC_SHARED_MEMORY."""
    return TUNED_SHARED_MEMORY if current().tuned else GENERIC_SHARED_MEMORY
