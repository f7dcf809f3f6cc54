"""Target-only batched generation; the whole decode loop is one ``jax.jit`` (``lax.while_loop``).

Layers (each reusable by the speculative loop):

* :func:`~specjax.decode.prefill.prefill` - run right-padded prompts through the target into a fresh :class:`KVCache`,
  returning the logits at each prompt's last token (and any tapped hidden states); with
  ``packed_len`` the prompts run back to back in one row, skipping the padding's work.
* :class:`DecodeState` - the loop carry: output buffer, per-sequence counts/limits/done flags,
  the last emitted token, the cache, the PRNG key.
* :func:`start` - prefill, then sample and emit the first token (the state both loops start from).
* :func:`~specjax.decode.batch.prepare` - host side: validate, right-pad and bucket token-id prompts, per-sequence limits.
* :func:`emit` - append a ragged number of new tokens per sequence (k+1 for a speculative step,
  1 here) with EOS / length stopping; tokens past a stop are discarded.
* :func:`generate_ids` - host entry: pads and buckets shapes, runs the jitted
  prefill + ``while_loop``, returns numpy results. Same shapes (padded prompt length, packed
  prefill length, batch, token budget) -> one compile.

Output tokens include the EOS token that stopped a sequence; ``num_tokens`` counts it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import placement
from specjax import sharding as shd
from specjax.decode.sampling import GREEDY, SamplingParams, sample
from specjax.kernels import tpu as kt
from specjax.models import panels
from specjax.decode.batch import (  # noqa: F401  (the loops' host side; also reachable from here)
    PACK_MAX, Batch, bucket, packed_length, prepare, resolve_packed_len, worth_packing,
)
from specjax.decode.prefill import chunked_prefill, prefill  # noqa: F401
from specjax.models.loading import LoadedTarget
from specjax.models.layer_scan import decode_layer_scan, stack_layer_runs, using_stacked_layers
from specjax.models.target import CausalLM, KVCache
from specjax.sharding import TARGET_RULES, constrain_cache, mesh_of, named_shardings
from specjax.sharding.placement import Placement

TRACE_COUNT = {"generate": 0}  # bumped each time the jitted loop is traced (= compiled)


class DecodeState(NamedTuple):
    step: jax.Array  # int32 scalar: loop iterations done
    tokens: jax.Array  # int32 [B, N] generated tokens (pad_id past num_tokens)
    num_tokens: jax.Array  # int32 [B]
    limit: jax.Array  # int32 [B]: max tokens this sequence may emit
    done: jax.Array  # bool [B]
    eos_hit: jax.Array  # bool [B]: stopped by EOS (vs the length limit)
    last: jax.Array  # int32 [B]: last emitted token (input of the next step)
    cache: KVCache
    key: jax.Array


def is_eos(tokens, eos_ids):
    """tokens int [...]; eos_ids int [E] (may be empty) -> bool [...]."""
    if eos_ids.shape[0] == 0:
        return jnp.zeros(tokens.shape, bool)
    return (tokens[..., None] == eos_ids).any(-1)


def emit(state: DecodeState, new_tokens, counts, eos_ids, pad_id: int) -> DecodeState:
    """Append ``new_tokens[b, :counts[b]]`` (int [B, K]) to each live sequence, truncated at the
    first EOS (kept) and at ``limit``; sets ``done``/``eos_hit``. Done sequences emit nothing."""
    B, K = new_tokens.shape
    N = state.tokens.shape[1]
    j = jnp.arange(K)[None, :]
    valid = (j < counts[:, None]) & ~state.done[:, None]
    eos = is_eos(new_tokens, eos_ids) & valid
    # keep tokens up to and including the first EOS
    before_eos = jnp.cumsum(eos.astype(jnp.int32), axis=1) - eos.astype(jnp.int32) == 0
    valid &= before_eos
    room = state.limit - state.num_tokens
    valid &= j < room[:, None]
    n_new = valid.sum(1).astype(jnp.int32)
    slots = jnp.where(valid, state.num_tokens[:, None] + j, N)  # N = dropped
    tokens = state.tokens.at[jnp.arange(B)[:, None], slots].set(new_tokens.astype(jnp.int32), mode="drop")
    num = state.num_tokens + n_new
    hit = (eos & valid).any(1)
    last_idx = jnp.maximum(n_new - 1, 0)
    last = jnp.where(n_new > 0, jnp.take_along_axis(new_tokens, last_idx[:, None], axis=1)[:, 0], state.last)
    done = state.done | hit | (num >= state.limit)
    return state._replace(tokens=tokens, num_tokens=num, done=done, eos_hit=state.eos_hit | hit,
                          last=last.astype(jnp.int32))


def start(model: CausalLM, prompt_ids, prompt_lens, limits, key, eos_ids, *, max_new_tokens: int, max_len: int,
          sampling: SamplingParams, pad_id: int, cache_dtype, tap_ids: Sequence[int] = (), mesh=None,
          packed_len: int | None = None, prefill_chunk: int | None = None, shared_prefix: int = 0,
          stacked: bool | None = None):
    """Prefill into a fresh cache, sample and emit the first token. Returns ``(DecodeState, aux)``
    (aux: the prompt rows' tapped hidden states, for a draft). ``mesh``: pin the KV cache to
    ``specjax.sharding.kv_cache_sharding`` (batch on data/fsdp, heads on tensor). ``stacked``:
    the cache's layout (default :func:`specjax.models.layer_scan.decode_layer_scan`; a tree loop
    passes False)."""
    B = prompt_ids.shape[0]
    stacked = decode_layer_scan(model) if stacked is None else stacked
    cache = pin_cache(KVCache.init(model.config, B, kt.cache_slots(max_len), cache_dtype, stacked=stacked), mesh)
    logits, cache, aux = prefill(model, prompt_ids, prompt_lens, cache, tap_ids=tap_ids, packed_len=packed_len,
                                 chunk=prefill_chunk, shared_prefix=shared_prefix)
    cache = pin_cache(cache, mesh)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, sampling)
    st = DecodeState(step=jnp.zeros((), jnp.int32), tokens=jnp.full((B, max_new_tokens), pad_id, jnp.int32),
                     num_tokens=jnp.zeros((B,), jnp.int32), limit=limits.astype(jnp.int32),
                     done=limits <= 0, eos_hit=jnp.zeros((B,), bool), last=first, cache=cache, key=key)
    return emit(st, first[:, None], jnp.ones((B,), jnp.int32), eos_ids, pad_id), aux


def pin_cache(cache, mesh):
    """``cache`` constrained to ``specjax.sharding.kv_cache_sharding`` on ``mesh`` (batch on
    data/fsdp, heads on tensor) inside a traced loop; unchanged without a mesh."""
    if mesh is None:
        return cache
    return constrain_cache(cache, mesh)


class Capture(NamedTuple):
    """The generate loop's record of tapped hidden states (``tap_ids`` given): generated token
    ``j``'s states come from the step that feeds it, so the loop runs one step past the last token."""

    hs: jax.Array  # [B, N, L, H]: the tapped states of generated token j
    captured: jax.Array  # int32 [B]: tokens whose states are recorded


