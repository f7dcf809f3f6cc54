"""Speculative decoding: draft, verify, accept, commit -- the whole loop is one ``jax.jit``.

One compiled program per shape: prefill the target (tapping the hidden states the draft
consumes), sample the first token, let the draft ingest the prompt rows and propose ``k``
tokens, then ``lax.while_loop`` over rounds until every sequence hit EOS or its limit:

1. **verify**: one target forward over ``[last, d_1, ..., d_k]`` ([B, k+1]) at positions
   ``L .. L+k`` (``L`` = committed tokens in the cache), returning logits and taps;
2. **accept** (:mod:`specjax.decode.accept`): ``n`` leading draft tokens plus one correction /
   bonus token per sequence (ragged);
3. **commit**: :func:`specjax.decode.generate.emit` appends the ``n + 1`` tokens (EOS / limit
   stops); the target cache keeps ``L + n + 1`` tokens (``rollback``: rejected slots are never
   read, later writes overwrite them);
4. **hand-off**: the draft receives the target rows of exactly the committed tokens -- the taps
   at verify positions ``0..n`` with the token after each (``d_2..d_n``, then the new token) --
   and proposes the next ``k`` (``draft.speculate``; chain drafts feed their own hidden state
   step to step, block drafts propose the block in one forward).

No host round trip inside the loop; all shapes are static (``B``, prompt bucket, ``k``,
``max_new_tokens``); per-sequence lengths live in the caches. Any object with the shared
draft decode entry works as the draft: every speculators algorithm in
:mod:`specjax.models.drafts`, and :class:`specjax.decode.selfdraft.SelfDraft`.

On a device mesh (``mesh=`` or params already placed on one) the same loop is jitted with
explicit shardings (:func:`sharded_spec_fn`): target params by ``TARGET_RULES``, draft params by
``DRAFT_RULES``, prompts / lengths / limits split by batch over ``("data", "fsdp")`` (padded to
a multiple of data x fsdp), both KV caches pinned to batch x heads inside the loop, outputs
replicated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import placement
from specjax import sharding as shd
from specjax.decode.accept import accept, draft_probs, is_lossy, sample_draft
from specjax.decode.batch import prepare, resolve_packed_len
from specjax.decode.generate import (
    GREEDY, Completion, DecodeState, GenerationResult, cache_dtype_of, completions, emit, encode_prompts, get_target,
    mesh_loop_jit, padded_mesh_inputs, pin_cache, start,
)
from specjax.decode.sampling import SamplingParams
from specjax.kernels import tpu as kt
from specjax.decode.spec_stats import SpecStats
from specjax.models.drafts.common import d2t_of, greedy
from specjax.decode.spec_draft import (  # noqa: F401  (the draft side of the loop; also reachable from here)
    DraftTargetMismatchError, SpecDraft, as_spec_draft, check_pair, draft_dtype_of, load_spec_draft,
    parse_self_draft, resolve_k,
)
from specjax.models import panels
from specjax.models.layer_scan import stack_layer_runs, using_stacked_layers
from specjax.models.target import CausalLM
from specjax.sharding import mesh_of

TRACE_COUNT = {"speculative": 0}  # bumped each time the speculative loop is traced (= compiled)


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SpecParams:
    """Static (hashable) settings of one speculative program."""

    k: int  # draft tokens per round
    sampling: SamplingParams = GREEDY  # applied to target and draft distributions alike
    draft_sampling: str = "greedy"  # "greedy": argmax proposals (point-mass q, speculators default) | "sample"

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k (speculative tokens) must be >= 1, got {self.k}")
        if self.draft_sampling not in ("greedy", "sample"):
            raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {self.draft_sampling!r}")

    @property
    def greedy_proposals(self) -> bool:
        return self.sampling.greedy or self.draft_sampling == "greedy"


class SpecState(NamedTuple):
    dec: DecodeState
    dcache: Any  # the draft's cache pytree
    prop: jax.Array  # int32 [B, k] pending proposal (target ids)
    q: jax.Array  # f32 [B, k, V] its distribution (sampled proposals) or [0] placeholder (point mass)
    hist: jax.Array  # int32 [B, k+1]: rounds in which each sequence accepted j draft tokens
    trace: tuple  # (proposals [R, B, k], accepted [R, B], start length [R, B], live [R, B]) or ()


class Pair(nnx.Module):
    """The target and the draft as one module: one ``nnx.split`` gives the loop's graphdef and state."""

    def __init__(self, target, draft):
        self.target = target
        self.draft = draft


