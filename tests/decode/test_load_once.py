"""One load path: loading a draft for decoding reads its config.json once and each safetensors
header once, and runs the draft-verifier compatibility check once (the bridge's check_verifier,
through check_pair)."""

import collections
import sys

import bridge.auditor
import bridge.jsonio
import bridge.safetensors_io
import specjax.decode.speculative as spec
from specjax.models.hf import load_hf_dir


def _count(monkeypatch, calls):
    real_json, real_hdr, real_check = bridge.jsonio.read_json, bridge.safetensors_io.parse_header, bridge.auditor.check_verifier

    def read_json(p, *a, **k):
        calls["read " + str(p).rsplit("/", 1)[-1]] += 1
        return real_json(p, *a, **k)

    def parse_header(p, *a, **k):
        calls["header " + str(p).rsplit("/", 1)[-1]] += 1
        return real_hdr(p, *a, **k)

    def check_verifier(*a, **k):
        calls["compatibility check"] += 1
        return real_check(*a, **k)

    for m in list(sys.modules.values()):  # every module that imported the functions by name
        if getattr(m, "__name__", "").startswith(("bridge", "specjax")):
            for name, real, fake in (("read_json", real_json, read_json), ("parse_header", real_hdr, parse_header),
                                     ("check_verifier", real_check, check_verifier)):
                if getattr(m, name, None) is real:
                    monkeypatch.setattr(m, name, fake)


def test_a_draft_load_reads_each_file_once(verifiers, tmp_path, monkeypatch):
    from tests.refs.speculators_ckpts import build

    path = build("eagle3", tmp_path / "e", verifiers["llama"], draft_vocab=40)
    target = load_hf_dir(verifiers["llama"])
    calls = collections.Counter()
    _count(monkeypatch, calls)
    sd = spec.load_spec_draft(str(path), target)
    assert sd.module.algorithm == "eagle3"
    assert calls == {"read config.json": 1, "header model.safetensors": 1, "compatibility check": 1}, calls
