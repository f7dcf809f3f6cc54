"""`specjax convert SRC DST --from KIND --verifier DIR`: the same call as bridge.convert_external."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import bridge
from specjax.cli import app
from tests.bridge.external import sources
from tests.bridge.external.conftest import read_config

runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["convert", *map(str, args)])


def test_auto_says_what_it_detected(tmp_path, verifiers):
    src = sources.zlab_dflash(tmp_path / "s", verifiers["qwen3"])
    r = run(src, tmp_path / "o", "--from", "auto", "--verifier", verifiers["qwen3"])
    assert r.exit_code == 0, r.output
    for s in ("detected dflash-zlab", "dflash_config", "wrote speculators dflash checkpoint", "aux ids [1, 3, 5]",
              "audit: OK", "[dflash.aux_offset]"):
        assert s in r.output, (s, r.output)


def test_cli_and_api_write_the_same_bytes(tmp_path, verifiers):
    v = verifiers["llama"]
    src = sources.safeailab_eagle3(tmp_path / "s", v)
    r = run(src, tmp_path / "cli", "--from", "eagle3-safeailab", "--verifier", v, "--norm-before-residual",
            "--norm-output", "--aux-layer-ids", "1,3,4")
    assert r.exit_code == 0, r.output
    bridge.convert_external(src, "eagle3-safeailab", str(v), tmp_path / "api", norm_before_residual=True,
                            norm_output=True, eagle_aux_hidden_state_layer_ids=[1, 3, 4])
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "api" / f).read_bytes(), f
    c = read_config(tmp_path / "cli")
    assert c["norm_before_residual"] is True and c["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_options_json_and_json_output(tmp_path, verifiers):
    v = verifiers["qwen3"]
    src = sources.native_mtp(tmp_path / "s", v)
    r = run(src, tmp_path / "o", "--from", "mtp", "--verifier", v, "--options", '{"num_speculative_steps": 2}',
            "--json")
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    assert j["source_kind"] == "mtp" and j["options"] == {"num_speculative_steps": 2} and j["audit"]["exit_code"] == 0
    assert read_config(tmp_path / "o")["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    r = run(src, tmp_path / "o2", "--from", "mtp", "--verifier", v, "--num-speculative-steps", "4",
            "--max-shard-size", "2KB")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o2" / "model.safetensors.index.json").exists()
    assert bridge.audit(tmp_path / "o2", verifier=v).exit_code == 0


def test_errors_exit_2_without_traceback(tmp_path, verifiers):
    v = verifiers["llama"]
    src = sources.safeailab_eagle3(tmp_path / "s", v)
    cases = [
        ((src, tmp_path / "o", "--from", "eagle", "--verifier", v), "unknown source kind --from 'eagle'"),
        ((src, tmp_path / "o", "--from", "auto"), "a verifier is required"),
        ((src, tmp_path / "o", "--from", "dflash-zlab", "--verifier", v), "looks like --from eagle3-safeailab"),
        ((src, tmp_path / "o", "--from", "auto", "--verifier", v, "--num-speculative-steps", "2"),
         "do not apply to --from eagle3-safeailab"),
    ]
    for args, msg in cases:
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert msg in " ".join(r.output.split()), (msg, r.output)
        assert "Traceback" not in r.output and not (tmp_path / "o").exists()
    r = run(src, tmp_path / "o", "--from", "auto", "--verifier", v, "--aux-layer-ids", "1,3,99")
    assert r.exit_code == 1 and "aux_ids.range" in r.output and not (tmp_path / "o").exists()


def test_usage_errors(tmp_path, verifiers):
    v = verifiers["llama"]
    src = sources.safeailab_eagle3(tmp_path / "s", v)
    for args in [(src, tmp_path / "o", "--from", "auto", "--verifier", v, "--to", "orbax"),
                 (src, tmp_path / "o", "--to", "orbax", "--verifier", v),
                 (src, tmp_path / "o"),
                 (src, tmp_path / "o", "--from", "auto", "--verifier", v, "--check"),
                 (src, tmp_path / "o", "--from", "auto", "--verifier", v, "--aux-layer-ids", "a,b")]:
        r = run(*args)
        assert r.exit_code == 2 and not (tmp_path / "o").exists(), (args, r.output)
    r = run(src, tmp_path / "o", "--from", "auto", "--verifier", v, "--to", "speculators")
    assert r.exit_code == 0, r.output