def _propose(draft, dcache, rows, next_tokens, positions, n_valid, params: SpecParams, key, vocab_size: int):
    sample = greedy if params.greedy_proposals else sample_draft(params.sampling)
    prop = draft.speculate(dcache, rows, next_tokens, positions, n_valid=n_valid, k=params.k, sample=sample, key=key)
    tokens = prop.tokens[:, : params.k].astype(jnp.int32)
    if params.greedy_proposals:
        q = jnp.zeros((1,), jnp.float32)
    else:
        q = draft_probs(prop.logits[:, : params.k], params.sampling, d2t=d2t_of(draft), vocab_size=vocab_size)
    return tokens, q, prop.cache


def spec_core(target: CausalLM, draft, prompt_ids, prompt_lens, limits, key, eos_ids, relax, *, params: SpecParams,
              max_new_tokens: int, max_len: int, draft_len: int, pad_id: int, cache_dtype, draft_dtype,
              trace: bool = False, mesh=None, packed_len: int | None = None, prefill_chunk: int | None = None):
    """The traced body of the jitted program. ``relax`` f32 [2]: (verifier_accept_k, accept_tolerance),
    runtime values (the exact rule unless k > 1 and tolerance > 0). ``mesh``: pin the target and
    draft KV caches to ``specjax.sharding.kv_cache_sharding`` (batch on data/fsdp, heads on
    tensor) at the start and every round. Returns the final :class:`SpecState`."""
    B, P = prompt_ids.shape
    k = params.k
    V = target.config.vocab_size
    taps = tuple(draft.tap_ids(target.config.num_hidden_layers))
    dec, aux = start(target, prompt_ids, prompt_lens, limits, key, eos_ids, max_new_tokens=max_new_tokens,
                     max_len=max_len, sampling=params.sampling, pad_id=pad_id, cache_dtype=cache_dtype, tap_ids=taps,
                     mesh=mesh, packed_len=packed_len, prefill_chunk=prefill_chunk)
    kd, dkey = jax.random.split(dec.key)
    dec = dec._replace(key=dkey)
    # prompt rows: row j holds the target state after token j; its next token is j+1 (the first
    # generated token for the last prompt row)
    nxt = jnp.concatenate([prompt_ids[:, 1:], jnp.full((B, 1), pad_id, prompt_ids.dtype)], axis=1)
    nxt = nxt.at[jnp.arange(B), prompt_lens - 1].set(dec.last.astype(prompt_ids.dtype))
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    dcache = pin_cache(draft.init_cache(B, kt.cache_slots(draft_len), draft_dtype), mesh)
    prop, q, dcache = _propose(draft, dcache, draft.aux_from_taps(aux), nxt, pos, prompt_lens, params, kd, V)
    dcache = pin_cache(dcache, mesh)
    R = max(max_new_tokens - 1, 1)
    tr = ((jnp.zeros((R, B, k), jnp.int32), jnp.zeros((R, B), jnp.int32), jnp.zeros((R, B), jnp.int32),
           jnp.zeros((R, B), bool)) if trace else ())
    st = SpecState(dec, dcache, prop, q, jnp.zeros((B, k + 1), jnp.int32), tr)

    def cond(s: SpecState):
        return (s.dec.step < max_new_tokens - 1) & ~jnp.all(s.dec.done)

    def body(s: SpecState):
        return spec_round(target, draft, s, eos_ids, relax, params=params, pad_id=pad_id, trace=trace, mesh=mesh)

    # the decode layer scan: the target's layers stacked once here for the verify, not in every round
    with using_stacked_layers(target, stack_layer_runs(target, taps) if dec.cache.stacked else None):
        return jax.lax.while_loop(cond, body, st)


