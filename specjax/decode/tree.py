"""Token trees for speculative decoding: the static tree type, dynamic (EAGLE-2) selection, and
the tree accept rules. Pure functions over arrays with static shapes.

Node numbering (static and dynamic trees alike): node 0 is the *root*, the last committed token
(its K/V is written by the verify, as in the chain loop); nodes ``1..N`` are drafted tokens in an
order where every parent precedes its children (a static tree: breadth first, siblings by rank).
Shapes: ``B`` sequences, ``N`` drafted nodes, ``D`` the tree's depth, ``C`` the most children of
any node, target vocabulary ``V``.

* ``node_tokens`` int32 [B, N+1]: column 0 the root token, column i node i's token. This row is
  exactly the verify input.
* ``children`` int32 [N+1, C] or [B, N+1, C]: node i's children in rank order, -1 padded.
* ``target_logits`` / ``target_probs`` [B, N+1, V]: row i = the target's next-token distribution
  after the root-to-node-i path (the tree verify's logits).
* ``node_q`` [B, N+1, V] or None: the distribution node i's token was drawn from (processed like
  the target's); None = point masses (deterministic proposals: top-k children, argmax chains).

Accept rules (:func:`accept_tree`):

* greedy: from the root, step to the first child (rank order) whose token is the target argmax
  at the current node; stop when none matches. The correction / bonus is the argmax at the last
  accepted node. Token-identical to target-only greedy decoding.
* sampled: recursive rejection sampling over siblings, the multi-candidate rule of SpecInfer
  (Miao et al. 2024, Algorithm "multi-step speculative sampling") and of Yang et al. 2024
  ("Multi-candidate speculative decoding", the with-replacement case). At the current node with
  target distribution ``p``, try its children in rank order; child ``x`` drawn from ``q_x``:
  accept with probability ``min(1, p(x) / q_x(x))``, else ``p <- normalise(max(p - q_x, 0))`` and
  try the next sibling. If every child is rejected, the correction is drawn from the residual
  ``p``; after the last accepted leaf the bonus is drawn from its ``p``. By induction over the
  siblings (one rejection step maps ``p`` to ``min(p, q) + max(p - q, 0) = p``), the emitted token
  follows ``p`` exactly *when each sibling's token is an independent draw from a distribution
  fixed before the target is consulted*: i.i.d. samples from the parent's draft distribution
  (``node_q`` rows equal to the parent's ``q``, duplicates allowed), or deterministic distinct
  tokens with point masses (then: accept ``x`` with probability ``p(x)``, else zero ``p(x)`` and
  renormalise). Sampling siblings *without* replacement is not covered by this rule (the second
  draw's distribution depends on the first): use point masses for top-k children.

Dynamic trees (:func:`dynamic_tree`): EAGLE-2's expand-then-rerank. Depth 1: the root's top-k
children. Each further level: the ``topk`` best candidates of the previous level (by cumulative
draft log-probability) expand their own top-k children. Finally the best ``num_nodes`` of all
candidates by cumulative log-prob form the tree (:func:`select_tree`). A child's cumulative
log-prob never exceeds its parent's and has a larger candidate index; ties go to the lower index,
so the selection is always ancestor-closed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.accept import residual
from specjax.decode.sampling import SamplingParams, process_logits
from specjax.kernels import ops as native_ops
from specjax.models.layers import first_argmax, write_cache


class TreeSpecError(ValueError):
    """A token-tree path list that is malformed (syntax, types, missing parents, rank gaps)."""


# ----------------------------------------------------------------------------- static trees


def _as_paths(spec) -> list[tuple[int, ...]]:
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec.strip())
        except (ValueError, SyntaxError) as e:
            raise TreeSpecError(f"token tree {spec!r} is not a Python literal list of tuples: {e}") from None
    if not isinstance(spec, (list, tuple)) or not spec:
        raise TreeSpecError(f"token tree must be a non-empty list of paths such as [(0,), (1,), (0, 0)], got {spec!r}")
    out = []
    for p in spec:
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(r, int) and not isinstance(r, bool)
                                                                 and r >= 0 for r in p):
            raise TreeSpecError(f"token tree path {p!r}: expected a non-empty tuple of ranks >= 0 such as (0, 1)")
        out.append(tuple(int(r) for r in p))
    return out


def _validate(paths: list[tuple[int, ...]]) -> None:
    seen = set()
    for p in paths:
        if p in seen:
            raise TreeSpecError(f"token tree path {p} appears twice")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeSpecError(f"token tree path {p}: its parent {p[:-1]} is not in the tree")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise TreeSpecError(f"token tree path {p}: rank {p[-1]} but sibling {p[:-1] + (p[-1] - 1,)} is missing "
                                "(ranks under one parent must be contiguous from 0)")


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A static token tree (vLLM's ``speculative_token_tree``). Hashable by its paths (a static
    jit argument). Arrays (numpy, node 0 = root, nodes 1..N in breadth-first, rank order):

    parent int32 [N+1] (root -1); depth int32 [N+1] (root 0; the position offset of a node);
    rank int32 [N+1]; mask bool [N+1, N+1] (``mask[i, j]``: j is i or an ancestor of i, the tree
    attention mask); children int32 [N+1, C] (-1 padded); levels: tuple of int32 arrays, the
    nodes at depth 0..D; path_nodes int32 [N+1, D+1] (root-to-node nodes, -1 padded)."""

    paths: tuple[tuple[int, ...], ...]
    parent: np.ndarray = field(repr=False)
    depth: np.ndarray = field(repr=False)
    rank: np.ndarray = field(repr=False)
    mask: np.ndarray = field(repr=False)
    children: np.ndarray = field(repr=False)
    levels: tuple = field(repr=False)
    path_nodes: np.ndarray = field(repr=False)

    def __hash__(self):
        return hash(self.paths)

    def __eq__(self, other):
        return isinstance(other, TokenTree) and other.paths == self.paths

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return len(self.levels) - 1

    @classmethod
    def from_paths(cls, spec) -> "TokenTree":
        """From a path list (or its string, parsed with ``ast.literal_eval``). Raises TreeSpecError."""
        paths = _as_paths(spec)
        _validate(paths)
        paths = sorted(paths, key=lambda p: (len(p), p))
        index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
        n1 = len(paths) + 1
        parent = np.array([-1] + [index[p[:-1]] for p in paths], np.int32)
        depth = np.array([0] + [len(p) for p in paths], np.int32)
        rank = np.array([0] + [p[-1] for p in paths], np.int32)
        D = int(depth.max())
        path_nodes = np.full((n1, D + 1), -1, np.int32)
        for p, i in index.items():
            path_nodes[i, : len(p) + 1] = [index[p[:j]] for j in range(len(p) + 1)]
        mask = np.zeros((n1, n1), bool)
        for i in range(n1):
            mask[i, path_nodes[i][path_nodes[i] >= 0]] = True
        C = max(int((parent == i).sum()) for i in range(n1))
        children = np.full((n1, C), -1, np.int32)
        for i in range(n1):
            kids = np.nonzero(parent == i)[0]
            children[i, : len(kids)] = kids
        levels = tuple(np.nonzero(depth == d)[0].astype(np.int32) for d in range(D + 1))
        return cls(tuple(paths), parent, depth, rank, mask, children, levels, path_nodes)

    @classmethod
    def chain(cls, k: int) -> "TokenTree":
        """The chain of k drafted tokens as a tree: [(0,), (0, 0), ...]."""
        if k < 1:
            raise TreeSpecError(f"a chain tree needs k >= 1, got {k}")
        return cls.from_paths([(0,) * d for d in range(1, k + 1)])


