"""Data: prompt files, chat rows with assistant-only masks, self-distilled rows with hidden states
captured in the generation pass, mixed regenerated and given answers, the cache in speculators' format both
ways (read by speculators' own dataset code; a speculators-layout cache trains here), resumable
builds, and the bad-input errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from specjax.train import dataset as ds
from specjax.train.errors import DatasetError, HiddenStateCacheError, PromptFileError
from specjax.train.hidden_states import (
    check_record, extract_hidden_states, hs_path, is_complete, read_hs, verify_cache, write_hs,
)
from specjax.train.pipeline import load_data_dir, prepare_data
from specjax.train.prompts import load_prompt_file
from specjax.train.render import conversation_rows
from tests.train.conftest import TINY_AUX, tiny_prompts, tiny_spec


# ----------------------------------------------------------------------------- prompts


def test_prompt_file_formats_and_line_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hi"}\n\n"bare"\n{"conversations": [{"from": "human", "value": "q"}, '
                 '{"from": "gpt", "value": "a"}, {"from": "bot", "value": "x"}]}\n'
                 '{"input_ids": [1, 2], "loss_mask": [0, 1]}\n{"instruction": "do", "input": "this", "output": "ok"}\n')
    recs = load_prompt_file(p)
    assert recs[0] == [{"role": "user", "content": "hi"}]
    assert [t["role"] for t in recs[2]] == ["user", "assistant", "assistant"]
    assert recs[3].input_ids == [1, 2]
    assert recs[4] == [{"role": "user", "content": "do\n\nthis"}, {"role": "assistant", "content": "ok"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x",,}\n')
    with pytest.raises(PromptFileError, match=r"bad.jsonl: record 2 \(line 2\): not valid JSON"):
        load_prompt_file(bad)
    bad.write_text('{"prompt": "ok"}\n\n{"prompt": "ok"}\n{"foo": 1}\n')
    with pytest.raises(PromptFileError, match=r"bad.jsonl: record 3 \(line 4\): no 'conversations'"):
        load_prompt_file(bad)
    bad.write_text('{"conversations": [{"content": "x"}]}\n')
    with pytest.raises(PromptFileError, match=r"record 1 \(line 1\): turn 0 has no 'role'"):
        load_prompt_file(bad)
    bad.write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(PromptFileError, match=r"record 1 \(line 1\): pretokenized row: 2 input_ids but 1"):
        load_prompt_file(bad)


def test_data_prepare_from_a_recipe_is_the_directory_train_expects(tmp_path, tiny_target_dir, tiny_data):
    """``specjax data prepare --config RECIPE`` builds the recipe's data.path with the settings
    ``specjax train`` would use (same rows as a direct build), and a second call leaves the complete
    directory alone (exit 0)."""
    from typer.testing import CliRunner

    from specjax.cli import app

    prompts = tiny_prompts(tmp_path / "p.jsonl")
    d = tmp_path / "d"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""speculator_type: eagle3
target: {tiny_target_dir}
data:
  path: {d}
  prepare: {{prompts: {prompts}, max_new_tokens: 20, seq_length: 128, batch_size: 8, temperature: 0.0}}
draft: {{target_layer_ids: {TINY_AUX}, draft_vocab_size: 40}}
trainer: {{output_dir: {tmp_path / 'run'}}}
""")
    runner = CliRunner()
    r = runner.invoke(app, ["data", "prepare", "--config", str(recipe), "--json"])
    assert r.exit_code == 0, r.output
    meta = json.loads(r.output.strip().splitlines()[-1])
    assert meta["complete"] and meta["rows"] == 24 and meta["aux_layer_ids"] == TINY_AUX
    assert (d / "d2t-40.npy").is_file()
    a, _ = load_data_dir(d)
    b, _ = load_data_dir(tiny_data)  # the same settings through prepare_data directly
    assert all(np.array_equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
    r2 = runner.invoke(app, ["data", "prepare", "--config", str(recipe)])
    assert r2.exit_code == 0 and "already complete" in r2.output
    r3 = runner.invoke(app, ["data", "prepare", "--set", "data.path=x"])
    assert r3.exit_code != 0 and "--config" in r3.output


def test_render_rows_assistant_only_mask(tiny_target):
    tok = tiny_target.tokenizer
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2!"}]
    rows = conversation_rows(tok, conv, max_length=200)
    assert len(rows) == 2
    for (ids, mask), ans in zip(rows, ("a1", "a2!")):
        sup = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert sup == f"{ans}</s>"
        assert mask == sorted(mask)  # one boundary: context then the assistant turn
    plen = int((np.asarray(rows[0][1]) == 0).sum())
    ids, mask = conversation_rows(tok, conv, max_length=plen + 1)[0]
    assert len(ids) == plen + 1 and sum(mask) == 1


# ----------------------------------------------------------------------------- self-distilled data


def test_mixed_sources_regenerate_only_the_unanswered(tmp_path, tiny_target, tiny_target_dir):
    """``prompts: [a, b]`` with ``regenerate: unanswered`` and bf16 products: the prompt-only
    conversations' rows are the rows a regenerating build of them alone gives, the answered ones'
    rows are their own renderings, and the extracted states of those are a float32 extraction's up
    to bf16 rounding."""
    from specjax import kernels

    asked = tiny_prompts(tmp_path / "asked.jsonl", 10)
    given = [[{"role": "user", "content": f"q{i}: add {i} and {i + 1}"},
              {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}" + " ok" * i}] for i in range(6)]
    gpath = tmp_path / "given.jsonl"
    gpath.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in given))
    mixed = tmp_path / "mixed"
    spec = dataclasses.replace(tiny_spec(asked, regenerate="unanswered", compute_dtype="bfloat16"),
                               prompts=[str(asked), str(gpath)])
    meta = prepare_data(mixed, spec, tiny_target, progress=False)
    regen = tmp_path / "regen"
    prepare_data(regen, tiny_spec(str(asked), compute_dtype="bfloat16"), tiny_target, progress=False)
    rows, _ = load_data_dir(mixed)
    want = [tuple(r) for r in load_data_dir(regen)[0].input_ids]
    want_given = [tuple(ids) for c in given for ids, _ in conversation_rows(tiny_target.tokenizer, c, max_length=128)]
    got = [tuple(r) for r in rows.input_ids]
    assert meta["rows"] == 16 and sorted(got) == sorted(want + want_given)
    written = [json.loads(l)["conversations"] for l in (mixed / "conversations.jsonl").read_text().splitlines()]
    assert len(written) == 16 and all(c in written for c in given)
    sep = tmp_path / "f32"
    ds.write_rows(sep, rows)
    idx = [i for i, r in enumerate(got) if r in want_given]
    extract_hidden_states(tiny_target.model, rows, sep, aux_layer_ids=TINY_AUX, dtype="float32", indices=idx,
                          progress=False)
    worst = 0.0
    for i in idx:
        a = np.asarray(read_hs(hs_path(mixed, i)).hidden_states, np.float32)
        b = np.asarray(read_hs(hs_path(sep, i)).hidden_states, np.float32)
        worst = max(worst, np.abs(a - b).max() / np.abs(b).max())
    assert worst <= 5e-2
    if kernels.available():
        assert worst > 1e-6  # bf16 products in the extraction too
    with pytest.raises(DatasetError, match="regenerate"):
        prepare_data(tmp_path / "bad", tiny_spec(str(asked), regenerate="some"), tiny_target, progress=False)
    # the CLI: --prompts twice and --keep-answers build the same rows
    from typer.testing import CliRunner

    from specjax.cli import app

    r = CliRunner().invoke(app, ["data", "prepare", "--out", str(tmp_path / "cli"), "--target", str(tiny_target_dir),
                                 "--prompts", str(asked), "--prompts", str(gpath), "--keep-answers",
                                 "--max-new-tokens", "20", "--seq-length", "128", "--batch-size", "8",
                                 "--aux-layer-ids", ",".join(map(str, TINY_AUX)), "--compute-dtype", "bfloat16",
                                 "--json"])
    assert r.exit_code == 0, r.output
    cli_meta = json.loads(r.output.strip().splitlines()[-1])
    assert cli_meta["regenerate"] == "unanswered" and cli_meta["prompts"] == [str(asked), str(gpath)]
    assert sorted(tuple(x) for x in load_data_dir(tmp_path / "cli")[0].input_ids) == sorted(got)


def test_regenerated_rows_and_captured_hidden_states(tiny_data, tiny_target):
    rows, meta = load_data_dir(tiny_data)
    assert meta["complete"] and meta["layer_ids"] == TINY_AUX + [6] and len(rows) == 24
    tok = tiny_target.tokenizer
    convs = [json.loads(l)["conversations"] for l in (tiny_data / "conversations.jsonl").read_text().splitlines()]
    assert all(c[-1]["role"] == "assistant" for c in convs)
    for i in range(len(rows)):
        ids, mask = rows.input_ids[i], rows.loss_mask[i]
        assert mask.sum() > 0 and (np.diff(mask) >= 0).all()
        prompt = tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
        assert prompt.startswith("<s>user:p") and prompt.endswith("<s>assistant:")
        rec = read_hs(hs_path(tiny_data, i))
        assert rec.hidden_states.shape == (len(ids), 4, 32) and rec.hidden_states.dtype.name == "bfloat16"
        np.testing.assert_array_equal(rec.token_ids, ids)
    # the captured states equal a separate prefill of each full row (up to bf16 rounding)
    sep = tiny_data.parent / "sep-extract"
    shutil.rmtree(sep, ignore_errors=True)
    ds.write_rows(sep, rows)
    extract_hidden_states(tiny_target.model, rows, sep, aux_layer_ids=TINY_AUX, dtype="float32", progress=False)
    for i in range(0, len(rows), 5):
        a = np.asarray(read_hs(hs_path(tiny_data, i)).hidden_states, np.float32)
        b = np.asarray(read_hs(hs_path(sep, i)).hidden_states, np.float32)
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()
    # greedy rows are the target's own greedy continuations
    from specjax.decode.generate import generate_ids

    i = 3
    plen = int((rows.loss_mask[i] == 0).sum())
    g = generate_ids(tiny_target.model, [rows.input_ids[i][:plen].tolist()], max_new_tokens=20,
                     eos_token_ids=tiny_target.eos_token_ids)
    assert g.tokens[0] == rows.input_ids[i][plen:].tolist()


def test_bf16_compute_regeneration(tmp_path, tiny_target):
    """``compute_dtype: bfloat16`` (the CPU kernels' bf16 products): a complete data directory whose
    captured states are a float32 extraction of the same rows up to bf16 rounding, and whose
    spec records the setting."""
    from specjax import kernels

    spec = tiny_spec(tiny_prompts(tmp_path / "p.jsonl", 10), compute_dtype="bfloat16")
    d = tmp_path / "bf16"
    prepare_data(d, spec, tiny_target, progress=False)
    rows, meta = load_data_dir(d)
    assert meta["complete"] and len(rows) == 10 and meta["spec"]["compute_dtype"] == "bfloat16"
    sep = tmp_path / "f32-extract"
    ds.write_rows(sep, rows)
    extract_hidden_states(tiny_target.model, rows, sep, aux_layer_ids=TINY_AUX, dtype="float32", progress=False)
    worst = 0.0
    for i in range(len(rows)):
        a = np.asarray(read_hs(hs_path(d, i)).hidden_states, np.float32)
        b = np.asarray(read_hs(hs_path(sep, i)).hidden_states, np.float32)
        worst = max(worst, np.abs(a - b).max() / np.abs(b).max())
    assert worst <= 5e-2
    if kernels.available():
        assert worst > 1e-6  # bf16 products, not float32's


def test_shared_prefix_regeneration(tiny_target):
    """Regeneration prefills the prompts' common leading tokens once per batch: the same tokens
    and, up to float reassociation, the same captured states as prefilling every row whole;
    ``shared_prefix_len`` keeps a token of every prompt its own."""
    from specjax.train.selfdistill import generate_with_hidden_states, shared_prefix_len

    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]) == 2
    assert shared_prefix_len([[1, 2], [1, 2, 3]]) == 1  # the shortest keeps its last token
    assert shared_prefix_len([[1, 2, 3]]) == 0 and shared_prefix_len([[4, 2], [1, 2]]) == 0
    head = [5, 9, 13, 17, 21, 25]
    rng = np.random.default_rng(0)
    prompts = [head + rng.integers(3, 60, size=int(n)).tolist() for n in (1, 4, 9, 17, 3)]
    kw = dict(max_new_tokens=6, taps=TINY_AUX + [6], batch_size=2, out_dtype=np.float32, progress=False)
    whole = generate_with_hidden_states(tiny_target.model, prompts, share_prefix=False, **kw)
    shared = generate_with_hidden_states(tiny_target.model, prompts, **kw)
    for a, b in zip(whole, shared):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(b.hidden_states, a.hidden_states, rtol=1e-5, atol=1e-5)


