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
FAMILIES = (
    "qwen2",
    "llama",
    "qwen3",
    "gemma3",
    "qwen3moe",
    "qwen2moe",
    "gpt-oss",
    "qwen35",
    "qwen35moe",
    "gemma4",
)
MAX_EXPERTS = 512  # llama.cpp's LLAMA_MAX_EXPERTS
# how router logits become the chosen experts' weights (llama.cpp's expert_gating_func):
# "softmax": softmax over all experts, top-k of the probabilities
EXPERT_GATINGS = ("softmax", "softmax_weight")
# the experts' gated activations (experts.GLU_ACTIVATIONS): SwiGLU, gpt-oss's clamped SwiGLU
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


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
    rope_dims: int = 0  # RoPE over the first rope_dims of each head (qwen35: head_dim / 4); 0: all
    # hybrid models (qwen35): True per layer that is Gated DeltaNet (model/deltanet.py); () none
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0  # DeltaNet: causal conv width K
    ssm_state: int = 0  # DeltaNet: head size dk = dv
    ssm_groups: int = 0  # DeltaNet: q / k heads
    ssm_v_heads: int = 0  # DeltaNet: v heads (a multiple of ssm_groups)
    mtp_layers: int = 0  # multi-token-prediction blocks after the trunk (loaded, not run)
    # gemma4 (model/gemma4.py): True per sliding-window layer (attention.sliding_window_pattern;
    # () : swa_period's rule); the sliding layers' head dim and KV heads (0: head_dim, n_kv_heads,
    # which are the full layers'); the last shared_kv_layers layers attend to an earlier layer's
    # cache (kv_source); per-layer FFN widths (() : d_ff); True per layer whose V is its K
    # projection (no attn_v); the per-layer embedding width (0: none); tanh soft-cap of the logits
    swa_layers: tuple[bool, ...] = ()
    head_dim_swa: int = 0
    n_kv_heads_swa: int = 0
    shared_kv_layers: int = 0
    layer_d_ff: tuple[int, ...] = ()
    v_from_k: tuple[bool, ...] = ()
    per_layer_dim: int = 0
    final_softcap: float = 0.0
    layer_out_scale: bool = False  # gemma4: each layer's output times layer_output_scale
    expert_gate_up_fused: bool = False  # the experts' gate and up as one ffn_gate_up_exps

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
        self._check_hybrid()
        self._check_layer_shapes()

    def _check_layer_shapes(self) -> None:
        """gemma4's per-layer fields: lengths, and a shared layer's source of its own kind."""
        for name in ("swa_layers", "layer_d_ff", "v_from_k"):
            n = len(getattr(self, name))
            if n not in (0, self.n_layers):
                raise InvalidArgumentError(f"Config.{name} has {n} entries for {self.n_layers}")
        for d in self.layer_d_ff:
            validate.integer("Config.layer_d_ff", d, 1, _LIMITS["d_ff"])
        validate.integer("Config.head_dim_swa", self.head_dim_swa, 0, 1 << 12)
        validate.integer("Config.n_kv_heads_swa", self.n_kv_heads_swa, 0, 1 << 12)
        validate.integer("Config.per_layer_dim", self.per_layer_dim, 0, 1 << 16)
        validate.number("Config.final_softcap", self.final_softcap, 0.0)
        if self.head_dim_swa % 2 or (self.n_kv_heads_swa and self.n_heads % self.n_kv_heads_swa):
            raise InvalidArgumentError(
                f"Config: sliding head dim {self.head_dim_swa} odd or {self.n_heads} heads not a "
                f"multiple of {self.n_kv_heads_swa} sliding KV heads"
            )
        validate.integer("Config.shared_kv_layers", self.shared_kv_layers, 0, self.n_layers)
        if self.shared_kv_layers:
            n_kv = self.n_layers - self.shared_kv_layers
            if n_kv < 2 or not self.is_local(n_kv - 2) or self.is_local(n_kv - 1):
                raise InvalidArgumentError(
                    f"Config: {self.shared_kv_layers} shared-KV layers need the two layers before "
                    "them to be a sliding-window then a full-attention layer (llama.cpp's reuse "
                    "rule: a shared layer reads layer n_kv - 2 if sliding, else n_kv - 1)"
                )

    def _check_hybrid(self) -> None:
        validate.integer("Config.rope_dims", self.rope_dims, 0, self.head_dim)
        if self.rope_dims % 2:
            raise InvalidArgumentError(f"Config.rope_dims {self.rope_dims} is odd")
        validate.integer("Config.mtp_layers", self.mtp_layers, 0, 1 << 8)
        if not self.recurrent_layers:
            return
        if len(self.recurrent_layers) != self.n_layers or all(self.recurrent_layers):
            raise InvalidArgumentError(
                f"Config.recurrent_layers has {len(self.recurrent_layers)} entries for "
                f"{self.n_layers} layers and must leave at least one attention layer"
            )
        for name in ("ssm_conv_kernel", "ssm_state", "ssm_groups", "ssm_v_heads"):
            validate.integer(f"Config.{name}", getattr(self, name), 1, 1 << 12)
        if self.ssm_conv_kernel < 2 or self.ssm_v_heads % self.ssm_groups:
            raise InvalidArgumentError(
                f"Config: conv kernel {self.ssm_conv_kernel} < 2 or {self.ssm_v_heads} v heads "
                f"not a multiple of {self.ssm_groups} q/k heads"
            )

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

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of a DeltaNet layer's conv: q | k | v."""
        return (2 * self.ssm_groups + self.ssm_v_heads) * self.ssm_state

    def is_recurrent(self, layer: int) -> bool:
        """Whether layer `layer` is Gated DeltaNet (no KV cache; a recurrent state instead)."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache, in order (KVCache.k[j] is layer attention_layers[j]'s)."""
        return tuple(
            i for i in range(self.n_layers) if not self.is_recurrent(i) and self.kv_source(i) == i
        )

    def kv_source(self, layer: int) -> int:
        """The layer whose cache layer `layer` attends to: itself, or for gemma4's last
        shared_kv_layers layers the last cached layer of its kind (llama.cpp: n_kv - 2 if sliding,
        else n_kv - 1; such a layer writes no cache)."""
        n_kv = self.n_layers - self.shared_kv_layers
        if layer < n_kv:
            return layer
        return n_kv - 2 if self.is_local(layer) else n_kv - 1

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim_swa if self.head_dim_swa and self.is_local(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return (
            self.n_kv_heads_swa if self.n_kv_heads_swa and self.is_local(layer) else self.n_kv_heads
        )

    def layer_ff(self, layer: int) -> int:
        """Layer `layer`'s dense FFN width (gemma4's shared-KV layers may be double-wide)."""
        return self.layer_d_ff[layer] if self.layer_d_ff else self.d_ff

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """The DeltaNet layers, in order (RecurrentState's j-th entries are the j-th one's)."""
        return tuple(i for i in range(self.n_layers) if self.is_recurrent(i))

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (llama.cpp's swa_layers)."""
        if not self.sliding_window:
            return False
        if self.swa_layers:
            return self.swa_layers[layer]
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
