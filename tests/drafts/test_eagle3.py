"""EAGLE-3 parity with speculators 0.9.0: every norm flag, both decoder families, pruned and full
vocabulary, several layers, biases, sliding-window layers, sdpa and eager reference attention."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from specjax.models.drafts import load_draft
from tests.drafts.conftest import TOL, rel_err
from tests.refs.spec_forward import reference

FLAGS = {
    "nbr": {},  # the fixture builder passes norm_before_residual=True (TrainConfig default)
    "no-nbr": {"norm_before_residual": False},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "fc_norm+output-no-nbr": {"fc_norm": True, "norm_output": True, "norm_before_residual": False},
    "all-but-fc_norm": {"norm_before_fc": True, "norm_output": True},
}

SWA = {
    "llama-swa": ("llama", {"num_layers": 2, "layer_over": {"layer_types": ["sliding_attention", "full_attention"],
                                                            "sliding_window": 3}}),
    "qwen3-swa": ("qwen3", {"num_layers": 2, "layer_over": {"layer_types": ["full_attention", "sliding_attention"],
                                                            "sliding_window": 4, "use_sliding_window": True}}),
    # Qwen3Config drops sliding_window without use_sliding_window: sliding layers attend fully
    "qwen3-swa-dropped": ("qwen3", {"num_layers": 2, "layer_over": {
        "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 3}}),
    "llama-all-swa-3layers": ("llama", {"num_layers": 3, "norm_output": True, "layer_over": {
        "layer_types": ["sliding_attention"] * 3, "sliding_window": 5}}),
}


def check(ckpt, verifier, *, attn="sdpa", ttt_steps=3, **ref_kw):
    ref = reference("eagle3", ckpt, attn=attn, ttt_steps=ttt_steps, **ref_kw)
    draft = load_draft(ckpt, verifier)
    out = draft(**{k: jnp.asarray(v) for k, v in ref.inputs.items()}, ttt_steps=ttt_steps)
    errs = {"logits": rel_err(out.logits[:, 0], ref.logits), "hidden": rel_err(out.hidden[:, 0], ref.hidden),
            "targets": rel_err(out.targets[0], ref.extra["targets"])}
    assert max(errs.values()) <= TOL, errs
    return errs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_flags_pruned(draft_ckpt, verifiers, family, flags):
    check(draft_ckpt("eagle3", family, draft_vocab=40, **FLAGS[flags]), verifiers[family])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("flags", ["nbr", "fc_norm+output-no-nbr"])
def test_full_vocab(draft_ckpt, verifiers, family, flags):
    check(draft_ckpt("eagle3", family, **FLAGS[flags]), verifiers[family])


@pytest.mark.parametrize("case", list(SWA))
def test_sliding_window(draft_ckpt, verifiers, case):
    family, kw = SWA[case]
    check(draft_ckpt("eagle3", family, draft_vocab=40, **kw), verifiers[family])


def test_three_layers_biases_eager(draft_ckpt, verifiers):
    ck = draft_ckpt("eagle3", "llama", num_layers=3, norm_before_fc=True,
                    layer_over={"attention_bias": True, "mlp_bias": True})
    check(ck, verifiers["llama"], attn="eager", ttt_steps=4)


def test_qwen3_bias_two_layers(draft_ckpt, verifiers):
    check(draft_ckpt("eagle3", "qwen3", num_layers=2, draft_vocab=40, layer_over={"attention_bias": True}),
          verifiers["qwen3"], ttt_steps=2)


def test_other_packings(draft_ckpt, verifiers):
    ck = draft_ckpt("eagle3", "qwen3", draft_vocab=40, norm_output=True)
    check(ck, verifiers["qwen3"], lengths=(40,), total_len=24, seed=3)  # one truncated document, no padding
    check(ck, verifiers["qwen3"], lengths=(2, 3, 1, 5, 4), total_len=20, seed=4)  # tiny documents + padding
