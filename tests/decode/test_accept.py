"""The accept/reject rule on its own: greedy cases by hand, speculators' relaxed rule, and
losslessness by chi-square (>= 1e5 vectorised draws) for random p, q at temperature 1 and with
top-p 0.9, for sampled and point-mass (greedy) proposals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.decode.accept import accept, accept_greedy, draft_probs, is_lossy, residual
from specjax.decode.sampling import SamplingParams, probs

N_DRAWS = 100_000
V, K = 12, 3


def _onehot_logits(rows, V=8):
    x = np.zeros((1, len(rows), V), np.float32)
    for i, t in enumerate(rows):
        x[0, i, t] = 5.0
    return jnp.asarray(x)


def test_greedy_rule_by_hand():
    logits = _onehot_logits([3, 4, 5, 6])  # target argmax per verified position
    r = accept_greedy(logits, jnp.asarray([[3, 4, 1]]))
    assert int(r.num_accepted[0]) == 2 and np.asarray(r.tokens)[0].tolist()[:3] == [3, 4, 5]
    r = accept_greedy(logits, jnp.asarray([[3, 4, 5]]))  # all accepted: bonus from the last row
    assert int(r.num_accepted[0]) == 3 and np.asarray(r.tokens)[0].tolist() == [3, 4, 5, 6]
    r = accept_greedy(logits, jnp.asarray([[0, 4, 5]]))  # a later match does not count
    assert int(r.num_accepted[0]) == 0 and int(r.tokens[0, 0]) == 3
    # greedy through the sampling dispatcher (temperature 0) is the same rule
    r2 = accept(jax.random.key(0), logits, jnp.asarray([[3, 4, 1]]), None, SamplingParams())
    assert int(r2.num_accepted[0]) == 2


def test_relaxed_rule_speculators():
    # row 0: top token 3 (logit 5), token 1 second (logit 4.5); row 1: top 4
    x = np.zeros((1, 3, 8), np.float32)
    x[0, 0, 3], x[0, 0, 1], x[0, 1, 4], x[0, 2, 6] = 5.0, 4.5, 5.0, 5.0
    logits, d = jnp.asarray(x), jnp.asarray([[1, 4]])
    assert int(accept_greedy(logits, d).num_accepted[0]) == 0  # exact rule
    assert int(accept_greedy(logits, d, verifier_accept_k=2, accept_tolerance=1.0).num_accepted[0]) == 2
    assert int(accept_greedy(logits, d, verifier_accept_k=2, accept_tolerance=0.4).num_accepted[0]) == 0
    assert int(accept_greedy(logits, d, verifier_accept_k=1, accept_tolerance=9.0).num_accepted[0]) == 0
    assert is_lossy(2, 1.0) and not is_lossy(1, 5.0) and not is_lossy(4, 0.0)


def test_residual_and_pruned_draft_probs():
    p = jnp.asarray([0.5, 0.3, 0.2])
    np.testing.assert_allclose(np.asarray(residual(p, jnp.asarray([0.2, 0.6, 0.2]))), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(residual(p, p)), np.asarray(p))  # zero residual -> p
    d2t = jnp.asarray([1, 2, 4])  # draft ids 0,1,2 -> target ids 1,3,6
    q = draft_probs(jnp.asarray([[[0.0, 1.0, 2.0]]]), SamplingParams(temperature=1.0), d2t=d2t, vocab_size=8)
    q = np.asarray(q)[0, 0]
    assert q.shape == (8,) and abs(q.sum() - 1) < 1e-6 and (q[[0, 2, 4, 5, 7]] == 0).all() and q[6] > q[3] > q[1]


def _draws(sampling: SamplingParams, greedy_proposals: bool, seed: int):
    rng = np.random.default_rng(seed)
    t_logits = jnp.asarray(rng.normal(size=(1, K + 1, V)).astype(np.float32) * 1.5)
    d_logits = jnp.asarray(rng.normal(size=(1, K, V)).astype(np.float32) * 1.5)
    p = np.asarray(probs(t_logits, sampling), np.float64)[0]  # [K+1, V] the target's processed distributions
    p /= p.sum(-1, keepdims=True)

    @jax.jit
    def run(key, t_logits, d_logits):  # arguments, not closure constants (XLA would constant-fold)
        kd, ka = jax.random.split(key)
        tl = jnp.broadcast_to(t_logits, (N_DRAWS, K + 1, V))
        dl = jnp.broadcast_to(d_logits, (N_DRAWS, K, V))
        if greedy_proposals:
            d, q = jnp.argmax(dl, -1).astype(jnp.int32), None
        else:
            q = draft_probs(dl, sampling)
            d = jax.random.categorical(kd, jnp.log(q), axis=-1).astype(jnp.int32)
        r = accept(ka, tl, d, q, sampling)
        return r.num_accepted, r.tokens

    n, toks = map(np.asarray, run(jax.random.key(seed), t_logits, d_logits))
    return p, n, toks


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["t1", "top_p0.9"])
@pytest.mark.parametrize("greedy_proposals", [False, True], ids=["sampled_q", "point_mass_q"])
def test_accept_is_lossless_chi_square(sampling, greedy_proposals):
    p, n, toks = _draws(sampling, greedy_proposals, seed=7)
    assert 0 < n.mean() < K  # both paths (accept and reject) are exercised
    for i in range(K + 1):
        rows = n >= i  # the token emitted at index i exists iff at least i drafts were accepted
        obs = np.bincount(toks[rows, i], minlength=V)
        exp = p[i] * rows.sum()
        zero = exp == 0
        assert obs[zero].sum() == 0, f"position {i}: tokens outside top-p were emitted"
        if rows.sum() < 1000:
            continue
        pval = stats.chisquare(obs[~zero], exp[~zero]).pvalue
        assert pval > 0.01, (i, pval, obs, exp)


def test_accept_detects_a_wrong_rule():
    """The chi-square setup has power: sampling the correction from p (instead of the residual)
    is caught."""
    sampling = SamplingParams(temperature=1.0)
    p, n, toks = _draws(sampling, False, seed=7)
    rng = np.random.default_rng(1)
    bad = toks[:, 0].copy()
    rej = n == 0
    bad[rej] = rng.choice(V, size=rej.sum(), p=p[0])  # wrong: plain p after a rejection
    obs = np.bincount(bad, minlength=V)
    assert stats.chisquare(obs, p[0] * len(bad)).pvalue < 1e-6
