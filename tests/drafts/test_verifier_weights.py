"""Verifier-owned tensors (embed_tokens, lm_head, verifier_lm_head, verifier_norm): filled from the
target exactly as speculators 0.9.0 does, whatever the checkpoint carries; NaN never survives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bridge import layout
from specjax.models.drafts import MissingVerifierWeightsError, load_draft
from specjax.models.drafts.load import DraftAuditError
from specjax.models.drafts.verifier_weights import VerifierSource, resolve_key
from specjax.models.drafts.vocab import VocabMappingError
from specjax.models.params import tree_of
from tests.refs.spec_forward import load_reference


def flat_params(draft) -> dict[str, np.ndarray]:
    flat = layout.flatten(tree_of(draft))
    for n in ("t2d", "d2t"):
        if getattr(draft, n, None) is not None:
            flat[n] = np.asarray(getattr(draft, n)[...])
    return flat


def rewrite(src: Path, dst: Path, *, drop=(), nan=(), add=None, config=None) -> Path:
    """Copy a checkpoint, dropping / NaN-filling / adding tensors or patching config.json."""
    shutil.copytree(src, dst)
    t = load_file(str(src / "model.safetensors"))
    for n in drop:
        t.pop(n, None)
    for n in nan:
        t[n] = np.full_like(t[n], np.nan)
    t.update({k: np.ascontiguousarray(v) for k, v in (add or {}).items()})
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


CASES = {
    "eagle3-pruned": ("eagle3", "llama", {"draft_vocab": 40}),
    "eagle3-qwen3-full": ("eagle3", "qwen3", {}),
    "peagle-pruned": ("peagle", "qwen3", {"draft_vocab": 40}),
    "dflash-pruned": ("dflash", "qwen3", {"draft_vocab": 40}),
    "dflash-full": ("dflash", "llama", {}),
    "dspark-full": ("dspark", "qwen3", {}),
    "mtp": ("mtp", "qwen3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_params_equal_speculators_loaded_model(draft_ckpt, verifiers, case):
    """Every tensor of our loaded draft equals speculators' own from_pretrained model."""
    algo, fam, kw = CASES[case]
    ck = draft_ckpt(algo, fam, **kw)
    ours = flat_params(load_draft(ck, verifiers[fam]))
    ref = {k: v.numpy() for k, v in load_reference(ck).state_dict().items()}
    assert sorted(ours) == sorted(ref)
    for n, v in ref.items():
        np.testing.assert_array_equal(ours[n], v.astype(ours[n].dtype), err_msg=n)


@pytest.mark.parametrize("case", list(CASES))
def test_with_and_without_verifier_tensors(draft_ckpt, verifiers, tmp_path, case):
    """Checkpoints that carry the verifier-owned tensors (older writers, snapshot DFlash), NaN
    sentinels, or nothing at all load to identical drafts."""
    algo, fam, kw = CASES[case]
    ck = draft_ckpt(algo, fam, **kw)
    base = flat_params(load_draft(ck, verifiers[fam]))
    owned = ["embed_tokens.weight", "lm_head.weight"] + ([] if algo == "mtp" else ["verifier_lm_head.weight"])
    full = {n: base[n] for n in owned}
    # the contract keeps lm_head on disk for EAGLE-3 / P-EAGLE and pruned DFlash-family drafts
    keep = {"lm_head.weight"} if algo in ("eagle3", "peagle") or kw.get("draft_vocab") else set()
    variants = {
        "all-saved": rewrite(ck, tmp_path / "a", add=full),
        "none-saved": rewrite(ck, tmp_path / "b", drop=[n for n in owned if n not in keep]),
        "nan-saved": rewrite(ck, tmp_path / "c", add={n: np.full_like(full[n], np.nan) for n in owned}),
    }
    for name, path in variants.items():
        got = flat_params(load_draft(path, verifiers[fam]))
        assert sorted(got) == sorted(base), name
        for n in base:
            np.testing.assert_array_equal(got[n], base[n], err_msg=f"{name}: {n}")


