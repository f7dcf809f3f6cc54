"""Trainer: the loss goes down, one compile of the jitted step, exact resume, best/last exports that
pass the audit and load in speculators 0.9.0 and in specjax, recipe and resume errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.train.config import load_recipe
from specjax.train.errors import RecipeError, ResumeError, TrainError
from specjax.train.losses import parse_loss_spec
from specjax.train.step import TRACE_COUNT
from specjax.train.trainer import Run
from tests.train.conftest import TINY_AUX

REPO = Path(__file__).resolve().parents[2]


def recipe(data, out, *extra):
    return load_recipe(None, [f"data.path={data}", "data.total_seq_len=128", f"draft.target_layer_ids={TINY_AUX}",
                              "draft.draft_vocab_size=40", f"trainer.output_dir={out}", "trainer.compute_dtype=float32",
                              "data.train_data_ratio=0.75", "optimizer.lr=3e-3", "trainer.checkpoint_every=4", *extra])


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_loss_goes_down_one_compile_and_exports(tmp_path, tiny_data, tiny_target):
    TRACE_COUNT["train_step"] = 0
    run = Run(recipe(tiny_data, tmp_path / "r", "trainer.epochs=6"), target=tiny_target, progress=False)
    s = run.train()
    assert TRACE_COUNT["train_step"] == 1
    recs = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "split" not in r]
    val = [r for r in recs if r.get("split") == "val"]
    assert len(train) == s["steps"] == s["total_steps"] and len(val) == 6
    first = np.mean([r["loss"] for r in train[:3]])
    last = np.mean([r["loss"] for r in train[-3:]])
    assert last < 0.6 * first, (first, last)
    assert val[-1]["loss"] < 0.7 * val[0]["loss"]
    assert {"full_acc_0", "cond_acc_2", "loss_1", "accept_est", "grad_norm", "lr"} <= set(train[-1])
    assert s["best"]["step"] is not None
    for name in ("last", "best"):
        assert (tmp_path / "r" / name / "config.json").is_file()


def test_export_loads_in_speculators_and_specjax(tmp_path, tiny_data, tiny_target, tiny_target_dir):
    import torch

    import bridge
    import speculators.models  # noqa: F401
    from speculators.model import SpeculatorModel
    from specjax.models.drafts import load_draft

    run = Run(recipe(tiny_data, tmp_path / "r", "trainer.max_steps=3", f"verifier_name_or_path={tiny_target_dir}"),
              target=tiny_target, progress=False)
    run.train()
    last = tmp_path / "r" / "last"
    cfg = json.loads((last / "config.json").read_text())
    for k in ("norm_before_residual", "norm_before_fc", "norm_output", "fc_norm", "embed_requires_grad",
              "eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size"):
        assert k in cfg, k
    assert cfg["eagle_aux_hidden_state_layer_ids"] == TINY_AUX and cfg["norm_before_residual"] is True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    rep = bridge.audit(last, verifier=str(tiny_target_dir))
    assert not rep.errors, [f.message for f in rep.errors]
    ref = SpeculatorModel.from_pretrained(str(last))
    assert type(ref).__name__ == "Eagle3DraftModel" and ref.config.draft_vocab_size == 40
    ours = load_draft(last, tiny_target)
    trained = run.model_of(run.params)
    for name in ("fc", "norm"):
        a = np.asarray(getattr(trained, name).kernel[...] if name == "fc" else trained.norm.scale[...])
        b = np.asarray(getattr(ours, name).kernel[...] if name == "fc" else ours.norm.scale[...], np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)  # bf16 export
    w = dict(ref.named_parameters())["fc.weight"].detach().to(torch.float32).numpy()
    np.testing.assert_allclose(w.T, np.asarray(ours.fc.kernel[...], np.float32), rtol=0, atol=0)


def test_resume_is_exact(tmp_path, tiny_data, tiny_target):
    ref = Run(recipe(tiny_data, tmp_path / "a", "trainer.epochs=2"), target=tiny_target, progress=False)
    ref.train()
    r1 = Run(recipe(tiny_data, tmp_path / "b", "trainer.epochs=2"), target=tiny_target, progress=False)
    r1.train(stop_after=5)  # "killed" after 5 steps (checkpoint at 4 and at the kill)
    assert not (tmp_path / "b" / "last").exists()
    # resume from the step-4 checkpoint: drop the newer one, as if killed before it was written
    ck = tmp_path / "b" / "checkpoints"
    import shutil

    shutil.rmtree(ck / "5")
    r2 = Run(recipe(tiny_data, tmp_path / "b", "trainer.epochs=2"), target=tiny_target, progress=False, resume=True)
    s = r2.train()
    assert s["steps"] == ref.total_steps
    for a, b in zip(_leaves(ref.params), _leaves(r2.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(ref.opt_state), jax.tree.leaves(r2.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_and_output_errors(tmp_path, tiny_data, tiny_target):
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        Run(recipe(tiny_data, tmp_path / "x"), target=tiny_target, progress=False, resume=True)
    Run(recipe(tiny_data, tmp_path / "r", "trainer.max_steps=2"), target=tiny_target, progress=False).train()
    with pytest.raises(TrainError, match="already holds a run"):
        Run(recipe(tiny_data, tmp_path / "r", "trainer.max_steps=2"), target=tiny_target, progress=False)
    with pytest.raises(ResumeError, match=r"optimizer.lr: 0.003 -> 0.001"):
        Run(recipe(tiny_data, tmp_path / "r", "trainer.max_steps=2", "optimizer.lr=1e-3"), target=tiny_target,
            progress=False, resume=True)
    # output-only keys may change
    Run(recipe(tiny_data, tmp_path / "r", "trainer.max_steps=2", "trainer.log_every=5"), target=tiny_target,
        progress=False, resume=True)


def test_recipe_errors(tmp_path):
    p = tmp_path / "r.yaml"

    def refused(text: str, match: str) -> None:
        p.write_text(text)
        with pytest.raises(RecipeError, match=match):
            load_recipe(p)

    refused("speculator_type: eagle3\ndraft:\n  num_layer: 2\n",
            r"unknown key 'draft.num_layer'; accepted keys: num_layers")
    refused("optimizer:\n  optimizer: sgd\n", r"accepted values: 'adamw', 'muon'")
    refused("trainer:\n  epochs: many\n", r"trainer.epochs: .*found 'many'.*expected int")
    with pytest.raises(RecipeError, match=r"unknown loss 'kld'"):
        load_recipe(None, ["loss_fn=kld"])
    with pytest.raises(RecipeError, match="dpace requires loss.loss_fn=ce"):
        load_recipe(None, ["speculator_type=dflash", "loss_fn=kl_div"])
    # weighted terms: a YAML mapping, speculators' JSON string of one and --set's inline mapping are one spec
    p.write_text("loss:\n  loss_fn:\n    kl_div: 1.0\n    ce: 0.5\n")
    as_mapping = load_recipe(p).loss.loss_fn
    p.write_text("loss:\n  loss_fn: '{\"kl_div\": 1.0, \"ce\": 0.5}'\n")
    as_json = load_recipe(p).loss.loss_fn
    as_set = load_recipe(None, ["loss_fn={kl_div: 1.0, ce: 0.5}"]).loss.loss_fn
    assert parse_loss_spec(as_mapping) == parse_loss_spec(as_json) == parse_loss_spec(as_set) == (
        ("kl_div", 1.0), ("ce", 0.5))
    refused("loss:\n  loss_fn:\n    kl_div: heavy\n", r"loss weight for 'kl_div' must be a number, got 'heavy'")
    refused("loss:\n  loss_fn:\n    kld: 1.0\n", r"unknown loss 'kld' in the loss dict")
    with pytest.raises(RecipeError, match=r"--set: unknown key 'bogus'"):
        load_recipe(None, ["bogus=1"])
    c = load_recipe(None, ["speculator_type=dflash"])
    assert (c.draft.num_layers, c.draft.draft_arch, c.loss.loss_fn, c.dflash.block_size,
            c.dflash.per_position_loss_weight, c.draft.norm_before_fc) == (5, "qwen3", "ce", 16, "dpace", False)
    e = load_recipe(None, ["lr=3e-4"])
    assert e.optimizer.lr == 3e-4 and e.optimizer.muon_lr == 3e-4 and e.draft.norm_output is True


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_recipes_validate(name):
    cfg = load_recipe(REPO / "configs" / name)
    assert cfg.speculator_type in ("eagle3", "dflash", "peagle", "dspark", "mtp")
    assert name.split("-")[0] == cfg.speculator_type


def test_dflash_trains(tmp_path, tiny_data, tiny_target, tiny_target_dir):
    run = Run(recipe(tiny_data, tmp_path / "d", "speculator_type=dflash", f"verifier_name_or_path={tiny_target_dir}", "draft.num_layers=2", "dflash.block_size=4",
                     "data.max_anchors=8", "trainer.epochs=4"), target=tiny_target, progress=False)
    s = run.train()
    recs = [json.loads(l) for l in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines() if "split" not in l]
    assert {"eal", "position_1_acc", "full_acc"} <= set(recs[-1])
    assert np.mean([r["loss"] for r in recs[-3:]]) < np.mean([r["loss"] for r in recs[:3]])
    cfg = json.loads((tmp_path / "d" / "last" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == TINY_AUX
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    import speculators.models  # noqa: F401
    from speculators.model import SpeculatorModel

    ref = SpeculatorModel.from_pretrained(str(tmp_path / "d" / "last"))
    assert type(ref).__name__ == "DFlashDraftModel" and ref.block_size == 4


def test_prompt_loss_supervises_every_training_position_only(tmp_path, tiny_data, tiny_target):
    """``data.prompt_loss``: training rows are supervised at every position (prompt included);
    validation rows keep the dataset's assistant-only mask, so validation numbers stay comparable."""
    plain = Run(recipe(tiny_data, tmp_path / "a"), target=tiny_target, progress=False)
    run = Run(recipe(tiny_data, tmp_path / "b", "data.prompt_loss=true"), target=tiny_target, progress=False)
    i = int(run.train_data.indices[0])
    assert run.train_data.sample(i)["loss_mask"].tolist() == [1] * len(run.train_data.rows.input_ids[i])
    masked = plain.train_data.sample(i)["loss_mask"]
    assert masked.sum() < len(masked)  # the dataset row has unsupervised (prompt) positions
    j = int(run.val_data.indices[0])
    np.testing.assert_array_equal(run.val_data.sample(j)["loss_mask"], plain.val_data.sample(j)["loss_mask"])