def _generate_core(model: CausalLM, prompt_ids, prompt_lens, limits, key, eos_ids, *, max_new_tokens: int,
                   max_len: int, sampling: SamplingParams, pad_id: int, cache_dtype, mesh=None,
                   packed_len: int | None = None, prefill_chunk: int | None = None, tap_ids: Sequence[int] = (),
                   capture_dtype=None, shared_prefix: int = 0):
    """The loop. Returns ``(tokens, num_tokens, eos_hit)``; with ``tap_ids`` also the prompt rows'
    tapped states ``[B, P, L, H]`` and the generated tokens' ``[B, N, L, H]`` (:class:`Capture`),
    in ``capture_dtype`` (the self-distillation data path)."""
    B = prompt_ids.shape[0]
    taps = tuple(int(t) for t in tap_ids)
    st, aux = start(model, prompt_ids, prompt_lens, limits, key, eos_ids, max_new_tokens=max_new_tokens,
                    max_len=max_len, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, mesh=mesh,
                    packed_len=packed_len, prefill_chunk=prefill_chunk, tap_ids=taps, shared_prefix=shared_prefix)
    # the decode layer scan: the layers' weights stacked once here, not in every step
    stacks = stack_layer_runs(model, taps) if st.cache.stacked else None
    if not taps:
        def cond(s: DecodeState):
            return (s.step < max_new_tokens - 1) & ~jnp.all(s.done)

        def body(s: DecodeState):
            return decode_step(model, s, eos_ids, sampling=sampling, pad_id=pad_id, mesh=mesh)

        with using_stacked_layers(model, stacks):
            st = jax.lax.while_loop(cond, body, st)
        return st.tokens, st.num_tokens, st.eos_hit
    cap = Capture(jnp.zeros((B, max_new_tokens, len(taps), model.config.hidden_size), capture_dtype),
                  jnp.zeros((B,), jnp.int32))

    def cond_capture(c):
        s, cap = c
        return jnp.any(cap.captured < s.num_tokens) & (s.step <= max_new_tokens)

    def body_capture(c):
        s, cap = c
        need = cap.captured < s.num_tokens  # the token fed now (the last emitted) is not recorded yet
        s2, out_taps = decode_step_taps(model, s, eos_ids, sampling=sampling, pad_id=pad_id, mesh=mesh, tap_ids=taps)
        new = jnp.stack([a[:, 0] for a in out_taps], axis=1).astype(capture_dtype)  # [B, L, H]
        slot = jnp.where(need, cap.captured, max_new_tokens)  # max_new_tokens = dropped
        return s2, Capture(cap.hs.at[jnp.arange(B), slot].set(new, mode="drop"), cap.captured + need.astype(jnp.int32))

    with using_stacked_layers(model, stacks):
        st, cap = jax.lax.while_loop(cond_capture, body_capture, (st, cap))
    return st.tokens, st.num_tokens, st.eos_hit, jnp.stack(aux, axis=2).astype(capture_dtype), cap.hs