def test_verifier_as_loaded_target_module(draft_ckpt, verifiers):
    from specjax.models.hf import load_hf_dir

    ck = draft_ckpt("dflash", "qwen3", draft_vocab=40)
    a = flat_params(load_draft(ck, verifiers["qwen3"]))
    b = flat_params(load_draft(ck, load_hf_dir(verifiers["qwen3"])))
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


def test_default_verifier_is_config_path(draft_ckpt, verifiers):
    ck = draft_ckpt("dspark", "qwen3")
    a = flat_params(load_draft(ck))  # speculators_config.verifier.name_or_path exists
    b = flat_params(load_draft(ck, verifiers["qwen3"]))
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


@pytest.mark.parametrize("algo,drop", [("eagle3", ["embed_tokens.weight"]), ("dflash", []), ("mtp", [])])
def test_missing_verifier_is_a_clear_error(draft_ckpt, tmp_path, algo, drop):
    fam = "qwen3" if algo == "mtp" else "llama"
    ck = draft_ckpt(algo, fam)
    bad = rewrite(ck, tmp_path / "x", drop=drop,
                  config={"speculators_config": {**json.loads((ck / "config.json").read_text())["speculators_config"],
                                                 "verifier": {"name_or_path": str(tmp_path / "nowhere"),
                                                              "architectures": []}}})
    with pytest.raises(MissingVerifierWeightsError, match="embed_tokens.weight"):
        load_draft(bad)