def spec_round(target: CausalLM, draft, s: SpecState, eos_ids, relax, *, params: SpecParams, pad_id: int,
               trace: bool = False, mesh=None) -> SpecState:
    """One round of the speculative loop: verify, accept, commit, hand-off (the module docstring's
    steps 1-4). A program of its own for per-round figures (``cost_analysis`` counts a
    ``while_loop`` body once)."""
    k = params.k
    V = target.config.vocab_size
    taps = tuple(draft.tap_ids(target.config.num_hidden_layers))
    ar = jnp.arange(k + 1, dtype=jnp.int32)
    d = s.dec
    nkey, ka, kd = jax.random.split(d.key, 3)
    L = d.cache.lengths
    out = target(jnp.concatenate([d.last[:, None], s.prop], axis=1), cache=d.cache, tap_ids=taps)  # verify
    res = accept(ka, out.logits, s.prop, None if params.greedy_proposals else s.q, params.sampling,
                 verifier_accept_k=relax[0], accept_tolerance=relax[1])
    live = ~d.done
    n_commit = jnp.where(live, res.num_accepted + 1, 0).astype(jnp.int32)
    d = d._replace(step=d.step + 1, cache=pin_cache(out.cache.rollback(L + n_commit), mesh), key=nkey)
    d = emit(d, res.tokens, res.num_accepted + 1, eos_ids, pad_id)
    hist = s.hist + jnp.where(live[:, None], (ar[None] == res.num_accepted[:, None]).astype(jnp.int32), 0)
    tr = s.trace
    if trace:
        i = s.dec.step
        tr = (tr[0].at[i].set(s.prop), tr[1].at[i].set(res.num_accepted), tr[2].at[i].set(L), tr[3].at[i].set(live))
    # hand-off: target rows of the committed tokens (verify positions 0..n), next token of each
    rows = draft.aux_from_taps(out.aux_hidden_states)
    prop, q, dcache = _propose(draft, s.dcache, rows, res.tokens, L[:, None] + ar[None], n_commit, params, kd, V)
    return SpecState(d, pin_cache(dcache, mesh), prop, q, hist, tr)


def _spec_outputs(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, relax, *, params, max_new_tokens,
                  max_len, draft_len, pad_id, cache_dtype, draft_dtype, trace, mesh=None, packed_len=None,
                  prefill_chunk=None, platform=None):
    with placement.building_for(mesh if mesh is not None else platform):
        return _spec_outputs_body(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, relax, params=params,
                                  max_new_tokens=max_new_tokens, max_len=max_len, draft_len=draft_len, pad_id=pad_id,
                                  cache_dtype=cache_dtype, draft_dtype=draft_dtype, trace=trace, mesh=mesh,
                                  packed_len=packed_len, prefill_chunk=prefill_chunk)


def _spec_outputs_body(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, relax, *, params,
                       max_new_tokens, max_len, draft_len, pad_id, cache_dtype, draft_dtype, trace, mesh, packed_len,
                       prefill_chunk):
    TRACE_COUNT["speculative"] += 1
    pair = nnx.merge(graphdef, state)
    st = spec_core(pair.target, pair.draft, prompt_ids, prompt_lens, limits, key, eos_ids, relax, params=params,
                   max_new_tokens=max_new_tokens, max_len=max_len, draft_len=draft_len, pad_id=pad_id,
                   cache_dtype=cache_dtype, draft_dtype=draft_dtype, trace=trace, mesh=mesh, packed_len=packed_len,
                   prefill_chunk=prefill_chunk)
    out = {"tokens": st.dec.tokens, "num_tokens": st.dec.num_tokens, "eos_hit": st.dec.eos_hit, "hist": st.hist,
           "rounds": st.dec.step}
    if trace:
        out.update(proposals=st.trace[0], accepted=st.trace[1], start_length=st.trace[2], live=st.trace[3],
                   target_cache=st.dec.cache, draft_cache=st.dcache)
    return out


_STATIC = ("graphdef", "params", "max_new_tokens", "max_len", "draft_len", "pad_id", "cache_dtype", "draft_dtype",
           "trace")


@functools.partial(jax.jit, static_argnames=_STATIC + ("packed_len", "prefill_chunk", "platform"))
def _spec_jit(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, relax, *, params, max_new_tokens,
              max_len, draft_len, pad_id, cache_dtype, draft_dtype, trace, packed_len=None, prefill_chunk=None,
              platform=None):
    """``platform`` (static: part of the trace cache key): where the pair's params live
    (:mod:`specjax.placement`)."""
    return _spec_outputs(graphdef, state, prompt_ids, prompt_lens, limits, key, eos_ids, relax, params=params,
                         max_new_tokens=max_new_tokens, max_len=max_len, draft_len=draft_len, pad_id=pad_id,
                         cache_dtype=cache_dtype, draft_dtype=draft_dtype, trace=trace, packed_len=packed_len,
                         prefill_chunk=prefill_chunk, platform=platform)


