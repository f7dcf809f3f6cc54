"""The verify-side accept/reject rule of speculative decoding, as small pure functions.

Shapes: ``B`` sequences, ``k`` drafted tokens, target vocabulary ``V``.

* ``target_logits`` [B, k+1, V]: the verifier's logits at the k+1 verified positions (row i is
  the distribution of the token after ``last, d_1, ..., d_i``).
* ``draft_tokens`` [B, k] (target-vocabulary ids).
* ``draft_probs`` [B, k, V] or ``None``: the distribution each draft token was drawn from,
  already processed by the same temperature / top-k / top-p as the target's. ``None`` means
  greedy proposals (the speculators default): a point mass on the drafted token.

Rules (:func:`accept`):

* greedy (``sampling.temperature == 0``): accept ``d_i`` while it equals the target argmax;
  the token at the first mismatch (or the bonus after k accepts) is the target argmax there.
* sampling: walk left to right, accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``;
  at the first rejection draw from ``normalise(max(p_i - q_i, 0))``; when all k are accepted
  draw the bonus from ``p_k``. The emitted tokens are distributed exactly as sampling the
  target alone (Leviathan et al. 2023, Chen et al. 2023). ``p`` and ``q`` are the *processed*
  distributions (:func:`specjax.decode.sampling.probs`). A point-mass ``q`` gives accept
  probability ``p_i(d_i)`` and the residual ``p_i`` without ``d_i``: still lossless.
* speculators' ``verifier_accept_k`` / ``accept_tolerance`` (greedy proposal config): a draft
  token is *also* accepted when it is within the verifier's top ``verifier_accept_k`` and its
  log-probability (raw logits, temperature 1) is within ``accept_tolerance`` of the top token's.
  This changes the output distribution: :func:`is_lossy` says so, and the loop reports it.
  With ``accept_tolerance == 0`` or ``verifier_accept_k == 1`` it is the exact rule. Both may be
  traced arrays (runtime settings), so exact and relaxed runs share one compiled program.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.decode.sampling import SamplingParams, process_logits
from specjax.models.layers import first_argmax


class AcceptResult(NamedTuple):
    num_accepted: jax.Array  # int32 [B]: leading draft tokens accepted, 0..k
    tokens: jax.Array  # int32 [B, k+1]: d_1..d_n then the correction / bonus token at index n
    accepted: jax.Array  # bool [B, k]: per-position test result (before the leading-run cut)


def is_lossy(verifier_accept_k: int = 1, accept_tolerance: float = 0.0) -> bool:
    """True when the relaxed speculators rule can accept a token the exact rule would not."""
    return int(verifier_accept_k) > 1 and float(accept_tolerance) > 0.0


def _maybe_relaxed(verifier_accept_k, accept_tolerance) -> bool:
    """Python numbers: decided now; arrays (runtime settings, one compile for both): maybe."""
    if isinstance(verifier_accept_k, jax.Array) or isinstance(accept_tolerance, jax.Array):
        return True
    return is_lossy(verifier_accept_k, accept_tolerance)


def leading_run(ok):
    """bool [B, k] -> int32 [B]: length of the leading run of True."""
    return jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1).astype(jnp.int32)


def relaxed_accept(target_logits, draft_tokens, verifier_accept_k: int, accept_tolerance: float):
    """bool [B, k]: speculators' near-miss rule on the raw verifier log-probs (see module doc).
    target_logits [B, k(+1), V] (only the first k rows are used)."""
    k = draft_tokens.shape[-1]
    vak, tol = jnp.asarray(verifier_accept_k), jnp.asarray(accept_tolerance)
    on = (vak > 1) & (tol > 0)  # else the exact rule: all False, and the [B, k, V] work is skipped

    def relaxed(logits):
        logp = jax.nn.log_softmax(logits[:, :k].astype(jnp.float32), axis=-1)
        lp_d = jnp.take_along_axis(logp, draft_tokens[..., None], axis=-1)[..., 0]
        rank = (logp > lp_d[..., None]).sum(-1)  # tokens strictly more likely than the draft token
        top = logp.max(-1)
        return (rank < vak) & (top - lp_d <= tol)

    def exact(logits):  # noqa: ARG001
        return jnp.zeros(draft_tokens.shape, bool)

    return jax.lax.cond(on, relaxed, exact, target_logits)


def _assemble(draft_tokens, n, next_token):
    """[B, k+1]: draft tokens before n, next_token at n and after."""
    k = draft_tokens.shape[-1]
    j = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([draft_tokens, next_token[:, None]], axis=1)
    return jnp.where(j < n[:, None], padded, next_token[:, None]).astype(jnp.int32)


def accept_greedy(target_logits, draft_tokens, *, verifier_accept_k: int = 1,
                  accept_tolerance: float = 0.0) -> AcceptResult:
    """Greedy verification: accept while ``d_i == argmax p_i`` (or the relaxed rule), then the argmax."""
    target_logits = target_logits.astype(jnp.float32)
    best = first_argmax(target_logits)  # [B, k+1]
    k = draft_tokens.shape[-1]
    ok = draft_tokens == best[:, :k]
    if _maybe_relaxed(verifier_accept_k, accept_tolerance):
        ok |= relaxed_accept(target_logits, draft_tokens, verifier_accept_k, accept_tolerance)
    n = leading_run(ok)
    nxt = jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
    return AcceptResult(n, _assemble(draft_tokens, n, nxt), ok)


def residual(p, q):
    """normalise(max(p - q, 0)) over the last axis; falls back to ``p`` where the residual is all
    zero (then p == q and the rejection that leads here has probability 0)."""
    r = jnp.maximum(p - q, 0.0)
    z = r.sum(-1, keepdims=True)
    return jnp.where(z > 0, r / jnp.where(z > 0, z, 1.0), p)


def accept_sampled(key, target_probs, draft_tokens, draft_probs=None, *, relaxed=None) -> AcceptResult:
    """Lossless rejection sampling. target_probs [B, k+1, V] (processed), draft_tokens [B, k],
    draft_probs [B, k, V] or None (point mass on the drafted tokens); ``relaxed`` bool [B, k]
    extra accepts (lossy)."""
    B, k1, V = target_probs.shape
    k = k1 - 1
    p = target_probs.astype(jnp.float32)
    ku, kr = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [B, k]
    if draft_probs is None:
        q_d = jnp.ones_like(p_d)
    else:
        q_d = jnp.take_along_axis(draft_probs.astype(jnp.float32), draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(ku, (B, k), jnp.float32)
    ok = u * q_d < p_d  # u < min(1, p/q); q_d == 0 < p_d accepts (ratio inf), p_d == 0 never
    if relaxed is not None:
        ok |= relaxed
    n = leading_run(ok)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    d_n = jnp.take_along_axis(jnp.concatenate([draft_tokens, draft_tokens[:, :1]], 1), n[:, None], axis=1)[:, 0]
    if draft_probs is None:
        q_n = jax.nn.one_hot(d_n, V, dtype=jnp.float32)
    else:
        qq = jnp.concatenate([draft_probs.astype(jnp.float32), jnp.zeros((B, 1, V), jnp.float32)], axis=1)
        q_n = jnp.take_along_axis(qq, n[:, None, None], axis=1)[:, 0]
    dist = jnp.where((n < k)[:, None], residual(p_n, q_n), p_n)  # bonus: p_k itself
    nxt = jax.random.categorical(kr, jnp.log(dist), axis=-1).astype(jnp.int32)
    return AcceptResult(n, _assemble(draft_tokens, n, nxt), ok)


def accept(key, target_logits, draft_tokens, draft_probs, sampling: SamplingParams, *, verifier_accept_k: int = 1,
           accept_tolerance: float = 0.0) -> AcceptResult:
    """Dispatch on ``sampling``: greedy rule at temperature 0, else lossless rejection sampling on
    the processed target distribution (``draft_probs`` None = greedy proposals)."""
    if sampling.greedy:
        return accept_greedy(target_logits, draft_tokens, verifier_accept_k=verifier_accept_k,
                             accept_tolerance=accept_tolerance)
    relaxed = None
    if _maybe_relaxed(verifier_accept_k, accept_tolerance):
        relaxed = relaxed_accept(target_logits, draft_tokens, verifier_accept_k, accept_tolerance)
    p = jax.nn.softmax(process_logits(target_logits, sampling), axis=-1)
    return accept_sampled(key, p, draft_tokens, draft_probs, relaxed=relaxed)


def draft_probs(draft_logits, sampling: SamplingParams, *, d2t=None, vocab_size: int | None = None):
    """The draft's processed distribution over the *target* vocabulary, [B, k, V].

    draft_logits [B, k, Vd] (draft vocabulary); ``d2t`` [Vd] offsets (target id = i + d2t[i])
    for a pruned vocabulary, None when Vd == V. Same temperature / top-k / top-p as the target."""
    q = jax.nn.softmax(process_logits(draft_logits, sampling), axis=-1)
    if d2t is None:
        return q
    Vd = q.shape[-1]
    tid = jnp.arange(Vd, dtype=jnp.int32) + d2t.astype(jnp.int32)
    out = jnp.zeros((*q.shape[:-1], int(vocab_size)), q.dtype)
    return out.at[..., tid].set(q)


def sample_draft(sampling: SamplingParams):
    """A draft ``sample(logits [B, Vd], key) -> ids [B]`` drawing from the processed draft distribution."""

    def fn(logits, key):
        return jax.random.categorical(key, process_logits(logits, sampling), axis=-1).astype(jnp.int32)

    return fn
