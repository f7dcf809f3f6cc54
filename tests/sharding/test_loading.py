"""Sharded loading code paths on this process's single device (the 8-device equality tests are
in mesh8_suite.py): target (HF dir, GGUF), draft, bridge.to_device and Orbax restore into
NamedShardings; the rule check runs before anything is read."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import bridge
import specjax.sharding as shd
from tests.sharding import tiny


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("load1")
    return {"target": tiny.write_target(root / "target"), "draft": tiny.write_eagle3(root / "eagle3")}


def test_target_and_draft_on_a_one_device_mesh(ckpts):
    from specjax.models.drafts import load_draft
    from specjax.models.hf import load_hf_dir

    mesh = shd.make_mesh()
    seen = []
    lt = shd.load_target(ckpts["target"], mesh, progress=False, on_slice=lambda p, i, n: seen.append(p))
    k = lt.model.model.layers[0].mlp.down_proj.kernel.get_value()
    assert isinstance(k.sharding, NamedSharding) and k.sharding.spec == P("tensor", "fsdp")
    assert "model.layers.0.mlp.down_proj.kernel" in seen
    ids = np.arange(3, 13, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(lt.model(ids).logits), np.asarray(load_hf_dir(ckpts["target"])(ids).logits))
    d = shd.load_draft(ckpts["draft"], lt, mesh)
    assert d.fc.kernel.get_value().sharding.spec == P("fsdp", None)
    ref = load_draft(ckpts["draft"], ckpts["target"])
    x = tiny.eagle3_inputs(batch=2)
    np.testing.assert_array_equal(np.asarray(d(**x, ttt_steps=1).logits), np.asarray(ref(**x, ttt_steps=1).logits))


def test_rule_check_runs_before_reading(ckpts):
    mesh = shd.make_mesh()
    rules = shd.PartitionRules.of("partial", [r for r in shd.TARGET_RULES if "lm_head" not in r.pattern])
    seen = []
    with pytest.raises(shd.UnmatchedParamError, match=r"lm_head\.kernel \[32, 96\]"):
        shd.load_target(ckpts["target"], mesh, rules=rules, progress=False, on_slice=lambda *a: seen.append(a))
    assert seen == []


def test_bridge_to_device_and_orbax_restore_give_sharded_arrays(ckpts, tmp_path):
    from bridge.layout import get_path, iter_leaves

    mesh = shd.make_mesh()
    ck = bridge.load_checkpoint(ckpts["draft"])
    fn = shd.sharding_fn(ck.tree, shd.DRAFT_RULES, mesh)
    tree = ck.to_device(sharding=fn, progress=False)
    ob = bridge.save_orbax(tmp_path / "ob", ck.config, ck.tree, metadata=ck.metadata)
    _, restored, _ = bridge.restore_orbax(ob, sharding=fn)  # bridge's own entry, with a sharding callable
    for path, a in iter_leaves(restored):
        assert isinstance(a, jax.Array) and a.sharding == fn(path), path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(get_path(tree, path)))