def test_context_loss_supervises_the_kept_prompt_tail_and_needs_max_context_tokens(tmp_path, tiny_data, tiny_target):
    """``data.context_loss`` with ``data.max_context_tokens``: a training row keeps the same positions
    and supervises all of them; validation keeps the assistant-only mask. Without
    max_context_tokens (or with prompt_loss) the recipe is refused, naming the keys."""
    cut = Run(recipe(tiny_data, tmp_path / "a", "data.max_context_tokens=2"), target=tiny_target, progress=False)
    run = Run(recipe(tiny_data, tmp_path / "b", "data.max_context_tokens=2", "data.context_loss=true"),
              target=tiny_target, progress=False)
    i = int(run.train_data.indices[0])
    a, b = cut.train_data.sample(i), run.train_data.sample(i)
    assert len(b["input_ids"]) == len(a["input_ids"]) < len(run.train_data.rows.input_ids[i])
    assert b["loss_mask"].tolist() == [1] * len(b["input_ids"]) and a["loss_mask"].sum() < len(a["loss_mask"])
    j = int(run.val_data.indices[0])
    np.testing.assert_array_equal(run.val_data.sample(j)["loss_mask"], cut.val_data.sample(j)["loss_mask"])
    for extra in ([], ["data.max_context_tokens=2", "data.prompt_loss=true"]):
        with pytest.raises(Exception, match="context_loss .*max_context_tokens"):
            recipe(tiny_data, tmp_path / "c", "data.context_loss=true", *extra)