def decode_step(model: CausalLM, s: DecodeState, eos_ids, *, sampling: SamplingParams, pad_id: int,
                mesh=None) -> DecodeState:
    """One iteration of the generate loop: a target forward of each sequence's last token over
    its cache, sample, emit. (A program of its own for per-step figures: ``cost_analysis``
    counts a ``while_loop`` body once.)"""
    return decode_step_taps(model, s, eos_ids, sampling=sampling, pad_id=pad_id, mesh=mesh)[0]


def decode_step_taps(model: CausalLM, s: DecodeState, eos_ids, *, sampling: SamplingParams, pad_id: int,
                     mesh=None, tap_ids: Sequence[int] = ()) -> tuple[DecodeState, tuple]:
    """:func:`decode_step`, also returning the fed tokens' tapped hidden states (``[B, 1, H]`` per
    tap id)."""
    B = s.last.shape[0]
    out = model(s.last[:, None], cache=s.cache, tap_ids=tuple(tap_ids), logits_at=jnp.zeros((B,), jnp.int32))
    k, sub = jax.random.split(s.key)
    nxt = sample(sub, out.logits, sampling)
    s = s._replace(step=s.step + 1, cache=pin_cache(out.cache, mesh), key=k)
    return emit(s, nxt[:, None], jnp.ones((B,), jnp.int32), eos_ids, pad_id), out.aux_hidden_states


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "sampling", "pad_id",
                                             "cache_dtype", "packed_len", "prefill_chunk", "platform", "tap_ids",
                                             "capture_dtype", "shared_prefix"))
