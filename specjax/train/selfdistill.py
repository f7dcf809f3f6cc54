"""Self-distillation data: the target writes the assistant turns itself (batched, greedy or
sampled) and, in the same pass, records the hidden states the draft trains on.

The row of a regenerated turn is ``render(history, add_generation_prompt=True) + generated ids``
with the loss mask on the generated ids: exactly the tokens the target emitted (no decode /
re-encode drift). Its hidden states come from the same forwards that generated it: the prompt
prefill (taps over the prompt) and one decode step per generated token (taps over the token fed
at that step), plus one extra step that feeds the final token. They equal a separate prefill
over the whole row up to float rounding (checked in tests), so no second pass is needed.

Shapes: the decode loop is one ``jax.jit`` (``lax.while_loop``) per ``(batch, cache length,
max_new_tokens)``; prompts are right-padded to a multiple of ``prompt_bucket`` and each batch's KV
cache holds its own bucket + ``max_new_tokens`` slots (one prefill and one decode compile per
bucket: prompts run sorted by length, so short batches do not pay for the longest prompt's cache).
On a single-device CPU the forwards run in the panel view of the params
(:func:`specjax.models.panels.decode_state`: the native matmul and decode-attention kernels, as
the generate loop does); at most ``panels.MAX_ROWS`` rows a step take that path, so a batch of 16
streams the weights once per step where XLA's dot would re-read them at a stride.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decode.generate import emit
from specjax.decode.sampling import SamplingParams, sample
from specjax.models import panels
from specjax.models.target import KVCache

TRACE_COUNT = {"prefill": 0, "decode": 0}


class _State(NamedTuple):
    tokens: jax.Array  # int32 [B, N]
    num_tokens: jax.Array  # int32 [B]
    limit: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    eos_hit: jax.Array  # bool [B]
    last: jax.Array  # int32 [B]
    cache: KVCache
    key: jax.Array
    hs: jax.Array  # [B, N, L, H]: hidden states of generated token k (fed at decode step k)
    captured: jax.Array  # int32 [B]
    step: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "taps", "out_dtype"))
def _prefill(graphdef, params, ids, lens, cache, *, taps, out_dtype):
    TRACE_COUNT["prefill"] += 1
    model = nnx.merge(graphdef, params)
    P = ids.shape[1]
    mask = jnp.arange(P)[None, :] < lens[:, None]
    out = model(ids, positions=jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), ids.shape), cache=cache,
                attention_mask=mask, tap_ids=taps, logits_at=lens - 1)
    hs = jnp.stack(out.aux_hidden_states, axis=2).astype(out_dtype) if taps else None
    return out.logits, out.cache, hs


@functools.partial(jax.jit, static_argnames=("graphdef", "taps", "out_dtype", "max_new_tokens", "sampling", "pad_id"))
def _decode(graphdef, params, logits, cache, limits, key, eos_ids, *, taps, out_dtype, max_new_tokens, sampling,
            pad_id):
    TRACE_COUNT["decode"] += 1
    model = nnx.merge(graphdef, params)
    B = logits.shape[0]
    N = max_new_tokens
    L = len(taps)
    H = model.config.hidden_size
    key, sub = jax.random.split(key)
    first = sample(sub, logits, sampling)
    st = _State(tokens=jnp.full((B, N), pad_id, jnp.int32), num_tokens=jnp.zeros((B,), jnp.int32),
                limit=limits.astype(jnp.int32), done=limits <= 0, eos_hit=jnp.zeros((B,), bool), last=first,
                cache=cache, key=key, hs=jnp.zeros((B, N, max(L, 1), H), out_dtype),
                captured=jnp.zeros((B,), jnp.int32), step=jnp.zeros((), jnp.int32))
    st = emit(st, first[:, None], jnp.ones((B,), jnp.int32), eos_ids, pad_id)

    def cond(s):
        return jnp.any(s.captured < s.num_tokens) & (s.step <= N)

    def body(s):
        out = model(s.last[:, None], cache=s.cache, tap_ids=taps, logits_at=jnp.zeros((B,), jnp.int32))
        need = s.captured < s.num_tokens
        hs = s.hs
        if L:
            new = jnp.stack([a[:, 0] for a in out.aux_hidden_states], axis=1).astype(out_dtype)  # [B, L, H]
            slot = jnp.where(need, s.captured, N)  # N = dropped
            hs = hs.at[jnp.arange(B), slot].set(new, mode="drop")
        k, sub = jax.random.split(s.key)
        nxt = sample(sub, out.logits, sampling)
        s = s._replace(cache=out.cache, key=k, hs=hs, captured=s.captured + need.astype(jnp.int32), step=s.step + 1)
        return emit(s, nxt[:, None], jnp.ones((B,), jnp.int32), eos_ids, pad_id)

    st = jax.lax.while_loop(cond, body, st)
    return st.tokens, st.num_tokens, st.eos_hit, st.hs


@dataclass
class Generated:
    prompt_ids: list[int]
    token_ids: list[int]  # generated (EOS included when it stopped the turn)
    stop_reason: str  # "eos" | "length"
    hidden_states: np.ndarray | None  # [len(prompt) + len(generated), L, H] or None without taps


def _bucket(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def generate_with_hidden_states(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
                                taps: Sequence[int] = (), sampling: SamplingParams = SamplingParams(), seed: int = 0,
                                eos_token_ids: Sequence[int] = (), pad_id: int = 0, batch_size: int = 32,
                                prompt_bucket: int = 64, out_dtype=jnp.bfloat16, max_prompt_len: int | None = None,
                                progress: bool = True, on_batch: Callable[[list[int], list[Generated]], None] | None = None,
                                desc: str = "generating") -> list[Generated]:
    """Generate a continuation of every prompt (token ids) and, when ``taps`` are given, the
    hidden states at those layer ids for prompt + continuation. Prompts are processed in
    batches of similar length; ``on_batch(indices, results)`` is called after each batch (so a
    caller can write files and resume). Returns results in prompt order."""
    from tqdm.auto import tqdm

    cfg = model.config
    ctx = int(cfg.max_position_embeddings)
    lens = [len(p) for p in prompts]
    if any(n == 0 for n in lens):
        raise ValueError(f"prompt {lens.index(0)} is empty")
    Pmax = _bucket(max_prompt_len or max(lens), prompt_bucket)
    if Pmax + max_new_tokens > ctx:
        raise ValueError(f"prompts up to {Pmax} tokens + {max_new_tokens} new tokens exceed the context {ctx}")
    graphdef, params = nnx.split(model)
    params = panels.decode_state(model, params)
    cache_dtype = jnp.dtype(model.model.embed_tokens.embedding[...].dtype)
    order = sorted(range(len(prompts)), key=lambda i: (lens[i], i))
    eos = jnp.asarray(list(eos_token_ids), jnp.int32)
    results: list[Generated | None] = [None] * len(prompts)
    key = jax.random.key(seed)
    bar = tqdm(total=len(prompts), unit="prompt", desc=desc, disable=not progress, dynamic_ncols=True)
    t0, ntok = time.perf_counter(), 0
    taps_t = tuple(int(t) for t in taps)
    for b0 in range(0, len(order), batch_size):
        idx = order[b0: b0 + batch_size]
        B = batch_size  # fixed batch shape: one decode compile
        P = _bucket(max(lens[i] for i in idx), prompt_bucket)
        ids = np.full((B, P), pad_id, np.int32)
        plen = np.ones((B,), np.int32)
        limits = np.zeros((B,), np.int32)
        for r, i in enumerate(idx):
            ids[r, : lens[i]] = prompts[i]
            plen[r] = lens[i]
            limits[r] = max_new_tokens
        cache = KVCache.init(cfg, B, P + max_new_tokens, cache_dtype)
        logits, cache, phs = _prefill(graphdef, params, jnp.asarray(ids), jnp.asarray(plen), cache, taps=taps_t,
                                      out_dtype=out_dtype)
        key, sub = jax.random.split(key)
        toks, num, eos_hit, ghs = _decode(graphdef, params, logits, cache, jnp.asarray(limits), sub, eos, taps=taps_t,
                                          out_dtype=out_dtype, max_new_tokens=int(max_new_tokens), sampling=sampling,
                                          pad_id=int(pad_id))
        toks, num, eos_hit = np.asarray(toks), np.asarray(num), np.asarray(eos_hit)
        phs = None if phs is None else np.asarray(jax.device_get(phs))
        ghs = np.asarray(jax.device_get(ghs)) if taps_t else None
        batch_res = []
        for r, i in enumerate(idx):
            g = toks[r, : num[r]].tolist()
            hs = None
            if taps_t:
                hs = np.concatenate([phs[r, : lens[i]], ghs[r, : num[r]]], axis=0)
            res = Generated(list(map(int, prompts[i])), g, "eos" if eos_hit[r] else "length", hs)
            results[i] = res
            batch_res.append(res)
            ntok += lens[i] + len(g)
        if on_batch is not None:
            on_batch(idx, batch_res)
        bar.update(len(idx))
        bar.set_postfix_str(f"{ntok / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    bar.close()
    return results  # type: ignore[return-value]
