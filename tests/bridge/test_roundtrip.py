"""speculators -> tree -> speculators and speculators -> Orbax -> speculators are bit-exact,
for checkpoints written by speculators 0.9.0 itself."""

import json
import shutil

import numpy as np
import pytest

import bridge
from bridge.roundtrip import compare, convert
from bridge.safetensors_io import open_tensors


def _tensor_bytes(d):
    s = open_tensors(d)
    return {n: (s.info(n).dtype, s.info(n).shape, s.raw_bytes(n)) for n in s.names}


def test_tree_roundtrip_is_bit_exact(case, tmp_path):
    name, src = case
    ck = bridge.load_checkpoint(src)
    out = bridge.save_checkpoint(tmp_path / "out", ck.config, ck.tree, metadata=ck.metadata)
    assert _tensor_bytes(out) == _tensor_bytes(src)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    # same file, byte for byte, since the writer follows the safetensors library's layout
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_orbax_roundtrip_is_bit_exact(case, tmp_path):
    name, src = case
    ck = bridge.load_checkpoint(src)
    ob = bridge.save_orbax(tmp_path / "orbax", ck.config, ck.tree, metadata=ck.metadata)
    cfg, tree, meta = bridge.restore_orbax(ob)
    out = bridge.save_checkpoint(tmp_path / "back", cfg, tree, metadata=meta)
    assert _tensor_bytes(out) == _tensor_bytes(src)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_tree_layout(spec_ckpts):
    ck = bridge.load_checkpoint(spec_ckpts["eagle3-qwen3-bf16-pruned"])
    src = open_tensors(spec_ckpts["eagle3-qwen3-bf16-pruned"])
    q = ck.tree["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert q.shape == (64, 32)  # Flax [in, out]; speculators stores [out, in] = [32, 64]
    np.testing.assert_array_equal(np.asarray(q).T, src.array("layers.0.self_attn.q_proj.weight"))
    assert ck.tree["norm"]["scale"].dtype.name == "bfloat16"
    assert ck.tree["t2d"].dtype == np.bool_ and ck.tree["d2t"].dtype == np.int64
    assert ck.tree["embed_tokens"]["embedding"].shape == (96, 32)
    assert "kernel" in ck.tree["lm_head"]


def test_lazy_views_read_nothing_until_touched(spec_ckpts):
    ck = bridge.load_checkpoint(spec_ckpts["dflash-qwen3-f32-pruned"])
    leaf = ck.tree["fc"]["kernel"]
    assert not leaf.flags.writeable  # a read-only view over the file mapping, not a copy
    assert leaf.base is not None


def test_unknown_config_keys_preserved(spec_ckpts, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(spec_ckpts["eagle3-llama-f32"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["my_future_key"] = {"nested": [1, 2, 3]}
    cfg["transformer_layer_config"]["exotic_rope_knob"] = 0.5
    (src / "config.json").write_text(json.dumps(cfg))
    ck = bridge.load_checkpoint(src)
    out = bridge.save_checkpoint(tmp_path / "out", ck.config, ck.tree, metadata=ck.metadata)
    assert json.loads((out / "config.json").read_text()) == cfg


def test_sharded_write_and_read(spec_ckpts, tmp_path):
    src = spec_ckpts["dflash-qwen3-f32-pruned"]
    ck = bridge.load_checkpoint(src)
    out = bridge.save_checkpoint(tmp_path / "sharded", ck.config, ck.tree, metadata=ck.metadata,
                                 max_shard_bytes=20_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (out / "model.safetensors.index.json").exists()
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"].values()) == set(shards)
    assert _tensor_bytes(out) == _tensor_bytes(src)
    # and back to a single file, bit-exact
    ck2 = bridge.load_checkpoint(out)
    single = bridge.save_checkpoint(tmp_path / "single", ck2.config, ck2.tree, metadata=ck2.metadata)
    assert (single / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_convert_api_with_check_both_ways(spec_ckpts, tmp_path):
    src = spec_ckpts["dspark-qwen3-rnn-bf16"]
    r1 = convert(src, tmp_path / "o", "orbax", check=True)
    assert r1["check"]["identical"]
    r2 = convert(tmp_path / "o", tmp_path / "s", "speculators", check=True)
    assert r2["check"]["identical"]
    assert compare(src, tmp_path / "s")["tensors"] == len(open_tensors(src).names)


def test_roundtrip_check_detects_a_flipped_bit(spec_ckpts, tmp_path):
    from bridge.roundtrip import RoundTripMismatch

    src = spec_ckpts["eagle3-llama-f32"]
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    data = bytearray((dst / "model.safetensors").read_bytes())
    data[-3] ^= 0x01  # last tensor's data
    (dst / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(RoundTripMismatch, match="bytes differ"):
        compare(src, dst)


def test_loaded_by_speculators_after_roundtrip(spec_ckpts, tmp_path):
    """What specjax writes, speculators 0.9.0 reads back to the same state dict."""
    import torch
    from speculators.model import SpeculatorModel

    src = spec_ckpts["eagle3-qwen3-bf16-pruned"]
    ck = bridge.load_checkpoint(src)
    cfg, tree, meta = bridge.restore_orbax(bridge.save_orbax(tmp_path / "o", ck.config, ck.tree))
    out = bridge.save_checkpoint(tmp_path / "s", cfg, tree, metadata=meta)
    a = SpeculatorModel.from_pretrained(str(src)).state_dict()
    b = SpeculatorModel.from_pretrained(str(out)).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_to_device_matches_numpy(spec_ckpts):
    import jax

    ck = bridge.load_checkpoint(spec_ckpts["eagle3-qwen3-bf16-pruned"])
    dev = ck.to_device()
    from bridge.layout import get_path, iter_leaves

    n = 0
    for path, leaf in iter_leaves(ck.tree):
        d = get_path(dev, path)
        assert isinstance(d, jax.Array)
        if leaf.dtype == np.int64:
            np.testing.assert_array_equal(np.asarray(d), leaf)  # int32 on device without x64; same values
        else:
            assert d.dtype == leaf.dtype
            np.testing.assert_array_equal(np.asarray(d), leaf)
        n += 1
    assert n == len(ck.store.names)


def test_to_device_with_named_sharding_and_cast(spec_ckpts):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    ck = bridge.load_checkpoint(spec_ckpts["dflash-qwen3-f32-pruned"])
    dev = ck.to_device(sharding=lambda path: NamedSharding(mesh, P()), dtype=jnp.bfloat16)
    k = dev["fc"]["kernel"]
    assert isinstance(k.sharding, NamedSharding) and k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(k), np.asarray(ck.tree["fc"]["kernel"]).astype(jnp.bfloat16))
    assert dev["t2d"].dtype == jnp.bool_
