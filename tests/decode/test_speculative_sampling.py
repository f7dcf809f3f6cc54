"""Losslessness of the whole loop at temperature 1: on a tiny random target with peaked logits
(vocab 16) and a cheaper draft (its first layer, so proposals are often rejected), the first 3
generated tokens of 20 000 speculative samples follow the target's exact joint distribution
(chi-square), for sampled and for greedy (point-mass) proposals; target-only sampling passes the
same test, so both sample the same distribution. (Sampling the correction from p instead of the
residual makes both speculative cases fail with p ~ 0.)"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from specjax.decode.generate import generate_ids
from specjax.decode.sampling import SamplingParams
from specjax.decode.selfdraft import SelfDraft
from specjax.decode.speculative import speculative_generate_ids
from specjax.models.config import TargetConfig
from specjax.models.target import build_model

V, N, PROMPT = 16, 20_000, [1, 2, 3]
T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def peaked():
    cfg = TargetConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
    model = build_model(cfg, rngs=nnx.Rngs(3))
    model.lm_head.kernel.set_value(model.lm_head.kernel[...] * 25.0)  # peaked next-token distributions
    return model


def exact_joint(model) -> np.ndarray:
    """P(t1, t2, t3 | prompt) [V, V, V] from the target's logits (float64 softmax)."""
    pre = np.asarray([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)], np.int32)
    lg = np.asarray(model(jnp.asarray(pre)).logits, np.float64)  # [V*V, 5, V]
    sm = np.exp(lg - lg.max(-1, keepdims=True))
    sm /= sm.sum(-1, keepdims=True)
    p1 = sm[0, 2]
    p2 = sm[::V, 3]  # rows with t2 = 0: p(t2 | t1)
    p3 = sm[:, 4].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(samples: np.ndarray, joint: np.ndarray) -> float:
    idx = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    obs = np.bincount(idx, minlength=V ** 3).astype(np.float64)
    exp = joint.reshape(-1) * len(samples)
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    assert big.sum() > 30  # a real test, not a handful of cells
    return float(stats.chisquare(o, e * o.sum() / e.sum()).pvalue)


def test_first_three_tokens_follow_the_target(peaked):
    joint = exact_joint(peaked)
    prompts = [PROMPT] * N
    kw = dict(max_new_tokens=3, sampling=T1, eos_token_ids=[], prompt_bucket=4)
    base = np.asarray(generate_ids(peaked, prompts, seed=1, **kw).tokens)
    assert chi_square_p(base, joint) > 0.01
    draft = SelfDraft(peaked, num_layers=1, speculative_tokens=2)
    for mode, seed in (("sample", 2), ("greedy", 3)):
        res = speculative_generate_ids(peaked, draft, prompts, seed=seed, draft_sampling=mode, **kw)
        toks = np.asarray(res.tokens)
        assert toks.shape == (N, 3)
        tps = res.stats.tokens_per_step()
        assert tps[1] > 0 and tps[3] > 0  # rejections and full accepts both happen
        assert chi_square_p(toks, joint) > 0.01, mode
        assert res.stats.tau > 1.1  # the draft's tokens do get committed
