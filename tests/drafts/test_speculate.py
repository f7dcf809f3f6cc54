"""The shared decode-loop entry ``speculate`` against a real specjax target: tap ids and aux order
plug into ``CausalLM``; speculating round by round (accepting part of each proposal, never rolling
the draft cache back) equals speculating once from scratch on the same prefix."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.drafts import load_draft
from specjax.models.hf import load_hf_dir
from tests.drafts.conftest import TOL, rel_err

CASES = {
    "eagle3": ("llama", {"draft_vocab": 40, "norm_output": True, "num_layers": 2}),
    "peagle": ("llama", {"draft_vocab": 40}),
    "dflash": ("llama", {"draft_vocab": 40}),
    "dspark": ("qwen3", {"markov_head_type": "rnn"}),
    "mtp": ("qwen3", {}),
}


@pytest.mark.parametrize("algo", list(CASES))
def test_rounds_equal_from_scratch(draft_ckpt, verifiers, algo):
    fam, kw = CASES[algo]
    draft = load_draft(draft_ckpt(algo, fam, **kw), verifiers[fam])
    target = load_hf_dir(verifiers[fam])
    n = target.config.num_hidden_layers
    taps = draft.tap_ids(n)
    assert len(taps) == (1 if algo == "mtp" else 3)
    seq = jnp.asarray(np.random.default_rng(0).integers(3, 90, size=(1, 16)))
    out = target(seq, tap_ids=taps)
    aux = draft.aux_from_taps(out.aux_hidden_states)  # [1, 16, A*H]
    pos = jnp.arange(16)[None]

    def rows(a, b):  # target rows a..b-1 and the token after each
        return aux[:, a:b], seq[:, a + 1:b + 1], pos[:, a:b]

    # round 1 on rows 0..8, round 2 adds rows 9..11 (as if 3 tokens were accepted + bonus)
    cache = draft.init_cache(1, 32)
    p1 = draft.speculate(cache, *rows(0, 9))
    p2 = draft.speculate(p1.cache, *rows(9, 12))
    fresh = draft.speculate(draft.init_cache(1, 32), *rows(0, 12))
    assert rel_err(p2.logits, fresh.logits) <= TOL
    np.testing.assert_array_equal(np.asarray(p2.tokens), np.asarray(fresh.tokens))
    assert p2.tokens.shape == (1, draft.speculative_tokens)
    assert int(p2.cache.lengths[0]) == 12
    assert ((p2.tokens >= 0) & (p2.tokens < draft.vocab_size)).all()