def sharded_spec_fn(mesh, state):
    """The speculative loop jitted for ``mesh`` with explicit shardings
    (:func:`specjax.decode.generate.mesh_loop_jit`, as the generate loop): the pair state
    (``split_pair``) in its own shardings (:func:`place_pair`), prompts ``[B, P]`` / lengths /
    limits ``[B]`` split by batch over ``("data", "fsdp")``, PRNG key data, EOS ids and the
    relaxation pair replicated; outputs replicated so every process can read them. Both KV caches
    are pinned inside the loop. Positional call: ``fn(state, prompt_ids, prompt_lens, limits,
    key_data, eos_ids, relax, *static)`` with the static arguments in ``_STATIC`` order
    (``jax.jit`` takes no keyword arguments when ``in_shardings`` is given)."""

    def run(state, prompt_ids, prompt_lens, limits, key_data, eos_ids, relax, graphdef, params, max_new_tokens,
            max_len, draft_len, pad_id, cache_dtype, draft_dtype, trace):
        return _spec_outputs(graphdef, state, prompt_ids, prompt_lens, limits, jax.random.wrap_key_data(key_data),
                             eos_ids, relax, params=params, max_new_tokens=max_new_tokens, max_len=max_len,
                             draft_len=draft_len, pad_id=pad_id, cache_dtype=cache_dtype, draft_dtype=draft_dtype,
                             trace=trace, mesh=mesh)

    return mesh_loop_jit("speculative", mesh, state, run, num_static=len(_STATIC), extra_inputs=1)


_PAIR_RULES = {"target": "TARGET_RULES", "draft": "DRAFT_RULES"}


def place_pair(target: CausalLM, draft, mesh, *, split=None):
    """``(graphdef, state)`` of the target/draft pair (``split_pair``) with the state on ``mesh``:
    the ``target`` part by ``TARGET_RULES``, the ``draft`` part by ``DRAFT_RULES`` (a self draft's
    layers shared with the target are one variable, under whichever part nnx files it; the
    decoder rules of both tables agree). A part whose every leaf already lives on ``mesh`` keeps
    its own shardings; any other part is placed as a copy (the modules are not touched). Abstract
    leaves (``jax.ShapeDtypeStruct``: modules built with ``nnx.eval_shape``) come back abstract,
    carrying the shardings the rules give (a deviceless compile; nothing is placed). Raises
    ``specjax.sharding`` rule errors naming the parameter and the mesh."""
    from jax.sharding import NamedSharding

    graphdef, state = split if split is not None else split_pair(target, draft)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    parts: dict[str, dict] = {}
    for i, (kp, x) in enumerate(flat):
        head, _, rest = shd.path_str(kp).partition(".")
        parts.setdefault(head, {})[rest] = (i, x)
    leaves = [x for _, x in flat]
    for head, items in parts.items():
        xs = {rest: x for rest, (_, x) in items.items()}
        if all(isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
               for x in xs.values()):
            continue
        rules = getattr(shd, _PAIR_RULES.get(head, "DRAFT_RULES"))
        shardings = shd.named_shardings(xs, rules, mesh)
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in xs.values()):
            placed = shd.abstract_with_shardings(xs, shardings)
        else:
            placed = jax.device_put(xs, shardings)
        for rest, (i, _) in items.items():
            leaves[i] = placed[rest]
    return graphdef, jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------- results


@dataclass
class SpecResult(GenerationResult):
    stats: SpecStats = None
    rounds: int = 0  # loop iterations (max over the batch)
    trace: dict = field(default_factory=dict)
    node_hits: Any = None  # tree loops: int [n, N+1], rounds in which each tree node was accepted


# ----------------------------------------------------------------------------- host API


def split_pair(target: CausalLM, draft):
    return nnx.split(Pair(target, draft))


def speculative_generate_ids(target: CausalLM, draft, prompts: Sequence[Sequence[int]], *, k: int | None = None,
                             max_new_tokens: int = 64, sampling: SamplingParams = GREEDY, seed: int = 0,
                             eos_token_ids: Sequence[int] | None = None, pad_id: int | None = None,
                             context_length: int | None = None, prompt_bucket: int = 32,
                             draft_sampling: str = "greedy", verifier_accept_k: int | None = None,
                             accept_tolerance: float | None = None, lossless: bool = False, trace: bool = False,
                             split=None, mesh=None, packed_len: int | str | None = "auto",
                             prefill_chunk: int | None = None, limit: int | None = None,
                             compute: str = "float32") -> SpecResult:
    """Speculative generation over token-id prompts (ragged batch), same stopping rules and
    output format as :func:`specjax.decode.generate.generate_ids` plus acceptance statistics.

    draft: a draft module with the shared decode entry, or a :class:`SpecDraft`. ``k``: default
    the checkpoint's ``speculative_tokens``. ``draft_sampling``: "greedy" proposals (point-mass q,
    the speculators default) or "sample" (draw from the processed draft distribution).
    ``verifier_accept_k`` / ``accept_tolerance``: default the checkpoint's (lossy when relaxed; the
    stats say so); ``lossless=True`` forces the exact rule. ``trace=True`` also returns per-round
    proposals, accept counts and the final caches (tests). ``split``: a cached
    ``split_pair(target, draft.module)`` (or ``place_pair(..., mesh)``) to skip re-splitting the
    modules.

    Sharded: when ``mesh`` (a ``jax.sharding.Mesh`` of more than one device) is given, or the
    target's / draft's params already live on a multi-device mesh, the loop runs under
    :func:`sharded_spec_fn` (a part of the pair not on the mesh is placed as a copy by its rules,
    :func:`place_pair`); the batch is padded to a multiple of data x fsdp with rows that emit
    nothing, and only the real rows come back (tokens, stop reasons, acceptance stats alike).
    Multi-process: every process calls this with the same prompts and gets the same result.
    ``packed_len`` / ``prefill_chunk``: the target's prompt prefill layout, as in ``generate_ids``.
    ``limit``: a runtime cap below ``max_new_tokens`` (no recompile), as in ``generate_ids``.
    ``compute``: the matmuls' arithmetic on one CPU device, target and draft alike, as in
    ``generate_ids`` (``"bfloat16"``: compare with ``generate_ids(..., compute="bfloat16")``).
    """
    sd = as_spec_draft(draft)
    kk = resolve_k(sd, k)
    vak = sd.verifier_accept_k if verifier_accept_k is None else int(verifier_accept_k)
    tol = sd.accept_tolerance if accept_tolerance is None else float(accept_tolerance)
    if lossless:
        vak, tol = 1, 0.0
    params = SpecParams(k=kk, sampling=sampling, draft_sampling=draft_sampling)
    b = prepare(target.config, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, pad_id=pad_id,
                context_length=context_length, prompt_bucket=prompt_bucket, limit=limit)
    P = b.padded_len
    max_len = P + max_new_tokens  # verify writes past it are dropped: those tokens are never emitted
    draft_len = P + max_new_tokens + 2 * (kk + 1)
    graphdef, state = split if split is not None else split_pair(target, sd.module)
    ddtype = draft_dtype_of(sd.module)
    mesh = loop_mesh(state, mesh)
    panels.check_compute(compute, mesh)
    if mesh is not None:
        graphdef, state = place_pair(target, sd.module, mesh, split=(graphdef, state))
        out = _spec_sharded(mesh, graphdef, state, b, vak=vak, tol=tol, seed=seed, params=params,
                            max_new_tokens=int(max_new_tokens), max_len=int(max_len), draft_len=int(draft_len),
                            cache_dtype=cache_dtype_of(target), draft_dtype=ddtype, trace=bool(trace))
        return _result(out, b, len(prompts), kk, vak, tol, trace)
    state = panels.decode_state(Pair(target, sd.module), state, compute=compute, rows=len(b.ids) * (kk + 1))
    out = _spec_jit(graphdef, state, jnp.asarray(b.ids), jnp.asarray(b.lens), jnp.asarray(b.limits),
                    jax.random.key(seed), jnp.asarray(b.eos, jnp.int32), jnp.asarray([vak, tol], jnp.float32),
                    params=params,
                    max_new_tokens=int(max_new_tokens), max_len=int(max_len), draft_len=int(draft_len), pad_id=b.pad,
                    cache_dtype=cache_dtype_of(target), draft_dtype=ddtype, trace=bool(trace),
                    packed_len=resolve_packed_len(packed_len, b),
                    prefill_chunk=None if prefill_chunk is None else int(prefill_chunk),
                    platform=placement.platform_of(state))
    return _result(jax.device_get(out), b, len(prompts), kk, vak, tol, trace)