def test_speculators_reads_our_cache(tiny_data):
    """speculators' own ArrowDataset (FileTransfer, on_missing=raise) + CollateFn + shift_batch give the
    packed row our trainer builds."""
    import torch
    from datasets import load_from_disk

    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from specjax.train.feed import TrainData

    hf = load_from_disk(str(tiny_data))
    assert hf.num_rows == 24 and set(hf.column_names) == {"input_ids", "loss_mask", "seq_len"}
    ref_ds = ArrowDataset(max_len=256, datapath=str(tiny_data), on_missing="raise", hidden_states_dtype=torch.float32)
    rows, _ = load_data_dir(tiny_data)
    ours = TrainData(tiny_data, rows, range(len(rows)), algo="eagle3", num_aux=3, hidden_size=32, total_seq_len=256,
                     seed=0)
    idx = [2, 5, 11]
    ref = CollateFn(256, 32, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)([ref_ds[i] for i in idx])
    mine = ours.batch(np.asarray(idx))
    for k in ("hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "position_ids", "document_ids"):
        np.testing.assert_array_equal(np.asarray(mine[k], np.float32), ref[k].float().numpy(), err_msg=k)


def test_speculators_layout_cache_trains_here(tmp_path, tiny_data, tiny_target):
    """A cache written the way speculators / hs_connectors write it (datasets.save_to_disk, torch
    safetensors save_file, no metadata) is read and trained on by specjax."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from specjax.train.config import load_recipe
    from specjax.train.trainer import Run

    rows, _ = load_data_dir(tiny_data)
    d = tmp_path / "spec-data"
    hfds = Dataset.from_dict({"input_ids": [torch.from_numpy(r) for r in rows.input_ids],
                              "loss_mask": [torch.from_numpy(m) for m in rows.loss_mask],
                              "seq_len": [len(r) for r in rows.input_ids]})
    hfds.set_format(type="torch")
    hfds.save_to_disk(str(d))
    (d / "hidden_states").mkdir()
    for i in range(len(rows)):
        rec = read_hs(hs_path(tiny_data, i))
        save_file({"hidden_states": torch.from_numpy(np.asarray(rec.hidden_states, np.float32)).bfloat16(),
                   "token_ids": torch.from_numpy(rec.token_ids)}, str(d / "hidden_states" / f"hs_{i}.safetensors"))
    cfg = load_recipe(None, [f"data.path={d}", "data.total_seq_len=128", f"draft.target_layer_ids={TINY_AUX}",
                             "draft.draft_vocab_size=40", f"trainer.output_dir={tmp_path / 'run'}",
                             "trainer.max_steps=3", "trainer.compute_dtype=float32", "data.train_data_ratio=0.9"])
    s = Run(cfg, target=tiny_target, progress=False).train()
    assert s["steps"] == 3 and (tmp_path / "run" / "last" / "model.safetensors").is_file()
    assert (d / "d2t-40.npy").is_file()  # built from the counts, as speculators does


# ----------------------------------------------------------------------------- resumable, bad input


def test_prepare_resumes_after_a_kill(tmp_path, tiny_target, tiny_data, monkeypatch):
    import specjax.train.selfdistill as sd

    spec = tiny_spec(tiny_prompts(tmp_path / "p.jsonl"))
    real = sd.generate_with_hidden_states
    calls = {"n": 0}

    def dying(*a, on_batch=None, **kw):
        def ob(idx, res):
            on_batch(idx, res)
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("killed")

        return real(*a, on_batch=ob, **kw)

    monkeypatch.setattr(sd, "generate_with_hidden_states", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(tmp_path / "d", spec, tiny_target, progress=False)
    staged = list((tmp_path / "d" / "hidden_states" / ".staging").glob("*.safetensors"))
    assert len(staged) == 16 and not (tmp_path / "d" / "state.json").exists()
    monkeypatch.setattr(sd, "generate_with_hidden_states", real)
    with pytest.raises(DatasetError, match="other settings"):
        prepare_data(tmp_path / "d", tiny_spec(tmp_path / "p.jsonl", max_new_tokens=9), tiny_target, progress=False)
    meta = prepare_data(tmp_path / "d", spec, tiny_target, progress=False)
    assert meta["rows"] == 24
    a, _ = load_data_dir(tmp_path / "d")
    b, _ = load_data_dir(tiny_data)
    assert all(np.array_equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
    for i in (0, 7, 23):
        np.testing.assert_array_equal(np.asarray(read_hs(hs_path(tmp_path / "d", i)).hidden_states, np.float32),
                                      np.asarray(read_hs(hs_path(tiny_data, i)).hidden_states, np.float32))


_KILLER = """
import os, signal, sys
from specjax.models.loading import load_target
import specjax.train.selfdistill as sd
from specjax.train.pipeline import prepare_data
from tests.train.conftest import tiny_spec

real, seen = sd.generate_with_hidden_states, []
def dying(*a, on_batch=None, **kw):
    def ob(idx, res):
        on_batch(idx, res)
        seen.append(idx)
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 between two batches: no cleanup runs
    return real(*a, on_batch=ob, **kw)
sd.generate_with_hidden_states = dying
prepare_data(sys.argv[3], tiny_spec(sys.argv[2]), load_target(sys.argv[1], progress=False), progress=False)
"""


def test_prepare_killed_midway_resumes_without_regenerating(tmp_path, tiny_target_dir, tiny_target, tiny_data,
                                                            monkeypatch):
    """A ``kill -9`` of a data build, then the same build again: the rerun regenerates only the
    answers the killed run had not written (the staged files are kept, not rewritten), and the
    directory equals an uninterrupted build (tiny_data, same settings) row for row."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import specjax.train.selfdistill as sd

    repo = Path(__file__).resolve().parents[2]
    prompts = tiny_prompts(tmp_path / "p.jsonl")
    d = tmp_path / "d"
    r = subprocess.run([sys.executable, "-c", _KILLER, str(tiny_target_dir), str(prompts), str(d)], cwd=repo,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    staged = sorted((d / "hidden_states" / ".staging").glob("*.safetensors"))
    assert len(staged) == 16 and not (d / "state.json").exists()  # two batches of 8 of the 24 prompts
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in staged}

    real, asked = sd.generate_with_hidden_states, []

    def counting(model, prompts, **kw):
        asked.append(len(prompts))
        return real(model, prompts, **kw)

    monkeypatch.setattr(sd, "generate_with_hidden_states", counting)
    meta = prepare_data(d, tiny_spec(prompts), tiny_target, progress=False)
    assert asked == [24 - 16]  # only the 8 answers the killed run had not written
    finals = {(p.stat().st_ino, p.stat().st_mtime_ns) for p in (d / "hidden_states").glob("hs_*.safetensors")}
    assert set(kept.values()) <= finals  # the staged files became rows untouched (moved, not rewritten)
    assert meta["rows"] == 24 and not (d / "hidden_states" / ".staging").exists()
    a, _ = load_data_dir(d)
    b, _ = load_data_dir(tiny_data)
    assert all(np.array_equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
    assert all(np.array_equal(x, y) for x, y in zip(a.loss_mask, b.loss_mask))
    for i in range(24):
        np.testing.assert_array_equal(np.asarray(read_hs(hs_path(d, i)).hidden_states, np.float32),
                                      np.asarray(read_hs(hs_path(tiny_data, i)).hidden_states, np.float32))


def test_extraction_resumes_and_partial_files_are_not_complete(tmp_path, tiny_data, tiny_target):
    rows, _ = load_data_dir(tiny_data)
    d = tmp_path / "x"
    ds.write_rows(d, rows)
    r1 = extract_hidden_states(tiny_target.model, rows, d, aux_layer_ids=TINY_AUX, indices=range(10), progress=False)
    assert r1["written"] == 10
    p = hs_path(d, 4)
    p.write_bytes(p.read_bytes()[:100])  # a truncated file under the final name
    assert not is_complete(p)
    r2 = extract_hidden_states(tiny_target.model, rows, d, aux_layer_ids=TINY_AUX, progress=False)
    assert r2["skipped"] == 9 and r2["written"] == 15
    verify_cache(rows, d, aux_layer_ids=TINY_AUX, num_layers=6, hidden_size=32)


def test_extraction_dispatches_the_next_batch_before_writing(tmp_path, monkeypatch):
    """The device computes batch n + 1 while the host writes batch n: every batch after the first
    is dispatched before the previous batch's rows are written, and every row is written once."""
    from specjax.train import hidden_states as hsm

    events = []

    def fn(ids):
        events.append(("run", int(ids[0, 0])))
        return np.repeat(ids[:, :, None, None].astype(np.float32), 2, axis=2)

    monkeypatch.setattr(hsm, "write_hs", lambda path, hs, ids, metadata: events.append(("write", int(ids[0]))))

    class Bar:
        def update(self, n):
            pass

        def set_postfix_str(self, s):
            pass

    rows = ds.TokenRows(input_ids=[np.arange(5, 9) + 10 * i for i in range(4)],
                        loss_mask=[np.ones(4, np.int32) for _ in range(4)])
    done = hsm._write_batches(fn, rows, tmp_path, list(range(4)), [[0], [1, 2], [3]], ctx=64, mesh=None, meta={},
                              main=True, bar=Bar(), t0=0.0)
    assert done == 16
    assert events == [("run", 5), ("run", 15), ("write", 5), ("run", 35), ("write", 15), ("write", 25),
                      ("write", 35)]


def test_regeneration_dispatches_the_next_batch_before_handing_results_over(monkeypatch, tiny_target):
    """Regeneration is pipelined as extraction is: batch n + 1 is dispatched before batch n's
    results reach ``on_batch`` (where the caller writes them), each batch handed over once, in order."""
    from specjax.train import selfdistill as sdm

    events = []
    monkeypatch.setattr(sdm, "generate_padded", lambda g, p, ids, *a, **kw: events.append(("run", ids.shape[0])) or ids)
    monkeypatch.setattr(sdm, "_batch_results", lambda out, prompts, lens, idx, taps:
                        [sdm.Generated(list(prompts[i]), [1], "length", None) for i in idx])
    prompts = [[5, 6, 7]] * 5
    sdm.generate_with_hidden_states(tiny_target.model, prompts, max_new_tokens=2, batch_size=2, progress=False,
                                    on_batch=lambda idx, res: events.append(("write", tuple(idx))))
    assert events == [("run", 2), ("run", 2), ("write", (0, 1)), ("run", 2), ("write", (2, 3)), ("write", (4,))]


def test_cache_mismatch_errors(tmp_path, tiny_data):
    rows, _ = load_data_dir(tiny_data)
    rec = read_hs(hs_path(tiny_data, 0))
    ids = rows.input_ids[0]
    with pytest.raises(HiddenStateCacheError, match="holds 4 layers; expected 5"):
        check_record(rec, input_ids=ids, num_layers=5, hidden_size=32)
    with pytest.raises(HiddenStateCacheError, match="hidden size 32; the target's is 64"):
        check_record(rec, input_ids=ids, num_layers=4, hidden_size=64)
    with pytest.raises(HiddenStateCacheError, match="do not match the dataset row"):
        check_record(rec, input_ids=ids[:-1], num_layers=4, hidden_size=32)
    with pytest.raises(HiddenStateCacheError, match=r"cached layer ids \[1, 3, 4, 6\]"):
        check_record(rec, input_ids=ids, num_layers=4, hidden_size=32, layer_ids=[2, 3, 4, 6])
    bad = tmp_path / "hs.safetensors"
    write_hs(bad, np.full((len(ids), 4, 32), np.nan, np.float32), ids)
    with pytest.raises(HiddenStateCacheError, match="non-finite"):
        check_record(read_hs(bad), input_ids=ids, num_layers=4, hidden_size=32)
    d = tmp_path / "d"
    shutil.copytree(tiny_data, d)
    hs_path(d, 5).unlink()
    with pytest.raises(HiddenStateCacheError, match=r"1 of 24 rows have no complete hidden-state file.*hs_5"):
        verify_cache(rows, d, aux_layer_ids=TINY_AUX, num_layers=6, hidden_size=32)


def test_cache_for_another_target_is_refused_before_training(tmp_path, tiny_data, tiny_target):
    from specjax.train.config import load_recipe
    from specjax.train.trainer import Run

    base = [f"data.path={tiny_data}", "data.total_seq_len=128", "draft.draft_vocab_size=40",
            f"trainer.output_dir={tmp_path / 'r'}"]
    with pytest.raises(HiddenStateCacheError, match=r"cache holds layers \[1, 3, 4, 6\]"):
        Run(load_recipe(None, base + ["draft.target_layer_ids=[1,2,4]"]), target=tiny_target, progress=False)
    with pytest.raises(Exception, match="larger than the target vocabulary"):
        Run(load_recipe(None, base + [f"draft.target_layer_ids={TINY_AUX}", "draft.draft_vocab_size=97"]),
            target=tiny_target, progress=False)


def test_fp8_connector_files_are_dequantised(tmp_path, tiny_data):
    import torch
    from safetensors.torch import save_file

    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    rec = read_hs(hs_path(tiny_data, 0))
    t = torch.from_numpy(np.asarray(rec.hidden_states, np.float32))
    q, sc = quantize_tensor_to_fp8(t)
    p = tmp_path / "hs_0.safetensors"
    save_file({"hidden_states": q, "hidden_states_scales": sc, "token_ids": torch.from_numpy(rec.token_ids)}, str(p))
    got = read_hs(p)
    ref = dequantize_fp8_tensor(q, sc, torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(got.hidden_states, np.float32), ref)


def test_multi_process_regeneration_is_refused_before_any_work(tmp_path, tiny_target, monkeypatch):
    import specjax.sharding as shd

    monkeypatch.setattr(shd, "process_count", lambda: 2)
    spec = tiny_spec(tiny_prompts(tmp_path / "p.jsonl"))
    with pytest.raises(DatasetError, match="regenerating answers runs in one process; this run has 2"):
        prepare_data(tmp_path / "d", spec, tiny_target, progress=False)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("context", [0, 3, 10_000])
def test_max_context_tokens_keeps_every_supervised_position(tiny_data, context):
    """``data.max_context_tokens``: a training row keeps every supervised position and at most
    ``context`` prompt positions before the first one (a tail of the whole row, its positions kept);
    packing sees the shortened lengths; a context longer than every prompt changes nothing."""
    from specjax.train.feed import TrainData

    rows, _ = load_data_dir(tiny_data)
    mk = dict(algo="eagle3", num_aux=3, hidden_size=32, total_seq_len=256, seed=0)
    whole = TrainData(tiny_data, rows, range(len(rows)), **mk)
    cut = TrainData(tiny_data, rows, range(len(rows)), max_context_tokens=context, **mk)
    dropped = 0
    for i in range(len(rows)):
        a, b = whole.sample(i), cut.sample(i)
        first = int(np.flatnonzero(a["loss_mask"])[0])
        start = max(0, first - context)
        dropped += start
        assert cut.length(i) == len(a["input_ids"]) - start == len(b["input_ids"])
        assert int(np.flatnonzero(b["loss_mask"])[0]) == min(first, context)
        for k in a:
            np.testing.assert_array_equal(b[k], a[k][start:], err_msg=k)
        assert b["loss_mask"].sum() == a["loss_mask"].sum()
    if context == 10_000:
        assert dropped == 0
        assert [list(x) for x in cut.epoch_batches(0)] == [list(x) for x in whole.epoch_batches(0)]
    else:
        assert dropped > 0
        total = sum(cut.tokens(b) for b in cut.epoch_batches(0))
        assert total == sum(max(cut.length(i) - 1, 0) for i in range(len(rows)))
    # prompt_loss supervises the prompt itself: nothing is cut
    full = TrainData(tiny_data, rows, range(len(rows)), max_context_tokens=context, prompt_loss=True, **mk)
    assert all(full.length(i) == len(rows.input_ids[i]) for i in range(len(rows)))
    # context_loss: the same cut rows, every kept position supervised (the kept prompt tail too)
    kept = TrainData(tiny_data, rows, range(len(rows)), max_context_tokens=context, context_loss=True, **mk)
    for i in range(len(rows)):
        b, c = cut.sample(i), kept.sample(i)
        assert kept.length(i) == cut.length(i)
        assert c["loss_mask"].tolist() == [1] * len(b["input_ids"])
        assert c["loss_mask"].sum() - b["loss_mask"].sum() == min(int(np.flatnonzero(b["loss_mask"])[0]), context)
        for k in b:
            if k != "loss_mask":
                np.testing.assert_array_equal(c[k], b[k], err_msg=k)
