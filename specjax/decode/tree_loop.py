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
   chosen by the path -- and drafts the next tree (:func:`specjax.decode.tree_draft.propose_tree`).

Every speculators draft drafts trees (its ``tree_drafting``), and so does any draft with a
teacher-forced ``propose(..., forced=)`` (the self draft). A static tree
(:class:`specjax.decode.tree.TokenTree`): node i's children are the draft's top-c tokens after the
root-to-i path. A dynamic tree (:class:`~specjax.decode.tree_draft.DynamicTreeSpec`): the root's
top-k, then per further depth the top-k frontier nodes (by cumulative draft log-prob) expanded, the
best ``num_nodes`` kept; each sequence has its own tree (masks, depths and children are [B, ...]
arrays). A chain draft (``extend`` then ``step``: EAGLE-3, MTP) ingests the committed rows once,
then drafts each depth with one batched chain step over that depth's expanded nodes, each continuing
its parent's chain state (its draft cache with the ancestors' scratch rows, and its hidden state):
one step per expanded node, nothing re-run (``tree_draft._step_nodes``). Other drafts with a
teacher-forced ``propose(..., forced=)`` re-run a forced chain per expanded node
(:func:`~specjax.decode.tree_draft.forced_logits`: one call per depth, each re-reading the committed
rows and re-running the earlier steps); both give the same tree. Block drafts
(``tree_draft._Block``) propose all depths in one pass: for P-EAGLE and DFlash the depth-d logits do
not depend on the drafted tokens, so a tree's nodes at one depth all get the same children (their
natural tree: the top-c tokens of each depth's distribution, combined along the tree's paths);
DSpark's Markov head conditions each depth on the token before it, so its depth-d logits are re-run
with each node's path fed (its backbone block once per node). A tree is at most a block deep
(:meth:`max_proposal`). On a mesh the loop runs sharded (:func:`sharded_tree_fn`). The drafting
lives in :mod:`specjax.decode.tree_draft`.
"""

from __future__ import annotations

import functools
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
from specjax.decode.sampling import SamplingParams
from specjax.decode.speculative import (
    GREEDY, Pair, SpecResult, loop_mesh, as_spec_draft, draft_dtype_of, load_spec_draft, place_pair, split_pair,
)
from specjax.decode.spec_stats import SpecStats
from specjax.decode.tree import accept_tree, compact_cache, parse_tree
from specjax.decode.tree_draft import (
    Drafted, DynamicTreeSpec, as_tree, check_tree_draft, proposal_sampling, propose_tree,
)
from specjax.kernels import tpu as kt
from specjax.models import panels
from specjax.models.layer_scan import tree_layer_scan
from specjax.models.target import CausalLM


class TreeState(NamedTuple):
    dec: DecodeState
    dcache: Any  # the draft's cache pytree
    tree: Drafted  # the pending tree
    hist: jax.Array  # int32 [B, D+1]: rounds in which each sequence accepted j drafted nodes
    hits: jax.Array  # int32 [B, N+1]: rounds in which node i was on the accepted path (node 0: every live round)


def tree_round(target: CausalLM, draft, s: TreeState, eos_ids, *, tree, sampling: SamplingParams,
               pad_id: int, draft_sampling: str = "greedy", mesh=None) -> TreeState:
    """One round: verify, accept, commit, hand-off (module docstring)."""
    D = tree.max_depth
    V = target.config.vocab_size
    taps = tuple(draft.tap_ids(target.config.num_hidden_layers))
    d = s.dec
    sample = proposal_sampling(sampling, draft_sampling)
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
                     packed_len=packed_len, prefill_chunk=prefill_chunk, mesh=mesh,
                     stacked=tree_layer_scan(target))
    nxt = jnp.concatenate([prompt_ids[:, 1:], jnp.full((B, 1), pad_id, prompt_ids.dtype)], axis=1)
    nxt = nxt.at[jnp.arange(B), prompt_lens - 1].set(dec.last.astype(prompt_ids.dtype))
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    dcache = pin_cache(draft.init_cache(B, kt.cache_slots(draft_len), draft_dtype), mesh)
    sample, kd = proposal_sampling(sampling, draft_sampling), None
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
                      limit: int | None = None, mesh=None, compute: str = "float32") -> SpecResult:
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
    multiple of data x fsdp, only the real rows come back). ``compute``: the matmuls' arithmetic on
    one CPU device, as in :func:`specjax.decode.generate.generate_ids`."""
    tree = as_tree(tree)
    if proposal_sampling(sampling, draft_sampling) is not None and isinstance(tree, DynamicTreeSpec):
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
    panels.check_compute(compute, mesh)
    if mesh is not None:
        graphdef, state = place_pair(target, sd.module, mesh, split=(graphdef, state))
        out = sharded_tree_fn(mesh, state)(state, *padded_mesh_inputs(b, mesh, seed), graphdef,
                                           *(static[k] for k in _STATIC[1:]))
        out = jax.tree.map(shd.to_host, out)  # every process reads the replicated outputs
    else:
        state = panels.decode_state(Pair(target, sd.module), state, compute=compute, rows=len(b.ids) * (N + 1))
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
                  mesh=None, compute: str = "float32"):
    """Tree counterpart of :func:`specjax.decode.speculative.speculative_generate` (text prompts,
    a target / draft by path or object; ``mesh``: loaded sharded on it and the loop runs sharded;
    ``compute``: the matmuls' arithmetic on one CPU device). Returns (completions, SpecStats)."""
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
                            eos_token_ids=eos, pad_id=pad, draft_sampling=draft_sampling, mesh=mesh,
                            compute=compute)
    return completions(lt, ids, res), res.stats
