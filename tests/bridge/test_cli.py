"""The bridge commands as a user runs them: output, exit codes, no tracebacks."""

import json
import shutil

from typer.testing import CliRunner

from specjax.cli import app
from tests.bridge.headers import gemma4_31b_dflash

runner = CliRunner()


def test_inspect_reads_header_only(spec_ckpts, tmp_path):
    # a sparse, header-only checkpoint of real size inspects instantly: no tensor data is read
    d = gemma4_31b_dflash(tmp_path)
    r = runner.invoke(app, ["inspect", str(d)])
    assert r.exit_code == 0, r.output
    for s in ("dflash", "google/gemma-4-31B-it", "[1, 17, 29, 47, 58]", "262144", "32000", "fc.weight", "5376x26880"):
        assert s in r.output, s
    r = runner.invoke(app, ["inspect", str(spec_ckpts["eagle3-qwen3-bf16-pruned"]), "--json"])
    j = json.loads(r.output)
    assert j["algorithm"] == "eagle3" and j["draft_vocab_size"] == 40 and j["tensors"]["t2d"]["dtype"] == "BOOL"


def test_audit_exit_codes_and_json(spec_ckpts, verifiers, tmp_path):
    ok = runner.invoke(app, ["audit", str(spec_ckpts["eagle3-llama-f32"]), "--verifier", str(verifiers["llama"])])
    assert ok.exit_code == 0 and "OK" in ok.output
    bad = runner.invoke(app, ["audit", str(gemma4_31b_dflash(tmp_path)), "--json"])
    assert bad.exit_code == 1
    j = json.loads(bad.output)
    assert j["exit_code"] == 1 and any("speculative_tokens 8" in e["message"] for e in j["errors"])
    assert any(w["rule"] == "verifier.binding" for w in j["warnings"])
    unreadable = runner.invoke(app, ["audit", str(tmp_path / "missing")])
    assert unreadable.exit_code == 2 and "Traceback" not in unreadable.output


def test_convert_round_trip_cli(spec_ckpts, tmp_path):
    src = spec_ckpts["peagle-qwen3-bf16-pruned"]
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o"), "--to", "orbax", "--check"])
    assert r.exit_code == 0, r.output
    assert "bit-exact" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "o"), str(tmp_path / "s"), "--to", "speculators", "--check",
                            "--max-shard-size", "20KB"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "s" / "model.safetensors.index.json").exists()
    # existing destination is refused without --overwrite, with a message and no traceback
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "s"), "--to", "speculators"])
    assert r.exit_code == 2 and "destination exists" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "s"), "--to", "speculators", "--overwrite", "--check"])
    assert r.exit_code == 0, r.output


def test_convert_bad_source_message(tmp_path):
    (tmp_path / "x").mkdir()
    r = runner.invoke(app, ["convert", str(tmp_path / "x"), str(tmp_path / "y"), "--to", "orbax"])
    assert r.exit_code == 2 and "not a speculators checkpoint" in r.output
    assert not (tmp_path / "y").exists()


def test_convert_bad_format(spec_ckpts, tmp_path):
    r = runner.invoke(app, ["convert", str(spec_ckpts["mtp-qwen3-f32"]), str(tmp_path / "y"), "--to", "gguf"])
    assert r.exit_code == 2 and "--to must be" in r.output


def test_specjax_without_arguments_runs_the_default_model():
    r = runner.invoke(app, [])
    assert r.exit_code == 0, r.output
    assert "SmolLM2-135M-Instruct" in r.output and "Fibonacci" in r.output
    assert "def " in r.output  # the model answered the code prompt with code


def test_audit_prints_rule_names_literally(tmp_path):
    r = runner.invoke(app, ["audit", str(gemma4_31b_dflash(tmp_path))])
    assert "[dflash.speculative_tokens]" in r.output and "[verifier.binding]" in r.output
