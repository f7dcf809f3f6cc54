"""Drafting a token tree (static or EAGLE-2 dynamic) from any draft, one batched step per depth:
what the tree loop (:mod:`specjax.decode.tree_loop`) calls each round to propose the next tree.

A static tree (:class:`specjax.decode.tree.TokenTree`): node i's children are the draft's top-c
tokens after the root-to-i path. A dynamic tree (:class:`DynamicTreeSpec`): the root's top-k, then
per further depth the top-k frontier nodes (by cumulative draft log-prob) expanded, the best
``num_nodes`` kept. How each draft kind drafts (chain steps from each parent's state, forced chains,
block drafts' natural trees) is told in :mod:`specjax.decode.tree_loop`'s docstring.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.accept import draft_probs
from specjax.decode.sampling import SamplingParams
from specjax.decode.tree import TokenTree, dynamic_tree, parse_tree
from specjax.models.drafts.common import DraftCache, d2t_of, last_rows, last_valid
from specjax.models.drafts.vocab import draft_to_target
from specjax.models.errors import ModelError

class TreeDraftError(ModelError, TypeError):
    """The draft cannot propose a token tree (no teacher-forced chain ``propose``)."""


@dataclass(frozen=True)
class DynamicTreeSpec:
    """An EAGLE-2 dynamic tree (:func:`specjax.decode.tree.dynamic_tree`): ``topk`` children per
    expanded node, ``depth`` levels, the best ``num_nodes`` candidates kept."""

    topk: int
    depth: int
    num_nodes: int

    def __post_init__(self):
        cands = self.topk + (self.depth - 1) * self.topk * self.topk
        if self.topk < 1 or self.depth < 1 or not 1 <= self.num_nodes <= cands:
            raise ValueError(f"dynamic tree: need topk >= 1, depth >= 1 and 1 <= num_nodes <= {cands} "
                             f"(the candidates), got topk={self.topk} depth={self.depth} num_nodes={self.num_nodes}")

    @property
    def max_depth(self) -> int:
        return self.depth


def as_tree(tree) -> TokenTree | DynamicTreeSpec:
    return tree if isinstance(tree, DynamicTreeSpec) else parse_tree(tree)


class Drafted(NamedTuple):
    """A drafted tree per sequence (node 0 = root; its token is set at verify)."""

    tokens: jax.Array  # int32 [B, N+1]: target ids
    depth: jax.Array  # int32 [B, N+1]
    mask: jax.Array  # bool [B, N+1, N+1]: ancestor-or-self
    children: jax.Array  # int32 [B, N+1, C]
    q: jax.Array  # f32 [B, N+1, V]: the distribution each node was drawn from (sampled proposals), else [1]


def check_tree_draft(draft, tree=None) -> None:
    """Refuse a draft that cannot draft ``tree`` (:class:`TreeDraftError`): one with neither a
    ``tree_drafting`` kind nor a teacher-forced ``propose(..., forced=)``, or a block draft asked
    for a tree deeper than its block."""
    name = getattr(draft, "algorithm", type(draft).__name__)
    if getattr(draft, "tree_drafting", None) is None:
        prop = getattr(draft, "propose", None)
        if not callable(prop) or "forced" not in inspect.signature(prop).parameters:
            raise TreeDraftError(f"a {name} draft cannot draft a token tree: it has no tree_drafting kind (chain, "
                                 "parallel, markov) and no teacher-forced propose(..., forced=)", key="tree")
    block = draft.max_proposal() if callable(getattr(draft, "max_proposal", None)) else None
    if tree is not None and block is not None and tree.max_depth > block:
        raise TreeDraftError(f"a {name} draft proposes at most {block} tokens per block; the tree is "
                             f"{tree.max_depth} deep", key="tree")


def propose_tree(draft, dcache, rows, next_tokens, positions, n_valid, tree, *, sample: SamplingParams | None = None,
                 key=None, vocab_size: int = 0, steps: bool | None = None) -> tuple[Drafted, Any]:
    """Draft ``tree`` (static or dynamic) after the committed rows (the arguments of
    ``draft.speculate``). ``sample`` (static trees): children are i.i.d. draws from the draft's
    distribution processed by ``sample`` (over ``vocab_size`` target ids), else the top-c tokens
    (point masses). ``steps``: draft each depth with one chain step per node from its parent's
    state (default for ``extend``/``step`` chain drafts: EAGLE-3, MTP), else re-run a teacher-forced
    chain per node (:func:`forced_logits`; same tokens). Returns the :class:`Drafted` tree and the
    draft cache."""
    mode = _mode(draft, steps)
    if isinstance(tree, DynamicTreeSpec):
        if sample is not None:
            raise ValueError("a dynamic tree takes the draft's top-k children (draft_sampling='greedy'), not samples")
        return _propose_dynamic(draft, dcache, rows, next_tokens, positions, n_valid, tree, mode)
    nodes, q, cache = _propose_static(draft, dcache, rows, next_tokens, positions, n_valid, tree, sample, key,
                                      vocab_size, mode)
    B = nodes.shape[0]
    bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (B, *a.shape))  # noqa: E731
    return Drafted(nodes, bc(tree.depth), bc(tree.mask), bc(tree.children), q), cache


def forced_logits(draft, dcache, rows, next_tokens, pos, n_valid, paths):
    """The draft's logits after F teacher-forced paths per sequence, in one ``propose`` over the
    batch repeated F times. paths int32 [B, F, d] (target ids) -> f32 [B, F, Vd]. The draft's
    inputs (cache, rows, tokens, positions, n_valid: leading batch axis B) are repeated, so the F
    chains run as one batch of B*F rows (one extend and d chain steps, not F of each)."""
    B, F, d = paths.shape
    rep = lambda x: jnp.repeat(x, F, axis=0) if getattr(x, "ndim", 0) and x.shape[0] == B else x  # noqa: E731
    prop = draft.propose(jax.tree_util.tree_map(rep, dcache), jax.tree_util.tree_map(rep, rows), rep(next_tokens),
                         rep(pos), k=d + 1, n_valid=rep(n_valid), forced=paths.reshape(B * F, d) if d else None)
    return prop.logits[:, d].astype(jnp.float32).reshape(B, F, -1)


class _Chains(NamedTuple):
    """F chain states per sequence after teacher-forced steps (leading axis F*B, f-major): the
    draft cache holding each chain's scratch rows, and the hidden state its next step feeds on."""

    cache: Any
    hidden: jax.Array  # [F*B, H]


