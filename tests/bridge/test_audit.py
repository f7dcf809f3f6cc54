"""Each audit rule has a checkpoint that violates it and one that passes; the seed's
published configs get the seed's verdicts."""

import json
import shutil

import numpy as np
import pytest

import bridge
from bridge.safetensors_io import open_tensors, write_safetensors
from tests.bridge.headers import gemma4_31b_dflash, mutated, qwen3_8b_eagle3


def rules(rep, level="error"):
    return {f.rule for f in rep.findings if f.level == level}


@pytest.mark.parametrize("name", ["eagle3-llama-f32", "eagle3-qwen3-bf16-pruned", "eagle3-llama-fc-norm-output",
                                  "eagle3-llama-fcnorm", "eagle3-llama-2layers-swa", "peagle-llama-f32",
                                  "dflash-qwen3-f32-pruned", "dspark-qwen3-gated-pruned", "dspark-qwen3-rnn-bf16",
                                  "mtp-qwen3-f32"])
def test_speculators_written_checkpoints_pass(spec_ckpts, verifiers, name):
    fam = "llama" if "llama" in name else "qwen3"
    rep = bridge.audit(spec_ckpts[name], verifier=verifiers[fam], deep=True)
    assert rep.errors == [], rep.errors
    assert rep.exit_code == 0


def test_seed_qwen3_8b_eagle3_passes(tmp_path):
    rep = bridge.audit(qwen3_8b_eagle3(tmp_path))
    assert rep.errors == []
    assert "aux_ids.absent" in rules(rep, "warning")  # records no aux ids: works only by the default agreement


def test_seed_gemma_dflash_fails_on_speculative_tokens(tmp_path):
    rep = bridge.audit(gemma4_31b_dflash(tmp_path))
    msgs = [f.message for f in rep.errors]
    assert any("speculative_tokens 8 != block_size-1 = 7" in m for m in msgs), msgs
    assert rep.exit_code == 1
    warned = rules(rep, "warning")
    assert {"verifier.binding", "sample_from_anchor.absent", "dflash.aux_offset",
            "sliding_window_non_causal.absent"} <= warned
    # fixing the count makes it pass
    d = tmp_path / "gemma-4-31b-dflash"
    cfg = json.loads((d / "config.json").read_text())
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    (d / "config.json").write_text(json.dumps(cfg))
    assert bridge.audit(d).errors == []


def test_seed_aux_drift_is_caught(tmp_path):
    d = gemma4_31b_dflash(tmp_path)
    bad = mutated(d, tmp_path / "drift", shapes={"fc.weight": (5376, 3 * 5376)})
    assert any("fc in_features 16128 != 5 aux x 5376" in f.message for f in bridge.audit(bad).errors)


E3 = "eagle3-qwen3-bf16-pruned"


@pytest.mark.parametrize("rule, kw", [
    ("fc.in_features", dict(shapes={"fc.weight": (32, 128)})),
    ("lm_head.shape", dict(shapes={"lm_head.weight": (41, 32)})),
    ("embed.rows", dict(shapes={"embed_tokens.weight": (95, 32)})),
    ("vocab.buffers", dict(shapes={"d2t": (39,)})),
    ("eagle3.first_layer", dict(shapes={"layers.0.self_attn.q_proj.weight": (32, 32)})),
    ("eagle3.family", dict(config_fn=lambda c: c["transformer_layer_config"].update(model_type="mistral"))),
    ("tensors.missing", dict(drop=["layers.0.hidden_norm.weight"])),
    ("tensors.unexpected", dict(add={"mask_hidden": ("F32", (1, 1, 96))})),
    ("tensors.dtype", dict(add={"d2t": ("I32", (40,))})),
    ("aux_ids.distinct", dict(config_fn=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 1, 4]))),
    ("vocab.size", dict(config_fn=lambda c: c.update(draft_vocab_size=97), shapes={"lm_head.weight": (97, 32),
                                                                                    "d2t": (97,)})),
])
def test_error_rules(spec_ckpts, tmp_path, rule, kw):
    bad = mutated(spec_ckpts[E3], tmp_path / "bad", **kw)
    rep = bridge.audit(bad)
    assert rule in rules(rep), rep.findings
    assert rep.exit_code == 1
    good = mutated(spec_ckpts[E3], tmp_path / "good")
    assert rule not in rules(bridge.audit(good))


def test_dflash_rules(spec_ckpts, tmp_path):
    src = spec_ckpts["dflash-qwen3-f32-pruned"]
    for rule, fn in [
        ("dflash.speculative_tokens", lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4)),
        ("dflash.aux_ids", lambda c: c.update(aux_hidden_state_layer_ids=None)),
        ("dflash.mask_token", lambda c: c.update(mask_token_id=None)),
    ]:
        bad = mutated(src, tmp_path / rule, config_fn=fn)
        assert rule in rules(bridge.audit(bad)), rule
    # sample_from_anchor=True makes block_size (4) the right count
    ok = mutated(src, tmp_path / "anchor", config_fn=lambda c: (
        c.update(sample_from_anchor=True), c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4)))
    assert "dflash.speculative_tokens" not in rules(bridge.audit(ok))
    assert "dflash.speculative_tokens" not in rules(bridge.audit(src))