def _generate_jit(graphdef, params, prompt_ids, prompt_lens, limits, key, eos_ids, *, max_new_tokens, max_len,
                  sampling, pad_id, cache_dtype, packed_len=None, prefill_chunk=None, platform=None, tap_ids=(),
                  capture_dtype=None, shared_prefix=0):
    """``platform`` (static: part of the trace cache key): where the params live, read by the
    platform-specific layers (:mod:`specjax.placement`)."""
    TRACE_COUNT["generate"] += 1
    with placement.building_for(platform):
        model = nnx.merge(graphdef, params)
        return _generate_core(model, prompt_ids, prompt_lens, limits, key, eos_ids, max_new_tokens=max_new_tokens,
                              max_len=max_len, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype,
                              packed_len=packed_len, prefill_chunk=prefill_chunk, tap_ids=tap_ids,
                              capture_dtype=capture_dtype, shared_prefix=shared_prefix)


def generate_padded(graphdef, params, prompt_ids, prompt_lens, limits, key, eos_ids, *, max_new_tokens: int,
                    max_len: int, sampling: SamplingParams, pad_id: int, cache_dtype, tap_ids: Sequence[int] = (),
                    capture_dtype=None, packed_len: int | None = None, shared_prefix: int = 0):
    """The jitted loop on one device over already padded arrays (``params`` as placed: pass the
    panel view, :func:`specjax.models.panels.decode_state`, on a CPU); one compile per shape.
    ``shared_prefix``: every row starts with the same that many tokens and is longer
    (:func:`specjax.decode.prefill.shared_prefix_prefill`).
    Returns :func:`_generate_core`'s tuple (with the captured states when ``tap_ids`` are given)."""
    return _generate_jit(graphdef, params, prompt_ids, prompt_lens, limits, key, eos_ids,
                         max_new_tokens=int(max_new_tokens), max_len=int(max_len), sampling=sampling, pad_id=int(pad_id),
                         cache_dtype=cache_dtype, packed_len=packed_len, platform=placement.platform_of(params),
                         tap_ids=tuple(int(t) for t in tap_ids),
                         capture_dtype=None if capture_dtype is None else jnp.dtype(capture_dtype),
                         shared_prefix=int(shared_prefix))


_MESH_JITS: dict = {}
_STATIC = ("graphdef", "max_new_tokens", "max_len", "sampling", "pad_id", "cache_dtype")


def mesh_loop_jit(name: str, mesh, state, run, *, num_static: int, extra_inputs: int = 0, out_shardings=None):
    """A decode loop's ``run(state, prompt_ids, prompt_lens, limits, key_data, eos_ids, *extra,
    *static)`` jitted for ``mesh`` with the loops' explicit shardings: ``state`` (params) in its
    own shardings, prompts ``[B, P]`` / lengths / limits ``[B]`` split by batch over
    ``("data", "fsdp")``, key data, EOS ids and the ``extra_inputs`` replicated, outputs
    replicated (every process can read them) unless ``out_shardings`` says otherwise; the last
    ``num_static`` positional arguments static. Cached per (``name``, mesh, state structure,
    shardings): ``run`` must depend on nothing else."""
    p_sh = shd.shardings_of(state)
    key = (name, mesh, jax.tree.structure(state), tuple(jax.tree.leaves(p_sh)))
    fn = _MESH_JITS.get(key)
    if fn is None:
        b1, b2, rep = shd.batch_sharding(mesh, 1), shd.batch_sharding(mesh, 2), shd.replicated(mesh)
        n_in = 6 + extra_inputs
        fn = jax.jit(run, static_argnums=tuple(range(n_in, n_in + num_static)),
                     in_shardings=(p_sh, b2, b1, b1, rep, rep) + (rep,) * extra_inputs,
                     out_shardings=rep if out_shardings is None else out_shardings)
        _MESH_JITS[key] = fn
    return fn


