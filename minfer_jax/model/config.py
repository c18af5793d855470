"""Static model configuration, read from GGUF metadata (never from a model-name table)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of a Qwen2-family model. Hashable: it is a static argument of every jit."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    context_length: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tied_output: bool  # no output.weight: the head reuses token_embd.weight

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "context_length", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads
