"""The one place a model family is chosen: `general.architecture` -> the family's module.

A family module (qwen2.py, llama.py, qwen3.py, gemma3.py, qwen3moe.py, qwen2moe.py, gptoss.py,
qwen35.py, qwen35moe.py, gemma4.py)
holds what differs between families:
  ARCHITECTURE, MODELS                the GGUF architecture name and the models it covers (messages)
  config_from_metadata(md) -> Config  its hyper-parameters from the file's `{arch}.*` keys
  tensor_shapes(cfg)                  every tensor it needs: (name, numpy shape), lazily
  embed(params, tokens, cfg)          tokens -> the residual stream's first rows
  block(x, layer, i, call)            one decoder layer on the residual stream x (residual.Stream;
                                      layers.LayerCall: positions, attend, cfg, impl, ...)
The engine (model/decoder.py, engine/steps.py) reaches a family only through `family(cfg)`; the
kernels, plan, scheduler and server never see which family runs.
"""

from __future__ import annotations

from types import ModuleType

from minfer_jax.errors import UnsupportedError
from minfer_jax.model import (
    gemma3,
    gemma4,
    gptoss,
    llama,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen35,
    qwen35moe,
)
from minfer_jax.model.config import Config

_MODULES: dict[str, ModuleType] = {
    m.ARCHITECTURE: m
    for m in (qwen2, llama, qwen3, gemma3, qwen3moe, qwen2moe, gptoss, qwen35, qwen35moe, gemma4)
}


def family(cfg_or_name: Config | str) -> ModuleType:
    """The family module of a Config (its static `family` field) or of an architecture name."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.family
    return _MODULES[name]


def for_architecture(arch: str, path: str) -> ModuleType:
    """The module for a file's general.architecture; UnsupportedError naming it otherwise."""
    module = _MODULES.get(arch)
    if module is None:
        known = "; ".join(f"'{m.ARCHITECTURE}' ({m.MODELS})" for m in _MODULES.values())
        raise UnsupportedError(
            f"{path}: unsupported architecture {arch!r}; minfer_jax runs {known}"
        )
    return module


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODULES)