def sharded_generate_fn(mesh, params):
    """The generate loop jitted for ``mesh`` (:func:`mesh_loop_jit`): params in their own
    shardings, prompts / lengths / limits split by batch, PRNG key data and EOS ids replicated,
    outputs (tokens, counts, eos flags) replicated; the KV cache is pinned inside (batch on
    data/fsdp, heads on tensor). Static arguments in ``_STATIC`` order."""

    def run(params, prompt_ids, prompt_lens, limits, key_data, eos_ids, graphdef, max_new_tokens, max_len,
            sampling, pad_id, cache_dtype):
        TRACE_COUNT["generate"] += 1
        with placement.building_for(mesh):
            model = nnx.merge(graphdef, params)
            return _generate_core(model, prompt_ids, prompt_lens, limits, jax.random.wrap_key_data(key_data),
                                  eos_ids, max_new_tokens=max_new_tokens, max_len=max_len, sampling=sampling,
                                  pad_id=pad_id, cache_dtype=cache_dtype, mesh=mesh)

    rep = shd.replicated(mesh)
    return mesh_loop_jit("generate", mesh, params, run, num_static=len(_STATIC), out_shardings=(rep, rep, rep))


def _generate_sharded(mesh, graphdef, params, b: "Batch", *, seed: int, max_new_tokens: int, max_len: int,
                      sampling: SamplingParams, cache_dtype):
    """Pad the batch to a multiple of data x fsdp (extra rows: limit 0, done at once), run the
    sharded loop, return the real rows. Multi-process: every process calls this with the same
    prompts and gets the same result."""
    B = b.ids.shape[0]
    fn = sharded_generate_fn(mesh, params)
    toks, num, eos_hit = fn(params, *padded_mesh_inputs(b, mesh, seed), graphdef, int(max_new_tokens), int(max_len),
                            sampling, b.pad, cache_dtype)  # static, in _STATIC order
    return np.asarray(toks)[:B], np.asarray(num)[:B], np.asarray(eos_hit)[:B]


def padded_mesh_inputs(b: "Batch", mesh, seed: int, *, abstract: bool = False) -> tuple:
    """``(ids, lens, limits, key_data, eos)`` on ``mesh``: the batch padded to a multiple of
    data x fsdp (extra rows: length 1, limit 0, so they are done at once) and split over the batch
    axes; the key and EOS ids replicated. ``abstract``: the same as ``jax.ShapeDtypeStruct`` with
    those shardings (shapes and dtypes only; nothing is placed: a deviceless compile)."""
    B = b.ids.shape[0]
    Bp = shd.pad_batch(B, mesh)
    ids = np.full((Bp, b.ids.shape[1]), b.pad, np.int32)
    ids[:B] = b.ids
    lens = np.ones((Bp,), np.int32)
    lens[:B] = b.lens
    limits = np.zeros((Bp,), np.int32)
    limits[:B] = b.limits
    b1, b2, rep = shd.batch_sharding(mesh, 1), shd.batch_sharding(mesh, 2), shd.replicated(mesh)
    key_data = np.asarray(jax.random.key_data(jax.random.key(seed)))
    host = ((ids, b2), (lens, b1), (limits, b1), (key_data, rep), (np.asarray(b.eos, np.int32), rep))
    if abstract:
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in host)
    return tuple(shd.put(a, sh) for a, sh in host)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per sequence (EOS included when it stopped the sequence)
    stop_reasons: list[str]  # "eos" | "length"
    prompt_lengths: list[int]


def cache_dtype_of(model: CausalLM):
    return jnp.dtype(model.model.embed_tokens.embedding.get_value().dtype)


