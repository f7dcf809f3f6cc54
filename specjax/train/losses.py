"""Training losses, as speculators 0.9.0's eager reference (``speculators.losses``).

Per-position losses (``logits``, ``targets``: ``[..., T, Vd]`` -> ``[..., T]``, float32), with
``p = softmax(targets)``, ``q = softmax(logits)``:

  kl_div  sum p (log p - log q)          rkl   sum q (log q - log p)
  jsd     (KL(p||m) + KL(q||m)) / 2      ce    -log q[argmax p] (first max on ties)
  tv      1 - sum min(p, q)              nla   -log max(sum min(p, q), 1e-5)
  lk_hybrid  l*KL + (1-l)*TV, l = exp(-3 * stopgrad(sum min(p, q)))

Targets never receive gradient. ``loss_function`` reduces ``sum(l * mask * w) / (sum(mask) +
1e-5)`` per batch row then means over rows; a loss spec is a name or a JSON dict of weights
(``{"ce": 0.1, "tv": 0.9}``), an unnormalised weighted sum of terms.
"""

from __future__ import annotations

import json
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from specjax.models.layers import first_argmax
from specjax.train.errors import RecipeError

REDUCTION_EPS = 1e-5
NLA_EPS = 1e-5


def _lsm(x):
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)


def kl_div(logits, targets):
    logq = _lsm(logits)
    logp = _lsm(jax.lax.stop_gradient(targets))
    p = jnp.exp(logp)
    # torch.kl_div(input=logq, target=p) = p * (log p - logq), xlogy(0, 0) = 0
    return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)


def kl_target_stats(targets):
    """What :func:`kl_div_prepared` needs of the targets, computed once and sliced per TTT step:
    ``p = softmax(targets)`` [.., V], ``sum xlogy(p, p)`` [..] and ``sum p`` [..] (float32)."""
    logp = _lsm(jax.lax.stop_gradient(targets))
    p = jnp.exp(logp)
    return p, jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1), jnp.sum(p, axis=-1)


@jax.custom_vjp
def kl_div_prepared(logits, p, plogp, psum):
    """:func:`kl_div` from :func:`kl_target_stats`: ``sum p log p - sum p * logits + lse(logits) *
    sum p`` (the same quantity, without materialising ``log q``), with the gradient written out as
    ``(softmax(logits) * sum p - p) * ct`` in one pass. The targets get no gradient."""
    return _kl_prepared_fwd(logits, p, plogp, psum)[0]


def _kl_prepared_fwd(logits, p, plogp, psum):
    lg = logits.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(lg, axis=-1, keepdims=True))
    lse = m[..., 0] + jnp.log(jnp.sum(jnp.exp(lg - m), axis=-1))
    # where(p > 0, ..): zero-probability classes contribute nothing even at logits of -inf (and the
    # select keeps XLA's CPU backend from handing this reduction to YNNPACK, measured 10x slower).
    cross = jnp.sum(jnp.where(p > 0, p * lg, 0.0), axis=-1)
    return plogp - cross + lse * psum, (logits, lse, p, psum)


def _kl_prepared_bwd(res, ct):
    logits, lse, p, psum = res
    q = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    g = (q * psum[..., None] - p) * ct[..., None]
    return g.astype(logits.dtype), None, None, None


kl_div_prepared.defvjp(_kl_prepared_fwd, _kl_prepared_bwd)


def rkl(logits, targets):
    logq = _lsm(logits)
    logp = _lsm(jax.lax.stop_gradient(targets))
    return jnp.sum(jnp.exp(logq) * (logq - logp), axis=-1)


def jsd(logits, targets):
    logq = _lsm(logits)
    logp = _lsm(jax.lax.stop_gradient(targets))
    log_m = jnp.logaddexp(logq, logp) - math.log(2.0)
    kl_pm = jnp.sum(jnp.exp(logp) * (logp - log_m), axis=-1)
    kl_qm = jnp.sum(jnp.exp(logq) * (logq - log_m), axis=-1)
    return 0.5 * (kl_pm + kl_qm)


def ce(logits, targets):
    tid = first_argmax(jax.lax.stop_gradient(targets))
    logq = _lsm(logits)
    return -jnp.take_along_axis(logq, tid[..., None], axis=-1)[..., 0]


def _overlap(logits, targets):
    q = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    p = jax.nn.softmax(jax.lax.stop_gradient(targets).astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.minimum(q, p), axis=-1)


