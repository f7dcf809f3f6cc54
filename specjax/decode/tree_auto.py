"""Choosing a token tree from measurements (``specjax bench --tree auto``).

1. **Calibrate** (:func:`calibration_tree`, :func:`rank_acceptance`): decode some prompts with a
   *spine* tree -- a chain of rank-0 nodes of depth ``D`` whose every spine node also has its
   draft's rank ``1..W-1`` candidates as children. The tree loop counts the rounds in which each
   node was accepted (``SpecResult.node_hits``). The spine node at depth ``d - 1`` is reached in
   ``R_d`` rounds; its rank-``r`` child was accepted in ``H_dr`` of them, so
   ``p[d, r] = H_dr / R_d``: the probability that the draft's rank-``r`` token is the one the target
   takes at depth ``d``, given the path so far was accepted (greedy: at most one sibling matches;
   sampled: the multi-candidate rule tries siblings in rank order, so ``p`` is that rule's).
2. **Predict** (:func:`best_tree`): assuming ``p`` depends on depth and rank only (Sequoia's
   position-acceptance model), the path to a node with ranks ``r_1..r_d`` is accepted with
   probability ``prod_i p[i, r_i]``, and a tree's expected tokens per round is
   ``1 + sum over nodes of that product``. The best tree of ``n`` nodes takes the ``n`` nodes of
   largest path probability, grown best first from the root (children after their parent,
   siblings in rank order, so every prefix is a valid ``speculative_token_tree``).
3. **Cost** (:func:`measure_tree_costs`): for each candidate, the target's tree verify over
   ``n + 1`` rows and the draft's tree proposal, timed on the device at the loop's shapes as
   :func:`specjax.decode.costs.measure_costs` times the chain's round.
4. **Pick** (:func:`choose_tree`): the candidate maximising the predicted speedup over target-only
   decoding, ``tau_tree * t_step / (t_draft(tree) + t_verify(n + 1))``.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from specjax.decode.costs import (
    best_interleaved, cycled, per_round, probe_setup, probe_step, probe_verify, round_ms, target_split,
)
from specjax.decode.generate import pin_cache
from specjax.decode.tree import TokenTree
from specjax.decode.tree_draft import DynamicTreeSpec, propose_tree
from specjax.models.target import KVCache

# node counts tried by ``--tree auto`` (those the calibrated table can fill)
CANDIDATE_NODES = (2, 3, 4, 6, 8, 12, 16)


def calibration_tree(depth: int, width: int) -> TokenTree:
    """The spine tree: rank-0 chain of ``depth`` nodes, each spine node (and the root) with
    children of ranks ``0..width-1``; ``depth * width`` nodes."""
    if depth < 1 or width < 1:
        raise ValueError(f"a calibration tree needs depth >= 1 and width >= 1, got {depth}, {width}")
    return TokenTree.from_paths([(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(width)])


def rank_acceptance(tree: TokenTree, node_hits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``p`` f64 [D, W] (``p[d - 1, r]``: module docstring) and the rounds ``reached`` int [D]
    behind each row, from a spine tree's per-node accept counts (int [n, N+1] or [N+1])."""
    hits = np.asarray(node_hits).reshape(-1, tree.num_nodes + 1).sum(0)
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    D = tree.max_depth
    W = max(p[-1] for p in tree.paths) + 1
    p = np.zeros((D, W))
    reached = np.zeros((D,), np.int64)
    for d in range(1, D + 1):
        spine = index.get((0,) * (d - 1), 0) if d > 1 else 0
        if d > 1 and (0,) * (d - 1) not in index:
            raise ValueError(f"tree {tree.paths} is not a spine tree (no node {(0,) * (d - 1)})")
        reached[d - 1] = hits[spine]
        for r in range(W):
            node = index.get((0,) * (d - 1) + (r,))
            if node is None:
                raise ValueError(f"tree {tree.paths} is not a spine tree (no node {(0,) * (d - 1) + (r,)})")
            p[d - 1, r] = hits[node] / reached[d - 1] if reached[d - 1] else 0.0
    return p, reached