def generate_ids(model: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                 sampling: SamplingParams = GREEDY, seed: int = 0, eos_token_ids: Sequence[int] | None = None,
                 pad_id: int | None = None, context_length: int | None = None,
                 prompt_bucket: int = 32, mesh=None, packed_len: int | str | None = "auto",
                 prefill_chunk: int | None = None, split=None, limit: int | None = None,
                 compute: str = "float32") -> GenerationResult:
    """Generate continuations of token-id prompts (a batch, ragged lengths allowed).

    ``compute``: ``"float32"`` (the params' arithmetic) or ``"bfloat16"``: on one CPU device with
    the kernels, every matmul in bf16 with float32 sums (:func:`specjax.models.panels.decode_state`:
    half the weight bytes a step streams, AMX tiles where the CPU has them); refused sharded.

    Each sequence stops at the first token in ``eos_token_ids`` (default: the config's; ``[]``
    disables EOS) or after ``max_new_tokens``, or when it reaches ``context_length`` (default
    the config's ``max_position_embeddings``). Prompts are right-padded to a multiple of
    ``prompt_bucket`` so nearby lengths share one compiled program.

    Sharded: when the model's params live on a multi-device mesh (``specjax.sharding.load_target``
    / ``shard_params``), or ``mesh`` is given (params not on it are placed, as a copy, by
    ``specjax.sharding.TARGET_RULES``), the loop runs under :func:`sharded_generate_fn` (explicit
    in/out shardings; the batch is padded to a multiple of data x fsdp).

    ``packed_len``: the prefill runs the prompts back to back in one row of this many tokens
    (:func:`prefill`; static, so a fixed value shares one compile across batches); "auto" (the
    default) :func:`packed_length`, None the right-padded layout. Sharded runs keep the padded
    layout (the batch is split over devices).

    ``prefill_chunk``: without a packed prefill, run the prompts through the cache this many
    tokens at a time, stopping after the longest one (:func:`chunked_prefill`): for prompts padded
    far past their length to share one compile (a fixed ``prompt_bucket``). Single device only.

    ``split``: a cached ``nnx.split(model)`` to skip re-splitting the module on every call.

    ``limit``: stop each sequence after this many tokens (1..max_new_tokens) in the program
    compiled for ``max_new_tokens`` (a runtime value: no recompile; shapes, caches and prefill as
    for ``max_new_tokens``).
    """
    b = prepare(model.config, prompts, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, pad_id=pad_id,
                context_length=context_length, prompt_bucket=prompt_bucket, limit=limit)
    P = b.padded_len
    max_len = min(P + max_new_tokens, max(b.context_length, P))
    graphdef, params = split if split is not None else nnx.split(model)
    placed = mesh_of(params)
    if mesh is not None and mesh.size > 1 and placed != mesh:  # place a copy by the target rules
        params = jax.device_put(params, named_shardings(params, TARGET_RULES, mesh))
    mesh = placed if mesh is None else mesh
    panels.check_compute(compute, mesh)
    if mesh is not None and mesh.size > 1:
        toks, num, eos_hit = _generate_sharded(mesh, graphdef, params, b, seed=seed, max_new_tokens=max_new_tokens,
                                               max_len=max_len, sampling=sampling, cache_dtype=cache_dtype_of(model))
        return GenerationResult(tokens=[toks[i, : num[i]].tolist() for i in range(len(prompts))],
                                stop_reasons=["eos" if e else "length" for e in eos_hit],
                                prompt_lengths=b.lens.tolist())
    packed_len = resolve_packed_len(packed_len, b)
    params = panels.decode_state(model, params, compute=compute, rows=len(prompts))
    toks, num, eos_hit = _generate_jit(graphdef, params, jnp.asarray(b.ids), jnp.asarray(b.lens),
                                       jnp.asarray(b.limits), jax.random.key(seed), jnp.asarray(b.eos, jnp.int32),
                                       max_new_tokens=int(max_new_tokens), max_len=int(max_len), sampling=sampling,
                                       pad_id=b.pad, cache_dtype=cache_dtype_of(model), packed_len=packed_len,
                                       prefill_chunk=None if prefill_chunk is None else int(prefill_chunk),
                                       platform=placement.platform_of(params))
    toks, num, eos_hit = np.asarray(toks), np.asarray(num), np.asarray(eos_hit)
    return GenerationResult(tokens=[toks[i, : num[i]].tolist() for i in range(len(prompts))],
                            stop_reasons=["eos" if e else "length" for e in eos_hit], prompt_lengths=b.lens.tolist())


