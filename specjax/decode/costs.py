"""What one round of each side costs on the device, at the speculative loop's own shapes: a
target decode step, a verify forward and a draft round (:func:`measure_costs`, used by
:mod:`specjax.decode.bench`)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import sharding as shd
from specjax.decode.generate import pin_cache
from specjax.decode.speculative import Pair, place_pair, split_pair
from specjax.models import panels
from specjax.models.drafts.common import greedy
from specjax.models.layers import first_argmax
from specjax.models.target import KVCache


def best_interleaved(calls, iters: int) -> list[float]:
    """calls: [(fn, args)]; each compiled + warmed, then timed round-robin ``iters`` times (a load
    change hits all of them alike); best time of each."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    best = [float("inf")] * len(calls)
    for _ in range(iters):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure_costs(target, draft, *, batch: int, prompt_len: int, max_new_tokens: int, k: int, iters: int = 5,
                  split=None, mesh=None, compute: str = "float32") -> dict:
    """Seconds of one target decode step, one verify forward and one draft round at the
    speculative loop's shapes (caches of the loop's sizes, half full), as the on-device loop pays
    them: each probe runs R and 2R rounds in one call, best of ``iters`` (interleaved), and a
    round is the difference per R (host dispatch cancels).
    ``mesh``: inputs and caches placed as the sharded loop places them (batch over data/fsdp,
    heads over tensor; ``batch`` is padded to a multiple of data x fsdp), params as in ``split``
    (default :func:`specjax.decode.speculative.place_pair`). ``compute``: the loops' matmul
    arithmetic (:func:`specjax.decode.generate.generate_ids`)."""
    batch, graphdef, state, put, put_cache, mesh = probe_setup(target, draft, batch=batch, mesh=mesh, split=split,
                                                               compute=compute, rows=batch * (k + 1))
    cfg = target.config
    S = prompt_len + max_new_tokens
    fill_host = np.full((batch,), prompt_len + max_new_tokens // 2, np.int32)
    fill = put(fill_host)
    dtype = target.model.embed_tokens.embedding[...].dtype
    tcache = put_cache(KVCache.init(cfg, batch, S, dtype, lengths=fill_host))
    taps = tuple(draft.tap_ids(cfg.num_hidden_layers))

    # Each probe runs `reps` rounds in one call (a traced trip count: one compile), every round
    # fed by the previous one's tokens, and a round costs the difference between 2R and R rounds
    # per R: what the on-device loop pays per round, without the per-call host work (flattening
    # ~300 param leaves, 1-3 ms for SmolLM2: as much as a whole draft round). The target's cache
    # is donated and handed back (lengths reset), so it is updated in place as in the loop. The
    # target probes are compiled per target (not per pair): another draft reuses them.
    tgraph, tstate = target_split(graphdef, state)
    step = functools.partial(probe_step, tgraph)
    verify = functools.partial(probe_verify, tgraph)
    ids1 = put(np.ones((batch, 1), np.int32))
    idsk = put(np.ones((batch, k + 1), np.int32))
    run_step, run_verify = cycled(step, tstate, ids1, tcache), cycled(verify, tstate, idsk, tcache)
    # the draft round's target rows (their values do not change its cost)
    aux = tuple(put(np.ones((batch, k + 1, cfg.hidden_size), np.dtype(dtype))) for _ in taps)
    draft_round = draft_round_probe(graphdef, batch=batch, cache_len=S + 2 * (k + 1), k=k, dtype=dtype, mesh=mesh)
    pos = put(fill_host[:, None] + np.arange(k + 1, dtype=np.int32)[None])
    nv = put(np.full((batch,), k + 1, np.int32))
    R = 3
    timed = best_interleaved([(run_step, (R,)), (run_step, (2 * R,)), (run_verify, (R,)), (run_verify, (2 * R,)),
                               (draft_round, (state, aux, idsk, pos, nv, fill, R)),
                               (draft_round, (state, aux, idsk, pos, nv, fill, 2 * R))], iters)
    t_step, t_verify, t_draft = (per_round(timed[i], timed[i + 1], R) for i in (0, 2, 4))
    return {"target_step_ms": round_ms(1e3 * t_step), "verify_ms": round_ms(1e3 * t_verify),
            "draft_round_ms": round_ms(1e3 * t_draft), "c": t_draft / (k * t_step),
            "verify_overhead": t_verify / t_step}


def probe_setup(target, draft, *, batch: int, mesh=None, split=None, compute: str = "float32", rows: int | None = None):
    """What the cost probes run on, as the loops run: ``(batch, graphdef, state, put, put_cache,
    mesh)`` (``mesh`` None for one device).
    One device: the pair's panel view (the weights the single-device loops stream), host arrays
    as they are. A mesh (more than one device): ``batch`` padded to a multiple of data x fsdp,
    params as in ``split`` (default :func:`specjax.decode.speculative.place_pair`), ``put(x)``
    splits a host array by batch, ``put_cache(cache)`` places a KV cache by batch and heads.
    ``compute`` / ``rows``: the panel view's arithmetic and the most rows a probe's step takes
    (:func:`specjax.models.panels.decode_state`)."""
    if mesh is not None and mesh.size <= 1:
        mesh = None
    panels.check_compute(compute, mesh)
    if mesh is not None:
        batch = shd.pad_batch(batch, mesh)
        if split is None:
            split = place_pair(target, draft, mesh)
    graphdef, state = split if split is not None else split_pair(target, draft)
    if mesh is None:
        state = panels.decode_state(Pair(target, draft), state, compute=compute, rows=rows or batch)
        return batch, graphdef, state, jnp.asarray, lambda c: c, None

    def put(x):
        x = np.asarray(x)
        return shd.put(x, shd.batch_sharding(mesh, x.ndim))

    def put_cache(cache):
        return jax.tree.map(lambda x, sh: shd.put(np.asarray(x), sh), cache, shd.kv_cache_sharding(mesh, cache))
    return batch, graphdef, state, put, put_cache, mesh


def draft_round_probe(graphdef, *, batch: int, cache_len: int, k: int, dtype, mesh=None):
    """A jitted ``(state, aux, ids, pos, n_valid, fill, reps) -> ids``: ``reps`` draft rounds in
    one call (ingest the k+1 target rows, propose k greedily), each fed by the previous round's
    first proposal, on a fresh draft cache of ``cache_len`` slots filled to ``fill``."""
    @jax.jit
    def draft_round(state, aux, ids, pos, nv, fill, reps):
        d = nnx.merge(graphdef, state).draft
        dcache = pin_cache(d.init_cache(batch, cache_len, dtype, lengths=fill), mesh)
        rows = d.aux_from_taps(aux)

        def body(_, ids):
            prop = d.speculate(dcache, rows, ids, pos, n_valid=nv, k=k, sample=greedy)
            return jnp.concatenate([prop.tokens[:, :1].astype(ids.dtype), ids[:, 1:]], axis=1)
        return jax.lax.fori_loop(0, reps, body, ids)

    return draft_round


def round_ms(ms: float) -> float:
    """A time in ms for a report, to 5 significant digits: a round the timing puts under 0.5 us (a
    tiny test model's draft) reads as the small positive number it is, where ``round(ms, 3)`` gave 0.0."""
    return float(f"{ms:.5g}")


def per_round(t_r: float, t_2r: float, R: int) -> float:
    """One round's seconds from a probe timed at R and 2R rounds in one call: the difference per R
    (host dispatch cancels); a difference lost in timing noise falls back to the 2R call's mean,
    host work included."""
    return (t_2r - t_r) / R if t_2r > t_r else t_2r / (2 * R)


def cycled(fn, state, ids, cache):
    """``call(reps)`` running ``fn(state, ids, cache, reps)`` (a probe that donates its cache and
    hands it back) on its own copy of ``cache``, kept between calls."""
    box = [jax.tree.map(jnp.copy, cache)]

    def call(reps):
        out, box[0] = fn(state, ids, box[0], reps)
        return out
    return call


def target_split(pair_graphdef, pair_state):
    """The target's own ``(graphdef, state)`` out of a pair's split (the same arrays)."""
    pair = nnx.merge(pair_graphdef, pair_state)
    return nnx.split(pair.target)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def probe_step(graphdef, state, ids, cache, reps):
    """``reps`` target decode steps (1 token, the last logit), each fed the previous argmax."""
    t = nnx.merge(graphdef, state)

    def body(_, c):
        ids, cache = c
        out = t(ids, cache=cache, logits_at=jnp.zeros((ids.shape[0],), jnp.int32))
        return first_argmax(out.logits)[:, None], out.cache.rollback(cache.lengths)
    return jax.lax.fori_loop(0, reps, body, (ids, cache))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def probe_verify(graphdef, state, ids, cache, reps, mask=None):
    """``reps`` verify forwards ([B, k+1] tokens, every logit), each fed the last's argmax;
    ``mask`` bool [B, T, T]: a token tree's verify with that tree mask. The loop's verify also
    hands the draft's taps out (a few [B, k+1, H] rows): left out here, so one compile serves
    every draft."""
    t = nnx.merge(graphdef, state)

    def body(_, c):
        ids, cache = c
        out = t(ids, cache=cache, tree_mask=mask)
        return first_argmax(out.logits), out.cache.rollback(cache.lengths)
    return jax.lax.fori_loop(0, reps, body, (ids, cache))