@pytest.mark.parametrize("rule, src, fn, words", [
    ("norm_before_residual.absent", "eagle3-llama-f32", lambda c: c.pop("norm_before_residual"),
     ["speculators reads False", "vLLM reads True"]),
    ("sliding_window_non_causal.absent", "dflash-qwen3-f32-pruned", lambda c: c.pop("sliding_window_non_causal"),
     ["speculators reads False", "non-causal"]),
    ("proposal.lossy", "eagle3-llama-f32",
     lambda c: c["speculators_config"]["proposal_methods"][0].update(verifier_accept_k=5), ["lossy"]),
    ("proposal.lossy", "eagle3-llama-f32",
     lambda c: c["speculators_config"]["proposal_methods"][0].update(accept_tolerance=0.5), ["lossy"]),
    ("verifier.binding", "eagle3-llama-f32",
     lambda c: c["speculators_config"]["verifier"].update(name_or_path=None), ["name_or_path"]),
    ("sliding_window_non_causal.vllm", "dflash-qwen3-f32-pruned",
     lambda c: (c.update(sliding_window_non_causal=True),
                c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"],
                                                     sliding_window=8)), ["causally"]),
    ("aux_ids.absent", "eagle3-llama-f32", lambda c: c.update(eagle_aux_hidden_state_layer_ids=None),
     ["[2, n//2, n-3]"]),
])
def test_warning_rules_never_change_exit_code(spec_ckpts, tmp_path, rule, src, fn, words):
    d = mutated(spec_ckpts[src], tmp_path / "w", config_fn=fn)
    rep = bridge.audit(d)
    hits = [f for f in rep.warnings if f.rule == rule]
    assert hits, rep.findings
    for w in words:
        assert w in hits[0].message
    assert rep.exit_code == 0
    assert rule not in rules(bridge.audit(spec_ckpts[src]), "warning")


def test_dflash_offset_warning_says_both_readings(spec_ckpts):
    rep = bridge.audit(spec_ckpts["dflash-qwen3-f32-pruned"])
    w = [f for f in rep.warnings if f.rule == "dflash.aux_offset"][0]
    assert "[0, 2, 3]" in w.message and "[1, 3, 4]" in w.message


def _vcopy(verifiers, tmp_path, fam, **upd):
    d = tmp_path / f"v-{fam}"
    shutil.copytree(verifiers[fam], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(upd)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("rule, upd", [
    ("verifier.hidden_size", {"hidden_size": 64}),
    ("verifier.vocab_size", {"vocab_size": 128}),
    ("aux_ids.range", {"num_hidden_layers": 3}),
    ("verifier.architecture", {"architectures": ["LlamaForCausalLM"]}),
])
def test_verifier_rules(spec_ckpts, verifiers, tmp_path, rule, upd):
    ck = spec_ckpts["eagle3-qwen3-bf16-pruned"]
    assert rule not in rules(bridge.audit(ck, verifier=verifiers["qwen3"]))
    rep = bridge.audit(ck, verifier=_vcopy(verifiers, tmp_path, "qwen3", **upd))
    assert rule in rules(rep), rep.findings


def test_deep_scan_finds_nan_and_inf(spec_ckpts, tmp_path):
    d = tmp_path / "nan"
    shutil.copytree(spec_ckpts["eagle3-llama-f32"], d)
    s = open_tensors(d)
    flat = {n: np.array(s.array(n)) for n in s.names}
    flat["embed_tokens.weight"][3, 1] = np.nan
    flat["fc.weight"][0, 0] = np.inf
    del s
    write_safetensors(d / "model.safetensors", flat, {"format": "pt"})
    assert bridge.audit(d).errors == []  # header-only audit cannot see data
    rep = bridge.audit(d, deep=True)
    assert {"deep.nan", "deep.inf"} <= rules(rep)
    assert any("embed_tokens.weight" in f.message and "sentinel" in f.message for f in rep.errors)


def test_unreadable_exit_code_2(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    rep = bridge.audit(tmp_path)
    assert rep.exit_code == 2 and rep.unreadable


@pytest.mark.parametrize("src,old,new", [("eagle3-qwen3-bf16-pruned", "BF16", "U16"),
                                         ("eagle3-qwen3-bf16-pruned", "BF16", "I16"),
                                         ("eagle3-llama-f32", "F32", "U32"), ("eagle3-llama-f32", "F32", "I32")])
def test_float_tensor_relabelled_as_integer_is_an_error(spec_ckpts, tmp_path, src, old, new):
    """Same byte size, so the header parses; the audit (not only a load) says the dtype is wrong."""
    s = open_tensors(spec_ckpts[src])
    name = next(n for n in s.names if s.info(n).dtype == old)
    d = mutated(spec_ckpts[src], tmp_path / "x", add={name: (new, tuple(s.info(name).shape))})
    rep = bridge.audit(d)
    assert "tensors.dtype" in rules(rep), rep.findings
    assert any(f"{name!r} has dtype {new}; expected a floating dtype" in f.message for f in rep.findings)
