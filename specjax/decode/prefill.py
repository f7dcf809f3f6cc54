"""Prefill: right-padded prompts through the target into a fresh KV cache, returning the logits
at each prompt's last token and any tapped hidden states. Four layouts of the same result: one
pass over ``B`` padded rows, one packed row of the prompts back to back (``packed_len``: no work
on padding), ``chunk`` tokens at a time in a ``lax.while_loop`` (work follows the longest
prompt, not the padded length), or a prefix every prompt shares (a chat template's system turn)
run once and copied into every row (``shared_prefix``)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from specjax.models.target import CausalLM, KVCache


def prefill(model: CausalLM, prompt_ids, prompt_lens, cache: KVCache, *, tap_ids: Sequence[int] = (),
            packed_len: int | None = None, chunk: int | None = None, shared_prefix: int = 0):
    """prompt_ids int [B, P] right-padded, prompt_lens int [B] >= 1. Writes the prompts into
    ``cache`` (which must start empty) and sets ``cache.lengths = prompt_lens``. Returns
    ``(last_logits [B, V], cache, aux)``; aux are [B, P, hidden] per tap id (rows past a
    prompt's length are not meaningful).

    ``packed_len`` (static): run the prompts back to back in one row of that many tokens
    (``sum(prompt_lens)`` must fit; the caller checks) instead of ``B`` rows of ``P``: the same
    result without the padding's work (a batch of 4 chat prompts of 64-195 tokens padded to 224
    is about half padding).

    ``chunk`` (static, without ``packed_len``): run the prompts ``chunk`` tokens at a time through
    the cache in a ``lax.while_loop`` of ``ceil(max(prompt_lens) / chunk)`` trips (one compile
    for the padded length, work proportional to the longest prompt rather than the padding):
    :func:`chunked_prefill`.

    ``shared_prefix`` (static; not with ``packed_len`` or ``chunk``): every row's first
    ``shared_prefix`` tokens are the same and every prompt is longer (the caller guarantees it):
    :func:`shared_prefix_prefill`."""
    B, P = prompt_ids.shape
    if shared_prefix > 0:
        if packed_len is not None or chunk is not None:
            raise ValueError("shared_prefix is its own prefill layout: pass it without packed_len or chunk")
        return shared_prefix_prefill(model, prompt_ids, prompt_lens, cache, tap_ids=tap_ids, prefix=shared_prefix)
    if packed_len is None and chunk is not None and chunk < P and chunk <= cache.max_len:
        return chunked_prefill(model, prompt_ids, prompt_lens, cache, tap_ids=tap_ids, chunk=chunk)
    if packed_len is None:
        mask = jnp.arange(P)[None, :] < prompt_lens[:, None]
        out = model(prompt_ids, positions=jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), prompt_ids.shape),
                    cache=cache, attention_mask=mask, tap_ids=tap_ids, logits_at=prompt_lens - 1)
        return out.logits, out.cache, out.aux_hidden_states
    lens = prompt_lens.astype(jnp.int32)
    ends = jnp.cumsum(lens)
    starts = ends - lens
    t = jnp.arange(packed_len, dtype=jnp.int32)
    seg = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)  # B past the last prompt
    valid = seg < B
    segc = jnp.minimum(seg, B - 1)
    pos = jnp.where(valid, t - starts[segc], 0)
    ids = jnp.where(valid, prompt_ids[segc, jnp.minimum(pos, P - 1)], 0)
    out = model(ids[None], positions=pos[None], cache=cache, segments=seg, tap_ids=tap_ids, logits_at=ends - 1)
    rows = jnp.minimum(starts[:, None] + jnp.arange(P, dtype=jnp.int32)[None], packed_len - 1)  # [B, P] -> row slot
    return out.logits, out.cache, tuple(a[0][rows] for a in out.aux_hidden_states)


def chunked_prefill(model: CausalLM, prompt_ids, prompt_lens, cache: KVCache, *, tap_ids: Sequence[int] = (),
                    chunk: int):
    """:func:`prefill` ``chunk`` tokens at a time: trip ``i`` writes positions ``i*chunk ..
    (i+1)*chunk - 1`` of every row into the cache (queries see the earlier trips' slots), and the
    loop stops after the longest prompt's last chunk, so a bucket padded far past its prompts
    costs only the prompts' chunks. Padding tokens of a shorter row land past its length, where
    nothing reads them (the cache contract). Equal to the one-pass prefill up to float
    reassociation; the aux rows come back ``[B, P, hidden]`` as there."""
    B, P = prompt_ids.shape
    C = int(chunk)
    n_layers = model.config.num_hidden_layers
    taps = tuple(int(t) for t in tap_ids)
    want = taps if n_layers in taps else taps + (n_layers,)
    trips = -(-P // C)
    ids = jnp.pad(prompt_ids, ((0, 0), (0, trips * C - P)))
    ar = jnp.arange(C, dtype=jnp.int32)
    lens = prompt_lens.astype(jnp.int32)

    def fwd(i, cache):
        s = i * C
        x = jax.lax.dynamic_slice_in_dim(ids, s, C, axis=1)
        pos = jnp.broadcast_to(s + ar, (B, C))
        out = model(x, positions=pos, cache=cache, tap_ids=want, return_logits=False)
        return out.cache, dict(zip(want, out.aux_hidden_states))

    shapes = jax.eval_shape(lambda c: fwd(jnp.zeros((), jnp.int32), c)[1], cache)
    aux0 = tuple(jnp.zeros((B, trips * C, shapes[t].shape[-1]), shapes[t].dtype) for t in taps)
    h0 = jnp.zeros((B, shapes[n_layers].shape[-1]), shapes[n_layers].dtype)

    def body(c):
        i, cache, aux, h = c
        cache, hs = fwd(i, cache)
        aux = tuple(jax.lax.dynamic_update_slice_in_dim(a, hs[t], i * C, axis=1) for a, t in zip(aux, taps))
        j = lens - 1 - i * C  # the last prompt token's index in this chunk
        here = (j >= 0) & (j < C)
        last = jnp.take_along_axis(hs[n_layers], jnp.clip(j, 0, C - 1)[:, None, None], axis=1)[:, 0]
        return i + 1, cache, aux, jnp.where(here[:, None], last, h)

    n_trips = (jnp.max(lens) + C - 1) // C
    _, cache, aux, h = jax.lax.while_loop(lambda c: c[0] < n_trips, body, (jnp.zeros((), jnp.int32), cache, aux0, h0))
    return model.head(h), cache.rollback(lens), tuple(a[:, :P] for a in aux)


def shared_prefix_prefill(model: CausalLM, prompt_ids, prompt_lens, cache: KVCache, *, tap_ids: Sequence[int] = (),
                          prefix: int):
    """:func:`prefill` of prompts that all begin with the same ``prefix`` tokens (row 0's are
    used) and are all longer than it: the prefix runs once, as a batch of one, its K/V are
    copied into every row's first ``prefix`` slots, then the rest of each prompt (``[B, P -
    prefix]``, at positions ``prefix ..``) runs over that cache. The prefix's tapped states are
    broadcast to every row. Equal to the one-pass prefill up to float reassociation; a chat
    template's system turn (the built-in prompts rendered for SmolLM2 share 24 tokens of about
    85) is then paid once per batch instead of once per row."""
    B, P = prompt_ids.shape
    S = int(prefix)
    if not 0 < S < P:
        raise ValueError(f"shared_prefix {S} must lie in (0, {P}): the padded prompt length")
    # a layer's cache [B, Hkv, S, D] or a stacked one [L, B, Hkv, S, D]: batch is the 4th axis from the end
    one = KVCache(*(jax.tree.map(lambda a: a[..., :1, :, :, :], c) for c in (cache.k, cache.v)),
                  jnp.zeros((1,), jnp.int32))
    head = model(prompt_ids[:1, :S], positions=jnp.arange(S, dtype=jnp.int32)[None], cache=one, tap_ids=tap_ids,
                 return_logits=False)

    def fill(a, h):  # row 0's prefix slots into every row
        h = h[..., :S, :]
        return jax.lax.dynamic_update_slice_in_dim(a, jnp.broadcast_to(h, a.shape[:-2] + h.shape[-2:]).astype(a.dtype),
                                                   0, axis=a.ndim - 2)

    k, v = jax.tree.map(fill, cache.k, head.cache.k), jax.tree.map(fill, cache.v, head.cache.v)
    cache = KVCache(k, v, jnp.full((B,), S, jnp.int32))
    lens = prompt_lens.astype(jnp.int32)
    pos = jnp.broadcast_to(S + jnp.arange(P - S, dtype=jnp.int32), (B, P - S))
    out = model(prompt_ids[:, S:], positions=pos, cache=cache, tap_ids=tap_ids,
                logits_at=jnp.clip(lens - 1 - S, 0, P - S - 1))
    aux = tuple(jnp.concatenate([jnp.broadcast_to(a, (B,) + a.shape[1:]), b], axis=1)
                for a, b in zip(head.aux_hidden_states, out.aux_hidden_states))
    return out.logits, out.cache.rollback(lens), aux
