"""Per-algorithm losses and metrics on top of the drafts' training forwards.

Metrics are ``{name: (sum, total)}`` pairs, reduced by summing and divided once
(speculators' ``normalize_counted_metrics``), so batches and devices pool exactly.

EAGLE-3 (``speculators.models.eagle3.metrics``): step ``s`` compares ``logits[s][:, :T-s]``
with ``targets[:, s:]`` under ``loss_mask[:, s:]``; loss ``sum_s gamma^s * L_s``; ``full_acc_s``
= masked positions whose greedy draft matched at steps 0..s (running ``prev_correct``, started
from the loss mask and updated in place on its first ``T-s`` entries); ``cond_acc_s`` = matches
at ``s`` / positions still correct before ``s``.

DFlash (``speculators.models.dflash.metrics``): slot ``k = index % block_size``; fixed-exp-decay
or D-PACE weights; ``position_k_acc``, ``full_acc`` and ``eal`` (per-block leading run of correct
valid slots + 1).

P-EAGLE (``speculators.models.peagle.metrics``): one compound loss over all COD elements, no
depth decay; ``full_acc`` and ``position_d_acc`` by depth.

DSpark (``speculators.models.dspark.metrics``): the DFlash loss and metrics on the Markov-corrected
logits, plus ``alpha * BCE(confidence, stopgrad(1 - TV))`` with fixed-exp-decay weights and
denominator ``sum(m) + 1e-8``; ``accept_rate``, ``accept_len`` (per valid block ``1 + sum_k
prod_{i<=k} alpha_i m_i``) and the confidence calibration metrics.

MTP (``speculators.models.mtp.core``): hard-label CE per step, ``w_k * sum CE / max(#valid, 1)``,
``w_k = beta^k / sum_j beta^j``; ``loss_step_k`` (weighted) and ``acc_step_k`` (specjax's addition:
argmax accuracy against the label, per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specjax.models.layers import first_argmax
from specjax.train.losses import (
    LOSSES, compound_loss, dflash_decay, dpace_weights, kl_div_prepared, kl_target_stats, loss_function, tv,
)


def eagle3_objective(logits, targets, loss_mask, *, loss_spec=(("kl_div", 1.0),), ttt_step_loss_decay: float = 1.0):
    """logits [S, B, T, Vd] (one slab per TTT step; or a sequence of S [B, T, Vd] slabs),
    targets [B, T, Vd], loss_mask [B, T].
    Returns (loss, metrics)."""
    S = len(logits)
    B, T = logits[0].shape[:2]
    lm_full = loss_mask
    prev = loss_mask.astype(bool)
    tgt_ids = first_argmax(targets)
    # A lone kl_div term (the default): the target softmax once for all steps, and the fused loss.
    kl_only = len(loss_spec) == 1 and loss_spec[0][0] == "kl_div"
    stats = kl_target_stats(targets) if kl_only else None
    loss = jnp.zeros((), jnp.float32)
    metrics = {}
    for s in range(S):
        lg = logits[s][:, : T - s]
        tg = targets[:, s:]
        m = lm_full[:, s:]
        pc = prev[:, : T - s]
        w = ttt_step_loss_decay ** s
        decay = (lambda el, w=w: jnp.full_like(el, w)) if w != 1.0 else None
        if kl_only:
            p, plogp, psum = (x[:, s:] for x in stats)
            l_s = loss_spec[0][1] * loss_function(
                lg, None, m, lambda lg_, _, p=p, plogp=plogp, psum=psum: kl_div_prepared(lg_, p, plogp, psum), decay)
            terms = {}
        else:
            l_s, terms = compound_loss(lg, tg, m, loss_spec, decay=decay)
        loss = loss + l_s
        pred = first_argmax(lg)
        correct = pred == tgt_ids[:, s:]
        cond_total = pc.sum().astype(jnp.float32)
        both = pc & correct
        prev = prev.at[:, : T - s].set(both)
        mb = m.astype(bool)
        full_correct = (both & mb).sum().astype(jnp.float32)
        full_total = mb.sum().astype(jnp.float32)
        one = jnp.ones((), jnp.float32)
        metrics[f"loss_{s}"] = (jax.lax.stop_gradient(l_s), one)
        for name, v in terms.items():
            metrics[f"{name}_{s}"] = (v, one)
        metrics[f"full_acc_{s}"] = (full_correct, full_total)
        metrics[f"cond_acc_{s}"] = (full_correct, cond_total)
    metrics["loss"] = (jax.lax.stop_gradient(loss), jnp.ones((), jnp.float32))
    return loss, metrics


def dflash_objective(logits, targets, loss_mask, *, block_size: int, loss_spec=(("ce", 1.0),),
                     per_position_loss_weight: str = "dpace", gamma: float = 4.0, dpace_alpha: float = 0.5,
                     sample_from_anchor: bool = False):
    """logits/targets [B, N*Bk, Vd], loss_mask [B, N*Bk] (already aligned, anchor-valid masked)."""
    B, Q = loss_mask.shape
    pos = jnp.broadcast_to(jnp.arange(Q) % block_size, (B, Q))
    if per_position_loss_weight == "dpace":
        def decay(el):
            return dpace_weights(el, loss_mask, block_size, dpace_alpha)
    else:
        w = dflash_decay(pos, gamma, sample_from_anchor)

        def decay(el):
            return w
    loss, terms = compound_loss(logits, targets, loss_mask, loss_spec, decay)
    pred = first_argmax(logits)
    tid = first_argmax(targets)
    mb = loss_mask.astype(bool)
    correct = (pred == tid) & mb
    one = jnp.ones((), jnp.float32)
    metrics = {"loss": (jax.lax.stop_gradient(loss), one)}
    for name, v in terms.items():
        metrics[name] = (v, one)
    start = 0 if sample_from_anchor else 1
    cpp = jnp.zeros(block_size).at[pos.reshape(-1)].add(correct.reshape(-1).astype(jnp.float32))
    tpp = jnp.zeros(block_size).at[pos.reshape(-1)].add(mb.reshape(-1).astype(jnp.float32))
    metrics["full_acc"] = (cpp[start:].sum(), tpp[start:].sum())
    for k in range(start, block_size):
        metrics[f"position_{k}_acc"] = (cpp[k], tpp[k])
    c = (pred == tid).reshape(-1, block_size)[:, start:]
    v = mb.reshape(-1, block_size)[:, start:]
    acc = (c & v).astype(jnp.float32)
    per_block = jnp.cumprod(acc, axis=-1).sum(-1) + 1.0
    bv = v.any(-1).astype(jnp.float32)
    metrics["eal"] = ((per_block * bv).sum(), bv.sum())
    return loss, metrics


def peagle_objective(logits, targets, loss_mask, depth, *, num_depths: int, loss_spec=(("kl_div", 1.0),)):
    """logits/targets [B, N, Vd] over the COD elements, loss_mask [B, N] (``loss_mask[orig]``,
    zero on padding elements), depth int [B, N]."""
    loss, terms = compound_loss(logits, targets, loss_mask, loss_spec)
    correct = (first_argmax(logits) == first_argmax(targets)) & loss_mask.astype(bool)
    d = jnp.clip(depth, 0, num_depths - 1).reshape(-1)
    cpp = jnp.zeros(num_depths).at[d].add(correct.reshape(-1).astype(jnp.float32))
    tpp = jnp.zeros(num_depths).at[d].add(loss_mask.astype(bool).reshape(-1).astype(jnp.float32))
    one = jnp.ones((), jnp.float32)
    metrics = {"loss": (jax.lax.stop_gradient(loss), one), "full_acc": (cpp.sum(), tpp.sum())}
    for name, v in terms.items():
        metrics[name] = (v, one)
    for k in range(num_depths):
        metrics[f"position_{k}_acc"] = (cpp[k], tpp[k])
    return loss, metrics


def dspark_objective(logits, targets, confidence, loss_mask, *, block_size: int, loss_spec=(("kl_div", 1.0),),
                     per_position_loss_weight: str = "fixed-exp-decay", gamma: float = 4.0, dpace_alpha: float = 0.5,
                     sample_from_anchor: bool = True, confidence_head_alpha: float = 1.0):
    """logits (Markov-corrected) / targets [B, N*Bk, Vd], confidence [B, N*Bk] logits or None,
    loss_mask [B, N*Bk] (aligned, anchor-valid masked)."""
    loss, metrics = dflash_objective(logits, targets, loss_mask, block_size=block_size, loss_spec=loss_spec,
                                     per_position_loss_weight=per_position_loss_weight, gamma=gamma,
                                     dpace_alpha=dpace_alpha, sample_from_anchor=sample_from_anchor)
    B, Q = loss_mask.shape
    N = Q // block_size
    start = 0 if sample_from_anchor else 1
    m = loss_mask.astype(jnp.float32)
    accept = jax.lax.stop_gradient(1.0 - tv(logits, targets))  # [B, Q]
    draft_mask = m.reshape(B, N, block_size)[..., start:]
    accept_prefix = jnp.cumprod(accept.reshape(B, N, block_size)[..., start:] * draft_mask, axis=-1)
    row_total = jnp.maximum(m.sum(-1), 1.0)  # per packed row, as each rank clamps its own
    if confidence is not None:
        c = confidence.astype(jnp.float32)
        bce = optax.sigmoid_binary_cross_entropy(c, accept)  # torch's BCE-with-logits, per element
        pos = jnp.broadcast_to(jnp.arange(Q) % block_size, (B, Q))
        w = dflash_decay(pos, gamma, sample_from_anchor)  # D-PACE wants token CE: BCE stays on fixed decay
        conf_loss = jnp.mean(jnp.sum(bce * m * w, -1) / (m.sum(-1) + 1e-8))
        loss = loss + confidence_head_alpha * conf_loss
        prob = jax.lax.stop_gradient(jax.nn.sigmoid(c))
        conf_prefix = jnp.cumprod(prob.reshape(B, N, block_size)[..., start:] * draft_mask, axis=-1)
        one = jnp.ones((), jnp.float32)
        metrics["confidence_loss"] = (jax.lax.stop_gradient(conf_loss), one)
        metrics["confidence_abs_error"] = ((jnp.abs(prob - accept) * m).sum(), row_total.sum())
        metrics["confidence_pred_mean"] = ((prob * m).sum(), row_total.sum())
        metrics["confidence_cumprod_bias"] = (((conf_prefix - accept_prefix) * draft_mask).sum(),
                                              jnp.maximum(draft_mask.sum((1, 2)), 1.0).sum())
    metrics["loss"] = (jax.lax.stop_gradient(loss), jnp.ones((), jnp.float32))
    metrics["accept_rate"] = ((accept * m).sum(), row_total.sum())
    per_block = accept_prefix.sum(-1) + 1.0
    block_valid = (draft_mask.sum(-1) > 0).astype(jnp.float32)
    metrics["accept_len"] = ((per_block * block_valid).sum(), jnp.maximum(block_valid.sum(-1), 1.0).sum())
    return loss, metrics


def mtp_step_weights(beta: float, num_steps: int) -> tuple[float, ...]:
    """speculators' ``compute_step_weights``: ``beta^k / sum_j beta^j``."""
    raw = [beta ** k for k in range(num_steps)]
    total = sum(raw)
    return tuple(w / total for w in raw)