def _train_steps(run_dir):
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if r.get("split") != "val"]


def test_kill_during_first_save_resumes_from_scratch_and_metrics_keep_one_line_per_step(tmp_path, tiny_data,
                                                                                      tiny_target):
    import shutil

    extra = ("trainer.epochs=2", "trainer.log_every=1")
    ref = Run(recipe(tiny_data, tmp_path / "a", *extra), target=tiny_target, progress=False)
    ref.train()
    r1 = Run(recipe(tiny_data, tmp_path / "b", *extra), target=tiny_target, progress=False)
    r1.train(stop_after=5)
    ck = tmp_path / "b" / "checkpoints"
    # what a kill inside the first save leaves: Orbax's temporary dir, no complete step, metrics of 5 steps
    shutil.rmtree(ck / "5")
    (ck / "4").rename(ck / "4.orbax-checkpoint-tmp-1764700000")
    assert _train_steps(tmp_path / "b") == [1, 2, 3, 4, 5]
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "epo')  # a torn last line
    r2 = Run(recipe(tiny_data, tmp_path / "b", *extra), target=tiny_target, progress=False, resume=True)
    s = r2.train()
    assert s["steps"] == ref.total_steps
    assert not [p for p in ck.iterdir() if "orbax-checkpoint-tmp" in p.name]
    for a, b in zip(_leaves(ref.params), _leaves(r2.params)):
        np.testing.assert_array_equal(a, b)
    assert _train_steps(tmp_path / "b") == list(range(1, ref.total_steps + 1))