def best_tree(p: np.ndarray, num_nodes: int) -> tuple[TokenTree, float]:
    """The ``num_nodes`` nodes of largest path acceptance probability under ``p`` [D, W] (module
    docstring), grown best first; returns (the tree, its expected tokens per round, tau)."""
    p = np.asarray(p, np.float64)
    D, W = p.shape
    if num_nodes < 1:
        raise ValueError(f"a tree needs num_nodes >= 1, got {num_nodes}")
    heap = [(-p[0, 0], (0,))]  # candidates: a parent's first child, or the next sibling of a taken node
    taken: list[tuple[tuple[int, ...], float]] = []
    value = {(): 1.0}
    while heap and len(taken) < num_nodes:
        neg, path = heapq.heappop(heap)
        v = -neg
        value[path] = v
        taken.append((path, v))
        d, r = len(path), path[-1]
        if r + 1 < W:  # next sibling
            sib = path[:-1] + (r + 1,)
            heapq.heappush(heap, (-value[path[:-1]] * p[d - 1, r + 1], sib))
        if d < D:  # first child
            heapq.heappush(heap, (-v * p[d, 0], path + (0,)))
    if len(taken) < num_nodes:
        raise ValueError(f"a {D}x{W} acceptance table holds fewer than {num_nodes} nodes")
    return TokenTree.from_paths([t for t, _ in taken]), 1.0 + float(sum(v for _, v in taken))


def expected_tau(tree: TokenTree, p: np.ndarray) -> float:
    """A static tree's expected tokens per round under ``p`` [D, W] (module docstring): 1 + the
    sum over its nodes of their path acceptance probability (0 past the table)."""
    p = np.asarray(p, np.float64)
    D, W = p.shape
    total = 1.0
    for path in tree.paths:
        v = 1.0
        for d, r in enumerate(path):
            v *= p[d, r] if d < D and r < W else 0.0
        total += v
    return total


@dataclass
class TreeCost:
    verify_ms: float  # the target's tree verify over N + 1 rows
    draft_ms: float  # the draft's tree proposal (ingest the accepted rows, draft every node)