def _mode(draft, steps: bool | None) -> str:
    """How a tree's depths are drafted: "block" (``tree_drafting`` parallel or markov:
    :class:`_Block`), "steps" (``extend`` once then ``step`` per token: EAGLE-3, MTP; a tree's
    nodes one step per depth from their parent's state, :func:`_step_nodes`; ``steps=False``
    forces the next) or "forced" (a teacher-forced chain per node, :func:`forced_logits`)."""
    kind = getattr(draft, "tree_drafting", None)
    if kind in ("parallel", "markov"):
        return "block"
    return "steps" if (kind == "chain" if steps is None else steps) else "forced"


class _Block:
    """A block draft's logits for a tree's nodes (module docstring): one proposal of the tree's
    depth ``D`` after the committed rows; ``at(d, paths)`` the logits f32 [B, F, Vd] of F nodes at
    depth d (paths int32 [B, F, d]: their root-to-node tokens, target ids)."""

    def __init__(self, draft, dcache, rows, next_tokens, positions, n_valid, D: int):
        self.draft, self.markov = draft, draft.tree_drafting == "markov"
        if hasattr(draft, "extend_anchor"):  # DFlash, DSpark: extend once, propose from the anchor
            self.ctx = draft.extend_anchor(dcache, rows, next_tokens, positions, n_valid=n_valid)
            prop = draft.propose(*self.ctx, k=D)
        else:  # P-EAGLE: the mask rows are scratch past the committed ones
            prop = draft.speculate(dcache, rows, next_tokens, positions, n_valid=n_valid, k=D)
        self.logits, self.cache = prop.logits.astype(jnp.float32), prop.cache

    def at(self, d: int, paths) -> jax.Array:
        B, F = paths.shape[:2]
        if not self.markov or d == 0:
            return jnp.broadcast_to(self.logits[:, d][:, None], (B, F, self.logits.shape[-1]))
        cache, anchor, apos = self.ctx
        rep = lambda x: jnp.repeat(x, F, axis=0)  # noqa: E731  (f-minor: row b*F + f)
        forced = jnp.concatenate([paths, jnp.zeros((B, F, 1), paths.dtype)], -1).reshape(B * F, d + 1)
        prop = self.draft.propose(jax.tree_util.tree_map(rep, cache), rep(anchor), rep(apos), forced=forced, k=d + 1)
        return prop.logits[:, d].astype(jnp.float32).reshape(B, F, -1)


def _extend_root(draft, dcache, rows, next_tokens, pos, n_valid):
    """The committed rows ingested once: (the root's draft logits [B, Vd], the root's chain state
    (F = 1), the committed cache to hand back, pos0 [B]: the last row's position)."""
    n = next_tokens.shape[1]
    ext = draft.extend(dcache, rows, next_tokens, pos, n_valid, rows=last_rows(n_valid, n))
    return ext.logits[:, 0], _Chains(ext.cache, ext.hidden[:, 0]), ext.cache, last_valid(pos, n_valid)