def parse_tree(spec) -> TokenTree:
    """``TokenTree.from_paths``: ``"[(0,), (1,), (0, 0)]"`` or the list itself."""
    return spec if isinstance(spec, TokenTree) else TokenTree.from_paths(spec)


# ----------------------------------------------------------------------------- dynamic trees


class DynamicTree(NamedTuple):
    """A per-sequence tree of n drafted nodes (node 0 = root), parents before children."""

    tokens: jax.Array  # int32 [B, n]: node 1..n tokens (target or draft ids, as given)
    parent: jax.Array  # int32 [B, n+1]: parent node, root -1
    depth: jax.Array  # int32 [B, n+1]: position offset, root 0
    mask: jax.Array  # bool [B, n+1, n+1]: ancestor-or-self (tree attention)
    children: jax.Array  # int32 [B, n+1, C]: children in index order, -1 padded
    index: jax.Array  # int32 [B, n]: the candidate each node came from
    score: jax.Array  # f32 [B, n]: cumulative draft log-prob of each node


def _rows(a, idx):
    """a [B, M, ...], idx int [B] or [B, K] -> a[b, idx[b]] ([B, ...] or [B, K, ...])."""
    b = jnp.arange(a.shape[0])
    return a[b, idx] if idx.ndim == 1 else a[b[:, None], idx]


