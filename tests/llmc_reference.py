"""Independent float64 NumPy reference for llm.c's GPT-2 and LLaMA-3 (forward and backward).

Written straight from docs/llmc-format.md and llm.c's reference scripts, with a hand-derived backward pass
(no autodiff), to produce debug-state files and to check ports against. Tensor names
and shapes are those of ``remat_lm.models.llmc_io`` (linear weights (out, in), per-layer tensors
with a leading L axis).

Example:
    >>> header = tiny_gpt2_header()
    >>> tensors = random_tensors(header, seed=0)
    >>> x = np.zeros((2, 8), np.int32); y = np.ones((2, 8), np.int32)
    >>> logits, loss, grads = gpt2_forward_backward(header, tensors, x, y)
"""

from __future__ import annotations

import math

import numpy as np

from remat_lm.models.gpt2 import GPT2Header
from remat_lm.models.llama3 import Llama3Header

GPT2_LN_EPS = 1e-5


# ---------------------------------------------------------------------------
# tiny configurations and random weights


def tiny_gpt2_header() -> GPT2Header:
    """A 2-layer, 4-head, C=32 GPT-2 with vocab 100 padded to 128 and block size 16."""
    return GPT2Header(block_size=16, vocab_size=100, n_layer=2, n_head=4, n_embd=32, padded_vocab_size=128)


def tiny_llama3_header() -> Llama3Header:
    """A 2-layer LLaMA-3 (4 heads, 2 kv heads, C=32, H=96, vocab 96, block 16, scaled RoPE)."""
    return Llama3Header(
        block_size=16, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
        ffn_dim_multiplier=1.0, multiple_of=32, norm_eps=1e-5, rope_theta=10000.0,
        use_scaled_rope=True, max_gen_batch_size=4,
    )


def random_tensors(header: GPT2Header | Llama3Header, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random float32 weights: N(0, std) matrices and biases, norm weights N(1, 0.1).

    GPT-2's padded wte rows V..Vp-1 are zero, as in llm.c files.

    Example:
        >>> random_tensors(tiny_llama3_header(), seed=1)["ln_f.w"].shape
        (32,)
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in header.tensor_shapes():
        if name.startswith("ln_") and name.endswith(".w"):
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            arr = std * rng.standard_normal(shape)
        out[name] = arr.astype(np.float32)
    if isinstance(header, GPT2Header):
        out["wte"][header.vocab_size:] = 0.0
    return out


def random_batch(header: GPT2Header | Llama3Header, B: int, T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random (x, y) int32 token batches in [0, vocab_size)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, header.vocab_size, size=(B, T), dtype=np.int32)
    y = rng.integers(0, header.vocab_size, size=(B, T), dtype=np.int32)
    return x, y


# ---------------------------------------------------------------------------
# building blocks (forward returns a cache, backward consumes it)


def _linear_grads(dout: np.ndarray, inp: np.ndarray) -> np.ndarray:
    """dW for out = inp @ W.T with W (out, in), summed over batch and time."""
    return np.einsum("bto,bti->oi", dout, inp)


def _layernorm_fwd(x, w, b, eps=GPT2_LN_EPS):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd)


def _layernorm_bwd(dout, cache, w):
    xhat, rstd = cache
    dw = (dout * xhat).sum((0, 1))
    db = dout.sum((0, 1))
    dxhat = dout * w
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, dw, db


def _rmsnorm_fwd(x, w, eps):
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * r * w, (x, r)


def _rmsnorm_bwd(dout, cache, w):
    x, r = cache
    dw = (dout * x * r).sum((0, 1))
    dxn = dout * w
    dx = r * dxn - x * r**3 * (dxn * x).mean(-1, keepdims=True)
    return dx, dw


_GELU_S = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


def _gelu_fwd(f):
    t = np.tanh(_GELU_S * (f + _GELU_K * f**3))
    return 0.5 * f * (1.0 + t), t


def _gelu_bwd(dg, f, t):
    return dg * (0.5 * (1.0 + t) + 0.5 * f * (1.0 - t * t) * _GELU_S * (1.0 + 3.0 * _GELU_K * f * f))


def _attention_fwd(q, k, v):
    """Causal softmax attention on (B, nh, T, hd) arrays, scale 1/sqrt(hd)."""
    T, hd = q.shape[-2], q.shape[-1]
    s = q @ k.swapaxes(-1, -2) / math.sqrt(hd)
    s = np.where(np.triu(np.ones((T, T), dtype=bool), k=1), -np.inf, s)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v, p