def _step_nodes(draft, parents: _Chains, parent_of, tokens, pos0, depth: int) -> tuple[jax.Array, _Chains]:
    """One chain step for F nodes of one depth: node j continues chain ``parent_of[j]`` of
    ``parents`` (int [F] static, or int32 [F, B] per sequence) with its token ``tokens`` [F, B]
    (target ids) at step ``depth``. Returns its draft logits f32 [F, B, Vd] and the new states."""
    F, B = tokens.shape
    Fp = parents.hidden.shape[0] // B

    def pick(x):  # [Fp*B, ...] -> [F*B, ...]: each node's parent chain
        x = x.reshape(Fp, B, *x.shape[1:])
        if isinstance(parent_of, np.ndarray):
            x = x[parent_of]
        else:
            idx = parent_of.reshape(F, B, *([1] * (x.ndim - 2)))
            x = jnp.take_along_axis(x, idx, axis=0)
        return x.reshape(F * B, *x.shape[2:])

    if Fp == F and depth > 1 and isinstance(parents.cache, DraftCache):
        cache = _pick_window(parents.cache, pick, F, B, depth - 1)
    else:
        cache = jax.tree_util.tree_map(pick, parents.cache)
    o = draft.step(cache, tokens.reshape(F * B), pick(parents.hidden), jnp.tile(pos0, F) + depth, depth)
    return o.logits.astype(jnp.float32).reshape(F, B, -1), _Chains(o.cache, o.hidden)


def _pick_window(cache: DraftCache, pick, F: int, B: int, w: int) -> DraftCache:
    """:func:`_step_nodes`' parent caches where the level has as many chains as the last (F): the
    chains share every slot but their scratch window (slots ``lengths .. lengths + w - 1``, their
    ancestors' steps; every chain was the root's copy at the first level), so each chain's cache
    takes its parent's window rows (``pick``: [F*B, ...] -> each node's parent's) in place of a
    copy of the parent's whole cache. Same contents as the whole-cache gather, slot for slot."""
    slots = cache.lengths[:B, None] + jnp.arange(w, dtype=jnp.int32)[None]  # [B, w]
    bi = jnp.arange(B)[:, None]

    def move(buf):  # [F*B, S, H, D]
        x = buf.reshape(F, B, *buf.shape[1:])
        rows = pick(x[:, bi, slots].reshape(F * B, w, *buf.shape[2:])).reshape(F, B, w, *buf.shape[2:])
        return x.at[:, bi, slots].set(rows, mode="drop").reshape(buf.shape)

    return cache._replace(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v))


def _propose_static(draft, dcache, rows, next_tokens, positions, n_valid, tree: TokenTree, sample, key,
                    vocab_size: int, mode: str):
    """Node i's children (rank order) are the draft's top-c tokens after the root-to-i path (or
    i.i.d. draws from its processed distribution, ``sample``). The internal nodes of one depth
    share one batched draft call (:func:`_mode`): "steps" one chain step each from its parent's
    state (:func:`_step_nodes`; the committed rows ingested once), "forced" one teacher-forced
    chain each (:func:`forced_logits`), "block" :class:`_Block`. Returns (nodes int32 [B, N+1]
    target ids, column 0 zero; q f32 [B, N+1, V] or [1]; the draft cache)."""
    B = next_tokens.shape[0]
    pos = positions + getattr(draft, "token_position_offset", 0)
    d2t = d2t_of(draft)
    if mode == "block":
        blk = _Block(draft, dcache, rows, next_tokens, positions, n_valid, tree.max_depth)
        root_logits, cache = blk.logits[:, 0], blk.cache
    elif mode == "steps":
        root_logits, chains, cache, pos0 = _extend_root(draft, dcache, rows, next_tokens, pos, n_valid)
    else:
        root = draft.propose(dcache, rows, next_tokens, pos, k=1, n_valid=n_valid)
        root_logits, cache = root.logits[:, 0], root.cache  # drafted rows are scratch: this cache is the committed one
    nodes = jnp.zeros((B, tree.num_nodes + 1), jnp.int32)
    node_q = jnp.zeros((1,), jnp.float32) if sample is None else jnp.zeros((B, tree.num_nodes + 1, vocab_size))
    prev = [0]  # with ``steps``: the internal nodes whose chain states ``chains`` holds, in order
    c = tree.children.shape[1]
    for d, level in enumerate(tree.levels):  # static: parents' tokens are set before their children's
        inner = [int(i) for i in level if tree.children[i][0] >= 0]
        if not inner:
            continue
        if d == 0:
            lg = root_logits[:, None].astype(jnp.float32)  # [B, 1, Vd]
        elif mode == "block":
            lg = blk.at(d, nodes[:, tree.path_nodes[np.asarray(inner)][:, 1:d + 1]])
        elif mode == "steps":
            where = {n: j for j, n in enumerate(prev)}
            parent_of = np.asarray([where[int(tree.parent[i])] for i in inner], np.int32)
            lg, chains = _step_nodes(draft, chains, parent_of, nodes[:, np.asarray(inner)].T, pos0, d)
            lg = jnp.swapaxes(lg, 0, 1)  # [B, F, Vd]
        else:
            paths = nodes[:, tree.path_nodes[np.asarray(inner)][:, 1:d + 1]]  # [B, F, d]
            lg = forced_logits(draft, dcache, rows, next_tokens, pos, n_valid, paths)
        prev = inner
        if sample is None:
            top = draft_to_target(jax.lax.top_k(lg, c)[1], d2t).astype(jnp.int32)  # [B, F, C]
        else:
            q = draft_probs(lg, sample, d2t=d2t, vocab_size=vocab_size)  # [B, F, V]
            top = jax.random.categorical(jax.random.fold_in(key, d), jnp.log(q)[:, :, None, :], axis=-1,
                                         shape=(B, len(inner), c)).astype(jnp.int32)  # i.i.d., with replacement
        for f, i in enumerate(inner):
            kids = tree.children[i][tree.children[i] >= 0]
            nodes = nodes.at[:, kids].set(top[:, f, : len(kids)])
            if sample is not None:
                node_q = node_q.at[:, kids].set(jnp.broadcast_to(q[:, f, None], (B, len(kids), vocab_size)))
    return nodes, node_q, cache