def ancestor_mask(parent, max_depth: int):
    """parent int32 [B, n+1] (root -1, parents before children) -> bool [B, n+1, n+1] ancestor-or-self."""
    n1 = parent.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n1, dtype=bool), (*parent.shape, n1))
    anc = eye
    for _ in range(max_depth):  # each pass adds one more generation of ancestors
        up = _rows(anc, jnp.maximum(parent, 0)) & (parent >= 0)[..., None]
        anc = eye | up
    return anc


def children_table(parent, max_children: int):
    """parent int32 [B, n+1] -> children int32 [B, n+1, C] in index order, -1 padded."""
    n1 = parent.shape[-1]
    is_child = parent[:, None, :] == jnp.arange(n1, dtype=parent.dtype)[None, :, None]  # [B, i, j]
    order = jnp.argsort(~is_child, axis=-1, stable=True)[..., :max_children].astype(jnp.int32)
    valid = jnp.take_along_axis(is_child, order, axis=-1)
    return jnp.where(valid, order, -1)


def select_tree(score, token, parent, depth, num_nodes: int, max_children: int) -> DynamicTree:
    """The best ``num_nodes`` candidates by cumulative log-prob, as a tree.

    score f32 [B, M]; token int32 [B, M]; parent int32 [B, M] (candidate index, -1 = child of the
    root; a parent's index is below its children's); depth int [M] (numpy, 1-based). Ties go to the
    lower index (``lax.top_k``), so a node's parent (score >= the node's, lower index) is selected
    whenever the node is: the result is ancestor-closed. Nodes are renumbered 1..n in candidate
    order, which keeps parents before children."""
    B, M = score.shape
    if not 1 <= num_nodes <= M:
        raise ValueError(f"num_nodes must be in 1..{M} (the candidates), got {num_nodes}")
    _, sel = jax.lax.top_k(score, num_nodes)
    sel = jnp.sort(sel, axis=-1).astype(jnp.int32)  # [B, n]
    inv = jnp.zeros((B, M), jnp.int32).at[jnp.arange(B)[:, None], sel].set(jnp.arange(1, num_nodes + 1))
    pc = jnp.take_along_axis(parent, sel, axis=-1)
    pnode = jnp.where(pc < 0, 0, jnp.take_along_axis(inv, jnp.maximum(pc, 0), axis=-1))
    par = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), pnode.astype(jnp.int32)], axis=1)
    dep = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.asarray(depth, jnp.int32)[sel]], axis=1)
    D = int(np.max(depth))
    return DynamicTree(jnp.take_along_axis(token, sel, axis=-1), par, dep, ancestor_mask(par, D),
                       children_table(par, max_children), sel, jnp.take_along_axis(score, sel, axis=-1))


def top_children(logp, score, topk: int):
    """logp f32 [B, F, V] (the draft's log-probs after each of F nodes), score f32 [B, F] (their
    cumulative log-probs) -> (child cumulative scores f32 [B, F*topk], child tokens int32 [B, F*topk]),
    children of node f at ``f*topk .. f*topk+topk-1`` in descending draft probability."""
    lp, tok = jax.lax.top_k(jnp.minimum(logp.astype(jnp.float32), 0.0), topk)  # clamp: a child never beats its parent
    B, F = score.shape
    return (score[..., None] + lp).reshape(B, F * topk), tok.reshape(B, F * topk).astype(jnp.int32)


def dynamic_tree(root_logp, expand: Callable, *, topk: int, depth: int, num_nodes: int) -> DynamicTree:
    """EAGLE-2's dynamic tree. root_logp f32 [B, V]: the draft's log-probs after the root.
    ``expand(level, paths int32 [B, topk, level], frontier int32 [B, topk]) -> logp f32 [B, topk, V]``:
    the draft's log-probs after each frontier candidate, given its root-to-node tokens (the last
    column is its own) and its index among its level's candidates (level 1: the root's top-k;
    further levels: ``topk`` children per previous frontier node, so ``frontier // topk`` is the
    parent's index in the previous frontier).
    Candidates: topk at depth 1, topk*topk per further depth (``M`` in all)."""
    if topk < 1 or depth < 1:
        raise ValueError(f"dynamic tree needs topk >= 1 and depth >= 1, got topk={topk} depth={depth}")
    B = root_logp.shape[0]
    s, t = top_children(root_logp[:, None], jnp.zeros((B, 1), jnp.float32), topk)
    scores, tokens, parents = [s], [t], [jnp.full((B, topk), -1, jnp.int32)]
    depths, paths = [np.ones(topk, np.int32)], t[..., None]  # paths: [B, level candidates, level]
    base = 0  # candidate index of the current level's first entry
    for lvl in range(1, depth):
        _, f = jax.lax.top_k(scores[-1], topk)  # frontier within the level
        front = (base + f).astype(jnp.int32)
        fpaths, fscore = jnp.take_along_axis(paths, f[..., None], 1), jnp.take_along_axis(scores[-1], f, -1)
        s, t = top_children(expand(lvl, fpaths, f), fscore, topk)
        paths = jnp.concatenate([jnp.repeat(fpaths, topk, axis=1), t[..., None]], axis=-1)
        base += scores[-1].shape[1]
        scores.append(s), tokens.append(t), parents.append(jnp.repeat(front, topk, axis=1))
        depths.append(np.full(topk * topk, lvl + 1, np.int32))
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    return select_tree(cat(scores), cat(tokens), cat(parents), np.concatenate(depths), num_nodes, topk)


