"""Static model configuration, read from GGUF metadata (never from a model-name table)."""

from __future__ import annotations

import dataclasses

from minfer_jax import validate
from minfer_jax.errors import InvalidArgumentError

# Upper bounds far above any supported model (Qwen2 72B / Llama 70B: 80 layers, d_model 8192, 64
# heads, ff 29568, vocab 152k-256k, context 128k-1M) that keep every derived size (layers x context
# x heads) an int32-sized product per axis; the KV cache's bytes are checked against the device at
# load (runtime.load).
_LIMITS = {
    "n_layers": 1 << 12,
    "d_model": 1 << 17,
    "n_heads": 1 << 12,
    "n_kv_heads": 1 << 12,
    "d_ff": 1 << 20,
    "context_length": validate.INT32_MAX,
    "vocab_size": validate.INT32_MAX,
}

# Model families with a layer module (model/families.py maps each to it).
FAMILIES = ("qwen2", "llama", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "gpt-oss")
MAX_EXPERTS = 512  # llama.cpp's LLAMA_MAX_EXPERTS
# how router logits become the chosen experts' weights (llama.cpp's expert_gating_func):
# "softmax": softmax over all experts, top-k of the probabilities
EXPERT_GATINGS = ("softmax", "softmax_weight")
# the experts' gated activations (experts.GLU_ACTIVATIONS): SwiGLU, gpt-oss's clamped SwiGLU
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyper-parameters of one model. Hashable: it is a static argument of every jit.

    The fields after tied_output default to Qwen2's behaviour, so a Qwen2 Config needs only the
    first ten; the family field picks the layer math (model/families.py).
    """

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
    family: str = "qwen2"
    # 0: d_model // n_heads (Qwen3 and Gemma 3 files state their own: attention.key_length)
    head_dim: int = 0
    # the file has rope_freqs.weight (Llama 3.1+): per-frequency divisors
    rope_freq_factors: bool = False
    # linear RoPE scaling: positions multiplied by this (1 / scaling.factor)
    rope_scale: float = 1.0
    attn_scale: float = 0.0  # softmax scale of q.k; 0: head_dim ** -0.5
    sliding_window: int = 0  # local layers attend to the last sliding_window positions; 0: none
    # with a window: every swa_period-th layer (i % period == period - 1) is global
    swa_period: int = 0
    rope_theta_local: float = 0.0  # RoPE base of the local (sliding-window) layers; 0: rope_theta
    # YaRN RoPE scaling (rope.scaling.type yarn, every layer): the factor, 0 for none, and
    # rope.scaling.original_context_length
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0
    # mixture of experts (model/moe.py): n_experts > 0 replaces every layer's FFN by a router and
    # n_experts expert FFNs of width d_ff_expert, n_experts_used of them per token
    n_experts: int = 0
    n_experts_used: int = 0
    d_ff_expert: int = 0
    d_ff_shared: int = 0  # a shared expert's width (Qwen2-MoE); 0: none
    expert_weights_norm: bool = False  # the k chosen weights divided by their sum
    # one of EXPERT_GATINGS: "softmax" over all experts, then top-k; "softmax_weight" (gpt-oss):
    # top-k of the raw logits, softmax over the chosen k
    expert_gating: str = "softmax"
    expert_act: str = "silu"  # one of EXPERT_ACTIVATIONS

    def __post_init__(self):
        for name, hi in _LIMITS.items():
            validate.integer(f"Config.{name}", getattr(self, name), 1, hi)
        validate.choice("Config.family", self.family, FAMILIES)
        if self.head_dim == 0:  # derived: d_model must split into even heads
            if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
                raise InvalidArgumentError(
                    f"Config.d_model {self.d_model} is not an even multiple of n_heads "
                    f"{self.n_heads} (RoPE needs an even head_dim)"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        validate.integer("Config.head_dim", self.head_dim, 1, 1 << 12)
        if self.head_dim % 2:
            raise InvalidArgumentError(
                f"Config.head_dim {self.head_dim} is odd (RoPE needs an even head_dim)"
            )
        if self.n_heads % self.n_kv_heads:
            raise InvalidArgumentError(
                f"Config.n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        validate.number("Config.rope_theta", self.rope_theta, 0.0, lo_open=True)
        validate.number("Config.rms_eps", self.rms_eps, 0.0, lo_open=True)
        validate.number("Config.rope_scale", self.rope_scale, 0.0, lo_open=True)
        validate.number("Config.attn_scale", self.attn_scale, 0.0)
        validate.number("Config.rope_theta_local", self.rope_theta_local, 0.0)
        validate.integer("Config.sliding_window", self.sliding_window, 0, validate.INT32_MAX)
        validate.integer("Config.swa_period", self.swa_period, 0, 1 << 12)
        validate.number("Config.yarn_factor", self.yarn_factor, 0.0)
        validate.integer("Config.yarn_orig_ctx", self.yarn_orig_ctx, 0, validate.INT32_MAX)
        if self.yarn_factor and (self.yarn_factor <= 1.0 or not self.yarn_orig_ctx):
            raise InvalidArgumentError(
                f"Config.yarn_factor {self.yarn_factor} needs a factor > 1 and an original "
                f"context length (got {self.yarn_orig_ctx})"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        validate.integer("Config.n_experts", self.n_experts, 0, MAX_EXPERTS)
        validate.choice("Config.expert_gating", self.expert_gating, EXPERT_GATINGS)
        validate.choice("Config.expert_act", self.expert_act, EXPERT_ACTIVATIONS)
        validate.integer("Config.d_ff_shared", self.d_ff_shared, 0, _LIMITS["d_ff"])
        if not self.n_experts:
            return
        if self.n_experts_used == 0:  # llama.cpp's wording
            raise InvalidArgumentError("model has expert layers but no expert layers are used")
        validate.integer("Config.n_experts_used", self.n_experts_used, 1, self.n_experts)
        validate.integer("Config.d_ff_expert", self.d_ff_expert, 1, _LIMITS["d_ff"])

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and of the attention output): n_heads x head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @property
    def yarn(self) -> tuple[float, int] | None:
        """(factor, original context) of YaRN RoPE scaling (layers.rope_neox), or None."""
        return (self.yarn_factor, self.yarn_orig_ctx) if self.yarn_factor else None

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (llama.cpp's swa_layers)."""
        if not self.sliding_window:
            return False
        return self.swa_period == 0 or layer % self.swa_period < self.swa_period - 1

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window in positions (0: the whole causal prefix)."""
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope_theta(self, layer: int) -> float:
        return (
            self.rope_theta_local
            if self.is_local(layer) and self.rope_theta_local
            else self.rope_theta
        )

    def layer_rope_scale(self, layer: int) -> float:
        """Linear RoPE scaling applies to the global layers only (llama.cpp: freq_scale_swa = 1)."""
        return 1.0 if self.is_local(layer) else self.rope_scale
