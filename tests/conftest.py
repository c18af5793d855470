"""Shared fixtures. Tests run on CPU; Pallas kernels run in interpret mode here."""

import os

import pytest


@pytest.fixture(scope="session")
def real_model_path() -> str:
    """Path of the real Qwen2.5-Coder-0.5B GGUF (MINFER_TEST_MODEL, else the built-in default
    model).

    CI installs the `model` extra, so this resolves there; a missing model is an error, not a skip.
    """
    env = os.environ.get("MINFER_TEST_MODEL")
    if env:
        return env
    from minfer_jax.files.model_source import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def real_model(real_model_path):
    """The parsed and validated real GGUF (config, metadata, mmap'd tensors)."""
    from minfer_jax.model.from_gguf import load_gguf

    return load_gguf(real_model_path)


@pytest.fixture(scope="module", autouse=True)
def _release_module_memory():
    """A worker runs dozens of modules: free what one module's jitted functions held before the
    next (a whole-suite worker reached 13 GB and swapped on this 23 GiB machine; over 8 heavy
    modules this kept a worker at 6.7-7.3 GB where it otherwise peaked at 10.5)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