def test_resume_after_a_kill_logs_each_step_once(tmp_path, tiny_data, tiny_target):
    import shutil

    extra = ("trainer.epochs=2", "trainer.log_every=1")
    r1 = Run(recipe(tiny_data, tmp_path / "b", *extra), target=tiny_target, progress=False)
    r1.train(stop_after=6)  # checkpoints at 4 and 6; metrics through 6
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "6")  # killed before the step-6 save: resume recomputes 5, 6
    r2 = Run(recipe(tiny_data, tmp_path / "b", *extra), target=tiny_target, progress=False, resume=True)
    r2.train()
    assert _train_steps(tmp_path / "b") == list(range(1, r2.total_steps + 1))


def test_log_to_tensorboard_records_what_metrics_jsonl_holds(tmp_path, tiny_data, tiny_target):
    from tests.train.test_metric_sinks import scalar_points

    out = tmp_path / "tb"
    Run(recipe(tiny_data, out, "trainer.max_steps=3", "trainer.log_every=1"), target=tiny_target, progress=False,
        log_to=["tensorboard"]).train()
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r.get("split") != "val"]
    assert [r["step"] for r in train_recs] == [1, 2, 3]
    points = scalar_points(out)  # {(tag, step): value}
    assert sorted(s for t, s in points if t == "train/loss") == [1, 2, 3]
    for r in train_recs:
        assert points[("train/loss", r["step"])] == pytest.approx(r["loss"], rel=1e-6)


def test_cached_data_trains_without_the_target_on_the_device(tmp_path, tiny_data, tiny_target, tiny_target_dir):
    """With the data already cached and an HF target, Run loads only the target's config and tokenizer;
    the verifier's embedding / head are read from its files. Same draft, bit for bit, as a run given
    the loaded target; and the loaded target is let go once the draft is built."""
    extra = ("trainer.max_steps=3", f"target={tiny_target_dir}")
    light = Run(recipe(tiny_data, tmp_path / "light", *extra), progress=False)
    assert light.target.model is None
    light.train()
    full = Run(recipe(tiny_data, tmp_path / "full", *extra), target=tiny_target, progress=False)
    assert full.target.model is not None
    full.train()
    assert full.target.model is None  # released after build_state (the caller's tiny_target is untouched)
    assert tiny_target.model is not None
    for a, b in zip(_leaves(light.params), _leaves(full.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(light.frozen), jax.tree.leaves(full.frozen)):
        assert isinstance(a, np.ndarray)  # the float32 frozen tensors live on the host
        np.testing.assert_array_equal(a, b)


def _float32_cache(tmp_path, tiny_data, tiny_target):
    """The tiny data's rows (as a pretokenized file) and a data directory of them with a float32
    cache written by extraction (the cache an online run replaces)."""
    from specjax.train.pipeline import load_data_dir, prepare_data
    from tests.train.conftest import tiny_spec

    rows, _ = load_data_dir(tiny_data)
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [int(t) for t in rows.input_ids[i]],
                                       "loss_mask": [int(m) for m in rows.loss_mask[i]]}) + "\n"
                           for i in range(len(rows))))
    d32 = tmp_path / "d32"
    prepare_data(d32, tiny_spec(src, regenerate=False, hidden_states_dtype="float32"), tiny_target, progress=False)
    return d32, src


def assert_online_step_matches_cache(cached, online, rows_cached=None, rows_online=None):
    """One step's loss and gradients: ``online`` (a data.online Run) on its packed row equals
    ``cached`` (the same recipe on a float32 cache) on the same rows, within 1e-5. Rows default
    to each run's first packed row of epoch 0."""
    from specjax.train.step import device_batch

    first = cached.train_data.step_batches(0)[0][0]
    got = []
    for run, rows in ((cached, rows_cached), (online, rows_online)):
        rows = run.train_data.batch(first) if rows is None else rows
        params, _ = run.build_state()
        batch = device_batch(rows, jax.random.key(0))
        got.append(jax.jit(jax.value_and_grad(lambda p: run.fns.loss(p, run.fns.frozen, batch)[0]))(params))
    (lc, gc), (lo, go) = got
    assert abs(float(lc) - float(lo)) <= 1e-5 * max(1.0, abs(float(lc))), (float(lc), float(lo))
    for a, c in zip(jax.tree.leaves(go), jax.tree.leaves(gc)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5, rtol=0)


