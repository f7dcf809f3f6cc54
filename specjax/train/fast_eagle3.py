"""EAGLE-3 TTT training forward with block-structured attention (same math as
:meth:`specjax.models.drafts.eagle3.Eagle3Draft.__call__`, far less work).

At TTT step ``s`` a query at position ``j`` attends to the step-0 keys under the step-0 mask
(causal, same document, window) and to exactly one key of each later step ``1..s``: its own
position (the diagonal blocks of speculators' extended mask). The module's forward materialises
the dense ``[T, (s+1)T]`` scores; here the step-0 block is ``[T, T]`` and each later block is a
per-position dot product ``[T]``, joined in one softmax:

    out_j = (sum_i p0_ji v0_i + sum_{t=1..s} pd_jt v_t_j) / Z_j

so attention costs ``T^2 + sT`` instead of ``(s+1)T^2`` per step. Equality with the module's
forward is tested (``tests/train/test_fast_eagle3.py``).

In a TPU program (``kt.attention_impl() == "pallas"``) each step's attention is the splash
kernel with the TTT mask as a :func:`specjax.kernels.tpu.ttt` spec (its block sparsity skips
the same blocks, and no ``[T, T]`` scores are stored for the backward pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels import tpu as kt
from specjax.models.drafts.eagle3 import Eagle3Output, ttt_mask
from specjax.models.drafts.common import mlp_block
from specjax.models.layers import bmm_f32acc
from specjax.models.rope import apply_rope, rope_cos_sin

_NEG = -1e30


def ttt_attend(q, k0, v0, kd, vd, mask0, scale: float, *, window: int | None = None, chunk: int = 256):
    """q [B,T,Hq,D]; k0/v0 [B,T,Hkv,D] (step-0 keys); kd/vd lists of [B,T,Hkv,D] (the keys of steps
    1..s at the query's own position); mask0 bool [B,1,T,T] (causal, within ``window`` when set).
    -> [B,T,Hq,D].

    Keys/values are repeated to the query heads and scores laid out ``[B, Hq, T, S]``: plain
    batched matmuls (:func:`~specjax.models.layers.bmm_f32acc`: float32 accumulation, and
    backward products XLA's CPU backend runs natively in bf16). Queries go in static blocks of
    ``chunk`` rows, each against only the step-0 keys the causal (and window) mask can admit: for
    1024 tokens in blocks of 256, 10 of the 16 score blocks. Exact: every skipped key is masked
    for every query of the block, and no row is empty (a query always sees itself)."""
    B, T, Hq, D = q.shape
    G = Hq // k0.shape[2]

    def heads(x):  # [B,T,Hkv,D] -> [B,Hq,T,D]
        return jnp.transpose(jnp.repeat(x, G, axis=2) if G > 1 else x, (0, 2, 1, 3))

    qt, kt, vt = jnp.transpose(q, (0, 2, 1, 3)), heads(k0), heads(v0)
    kdt, vdt = [heads(k) for k in kd], [heads(v) for v in vd]
    outs = []
    for lo in range(0, T, chunk):
        hi = min(lo + chunk, T)
        k_lo = 0 if window is None else max(0, (lo - window + 1) // chunk * chunk)
        rows = slice(lo, hi)
        outs.append(_attend_block(qt[:, :, rows], kt[:, :, k_lo:hi], vt[:, :, k_lo:hi],
                                  [k[:, :, rows] for k in kdt], [v[:, :, rows] for v in vdt],
                                  mask0[:, :, rows, k_lo:hi], scale))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    return jnp.transpose(o, (0, 2, 1, 3)).astype(q.dtype)


def _attend_block(qt, kt, vt, kdt, vdt, mask, scale):
    """One block of query rows, heads leading: qt [B,Hq,C,D] against step-0 keys kt/vt
    [B,Hq,S,D] under ``mask`` [B,1,C,S] and each later step's key at the query's own position
    (kdt/vdt [B,Hq,C,D]), one softmax over all of them. -> float32 [B,Hq,C,D]."""
    s0 = bmm_f32acc(qt, kt, True, True) * scale
    s0 = jnp.where(mask, s0, _NEG)
    sd = [jnp.sum(qt.astype(jnp.float32) * k.astype(jnp.float32), axis=-1) * scale for k in kdt]  # [B,Hq,C]
    m = jnp.max(s0, axis=-1)
    for x in sd:
        m = jnp.maximum(m, x)
    m = jax.lax.stop_gradient(m)
    p0 = jnp.exp(s0 - m[..., None])
    pd = [jnp.exp(x - m) for x in sd]
    z = jnp.sum(p0, axis=-1)
    for p in pd:
        z = z + p
    o = bmm_f32acc(p0.astype(vt.dtype), vt, False, True)
    for p, v in zip(pd, vdt):
        o = o + p[..., None] * v.astype(jnp.float32)
    return o / z[..., None]


def ttt_forward(model, hidden_states, input_ids, document_ids, position_ids=None, verifier_last_hidden_states=None,
                *, ttt_steps: int = 3, stack: bool = True, attn_chunk: int = 256) -> Eagle3Output:
    """``model(...)`` of an ``Eagle3Draft`` (one packed row, after ``shift_batch``), computed with
    :func:`ttt_attend`. ``stack=False`` returns ``logits`` and ``hidden`` as tuples of per-step
    slabs (what the train step uses: the backward of a stack plus per-step slices is a padded
    ``[S, B, T, Vd]`` sum, measured at 0.13 s of a 1.2 s step). ``attn_chunk``: the query block
    of :func:`ttt_attend`."""
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = jnp.broadcast_to(1 + jnp.arange(T), (B, T))
    h = model.project_aux(hidden_states)
    pallas = kt.attention_impl() == "pallas"
    masks0 = {} if pallas else {w: ttt_mask(document_ids, w, 0) for w in model.spec.distinct_windows}
    ids0 = input_ids
    ids = input_ids
    L = len(model.layers)
    k0 = [None] * L
    v0 = [None] * L
    kd: list[list] = [[] for _ in range(L)]
    vd: list[list] = [[] for _ in range(L)]
    all_logits, all_hidden = [], []
    for s in range(ttt_steps):
        e = model.embed(ids)
        cos, sin = rope_cos_sin(position_ids + s, model.spec.rope, dtype=h.dtype)
        x = None
        for i, layer in enumerate(model.layers):
            if i == 0:
                xin, res = layer.attn_input(e, h)
            else:
                xin, res = layer.input_layernorm(x), x
            attn = layer.self_attn
            q, k, v = attn.project(xin)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if s == 0:
                k0[i], v0[i] = k, v
            else:
                kd[i].append(k)
                vd[i].append(v)
            w = model.spec.windows[i]
            if pallas:  # keys: step 0's, then each later step's (kt.ttt's chunks)
                o = kt.tpu_attention(q, jnp.concatenate([k0[i]] + kd[i], axis=1),
                                     jnp.concatenate([v0[i]] + vd[i], axis=1),
                                     mask_spec=kt.ttt(document_ids, window=w, steps_before=s), scale=attn.scaling)
            else:
                o = ttt_attend(q, k0[i], v0[i], kd[i], vd[i], masks0[w], attn.scaling, window=w,
                               chunk=attn_chunk)
            x = mlp_block(layer, res + attn.output(o))
        logits, h = model.head(x)
        all_logits.append(logits)
        all_hidden.append(h)
        ids = jnp.concatenate([ids0[:, 1 + s:], jnp.zeros((B, 1 + s), ids0.dtype)], axis=1)
    tg = None if verifier_last_hidden_states is None else model.targets(verifier_last_hidden_states)
    if not stack:
        return Eagle3Output(tuple(all_logits), tuple(all_hidden), tg)
    return Eagle3Output(jnp.stack(all_logits), jnp.stack(all_hidden), tg)
