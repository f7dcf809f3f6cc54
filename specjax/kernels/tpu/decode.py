"""Decode attention for TPU programs: queries against a preallocated KV cache, reading only the
cache blocks each sequence's queries can see.

Query t of sequence b sees the cache slots ``lo[b, t] <= j <= hi[b, t]`` (inclusive): for a
target step ``lo = pos - W + 1`` (0 without a window), ``hi = pos`` (:func:`position_ranges`);
for a draft chain step the ``(lo, hi)`` of ``drafts.common.cache_range``. T is small (1 for
decoding, k + 1 for speculative verify) or a whole prompt (prefill into the cache).

Layout::

    q [B, T, Hq, D]; cache k, v [B, Hkv, S, D] (heads-major, the target's KVCache) or
    [B, S, Hkv, D] (``seq_major``, the drafts' DraftCache; D a multiple of 128); lo, hi int [B, T]
    -> [B, T, Hq, D] in q's dtype

    With ``layer`` (an int32 scalar, traced): k, v are a stacked heads-major cache [L, B, Hkv, S,
    D] (the target's KVCache under the decode layer scan) and the kernel reads layer ``layer``'s
    blocks in place (the index is prefetched with the ranges), so a scanned layer never copies its
    slice of the cache out.

The kernel runs a grid (batch, kv head, query block, kv step) with the per-(sequence, query
block) range of kv blocks prefetched into scalar memory: step s reads block ``first + s`` and
steps past the last needed block neither compute nor copy (their block index repeats, so the
pipeline issues no DMA). Query rows are the (token, group) pairs of one kv head, so GQA reads
each cache block once for all its query heads. Softmax is online in float32.

Slots outside every query's range never reach the output, NaN included (values there are
zeroed before the probability-weighted sum); slots inside the span ``[min lo, max hi]`` of a
query block must be finite. A query with an empty range gets a zero output.

With ``return_lse`` the kernel also returns each query head's log-sum-exp of its scaled logits
over its range (float32 [B, T, Hq], -inf for an empty range), so that attention over a part of
the keys merges exactly with attention over the rest (:func:`merge_attention`): a token-tree
verify attends to the committed cache here and to its own tree rows beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.kernels.tpu.splash import KernelShapeError, round_up

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128


def position_ranges(positions, window: int | None = None):
    """A target step's visible slots (``layers.causal_mask`` over slots == positions): int
    [B, T] positions -> (lo, hi) with ``hi = pos`` and ``lo = max(pos - window + 1, 0)``."""
    hi = jnp.asarray(positions, jnp.int32)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(hi - (window - 1), 0)
    return lo, hi


def _kv_block(S: int, target: int, itemsize: int) -> int:
    sub = 8 * (4 // itemsize)  # sublane tile: 8 rows of f32, 16 of bf16
    for b in (target, 512, 256, 128):
        if b <= S and S % b == 0 and b % sub == 0:
            return b
    if S <= 1024 and S % sub == 0:
        return S
    raise KernelShapeError(f"cache length {S} has no kv block (a multiple of {sub} dividing it, <= {target}); "
                           f"allocate the cache with max_len a multiple of 128")


def _kernel(first_ref, last_ref, smin_ref, smax_ref, q_ref, k_ref, v_ref, lo_ref, hi_ref, o_ref, *refs,
            scale: float, bk: int, nq: int, with_lse: bool):
    lse_ref, (m_ref, l_ref, acc_ref) = (refs[0], refs[1:]) if with_lse else (None, refs)
    b, i, s = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    idx = b * nq + i
    blk = first_ref[idx] + s

    @pl.when(s == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(blk <= last_ref[idx])
    def _step():
        q = q_ref[...]
        k = k_ref[...].astype(q.dtype)
        bq = q.shape[0]
        logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        slot = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        ok = (slot >= lo_ref[...]) & (slot <= hi_ref[...])
        logits = jnp.where(ok, logits, MASK_VALUE)
        m_prev = m_ref[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(logits, axis=-1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(ok, jnp.exp(logits - m_new), 0.0)
        col = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        used = (col >= smin_ref[idx]) & (col <= smax_ref[idx])
        v = jnp.where(used, v_ref[...].astype(jnp.float32), 0.0).astype(q.dtype)  # NaN in unused slots stays out
        pv = jax.lax.dot_general(p.astype(q.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        l_new = alpha * l_ref[...][:, :1] + jnp.sum(p, axis=-1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + pv
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)

    @pl.when(s == pl.num_programs(3) - 1)
    def _done():
        l = l_ref[...][:, :1]
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)
        if with_lse:  # m + log(l) in every lane; -inf where nothing was visible
            lf = l_ref[...]
            lse_ref[...] = jnp.where(lf > 0, m_ref[...] + jnp.log(jnp.where(lf > 0, lf, 1.0)), -jnp.inf)


def _drop_first(kernel, _layer_ref, *refs):
    return kernel(*refs)


def _cost(B: int, Hkv: int, Rp: int, nq: int, S: int, D: int, q_size: int, kv_size: int,
          with_lse: bool = False) -> pl.CostEstimate:
    """What XLA's cost analysis charges the call (it sees no flops or bytes in a Mosaic kernel
    otherwise): the upper bound of every query row against every slot, and the whole cache read
    once per (row block, kv head) pair, K and V; the kernel reads only the blocks of each row's range."""
    rows = B * Hkv * Rp
    return pl.CostEstimate(flops=4 * rows * S * D, transcendentals=rows * S,
                           bytes_accessed=2 * rows * D * q_size + 2 * B * Hkv * nq * S * D * kv_size + 2 * rows * 4
                           + (rows * LANES * 4 if with_lse else 0))