def _result(out: dict, b, n: int, k: int, vak, tol, trace: bool) -> SpecResult:
    """Host outputs of the jitted loop (rows past ``n``: batch padding, dropped) -> :class:`SpecResult`."""
    toks, num, eos_hit = out["tokens"], out["num_tokens"], out["eos_hit"]
    res = SpecResult(tokens=[toks[i, : num[i]].tolist() for i in range(n)],
                     stop_reasons=["eos" if e else "length" for e in eos_hit[:n]], prompt_lengths=b.lens.tolist(),
                     stats=SpecStats(k, np.asarray(out["hist"])[:n], is_lossy(vak, tol)), rounds=int(out["rounds"]))
    if trace:
        res.trace = {key: out[key] for key in ("proposals", "accepted", "start_length", "live", "target_cache",
                                               "draft_cache")}
    return res


def loop_mesh(state, mesh):
    """The mesh the loop runs on: ``mesh`` if it has more than one device, else the mesh the
    pair's params already live on (``mesh_of``: multi-device only; None: the single-device program)."""
    if mesh is None or mesh.size <= 1:
        mesh = mesh_of(state)
    return mesh


def _spec_sharded(mesh, graphdef, state, b, *, vak, tol, seed: int, params: SpecParams, max_new_tokens: int,
                  max_len: int, draft_len: int, cache_dtype, draft_dtype, trace: bool) -> dict:
    """Pad the batch to a multiple of data x fsdp (extra rows: limit 0, done at once, no stats),
    run :func:`sharded_spec_fn`, return host outputs (every row; :func:`_result` drops the padding)."""
    fn = sharded_spec_fn(mesh, state)
    relax = shd.put(np.asarray([vak, tol], np.float32), shd.replicated(mesh))
    out = fn(state, *padded_mesh_inputs(b, mesh, seed), relax,
             graphdef, params, max_new_tokens, max_len, draft_len, b.pad, cache_dtype, draft_dtype, trace)  # _STATIC
    return jax.tree.map(shd.to_host, out)


def speculative_generate(prompts, *, target=None, draft="self", chat: bool = False, max_new_tokens: int = 64,
                         k: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         seed: int = 0, dtype=None, eos_token_ids: Sequence[int] | None = None, cache_dir=None,
                         draft_sampling: str = "greedy", lossless: bool = False,
                         mesh=None, compute: str = "float32") -> tuple[list[Completion], SpecStats]:
    """Speculative counterpart of :func:`specjax.decode.generate.generate`: the same prompts/target
    arguments, plus ``draft`` (a speculators checkpoint directory, ``"self"`` / ``"self:M"``, a
    module or a :class:`SpecDraft`) and ``k``. Returns the completions and the acceptance stats.
    ``mesh`` (a ``jax.sharding.Mesh``, ``specjax.sharding.make_mesh``): a target or draft given by
    path loads sharded on it and the loop runs sharded (see :func:`speculative_generate_ids`).
    ``compute``: the matmuls' arithmetic on one CPU device (:func:`speculative_generate_ids`)."""
    lt = get_target(target, dtype, cache_dir, mesh)
    sd = load_spec_draft(draft, lt, dtype=dtype, mesh=mesh)
    ids = encode_prompts(lt, prompts, chat=chat)
    eos = lt.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    tok = lt.tokenizer
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else None
    res = speculative_generate_ids(lt.model, sd, ids, k=k, max_new_tokens=max_new_tokens,
                                   sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                                   seed=seed, eos_token_ids=eos, pad_id=pad, draft_sampling=draft_sampling,
                                   lossless=lossless, mesh=mesh, compute=compute)
    return completions(lt, ids, res), res.stats
