"""Static model configuration, read from GGUF metadata (never from a model-name table)."""

from __future__ import annotations

import dataclasses

from minfer_jax import validate
from minfer_jax.errors import InvalidArgumentError

# Upper bounds far above any Qwen2 model (72B: 80 layers, d_model 8192, 64 heads, ff 29568,
# vocab 152k, context 128k-1M) that keep every derived size (layers x context x heads) an int32-sized
# product per axis; the KV cache's bytes are checked against the device at load (runtime.load).
_LIMITS = {"n_layers": 1 << 12, "d_model": 1 << 17, "n_heads": 1 << 12, "n_kv_heads": 1 << 12, "d_ff": 1 << 20,
           "context_length": validate.INT32_MAX, "vocab_size": validate.INT32_MAX}


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
        for name, hi in _LIMITS.items():
            validate.integer(f"Config.{name}", getattr(self, name), 1, hi)
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise InvalidArgumentError(f"Config.d_model {self.d_model} is not an even multiple of n_heads "
                                       f"{self.n_heads} (RoPE needs an even head_dim)")
        if self.n_heads % self.n_kv_heads:
            raise InvalidArgumentError(f"Config.n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        validate.number("Config.rope_theta", self.rope_theta, 0.0, lo_open=True)
        validate.number("Config.rms_eps", self.rms_eps, 0.0, lo_open=True)

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