def mtp_objective(logits, labels, *, step_weights, ignore_index: int = -100):
    """logits [K, B, Tv, V], labels [K, B, Tv] (``ignore_index`` where not supervised);
    ``step_weights`` one per configured step (the first K are used when a short row caps K)."""
    K = logits.shape[0]
    one = jnp.ones((), jnp.float32)
    loss = jnp.zeros((), jnp.float32)
    metrics = {}
    for k in range(K):
        lab = labels[k]
        ok = lab != ignore_index
        lsm = jax.nn.log_softmax(logits[k].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(lsm, jnp.where(ok, lab, 0)[..., None], axis=-1)[..., 0]
        nll = jnp.where(ok, nll, 0.0)
        count = ok.sum(-1).astype(jnp.float32)
        step = step_weights[k] * jnp.mean(nll.sum(-1) / jnp.maximum(count, 1.0))
        loss = loss + step
        metrics[f"loss_step_{k}"] = (jax.lax.stop_gradient(step), one)
        correct = (first_argmax(logits[k]) == lab) & ok
        metrics[f"acc_step_{k}"] = (correct.sum().astype(jnp.float32), count.sum())
    metrics["loss"] = (jax.lax.stop_gradient(loss), one)
    return loss, metrics


def select_anchors(key, loss_mask, max_anchors: int, block_size: int):
    """speculators' ``select_anchors`` with JAX randomness: a uniformly random subset of the
    positions with ``loss_mask == 1`` outside the last ``block_size`` positions of the row,
    ``min(max_anchors, #candidates)`` of them, ascending; the rest are anchor 0, invalid.
    loss_mask [B, T] -> (anchors int32 [B, N], valid bool [B, N])."""
    B, T = loss_mask.shape
    cand = loss_mask.astype(bool) & (jnp.arange(T) < T - block_size)[None]
    u = jax.random.uniform(key, (B, T))
    score = jnp.where(cand, u, -1.0)
    k = min(max_anchors, T)
    top, idx = jax.lax.top_k(score, k)
    valid = top >= 0
    srt = jnp.sort(jnp.where(valid, idx, T), axis=-1)
    valid = srt < T
    anchors = jnp.where(valid, srt, 0).astype(jnp.int32)
    if k < max_anchors:
        pad = max_anchors - k
        anchors = jnp.concatenate([anchors, jnp.zeros((B, pad), jnp.int32)], axis=1)
        valid = jnp.concatenate([valid, jnp.zeros((B, pad), bool)], axis=1)
    return anchors, valid


def normalize_metrics(sums: dict) -> dict:
    """``{name: (sum, total)}`` (host floats) -> ``{name: sum / total}`` (0 when total is 0)."""
    out = {}
    for k, (s, t) in sums.items():
        s, t = float(s), float(t)
        out[k] = s / t if t > 0 else 0.0
    return out


def accept_estimate(metrics: dict, steps: int) -> float:
    """1 + sum_s full_acc_s: the expected tokens per verify step implied by the per-position
    greedy acceptance (EAGLE-3 training metrics)."""
    return 1.0 + sum(metrics.get(f"full_acc_{s}", 0.0) for s in range(steps))


__all__ = ["eagle3_objective", "dflash_objective", "peagle_objective", "dspark_objective", "mtp_objective",
           "mtp_step_weights", "select_anchors", "normalize_metrics", "accept_estimate", "loss_function", "LOSSES"]