@pytest.mark.parametrize("algo", [
    ("speculator_type=peagle", "peagle.num_depths=4", "data.max_anchors=24"),
    ("speculator_type=dflash", "draft.num_layers=2", "dflash.block_size=4", "data.max_anchors=8"),
    ("speculator_type=dspark", "draft.num_layers=2", "dflash.block_size=4", "data.max_anchors=8",
     "dspark.markov_rank=16"),
], ids=["peagle", "dflash", "dspark"])
def test_online_loss_and_gradients_match_the_cache_for_block_drafts(tmp_path, tiny_data, tiny_target, algo):
    """data.online for P-EAGLE, DFlash and DSpark (their own row layouts, anchors drawn from the
    batch's rng): the loss and gradients of one step equal the float32 cache's (1e-5)."""
    d32, _ = _float32_cache(tmp_path, tiny_data, tiny_target)
    f32 = ("data.hidden_states_dtype=float32", *algo)
    cached = Run(recipe(d32, tmp_path / "c", *f32), target=tiny_target, progress=False)
    online = Run(recipe(d32, tmp_path / "o", *f32, "data.online=true"), target=tiny_target, progress=False)
    assert_online_step_matches_cache(cached, online)


def test_online_hidden_states_match_the_cache_and_resume_exactly(tmp_path, tiny_data, tiny_target):
    """data.online: the target computes each row's hidden states inside the train step. On the same rows the
    batch, loss and gradients equal those of a run reading a float32 cache written by extraction
    (1e-5), also with rows trimmed by data.max_context_tokens; the step compiles once; data an online
    recipe prepares has no state cache; a killed online run resumes bit-exactly."""
    from tests.train.conftest import tiny_prompts

    d32, src = _float32_cache(tmp_path, tiny_data, tiny_target)
    from specjax.train.errors import HiddenStateCacheError
    from specjax.train.hidden_states import read_hs
    from specjax.train.online import fill

    # whole rows, and rows trimmed to 2 prompt tokens before the answer (the target still sees the whole prompt)
    for trim in ((), ("data.max_context_tokens=2",)):
        f32 = ("data.hidden_states_dtype=float32", *trim)
        cached = Run(recipe(d32, tmp_path / f"c{len(trim)}", *f32), target=tiny_target, progress=False)
        online = Run(recipe(d32, tmp_path / f"o{len(trim)}", *f32, "data.online=true"), target=tiny_target,
                     progress=False)
        b = cached.train_data.step_batches(0)[0]
        rc, ro = cached.train_data.batch(b[0]), online.train_data.batch(b[0])
        assert any(online.train_data.start(int(i)) > 0 for i in b[0]) == bool(trim)  # the trim takes effect
        filled = jax.jit(lambda r: fill(tiny_target.model, online.layer_ids, jnp.float32, r))(ro)
        assert set(rc) == set(filled)
        for k in rc:
            np.testing.assert_allclose(np.asarray(filled[k], np.float64), np.asarray(rc[k], np.float64), atol=1e-5,
                                       rtol=0)
        assert_online_step_matches_cache(cached, online, rc, ro)

    # an online recipe that builds its data from rows the target does not write writes no state cache
    fresh = tmp_path / "fresh"
    r0 = Run(recipe(fresh, tmp_path / "f", "data.online=true", f"data.prepare.prompts={src}",
                    "data.prepare.regenerate=false", "trainer.max_steps=2"), target=tiny_target, progress=False)
    assert r0.train()["steps"] == 2
    assert (fresh / "state.json").is_file() and not list(fresh.rglob("hs_*.safetensors"))
    # ... nor for the answers it regenerates (their files keep the row and text, with empty states)
    regen = tmp_path / "regen"
    convs = tiny_prompts(tmp_path / "convs.jsonl")
    r1 = Run(recipe(regen, tmp_path / "g", "data.online=true", f"data.prepare.prompts={convs}",
                    "data.prepare.max_new_tokens=12", "data.prepare.seq_length=128", "trainer.max_steps=2"),
             target=tiny_target, progress=False)
    assert r1.train()["steps"] == 2
    files = list(regen.rglob("hs_*.safetensors"))
    assert files and all(read_hs(f).hidden_states.size == 0 for f in files)
    with pytest.raises(HiddenStateCacheError, match="without a hidden-state cache"):
        Run(recipe(regen, tmp_path / "g2"), target=tiny_target, progress=False)

    extra = ("data.online=true", "trainer.epochs=2")
    ref = Run(recipe(tiny_data, tmp_path / "a", *extra), target=tiny_target, progress=False)
    s = ref.train()
    T = ref.cfg.data.total_seq_len
    assert s["online_target_lengths"] == [T]  # rows that fit the draft row: the target row is the draft row's size
    assert s["compiles"]["train_step"] == 1
    r1 = Run(recipe(tiny_data, tmp_path / "b", *extra), target=tiny_target, progress=False)
    r1.train(stop_after=5)
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoints" / "5")
    r2 = Run(recipe(tiny_data, tmp_path / "b", *extra), target=tiny_target, progress=False, resume=True)
    r2.train()
    for a, c in zip(_leaves(ref.params), _leaves(r2.params)):
        np.testing.assert_array_equal(a, c)


