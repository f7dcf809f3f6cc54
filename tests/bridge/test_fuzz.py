"""Property tests over corrupted checkpoints (issue #24's families): every input ends in one of two
ways, never a third:

* a typed ``BridgeError`` from ``load_checkpoint``, which ``audit`` also reports (exit 1 or 2), or
* a checkpoint that loads, reads every tensor, and round-trips speculators -> Orbax -> speculators
  bit-exactly.

``test_always_bad_families`` draws from corruptions that can never be a valid checkpoint (header
length off, trailing bytes, holes, FIFO, symlink loop, nested JSON, vocabulary maps out of range,
a float tensor relabelled as integer, config values the models cannot run, an empty or incomplete
index): they must be refused by load *and* by a plain (header-only) audit. A hang is a failure
(an alarm interrupts it)."""

import contextlib
import json
import os
import shutil
import signal
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import bridge
from bridge.errors import BridgeError
from bridge.roundtrip import convert

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
BASE = "eagle3-qwen3-bf16-pruned"


@contextlib.contextmanager
def no_hang(seconds=20):
    def boom(*_):
        raise TimeoutError(f"hung for {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load_outcome(d):
    """The BridgeError load raised, or None after reading every tensor."""
    with no_hang():
        try:
            ck = bridge.load_checkpoint(d)
            for n in ck.store.names:
                np.asarray(ck.store.array(n)).sum()
        except BridgeError as e:
            return e
    return None


def audit_code(d, **kw):
    with no_hang():
        return bridge.audit(d, **kw).exit_code


def assert_typed_error_or_exact_round_trip(d, work):
    err = load_outcome(d)
    if err is not None:
        assert audit_code(d, deep=True) in (1, 2), f"load refused ({err}) but the deep audit passed"
        return
    convert(d, work / "orbax", "orbax", check=True)  # check: read back and compared bit-exactly
    convert(work / "orbax", work / "back", "speculators", check=True)
    bridge.roundtrip.compare(d, work / "back")


# ---------------------------------------------------------------- random corruptions

@SETTINGS
@given(data=st.data())
def test_byte_corruptions_of_safetensors(spec_ckpts, tmp_path_factory, data):
    d = tmp_path_factory.mktemp("fz") / "c"
    shutil.copytree(spec_ckpts[BASE], d)
    raw = bytearray((d / "model.safetensors").read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    kind = data.draw(st.sampled_from(["flip_header", "truncate", "length", "splice_json"]))
    if kind == "flip_header":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, 8 + hlen - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "length":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    else:
        header = json.loads(raw[8:8 + hlen])
        name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = data.draw(st.one_of(
            st.integers(-5, 10**12), st.text(max_size=5), st.lists(st.integers(-3, 10**6), max_size=4),
            st.none(), st.booleans(), st.sampled_from(["F8_E4M3", "BOOL", "I64", "Q4", "U16", "I16", "F16"])))
        new = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(new)) + new + raw[8 + hlen:])
    (d / "model.safetensors").write_bytes(bytes(raw))
    assert_typed_error_or_exact_round_trip(d, d.parent)


@SETTINGS
@given(data=st.data())
def test_config_corruptions(spec_ckpts, tmp_path_factory, data):
    src = data.draw(st.sampled_from([BASE, "dflash-qwen3-f32-pruned", "mtp-qwen3-f32", "dspark-qwen3-f32"]))
    d = tmp_path_factory.mktemp("fc") / "c"
    shutil.copytree(spec_ckpts[src], d)
    cfg = json.loads((d / "config.json").read_text())
    value = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**9), st.floats(allow_nan=True),
                      st.text(max_size=8), st.lists(st.integers(-2, 200), max_size=6),
                      st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    target = data.draw(st.sampled_from(["top", "layer", "spec", "text"]))
    if target == "top":
        cfg[data.draw(st.sampled_from(sorted(cfg)))] = data.draw(value)
    elif target == "layer":
        lc = cfg["transformer_layer_config"]
        lc[data.draw(st.sampled_from(sorted(lc)))] = data.draw(value)
    elif target == "spec":
        cfg["speculators_config"]["proposal_methods"][0][data.draw(st.sampled_from(
            ["speculative_tokens", "verifier_accept_k", "accept_tolerance", "proposal_type"]))] = data.draw(value)
    if target == "text":
        text = json.dumps(cfg)
        i = data.draw(st.integers(0, len(text) - 1))
        (d / "config.json").write_text(text[:i] + data.draw(st.text(max_size=3)) + text[i + 1:])
    else:
        (d / "config.json").write_text(json.dumps(cfg))
    assert_typed_error_or_exact_round_trip(d, d.parent)


# ---------------------------------------------------------------- families that are never valid

def _rewrite(path, header: dict, data: bytes, *, hlen_delta=0, pad=0):
    raw = json.dumps(header).encode() + b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) + hlen_delta))
        f.write(raw)
        f.write(data)


def _parts(path):
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + hlen]), raw[8 + hlen:]


def _retensor(d, **edits):
    from bridge.safetensors_io import open_tensors, write_safetensors

    s = open_tensors(d)
    tensors = {n: np.array(s.array(n)) for n in s.names}
    meta = s.metadata
    for f in s.files:
        f.close()
    tensors.update(edits)
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", tensors, metadata=meta)