# ----------------------------------------------------------------------------- public API


@dataclass
class Completion:
    text: str | None  # None when the target has no tokenizer
    token_ids: list[int]
    prompt_token_ids: list[int]
    stop_reason: str  # "eos" | "length"


_LOADED: dict = {}


def get_target(target, dtype, cache_dir, mesh=None):
    """A ``LoadedTarget`` from what the Python API takes (a LoadedTarget, a ``CausalLM``, a source
    string or None for the default), loaded once per (source, dtype, mesh) in this process."""
    if isinstance(target, LoadedTarget):
        return target
    if isinstance(target, CausalLM):
        return LoadedTarget(target, target.config, None, "<module>", "module")
    key = (None if target is None else str(target), str(dtype), mesh)
    if key not in _LOADED:
        _LOADED[key] = Placement.of(mesh).load_target(target, dtype=dtype, cache_dir=cache_dir)
    return _LOADED[key]


def generate(prompts, *, target=None, chat: bool = False, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, dtype=None, eos_token_ids: Sequence[int] | None = None,
             cache_dir=None, mesh=None, compute: str = "float32") -> list[Completion]:
    """Target-only generation.

    prompts: a string, a list of strings, or a list of token-id lists. target: None/"default"
    (embedded SmolLM2), a .gguf path, an HF directory, a cached HF repo id, a ``LoadedTarget``
    or a ``CausalLM`` (ids only). chat=True renders each string prompt as one user message
    through the model's chat template. temperature 0 is greedy. Returns one
    :class:`Completion` per prompt. Loaded targets are memoised per (target, dtype, mesh).
    ``mesh`` (a ``jax.sharding.Mesh`` from ``specjax.sharding.make_mesh``): load a target given by
    path sharded on it; a target already sharded runs sharded whatever ``mesh`` says.
    ``compute``: the matmuls' arithmetic on one CPU device (:func:`generate_ids`).
    """
    lt = get_target(target, dtype, cache_dir, mesh)
    tok = lt.tokenizer
    ids = encode_prompts(lt, prompts, chat=chat)
    eos = lt.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else None
    res = generate_ids(lt.model, ids, max_new_tokens=max_new_tokens,
                       sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed,
                       eos_token_ids=eos, pad_id=pad, compute=compute)
    return completions(lt, ids, res)


def encode_prompts(lt, prompts, *, chat: bool = False) -> list[list[int]]:
    """A string, a list of strings or a list of token-id lists -> token-id lists (chat=True renders
    each string as one user message through the chat template)."""
    tok = lt.tokenizer
    if isinstance(prompts, str):
        prompts = [prompts]
    ids: list[list[int]] = []
    for p in list(prompts):
        if isinstance(p, str):
            if tok is None:
                raise ValueError(f"target {lt.source} has no tokenizer (no tokenizer.json, or a GGUF without one); "
                                 "text prompts need one, token-id prompts do not")
            if chat:
                ids.append(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=True))
            else:
                ids.append(tok.encode(p))
        else:
            ids.append([int(t) for t in p])
    return ids


def completions(lt, ids, res: GenerationResult) -> list[Completion]:
    tok = lt.tokenizer
    return [Completion(text=None if tok is None else tok.decode(t, skip_special_tokens=True), token_ids=t,
                       prompt_token_ids=p, stop_reason=r) for p, t, r in zip(ids, res.tokens, res.stop_reasons)]
