"""P-EAGLE's COD (conditional-on-distribution) sampling with JAX randomness and static shapes.

speculators 0.9.0 (``models/peagle/data.py::generate_cod_sample_indices``), for one packed row of
length ``T`` with ``valid = loss_mask == 1``:

* seeds = the valid positions, or a random sorted subset of ``max_anchors`` of them;
* depth 0 = every position ``0..T-1`` (padding included), anchor = position;
* depth ``d = 1..num_depths-1``: ``n_d = int(max(0, |seeds| - d) * max(r^d, r_min))``; stop when
  ``n_d <= 0``; sample ``n_d`` positions of the current pool (all of it when smaller), sorted;
  elements ``(anchor = sampled - d, depth = d)``; the next pool is ``(sampled + 1) mod T`` without 0,
  kept where valid. The first pool is the seeds.

Static shapes: every depth ``d >= 1`` gets a fixed slot budget ``K_d`` = the largest ``n_d`` any
row can need, ``int(max(0, S - d) * max(r^d, r_min))`` with ``S = min(max_anchors, T)`` (``n_d``
grows with ``|seeds| <= S``). Elements are laid out as speculators lays them out, depth 0's ``T``
then ``K_1, K_2, ...`` slots, each depth's real elements first (ascending), then padding. A padding
element is ``(anchor -1, depth 1)`` flagged invalid: under P-EAGLE's attention mask no real
element attends to it (its anchor equals no real anchor and its depth is not 0), its RoPE
position / gather index ``anchor + depth`` is 0 (in range), and the objective zeroes its loss mask,
so the loss, the gradients and every metric are those of the real elements alone.

``n_d`` uses a host table built with Python float arithmetic (as speculators computes it), so the
element counts match speculators' for the same seed count exactly; the random choices themselves
come from the batch rng (``jax.random``), not torch's generator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

PAD_ANCHOR, PAD_DEPTH = -1, 1


def _ratios(num_depths: int, ratio: float, ratio_min: float) -> list[float]:
    return [max(ratio ** d, ratio_min) for d in range(num_depths)]


@functools.lru_cache(maxsize=32)
def cod_budget(T: int, max_anchors: int | None, num_depths: int, ratio: float = 0.7,
               ratio_min: float = 0.2) -> tuple[int, ...]:
    """Static slots per depth: ``(T, K_1, ..., K_{D-1})`` (trailing zero depths dropped)."""
    S = T if max_anchors is None else min(int(max_anchors), T)
    out = [T]
    for d, r in enumerate(_ratios(num_depths, ratio, ratio_min)):
        if d == 0:
            continue
        k = min(int(max(0, S - d) * r), T)
        if k <= 0:
            break
        out.append(k)
    return tuple(out)


def num_elements(T: int, max_anchors: int | None, num_depths: int, ratio: float = 0.7, ratio_min: float = 0.2) -> int:
    return sum(cod_budget(T, max_anchors, num_depths, ratio, ratio_min))


@functools.lru_cache(maxsize=32)
def _size_table(T: int, max_anchors: int | None, num_depths: int, ratio: float, ratio_min: float) -> np.ndarray:
    """``n_d`` before the pool cap for every seed count ``0..S``: int32 [D, S+1] (row 0 unused)."""
    S = T if max_anchors is None else min(int(max_anchors), T)
    tab = np.zeros((max(num_depths, 1), S + 1), np.int32)
    for d, r in enumerate(_ratios(num_depths, ratio, ratio_min)):
        if d:
            tab[d] = [int(max(0, n - d) * r) for n in range(S + 1)]
    return tab


def cod_sample_row(key, loss_mask, *, num_depths: int, max_anchors: int | None, ratio: float = 0.7,
                   ratio_min: float = 0.2):
    """One row: loss_mask [T] -> (anchor_pos int32 [N], depth int32 [N], valid bool [N]),
    ``N = num_elements(T, ...)``."""
    T = loss_mask.shape[-1]
    budget = cod_budget(T, max_anchors, num_depths, ratio, ratio_min)
    table = jnp.asarray(_size_table(T, max_anchors, num_depths, ratio, ratio_min))
    valid = loss_mask == 1
    keys = jax.random.split(key, len(budget))
    pos = jnp.arange(T, dtype=jnp.int32)
    # seeds: all valid positions, or a uniformly random max_anchors of them
    if max_anchors is not None and max_anchors < T:
        score = jnp.where(valid, jax.random.uniform(keys[0], (T,)), -1.0)
        top, idx = jax.lax.top_k(score, int(max_anchors))
        seeds = jnp.zeros((T,), bool).at[idx].set(top >= 0)
    else:
        seeds = valid
    n_seeds = jnp.sum(seeds).astype(jnp.int32)
    anchors, depths, oks = [pos], [jnp.zeros((T,), jnp.int32)], [jnp.ones((T,), bool)]
    pool = seeds
    for d in range(1, len(budget)):
        K = budget[d]
        n = jnp.minimum(table[d, n_seeds], jnp.sum(pool).astype(jnp.int32))
        score = jnp.where(pool, jax.random.uniform(keys[d], (T,)), -1.0)
        _, idx = jax.lax.top_k(score, K)  # the pool's members in random order first
        sampled = jnp.zeros((T,), bool).at[idx].set(jnp.arange(K) < n)
        where = jnp.nonzero(sampled, size=K, fill_value=0)[0].astype(jnp.int32)  # ascending
        ok = jnp.arange(K) < n
        anchors.append(jnp.where(ok, where - d, PAD_ANCHOR))
        depths.append(jnp.where(ok, d, PAD_DEPTH).astype(jnp.int32))
        oks.append(ok)
        # next pool: (sampled + 1) mod T, without position 0, where valid
        pool = jnp.concatenate([jnp.zeros((1,), bool), sampled[:-1]]) & valid
    return jnp.concatenate(anchors), jnp.concatenate(depths), jnp.concatenate(oks)


def cod_sample(key, loss_mask, **kw):
    """loss_mask [B, T] -> (anchor_pos, depth, valid) [B, N]: one independent draw per row."""
    B = loss_mask.shape[0]
    keys = jax.random.split(key, B)
    return jax.vmap(lambda k, m: cod_sample_row(k, m, **kw))(keys, loss_mask)


def pad_elements(anchor_pos, depth, n: int):
    """Explicit elements (e.g. speculators' own draw) padded to ``n`` with invalid elements:
    int [M] -> (anchor_pos [n], depth [n], valid [n])."""
    anchor_pos = np.asarray(anchor_pos, np.int32)
    depth = np.asarray(depth, np.int32)
    m = anchor_pos.shape[0]
    if m > n:
        raise ValueError(f"{m} COD elements do not fit a budget of {n}")
    pa = np.concatenate([anchor_pos, np.full(n - m, PAD_ANCHOR, np.int32)])
    pd = np.concatenate([depth, np.full(n - m, PAD_DEPTH, np.int32)])
    return pa, pd, np.arange(n) < m
