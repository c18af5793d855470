"""The MTP (multi-token prediction, "nextn") block that Qwen3.5 / 3.6 files append after the trunk,
run as a drafter for speculative decoding (engine/verify.py runs it; engine/lookup.py's MtpDrafter
is the host's side).

Its math, as llama.cpp's `llama_model_qwen35::graph_mtp` constructor (src/models/qwen35.cpp of
ggml-org/llama.cpp at 06e514f: the LLM_GRAPH_TYPE_DECODER_MTP graph, after `graph::build_layer_ffn`;
`graph::graph` names the trunk's normed output `h_nextn`) and vLLM's
`Qwen3_5MultiTokenPredictor.forward` (vllm/model_executor/models/qwen3_5_mtp.py at 01d9980)
compute it: for the trunk's final hidden state h_i (after output_norm) and the next token t_{i+1},
    x = eh_proj . concat(rms(embed(t_{i+1})) . enorm, rms(h_i) . hnorm)   (embedding first:
        ggml_concat(e_norm, h_norm, 0) / torch.cat([inputs_embeds, hidden_states], -1)),
    x = the block: a gated full-attention layer with the trunk's FFN (qwen35's / qwen35moe's
        block) over its own KV cache,
    h' = rms(x) . shared_head_norm (else output_norm), logits = head . h' (nextn.shared_head_head,
        else the trunk's output / tied embedding; the embedding: nextn.embed_tokens, else
        token_embd).
h' predicts t_{i+2}; a chained draft feeds h' back as the next row's h. The row of (t_{i+1}, h_i)
sits at t_{i+1}'s position (llama.cpp's convention: hidden states shifted right by one, tokens at
their own positions); only relative positions reach the attention.

The block's cache (KVCache.mtp: its K / V and, per slot, the trunk's final normed hidden state
of the last fed token) follows the sequence:
- after each prefill chunk, `warm_up` writes the block's rows for the chunk's positions: row j
  feeds (x_j, h_{j-1}) (h before the prompt: zeros), and keeps h of the chunk's last token;
- a verification (verify.verify_chunk with device drafts) first `draft`s: from the slot's last
  token x_n (not fed yet) and h_{n-1}, K chained rows at positions n, n + 1, ..., each the
  block's greedy token fed back with the block's own output h' (rows past n are overwritten
  below); the trunk verifies [x_n, d_1 .. d_K] as for any draft, and `catch_up` writes the rows
  (d_i, H_{i-1}) at n + i from the trunk's hidden states H of that step and keeps H_a of the
  last accepted row. Rows past the accepted ones lie past the sequence's end and are written
  again before any query can see them (keys are masked by position).
Greedy drafts are one-hot proposals: verification's acceptance keeps greedy and sampled output
the plain decoder's. One executable per draft bucket; no host round trip beyond the tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from minfer_jax import ops, residual
from minfer_jax.errors import UnsupportedError
from minfer_jax.model import attention, layers
from minfer_jax.model import cache as kv_cache
from minfer_jax.model.cache import KVCache
from minfer_jax.model.config import Config
from minfer_jax.model.families import family
from minfer_jax.model.gguf_model import GGUFModel
from minfer_jax.model.weights import (
    Layer,
    LoadOptions,
    Params,
    Weight,
    load_layer,
    load_matrix,
    load_vector,
)
from minfer_jax.quant.matrix import embed_rows

# A draft chain's rows (1) and a verification's (K <= 15) attend as decode rows (every row its own
# position; the chunk kernel takes powers of two from 16), a prefill chunk's as a chunk.
AS_DECODE_ROWS = 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MtpParams:
    """The MTP block's weights."""

    layer: Layer  # blk.{n}.attn_*, ffn_* (a gated-attention layer)
    eh_proj: Weight  # [d, 2 d]
    enorm: jax.Array  # [d]
    hnorm: jax.Array  # [d]
    head_norm: jax.Array | None = None  # [d] shared_head_norm; None: the trunk's output_norm
    embed: Weight | None = None  # nextn.embed_tokens [vocab, d]; None: the trunk's token_embd
    head: Weight | None = None  # nextn.shared_head_head [vocab, d]; None: the trunk's head


def has_mtp(model: GGUFModel) -> bool:
    """Whether the file carries an MTP block (from_gguf kept its tensors)."""
    return f"blk.{model.config.n_layers}.nextn.eh_proj.weight" in model.tensors


def load_mtp(model: GGUFModel, opts: LoadOptions, device) -> MtpParams:
    """The MTP block's weights on the device; UnsupportedError where the file has none."""
    if not has_mtp(model):
        raise UnsupportedError(
            f"{model.path} has no MTP block (nextn_predict_layers = {model.config.mtp_layers})"
        )
    n = model.config.n_layers
    p = f"blk.{n}.nextn."

    def optional(name):
        return load_matrix(model, p + name, opts, device) if p + name in model.tensors else None

    def optional_vector(name):
        return load_vector(model, p + name, device) if p + name in model.tensors else None

    return MtpParams(
        layer=load_layer(model, n, opts, device),
        eh_proj=load_matrix(model, p + "eh_proj.weight", opts, device),
        enorm=load_vector(model, p + "enorm.weight", device),
        hnorm=load_vector(model, p + "hnorm.weight", device),
        head_norm=optional_vector("shared_head_norm.weight"),
        embed=optional("embed_tokens.weight"),
        head=optional("shared_head_head.weight"),
    )