def test_nan_tensor_without_verifier_is_an_error(draft_ckpt, tmp_path):
    ck = draft_ckpt("eagle3", "llama", draft_vocab=40)
    base = load_draft(ck)  # the checkpoint's own verifier path
    cfg = json.loads((ck / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = None
    bad = rewrite(ck, tmp_path / "x", nan=["lm_head.weight"], config={"speculators_config": cfg["speculators_config"]})
    with pytest.raises(MissingVerifierWeightsError, match=r"lm_head.weight \(NaN\)"):
        load_draft(bad)
    # with the verifier the NaN sentinel is replaced by the t2d rows: same draft as before
    got = flat_params(load_draft(bad, ck.parent / "verifier-llama"))
    for n, v in flat_params(base).items():
        np.testing.assert_array_equal(got[n], v, err_msg=n)


def test_tied_verifier_gives_embedding_rows(tmp_path, draft_ckpt, verifiers):
    """A verifier without lm_head.weight (tied embeddings): lm_head rows come from the embedding."""
    src = verifiers["llama"]
    tied = rewrite(src, tmp_path / "tied", drop=["lm_head.weight"], config={"tie_word_embeddings": True})
    emb = load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"]
    # full vocabulary DFlash: lm_head is not saved, always rebuilt from the verifier
    d = load_draft(draft_ckpt("dflash", "llama"), tied)
    np.testing.assert_array_equal(np.asarray(d.lm_head.kernel[...]).T, emb)
    # pruned: the saved lm_head wins (it is not NaN); verifier_lm_head takes the t2d rows
    d = load_draft(draft_ckpt("dflash", "llama", draft_vocab=40), tied)
    t2d = np.asarray(d.t2d[...])
    np.testing.assert_array_equal(np.asarray(d.verifier_lm_head.kernel[...]).T, emb[t2d])


def test_resolve_key_matches_speculators():
    from speculators.utils.loading import _resolve_key

    names = ["language_model.model.embed_tokens.weight", "model.embed_tokens.weight", "output.weight",
             "llm.norm.weight", "model.layers.0.input_layernorm.weight", "tok_embeddings.weight"]
    cases = [names, names[2:], ["model.layers.0.input_layernorm.weight", "model.layers.0.q_norm.weight"],
             ["backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.0.norm.weight"], []]
    for keys in cases:
        wm = dict.fromkeys(keys, "f")
        for want in ("embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert resolve_key(want, keys) == _resolve_key(want, wm), (want, keys)
    # the quirk users should know: no final norm -> "norm.weight" suffix-matches a layer norm
    assert resolve_key("model.norm.weight", cases[2]) == "model.layers.0.q_norm.weight"


def test_verifier_source_from_mapping():
    emb = np.arange(12, dtype=np.float32).reshape(4, 3)
    src = VerifierSource.of({"tok_embeddings.weight": emb, "output.weight": emb * 2, "norm.weight": np.ones(3)})
    assert src.lookup("embed_tokens.weight") is not None and src.lookup("lm_head.weight")[1, 0] == 6


def test_inconsistent_d2t_refused(draft_ckpt, verifiers, tmp_path):
    ck = draft_ckpt("eagle3", "llama", draft_vocab=40)
    d2t = load_file(str(ck / "model.safetensors"))["d2t"].copy()
    d2t[5] += 1
    bad = rewrite(ck, tmp_path / "x", add={"d2t": d2t})
    with pytest.raises(VocabMappingError, match="draft id 5"):
        load_draft(bad, verifiers["llama"])


def test_audit_errors_refuse_the_load(draft_ckpt, verifiers, tmp_path):
    ck = draft_ckpt("eagle3", "llama")
    t = load_file(str(ck / "model.safetensors"))
    bad = rewrite(ck, tmp_path / "x", add={"fc.weight": np.zeros((32, 64), t["fc.weight"].dtype)})
    with pytest.raises(DraftAuditError, match="fc"):
        load_draft(bad, verifiers["llama"])


@pytest.mark.parametrize("algo", ["eagle3", "mtp"])
def test_bf16_checkpoint_keeps_dtype_and_matches(draft_ckpt, verifiers, algo):
    import torch

    ck = draft_ckpt(algo, "qwen3", dtype=torch.bfloat16, **({"draft_vocab": 40} if algo == "eagle3" else {}))
    d = load_draft(ck, verifiers["qwen3"])
    # verifier-filled tensors take the checkpoint's dtype (MTP saves none of them)
    assert d.embed_tokens.embedding[...].dtype == jnp.bfloat16 and d.lm_head.kernel[...].dtype == jnp.bfloat16
    ref = {k: v.float().numpy() for k, v in load_reference(ck).state_dict().items() if v.is_floating_point()}
    ours = flat_params(d)
    for n, v in ref.items():
        np.testing.assert_array_equal(np.asarray(ours[n], np.float32), v, err_msg=n)


def test_verifier_as_loaded_target(draft_ckpt, verifiers):
    import specjax

    ck = draft_ckpt("eagle3", "qwen3", draft_vocab=40)
    a = flat_params(load_draft(ck, verifiers["qwen3"]))
    b = flat_params(specjax.load_draft(ck, specjax.load_target(str(verifiers["qwen3"]))))
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


def test_inference_only_draft_needs_no_verifier(draft_ckpt, tmp_path):
    """EAGLE-3 checkpoints carry embed_tokens and lm_head: without verifier heads they load with no
    verifier at all, and propose exactly as the full draft does."""
    ck = draft_ckpt("eagle3", "llama", draft_vocab=40)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = None
    lone = rewrite(ck, tmp_path / "x", config={"speculators_config": cfg["speculators_config"]})
    with pytest.raises(MissingVerifierWeightsError, match="verifier_lm_head"):
        load_draft(lone)
    small = load_draft(lone, verifier_heads=False)
    assert small.verifier_lm_head is None and small.verifier_norm is None
    full = flat_params(load_draft(ck))
    for n, v in flat_params(small).items():
        np.testing.assert_array_equal(v, full[n], err_msg=n)
    with pytest.raises(Exception, match="verifier heads"):
        small.targets(jnp.zeros((1, 2, 32)))