def _check_shapes(q, k, v, lo, hi, seq_major: bool, stacked: bool = False):
    """(B, T, Hq, D, Hkv, S) of a decode-attention call, or a :class:`KernelShapeError` naming what
    does not fit."""
    if stacked:
        if seq_major or k.ndim != 5 or k.shape != v.shape:
            raise KernelShapeError(f"with a layer index the cache is stacked heads-major [L, B, Hkv, S, D], got "
                                   f"{k.shape}, {v.shape}{' (seq_major)' if seq_major else ''}")
        k, v = k[0], v[0]
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise KernelShapeError(f"expected q [B, T, Hq, D] and a cache k = v of rank 4, got {q.shape}, {k.shape}, "
                               f"{v.shape}")
    B, T, Hq, D = q.shape
    Hkv, S = (k.shape[2], k.shape[1]) if seq_major else (k.shape[1], k.shape[2])
    if k.shape[0] != B or k.shape[3] != D or Hq % Hkv:
        raise KernelShapeError(f"cache {k.shape} ({'seq' if seq_major else 'heads'}-major) does not fit q {q.shape}")
    if seq_major and Hkv > 1 and D % LANES:
        raise KernelShapeError(f"a seq-major cache is read one head at a time along its last axis, which needs "
                               f"head_dim a multiple of {LANES}; got {D}")
    if jnp.shape(lo) != (B, T) or jnp.shape(hi) != (B, T):
        raise KernelShapeError(f"lo/hi must be int [B, T] = {(B, T)}, got {jnp.shape(lo)} / {jnp.shape(hi)}")
    return B, T, Hq, D, Hkv, S


