"""Trainer for P-EAGLE, DSpark and MTP on tiny targets: the loss goes down with a margin, one
compile per step function, exports pass the audit and load in speculators 0.9.0's
``from_pretrained``, resume after a kill equals an uninterrupted run, and bad recipes / targets
are refused naming the key."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from specjax.train.config import load_recipe
from specjax.train.errors import RecipeError, TrainError
from tests.train.conftest import TINY_AUX, tiny_prompts, tiny_spec, write_char_tokenizer
from tests.train.test_trainer import recipe

QWEN_LAYERS = 6


@pytest.fixture(scope="session")
def qwen_target_dir(spec_root, verifiers):
    """The qwen3 test verifier plus a char tokenizer and a native MTP head (``mtp.*``: the last
    layer perturbed, a random ``fc``, unit norms), as Qwen3-Next-style checkpoints carry one."""
    from safetensors.numpy import load_file, save_file

    d = spec_root / "train-target-qwen3-mtp"
    if not d.exists():
        shutil.copytree(verifiers["qwen3"], d)
        write_char_tokenizer(d)
        t = load_file(d / "model.safetensors")
        rng = np.random.default_rng(0)
        last = f"model.layers.{QWEN_LAYERS - 1}."
        for k, v in list(t.items()):
            if k.startswith(last):
                t["mtp.layers.0." + k[len(last):]] = (v + 0.02 * rng.standard_normal(v.shape)).astype(v.dtype)
        H = t["model.norm.weight"].shape[0]
        t["mtp.fc.weight"] = (0.05 * rng.standard_normal((H, 2 * H))).astype(np.float32)
        for n in ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"):
            t[n] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="session")
def qwen_target(qwen_target_dir):
    from specjax.models.loading import load_target

    return load_target(str(qwen_target_dir), progress=False)


@pytest.fixture(scope="session")
def qwen_data(spec_root, qwen_target):
    from specjax.train.pipeline import prepare_data

    d = spec_root / "train-data-qwen3"
    if not (d / "specjax_data.json").is_file():
        prepare_data(d, tiny_spec(tiny_prompts(spec_root / "train-prompts-qwen3.jsonl"), draft_vocab_size=None),
                     qwen_target, progress=False)
    return d


def _records(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "split" not in r], [r for r in recs if r.get("split") == "val"]


def _train_and_check(run, out, keys, margin):
    from specjax.train.step import TRACE_COUNT

    TRACE_COUNT["train_step"] = TRACE_COUNT["eval_step"] = 0
    s = run.train()
    assert s["compiles"] == {"train_step": 1, "eval_step": 1}, s["compiles"]
    train, val = _records(out)
    assert len(train) == s["steps"] == s["total_steps"] and val
    assert keys | {"grad_norm"} <= set(train[-1]) and keys <= set(val[-1]), (keys - set(val[-1]), sorted(train[-1]))
    first = np.mean([r["loss"] for r in train[:3]])
    last = np.mean([r["loss"] for r in train[-3:]])
    assert last < margin * first, (first, last)
    assert val[-1]["loss"] < val[0]["loss"]
    return s, train, val


def _check_export(out, verifier_dir, algo, cls_name):
    import bridge
    import speculators.models  # noqa: F401
    from speculators.model import SpeculatorModel

    last = out / "last"
    cfg = json.loads((last / "config.json").read_text())
    assert cfg["speculators_model_type"] == algo and cfg["architectures"] == [cls_name]
    rep = bridge.audit(last, verifier=str(verifier_dir))
    # clean: no errors; the one warning allowed is the DFlash family's note on vLLM's aux-id offset
    assert not rep.errors and {f.rule for f in rep.warnings} <= {"dflash.aux_offset"}, [f.message for f in rep.findings]
    ref = SpeculatorModel.from_pretrained(str(last))
    assert type(ref).__name__ == cls_name
    return cfg, ref


def test_peagle_trains_exports_loads(tmp_path, tiny_data, tiny_target, tiny_target_dir):
    from specjax.train.trainer import Run

    out = tmp_path / "p"
    run = Run(recipe(tiny_data, out, "speculator_type=peagle", f"verifier_name_or_path={tiny_target_dir}",
                     "peagle.num_depths=4", "data.max_anchors=24", "trainer.epochs=6"), target=tiny_target,
              progress=False)
    before = np.asarray(run.build_state()[0]["embed_tokens"]["embedding"][...])
    _train_and_check(run, out, {"loss", "full_acc", "position_0_acc", "position_3_acc"}, 0.7)
    after = np.asarray(run.params["embed_tokens"]["embedding"][...])
    assert np.abs(after - before).max() > 1e-4  # P-EAGLE trains its embedding
    cfg, ref = _check_export(out, tiny_target_dir, "peagle", "PEagleDraftModel")
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["embed_requires_grad"] is True and cfg["mask_token_id"] == 0 and cfg["norm_before_residual"] is True
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"  # peagle's draft_arch default
    w = dict(ref.named_parameters())["embed_tokens.weight"].detach().float().numpy()
    np.testing.assert_allclose(w, after, rtol=1e-2, atol=1e-2)  # the trained embedding was exported (bf16)


def test_dspark_trains_exports_loads(tmp_path, tiny_data, tiny_target, tiny_target_dir):
    from specjax.train.trainer import Run

    out = tmp_path / "s"
    run = Run(recipe(tiny_data, out, "speculator_type=dspark", f"verifier_name_or_path={tiny_target_dir}",
                     "draft.num_layers=2", "dflash.block_size=4", "data.max_anchors=8", "dspark.markov_rank=16",
                     "loss.loss_fn=ce", "optimizer.lr=1e-2", "trainer.epochs=8"), target=tiny_target, progress=False)
    assert run.cfg.dflash.sample_from_anchor is True and run.cfg.dflash.per_position_loss_weight == "fixed-exp-decay"
    _, train, _ = _train_and_check(run, out, {"loss", "accept_len", "accept_rate", "confidence_loss", "eal",
                                              "position_0_acc", "confidence_cumprod_bias"}, 0.8)
    # the token loss (loss - alpha * BCE) learns with a margin; the BCE (whose target, the draft's own
    # acceptance rate, moves as the draft learns, and whose floor is its entropy) goes down too
    main = [r["loss"] - r["confidence_loss"] for r in train]
    assert np.mean(main[-3:]) < 0.8 * np.mean(main[:3]), (main[:3], main[-3:])
    conf = [r["confidence_loss"] for r in train]
    assert np.mean(conf[-3:]) < conf[0], conf
    assert 1.0 <= train[-1]["accept_len"] <= 5.0
    cfg, ref = _check_export(out, tiny_target_dir, "dspark", "DSparkDraftModel")
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # block_size (from anchor)
    assert (cfg["markov_rank"], cfg["block_size"], cfg["sample_from_anchor"]) == (16, 4, True)
    assert ref.markov_head is not None and ref.confidence_head is not None


@pytest.mark.parametrize("init", ["native", "last_layer"])
def test_mtp_trains_exports_loads(tmp_path, qwen_data, qwen_target, qwen_target_dir, init):
    from specjax.train.trainer import Run

    out = tmp_path / "m"
    run = Run(recipe(qwen_data, out, "speculator_type=mtp", "draft.draft_vocab_size=null", f"mtp.init={init}",
                     f"verifier_name_or_path={qwen_target_dir}", "optimizer.lr=1e-2", "trainer.epochs=14"), target=qwen_target,
              progress=False)
    params, _ = run.build_state()
    q = np.asarray(params["mtp_layers"][0]["self_attn"]["q_proj"]["kernel"][...])
    body = np.asarray(qwen_target.model.model.layers[QWEN_LAYERS - 1].self_attn.q_proj.kernel[...])
    if init == "native":  # speculators' start: the checkpoint's own mtp.* head
        from safetensors.numpy import load_file

        native = load_file(qwen_target_dir / "model.safetensors")["mtp.layers.0.self_attn.q_proj.weight"]
        np.testing.assert_array_equal(q, native.T)
    else:
        np.testing.assert_array_equal(q, body)
    _train_and_check(run, out, {"loss", "loss_step_0", "loss_step_2", "acc_step_0", "acc_step_2"}, 0.8)
    cfg, ref = _check_export(out, qwen_target_dir, "mtp", "MTPDraftModel")
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert "draft_vocab_size" not in cfg and cfg["transformer_layer_config"]["num_hidden_layers"] == QWEN_LAYERS
    trained = np.asarray(run.params["mtp_layers"][0]["input_proj"]["kernel"][...])
    w = dict(ref.named_parameters())["mtp_layers.0.input_proj.weight"].detach().float().numpy()
    np.testing.assert_allclose(w.T, trained, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("algo", ["peagle", "mtp"])
def test_resume_is_exact(tmp_path, tiny_data, tiny_target, qwen_data, qwen_target, algo):
    from specjax.train.trainer import Run

    if algo == "peagle":
        data, target, extra = tiny_data, tiny_target, ["speculator_type=peagle", "peagle.num_depths=4",
                                                      "data.max_anchors=16"]
    else:
        data, target, extra = qwen_data, qwen_target, ["speculator_type=mtp", "draft.draft_vocab_size=null",
                                                      "mtp.init=last_layer"]

    def mk(out, **kw):
        return Run(recipe(data, out, *extra, "trainer.epochs=2"), target=target, progress=False, **kw)

    ref = mk(tmp_path / "a")
    ref.train()
    r1 = mk(tmp_path / "b")
    r1.train(stop_after=5)  # killed after 5 steps (checkpoints at 4 and at the kill)
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "5")  # as if killed before the step-5 checkpoint
    r2 = mk(tmp_path / "b", resume=True)
    assert r2.train()["steps"] == ref.total_steps > 5
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(r2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(ref.opt_state), jax.tree.leaves(r2.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_recipe_defaults_and_errors():
    c = load_recipe(None, ["speculator_type=dspark"])
    assert (c.draft.num_layers, c.draft.draft_arch, c.loss.loss_fn, c.dflash.block_size, c.dflash.sample_from_anchor,
            c.dflash.per_position_loss_weight, c.dspark.markov_rank, c.dspark.confidence_head_alpha) == \
        (5, "qwen3", "kl_div", 8, True, "fixed-exp-decay", 256, 1.0)
    p = load_recipe(None, ["speculator_type=peagle"])
    assert (p.draft.num_layers, p.draft.draft_arch, p.loss.loss_fn, p.draft.norm_before_fc, p.draft.norm_output,
            p.peagle.num_depths, p.peagle.down_sample_ratio, p.peagle.down_sample_ratio_min) == \
        (1, "qwen3", "kl_div", False, False, 8, 0.7, 0.2)
    m = load_recipe(None, ["speculator_type=mtp"])
    assert (m.mtp.num_speculative_steps, m.mtp.step_weight_beta, m.mtp.init) == (3, 0.6, "native")
    # D-PACE needs token CE (dspark's default loss is kl_div)
    with pytest.raises(RecipeError, match=r"dflash.per_position_loss_weight=dpace requires loss.loss_fn=ce"):
        load_recipe(None, ["speculator_type=dspark", "dflash.per_position_loss_weight=dpace"])
    with pytest.raises(RecipeError, match=r"dflash.dpace_alpha must be in \(0, 1\]"):
        load_recipe(None, ["speculator_type=dspark", "per_position_loss_weight=dpace", "loss_fn=ce", "dpace_alpha=0"])
    with pytest.raises(RecipeError, match=r"dspark.confidence_head_with_markov=true requires dspark.markov_rank > 0"):
        load_recipe(None, ["speculator_type=dspark", "dspark.markov_rank=0"])
    with pytest.raises(RecipeError, match=r"unknown key 'peagle.num_depth'; accepted keys: num_depths"):
        load_recipe(None, ["speculator_type=peagle", "peagle.num_depth=4"])
    with pytest.raises(RecipeError, match=r"mtp.init: .*found 'copy'.*accepted values: 'native', 'last_layer'"):
        load_recipe(None, ["speculator_type=mtp", "mtp.init=copy"])
    with pytest.raises(RecipeError, match=r"peagle.num_depths: .*found 'many'"):
        load_recipe(None, ["speculator_type=peagle", "num_depths=many"])
    with pytest.raises(RecipeError, match=r"accepted values: 'eagle3', 'dflash', 'peagle', 'dspark', 'mtp'"):
        load_recipe(None, ["speculator_type=medusa"])
    # the other algorithms' sections do not enter an eagle3 run's resume identity
    e = load_recipe(None, [])
    assert not any(k.split(".")[0] in ("dspark", "peagle", "mtp") for k in e.resume_key())
    assert any(k.startswith("peagle.") for k in p.resume_key())


def test_mtp_target_errors(tmp_path, tiny_data, tiny_target, verifiers, qwen_data, qwen_target):
    from specjax.models.loading import load_target
    from specjax.train.trainer import Run

    # a llama target has no MTP layer to mirror
    with pytest.raises(TrainError, match=r"no MTP layer to mirror") as e:
        Run(recipe(tiny_data, tmp_path / "a", "speculator_type=mtp", "draft.draft_vocab_size=null"),
            target=tiny_target, progress=False)
    assert e.value.key == "speculator_type"
    with pytest.raises(TrainError, match=r"MTP predicts over the target's full vocabulary") as e:
        Run(recipe(qwen_data, tmp_path / "b", "speculator_type=mtp"), target=qwen_target, progress=False)
    assert e.value.key == "draft.draft_vocab_size"
    # a qwen3 target without native mtp.* tensors: speculators' way (native) is refused, naming mtp.init
    plain = load_target(str(verifiers["qwen3"]), progress=False)
    run = Run(recipe(qwen_data, tmp_path / "c", "speculator_type=mtp", "draft.draft_vocab_size=null"), target=plain,
              progress=False)
    with pytest.raises(TrainError, match=r"the target has no native MTP layers") as e:
        run.train()
    assert e.value.key == "mtp.init"


def test_mtp_online_loss_and_gradients_match_the_cache(tmp_path, qwen_data, qwen_target):
    """data.online for MTP on the qwen3 target (the draft mirrors its last layer): one step's loss
    and gradients equal those from a float32 cache of the same rows (1e-5)."""
    from specjax.train.trainer import Run
    from tests.train.test_trainer import _float32_cache, assert_online_step_matches_cache

    d32, _ = _float32_cache(tmp_path, qwen_data, qwen_target)
    f32 = ("speculator_type=mtp", "draft.draft_vocab_size=null", "data.hidden_states_dtype=float32")
    cached, online = (Run(recipe(d32, tmp_path / name, *f32, *extra), target=qwen_target, progress=False)
                      for name, extra in (("c", ()), ("o", ("data.online=true",))))
    assert_online_step_matches_cache(cached, online)