RELABEL = {"BF16": ("U16", "I16"), "F32": ("U32", "I32"), "F16": ("U16", "I16")}
BAD_CONFIG = [
    ("transformer_layer_config", "rms_norm_eps", float("nan")),
    ("transformer_layer_config", "rope_parameters", {}),
    ("transformer_layer_config", "rope_parameters", None),
    ("transformer_layer_config", "rope_parameters", {"rope_type": "default", "rope_theta": -1.0}),
    ("transformer_layer_config", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6}),
    ("transformer_layer_config", "layer_types", None),
    ("transformer_layer_config", "layer_types", ["full_attention"] * 5),
    ("transformer_layer_config", "hidden_act", "silux"),
    ("transformer_layer_config", "model_type", "gpt2"),
    ("transformer_layer_config", "dtype", "float99"),
    ("transformer_layer_config", "tie_word_embeddings", "false"),
    (None, "tie_word_embeddings", 2),
    (None, "dtype", "float99"),
    (None, "eagle_aux_hidden_state_layer_ids", []),
    (None, "eagle_aux_hidden_state_layer_ids", [10**9, 1, 2]),
    ("speculators_config", "algorithm", "eagle9"),
    ("speculators_config", "algorithm", "dflash"),
    ("proposal", "accept_tolerance", float("inf")),
    ("proposal", "verifier_accept_k", 10**9),
]


FAMILIES = ["header_length", "trailing_bytes", "hole", "fifo", "symlink_loop", "nested_json", "d2t_range",
            "d2t_negative", "t2d_disagrees", "t2d_byte", "dtype_kind", "config_value", "index_empty",
            "index_missing_shard_tensors"]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_always_bad_families(spec_ckpts, tmp_path_factory, family, data):
    src = BASE if family != "dtype_kind" else data.draw(st.sampled_from([BASE, "eagle3-llama-f32"]))
    d = tmp_path_factory.mktemp("bad") / "c"
    shutil.copytree(spec_ckpts[src], d)
    st_path = d / "model.safetensors"
    if family == "header_length":
        header, blob = _parts(st_path)
        pad = data.draw(st.integers(1, 7))  # spaces after the JSON keep it parseable when the length shrinks
        delta = data.draw(st.sampled_from([-k for k in range(1, pad + 1)] + [1, 2, 3, 8]))
        _rewrite(st_path, header, blob, hlen_delta=delta, pad=pad)
    elif family == "trailing_bytes":
        with open(st_path, "ab") as f:
            f.write(b"\0" * data.draw(st.integers(1, 64)))
    elif family == "hole":
        header, blob = _parts(st_path)
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        i = data.draw(st.integers(0, len(names) - 1))
        gap = data.draw(st.integers(1, 32))
        cut = header[names[i]]["data_offsets"][0]
        for n in names[i:]:
            header[n]["data_offsets"] = [o + gap for o in header[n]["data_offsets"]]
        _rewrite(st_path, header, blob[:cut] + b"\0" * gap + blob[cut:])
    elif family == "fifo":
        st_path.unlink()
        os.mkfifo(st_path)
    elif family == "symlink_loop":
        st_path.unlink()
        os.symlink("model.safetensors", st_path)
    elif family == "nested_json":
        depth = data.draw(st.integers(100, 100_000))
        (d / "config.json").write_text("[" * depth + "]" * depth)
    elif family in ("d2t_range", "d2t_negative", "t2d_disagrees", "t2d_byte"):
        from bridge.safetensors_io import open_tensors

        s = open_tensors(d)
        d2t, t2d = np.array(s.array("d2t")), np.array(s.array("t2d"))
        for f in s.files:
            f.close()
        i = data.draw(st.integers(0, d2t.size - 1))
        if family == "d2t_range":
            d2t[-1] += data.draw(st.integers(t2d.size, 10**6))
            _retensor(d, d2t=d2t)
        elif family == "d2t_negative":
            d2t[i] = -data.draw(st.integers(1, 10**6)) - i
            _retensor(d, d2t=d2t)
        elif family == "t2d_disagrees":
            off = np.flatnonzero(~t2d)
            t2d[off[data.draw(st.integers(0, off.size - 1))]] = True
            _retensor(d, t2d=t2d)
        else:
            raw = t2d.view(np.uint8).copy()
            raw[np.flatnonzero(raw)[i]] = data.draw(st.integers(2, 255))
            _retensor(d, t2d=raw.view(np.bool_))
    elif family == "dtype_kind":
        header, blob = _parts(st_path)
        floats = sorted(k for k in header if k != "__metadata__" and header[k]["dtype"] in RELABEL)
        name = data.draw(st.sampled_from(floats))
        header[name]["dtype"] = data.draw(st.sampled_from(RELABEL[header[name]["dtype"]]))
        _rewrite(st_path, header, blob)
    elif family == "config_value":
        where, key, value = data.draw(st.sampled_from(BAD_CONFIG), label="edit")
        cfg = json.loads((d / "config.json").read_text())
        obj = {None: cfg, "transformer_layer_config": cfg["transformer_layer_config"],
               "speculators_config": cfg["speculators_config"],
               "proposal": cfg["speculators_config"]["proposal_methods"][0]}[where]
        obj[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        ck = bridge.load_checkpoint(d)
        shutil.rmtree(d)
        bridge.save_checkpoint(d, ck.config, ck.tree, metadata=ck.metadata, max_shard_bytes=3000)
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        if family == "index_empty":
            idx["weight_map"] = {}
        else:  # an optional tensor's shard left out of the map: it would be silently dropped
            gone = data.draw(st.sampled_from(sorted(set(idx["weight_map"].values()))))
            idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != gone}
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    err = load_outcome(d)
    assert err is not None, f"{family}: loaded without an error"
    assert audit_code(d) in (1, 2), f"{family}: load refused ({err}) but a plain audit passed"