def _attention_bwd(dy, q, k, v, p):
    scale = 1.0 / math.sqrt(q.shape[-1])
    dp = dy @ v.swapaxes(-1, -2)
    dv = p.swapaxes(-1, -2) @ dy
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = (ds @ k) * scale
    dk = (ds.swapaxes(-1, -2) @ q) * scale
    return dq, dk, dv


def _cross_entropy(logits, y):
    """Mean cross-entropy over all positions and its gradient w.r.t. ``logits``."""
    B, T, _ = logits.shape
    z = logits - logits.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1, keepdims=True))
    logp = z - lse
    loss = -np.take_along_axis(logp, y[..., None], -1).mean()
    dlogits = np.exp(logp)
    bi, ti = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    dlogits[bi, ti, y] -= 1.0
    return float(loss), dlogits / (B * T)


def rope_frequencies(head_dim: int, theta: float, use_scaled_rope: bool) -> np.ndarray:
    """RoPE frequencies ``1/theta^(2i/hd)``, optionally with LLaMA-3.1 scaling (factor 8, 1, 4, 8192).

    Example:
        >>> rope_frequencies(4, 10000.0, False)
        array([1.  , 0.01])
    """
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2)[: head_dim // 2] / head_dim)
    if not use_scaled_rope:
        return freqs
    scale_factor, low_freq_factor, high_freq_factor, old_context = 8.0, 1.0, 4.0, 8192.0
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2.0 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1.0 - smooth) * freqs / scale_factor + smooth * freqs
    return np.where(wavelen < high_freq_wavelen, freqs, np.where(wavelen > low_freq_wavelen, freqs / scale_factor, mid))


def _rope(x, cos, sin):
    """Rotate adjacent pairs (x[2i], x[2i+1]) of (B, T, heads, hd) by angle t*freq_i."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return np.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape)


# ---------------------------------------------------------------------------
# GPT-2


def gpt2_forward_backward(header: GPT2Header, tensors: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    """float64 GPT-2 forward and backward for one batch.

    Args:
        header: the model configuration.
        tensors: ``{name: array}`` as read by ``read_model`` (wte with Vp rows).
        x, y: (B, T) int token ids, T <= block_size.

    Returns:
        ``(logits (B,T,Vp) float64, loss float, grads {name: float64 array})``. The loss
        (mean cross-entropy) only looks at columns :V; padded columns get zero gradient.

    Example:
        >>> logits, loss, grads = gpt2_forward_backward(header, tensors, x, y)
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    x, y = np.asarray(x), np.asarray(y)
    B, T = x.shape
    C, nh, L, V = header.n_embd, header.n_head, header.n_layer, header.vocab_size
    hd = C // nh
    assert T <= header.block_size

    def heads(a):  # (B, T, C) -> (B, nh, T, hd)
        return a.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)

    def unheads(a):
        return a.transpose(0, 2, 1, 3).reshape(B, T, C)

    h = p["wte"][x] + p["wpe"][:T]
    caches = []
    for l in range(L):
        ln1, c1 = _layernorm_fwd(h, p["ln_1.w"][l], p["ln_1.b"][l])
        qkv = ln1 @ p["attn.c_attn.w"][l].T + p["attn.c_attn.b"][l]
        q, k, v = (heads(a) for a in np.split(qkv, 3, axis=-1))
        att, probs = _attention_fwd(q, k, v)
        att = unheads(att)
        h1 = h + att @ p["attn.c_proj.w"][l].T + p["attn.c_proj.b"][l]
        ln2, c2 = _layernorm_fwd(h1, p["ln_2.w"][l], p["ln_2.b"][l])
        f = ln2 @ p["mlp.c_fc.w"][l].T + p["mlp.c_fc.b"][l]
        g, t = _gelu_fwd(f)
        h2 = h1 + g @ p["mlp.c_proj.w"][l].T + p["mlp.c_proj.b"][l]
        caches.append((ln1, c1, q, k, v, probs, att, ln2, c2, f, g, t))
        h = h2
    lnf, cf = _layernorm_fwd(h, p["ln_f.w"], p["ln_f.b"])
    logits = lnf @ p["wte"].T
    loss, dlogits_v = _cross_entropy(logits[..., :V], y)

    grads = {name: np.zeros_like(arr) for name, arr in p.items()}
    dlogits = np.zeros_like(logits)
    dlogits[..., :V] = dlogits_v
    grads["wte"] += np.einsum("btv,btc->vc", dlogits, lnf)
    dh, grads["ln_f.w"], grads["ln_f.b"] = _layernorm_bwd(dlogits @ p["wte"], cf, p["ln_f.w"])
    for l in reversed(range(L)):
        ln1, c1, q, k, v, probs, att, ln2, c2, f, g, t = caches[l]
        # MLP branch
        grads["mlp.c_proj.w"][l] = _linear_grads(dh, g)
        grads["mlp.c_proj.b"][l] = dh.sum((0, 1))
        df = _gelu_bwd(dh @ p["mlp.c_proj.w"][l], f, t)
        grads["mlp.c_fc.w"][l] = _linear_grads(df, ln2)
        grads["mlp.c_fc.b"][l] = df.sum((0, 1))
        dx, grads["ln_2.w"][l], grads["ln_2.b"][l] = _layernorm_bwd(df @ p["mlp.c_fc.w"][l], c2, p["ln_2.w"][l])
        dh = dh + dx
        # attention branch
        grads["attn.c_proj.w"][l] = _linear_grads(dh, att)
        grads["attn.c_proj.b"][l] = dh.sum((0, 1))
        dq, dk, dv = _attention_bwd(heads(dh @ p["attn.c_proj.w"][l]), q, k, v, probs)
        dqkv = np.concatenate([unheads(dq), unheads(dk), unheads(dv)], axis=-1)
        grads["attn.c_attn.w"][l] = _linear_grads(dqkv, ln1)
        grads["attn.c_attn.b"][l] = dqkv.sum((0, 1))
        dx, grads["ln_1.w"][l], grads["ln_1.b"][l] = _layernorm_bwd(dqkv @ p["attn.c_attn.w"][l], c1, p["ln_1.w"][l])
        dh = dh + dx
    np.add.at(grads["wte"], x, dh)
    grads["wpe"][:T] += dh.sum(0)
    return logits, loss, grads


