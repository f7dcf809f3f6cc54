"""Training forwards are jit-compatible (static shapes, no host round trips) and differentiable
with speculators' gradient rules (EAGLE-3's embedding lookup is under no_grad; P-EAGLE's is not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.drafts import load_draft
from specjax.models.drafts.common import trainable
from tests.drafts.conftest import rel_err
from tests.refs.spec_forward import reference

CASES = {
    "eagle3": ("llama", {"draft_vocab": 40, "norm_output": True}, {"ttt_steps": 3}),
    "peagle": ("llama", {}, {}),
    "dflash": ("qwen3", {"draft_vocab": 40}, {}),
    "dspark": ("qwen3", {"markov_head_type": "rnn"}, {}),
    "mtp": ("qwen3", {}, {}),
}
STATIC = {"ttt_steps"}


@pytest.mark.parametrize("algo", list(CASES))
def test_jit_equals_eager_and_grads(draft_ckpt, verifiers, algo):
    fam, kw, fwd = CASES[algo]
    ck = draft_ckpt(algo, fam, **kw)
    ref = reference(algo, ck, **({"max_anchors": 5} if algo in ("dflash", "dspark") else {}))
    draft = load_draft(ck, verifiers[fam])
    inputs = {k: jnp.asarray(v) for k, v in ref.inputs.items()}
    eager = draft(**inputs, **fwd)

    @nnx.jit
    def run(model, inputs):
        return model(**inputs, **fwd).logits

    assert rel_err(run(draft, inputs), eager.logits) <= 1e-6

    def loss(model):
        return jnp.sum(model(**inputs, **fwd).logits ** 2)

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, trainable(draft)))(draft)
    names = {p[0] for p, _ in nnx.to_flat_state(grads)}
    assert not names & {"lm_head", "verifier_lm_head", "verifier_norm"}
    # embed_requires_grad (P-EAGLE default True) trains the embedding; everyone else freezes it
    assert ("embed_tokens" in names) == (algo == "peagle")
    if algo == "peagle":
        assert np.abs(np.asarray(grads["embed_tokens"]["embedding"][...])).sum() > 0
    flat = jax.tree_util.tree_leaves(grads)
    assert flat and all(np.isfinite(np.asarray(g)).all() for g in flat)
