"""Bad input: a clear error naming the file / key / expected value, and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import bridge
from bridge.errors import WriteError
from bridge.external import ExternalAuditError, ExternalSourceError, UnrecognizedSourceError, VerifierError
from tests.bridge.external import sources
from tests.bridge.external.conftest import spec_convert


def nothing_written(out: Path):
    assert not out.exists(), f"{out} was written"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, leftovers


def convert_fails(exc, src, kind, verifier, out, *, match=(), **opts):
    with pytest.raises(exc) as ei:
        bridge.convert_external(src, kind, verifier, out, **opts)
    msg = str(ei.value)
    for m in match:
        assert m in msg, (m, msg)
    assert "Traceback" not in msg
    nothing_written(out)
    return ei.value


@pytest.fixture
def eagle_src(tmp_path, verifiers):
    return sources.safeailab_eagle3(tmp_path / "eagle", verifiers["llama"])


@pytest.fixture
def dflash_src(tmp_path, verifiers):
    return sources.zlab_dflash(tmp_path / "dflash", verifiers["qwen3"])


def test_unknown_from(eagle_src, verifiers, tmp_path):
    e = convert_fails(ExternalSourceError, eagle_src, "eagle", verifiers["llama"], tmp_path / "o",
                      match=("'eagle'", "eagle3-safeailab", "dflash-zlab", "mtp", "auto"))
    assert e.key == "from"


def test_from_that_does_not_fit_the_source(eagle_src, dflash_src, verifiers, tmp_path):
    convert_fails(ExternalSourceError, eagle_src, "mtp", verifiers["llama"], tmp_path / "o",
                  match=("mtp.", "model.safetensors", "looks like --from eagle3-safeailab", "midlayer"))
    convert_fails(ExternalSourceError, dflash_src, "eagle3-safeailab", verifiers["qwen3"], tmp_path / "o",
                  match=("midlayer.input_layernorm.weight", "looks like --from dflash-zlab"))


def test_missing_verifier(eagle_src, tmp_path):
    convert_fails(VerifierError, eagle_src, "eagle3-safeailab", None, tmp_path / "o", match=("--verifier",))
    convert_fails(VerifierError, eagle_src, "auto", tmp_path / "nope", tmp_path / "o",
                  match=(str(tmp_path / "nope"), "does not exist"))
    empty = tmp_path / "empty-verifier"
    empty.mkdir()
    e = convert_fails(VerifierError, eagle_src, "auto", empty, tmp_path / "o", match=("config.json not found",))
    assert e.path == str(empty / "config.json")


@pytest.mark.parametrize("kind,drop,named", [
    ("eagle3", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.q_proj.weight"),
    ("eagle3", "t2d", "no t2d"),  # keeps d2t: the pruned lm_head has no mapping left
    ("dflash", "layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"),
    ("dflash", "hidden_norm.weight", "hidden_norm.weight"),
    ("mtp", "mtp.norm.weight", "mtp.norm.weight"),
    ("mtp", "mtp.layers.0.self_attn.k_norm.weight", "mtp.layers.0.self_attn.k_norm.weight"),
    ("mtp-moe", "mtp.layers.0.mlp.experts.2.up_proj.weight", "up_proj"),
])
def test_tensor_missing_from_source(kind, drop, named, tmp_path, verifiers, next_verifier):
    if kind == "eagle3":
        src, v, k = sources.safeailab_eagle3(tmp_path / "s", verifiers["llama"], drop=(drop,)), verifiers["llama"], \
            "eagle3-safeailab"
    elif kind == "dflash":
        src, v, k = sources.zlab_dflash(tmp_path / "s", verifiers["qwen3"], drop=(drop,)), verifiers["qwen3"], "dflash-zlab"
    elif kind == "mtp":
        src, v, k = sources.native_mtp(tmp_path / "s", verifiers["qwen3"], drop=(drop,)), verifiers["qwen3"], "mtp"
    else:
        src, v, k = sources.native_mtp(tmp_path / "s", next_verifier, drop=(drop,), body=False), next_verifier, "mtp"
    err = ExternalSourceError
    e = convert_fails(err, src, k, v, tmp_path / "o", match=(named,))
    if err is ExternalSourceError:
        assert e.path and Path(e.path).name.startswith("model"), e.path  # names the weights file


def test_speculators_writes_random_weights_where_specjax_refuses(tmp_path, verifiers):
    """The contrast that motivates the refusal: speculators' EAGLE-3 converter loads with
    strict=False and saves whatever the module was initialised with."""
    src = sources.safeailab_eagle3(tmp_path / "s", verifiers["llama"], drop=("midlayer.self_attn.q_proj.weight",))
    spec_convert(src, verifiers["llama"], "eagle3", tmp_path / "theirs")
    assert (tmp_path / "theirs" / "model.safetensors").exists()
    convert_fails(ExternalSourceError, src, "eagle3-safeailab", verifiers["llama"], tmp_path / "ours")


def test_dflash_without_block_size(tmp_path, verifiers):
    src = sources.zlab_dflash(tmp_path / "s", verifiers["qwen3"], block_in=None)
    e = convert_fails(ExternalSourceError, src, "auto", verifiers["qwen3"], tmp_path / "o",
                      match=("block_size", "top level", "dflash_config"))
    assert e.path == str(src / "config.json") and e.key == "block_size"
    with pytest.raises(ValueError, match="block_size"):  # speculators refuses it too
        spec_convert(src, verifiers["qwen3"], "dflash", tmp_path / "theirs")


def test_dflash_config_errors(tmp_path, verifiers):
    v = verifiers["qwen3"]
    src = sources.zlab_dflash(tmp_path / "s1", v, config_over={"dflash_config": {"target_layer_ids": [0, 2, 4]}})
    convert_fails(ExternalSourceError, src, "dflash-zlab", v, tmp_path / "o", match=("mask_token_id",))
    src = sources.zlab_dflash(tmp_path / "s2", v, block_size=1)
    convert_fails(ExternalSourceError, src, "dflash-zlab", v, tmp_path / "o", match=("block_size 1", ">= 2"))
    src = sources.zlab_dflash(tmp_path / "s3", v, config_over={"hidden_size": 64})
    convert_fails(ExternalSourceError, src, "dflash-zlab", v, tmp_path / "o", match=("hidden_size 64", "32"))
    src = sources.zlab_dflash(tmp_path / "s4", v, config_over={"dflash_config": {"mask_token_id": 5}})
    convert_fails(ExternalSourceError, src, "dflash-zlab", v, tmp_path / "o", match=("target_layer_ids",
                                                                                    "aux_hidden_state_layer_ids"))


def test_dflash_final_layer_id_without_fused_qkv(tmp_path, verifiers):
    """z-lab id n-1 becomes aux id n and is dropped; fc still has its columns. speculators fails
    on the size mismatch; specjax says why."""
    v = verifiers["qwen3"]
    src = sources.zlab_dflash(tmp_path / "s", v, target_layer_ids=(0, 2, 5))
    convert_fails(ExternalSourceError, src, "dflash-zlab", v, tmp_path / "o",
                  match=("fc.weight", "[32, 96]", "final-layer target id 5", "2 aux ids x hidden 32"))
    with pytest.raises(RuntimeError, match="size mismatch"):
        spec_convert(src, v, "dflash", tmp_path / "theirs")


def test_eagle3_shapes_are_the_contracts(tmp_path, verifiers):
    """The SafeAILab converter checks the source against bridge.contract's shapes for the config it
    writes (four aux ids: fc reads 4 x hidden), naming the source tensor and the contract's shape."""
    from bridge.contract import expected_tensors
    from bridge.schema import parse_config

    v = verifiers["llama"]
    H = json.loads((v / "config.json").read_text())["hidden_size"]
    src = sources.safeailab_eagle3(tmp_path / "s", v)
    aux = [1, 2, 3, 4]
    _, _, plan = bridge.external.plan_external(src, "eagle3-safeailab", v)
    cfg = dict(plan.config, eagle_aux_hidden_state_layer_ids=aux)
    want = expected_tensors(parse_config(cfg))["fc.weight"].shape
    assert want == (H, 4 * H)
    convert_fails(ExternalSourceError, src, "eagle3-safeailab", v, tmp_path / "o",
                  match=("'fc.weight'", f"[{H}, {3 * H}]", f"expected {list(want)}"),
                  eagle_aux_hidden_state_layer_ids=aux)


