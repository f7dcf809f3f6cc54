"""Where specjax differs from speculators 0.9.0 on purpose (bridge/external/__init__.py)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

import bridge
from bridge.external import ExternalSourceError
from tests.bridge.external import sources
from tests.bridge.external.conftest import read_tensors, spec_convert
from tests.bridge.external.test_load import TOL, rel_err, speculators_model

AUX = [1, 3, 4]


@pytest.mark.parametrize("flag,names", [("norm_before_fc", ["input_norm.weight"]),
                                        ("fc_norm", [f"fc_norm.{i}.weight" for i in range(3)])])
def test_eagle3_optional_norms_are_kept(flag, names, tmp_path, verifiers):
    """speculators' legacy converter module has no input_norm / fc_norm and drops them (its draft
    then runs with unit weights); specjax keeps the trained ones, and the result runs the same in
    specjax and in speculators."""
    from specjax.models.drafts import load_draft
    from tests.refs.spec_forward import reference

    v = verifiers["llama"]
    g = torch.Generator().manual_seed(3)
    extra = {n: (1 + 0.1 * torch.randn(96 if n == "input_norm.weight" else 32, generator=g)).float() for n in names}
    src = sources.safeailab_eagle3(tmp_path / "s", v, dtype="float32", extra=extra)
    theirs = spec_convert(src, v, "eagle3", tmp_path / "theirs", **{flag: True}, eagle_aux_hidden_state_layer_ids=AUX)
    assert not set(names) & set(read_tensors(theirs))
    ours = tmp_path / "ours"
    r = bridge.convert_external(src, "eagle3-safeailab", v, ours, **{flag: True}, eagle_aux_hidden_state_layer_ids=AUX)
    assert r.report.exit_code == 0 and set(names) <= set(read_tensors(ours))
    ref = reference("eagle3", ours, model=speculators_model(ours), ttt_steps=2)
    out = load_draft(ours, v, dtype=jnp.float32)(**{k: jnp.asarray(x) for k, x in ref.inputs.items()}, ttt_steps=2)
    assert rel_err(out.logits[:, 0], ref.logits) <= TOL
    # without the tensors in the source the flag cannot be honoured
    src2 = sources.safeailab_eagle3(tmp_path / "s2", v)
    with pytest.raises(ExternalSourceError, match=names[0].replace(".", r"\.")):
        bridge.convert_external(src2, "eagle3-safeailab", v, tmp_path / "o2", **{flag: True})
    assert not (tmp_path / "o2").exists()


def test_mtp_nan_sentinel_not_written(tmp_path, verifiers):
    v = verifiers["qwen3"]
    src = sources.native_mtp(tmp_path / "s", v)
    theirs = read_tensors(spec_convert(src, v, "mtp", tmp_path / "theirs"))
    assert torch.isnan(torch.from_numpy(theirs["verifier_lm_head.weight"])).all()
    assert bridge.audit(tmp_path / "theirs", verifier=v).exit_code == 1  # speculators' own output fails the audit
    bridge.convert_external(src, "mtp", v, tmp_path / "ours")
    assert "verifier_lm_head.weight" not in read_tensors(tmp_path / "ours")