# ----------------------------------------------------------------------------- accept


class TreeAcceptResult(NamedTuple):
    num_accepted: jax.Array  # int32 [B]: drafted nodes accepted, 0..D
    path: jax.Array  # int32 [B, D+1]: root (0), then the accepted nodes; -1 after num_accepted
    tokens: jax.Array  # int32 [B, D+1]: accepted tokens, then the correction / bonus from index n on


def _children(children, B: int):
    c = jnp.asarray(children, jnp.int32)
    return jnp.broadcast_to(c, (B, *c.shape)) if c.ndim == 2 else c


def _finish(node_tokens, path, n, nxt) -> TreeAcceptResult:
    D1 = path.shape[1]
    tok = _rows(node_tokens, jnp.maximum(path[:, 1:], 0))  # [B, D]
    tok = jnp.concatenate([tok, nxt[:, None]], axis=1)
    tok = jnp.where(jnp.arange(D1)[None] < n[:, None], tok, nxt[:, None]).astype(jnp.int32)
    return TreeAcceptResult(n.astype(jnp.int32), path.astype(jnp.int32), tok)


def accept_tree_greedy(target_logits, node_tokens, children, max_depth: int) -> TreeAcceptResult:
    """Longest root path whose every token is the target argmax at its parent (first sibling on
    duplicates), then the argmax at its end. Shapes as in the module docstring."""
    B = node_tokens.shape[0]
    ch = _children(children, B)
    best = first_argmax(target_logits.astype(jnp.float32))  # [B, N+1]
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    path = [cur]
    for _ in range(max_depth):
        kids = _rows(ch, cur)  # [B, C]
        match = (kids >= 0) & (_rows(node_tokens, jnp.maximum(kids, 0)) == _rows(best, cur)[:, None])
        hit = alive & match.any(-1)
        nxt = jnp.take_along_axis(kids, first_argmax(match.astype(jnp.int32))[:, None], axis=1)[:, 0]
        cur = jnp.where(hit, nxt, cur)
        alive = hit
        path.append(jnp.where(hit, nxt, -1))
    path = jnp.stack(path, axis=1)
    n = (path[:, 1:] >= 0).sum(-1)
    return _finish(node_tokens, path, n, _rows(best, cur))


def _try_siblings(keys, p, kids, node_tokens, node_q, alive):
    """Recursive rejection over one node's children. p f32 [B, V]; kids int32 [B, C].
    Returns (accepted child or -1 [B], residual p [B, V])."""
    B, V = p.shape
    b = jnp.arange(B)
    got = jnp.full((B,), -1, jnp.int32)
    for j in range(kids.shape[1]):  # static C
        c = kids[:, j]
        live = alive & (c >= 0) & (got < 0)
        x = node_tokens[b, jnp.maximum(c, 0)]
        q = jax.nn.one_hot(x, V, dtype=jnp.float32) if node_q is None else node_q[b, jnp.maximum(c, 0)]
        u = jax.random.uniform(keys[j], (B,), jnp.float32)
        ok = live & (u * q[b, x] < p[b, x])  # u < min(1, p/q); p(x) == 0 never accepts
        got = jnp.where(ok, c, got)
        p = jnp.where((live & ~ok)[:, None], residual(p, q), p)
    return got, p