def test_shape_mismatch_names_tensor(tmp_path, verifiers):
    v = verifiers["llama"]
    src = sources.safeailab_eagle3(tmp_path / "s", v, config_over={"intermediate_size": 48})
    convert_fails(ExternalSourceError, src, "eagle3-safeailab", v, tmp_path / "o",
                  match=("midlayer.mlp.gate_proj.weight", "[64, 32]", "[48, 32]"))


def test_options_checked(eagle_src, dflash_src, verifiers, tmp_path):
    convert_fails(ExternalSourceError, dflash_src, "dflash-zlab", verifiers["qwen3"], tmp_path / "o",
                  match=("norm_output", "aux_hidden_state_layer_ids"), norm_output=True)
    convert_fails(ExternalSourceError, eagle_src, "eagle3-safeailab", verifiers["llama"], tmp_path / "o",
                  match=("eagle_aux_hidden_state_layer_ids", "list of integer"),
                  eagle_aux_hidden_state_layer_ids="1,2,3")
    convert_fails(ExternalSourceError, eagle_src, "eagle3-safeailab", verifiers["llama"], tmp_path / "o",
                  match=("norm_before_residual", "true or false"), norm_before_residual="yes")
    convert_fails(ExternalSourceError, eagle_src, "eagle3-safeailab", verifiers["llama"], tmp_path / "o",
                  match=("mutually exclusive",), norm_before_fc=True, fc_norm=True)


