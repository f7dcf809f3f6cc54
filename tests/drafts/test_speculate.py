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


@pytest.mark.skipif(not __import__("specjax.kernels", fromlist=["available"]).available(),
                    reason="CPU kernels unavailable")
@pytest.mark.parametrize("algo,window", [("eagle3", None), ("eagle3", 4), ("mtp", None)])
def test_chain_decode_on_the_attention_kernel_equals_masked(draft_ckpt, verifiers, algo, window):
    """In the decode-time panel view a chain draft (EAGLE-3, MTP) attends over its cache with the
    native kernel (slot ranges, seq-major cache) instead of masking every slot: two speculate
    rounds give the plain module's proposals and logits (a sliding layer's window too)."""
    import jax
    from flax import nnx

    from specjax.models import panels

    over = {"layer_over": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window,
                           "use_sliding_window": True}} if window else {}
    fam = "qwen3" if algo == "mtp" else "llama"
    kw = {} if algo == "mtp" else dict(draft_vocab=40, num_layers=2, **over)
    draft = load_draft(draft_ckpt(algo, fam, **kw), verifiers[fam])
    target = load_hf_dir(verifiers[fam])
    seq = jnp.asarray(np.random.default_rng(1).integers(3, 90, size=(2, 16)))
    aux = draft.aux_from_taps(target(seq, tap_ids=draft.tap_ids(target.config.num_hidden_layers)).aux_hidden_states)
    pos = jnp.broadcast_to(jnp.arange(16)[None], (2, 16))
    graphdef, state = nnx.split(draft)

    @jax.jit
    def two_rounds(state):
        d = nnx.merge(graphdef, state)
        p1 = d.speculate(d.init_cache(2, 32), aux[:, :9], seq[:, 1:10], pos[:, :9], n_valid=jnp.asarray([9, 7]))
        p2 = d.speculate(p1.cache, aux[:, 9:13], seq[:, 10:14], pos[:, 9:13], n_valid=jnp.asarray([4, 2]))
        return p1.tokens, p1.logits, p2.tokens, p2.logits

    view = panels.decode_state(draft, state)
    assert "specjax_decode_attention" in two_rounds.lower(view).as_text()
    assert "specjax_decode_attention" not in two_rounds.lower(state).as_text()
    plain, fast = two_rounds(state), two_rounds(view)
    for a, b in zip(plain, fast):
        if a.dtype == jnp.float32:
            assert rel_err(b, a) <= TOL
        else:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