def measure_tree_costs(target, draft, trees: Sequence, *, batch: int, prompt_len: int, max_new_tokens: int,
                       iters: int = 5, split=None, mesh=None, compute: str = "float32") -> tuple[float, list[TreeCost]]:
    """One target decode step (ms) and, per tree (:class:`TokenTree` or :class:`DynamicTreeSpec`),
    the verify and draft costs of one round, at the tree loop's shapes (caches half full), timed as
    :func:`specjax.decode.costs.measure_costs` times the chain: ``R`` and ``2R`` rounds in one call,
    the difference per ``R``, best of ``iters`` interleaved. A dynamic tree's verify is timed with
    a chain mask of its size (same rows, same cost). ``mesh``: placed as the sharded tree loop
    places them (batch padded to a multiple of data x fsdp and split, heads over tensor; params as
    in ``split``, default :func:`specjax.decode.speculative.place_pair`). ``compute``: the loops'
    matmul arithmetic (:func:`specjax.decode.generate.generate_ids`)."""
    maxn = max(t.num_nodes for t in trees)
    batch, graphdef, state, put, put_cache, mesh = probe_setup(target, draft, batch=batch, mesh=mesh, split=split,
                                                               compute=compute, rows=batch * (maxn + 1))
    cfg = target.config
    dtype = target.model.embed_tokens.embedding[...].dtype
    fill_host = np.full((batch,), prompt_len + max_new_tokens // 2, np.int32)
    S = prompt_len + max_new_tokens + maxn + 1
    tgraph, tstate = target_split(graphdef, state)
    taps = tuple(draft.tap_ids(cfg.num_hidden_layers))
    fill = put(fill_host)
    cache = put_cache(KVCache.init(cfg, batch, S, dtype, lengths=fill_host))  # each probe donates its own copy

    def verify_call(tree):
        n1 = tree.num_nodes + 1
        mask = tree.mask if isinstance(tree, TokenTree) else np.tril(np.ones((n1, n1), bool))
        ids = put(np.ones((batch, n1), np.int32))
        return cycled(functools.partial(probe_verify, tgraph, mask=put(np.broadcast_to(mask, (batch, n1, n1)))),
                      tstate, ids, cache)

    def draft_call(tree):
        D = tree.max_depth
        aux = tuple(put(np.ones((batch, D + 1, cfg.hidden_size), np.dtype(dtype))) for _ in taps)
        ids = put(np.ones((batch, D + 1), np.int32))
        pos = put(fill_host[:, None] + np.arange(D + 1, dtype=np.int32)[None])
        nv = put(np.full((batch,), D + 1, np.int32))
        slots = prompt_len + max_new_tokens + 2 * (D + 1)
        fn = functools.partial(_probe_tree_draft, graphdef, tree, batch, slots, dtype, mesh)
        return lambda reps: fn(state, aux, ids, pos, nv, fill, reps)

    step = cycled(functools.partial(probe_step, tgraph), tstate, put(np.ones((batch, 1), np.int32)), cache)

    R = 3
    calls = [(step, (R,)), (step, (2 * R,))]
    for t in trees:
        v, dr = verify_call(t), draft_call(t)
        calls += [(v, (R,)), (v, (2 * R,)), (dr, (R,)), (dr, (2 * R,))]
    timed = best_interleaved(calls, iters)

    ms = [1e3 * per_round(timed[i], timed[i + 1], R) for i in range(0, len(timed), 2)]
    return ms[0], [TreeCost(ms[1 + 2 * j], ms[2 + 2 * j]) for j in range(len(trees))]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _probe_tree_draft(graphdef, tree, batch, slots, dtype, mesh, state, aux, ids, pos, nv, fill, reps):
    """``reps`` tree proposals after D+1 accepted rows, each fed a token of the last tree."""
    d = nnx.merge(graphdef, state).draft
    dcache = pin_cache(d.init_cache(batch, slots, dtype, lengths=fill), mesh)
    rows = d.aux_from_taps(aux)

    def body(_, ids):
        drafted, _ = propose_tree(d, dcache, rows, ids, pos, nv, tree)
        return ids.at[:, 0].set(drafted.tokens[:, 1].astype(ids.dtype))
    return jax.lax.fori_loop(0, reps, body, ids)


@dataclass
class Candidate:
    tree: TokenTree
    predicted_tau: float
    cost: TreeCost
    predicted_speedup: float

    def to_json(self) -> dict:
        return {"nodes": self.tree.num_nodes, "depth": self.tree.max_depth, "paths": [list(p) for p in self.tree.paths],
                "predicted_tau": round(self.predicted_tau, 4), "verify_ms": round_ms(self.cost.verify_ms),
                "draft_ms": round_ms(self.cost.draft_ms), "predicted_speedup": round(self.predicted_speedup, 3)}


def candidates(p: np.ndarray, sizes: Sequence[int] = CANDIDATE_NODES) -> list[tuple[TokenTree, float]]:
    """The best tree (and its predicted tau) of each node count in ``sizes`` the table can fill;
    trees that come out equal are listed once."""
    D, W = p.shape
    out, seen = [], set()
    for n in sizes:
        if n > D * W:
            continue
        t, tau = best_tree(p, n)
        if t.paths not in seen:
            seen.add(t.paths)
            out.append((t, tau))
    return out


def monotone(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``ys`` ordered by ``xs`` (pool adjacent violators),
    in the input order: a verify over more rows never costs less, so a timing that says otherwise
    is noise, pooled with its neighbours."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    blocks: list[list[float]] = []  # [mean, weight]
    for i in order:
        blocks.append([float(ys[i]), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    fitted = [m for m, w in blocks for _ in range(int(w))]
    out = [0.0] * len(xs)
    for i, v in zip(order, fitted):
        out[i] = v
    return out


def choose_tree(p: np.ndarray, step_ms: float, costs: Sequence[TreeCost], trees: Sequence[tuple[TokenTree, float]],
                *, margin: float = 0.02) -> tuple[Candidate, list[Candidate]]:
    """Score each (tree, predicted tau) with its cost (verify times made non-decreasing in the node
    count, :func:`monotone`); returns (the pick, all). The pick is the smallest tree predicted
    within ``margin`` (relative) of the best: closer than that is timing noise, and a smaller tree
    costs less where the model is off (the loop's own per-round work grows with the tree)."""
    if not trees:
        raise ValueError(f"no candidate tree fits a {p.shape[0]}x{p.shape[1]} acceptance table")
    verify = monotone([t.num_nodes for t, _ in trees], [c.verify_ms for c in costs])
    costs = [TreeCost(v, c.draft_ms) for v, c in zip(verify, costs)]
    scored = [Candidate(t, tau, c, tau * step_ms / (c.draft_ms + c.verify_ms)) for (t, tau), c in zip(trees, costs)]
    top = max(c.predicted_speedup for c in scored)
    pick = min((c for c in scored if c.predicted_speedup >= (1 - margin) * top), key=lambda c: c.tree.num_nodes)
    return pick, scored


def describe_tree(tree) -> dict:
    """JSON description of a static or dynamic tree."""
    if isinstance(tree, DynamicTreeSpec):
        return {"kind": "dynamic", "topk": tree.topk, "depth": tree.depth, "nodes": tree.num_nodes}
    return {"kind": "static", "nodes": tree.num_nodes, "depth": tree.max_depth,
            "paths": [list(p) for p in tree.paths]}