def test_audit_failure_writes_nothing(eagle_src, verifiers, tmp_path):
    e = convert_fails(ExternalAuditError, eagle_src, "eagle3-safeailab", verifiers["llama"], tmp_path / "o",
                      match=("aux_ids.range", "99"), aux_layer_ids=[1, 3, 99])
    assert e.report.errors and e.exit_code == 1


def test_destination_exists_is_kept(eagle_src, verifiers, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(WriteError, match="destination exists"):
        bridge.convert_external(eagle_src, "auto", verifiers["llama"], out)
    assert (out / "keep.txt").read_text() == "mine"
    bridge.convert_external(eagle_src, "auto", verifiers["llama"], out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_auto_unrecognised_lists_what_it_looked_for(verifiers, tmp_path):
    convert_fails(UnrecognizedSourceError, verifiers["llama"], "auto", verifiers["llama"], tmp_path / "o",
                  match=("dflash_config", "midlayer.*", "mtp.*", "'model'", "'lm_head'"))


def test_speculators_checkpoint_is_not_a_source(spec_ckpts, verifiers, tmp_path):
    convert_fails(ExternalSourceError, spec_ckpts["eagle3-llama-f32"], "auto", verifiers["llama"], tmp_path / "o",
                  match=("already a speculators checkpoint", "--to"))


def test_source_problems(tmp_path, verifiers, eagle_src):
    v = verifiers["llama"]
    convert_fails(ExternalSourceError, tmp_path / "absent", "auto", v, tmp_path / "o", match=("does not exist",))
    no_w = tmp_path / "no-weights"
    no_w.mkdir()
    (no_w / "config.json").write_text("{}")
    convert_fails(ExternalSourceError, no_w, "auto", v, tmp_path / "o", match=("model.safetensors", "pytorch_model.bin"))
    bad = tmp_path / "bad-json"
    shutil.copytree(eagle_src, bad)
    (bad / "config.json").write_text("{not json")
    convert_fails(ExternalSourceError, bad, "eagle3-safeailab", v, tmp_path / "o", match=("not valid JSON",))
    (bad / "config.json").unlink()
    convert_fails(ExternalSourceError, bad, "eagle3-safeailab", v, tmp_path / "o", match=("no config.json",))
    cfg = json.loads((eagle_src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "int8"}))
    convert_fails(ExternalSourceError, bad, "eagle3-safeailab", v, tmp_path / "o", match=("torch_dtype 'int8'",))
