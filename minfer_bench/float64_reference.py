"""A float64 numpy forward of every supported family, written from the models' definitions and
independent of the package's layer code (weights dequantized with gguf.quants).

Used by tests/test_families.py, tests/test_moe.py and by tools/llama_cpp_reference.py (which
records how far llama.cpp's own logits are from it). Families: qwen2 (q/k/v biases, NeoX RoPE;
qwen2moe's attention), llama (no biases, RoPE on adjacent pairs as llama.cpp applies it to GGUF's
permuted Q/K, rope_freqs divisors), qwen3 (per-head q/k RMSNorm, NeoX; qwen3moe's attention),
gemma3 (sqrt(d) embedding scale, q/k norms, norms after attention and FFN, GeGLU with tanh gelu,
sliding-window layers with their own RoPE base), and the mixture-of-experts FFN of qwen3moe,
qwen2moe and llama with experts (Mixtral).
"""

from __future__ import annotations

import math

import numpy as np
from gguf.quants import dequantize

_LAST: list = []  # [(gm, {name: float64 array})]: the last model's weights, dequantized once


def _weights(gm):
    """name -> the tensor dequantized to float64, kept for the last model only (1-4 GB for the
    real files; a divergence check runs several forwards on one model)."""
    if not _LAST or _LAST[0][0] is not gm:
        _LAST[:] = [(gm, {})]
    cache = _LAST[0][1]

    def w(name):
        if name not in cache:
            t = gm.tensors[name]
            cache[name] = (
                dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float64)
            )
        return cache[name]

    return w


def _norm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _rope(x, pos, theta, *, neox, factors=None, scale=1.0):
    """x [T, H, hd] rotated by positions pos [T]."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    if factors is not None:
        inv = inv / factors
    ang = (pos.astype(np.float64) * scale)[:, None] * inv[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def _moe(w, p: str, cfg, h, gaps):
    """The mixture-of-experts FFN of layer prefix p on normed rows h [T, d] (llama.cpp's
    build_moe_ffn: softmax over experts, top-k, renormalised for qwen3moe / llama, experts
    weighted after down and summed; qwen2moe's sigmoid-gated shared expert). gaps (a list): gets
    each token's k-th minus (k+1)-th probability, the router's distance from a tie."""
    k = cfg.n_experts_used
    logits = h @ w(p + "ffn_gate_inp.weight").T  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, -1)
    if gaps is not None:
        gaps.append(ranked[:, k - 1] - ranked[:, k] if k < cfg.n_experts else np.ones(len(h)))
    ids, wts = order[:, :k], ranked[:, :k]
    if cfg.expert_weights_norm:
        wts = wts / np.maximum(wts.sum(-1, keepdims=True), 6.103515625e-5)
    gate, up, down = (w(p + f"ffn_{r}_exps.weight") for r in ("gate", "up", "down"))
    out = np.zeros_like(h)
    for t in range(len(h)):
        for j in range(k):
            e = ids[t, j]
            out[t] += wts[t, j] * (down[e] @ (_silu(gate[e] @ h[t]) * (up[e] @ h[t])))
    if cfg.d_ff_shared:
        sg = 1 / (1 + np.exp(-(h @ w(p + "ffn_gate_inp_shexp.weight"))))
        g, u = h @ w(p + "ffn_gate_shexp.weight").T, h @ w(p + "ffn_up_shexp.weight").T
        out += sg[:, None] * ((_silu(g) * u) @ w(p + "ffn_down_shexp.weight").T)
    return out


def forward(gm, tokens, x_quant=None, router_gaps=None) -> np.ndarray:
    """float64 forward over tokens [T] from position 0 -> logits [T, vocab]. x_quant (optional):
    (site, x) -> x, applied to each matmul's input, site one of "qkv", "o", "gateup", "down",
    "head" (tools/x_quant_emulation.py: an activation quantization's effect alone).
    router_gaps (a list, MoE models): gets one [T] array per layer, each token's k-th minus
    (k+1)-th router probability."""
    cfg = gm.config
    xq = x_quant or (lambda site, x: x)
    fam = cfg.family
    w = _weights(gm)
    hd, nh, nkv, eps = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.rms_eps
    t = len(tokens)
    pos = np.arange(t)
    factors = w("rope_freqs.weight") if cfg.rope_freq_factors else None
    x = w("token_embd.weight")[np.asarray(tokens)]
    if fam == "gemma3":
        x = x * math.sqrt(cfg.d_model)
    scale = cfg.attn_scale or hd**-0.5
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        local = cfg.sliding_window and (
            cfg.swa_period == 0 or i % cfg.swa_period < cfg.swa_period - 1
        )
        h = xq("qkv", _norm(x, w(p + "attn_norm.weight"), eps))
        q, k, v = (h @ w(p + f"attn_{r}.weight").T for r in "qkv")
        if fam in ("qwen2", "qwen2moe"):
            q, k, v = q + w(p + "attn_q.bias"), k + w(p + "attn_k.bias"), v + w(p + "attn_v.bias")
        q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
        if fam in ("qwen3", "gemma3", "qwen3moe"):
            q, k = (
                _norm(q, w(p + "attn_q_norm.weight"), eps),
                _norm(k, w(p + "attn_k_norm.weight"), eps),
            )
        theta = cfg.rope_theta_local if local and cfg.rope_theta_local else cfg.rope_theta
        rscale = 1.0 if local else cfg.rope_scale
        q = _rope(q, pos, theta, neox=fam != "llama", factors=factors, scale=rscale)
        k = _rope(k, pos, theta, neox=fam != "llama", factors=factors, scale=rscale)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) * scale
        visible = pos[None, :] <= pos[:, None]
        if local:
            visible &= pos[:, None] - pos[None, :] < cfg.sliding_window
        s = np.where(visible[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = xq("o", np.einsum("hts,shd->thd", pr, v).reshape(t, nh * hd))
        o = o @ w(p + "attn_output.weight").T
        if fam == "gemma3":
            o = _norm(o, w(p + "post_attention_norm.weight"), eps)
        x = x + o
        h = xq("gateup", _norm(x, w(p + "ffn_norm.weight"), eps))
        if cfg.n_experts:
            x = x + _moe(w, p, cfg, h, router_gaps)
            continue
        g, u = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        act = _gelu_tanh(g) if fam == "gemma3" else g / (1 + np.exp(-g))
        f = xq("down", act * u) @ w(p + "ffn_down.weight").T
        if fam == "gemma3":
            f = _norm(f, w(p + "post_ffw_norm.weight"), eps)
        x = x + f
    x = xq("head", _norm(x, w("output_norm.weight"), eps))
    return x @ w("token_embd.weight" if cfg.tied_output else "output.weight").T