def _propose_dynamic(draft, dcache, rows, next_tokens, positions, n_valid, spec: DynamicTreeSpec, mode: str):
    """EAGLE-2: scores are the draft's cumulative log-probs (temperature 1, draft vocabulary); the
    frontier of each depth is expanded by one chain step per frontier node from its parent's
    state ("steps", chain drafts), by one batched teacher-forced proposal ("forced"), or from a
    block draft's proposal (:class:`_Block`)."""
    pos = positions + getattr(draft, "token_position_offset", 0)
    d2t = d2t_of(draft)
    if mode == "block":
        blk = _Block(draft, dcache, rows, next_tokens, positions, n_valid, spec.depth)
        root_logits, cache = blk.logits[:, 0], blk.cache

        def expand(level, paths, frontier):  # noqa: ARG001  (paths [B, topk, level] draft ids)
            return jax.nn.log_softmax(blk.at(level, draft_to_target(paths, d2t).astype(jnp.int32)), axis=-1)
    elif mode == "steps":
        root_logits, root_chain, cache, pos0 = _extend_root(draft, dcache, rows, next_tokens, pos, n_valid)
        box = {"chains": root_chain}

        def expand(level, paths, frontier):  # frontier int32 [B, topk]: each node's index in its level
            B, F = frontier.shape
            parent_of = (jnp.zeros((F, B), jnp.int32) if level == 1 else (frontier // spec.topk).T.astype(jnp.int32))
            toks = draft_to_target(paths[:, :, -1], d2t).astype(jnp.int32).T  # [F, B]
            lg, box["chains"] = _step_nodes(draft, box["chains"], parent_of, toks, pos0, level)
            return jax.nn.log_softmax(jnp.swapaxes(lg, 0, 1), axis=-1)
    else:
        root = draft.propose(dcache, rows, next_tokens, pos, k=1, n_valid=n_valid)
        root_logits, cache = root.logits[:, 0], root.cache

        def expand(level, paths, frontier):  # noqa: ARG001  (paths [B, topk, level] draft ids)
            forced = draft_to_target(paths, d2t).astype(jnp.int32)
            return jax.nn.log_softmax(forced_logits(draft, dcache, rows, next_tokens, pos, n_valid, forced), axis=-1)

    root_logp = jax.nn.log_softmax(root_logits.astype(jnp.float32), axis=-1)
    t = dynamic_tree(root_logp, expand, topk=spec.topk, depth=spec.depth, num_nodes=spec.num_nodes)
    B = t.tokens.shape[0]
    tokens = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), draft_to_target(t.tokens, d2t).astype(jnp.int32)], 1)
    return Drafted(tokens, t.depth, t.mask, t.children, jnp.zeros((1,), jnp.float32)), cache


def proposal_sampling(sampling: SamplingParams, draft_sampling: str) -> SamplingParams | None:
    """The distribution a tree's nodes are drawn from: None (the draft's top-c tokens, point
    masses) for greedy target sampling or ``draft_sampling="greedy"``, else ``sampling``."""
    if draft_sampling not in ("greedy", "sample"):
        raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {draft_sampling!r}")
    return None if sampling.greedy or draft_sampling == "greedy" else sampling