def tv(logits, targets):
    return 1.0 - _overlap(logits, targets)


def nla(logits, targets):
    return -jnp.log(jnp.maximum(_overlap(logits, targets), NLA_EPS))


def lk_hybrid(logits, targets, eta: float = 3.0):
    ov = _overlap(logits, targets)
    w = jnp.exp(-eta * jax.lax.stop_gradient(ov))
    return w * kl_div(logits, targets) + (1.0 - w) * (1.0 - ov)


LOSSES: dict[str, Callable] = {"kl_div": kl_div, "rkl": rkl, "jsd": jsd, "ce": ce, "tv": tv, "nla": nla,
                               "lk_hybrid": lk_hybrid}


def parse_loss_spec(spec: str | Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """A loss name or a JSON dict of weights -> ``((name, weight), ...)`` (hashable, jit-static)."""
    if isinstance(spec, str) and spec in LOSSES:
        return ((spec, 1.0),)
    parsed = spec
    if isinstance(spec, str):
        try:
            parsed = json.loads(spec)
        except ValueError:
            raise RecipeError(f"unknown loss {spec!r}; expected one of {sorted(LOSSES)} or a JSON dict of weights, "
                              'e.g. {"ce": 0.1, "tv": 0.9}', key="loss_fn") from None
    if not isinstance(parsed, Mapping) or not parsed:
        raise RecipeError(f"loss spec must be a name or a non-empty dict of weights, got {spec!r}", key="loss_fn")
    out = []
    for name, w in parsed.items():
        if name not in LOSSES:
            raise RecipeError(f"unknown loss {name!r} in the loss dict; expected one of {sorted(LOSSES)}",
                              key="loss_fn")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise RecipeError(f"loss weight for {name!r} must be a number, got {w!r}", key="loss_fn")
        out.append((name, float(w)))
    return tuple(out)


def loss_function(logits, targets, loss_mask, loss_fn: Callable, decay: Callable | None = None):
    """Masked, optionally weighted mean: ``sum(l * m * w) / (sum(m) + 1e-5)`` per row, mean over rows.
    ``decay(elementwise_loss) -> weights`` (speculators passes the masked elementwise loss)."""
    el = loss_fn(logits, targets)
    m = loss_mask.astype(el.dtype)
    el = el * m
    if decay is not None:
        el = el * decay(el)
    return jnp.mean(jnp.sum(el, axis=-1) / (jnp.sum(m, axis=-1) + REDUCTION_EPS))


def compound_loss(logits, targets, loss_mask, loss_spec, decay: Callable | None = None):
    """``sum_i w_i * loss_function(term_i)`` and the unweighted per-term values (multi-term only)."""
    total = jnp.zeros((), jnp.float32)
    terms = {}
    for name, w in loss_spec:
        t = loss_function(logits, targets, loss_mask, LOSSES[name], decay)
        if len(loss_spec) > 1:
            terms[f"{name}_loss"] = jax.lax.stop_gradient(t)
        total = total + w * t
    return total, terms


# ----------------------------------------------------------------------------- per-position weights


def dflash_decay(pos_idx, gamma: float, sample_from_anchor: bool):
    """DFlash ``w_0 = 0, w_k = exp(-(k-1)/gamma)``; DSpark (sample_from_anchor) ``exp(-k/gamma)``."""
    pos = pos_idx.astype(jnp.float32)
    if sample_from_anchor:
        return jnp.exp(-pos / gamma)
    return jnp.exp(-jnp.maximum(pos - 1, 0) / gamma) * (pos_idx != 0).astype(jnp.float32)


def dpace_weights(elementwise_loss, loss_mask, block_size: int, alpha: float):
    """D-PACE (``dpace_loss_decay``), detached. ``elementwise_loss``/``loss_mask`` [B, N*Bk]."""
    el = jax.lax.stop_gradient(elementwise_loss)
    B, Q = el.shape
    q = jnp.exp(-el).astype(jnp.float32).reshape(B, Q // block_size, block_size)
    m = loss_mask.reshape(B, Q // block_size, block_size).astype(jnp.float32)
    smooth = jnp.where(m > 0, (1.0 - alpha) * q + alpha, 1.0)
    prefix = jnp.cumprod(smooth, axis=-1)
    w = jnp.flip(jnp.cumsum(jnp.flip(prefix * m, axis=-1), axis=-1), axis=-1) * m
    return jax.lax.stop_gradient(w.reshape(B, Q))
