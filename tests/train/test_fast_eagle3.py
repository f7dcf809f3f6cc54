"""The trainer's block-structured TTT forward equals the draft module's forward (logits, fed-forward
hidden states, targets and gradients) on packed rows with several documents and padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from specjax.models.drafts import load_draft
from specjax.train.fast_eagle3 import ttt_forward
from specjax.train.objectives import eagle3_objective
from tests.refs.spec_forward import packed_batch
from tests.train.conftest import rel_err

CASES = {
    "llama-pruned": ("llama", {"draft_vocab": 40, "norm_before_fc": True, "norm_output": True}),
    "qwen3-2layers": ("qwen3", {"num_layers": 2, "fc_norm": True}),
    "llama-swa-3layers": ("llama", {"num_layers": 3, "layer_over": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 4}}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [256, 8])
def test_fast_forward_equals_module(spec_draft, verifiers, case, chunk):
    """``chunk`` 8 splits the 34 query rows into 5 blocks (the last ragged), each against only
    the keys its causal/window mask admits; 256 is one block."""
    fam, kw = CASES[case]
    draft = load_draft(spec_draft("eagle3", fam, **kw), verifiers[fam])
    b = packed_batch("eagle3", hidden=32, num_aux=3, vocab=96, lengths=(9, 6, 11, 3), total_len=34, seed=7)
    inp = {k: jnp.asarray(v.numpy()) for k, v in b.items()}
    # jitted (op-by-op dispatch of the eager forwards and gradients took most of this test's time)
    ref = nnx.jit(lambda d, inp: d(**inp, ttt_steps=4))(draft, inp)
    out = nnx.jit(lambda d, inp: ttt_forward(d, inp["hidden_states"], inp["input_ids"], inp["document_ids"],
                                             inp["position_ids"], inp["verifier_last_hidden_states"], ttt_steps=4,
                                             attn_chunk=chunk))(draft, inp)
    assert rel_err(out.logits, ref.logits) <= 1e-5
    assert rel_err(out.hidden, ref.hidden) <= 1e-5
    assert rel_err(out.targets, ref.targets) == 0.0

    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)

    def loss(p, fast):
        m = nnx.merge(graphdef, p, rest)
        o = (ttt_forward(m, inp["hidden_states"], inp["input_ids"], inp["document_ids"], inp["position_ids"],
                         inp["verifier_last_hidden_states"], ttt_steps=3, attn_chunk=chunk) if fast
             else m(**inp, ttt_steps=3))
        return eagle3_objective(o.logits, o.targets, inp["loss_mask"])[0]

    g_ref = nnx.to_flat_state(jax.jit(jax.grad(lambda p: loss(p, False)))(params))
    g_fast = dict(nnx.to_flat_state(jax.jit(jax.grad(lambda p: loss(p, True)))(params)))
    for path, v in g_ref:
        a = v[...]
        if float(jnp.abs(a).max()) > 0:
            assert rel_err(g_fast[path][...], a) <= 1e-4, path


def _dots(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield e
        for v in e.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    yield from _dots(inner)


def test_bf16_step_runs_every_product_in_bf16(spec_draft, verifiers):
    """With the trainer's bf16 compute (params and frozen tensors cast), every product of the TTT
    loss and its gradient takes bf16 operands with a float32 result: no layer falls back to
    float32 (a float32 embedding once made the whole draft compute in float32), and the
    gradients stay within bf16 rounding of the float32 ones."""
    from specjax.train.step import _cast

    draft = load_draft(spec_draft("eagle3", "llama", draft_vocab=40, norm_before_fc=True, norm_output=True),
                       verifiers["llama"])
    b = packed_batch("eagle3", hidden=32, num_aux=3, vocab=96, lengths=(9, 6, 11, 3), total_len=34, seed=7)
    inp = {k: jnp.asarray(v.numpy()) for k, v in b.items()}
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)

    def loss(p, dt):
        m = nnx.merge(graphdef, _cast(p, dt), _cast(rest, dt))
        o = ttt_forward(m, inp["hidden_states"].astype(dt), inp["input_ids"], inp["document_ids"],
                        inp["position_ids"], inp["verifier_last_hidden_states"].astype(dt), ttt_steps=3, stack=False)
        return eagle3_objective(o.logits, o.targets, inp["loss_mask"])[0]

    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, jnp.bfloat16)))(params)
    dots = list(_dots(jaxpr.jaxpr))
    assert len(dots) > 20
    for e in dots:
        assert [str(a.aval.dtype) for a in e.invars] == ["bfloat16", "bfloat16"], e
        assert str(e.outvars[0].aval.dtype) == "float32", e
    l32, g32 = jax.value_and_grad(lambda p: loss(p, jnp.float32))(params)
    l16, g16 = jax.value_and_grad(lambda p: loss(p, jnp.bfloat16))(params)
    assert abs(float(l16) - float(l32)) <= 2e-2 * abs(float(l32))
    g16 = dict(nnx.to_flat_state(g16))
    for path, v in nnx.to_flat_state(g32):
        a = v[...]
        if float(jnp.abs(a).max()) > 0:
            assert rel_err(g16[path][...], a) <= 5e-2, path
