"""Every kind of bad input gets the bridge's own typed error naming the culprit, and
nothing is modified or half-written."""

import json
import re
import shutil
import struct

import numpy as np
import pytest

import bridge
from bridge.errors import (
    BridgeError, CheckpointNotFoundError, ConfigError, SafetensorsFormatError, ShardIndexError, TensorMismatchError,
    UnknownModelTypeError, WriteError,
)
from bridge.safetensors_io import SafetensorsFile, write_safetensors


@pytest.fixture
def ck(spec_ckpts, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(spec_ckpts["eagle3-qwen3-bf16-pruned"], d)
    return d


def _edit_config(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _write_raw(path, header: dict | bytes, data: bytes = b"", hlen: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if hlen is None else hlen))
        f.write(raw)
        f.write(data)


def test_missing_config(ck):
    (ck / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        bridge.load_checkpoint(ck)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        bridge.load_checkpoint(tmp_path / "nope")


def test_invalid_json(ck):
    (ck / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        bridge.load_checkpoint(ck)
    assert "config.json" in str(e.value)


def test_missing_model_type_refuses_to_guess(ck):
    _edit_config(ck, lambda c: c.pop("speculators_model_type"))
    with pytest.raises(UnknownModelTypeError, match="speculators_model_type.*refuses to guess"):
        bridge.load_checkpoint(ck)


def test_unknown_model_type(ck):
    _edit_config(ck, lambda c: c.update(speculators_model_type="medusa"))
    with pytest.raises(UnknownModelTypeError, match="'medusa'.*eagle3"):
        bridge.load_checkpoint(ck)


def test_wrong_type_names_key(ck):
    _edit_config(ck, lambda c: c.update(norm_before_fc="yes"))
    with pytest.raises(ConfigError, match="norm_before_fc") as e:
        bridge.load_checkpoint(ck)
    assert e.value.key == "norm_before_fc"


def test_missing_layer_field_names_key(ck):
    _edit_config(ck, lambda c: c["transformer_layer_config"].pop("hidden_size"))
    with pytest.raises(ConfigError, match="transformer_layer_config.hidden_size"):
        bridge.load_checkpoint(ck)


def test_header_length_past_file_end(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, hlen=10**6)
    with pytest.raises(SafetensorsFormatError, match="header length 1000000 is larger than the file"):
        SafetensorsFile(p)


def test_header_not_json(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, b"\xff\xfe{garbage", b"")
    with pytest.raises(SafetensorsFormatError, match="not valid UTF-8 JSON"):
        SafetensorsFile(p)


def test_offsets_out_of_range(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(SafetensorsFormatError, match="'w'.*run past the data buffer"):
        SafetensorsFile(p)


def test_offsets_overlap(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    with pytest.raises(SafetensorsFormatError, match="overlap"):
        SafetensorsFile(p)


def test_unknown_dtype(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, {"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(SafetensorsFormatError, match="'a': unknown dtype 'F7'"):
        SafetensorsFile(p)


def test_shape_times_dtype_mismatch(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, {"a": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(SafetensorsFormatError, match=r"'a': shape \[3, 2\] x BF16 needs 12 bytes but data_offsets span 8"):
        SafetensorsFile(p)


def test_duplicate_tensor_in_header(tmp_path):
    p = tmp_path / "m.safetensors"
    raw = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    _write_raw(p, raw, b"\0")
    with pytest.raises(SafetensorsFormatError, match="'a' twice"):
        SafetensorsFile(p)


def test_file_too_short(tmp_path):
    p = tmp_path / "m.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsFormatError, match="at least 8"):
        SafetensorsFile(p)


def _shard(tmp_path, ck, weight_map_fn):
    """Make a 2-shard copy of ck and let weight_map_fn corrupt its index."""
    out = bridge.save_checkpoint(tmp_path / "sharded", *(lambda c: (c.config, c.tree))(bridge.load_checkpoint(ck)),
                                 max_shard_bytes=3000)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map_fn(idx["weight_map"], out)
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    return out


def test_index_names_missing_shard(ck, tmp_path):
    def corrupt(wm, out):
        k = next(iter(wm))
        (out / wm[k]).unlink()
    out = _shard(tmp_path, ck, corrupt)
    with pytest.raises(ShardIndexError, match="does not exist"):
        bridge.load_checkpoint(out)


def test_index_shard_outside_directory(ck, tmp_path):
    def corrupt(wm, out):
        k = next(iter(wm))
        shutil.copy(out / wm[k], tmp_path / "evil.safetensors")
        wm[k] = "../evil.safetensors"
    out = _shard(tmp_path, ck, corrupt)
    with pytest.raises(ShardIndexError, match="outside the checkpoint directory"):
        bridge.load_checkpoint(out)


def test_same_tensor_in_two_shards(ck, tmp_path):
    def corrupt(wm, out):
        shards = sorted(set(wm.values()))
        name = next(k for k, v in wm.items() if v == shards[0])
        s = bridge.open_tensors(out)
        extra = {n: np.asarray(s.array(n)) for n, v in wm.items() if v == shards[1]}
        extra[name] = np.asarray(s.array(name))
        write_safetensors(out / shards[1], extra, {"format": "pt"})
    out = _shard(tmp_path, ck, corrupt)
    with pytest.raises(ShardIndexError, match="appears in both"):
        bridge.load_checkpoint(out)


def test_index_duplicate_key(ck, tmp_path):
    out = _shard(tmp_path, ck, lambda wm, out: None)
    text = (out / "model.safetensors.index.json").read_text()
    first = text.index('"weight_map": {') + len('"weight_map": {')
    key_line = text[first:].split(",")[0]
    (out / "model.safetensors.index.json").write_text(text[:first] + key_line + "," + text[first:])
    with pytest.raises(ShardIndexError, match="twice"):
        bridge.load_checkpoint(out)


def test_missing_tensor_for_flags(ck):
    _edit_config(ck, lambda c: c.update(norm_before_fc=True))  # requires input_norm.weight
    with pytest.raises(TensorMismatchError, match="input_norm.weight"):
        bridge.load_checkpoint(ck)


def test_unexpected_tensor_for_algorithm(spec_ckpts, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(spec_ckpts["eagle3-llama-f32"], d)
    s = bridge.open_tensors(d)
    flat = {n: np.asarray(s.array(n)) for n in s.names}
    flat["mask_hidden"] = np.zeros((1, 1, 96), np.float32)  # a P-EAGLE tensor in an EAGLE-3 checkpoint
    write_safetensors(d / "model.safetensors", flat, {"format": "pt"})
    with pytest.raises(TensorMismatchError, match="unexpected.*mask_hidden"):
        bridge.load_checkpoint(d)


def test_shape_disagrees_with_config(ck):
    _edit_config(ck, lambda c: c["transformer_layer_config"].update(intermediate_size=65))
    with pytest.raises(TensorMismatchError, match=r"mlp\..*shape"):
        bridge.load_checkpoint(ck)


def test_inputs_never_modified_and_failed_write_leaves_nothing(spec_ckpts, tmp_path, monkeypatch):
    src = spec_ckpts["dflash-llama-bf16"]
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    ck = bridge.load_checkpoint(src)
    import bridge.safetensors_io as sio

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(sio, "write_safetensors", boom)
    with pytest.raises(OSError):
        bridge.save_checkpoint(tmp_path / "out", ck.config, ck.tree)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp dir left behind
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_refuses_existing_destination(spec_ckpts, tmp_path):
    ck = bridge.load_checkpoint(spec_ckpts["mtp-qwen3-f32"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(WriteError, match="destination exists"):
        bridge.save_checkpoint(tmp_path / "out", ck.config, ck.tree)
    with pytest.raises(WriteError, match="destination exists"):
        bridge.save_orbax(tmp_path / "out", ck.config, ck.tree)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    bridge.save_checkpoint(tmp_path / "out", ck.config, ck.tree, overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists()


def test_all_errors_share_one_base():
    for cls in (CheckpointNotFoundError, ConfigError, UnknownModelTypeError, SafetensorsFormatError, ShardIndexError,
                TensorMismatchError, WriteError):
        assert issubclass(cls, BridgeError)


# ----------------------------------------------------------------------------- hostile files ([hardening])


def _padded(header: dict) -> bytes:
    """A header padded with spaces to a multiple of 8 bytes, as the safetensors writers pad it."""
    raw = json.dumps(header).encode()
    return raw + b" " * (-len(raw) % 8 or 8)


def test_header_length_off_by_one_is_refused_not_read_shifted(tmp_path):
    """A header length one short still parses (the padding absorbs it) but would read every tensor
    one byte early; the data buffer must be covered exactly, so it is refused."""
    p = tmp_path / "m.safetensors"
    raw = _padded({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    _write_raw(p, raw, np.arange(2, dtype=np.float32).tobytes(), hlen=len(raw) - 1)
    with pytest.raises(SafetensorsFormatError, match="cover 8 bytes but the data buffer after the header holds 9"):
        SafetensorsFile(p)


def test_trailing_bytes_and_holes_are_refused(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12)
    with pytest.raises(SafetensorsFormatError, match="cover 8 bytes but the data buffer after the header holds 12"):
        SafetensorsFile(p)
    _write_raw(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12)
    with pytest.raises(SafetensorsFormatError, match="4 unused byte.*'a'.*'b'"):
        SafetensorsFile(p)
    _write_raw(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8)
    with pytest.raises(SafetensorsFormatError, match="starts at byte 4 of the data buffer; expected 0"):
        SafetensorsFile(p)


def test_non_regular_files_are_refused_before_they_are_opened(ck, tmp_path):
    """A FIFO would block open() forever and a symlink loop raises a bare OSError: both are typed
    errors naming the file, for the tensors and for config.json."""
    import os

    st = ck / "model.safetensors"
    st.unlink()
    os.mkfifo(st)
    with pytest.raises(SafetensorsFormatError, match="model.safetensors: expected a safetensors file to be a regular "
                                                     "file, found a FIFO"):
        bridge.load_checkpoint(ck)
    st.unlink()
    os.symlink(st, st)  # a loop
    with pytest.raises(SafetensorsFormatError, match="cannot stat a safetensors file: Too many levels of symbolic"):
        bridge.load_checkpoint(ck)
    cfg = ck / "config.json"
    cfg.unlink()
    os.mkfifo(cfg)
    with pytest.raises(ConfigError, match="config.json: expected config.json to be a regular file, found a FIFO"):
        bridge.load_checkpoint(ck)


def test_deeply_nested_json_is_a_typed_error(ck, tmp_path):
    (ck / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="config.json nests 100000 levels deep; expected at most 64"):
        bridge.load_checkpoint(ck)
    p = tmp_path / "m.safetensors"
    _write_raw(p, b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"")
    with pytest.raises(SafetensorsFormatError, match="header nests 5001 levels"):
        SafetensorsFile(p)
    # brackets inside strings do not count
    from bridge.jsonio import json_depth

    assert json_depth(b'{"a": "[[[[{{{", "b": [1, [2]]}') == 3


def _with_tensors(ck, **edits):
    """Rewrite ck/model.safetensors with some tensors replaced (raw numpy arrays, any dtype)."""
    from bridge.safetensors_io import open_tensors

    s = open_tensors(ck)
    tensors = {n: np.array(s.array(n)) for n in s.names}
    meta = s.metadata
    for f in s.files:
        f.close()
    tensors.update(edits)
    (ck / "model.safetensors").unlink()
    write_safetensors(ck / "model.safetensors", tensors, metadata=meta)


def _d2t_t2d(ck):
    from bridge.safetensors_io import open_tensors

    s = open_tensors(ck)
    return np.array(s.array("d2t")), np.array(s.array("t2d"))


@pytest.mark.parametrize("case,match", [
    ("d2t_out_of_range", r"maps to target id .* outside the verifier vocabulary"),
    ("d2t_negative", r"d2t\[0\] = -1 is negative"),
    ("d2t_not_increasing", r"expected strictly increasing"),
    ("t2d_disagrees", r"t2d marks .* target ids but d2t maps .*; they disagree"),
    ("t2d_byte_2", r"t2d holds byte value 2 at index"),
])
def test_vocab_map_values_are_checked_at_load_and_in_audit(ck, case, match):
    d2t, t2d = _d2t_t2d(ck)
    V = t2d.size
    if case == "d2t_out_of_range":
        d2t[-1] = V  # last draft id -> beyond the vocabulary
    elif case == "d2t_negative":
        d2t[0] = -1
    elif case == "d2t_not_increasing":
        d2t[1] = d2t[0] - 1  # draft id 1 -> the same target id as draft id 0
    elif case == "t2d_disagrees":
        t2d = t2d.copy()
        t2d[np.flatnonzero(~t2d)[0]] = True
    if case == "t2d_byte_2":
        raw = t2d.view(np.uint8).copy()
        raw[np.flatnonzero(raw)[0]] = 2
        _with_tensors(ck, t2d=raw.view(np.bool_))
    else:
        _with_tensors(ck, d2t=d2t, t2d=t2d)
    with pytest.raises(TensorMismatchError, match=match) as ei:
        bridge.load_checkpoint(ck)
    assert ei.value.key in ("d2t", "t2d")
    rep = bridge.audit(ck)
    assert any(f.rule == "vocab.values" and re.search(match, f.message) for f in rep.errors), rep.findings
    assert rep.exit_code == 1


def test_valid_vocab_maps_pass(ck):
    from bridge.vocab_maps import vocab_map_problems

    d2t, t2d = _d2t_t2d(ck)
    assert vocab_map_problems(d2t, t2d.tobytes(), t2d.size) == []
    bridge.load_checkpoint(ck)
    assert not [f for f in bridge.audit(ck).errors if f.rule == "vocab.values"]


def test_unfilled_vocab_maps_warn_in_a_header_audit_and_fail_deep_and_at_load(ck):
    d2t, t2d = _d2t_t2d(ck)
    _with_tensors(ck, d2t=np.zeros_like(d2t), t2d=np.zeros_like(t2d))
    assert [f.rule for f in bridge.audit(ck).findings if f.key == "t2d"] == ["vocab.unfilled"]
    assert any(f.rule == "vocab.values" for f in bridge.audit(ck, deep=True).errors)
    with pytest.raises(TensorMismatchError, match="t2d marks 0 target ids but d2t maps"):
        bridge.load_checkpoint(ck)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["transformer_layer_config"].update(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (lambda c: c["transformer_layer_config"].update(rms_norm_eps=float("inf")), "rms_norm_eps"),
    (lambda c: c["transformer_layer_config"].update(rms_norm_eps=0.0), "rms_norm_eps"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["full_attention"] * 7), r"layer_types has 7 entries"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(accept_tolerance=float("inf")), "accept_tolerance"),
])
def test_config_values_that_cannot_run_or_round_trip_are_refused(ck, edit, match):
    """NaN/inf floats (Orbax would store null and fail to restore), a non-positive norm epsilon and
    layer_types not one per layer are config errors at load and in audit."""
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))  # json writes NaN / Infinity literals
    with pytest.raises(ConfigError, match=match):
        bridge.load_checkpoint(ck)
    rep = bridge.audit(ck)
    assert rep.exit_code == 2 and re.search(match, rep.unreadable)


def _layer(**upd):
    return lambda c: c["transformer_layer_config"].update(**upd)


@pytest.mark.parametrize("edit,key,match", [
    (_layer(rope_parameters={}), "rope_parameters.rope_theta", r"rope_theta is None; expected a finite number > 0"),
    (_layer(rope_parameters=None), "rope_parameters", r"rope_parameters is None; expected an object"),
    (_layer(rope_parameters={"rope_type": "default", "rope_theta": -5.0}), "rope_parameters.rope_theta",
     r"rope_theta is -5.0"),
    (_layer(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_parameters.factor",
     r"rope_type 'yarn' needs 'factor'"),
    (_layer(rope_parameters={"rope_type": "ntk9", "rope_theta": 1e6}), "rope_parameters.rope_type",
     r"rope_type 'ntk9' is not a transformers rope type"),
    (_layer(layer_types=None), "layer_types", r"layer_types is None; expected a list"),
    (_layer(head_dim=None, hidden_size=33), "transformer_layer_config", r"not a multiple of num_attention_heads"),
    (_layer(hidden_act="slu"), "hidden_act", r"hidden_act 'slu' is not a transformers activation"),
    (_layer(model_type="gpt2"), "model_type", r"model_type 'gpt2' is not a decoder family"),
    (_layer(dtype="float99"), "dtype", r"dtype 'float99' is not a dtype name"),
    (lambda c: c.update(dtype="float99"), "dtype", r"dtype 'float99' is not a dtype name"),
    (lambda c: c.update(tie_word_embeddings=2), "tie_word_embeddings", r"tie_word_embeddings is 2; expected true or false"),
    (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings", r"expected true or false"),
    (_layer(tie_word_embeddings="false"), "tie_word_embeddings", r"valid boolean"),
    (lambda c: c["speculators_config"].update(algorithm="eagle9"), "speculators_config.algorithm",
     r"algorithm is 'eagle9' but speculators_model_type is 'eagle3'"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[]), "eagle_aux_hidden_state_layer_ids", r"empty list"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[10**9, 1, 2]), "eagle_aux_hidden_state_layer_ids",
     r"aux layer id 1000000000 is beyond any verifier's depth"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(verifier_accept_k=10**9), "verifier_accept_k",
     r"verifier_accept_k 1000000000 exceeds the verifier vocabulary \(96 tokens\)"),
])
def test_every_config_field_the_models_read_is_checked_at_load_and_in_audit(ck, edit, key, match):
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match) as ei:
        bridge.load_checkpoint(ck)
    assert key in (ei.value.key or ""), ei.value.key
    rep = bridge.audit(ck)
    if rep.unreadable:
        assert re.search(match, rep.unreadable) and rep.exit_code == 2
    else:  # checks that need the parsed config are audit rules (exit 1)
        assert any(re.search(match, f.message) for f in rep.errors) and rep.exit_code == 1, rep.findings


def test_mtp_checkpoint_naming_another_algorithm_is_refused(spec_ckpts, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(spec_ckpts["mtp-qwen3-f32"], d)
    _edit_config(d, lambda c: c["speculators_config"].update(algorithm="dflash"))
    with pytest.raises(ConfigError, match="algorithm is 'dflash' but speculators_model_type is 'mtp'"):
        bridge.load_checkpoint(d)


def test_empty_weight_map_is_unreadable_for_every_command(ck, tmp_path):
    from typer.testing import CliRunner

    from specjax.cli import app

    out = _shard(tmp_path, ck, lambda wm, out: wm.clear())
    with pytest.raises(ShardIndexError, match="weight_map is empty"):
        bridge.load_checkpoint(out)
    runner = CliRunner()
    codes = {cmd: runner.invoke(app, args).exit_code for cmd, args in [
        ("inspect", ["inspect", str(out)]), ("audit", ["audit", str(out)]),
        ("convert", ["convert", str(out), str(tmp_path / "o")])]}
    assert codes == {"inspect": 2, "audit": 2, "convert": 2}
    assert not (tmp_path / "o").exists()


def test_a_shard_the_index_does_not_name_is_refused(ck, tmp_path):
    def drop_one_shard(wm, out):
        gone = sorted(set(wm.values()))[-1]
        for k in [k for k, v in wm.items() if v == gone]:
            del wm[k]
    out = _shard(tmp_path, ck, drop_one_shard)
    with pytest.raises(ShardIndexError, match="the index names no tensor in it"):
        bridge.load_checkpoint(out)
