"""Property: random corruptions of a valid checkpoint never raise anything but the bridge's
own errors (and a load that succeeds still reads every tensor)."""

import json
import shutil
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import bridge
from bridge.errors import BridgeError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _try_load(d):
    try:
        ck = bridge.load_checkpoint(d)
        for n in ck.store.names:
            np.asarray(ck.store.array(n)).sum()
    except BridgeError:
        pass
    rep = bridge.audit(d, deep=True)  # the audit never raises on bad input
    assert rep.exit_code in (0, 1, 2)


@SETTINGS
@given(data=st.data())
def test_byte_corruptions_of_safetensors(spec_ckpts, tmp_path_factory, data):
    src = spec_ckpts["eagle3-qwen3-bf16-pruned"]
    d = tmp_path_factory.mktemp("fz")
    shutil.copytree(src, d / "c")
    d = d / "c"
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
            st.none(), st.booleans(), st.sampled_from(["F8_E4M3", "BOOL", "I64", "Q4"])))
        new = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(new)) + new + raw[8 + hlen:])
    (d / "model.safetensors").write_bytes(bytes(raw))
    _try_load(d)


@SETTINGS
@given(data=st.data())
def test_config_corruptions(spec_ckpts, tmp_path_factory, data):
    src = spec_ckpts["dflash-qwen3-f32-pruned"]
    d = tmp_path_factory.mktemp("fc") / "c"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    value = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**9), st.floats(allow_nan=True),
                      st.text(max_size=8), st.lists(st.integers(-2, 200), max_size=6), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
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
    _try_load(d)