def decode_attention(q, k, v, lo, hi, *, scale: float | None = None, seq_major: bool = False,
                     block_q: int = 256, block_kv: int = 512, interpret: bool = False, return_lse: bool = False,
                     layer=None):
    """Attention of q against the cache slots ``[lo, hi]`` of each query (module docstring);
    with ``return_lse`` also the log-sum-exp of each query head's logits, float32 [B, T, Hq];
    with ``layer``, of layer ``layer`` of a stacked cache [L, B, Hkv, S, D]."""
    stacked = layer is not None
    B, T, Hq, D, Hkv, S = _check_shapes(q, k, v, lo, hi, seq_major, stacked)
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    bk = _kv_block(S, block_kv, jnp.dtype(k.dtype).itemsize)
    nk = S // bk

    R = T * G  # query rows per kv head, ordered (token, group)
    sub = 8 * (4 // jnp.dtype(q.dtype).itemsize)
    bq = min(round_up(block_q, sub), round_up(R, sub))
    Rp = round_up(R, bq)
    nq = Rp // bq
    qh = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, R, D)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    lo = jnp.clip(jnp.asarray(lo, jnp.int32), 0, S)
    hi = jnp.clip(jnp.asarray(hi, jnp.int32), -1, S - 1)
    hi = jnp.where(hi < lo, -1, hi)  # empty range
    # padding rows get an empty range [S, -1], which widens no block's span
    lo_r = jnp.pad(jnp.repeat(lo, G, axis=1), ((0, 0), (0, Rp - R)), constant_values=S)[..., None]
    hi_r = jnp.pad(jnp.repeat(hi, G, axis=1), ((0, 0), (0, Rp - R)), constant_values=-1)[..., None]
    smin = jnp.min(lo_r.reshape(B, nq, bq), axis=-1).reshape(-1)
    smax = jnp.max(hi_r.reshape(B, nq, bq), axis=-1).reshape(-1)
    first = jnp.clip(smin // bk, 0, nk - 1)
    last = jnp.where(smax >= smin, smax // bk, first - 1)  # last < first: nothing to read

    def kv_map(b, h, i, s, *refs):
        first, last = refs[-4:-2]
        blk = jnp.minimum(first[b * nq + i] + s, jnp.maximum(last[b * nq + i], first[b * nq + i]))
        if stacked:
            return refs[0][0], b, h, blk, 0
        return (b, blk, h) if seq_major else (b, h, blk, 0)

    if stacked:
        kk, vv = k, v
        kv_spec = pl.BlockSpec((None, None, None, bk, D), kv_map)
    elif seq_major:
        kk, vv = k.reshape(B, S, Hkv * D), v.reshape(B, S, Hkv * D)
        kv_spec = pl.BlockSpec((None, bk, D), kv_map)
    else:
        kk, vv = k, v
        kv_spec = pl.BlockSpec((None, None, bk, D), kv_map)
    row_map = lambda b, h, i, s, *_: (b, h, i, 0)
    rng_map = lambda b, h, i, s, *_: (b, i, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5 if stacked else 4, grid=(B, Hkv, nq, nk),
        in_specs=[pl.BlockSpec((None, None, bq, D), row_map), kv_spec, kv_spec,
                  pl.BlockSpec((None, bq, 1), rng_map), pl.BlockSpec((None, bq, 1), rng_map)],
        out_specs=[pl.BlockSpec((None, None, bq, D), row_map)]
        + ([pl.BlockSpec((None, None, bq, LANES), row_map)] if return_lse else []),
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, D), jnp.float32)])
    kernel = functools.partial(_kernel, scale=scale, bk=bk, nq=nq, with_lse=return_lse)
    prefetch = (first.astype(jnp.int32), last.astype(jnp.int32), smin, smax)
    if stacked:  # the layer index rides along as the first scalar; the kernel body does not read it
        kernel = functools.partial(_drop_first, kernel)
        prefetch = (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),) + prefetch
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, Rp, D), q.dtype)]
        + ([jax.ShapeDtypeStruct((B, Hkv, Rp, LANES), jnp.float32)] if return_lse else []),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(B, Hkv, Rp, nq, S, D, jnp.dtype(q.dtype).itemsize, jnp.dtype(k.dtype).itemsize,
                            return_lse),
        interpret=interpret,
    )(*prefetch, qh, kk, vv, lo_r, hi_r)
    out = outs[0][:, :, :R].reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    if not return_lse:
        return out
    lse = outs[1][:, :, :R, 0].reshape(B, Hkv, T, G).transpose(0, 2, 1, 3)
    return out, lse.reshape(B, T, Hq)


def merge_attention(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets from each set's output [B, T, Hq, D] and
    log-sum-exp [B, T, Hq] (float32; -inf for an empty set, whose output is ignored): the
    softmax-weighted mix ``(o_a e^lse_a + o_b e^lse_b) / (e^lse_a + e^lse_b)``, in o_a's dtype."""
    lse = jnp.logaddexp(lse_a, lse_b)
    wa = jnp.where(jnp.isneginf(lse_a), 0.0, jnp.exp(lse_a - lse))[..., None]
    wb = jnp.where(jnp.isneginf(lse_b), 0.0, jnp.exp(lse_b - lse))[..., None]
    return (o_a.astype(jnp.float32) * wa + o_b.astype(jnp.float32) * wb).astype(o_a.dtype)
