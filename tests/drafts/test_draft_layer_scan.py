"""Multi-layer drafts' training forward with its layers under ``lax.scan`` (``SPECJAX_SCAN_LAYERS=1``,
``layer_scan("on")``): DFlash and DSpark run each run of alike layers (one sliding window) as one
scanned layer body. The scanned forward matches speculators 0.9.0 as the unrolled one does, equals
the unrolled one within 1e-5 (outputs and gradients), and its program holds one loop per run."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.drafts import load_draft
from specjax.models.layer_scan import draft_layer_scan, layer_scan, recording_layer_scans
from tests.drafts.conftest import TOL, rel_err
from tests.refs.spec_forward import reference

FOUR = {"num_layers": 4, "draft_vocab": 40}
MIXED = {"num_layers": 4, "layer_over": {"layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                         "full_attention"], "sliding_window": 3,
                                         "use_sliding_window": True}}


def _inputs(ref):
    return {k: jnp.asarray(v) for k, v in ref.inputs.items()}


def _forward(draft, inputs, scan: bool):
    with layer_scan(scan), recording_layer_scans() as log:
        out = draft(**inputs)
    return out, log


def test_draft_scan_setting():
    with layer_scan("on"):
        assert draft_layer_scan(4) and not draft_layer_scan(1)
    for s in ("off", "auto"):
        with layer_scan(s):
            assert not draft_layer_scan(4)


@pytest.mark.parametrize("algo,fam,kw,runs", [
    ("dflash", "qwen3", FOUR, [(0, 4)]),
    ("dflash", "llama", MIXED, [(0, 2), (2, 4)]),
    ("dspark", "qwen3", {"num_layers": 3, "markov_head_type": "gated"}, [(0, 3)]),
])
def test_scanned_draft_matches_speculators_and_the_unrolled_forward(draft_ckpt, verifiers, algo, fam, kw, runs):
    ck = draft_ckpt(algo, fam, **kw)
    ref = reference(algo, ck, max_anchors=6, seed=3)
    draft = load_draft(ck, verifiers[fam])
    inputs = _inputs(ref)
    flat, log0 = _forward(draft, inputs, False)
    scanned, log1 = _forward(draft, inputs, True)
    assert log0 == [] and log1 == [runs]
    errs = {"logits": rel_err(scanned.logits, ref.logits), "hidden": rel_err(scanned.hidden, ref.hidden)}
    assert max(errs.values()) <= TOL, errs
    np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(flat.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(scanned.loss_mask), np.asarray(flat.loss_mask))


def test_scanned_draft_gradients_equal_the_unrolled_ones(draft_ckpt, verifiers):
    """Gradients reach every layer's own params through the stack, the same as unrolled."""
    ck = draft_ckpt("dflash", "llama", **MIXED)
    ref = reference("dflash", ck, max_anchors=6, seed=4)
    draft = load_draft(ck, verifiers["llama"])
    inputs = _inputs(ref)
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    w = jax.random.normal(jax.random.key(0), ref.logits.shape, jnp.float32)

    def loss(p, scan):
        with layer_scan(scan):
            out = nnx.merge(graphdef, p, rest)(**inputs)
        return jnp.sum(out.logits * w) + jnp.sum(out.hidden ** 2)

    g0 = jax.grad(loss)(params, False)
    g1 = jax.grad(loss)(params, True)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(leaves0) == len(leaves1)
    layer_grads = [x for p, x in jax.tree_util.tree_leaves_with_path(g1) if "layers" in jax.tree_util.keystr(p)]
    assert layer_grads and all(float(jnp.abs(x).max()) > 0 for x in layer_grads)
    for a, b in zip(leaves0, leaves1):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()) + 1e-7)


def test_scanned_draft_program_holds_one_loop_per_run(draft_ckpt, verifiers):
    ck = draft_ckpt("dflash", "qwen3", **FOUR)
    ref = reference("dflash", ck, max_anchors=6, seed=3)
    draft = load_draft(ck, verifiers["qwen3"])
    inputs = _inputs(ref)
    graphdef, state = nnx.split(draft)

    def hlo(scan):
        def f(st, x):
            with layer_scan(scan):
                return nnx.merge(graphdef, st)(**x).logits
        return jax.jit(f).lower(state, inputs).as_text()

    flat, scanned = hlo(False), hlo(True)
    assert len(re.findall(r"stablehlo\.while", flat)) == 0
    assert len(re.findall(r"stablehlo\.while", scanned)) == 1
    dots = lambda t: len(re.findall(r"stablehlo\.dot_general", t))  # noqa: E731
    assert dots(scanned) < dots(flat) / 2, (dots(scanned), dots(flat))
