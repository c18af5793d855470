"""How the kernel tests run: interpreted on the CPU (default) or compiled on a GPU.

`MINFER_TEST_KERNELS=compiled python -m pytest tests/test_kernels.py ...` runs every kernel test
through the Triton lowering on a GPU instead of Pallas' interpreter, so the same suite is the
GPU test. Tests take `INTERPRET` (for a kernel's `interpret=` argument) and `KERNELS` (for
`ops.Impl(kernels=...)`) from here instead of hard-coding interpret mode.
"""

import os

_MODE = os.environ.get("MINFER_TEST_KERNELS", "interpret")
if _MODE not in ("interpret", "compiled"):
    raise RuntimeError(f"MINFER_TEST_KERNELS must be 'interpret' or 'compiled', got {_MODE!r}")

INTERPRET: bool = _MODE == "interpret"
KERNELS: str = "interpret" if INTERPRET else "pallas"