def mtp_config(cfg: Config) -> Config:
    """The block as a one-layer model of the trunk's shapes: one full-attention layer."""
    return dataclasses.replace(cfg, n_layers=1, recurrent_layers=(False,), mtp_layers=0)


def mtp_forward(
    mtp: MtpParams,
    params: Params,
    tokens: jax.Array,
    hidden: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    kv: tuple[jax.Array, jax.Array],
    cfg: Config,
    impl: ops.Impl,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """T rows of one sequence at positions start + [0, T) in slot: tokens [T] (t_{i+1}) with the
    trunk's hidden states [T, d] before them (h_i), over the block's cache kv = (k, v) [n_slots,
    Hkv, len, hd] -> (logits [T, vocab] f32, h' [T, d] f32, kv with the T rows written)."""
    mcfg = mtp_config(cfg)
    eps = cfg.rms_eps
    e = ops.rms_norm(embed_rows(mtp.embed or params.embed, tokens), mtp.enorm, eps)
    h = ops.rms_norm(hidden, mtp.hnorm, eps)
    x = ops.matmul(jnp.concatenate([e, h], axis=-1), mtp.eh_proj, impl)  # embedding first
    t = tokens.shape[0]
    positions = start + jnp.arange(t, dtype=jnp.int32)
    slots = jnp.full((t,), slot, jnp.int32)
    k_cache, v_cache = kv

    def attend(q, k, v, sinks=None):
        nonlocal k_cache, v_cache
        if t > AS_DECODE_ROWS:  # a prefill chunk
            k_cache = kv_cache.write_chunk(k_cache, k, slot, start)
            v_cache = kv_cache.write_chunk(v_cache, v, slot, start)
            return attention.chunk_attention(q, k_cache, v_cache, slot, start, mcfg, impl)
        k_cache = kv_cache.write_rows(k_cache, k, slots, positions)
        v_cache = kv_cache.write_rows(v_cache, v, slots, positions)
        return attention.decode_attention(q, k_cache, v_cache, slots, positions, mcfg, impl)

    call = layers.LayerCall(
        positions=positions,
        attend=attention.Attend(attend, positions, mcfg, impl),
        cfg=mcfg,
        impl=impl,
    )
    stream = family(cfg).block(residual.start(x, impl), mtp.layer, 0, call)
    head_norm = params.out_norm if mtp.head_norm is None else mtp.head_norm
    out = ops.rms_norm(stream.rows, head_norm, eps)
    logits = ops.matmul(out, mtp.head or params.head, impl)
    return logits, out, (k_cache, v_cache)


def warm_up(params: Params, cache: KVCache, tokens, hidden, slot, start, n_valid, cfg, impl):
    """After a prefill chunk of tokens [C] (n_valid real) at start with the trunk's normed hidden
    states [C, d]: the block's rows for the chunk, and the slot's hidden of its last token."""
    k, v, last = cache.mtp
    before = jnp.where(start == 0, 0.0, last[slot])[None]  # h_{start - 1}
    shifted = jnp.concatenate([before, hidden[:-1].astype(jnp.float32)])
    _, _, (k, v) = mtp_forward(params.mtp, params, tokens, shifted, slot, start, (k, v), cfg, impl)
    h = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False)
    return dataclasses.replace(cache, mtp=(k, v, last.at[slot].set(h.astype(jnp.float32))))


def draft(
    params: Params, cache: KVCache, token, slot, position, n: int, cfg: Config, impl: ops.Impl
) -> tuple[jax.Array, KVCache]:
    """n chained greedy drafts [n] int32 after token (the slot's last, to be fed at position)."""
    k, v, last = cache.mtp

    def step(carry, i):
        t, h, k, v = carry
        logits, h, (k, v) = mtp_forward(
            params.mtp, params, t, h, slot, position + i, (k, v), cfg, impl
        )
        t = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (t, h, k, v), t[0]

    init = (token[None].astype(jnp.int32), last[slot][None], k, v)
    (_, _, k, v), drafts = jax.lax.scan(step, init, jnp.arange(n, dtype=jnp.int32))
    return drafts, dataclasses.replace(cache, mtp=(k, v, last))


def catch_up(params: Params, cache: KVCache, drafts, hidden, slot, position, n_accepted, cfg, impl):
    """After verifying [x_n, drafts] at position n with the trunk's hidden states [1 + K, d]:
    the rows (d_i, H_{i-1}) at n + i, and the slot's hidden H of its last accepted row."""
    k, v, last = cache.mtp
    _, _, (k, v) = mtp_forward(
        params.mtp, params, drafts, hidden[:-1], slot, position + 1, (k, v), cfg, impl
    )
    h = jax.lax.dynamic_index_in_dim(hidden, n_accepted, keepdims=False)
    return dataclasses.replace(cache, mtp=(k, v, last.at[slot].set(h.astype(jnp.float32))))
