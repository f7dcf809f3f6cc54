"""P-EAGLE, DFlash, DSpark and MTP parity with speculators 0.9.0 (float32, CPU, sdpa unless noted):
logits and hidden outputs (and targets / aligned masks / confidence) on packed rows with several
documents and padding, with the reference's own anchors / COD elements as inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.drafts import load_draft
from tests.drafts.conftest import TOL, rel_err
from tests.refs.spec_forward import reference

SWA2 = {"num_layers": 2, "layer_over": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3,
                                        "use_sliding_window": True}}


def _inputs(ref):
    return {k: jnp.asarray(v) for k, v in ref.inputs.items()}


PEAGLE = {
    "llama-full": ("llama", {}),
    "qwen3-pruned": ("qwen3", {"draft_vocab": 40}),
    "llama-norm_before_fc-2layers": ("llama", {"norm_before_fc": True, "num_layers": 2, "draft_vocab": 40}),
    "qwen3-fc_norm-nbr": ("qwen3", {"fc_norm": True, "norm_before_residual": True}),
    "qwen3-swa": ("qwen3", {**SWA2, "draft_vocab": 40}),
    "llama-swa-all": ("llama", {"num_layers": 2, "layer_over": {"layer_types": ["sliding_attention"] * 2,
                                                                "sliding_window": 2}}),
}


@pytest.mark.parametrize("case", list(PEAGLE))
def test_peagle(draft_ckpt, verifiers, case):
    fam, kw = PEAGLE[case]
    ck = draft_ckpt("peagle", fam, **kw)
    ref = reference("peagle", ck, num_depths=4)
    out = load_draft(ck, verifiers[fam])(**_inputs(ref))
    errs = {"logits": rel_err(out.logits, ref.logits), "hidden": rel_err(out.hidden, ref.hidden),
            "targets": rel_err(out.targets, ref.extra["targets"])}
    assert max(errs.values()) <= TOL, errs


def test_peagle_max_anchors_and_eager(draft_ckpt, verifiers):
    """Subsampled seeds (max_anchors); eager reference: speculators gives NaN on rows whose anchor
    is padding (fully masked), compared on the finite rows."""
    ck = draft_ckpt("peagle", "llama", draft_vocab=40)
    draft = load_draft(ck, verifiers["llama"])
    ref = reference("peagle", ck, num_depths=5, max_anchors=6, seed=2)
    assert rel_err(draft(**_inputs(ref)).logits, ref.logits) <= TOL
    ref = reference("peagle", ck, attn="eager", num_depths=4)
    out = draft(**_inputs(ref))
    assert not np.isfinite(ref.logits).all()  # the speculators eager quirk this test documents
    assert rel_err(out.logits, ref.logits) <= TOL


DFLASH = {
    "qwen3-pruned": ("qwen3", {"draft_vocab": 40}),
    "llama-full": ("llama", {}),  # model_type llama: still Qwen3-style layers (q/k norm)
    "qwen3-swa-causal": ("qwen3", {**SWA2}),
    "qwen3-swa-noncausal": ("qwen3", {**SWA2, "sliding_window_non_causal": True, "draft_vocab": 40}),
    "llama-swa-3layers-anchor": ("llama", {"num_layers": 3, "sample_from_anchor": True, "layer_over": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 4}}),
    "qwen3-block6": ("qwen3", {"block_size": 6, "draft_vocab": 40}),
}


@pytest.mark.parametrize("case", list(DFLASH))
def test_dflash(draft_ckpt, verifiers, case):
    fam, kw = DFLASH[case]
    ck = draft_ckpt("dflash", fam, **kw)
    draft = load_draft(ck, verifiers[fam])
    for max_anchors, seed in ((5, 0), (40, 1)):  # a subset of anchors; more slots than candidates (invalid ones)
        ref = reference("dflash", ck, max_anchors=max_anchors, seed=seed)
        out = draft(**_inputs(ref))
        errs = {"logits": rel_err(out.logits, ref.logits), "hidden": rel_err(out.hidden, ref.hidden),
                "targets": rel_err(out.targets, ref.extra["targets"])}
        assert max(errs.values()) <= TOL, (max_anchors, errs)
        np.testing.assert_array_equal(np.asarray(out.loss_mask), ref.extra["aligned_loss_mask"])


def test_dflash_eager(draft_ckpt, verifiers):
    ck = draft_ckpt("dflash", "qwen3", **SWA2)
    ref = reference("dflash", ck, attn="eager", max_anchors=7, seed=5)
    assert rel_err(load_draft(ck, verifiers["qwen3"])(**_inputs(ref)).logits, ref.logits) <= TOL


DSPARK = {
    "vanilla": ("qwen3", {}),
    "gated-pruned": ("qwen3", {"markov_head_type": "gated", "draft_vocab": 40}),
    "rnn-no-anchor": ("qwen3", {"markov_head_type": "rnn", "sample_from_anchor": False}),
    "rnn-pruned-swa": ("qwen3", {"markov_head_type": "rnn", "draft_vocab": 40, **SWA2}),
    "no-markov": ("llama", {"markov_rank": 0, "confidence_head_with_markov": False}),
    "no-confidence": ("qwen3", {"enable_confidence_head": False}),
    "conf-without-markov": ("qwen3", {"confidence_head_with_markov": False, "markov_head_type": "gated"}),
}


@pytest.mark.parametrize("case", list(DSPARK))
def test_dspark(draft_ckpt, verifiers, case):
    fam, kw = DSPARK[case]
    ck = draft_ckpt("dspark", fam, **kw)
    ref = reference("dspark", ck, max_anchors=6)
    out = load_draft(ck, verifiers[fam])(**_inputs(ref))
    errs = {"logits": rel_err(out.logits, ref.logits), "hidden": rel_err(out.hidden, ref.hidden),
            "targets": rel_err(out.targets, ref.extra["targets"])}
    if ref.extra["confidence_logits"] is None:
        assert out.confidence is None
    else:
        errs["confidence"] = rel_err(out.confidence, ref.extra["confidence_logits"])
    assert max(errs.values()) <= TOL, errs
    np.testing.assert_array_equal(np.asarray(out.loss_mask), ref.extra["aligned_loss_mask"])


@pytest.mark.parametrize("steps", [1, 3, 4])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mtp(draft_ckpt, verifiers, steps, attn):
    ck = draft_ckpt("mtp", "qwen3", num_speculative_steps=steps)
    ref = reference("mtp", ck, attn=attn)
    out = load_draft(ck, verifiers["qwen3"])(**_inputs(ref))
    errs = {"logits": rel_err(out.logits[:, 0], ref.logits), "hidden": rel_err(out.hidden[:, 0], ref.hidden)}
    assert max(errs.values()) <= TOL, errs
    # labels are the hard targets speculators scores: input_ids[k+2:], -100 where loss_mask == 0
    T = ref.inputs["input_ids"].shape[1]
    Tv = T - min(steps, T - 2) - 1
    for k in range(out.labels.shape[0]):
        lab = ref.inputs["input_ids"][0, k + 2:k + 2 + Tv].copy()
        lab[ref.inputs["loss_mask"][0, k + 2:k + 2 + Tv] == 0] = -100
        np.testing.assert_array_equal(np.asarray(out.labels[k, 0]), lab)