def accept_tree_sampled(key, target_probs, node_tokens, children, max_depth: int, node_q=None) -> TreeAcceptResult:
    """Lossless multi-candidate rejection sampling down the tree (module docstring). target_probs
    f32 [B, N+1, V] processed; node_q f32 [B, N+1, V] or None (point masses)."""
    B = node_tokens.shape[0]
    ch = _children(children, B)
    p_all = target_probs.astype(jnp.float32)
    q_all = None if node_q is None else node_q.astype(jnp.float32)
    C = ch.shape[-1]
    keys = jax.random.split(key, max_depth * C + 1)
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    final = _rows(p_all, cur)
    path = [cur]
    for d in range(max_depth):
        got, resid = _try_siblings(keys[d * C:(d + 1) * C], _rows(p_all, cur), _rows(ch, cur), node_tokens, q_all,
                                   alive)
        hit = got >= 0
        final = jnp.where((alive & ~hit)[:, None], resid, final)  # stopped here: the residual
        cur = jnp.where(hit, got, cur)
        alive = hit
        path.append(got)
    final = jnp.where(alive[:, None], _rows(p_all, cur), final)  # accepted down to a leaf: bonus
    nxt = jax.random.categorical(keys[-1], jnp.log(final), axis=-1).astype(jnp.int32)
    path = jnp.stack(path, axis=1)
    return _finish(node_tokens, path, (path[:, 1:] >= 0).sum(-1), nxt)


def accept_tree(key, target_logits, node_tokens, children, max_depth: int, node_q,
                sampling: SamplingParams) -> TreeAcceptResult:
    """Greedy rule at temperature 0, else lossless rejection sampling on the processed target."""
    if sampling.greedy:
        return accept_tree_greedy(target_logits, node_tokens, children, max_depth)
    p = jax.nn.softmax(process_logits(target_logits, sampling), axis=-1)
    return accept_tree_sampled(key, p, node_tokens, children, max_depth, node_q)


# ----------------------------------------------------------------------------- cache compaction


def compact_cache(cache, base, path, num_accepted, *, native: bool | None = None):
    """Keep the accepted path of a tree verify as consecutive cache rows.

    ``cache``: a target :class:`~specjax.models.target.KVCache` (k / v: layers x [B, Hkv, S, D], or
    stacked [L, B, Hkv, S, D], moved layer by layer in a loop) after a tree verify wrote node i at slot ``base + i``; base int32 [B]: the committed length
    before the verify; path int32 [B, D+1], num_accepted int32 [B]: from the accept rule. Returns
    the cache with slot ``base + j`` holding node ``path[:, j]``'s K/V for j <= n and lengths
    ``base + n + 1`` (root and accepted nodes; slots past that are stale, never read). ``native``
    (default: :func:`specjax.kernels.ops.native_here`, a single-device CPU program with the native
    kernels): a per-layer cache moves on one kernel call (:func:`specjax.kernels.ops.compact_rows`),
    the same bytes as the gathers and scatters."""
    S = cache.max_len
    D1 = path.shape[1]
    src = jnp.minimum(base[:, None] + jnp.maximum(path, 0), S - 1).astype(jnp.int32)  # [B, D+1]
    dst = base[:, None] + jnp.arange(D1, dtype=jnp.int32)[None]

    def move(buf):  # [B, H, S, Dh]
        rows = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)  # [B, H, D+1, Dh]
        return write_cache(buf, dst, jnp.swapaxes(rows, 1, 2))

    lengths = (base + num_accepted + 1).astype(jnp.int32)
    if not cache.stacked and (native_ops.native_here() if native is None else native):
        moved = native_ops.compact_rows(base, path, cache.k + cache.v)
        n = len(cache.k)
        return cache._replace(k=tuple(moved[:n]), v=tuple(moved[n:]), lengths=lengths)
    if cache.stacked:
        # layer by layer in a loop, each layer's rows gathered by index from the stack and written in
        # place (write_cache's ``layer``). Per round at B=8 on v5e-8 (``plan``): one gather and scatter
        # over the whole [L, B, Hkv, S, D] stack (vmapped or indexed at once) rewrote the stack, 1.75
        # against 1.18 GB per-layer for an 8-layer 8B-wide target; a loop slicing each layer out
        # before its gather, 1.25 (Llama-3.1-8B: 3.40 against 2.88 GB); this loop 2.92 GB
        def move_stacked(buf):
            def body(layer, b):
                rows = b[layer, jnp.arange(b.shape[1])[:, None], :, src]  # [B, D+1, Hkv, Dh]
                return write_cache(b, dst, rows, layer=layer)
            return jax.lax.fori_loop(0, buf.shape[0], body, buf)

        return cache._replace(k=move_stacked(cache.k), v=move_stacked(cache.v), lengths=lengths)
    return cache._replace(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v), lengths=lengths)