def test_state_noise_augments_training_batches_only(tmp_path, tiny_data, tiny_target):
    """``data.noise_std``: the train step adds ``U(-s, s)`` to the auxiliary hidden states only (the
    verifier's last states, which give the targets, stay), drawn from the batch's key; the loss it
    differentiates is the loss at those noisy states; the eval step sees the states unchanged; 0 is
    the 0.9.0 step exactly; a run made before the setting existed resumes."""
    from specjax.train.run_files import changed_settings
    from specjax.train.step import add_state_noise, device_batch

    s = 0.25
    quiet = Run(recipe(tiny_data, tmp_path / "q"), target=tiny_target, progress=False)
    noisy = Run(recipe(tiny_data, tmp_path / "n", f"data.noise_std={s}"), target=tiny_target, progress=False)
    (params, opt), (qparams, qopt) = noisy.build_state(), quiet.build_state()
    rows = noisy.train_data.batch(noisy.train_data.step_batches(0)[0][0])
    batch = device_batch(rows, jax.random.key(0))
    got = add_state_noise(batch, s)
    new = np.asarray(got["hidden_states"], np.float32)
    d = new - np.asarray(batch["hidden_states"], np.float32)
    assert got["hidden_states"].dtype == batch["hidden_states"].dtype
    # within s, up to the rounding of the sum to the cache's dtype (bfloat16: half an ulp, 2^-8 relative)
    assert np.all(np.abs(d) <= s + np.abs(new) * 2.0 ** -8) and np.abs(d).max() > 0.9 * s
    assert abs(d.mean()) < 0.01 and abs(d.std() - s / np.sqrt(3)) < 0.02  # uniform on [-s, s]
    np.testing.assert_array_equal(np.asarray(got["verifier_last_hidden_states"]),
                                  np.asarray(batch["verifier_last_hidden_states"]))
    again = add_state_noise(device_batch(rows, jax.random.key(0)), s)["hidden_states"]
    other = add_state_noise(device_batch(rows, jax.random.key(1)), s)["hidden_states"]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got["hidden_states"]))
    assert not np.array_equal(np.asarray(other), np.asarray(got["hidden_states"]))
    assert add_state_noise(batch, 0.0) is batch

    _, _, m = noisy.fns.train_step(params, opt, batch)
    want, _ = noisy.fns.loss(params, noisy.fns.frozen, dict(got, rng=batch["rng"]))
    np.testing.assert_allclose(float(m["loss"][0]) / float(m["loss"][1]), float(want), rtol=1e-5)
    _, _, mq = quiet.fns.train_step(qparams, qopt, batch)
    plain, _ = quiet.fns.loss(qparams, quiet.fns.frozen, batch)
    np.testing.assert_allclose(float(mq["loss"][0]) / float(mq["loss"][1]), float(plain), rtol=1e-6)
    assert abs(float(want) - float(plain)) > 1e-6
    assert noisy.validate(params) == quiet.validate(qparams)  # same initial params, states as they are

    old = {k: v for k, v in quiet.cfg.resume_key().items() if k != "data.noise_std"}
    assert changed_settings(old, quiet.cfg) == []
    assert changed_settings(old, noisy.cfg) == ["data.noise_std"]