# ---------------------------------------------------------------------------
# LLaMA-3


def llama3_forward_backward(header: Llama3Header, tensors: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    """float64 LLaMA-3 forward and backward for one batch.

    RMSNorm, RoPE over adjacent pairs (optional 3.1 scaling), GQA (query head i uses kv
    head i // (n_head/n_kv_head)), SwiGLU ``c_proj(silu(c_fc2(x)) * c_fc(x))``, untied head.

    Returns:
        ``(logits (B,T,V) float64, loss float, grads {name: float64 array})``.

    Example:
        >>> logits, loss, grads = llama3_forward_backward(header, tensors, x, y)
    """
    p = {k: np.asarray(v, dtype=np.float64) for k, v in tensors.items()}
    x, y = np.asarray(x), np.asarray(y)
    B, T = x.shape
    C, nh, nkv, L = header.n_embd, header.n_head, header.n_kv_head, header.n_layer
    hd, rep, eps = C // nh, nh // nkv, header.norm_eps
    assert T <= header.block_size
    angles = np.outer(np.arange(T), rope_frequencies(hd, header.rope_theta, header.use_scaled_rope))
    cos, sin = np.cos(angles), np.sin(angles)

    def bhtd(a):  # (B, T, heads, hd) -> (B, heads, T, hd)
        return a.transpose(0, 2, 1, 3)

    h = p["wte"][x]
    caches = []
    for l in range(L):
        n1, c1 = _rmsnorm_fwd(h, p["ln_1.w"][l], eps)
        qkv = n1 @ p["attn.c_attn.w"][l].T
        q = qkv[..., : nh * hd].reshape(B, T, nh, hd)
        k = qkv[..., nh * hd : (nh + nkv) * hd].reshape(B, T, nkv, hd)
        v = qkv[..., (nh + nkv) * hd :].reshape(B, T, nkv, hd)
        qr, kr = _rope(q, cos, sin), _rope(k, cos, sin)
        qh = bhtd(qr)
        kh = bhtd(np.repeat(kr, rep, axis=2))
        vh = bhtd(np.repeat(v, rep, axis=2))
        att, probs = _attention_fwd(qh, kh, vh)
        att = bhtd(att).reshape(B, T, C)
        h1 = h + att @ p["attn.c_proj.w"][l].T
        n2, c2 = _rmsnorm_fwd(h1, p["ln_2.w"][l], eps)
        u = n2 @ p["mlp.c_fc.w"][l].T
        z = n2 @ p["mlp.c_fc2.w"][l].T
        sig = 1.0 / (1.0 + np.exp(-z))
        act = z * sig * u
        h2 = h1 + act @ p["mlp.c_proj.w"][l].T
        caches.append((n1, c1, qh, kh, vh, probs, att, n2, c2, u, z, sig, act))
        h = h2
    nf, cf = _rmsnorm_fwd(h, p["ln_f.w"], eps)
    logits = nf @ p["lm_head.w"].T
    loss, dlogits = _cross_entropy(logits, y)

    grads = {name: np.zeros_like(arr) for name, arr in p.items()}
    grads["lm_head.w"] = np.einsum("btv,btc->vc", dlogits, nf)
    dh, grads["ln_f.w"] = _rmsnorm_bwd(dlogits @ p["lm_head.w"], cf, p["ln_f.w"])
    for l in reversed(range(L)):
        n1, c1, qh, kh, vh, probs, att, n2, c2, u, z, sig, act = caches[l]
        # SwiGLU branch
        grads["mlp.c_proj.w"][l] = _linear_grads(dh, act)
        dact = dh @ p["mlp.c_proj.w"][l]
        silu = z * sig
        du = dact * silu
        dz = dact * u * sig * (1.0 + z * (1.0 - sig))
        grads["mlp.c_fc.w"][l] = _linear_grads(du, n2)
        grads["mlp.c_fc2.w"][l] = _linear_grads(dz, n2)
        dn2 = du @ p["mlp.c_fc.w"][l] + dz @ p["mlp.c_fc2.w"][l]
        dx, grads["ln_2.w"][l] = _rmsnorm_bwd(dn2, c2, p["ln_2.w"][l])
        dh = dh + dx
        # attention branch
        grads["attn.c_proj.w"][l] = _linear_grads(dh, att)
        datt = bhtd((dh @ p["attn.c_proj.w"][l]).reshape(B, T, nh, hd))
        dqh, dkh, dvh = _attention_bwd(datt, qh, kh, vh, probs)
        dq = _rope(bhtd(dqh), cos, -sin)  # the rotation's transpose is the inverse rotation
        dk = _rope(bhtd(dkh).reshape(B, T, nkv, rep, hd).sum(3), cos, -sin)
        dv = bhtd(dvh).reshape(B, T, nkv, rep, hd).sum(3)
        dqkv = np.concatenate([dq.reshape(B, T, -1), dk.reshape(B, T, -1), dv.reshape(B, T, -1)], axis=-1)
        grads["attn.c_attn.w"][l] = _linear_grads(dqkv, n1)
        dx, grads["ln_1.w"][l] = _rmsnorm_bwd(dqkv @ p["attn.c_attn.w"][l], c1, p["ln_1.w"][l])
        dh = dh + dx
    np.add.at(grads["wte"], x, dh)
    return logits, loss, grads


def forward_backward(kind: str, header, tensors, x, y):
    """Dispatch to :func:`gpt2_forward_backward` or :func:`llama3_forward_backward` by ``kind``."""
    fn = {"gpt2": gpt2_forward_backward, "llama3": llama3_forward_backward}[kind]
    return fn(header, tensors, x, y)


# ---------------------------------------------------------------------------
# token shards, as llm.c's own writer makes them


# The two formats of llm.c's dev/data/data_common.py (HEADERS_INFO), keyed by its model_desc.
LLMC_TOKEN_HEADERS = {
    "gpt-2": dict(magic=20240520, version=1, token_dtype=np.uint16),
    "llama-3": dict(magic=20240801, version=7, token_dtype=np.uint32),
}


def llmc_write_datafile(filename, toks, model_desc: str = "gpt-2") -> None:
    """What llm.c's ``dev/data/data_common.py`` ``write_datafile`` does, independently of remat_lm.models.llmc_io.

    A header of 256 int32 (native order, as NumPy writes it: [0] magic, [1] version, [2] token
    count), then the tokens as uint16 ("gpt-2") or uint32 ("llama-3"), written with a plain
    ``open(..., "wb")`` (not atomic); ids are cast with ``np.array(toks, dtype=...)`` unchecked.
    """
    assert len(toks) < 2**31, "token count too large"
    assert model_desc in LLMC_TOKEN_HEADERS, f"unknown model descriptor {model_desc}"
    info = LLMC_TOKEN_HEADERS[model_desc]
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [info["magic"], info["version"], len(toks)]
    body = np.array(toks, dtype=info["token_dtype"])
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(body.tobytes())
