"""Every causal attention core, and the one switch between them: `tiled`, `xla`, `cudnn`, `pallas`, or `auto`.

- `tiled` (`tiled_causal_attention`): flash-attention style, `lax` loops over query tiles and,
  for each, over the key tiles at or below the diagonal with an online softmax (running max and
  sum); tiles above the diagonal are never computed, forward or backward, only the diagonal tile is
  masked. Keeps q, k, v and the log-sum-exp; compiled temp grows as B·H·T·tile instead of B·H·T²,
  and the program does not grow with T/tile.
- `xla` (`xla_causal_attention`): the whole (T, T) score matrix per kv head (the core before the
  tiled one); the same residuals and dropout bits, for comparison, and the tiled core's program
  when T fits in one tile.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN flash attention; GPU,
  bf16/fp16, no dropout), its residuals tagged `names.ATTN_PROBS` (see `cudnn_causal_attention`).
- `pallas`: Pallas TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, its
  MQA kernel per kv group, so GQA/MQA share k and v); TPU only; its residuals tagged
  `names.ATTN_PROBS` (see `pallas_causal_attention`).
- `auto`: chosen for the platform the program is built for (`remat.memory.target_platform`: the
  host, or `remat.memory.building_for` / `lowered_for`), not the host: cudnn on an NVIDIA GPU where
  it applies (bf16/fp16, no dropout, a head size cuDNN takes), else on a GPU the tiled core with a
  GPU-sized tile (`GPU_TILE`); pallas on TPU where it applies (no dropout, T a multiple of 128), else
  tiled; tiled on CPU.

Shapes: B batch, T sequence, H query heads, K kv heads, G = H/K, D head size, t tile, S keys a
block reads, n = ceil(T/t) tiles.

Example:
    >>> causal_attention(q, k, v, 4, 2, attention="tiled", tile=4).shape  # (B, T, H·D); q (B, T, 4·8), k and v (B, T, 2·8)
    (2, 8, 32)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from remat import memory as _memory
from remat import names

F32 = jnp.float32
ATTENTION = ("auto", "tiled", "xla", "cudnn", "pallas")
# NOTE: DEFAULT_TILE was measured on XLA:CPU (`python -m remat_lm.bench.attention --tile_sweep
# 64,128,256,512 --shapes 8x256,1x1024,1x4096`): one GPT-2 reference attention layer (C=256, 4
# heads), forward + backward, with the online kernel. 128 was the fastest at T=1024 and 4096 (tiles
# 256 and 512 lose: a (t, t) tile per step grows the temp and the serial dependency through the
# running max); 64 ties at the reference T=256 and is slower at T=4096 (more, smaller loop steps).
DEFAULT_TILE = 128
# NOTE: the tile `auto` gives the tiled core on a GPU (float32, or a shape cuDNN refuses). The tiled
# core runs its tile pairs one after another, n(n+1)/2 per pass with n = T/tile, each a small matmul
# a GPU cannot fill: tile 128 at T=1024 is 36 sequential steps per layer per pass, tile 512 is 3.
# Temp grows as B·H·T·tile, still far below the (T, T) scores of the `xla` core. An explicit
# `--attention tiled` keeps the tile it is given.
GPU_TILE = 512


# ------------------------------------------------------------------------------------------------
# Dropout bits: a pure function of (key, batch, head, query position, key position).

def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def dropout_keep(key, rate: float, shape, q_offset=0, k_offset=0):
    """The dropout keep-mask of a (B, K, G, t, S) block of attention probabilities.

    Element (b, kv, g, i, j) is kept iff hash(key, b, head kv·G+g, query q_offset+i, key
    k_offset+j) ≥ rate·2³², so any tiling, the forward and the backward, and every remat setting
    draw the same bit for the same position. The offsets may be traced (loop indices).
    Example:
      >>> keep = dropout_keep(jax.random.key(0), 0.5, (1, 1, 1, 4, 4))
      >>> keep.shape, keep.dtype
      ((1, 1, 1, 4, 4), dtype('bool'))
    """
    B, K, G, t, S = shape
    # NOTE: counter-based, like Philox in cuDNN/PyTorch: the two seed words come from the key
    # (jax.random.bits), the counters are positions. One finalizer round per element; the row
    # hash (b, head, query) is mixed first on the small (B, K, G, t) array.
    seed = jax.random.bits(key, (2,), jnp.uint32)
    u = lambda shp, axis: lax.broadcasted_iota(jnp.uint32, shp, axis)
    hb = _fmix32(seed[0] + u((B, 1, 1, 1, 1), 0) * jnp.uint32(0x9E3779B9))
    head = u((1, K, G, 1, 1), 1) * jnp.uint32(G) + u((1, K, G, 1, 1), 2)
    hh = _fmix32(hb ^ (seed[1] + head * jnp.uint32(0x85EBCA77)))
    off = lambda o: jnp.asarray(o).astype(jnp.uint32)
    hr = _fmix32(hh ^ ((u((1, 1, 1, t, 1), 3) + off(q_offset)) * jnp.uint32(0xC2B2AE3D)))  # (B, K, G, t, 1)
    h = _fmix32(hr + (u((1, 1, 1, 1, S), 4) + off(k_offset)) * jnp.uint32(0x27D4EB2F))  # (B, K, G, t, S)
    return h >= jnp.uint32(min(round(rate * 2.0 ** 32), 2 ** 32 - 1))


# ------------------------------------------------------------------------------------------------
# Layout, shared by every core. Heads are contiguous in the last axis of q (B, T, H·D) and of k, v
# (B, T, K·D); query head h = kv·G + g reads kv head kv (llm.c's repeat_kv).

def _split(x, n_kv_head, groups):
    """(B, T, K·G·D) → (B, K, G, T, D)."""
    B, T, F = x.shape
    return x.reshape(B, T, n_kv_head, groups, F // (n_kv_head * groups)).transpose(0, 2, 3, 1, 4)


def _merge(x5):
    """(B, K, G, T, D) → (B, T, K·G·D): the inverse of `_split`."""
    B, K, G, T, D = x5.shape
    return x5.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G * D)


def _heads(q, k, v, n_head, n_kv_head):
    """q (B, K, G, T, D), k and v (B, K, T, D), G, and the score scale 1/sqrt(D)."""
    G = n_head // n_kv_head
    return (_split(q, n_kv_head, G), _split(k, n_kv_head, 1)[:, :, 0], _split(v, n_kv_head, 1)[:, :, 0],
            G, 1.0 / math.sqrt(q.shape[-1] // n_head))


def _fresh(xs, *prev):
    """The arrays `xs` (zero buffers a loop writes into), made to depend on the arrays `prev`, so
    that XLA makes them when `prev` exists, one per layer.

    # NOTE: a plain zeros, or the stacked outputs of `lax.scan`, start from a constant broadcast,
    # which XLA shares between every loop of the program; under SPMD partitioning XLA:CPU then made
    # one copy per loop at the start of the program, all live until their loop ran (every loop's
    # (n, B, K, G·t, D) copy in the forward, before any layer). `lax.optimization_barrier` does not hold: XLA:CPU removes it before scheduling. A data
    # dependency does: one element of each `prev` times zero (XLA keeps x·0 for floats, as it is NaN
    # for x = NaN or inf). A NaN or inf in `prev` turns the buffers NaN; the loss is NaN either way.
    """
    dep = sum(p.reshape(-1)[0].astype(F32) for p in prev) * 0
    return tuple((x + dep.astype(x.dtype)) for x in xs)


# ------------------------------------------------------------------------------------------------
# The xla core: the whole (T, T) score matrix per kv head.

def xla_causal_attention(q, k, v, n_head: int, n_kv_head: int, *, dropout_rate: float = 0.0, key=None):
    """Causal softmax attention with grouped-query heads over the whole (T, T) scores; keeps q, k, v
    and the log-sum-exp.

    The `xla` core of `causal_attention` (and the `tiled` core's when T fits in one tile). Scores,
    softmax and the backward's probabilities are float32; the context comes back in v's dtype.

    Args:
      q: (B, T, H·D); k, v: (B, T, K·D), heads contiguous in the last axis.
      n_head, n_kv_head: H and K (query head h reads kv head h // (H/K)).
      dropout_rate, key: dropout on the probabilities; off when `key` is None or the rate is 0.
    Returns:
      the context, heads merged: (B, T, H·D).
    Example:
      >>> xla_causal_attention(q, k, v, 4, 2).shape  # q (B, T, 4·8), k and v (B, T, 2·8)
      (2, 8, 32)
    """
    if key is None or dropout_rate == 0.0:
        key, dropout_rate = None, 0.0
    return _xla(q, k, v, key, n_head, n_kv_head, float(dropout_rate))


# NOTE: layout. The core works head-major with the G query heads of a kv group folded into the
# rows: q (B, K, R, D) with R = G·T (row r is head g = r // T, position r % T), k and v (B, K, T, D),
# scores (B, K, R, T). Every product is then a plain batched matmul (batch dims leading, contracting
# the last axis), which XLA:CPU runs faster than the same einsums over (B, T, K, G, D) operands
# (the commit that chose this layout records the timing). (B, K, R, T) has the memory
# order of (B, K, G, T, T), so dropout masks are drawn in that shape.

def _q_rows(q, n_head, n_kv_head):
    """(B, T, H·D) → (B, K, R, D), R = G·T."""
    q5 = _split(q, n_kv_head, n_head // n_kv_head)
    B, K, G, T, D = q5.shape
    return q5.reshape(B, K, G * T, D)


def _xla_setup(q, k, v, n_head, n_kv_head):
    """q (B, K, R, D), k and v (B, K, T, D), G and the scale."""
    _, kh, vh, G, scale = _heads(q, k, v, n_head, n_kv_head)
    return _q_rows(q, n_head, n_kv_head), kh, vh, G, scale


def _rows_merge(yh, G):
    """(B, K, R, D) → (B, T, K·G·D)."""
    B, K, R, D = yh.shape
    return _merge(yh.reshape(B, K, G, R // G, D))


def _xla_probs(qh, kh, scale, lse=None):
    """Scaled, causally masked scores → (probabilities, log-sum-exp), all float32."""
    s = jnp.einsum("bkrd,bksd->bkrs", qh, kh, preferred_element_type=F32) * scale  # (B, K, R, T)
    R, T = s.shape[-2:]
    causal = lax.broadcasted_iota(jnp.int32, (R, T), 0) % T >= lax.broadcasted_iota(jnp.int32, (R, T), 1)
    s = jnp.where(causal, s, -jnp.inf)
    if lse is None:  # the diagonal is never masked, so every row max is finite
        lse = jax.nn.logsumexp(s, axis=-1)  # (B, K, R)
    return jnp.exp(s - lse[..., None]), lse


def _xla_keep(key, rate, p, G):
    """The dropout keep-mask for probabilities p (B, K, R, T), drawn as (B, K, G, T, T)."""
    B, K, R, T = p.shape
    return dropout_keep(key, rate, (B, K, G, T, T)).reshape(p.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _xla(q, k, v, key, n_head, n_kv_head, rate):
    return _xla_fwd(q, k, v, key, n_head, n_kv_head, rate)[0]


def _xla_fwd(q, k, v, key, n_head, n_kv_head, rate):
    qh, kh, vh, G, scale = _xla_setup(q, k, v, n_head, n_kv_head)
    p, lse = _xla_probs(qh, kh, scale)  # (B, K, R, T)
    if rate:
        p = jnp.where(_xla_keep(key, rate, p, G), p / (1.0 - rate), 0.0)
    y = jnp.einsum("bkrs,bksd->bkrd", p.astype(v.dtype), vh)  # (B, K, R, D)
    return _rows_merge(y, G), (q, k, v, key, lse)


def _xla_bwd(n_head, n_kv_head, rate, res, dy):
    q, k, v, key, lse = res
    qh, kh, vh, G, scale = _xla_setup(q, k, v, n_head, n_kv_head)
    p, _ = _xla_probs(qh, kh, scale, lse)  # (B, K, R, T)
    dyh = _q_rows(dy, n_head, n_kv_head)  # (B, K, R, D)
    dp = jnp.einsum("bkrd,bksd->bkrs", dyh, vh, preferred_element_type=F32)
    pd = p
    if rate:
        keep = _xla_keep(key, rate, p, G)
        pd = jnp.where(keep, p / (1.0 - rate), 0.0)
        dp = jnp.where(keep, dp / (1.0 - rate), 0.0)
    dv = jnp.einsum("bkrs,bkrd->bksd", pd.astype(v.dtype), dyh)  # (B, K, T, D)
    # NOTE: the softmax backward's row term is sum(dp·p), taken from the (T, T) tiles we rebuild
    # anyway; flash kernels use sum(dy·y) to avoid them, which would also need y as a residual.
    ds = (p * (dp - (dp * p).sum(-1, keepdims=True)) * scale).astype(q.dtype)  # (B, K, R, T)
    dq = jnp.einsum("bkrs,bksd->bkrd", ds, kh)  # (B, K, R, D)
    dk = jnp.einsum("bkrs,bkrd->bksd", ds, qh)  # (B, K, T, D)
    return _rows_merge(dq, G), _merge(dk[:, :, None]), _merge(dv[:, :, None]), None


_xla.defvjp(_xla_fwd, _xla_bwd)


# ------------------------------------------------------------------------------------------------
# The tiled core.

def tiled_causal_attention(q, k, v, n_head: int, n_kv_head: int, *, tile: int = DEFAULT_TILE,
                           dropout_rate: float = 0.0, key=None):
    """Causal GQA attention over tiles that skip the masked key tiles; keeps q, k, v and the lse.

    Same arguments and result as `xla_causal_attention`, plus `tile` (any T: the last tile may be
    shorter). T ≤ tile is one masked block: the xla core's program.
    Example:
      >>> tiled_causal_attention(q, k, v, 4, 2, tile=4).shape  # (B, T, H·D); tests/test_attention.py compares the cores
      (2, 8, 32)
    """
    if key is None or dropout_rate == 0.0:
        key, dropout_rate = None, 0.0
    if q.shape[1] <= tile:  # one tile: a single masked block, nothing to loop over (same result)
        return _xla(q, k, v, key, n_head, n_kv_head, float(dropout_rate))
    return _online(q, k, v, key, n_head, n_kv_head, int(tile), float(dropout_rate))


# ------------------------------------------------------------------------------------------------
# The online-softmax core: loops over (query tile, key tile) pairs, program size independent of T.

# NOTE: flash-attention style (FlashAttention-2's algorithm, in XLA loops). `lax.scan` runs over
# the query tiles; for query tile i a `lax.fori_loop` with the traced bound i runs over the key
# tiles j < i (no mask), then the diagonal tile j = i runs once with the causal mask. Tiles above
# the diagonal are never visited, forward or backward. The forward keeps a running row max m, row
# sum l and unnormalized context acc per query tile and rescales them by exp(m_old - m_new) at
# each key tile; it ends with y = acc / l and lse = m + log l. The loop bodies are traced once, so
# the program does not grow with T/tile (tests/test_attention.py counts HLO instructions), and the
# live temp is one (t, t) score tile per (B, K, G) plus O(B·H·T·D) accumulators: O(B·H·T·tile).
# T is padded to a multiple of the tile: padded keys only ever meet real queries in the last
# diagonal tile, where the causal mask removes them; padded query rows are sliced off and get a
# zero cotangent, so they add nothing to dk and dv.
#
# The backward keeps only q, k, v and the lse. The softmax backward's row term rowsum(dP∘P)
# (= rowsum(dO∘O), with or without dropout) needs the whole key row before the first dS, so each
# query tile runs two key loops: the first accumulates the row term (QKᵀ and dO·Vᵀ per tile pair),
# the second forms dS and adds up dQ (carried), dK and dV (float32 buffers indexed by key tile,
# one rounding to k's dtype at the end). Keeping O as a fifth residual would save the first loop
# (2 of the backward's 7 tile-pair matmuls) but break "q, k, v and the lse only", on which the
# saved-bytes comparisons with PyTorch and the memory model rest; the measured cost of the
# recompute is in the step times of `python -m remat_lm.bench.attention`.

def _tile_major(x5, n, t):
    """(B, K, G, n·t, D) → (n, B, K, G·t, D): tile i's rows of all G heads of a kv group."""
    B, K, G, _, D = x5.shape
    return x5.reshape(B, K, G, n, t, D).transpose(3, 0, 1, 2, 4, 5).reshape(n, B, K, G * t, D)


def _from_tile_major(xt, G, T):
    """(n, B, K, G·t, ...) → (B, K, G, T, ...) (the inverse of `_tile_major`, padding cut)."""
    n, B, K, R = xt.shape[:4]
    rest = xt.shape[4:]
    x = xt.reshape((n, B, K, G, R // G) + rest)
    x = jnp.moveaxis(x, 0, 3).reshape((B, K, G, n * (R // G)) + rest)
    return x[:, :, :, :T]


def _pad_seq(x, pad: int):
    """`x` padded with `pad` zero rows along its sequence axis (-2); no op at all when pad is 0, so
    that a remat policy sees q, k, v themselves, not copies of them (tests/test_bf16_policy.py)."""
    return x if pad == 0 else jnp.pad(x, ((0, 0),) * (x.ndim - 2) + ((0, pad), (0, 0)))


def _online_setup(q, k, v, n_head, n_kv_head, tile):
    q5, kh, vh, G, scale = _heads(q, k, v, n_head, n_kv_head)  # (B, K, G, T, D), (B, K, T, D) ×2
    T = q.shape[1]
    t = min(tile, T)
    n = -(-T // t)
    pad = n * t - T
    q5 = _pad_seq(q5, pad)
    kv = lambda x: _pad_seq(x, pad)[:, :, None]  # (B, K, 1, n·t, D)
    return _tile_major(q5, n, t), _tile_major(kv(kh), n, t), _tile_major(kv(vh), n, t), G, scale, t, n


def _online_scores(qi, kj, scale, masked, G):
    """Scaled scores of one (query tile, key tile) pair, float32 (B, K, G·t, t); causal on the diagonal."""
    s = jnp.einsum("bkrd,bksd->bkrs", qi, kj, preferred_element_type=F32) * scale
    if masked:  # diagonal tile: query row r sits at r % t of the tile, key column c at c
        R, t = s.shape[-2:]
        s = jnp.where(lax.broadcasted_iota(jnp.int32, (R, t), 0) % t >= lax.broadcasted_iota(jnp.int32, (R, t), 1),
                      s, -jnp.inf)
    return s


def _online_keep(key, rate, p, i, j, G):
    B, K, R, t = p.shape
    return dropout_keep(key, rate, (B, K, G, R // G, t), i * t, j * t).reshape(p.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _online(q, k, v, key, n_head, n_kv_head, tile, rate):
    return _online_fwd(q, k, v, key, n_head, n_kv_head, tile, rate)[0]


def _online_fwd(q, k, v, key, n_head, n_kv_head, tile, rate):
    qt, kt, vt, G, scale, t, n = _online_setup(q, k, v, n_head, n_kv_head, tile)  # (n, B, K, G·t | t, D)

    def row(i, out):
        qi = qt[i]

        def step(j, carry, masked):
            m, l, acc = carry  # (B, K, G·t) ×2, (B, K, G·t, D) float32
            s = _online_scores(qi, kt[j], scale, masked, G)  # (B, K, G·t, t)
            m_new = jnp.maximum(m, s.max(-1))  # finite: key tile 0 or the diagonal comes first
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            if rate:
                p_v = jnp.where(_online_keep(key, rate, p, i, j, G), p / (1.0 - rate), 0.0)
            else:
                p_v = p
            pv = jnp.einsum("bkrs,bksd->bkrd", p_v.astype(v.dtype), vt[j], preferred_element_type=F32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        init = (jnp.full(qi.shape[:3], -jnp.inf, F32), jnp.zeros(qi.shape[:3], F32), jnp.zeros(qi.shape, F32))
        carry = lax.fori_loop(0, i, functools.partial(step, masked=False), init)
        m, l, acc = step(i, carry, masked=True)
        return out[0].at[i].set((acc / l[..., None]).astype(v.dtype)), out[1].at[i].set(m + jnp.log(l))

    # (n, B, K, G·t, D), (n, B, K, G·t): written tile by tile into buffers made from q (see `_fresh`)
    yt, lset = lax.fori_loop(0, n, row, _fresh((jnp.zeros(qt.shape, v.dtype), jnp.zeros(qt.shape[:-1], F32)), qt))
    T = q.shape[1]
    return _merge(_from_tile_major(yt, G, T)), (q, k, v, key, _from_tile_major(lset, G, T))  # lse (B, K, G, T)


def _online_bwd(n_head, n_kv_head, tile, rate, res, dy):
    q, k, v, key, lse = res
    T = q.shape[1]
    qt, kt, vt, G, scale, t, n = _online_setup(q, k, v, n_head, n_kv_head, tile)
    dyt = _tile_major(_pad_seq(_split(dy, n_kv_head, G), n * t - T), n, t)
    lset = _tile_major(_pad_seq(lse[..., None], n * t - T), n, t)[..., 0]  # (n, B, K, G·t)

    def row(i, carry):
        dqt, dkv = carry
        qi, dyi, lse_i = qt[i], dyt[i], lset[i]

        def probs(j, masked):
            p = jnp.exp(_online_scores(qi, kt[j], scale, masked, G) - lse_i[..., None])  # (B, K, G·t, t)
            dp = jnp.einsum("bkrd,bksd->bkrs", dyi, vt[j], preferred_element_type=F32)
            if not rate:
                return p, p, dp
            keep = _online_keep(key, rate, p, i, j, G)
            return p, jnp.where(keep, p / (1.0 - rate), 0.0), jnp.where(keep, dp / (1.0 - rate), 0.0)

        def row_term(j, acc, masked):
            p, _, dp = probs(j, masked)
            return acc + (p * dp).sum(-1)

        d = row_term(i, lax.fori_loop(0, i, functools.partial(row_term, masked=False),
                                      jnp.zeros(qi.shape[:3], F32)), masked=True)  # (B, K, G·t)

        def grads(j, carry, masked):
            dq, dk, dv = carry
            p, pd, dp = probs(j, masked)
            ds = (p * (dp - d[..., None]) * scale).astype(q.dtype)  # (B, K, G·t, t)
            dq = dq + jnp.einsum("bkrs,bksd->bkrd", ds, kt[j], preferred_element_type=F32)
            dk = dk.at[j].add(jnp.einsum("bkrs,bkrd->bksd", ds, qi, preferred_element_type=F32))
            dv = dv.at[j].add(jnp.einsum("bkrs,bkrd->bksd", pd.astype(v.dtype), dyi, preferred_element_type=F32))
            return dq, dk, dv

        carry = lax.fori_loop(0, i, functools.partial(grads, masked=False), (jnp.zeros(qi.shape, F32),) + dkv)
        dq, dk, dv = grads(i, carry, masked=True)
        return dqt.at[i].set(dq.astype(q.dtype)), (dk, dv)

    # NOTE: the dk/dv accumulators depend on nothing, and XLA:CPU's scheduler otherwise creates every
    # layer's at the start of the backward, all live at once; made after dy with `_fresh`, each lives
    # only through its layer's backward (tests/test_peak.py checks the compiled temp).
    dq0, zeros = _fresh((jnp.zeros(qt.shape, q.dtype), jnp.zeros(kt.shape, F32)), dyt)  # dk, dv: per key tile
    dqt, (dkt, dvt) = lax.fori_loop(0, n, row, (dq0, (zeros, zeros)))
    kv = lambda xt, like: _merge(_from_tile_major(xt, 1, T).astype(like.dtype))  # → (B, T, K·D)
    return _merge(_from_tile_major(dqt, G, T)), kv(dkt, k), kv(dvt, v), None


_online.defvjp(_online_fwd, _online_bwd)


# ------------------------------------------------------------------------------------------------
# cuDNN, with named residuals.

def named_residuals(fn, name: str):
    """`fn(*args)` whose backward keeps what `jax.vjp(fn)` keeps, each residual tagged `name`.

    A remat policy then decides about those residuals by name (`save_names:`, `offload_names:`,
    the selective presets) as it does for any tagged activation.
    Example:
      >>> f = named_residuals(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), names.ATTN_PROBS)
      >>> qh = q.reshape(2, 8, 4, 8)  # (B, T, heads, D)
      >>> f(qh, qh, qh).shape
      (2, 8, 4, 8)
    """
    treedef = []  # set while tracing the forward; the backward is always traced after it

    @jax.custom_vjp
    def f(*args):
        return fn(*args)

    def fwd(*args):
        y, pullback = jax.vjp(fn, *args)
        leaves, td = jax.tree.flatten(pullback)  # a jax.tree_util.Partial: residual arrays as leaves
        treedef[:] = [td]
        return y, tuple(checkpoint_name(x, name) for x in leaves)

    def bwd(res, dy):
        return jax.tree.unflatten(treedef[0], res)(dy)

    f.defvjp(fwd, bwd)
    return f


def _dpa(q, k, v, implementation):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


# The cuDNN version a program built on a host without cuDNN assumes. JAX reads it only to refuse
# MLA (q and v head sizes differ) before 9.10 and compute capability 10.3 before 9.11.
CUDNN_TARGET_VERSION = 91000


def _fused_attention_stablehlo():
    """JAX's cuDNN attention module, `jax._src.cudnn.fused_attention_stablehlo`: the one JAX internal
    remat_lm imports (the library's are in remat/_compat.py; `tests/test_jax_policies.py` checks).

    # NOTE: no public API exposes the cuDNN version check JAX runs while tracing cuDNN attention
    # (replaced by `_cudnn_off_host` so a CPU host can build a cuda program) or its compute-capability
    # check (the largest head size cuDNN takes). Imported on first use, so `import remat_lm` and every
    # other attention core keep working if JAX moves it; pyproject.toml's `jax<0.11` bounds it.
    """
    from jax._src.cudnn import fused_attention_stablehlo
    return fused_attention_stablehlo


def _cudnn_off_host():
    """Let JAX's cuDNN wrapper trace for cuda on a host without cuDNN (a CPU machine building a GPU
    program): it asks the local cuDNN for its version and refuses without one. Installed once: while
    the target is cuda and no cuDNN is loaded, the answer is CUDNN_TARGET_VERSION; otherwise JAX's
    own check runs. Its shape checks (head size, layout) still run, for a pre-Hopper GPU.

    # NOTE: a wrapper installed for good rather than a patch around the call: `jax.checkpoint`
    # re-traces the region (and so the cuDNN call) during partial evaluation, after the call returned.
    """
    fas = _fused_attention_stablehlo()
    if getattr(fas.check_cudnn_version, "_remat_off_host", False):
        return
    jax_check = fas.check_cudnn_version

    def check():
        if fas.cuda_versions is None and _memory.target_platform() == "cuda":
            return CUDNN_TARGET_VERSION
        return jax_check()

    check._remat_off_host = True
    fas.check_cudnn_version = check


def cudnn_head_max() -> int:
    """The largest head size JAX's cuDNN flash attention takes here: 256 on a local Hopper or later
    GPU, else 128 (JAX's own rule, `check_is_flash_attention`; off-GPU it assumes pre-Hopper)."""
    fas = _fused_attention_stablehlo()
    try:
        return 256 if fas.check_compute_capability("9.0") else 128
    except Exception:  # no GPU backend here
        return 128


def cudnn_causal_attention(q, k, v, n_head: int, n_kv_head: int, *, implementation: str = "cudnn"):
    """`jax.nn.dot_product_attention(is_causal=True)` on (B, T, H·D) inputs; residuals tagged attn_probs.

    # NOTE: cuDNN's VJP keeps q, k, v, the output and the softmax statistics. Tagged
    # `attn_probs` (the attention core's own state), `core_attn` recomputes the cuDNN forward in
    # the backward, `none` keeps them, and `save_names:`/`offload_names:` name them. With
    # `implementation="xla"` the same wrapper runs on any backend (tests use it on CPU). Traced for
    # cuda (`remat.memory.building_for("cuda")`) it lowers from any host (`_cudnn_off_host`).
    Example:
      >>> cudnn_causal_attention(q, k, v, 4, 2, implementation="xla").shape  # cuDNN itself needs a GPU and bf16
      (2, 8, 32)
    """
    B, T, _ = q.shape
    D = q.shape[-1] // n_head
    f = named_residuals(functools.partial(_dpa, implementation=implementation), names.ATTN_PROBS)
    try:
        _cudnn_off_host()
        y = f(q.reshape(B, T, n_head, D), k.reshape(B, T, n_kv_head, D), v.reshape(B, T, n_kv_head, D))
    except (RuntimeError, NotImplementedError, ValueError) as e:  # "cuDNN is not detected", unsupported shapes
        raise ValueError(f"attention='cudnn' cannot run here ({e}); use attention='tiled' "
                         f"(--attention tiled), which runs on every backend") from None
    return y.reshape(B, T, n_head * D)  # (B, T, H·D)


# ------------------------------------------------------------------------------------------------
# Pallas TPU splash attention, with named residuals.

# The kernel's block along T: splash attention takes key blocks of a multiple of 128 (a TPU lane width).
PALLAS_BLOCK = 128


def _pallas_problem(T: int) -> str | None:
    if T % PALLAS_BLOCK:
        return f"splash attention tiles T by {PALLAS_BLOCK} and T={T} is not a multiple of it"
    return None


def pallas_causal_attention(q, k, v, n_head: int, n_kv_head: int, *, interpret: bool = False, spec=None):
    """Causal GQA attention by Pallas TPU splash attention on (B, T, H·D) inputs; residuals tagged attn_probs.

    One MQA kernel (G = H/K query heads over one k, v) per kv group, mapped over batch and groups,
    so k and v are never repeated. `interpret=True` runs the kernel in Pallas' interpreter on any
    backend (tests compare its gradients with the other cores on CPU); otherwise it needs a TPU
    target (it lowers to `tpu_custom_call` from any host). Under a mesh of several devices it runs
    per shard (`_pallas_sharded`; `spec`: the layout of q, k, v and the result), whether the caller
    set the mesh (`jax.set_mesh`) or only sharded the inputs.
    # NOTE: the kernel's own VJP keeps q, k, v, the output and the log-sum-exp; `named_residuals`
    # tags them `attn_probs`, as for cudnn, so `core_attn` recomputes the kernel's forward in the
    # backward and `save_names:` / `offload_names:` name them. The tags are put outside the
    # shard_map, on the global residuals (names inside a shard_map do not reach the policy's view).
    # The kernel does not scale q: the 1/sqrt(D) is applied to q first.
    Example:
      >>> q128 = jnp.ones((1, 128, 4 * 8))  # (B, T, H·D): T a multiple of PALLAS_BLOCK
      >>> pallas_causal_attention(q128, q128[..., :16], q128[..., :16], 4, 2, interpret=True).shape
      (1, 128, 32)
    """
    problem = _pallas_problem(q.shape[1])
    if problem:
        raise ValueError(f"attention='pallas' cannot run this shape: {problem}; use attention='tiled' "
                         f"(--attention tiled), which runs on every backend")
    run = functools.partial(_pallas_sharded, n_head=n_head, n_kv_head=n_kv_head, spec=spec, interpret=interpret)
    return named_residuals(run, names.ATTN_PROBS)(q, k, v)


def _pallas_kernel(q, k, v, n_head, n_kv_head, interpret):
    """The splash kernel on one device's (B, T, H·D) q and (B, T, K·D) k, v."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    T = q.shape[1]
    G, D = n_head // n_kv_head, q.shape[-1] // n_head
    b = PALLAS_BLOCK
    blocks = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                           block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(G)])
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret)
    run = jax.vmap(jax.vmap(kernel))  # over B, then K: (B, K, G, T, D), (B, K, T, D) ×2
    q5, kh, vh, G, scale = _heads(q * jnp.asarray(1.0 / math.sqrt(D), q.dtype), k, v, n_head, n_kv_head)
    return _merge(run(q5, kh, vh).astype(v.dtype))  # (B, T, H·D)


def _pallas_sharded(q, k, v, n_head, n_kv_head, spec, interpret=False):
    """`_pallas_kernel` under a mesh of several devices: one kernel per device's shard.

    # NOTE: XLA cannot partition a Mosaic (Pallas TPU) call ("Mosaic kernels cannot be
    # automatically partitioned"), so under a multi-device mesh the kernel runs in a `shard_map`
    # over every mesh axis: q, k, v as `spec` lays them out, (B, T, heads·D) with batch and heads
    # split and T whole (the model's `parallel.split` layout), else the batch over every axis
    # larger than 1. Heads are split in contiguous blocks, so a device's kv heads serve exactly its
    # query heads (remat_lm.training.sharding.check_tensor: heads and kv heads divisible by tensor).
    """
    from jax.sharding import PartitionSpec as P
    mesh = _mesh_of(q)
    if mesh is None or mesh.empty or mesh.size == 1:
        return _pallas_kernel(q, k, v, n_head, n_kv_head, interpret)
    if spec is None:
        spec = P(tuple(a for a in mesh.axis_names if mesh.shape[a] > 1), None, None)
    spec = tuple(spec) + (None,) * (3 - len(tuple(spec)))
    size = lambda axes: math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
    heads = size(spec[2])
    if spec[1] is not None or q.shape[0] % size(spec[0]) or n_head % heads or n_kv_head % heads:
        raise ValueError(f"attention='pallas' cannot run this layout: {P(*spec)} over mesh {dict(mesh.shape)} "
                         f"(T must be whole, batch and heads divisible); use attention='tiled' (--attention tiled)")
    run = functools.partial(_pallas_kernel, n_head=n_head // heads, n_kv_head=n_kv_head // heads, interpret=interpret)
    # check_vma=False: the kernel's pallas_call declares its outputs without varying-axis types
    return jax.shard_map(lambda q, k, v: run(q, k, v), mesh=mesh, in_specs=(P(*spec),) * 3, out_specs=P(*spec),
                         check_vma=False)(q, k, v)


def _mesh_of(x):
    """The mesh `x` is laid out over: the one set by `jax.set_mesh`, else the mesh of `x`'s own
    sharding (an array, or a tracer of a program jitted with sharded inputs and no mesh set).

    # NOTE: a program jitted with sharded arguments alone (`jax.jit(f)(x)` with `x` on a
    # NamedSharding, or `ShapeDtypeStruct(..., sharding=...)` to `.trace`) sets no mesh context, but
    # its tracers' types carry the arguments' mesh (`jax.typeof(q).sharding.mesh`, an AbstractMesh;
    # in Auto axis mode the spec is not recorded). The kernel's shard_map is built over that mesh
    # with the model's layout; XLA reshards q, k, v at its boundary if the caller laid them out
    # otherwise. Without it the kernel reaches XLA's partitioner, which refuses a Mosaic call.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "mesh", None) if isinstance(sharding, jax.sharding.NamedSharding) else None


# ------------------------------------------------------------------------------------------------
# The switch.

def _cudnn_problem(dtype, head_dim: int, dropout: bool, platform: str) -> str | None:
    """Why cuDNN flash attention cannot run this call on `platform`, or None."""
    if platform != "cuda":
        return f"it needs an NVIDIA GPU and the program is built for {platform}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it computes in bfloat16/float16 and the compute dtype is {jnp.dtype(dtype).name}"
    if dropout:
        return "jax.nn.dot_product_attention has no dropout and attention dropout is on"
    top = cudnn_head_max()
    if head_dim % 8 or head_dim > top:
        return f"cuDNN flash attention takes head sizes that are multiples of 8 up to {top} here, not {head_dim}"
    return None


def _pallas_problem_for(dropout: bool, seq_len: int | None, platform: str) -> str | None:
    """Why splash attention cannot run this call on `platform`, or None."""
    if platform != "tpu":
        return f"it needs a TPU and the program is built for {platform}"
    if dropout:
        return "splash attention has no dropout and attention dropout is on"
    return _pallas_problem(seq_len) if seq_len else None


def resolve(attention: str, dtype, head_dim: int, dropout: bool = False, *, seq_len: int | None = None,
            platform: str | None = None) -> str:
    """The core `attention` names for `platform` (default: the one being built for,
    `remat.memory.target_platform()`): `auto` → cudnn on cuda, pallas on tpu, where they apply,
    else tiled.

    Raises ValueError for an unknown name, or for cudnn / pallas where they cannot run (naming `tiled`).
    Example:
      >>> resolve("auto", jnp.float32, 64, platform="cpu"), resolve("auto", jnp.bfloat16, 64, platform="cuda")
      ('tiled', 'cudnn')
      >>> resolve("auto", jnp.float32, 64, seq_len=256, platform="tpu")
      'pallas'
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not valid; use one of {', '.join(ATTENTION)}")
    if attention in ("tiled", "xla"):
        return attention
    platform = platform or _memory.target_platform()
    problems = {"cudnn": _cudnn_problem(dtype, head_dim, dropout, platform),
                "pallas": _pallas_problem_for(dropout, seq_len, platform)}
    if attention == "auto":
        return next((core for core, problem in problems.items() if problem is None), "tiled")
    if problems[attention]:
        raise ValueError(f"attention='{attention}' cannot run: {problems[attention]}; use attention='tiled' "
                         f"(--attention tiled), which runs on every backend")
    return attention


def causal_attention(q, k, v, n_head: int, n_kv_head: int, *, attention: str = "auto",
                     tile: int = DEFAULT_TILE, dropout_rate: float = 0.0, key=None, spec=None):
    """Causal GQA attention by the core `attention` names (`resolve`); (B, T, H·D) in and out.

    Args:
      q: (B, T, H·D); k, v: (B, T, K·D), heads contiguous in the last axis.
      n_head, n_kv_head: H and K (query head h reads kv head h // (H/K)).
      attention: auto | tiled | xla | cudnn | pallas; tile: the tiled core's query tile (`auto` on
        a GPU raises it to GPU_TILE).
      dropout_rate, key: dropout on the probabilities; off when `key` is None or the rate is 0.
      spec: the PartitionSpec of q, k, v and the result under a mesh (the model's
        `parallel.split`), for the Pallas kernel's `shard_map` (XLA cannot partition it).
    Example:
      >>> causal_attention(q, k, v, 4, 2, attention="xla").shape
      (2, 8, 32)
    """
    dropout = key is not None and dropout_rate > 0.0
    platform = _memory.target_platform()
    impl = resolve(attention, q.dtype, q.shape[-1] // n_head, dropout, seq_len=q.shape[1], platform=platform)
    if attention == "auto" and platform in ("cuda", "rocm"):
        tile = max(tile, GPU_TILE)
    tiled = functools.partial(tiled_causal_attention, q, k, v, n_head, n_kv_head, tile=tile,
                              dropout_rate=dropout_rate, key=key)
    if impl == "tiled":
        return tiled()
    if impl == "xla":
        return xla_causal_attention(q, k, v, n_head, n_kv_head, dropout_rate=dropout_rate, key=key)
    try:
        if impl == "pallas":
            return pallas_causal_attention(q, k, v, n_head, n_kv_head, spec=spec)
        return cudnn_causal_attention(q, k, v, n_head, n_kv_head)
    except ValueError:
        if attention != "auto":
            raise
        # auto: a shape the kernel turns down at trace time (its own checks) runs tiled instead
        return tiled()


# ------------------------------------------------------------------------------------------------
# Decoding: new queries over a key/value cache.

def cached_attention(q, k, v, positions):
    """Causal GQA attention of S new queries over a cache of keys and values (no gradient kept).

    The decode core of `remat_lm.models.layers.CausalSelfAttention`: one plain (S, T_max) score
    matrix per kv head, whatever the model's `attention` setting (the tiled, cuDNN and Pallas cores
    are training kernels over a whole causal sequence). Query head h reads kv head h // G. Scores
    and softmax are float32 (as the `xla` core's); cache entries past a query's position are
    masked, so unfilled ones are never read.

    Args:
      q: (B, S, H, D); k, v: (B, T_max, K, D), the cache; positions: (S,) the queries' positions.
    Returns:
      the context, heads merged: (B, S, H·D) in v's dtype.
    Example:
      >>> q4, k4, v4 = q.reshape(2, 8, 4, 8), k.reshape(2, 8, 2, 8), v.reshape(2, 8, 2, 8)  # (B, T, heads, D)
      >>> y = cached_attention(q4, k4, v4, jnp.arange(8))   # a cache filled at positions 0..7
      >>> y.shape, bool(jnp.allclose(y, causal_attention(q, k, v, 4, 2, attention="xla"), atol=1e-5))
      ((2, 8, 32), True)
    """
    B, S, H, D = q.shape
    T, K = k.shape[1], k.shape[2]
    qg = q.reshape(B, S, K, H // K, D)
    s = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=F32) * (1.0 / math.sqrt(D))  # (B, K, G, S, T)
    visible = jnp.arange(T)[None, :] <= positions[:, None]  # (S, T)
    s = jnp.where(visible, s, -jnp.inf)
    p = jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True))
    y = jnp.einsum("bkgst,btkd->bskgd", p.astype(v.dtype), v)  # (B, S, K, G, D)
    return y.reshape(B, S, H * D)
