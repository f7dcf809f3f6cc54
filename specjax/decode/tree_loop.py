"""Speculative decoding over a token tree (static or EAGLE-2 dynamic): draft a tree, verify it in one target forward,
accept the longest path, commit it -- the whole loop one ``jax.jit`` with ``lax.while_loop``, as
the chain loop of :mod:`specjax.decode.speculative`.

One round (``B`` sequences, tree of ``N`` drafted nodes and depth ``D``, :mod:`specjax.decode.tree`):

1. **verify**: the target runs over ``[last, node_1..node_N]`` ([B, N+1]) with the tree mask
   (slots ``L..L+N``, positions ``L + depth``), returning logits and taps per node;
2. **accept** (:func:`specjax.decode.tree.accept_tree`): the longest root path the target agrees
   with (greedy) or multi-candidate rejection sampling down the tree (lossless; proposals are
   point masses on the draft's top-c tokens), ``n`` drafted nodes plus one correction / bonus;
3. **commit**: :func:`specjax.decode.tree.compact_cache` moves the path's K/V rows to slots
   ``L..L+n``; :func:`specjax.decode.generate.emit` appends the ``n + 1`` tokens;
4. **hand-off**: the draft receives the target rows of the path's nodes (the taps gathered by
   ``path``) with the token after each, at positions ``L..L+n`` -- the chain hand-off, rows
   chosen by the path -- and drafts the next tree (:func:`propose_tree`).

Every speculators draft drafts trees (its ``tree_drafting``), and so does any draft with a
teacher-forced ``propose(..., forced=)`` (the self draft). A static
tree (:class:`specjax.decode.tree.TokenTree`): node i's children are the draft's top-c tokens after
the root-to-i path. A dynamic tree (:class:`DynamicTreeSpec`): the root's top-k, then per further
depth the top-k frontier nodes (by cumulative draft log-prob) expanded, the best ``num_nodes``
kept; each sequence has its own tree (masks, depths and children are [B, ...] arrays). A chain
draft (``extend`` then ``step``: EAGLE-3, MTP) ingests the committed rows once, then drafts each
depth with one batched chain step over that depth's expanded nodes, each continuing its parent's
chain state (its draft cache with the ancestors' scratch rows, and its hidden state): one step per
expanded node, nothing re-run (:func:`_step_nodes`). Other drafts with a teacher-forced
``propose(..., forced=)`` re-run a forced chain per expanded node (:func:`forced_logits`: one
call per depth, each re-reading the committed rows and re-running the earlier steps); both give
the same tree. Block drafts (:class:`_Block`) propose all depths in one pass: for P-EAGLE and
DFlash the depth-d logits do not depend on the drafted tokens, so a tree's nodes at one depth all
get the same children (their natural tree: the top-c tokens of each depth's distribution,
combined along the tree's paths); DSpark's Markov head conditions each depth on the token before
it, so its depth-d logits are re-run with each node's path fed (its backbone block once per node).
A tree is at most a block deep (:meth:`max_proposal`). On a mesh the loop runs sharded
(:func:`sharded_tree_fn`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import placement
from specjax import sharding as shd
from specjax.decode.batch import prepare, resolve_packed_len
from specjax.decode.generate import (
    DecodeState, cache_dtype_of, completions, emit, encode_prompts, get_target, mesh_loop_jit, padded_mesh_inputs,
    pin_cache, start,
)
from specjax.decode.accept import draft_probs
from specjax.decode.sampling import SamplingParams
from specjax.decode.speculative import (
    GREEDY, Pair, SpecResult, loop_mesh, as_spec_draft, draft_dtype_of, load_spec_draft, place_pair, split_pair,
)
from specjax.decode.spec_stats import SpecStats
from specjax.decode.tree import TokenTree, accept_tree, compact_cache, dynamic_tree, parse_tree
from specjax.kernels import tpu as kt
from specjax.models import panels
from specjax.models.drafts.common import d2t_of, last_rows, last_valid
from specjax.models.drafts.vocab import draft_to_target
from specjax.models.errors import ModelError
from specjax.models.target import CausalLM


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


class TreeState(NamedTuple):
    dec: DecodeState
    dcache: Any  # the draft's cache pytree
    tree: Drafted  # the pending tree
    hist: jax.Array  # int32 [B, D+1]: rounds in which each sequence accepted j drafted nodes
    hits: jax.Array  # int32 [B, N+1]: rounds in which node i was on the accepted path (node 0: every live round)


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

    cache = jax.tree_util.tree_map(pick, parents.cache)
    o = draft.step(cache, tokens.reshape(F * B), pick(parents.hidden), jnp.tile(pos0, F) + depth, depth)
    return o.logits.astype(jnp.float32).reshape(F, B, -1), _Chains(o.cache, o.hidden)


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


def _proposal_sampling(sampling: SamplingParams, draft_sampling: str) -> SamplingParams | None:
    if draft_sampling not in ("greedy", "sample"):
        raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {draft_sampling!r}")
    return None if sampling.greedy or draft_sampling == "greedy" else sampling


def tree_round(target: CausalLM, draft, s: TreeState, eos_ids, *, tree, sampling: SamplingParams,
               pad_id: int, draft_sampling: str = "greedy", mesh=None) -> TreeState:
    """One round: verify, accept, commit, hand-off (module docstring)."""
    D = tree.max_depth
    V = target.config.vocab_size
    taps = tuple(draft.tap_ids(target.config.num_hidden_layers))
    d = s.dec
    sample = _proposal_sampling(sampling, draft_sampling)
    if sample is None:
        (nkey, ka), kd = jax.random.split(d.key), None
    else:
        nkey, ka, kd = jax.random.split(d.key, 3)
    L = d.cache.lengths
    t = s.tree
    nodes = t.tokens.at[:, 0].set(d.last)
    out = target(nodes, cache=d.cache, tree_mask=t.mask, positions=L[:, None] + t.depth, tap_ids=taps)
    res = accept_tree(ka, out.logits, nodes, t.children, D, None if sample is None else t.q, sampling)
    live = ~d.done
    n_commit = jnp.where(live, res.num_accepted + 1, 0).astype(jnp.int32)
    cache = pin_cache(compact_cache(out.cache, L, res.path, res.num_accepted).rollback(L + n_commit), mesh)
    d = emit(d._replace(step=d.step + 1, cache=cache, key=nkey), res.tokens, res.num_accepted + 1, eos_ids, pad_id)
    ar = jnp.arange(D + 1, dtype=jnp.int32)
    hist = s.hist + jnp.where(live[:, None], (ar[None] == res.num_accepted[:, None]).astype(jnp.int32), 0)
    on_path = (jnp.arange(t.tokens.shape[1], dtype=jnp.int32)[None, :, None] == res.path[:, None, :]).any(-1)
    hits = s.hits + (on_path & live[:, None]).astype(jnp.int32)
    path = jnp.maximum(res.path, 0)  # [B, D+1] (padding: the root; past n_commit, not read)
    rows = jax.tree_util.tree_map(lambda a: jnp.take_along_axis(a, path[..., None], axis=1),
                                  draft.aux_from_taps(out.aux_hidden_states))
    nxt, dcache = propose_tree(draft, s.dcache, rows, res.tokens, L[:, None] + ar[None], n_commit, tree,
                               sample=sample, key=kd, vocab_size=V)
    return TreeState(d, pin_cache(dcache, mesh), nxt, hist, hits)


def tree_core(target: CausalLM, draft, prompt_ids, prompt_lens, limits, key, eos_ids, *, tree,
              sampling: SamplingParams, max_new_tokens: int, max_len: int, draft_len: int, pad_id: int, cache_dtype,
              draft_dtype, draft_sampling: str = "greedy", packed_len: int | None = None,
              prefill_chunk: int | None = None, mesh=None) -> TreeState:
    """The traced program: prefill, first token, the draft ingests the prompt rows and drafts the
    first tree, then ``lax.while_loop`` over :func:`tree_round`."""
    B, P = prompt_ids.shape
    taps = tuple(draft.tap_ids(target.config.num_hidden_layers))
    dec, aux = start(target, prompt_ids, prompt_lens, limits, key, eos_ids, max_new_tokens=max_new_tokens,
                     max_len=max_len, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, tap_ids=taps,
                     packed_len=packed_len, prefill_chunk=prefill_chunk, mesh=mesh)
    nxt = jnp.concatenate([prompt_ids[:, 1:], jnp.full((B, 1), pad_id, prompt_ids.dtype)], axis=1)
    nxt = nxt.at[jnp.arange(B), prompt_lens - 1].set(dec.last.astype(prompt_ids.dtype))
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    dcache = pin_cache(draft.init_cache(B, kt.cache_slots(draft_len), draft_dtype), mesh)
    sample, kd = _proposal_sampling(sampling, draft_sampling), None
    if sample is not None:
        kd, dkey = jax.random.split(dec.key)
        dec = dec._replace(key=dkey)
    drafted, dcache = propose_tree(draft, dcache, draft.aux_from_taps(aux), nxt, pos, prompt_lens, tree,
                                   sample=sample, key=kd, vocab_size=target.config.vocab_size)
    st = TreeState(dec, pin_cache(dcache, mesh), drafted, jnp.zeros((B, tree.max_depth + 1), jnp.int32),
                   jnp.zeros((B, tree.num_nodes + 1), jnp.int32))

    def cond(s: TreeState):
        return (s.dec.step < max_new_tokens - 1) & ~jnp.all(s.dec.done)

    def body(s: TreeState):
        return tree_round(target, draft, s, eos_ids, tree=tree, sampling=sampling, pad_id=pad_id,
                          draft_sampling=draft_sampling, mesh=mesh)

    return jax.lax.while_loop(cond, body, st)


_STATIC = ("graphdef", "tree", "sampling", "max_new_tokens", "max_len", "draft_len", "pad_id", "cache_dtype",
           "draft_dtype", "draft_sampling", "trace")


def _tree_outputs(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, *, tree, sampling, max_new_tokens,
                  max_len, draft_len, pad_id, cache_dtype, draft_dtype, draft_sampling="greedy", trace=False,
                  platform=None, packed_len=None, prefill_chunk=None, mesh=None):
    with placement.building_for(mesh if mesh is not None else platform):
        pair = nnx.merge(graphdef, state)
        st = tree_core(pair.target, pair.draft, prompt_ids, prompt_lens, limits, key, eos_ids, tree=tree,
                       sampling=sampling, max_new_tokens=max_new_tokens, max_len=max_len, draft_len=draft_len,
                       pad_id=pad_id, cache_dtype=cache_dtype, draft_dtype=draft_dtype, draft_sampling=draft_sampling,
                       packed_len=packed_len, prefill_chunk=prefill_chunk, mesh=mesh)
    out = {"tokens": st.dec.tokens, "num_tokens": st.dec.num_tokens, "eos_hit": st.dec.eos_hit, "hist": st.hist,
           "hits": st.hits, "rounds": st.dec.step}
    if trace:
        out["target_cache"] = st.dec.cache
    return out


@functools.partial(jax.jit, static_argnames=_STATIC + ("platform", "packed_len", "prefill_chunk"))
def _tree_jit(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, **kw):
    """The single-device program; ``platform`` (static, part of the cache key): where the params live."""
    return _tree_outputs(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, **kw)


def sharded_tree_fn(mesh, state):
    """The tree loop jitted for ``mesh`` (:func:`specjax.decode.generate.mesh_loop_jit`, the
    shardings of the chain loop's :func:`specjax.decode.speculative.sharded_spec_fn`): the pair
    state in its own shardings, prompts / lengths / limits split by batch, key data and EOS ids
    replicated, outputs replicated; both KV caches pinned inside the loop (batch on data/fsdp,
    heads on tensor), the drafted trees follow the batch. Positional call: ``fn(state, prompt_ids,
    prompt_lens, limits, key_data, eos_ids, *static)`` in ``_STATIC`` order."""

    def run(state, prompt_ids, prompt_lens, limits, key_data, eos_ids, *static):
        return _tree_outputs(static[0], state, prompt_ids, prompt_lens, limits, jax.random.wrap_key_data(key_data),
                             eos_ids, **dict(zip(_STATIC[1:], static[1:])), mesh=mesh)

    return mesh_loop_jit("tree", mesh, state, run, num_static=len(_STATIC))


def tree_generate_ids(target: CausalLM, draft, prompts: Sequence[Sequence[int]], *, tree, max_new_tokens: int = 64,
                      sampling: SamplingParams = GREEDY, seed: int = 0, eos_token_ids: Sequence[int] | None = None,
                      pad_id: int | None = None, context_length: int | None = None,
                      prompt_bucket: int = 32, draft_sampling: str = "greedy", trace: bool = False, split=None,
                      packed_len: int | str | None = "auto", prefill_chunk: int | None = None,
                      limit: int | None = None, mesh=None) -> SpecResult:
    """Tree speculative generation over token-id prompts; output as
    :func:`specjax.decode.speculative.speculative_generate_ids` (``stats`` per tree depth: the
    histogram of accepted drafted nodes per round). ``tree``: a :class:`TokenTree` or vLLM's
    ``speculative_token_tree`` path list (or its string), or a :class:`DynamicTreeSpec`.
    ``draft_sampling``: "greedy" (each node's children are the draft's top-c tokens: point masses)
    or "sample" (static trees at temperature > 0: i.i.d. draws from the draft's processed
    distribution, SpecInfer's multi-candidate rule with the parent's q). ``trace``: also return the
    final target KV cache (``res.trace["target_cache"]``, tests). ``res.node_hits`` int [n, N+1]:
    per sequence, the rounds in which each node was on the accepted path (node 0, the root: every
    round; for a static tree node i is ``tree.paths[i - 1]``, for a dynamic tree the i-th kept
    node of each round's own tree). ``split``, ``packed_len``, ``prefill_chunk``, ``limit``: as in
    :func:`specjax.decode.speculative.speculative_generate_ids`. ``mesh`` (more than one device),
    or params already on one: the loop runs sharded (:func:`sharded_tree_fn`; the batch padded to a
    multiple of data x fsdp, only the real rows come back)."""
    tree = as_tree(tree)
    if _proposal_sampling(sampling, draft_sampling) is not None and isinstance(tree, DynamicTreeSpec):
        raise ValueError("a dynamic tree takes the draft's top-k children (draft_sampling='greedy'), not samples")
    sd = as_spec_draft(draft)
    check_tree_draft(sd.module, tree)
    b = prepare(target.config, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, pad_id=pad_id,
                context_length=context_length, prompt_bucket=prompt_bucket, limit=limit)
    P, N = b.padded_len, tree.num_nodes
    max_len = P + max_new_tokens + N + 1  # a verify writes N+1 rows past the committed ones
    draft_len = P + max_new_tokens + 2 * (tree.max_depth + 1)
    graphdef, state = split if split is not None else split_pair(target, sd.module)
    static = dict(tree=tree, sampling=sampling, max_new_tokens=int(max_new_tokens), max_len=int(max_len),
                  draft_len=int(draft_len), pad_id=b.pad, cache_dtype=cache_dtype_of(target),
                  draft_dtype=draft_dtype_of(sd.module), draft_sampling=draft_sampling, trace=bool(trace))
    mesh = loop_mesh(state, mesh)
    if mesh is not None:
        graphdef, state = place_pair(target, sd.module, mesh, split=(graphdef, state))
        out = sharded_tree_fn(mesh, state)(state, *padded_mesh_inputs(b, mesh, seed), graphdef,
                                           *(static[k] for k in _STATIC[1:]))
        out = jax.tree.map(shd.to_host, out)  # every process reads the replicated outputs
    else:
        state = panels.decode_state(Pair(target, sd.module), state)
        out = _tree_jit(graphdef, state, jnp.asarray(b.ids), jnp.asarray(b.lens), jnp.asarray(b.limits),
                        jax.random.key(seed), jnp.asarray(b.eos, jnp.int32), **static,
                        platform=placement.platform_of(state), packed_len=resolve_packed_len(packed_len, b),
                        prefill_chunk=None if prefill_chunk is None else int(prefill_chunk))
        out = jax.device_get(out)
    n = len(prompts)
    toks, num = out["tokens"], out["num_tokens"]
    res = SpecResult(tokens=[toks[i, : num[i]].tolist() for i in range(n)],
                     stop_reasons=["eos" if e else "length" for e in out["eos_hit"][:n]],
                     prompt_lengths=b.lens.tolist(), stats=SpecStats(tree.max_depth, np.asarray(out["hist"])[:n], False),
                     rounds=int(out["rounds"]), node_hits=np.asarray(out["hits"])[:n])
    if trace:
        res.trace = {"target_cache": out["target_cache"]}
    return res


def tree_option(tree: str | None = None, *, topk: int | None = None, depth: int | None = None,
                num_nodes: int | None = None):
    """The tree options of ``generate`` / the Python API -> a :class:`TokenTree`, a
    :class:`DynamicTreeSpec` or None (chain): ``tree`` a ``speculative_token_tree`` path list
    (string), or ``topk``, ``depth`` and ``num_nodes`` together for a dynamic tree."""
    dyn = [x is not None for x in (topk, depth, num_nodes)]
    if tree is not None and any(dyn):
        raise ValueError("give either a static tree (--tree) or a dynamic one (--tree-topk/--tree-depth/--tree-nodes), "
                         "not both")
    if any(dyn) and not all(dyn):
        raise ValueError(f"a dynamic tree needs --tree-topk, --tree-depth and --tree-nodes together, got topk={topk} "
                         f"depth={depth} nodes={num_nodes}")
    if all(dyn):
        return DynamicTreeSpec(int(topk), int(depth), int(num_nodes))
    return None if tree is None else parse_tree(tree)


def tree_generate(prompts, *, tree, target=None, draft="self", chat: bool = False, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, dtype=None,
                  eos_token_ids: Sequence[int] | None = None, cache_dir=None, draft_sampling: str = "greedy",
                  mesh=None):
    """Tree counterpart of :func:`specjax.decode.speculative.speculative_generate` (text prompts,
    a target / draft by path or object; ``mesh``: loaded sharded on it and the loop runs sharded).
    Returns (completions, SpecStats)."""
    if mesh is not None and mesh.size <= 1:
        mesh = None
    lt = get_target(target, dtype, cache_dir, mesh)
    sd = load_spec_draft(draft, lt, dtype=dtype, mesh=mesh)
    ids = encode_prompts(lt, prompts, chat=chat)
    eos = lt.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    tok = lt.tokenizer
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else None
    res = tree_generate_ids(lt.model, sd, ids, tree=tree, max_new_tokens=max_new_tokens,
                            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
                            eos_token_ids=eos, pad_id=pad, draft_sampling=draft_sampling, mesh=mesh)
    return completions(lt, ids, res), res.stats
