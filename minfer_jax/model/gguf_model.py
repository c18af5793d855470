"""A GGUF read as a model of a supported family: its Config and the tensors that Config needs
(model/from_gguf.py builds and checks it from files/gguf.py's raw file)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from minfer_jax.files.gguf import RawTensor
from minfer_jax.model.config import Config


@dataclasses.dataclass(eq=False)
class GGUFModel:
    """A validated GGUF of a supported family: static config, metadata as Python values, the tensors
    the config needs by name."""

    path: str
    config: Config
    metadata: Mapping[str, Any]
    tensors: dict[str, RawTensor]
    file_size: int

    def tensor(self, name: str) -> RawTensor:
        return self.tensors[name]
