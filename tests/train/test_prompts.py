"""The one prompt reader (specjax.train.prompts.read_prompts): every input kind (json, jsonl,
parquet, arrow, save_to_disk, a directory of files, hf: from the local datasets cache), the record
shapes, errors that name the file, the record and the key, --max-samples / --shuffle-seed, and
``specjax data prepare`` failing on a bad input before the target loads, leaving nothing behind."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specjax.train.errors import PromptFileError
from specjax.train.prompts import PretokenizedRow, PromptIds, read_prompts
from tests.train.conftest import TINY_AUX

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                                  {"from": "gpt", "value": "Hello!"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                                  {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]},
]
ULTRACHAT = [  # UltraChat's columns: prompt, prompt_id, messages
    {"prompt": f"q{i}", "prompt_id": f"id{i}",
     "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
    for i in range(5)
]
MESSAGES_0 = [{"role": "user", "content": "question 0?"}, {"role": "assistant", "content": "answer 0."}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ----------------------------------------------------------------------------- input kinds


def test_every_file_kind_and_record_shape(tmp_path):
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps(SHAREGPT, indent=1))
    recs = read_prompts(sg)
    assert recs[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                       {"role": "assistant", "content": "Hello!"}]
    assert [t["role"] for t in recs[1]] == ["user", "assistant", "user", "assistant"]

    oa = _jsonl(tmp_path / "chat.jsonl", ULTRACHAT)
    pqf = _parquet(tmp_path / "ultrachat.parquet", ULTRACHAT)
    assert read_prompts(oa) == read_prompts(pqf) and len(read_prompts(pqf)) == 5
    assert read_prompts(pqf)[0] == MESSAGES_0  # 'messages' wins over the plain 'prompt' column

    shapes = _jsonl(tmp_path / "shapes.jsonl", [
        "a bare string", {"text": "t"}, {"question": "q?", "answer": "a."},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]},
        {"messages": [{"role": "USER", "content": "u"}, {"role": "assistant", "content": None,
                                                          "tool_calls": [{"id": "1"}]},
                      {"role": "tool", "content": "r", "tool_call_id": "1"}]},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"prompt_ids": [4, 5]}])
    got = read_prompts(shapes)
    assert got[0] == [{"role": "user", "content": "a bare string"}]
    assert got[1] == [{"role": "user", "content": "t"}]
    assert got[2] == [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a."}]
    assert got[3] == [{"role": "user", "content": "xy"}]
    assert got[4][1] == {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    assert got[4][2] == {"role": "tool", "content": "r", "tool_call_id": "1"}
    assert got[5] == PretokenizedRow([1, 2, 3], [0, 1, 1]) and got[6] == PromptIds([4, 5])


def test_save_to_disk_arrow_and_directories(tmp_path):
    import datasets

    datasets.Dataset.from_list(ULTRACHAT).save_to_disk(str(tmp_path / "saved"))
    assert read_prompts(tmp_path / "saved")[0] == MESSAGES_0
    arrow = sorted((tmp_path / "saved").glob("*.arrow"))
    assert len(arrow) == 1 and read_prompts(arrow[0]) == read_prompts(tmp_path / "saved")

    dd = datasets.DatasetDict({"train_sft": datasets.Dataset.from_list(ULTRACHAT[:2]),
                               "test_sft": datasets.Dataset.from_list(ULTRACHAT[2:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PromptFileError, match=r"dd: holds the splits \['train_sft', 'test_sft'\] and none is 'train'"):
        read_prompts(tmp_path / "dd")
    assert len(read_prompts(tmp_path / "dd" / "test_sft")) == 3
    datasets.DatasetDict({"train": dd["train_sft"]}).save_to_disk(str(tmp_path / "dd1"))
    assert len(read_prompts(tmp_path / "dd1")) == 2

    mixed = tmp_path / "mixed"
    (mixed / "sub").mkdir(parents=True)
    (mixed / "a.json").write_text(json.dumps(SHAREGPT))
    _jsonl(mixed / "b.jsonl", [{"prompt": "from b"}])
    _parquet(mixed / "sub" / "c.parquet", ULTRACHAT[:1])
    (mixed / "README.md").write_text("not a prompt file")
    (mixed / ".hidden").mkdir()
    _jsonl(mixed / ".hidden" / "x.jsonl", [{"nope": 1}])  # hidden paths are skipped
    recs = read_prompts(mixed)
    assert len(recs) == 4 and recs[2] == [{"role": "user", "content": "from b"}] and recs[3] == MESSAGES_0
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptFileError, match=r"empty: a directory with no prompt files"):
        read_prompts(tmp_path / "empty")
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(PromptFileError, match=r"p.csv: unknown prompt file type '.csv'"):
        read_prompts(tmp_path / "p.csv")


def _fake_hf_cache(root, repo_id: str, split: str, rows) -> str:
    """A datasets cache entry as ``load_dataset(repo_id)`` leaves it (``<ns>___<name>/default/
    0.0.0/<hash>/<name>-<split>.arrow``), written by datasets' own parquet builder."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    ns, name = repo_id.split("/")
    src = _parquet(root / "src.parquet", rows)
    b = Parquet(cache_dir=str(root / "build"), dataset_name=name, data_files={split: str(src)}, hash="0123abcd")
    b.download_and_prepare()
    built = next((root / "build" / name).iterdir())  # default-<config hash>
    cache = root / "cache"
    (cache / f"{ns}___{name}").mkdir(parents=True)
    built.rename(cache / f"{ns}___{name}" / "default")
    return str(cache)


def test_hf_ids_from_the_local_datasets_cache(tmp_path):
    cache = _fake_hf_cache(tmp_path, "someone/tiny_chat", "train_sft", ULTRACHAT)
    assert read_prompts("hf:someone/tiny_chat", hf_cache_dir=cache)[0] == MESSAGES_0  # the only split
    assert len(read_prompts("hf:someone/tiny_chat::train_sft", hf_cache_dir=cache, max_samples=2)) == 2
    with pytest.raises(PromptFileError, match=r"has no split 'test'; it has \['train_sft'\]"):
        read_prompts("hf:someone/tiny_chat::test", hf_cache_dir=cache)
    with pytest.raises(PromptFileError, match=r"for config 'other'.*datasets.load_dataset\('someone/tiny_chat', "
                                              r"'other'\)"):
        read_prompts("hf:someone/tiny_chat:other", hf_cache_dir=cache)
    with pytest.raises(PromptFileError) as e:
        read_prompts("hf:HuggingFaceH4/ultrachat_200k::train_sft", hf_cache_dir=cache)
    msg = str(e.value)
    assert msg.startswith("hf:HuggingFaceH4/ultrachat_200k::train_sft: HuggingFaceH4/ultrachat_200k is not in the "
                          "local HF datasets cache")
    assert "datasets.load_dataset('HuggingFaceH4/ultrachat_200k', split='train_sft')" in msg
    with pytest.raises(PromptFileError, match=r"expected hf:<id>\[:<config>\]\[:<split>\]"):
        read_prompts("hf:")


# ----------------------------------------------------------------------------- errors


BAD_JSONL = [
    ('{"prompt": "ok"}\n\n{"conversations": [{"from": "human", "value": "x"}, {"from": "narrator", "value": "y"}]}\n',
     r"bad.jsonl: record 2 \(line 3\): turn 1 has from 'narrator'; expected one of user, human", "conversations[1].from"),
    ('{"prompt": "ok"}\n{"messages": [{"content": "x"}]}\n',
     r"bad.jsonl: record 2 \(line 2\): turn 0 has no 'role' \(or 'from'\) key \(found \['content'\]\)", "messages[0]"),
    ('{"prompt": "ok"}\n{"prompt": "ok"}\n{"title": "x", "body": "y"}\n',
     r"bad.jsonl: record 3 \(line 3\): no 'conversations', 'messages', 'prompt', 'text'.*\(found \['body', 'title'\]\)",
     None),
    (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n',
     r"bad.jsonl: record 2 \(line 2\): column 16: byte 0xe9 is not UTF-8 \(invalid continuation byte\)", None),
    ('{"prompt": "ok"}\n{"prompt": "x",}\n', r"bad.jsonl: record 2 \(line 2\): not valid JSON", None),
    ('{"messages": [{"role": "assistant", "content": "only me"}]}\n',
     r"record 1 \(line 1\): 'messages' has no user turn with text", "messages"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}\n',
     r"record 1 \(line 1\): a content part of type 'image_url'; only text parts", "messages[0].content"),
    ('{"messages": []}\n', r"record 1 \(line 1\): 'messages' is empty; expected a non-empty list", "messages"),
    ('{"prompt": "   "}\n', r"record 1 \(line 1\): 'prompt' is empty", "prompt"),
    ('\n\n', r"bad.jsonl: no records \(the input is empty\)", None),
]


@pytest.mark.parametrize("text,match,key", BAD_JSONL)
def test_bad_records_name_file_record_and_key(tmp_path, text, match, key):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PromptFileError, match=match) as e:
        read_prompts(bad)
    assert e.value.key == key


def test_bad_json_and_parquet_inputs(tmp_path):
    j = tmp_path / "sg.json"
    j.write_text(json.dumps(SHAREGPT + [{"conversations": [{"from": "human", "value": 3}]}]))
    with pytest.raises(PromptFileError, match=r"sg.json: record 3: content is a int; expected a string") as e:
        read_prompts(j)
    assert e.value.key == "conversations[0].value"
    j.write_bytes(b'[{"prompt": "ok"},\n {"prompt": "\xff"}]')
    with pytest.raises(PromptFileError, match=r"sg.json: line 2, column 14: byte 0xff is not UTF-8"):
        read_prompts(j)
    j.write_text('[{"prompt": "ok"},\n {"prompt": }]')
    with pytest.raises(PromptFileError, match=r"sg.json: line 2, column 13: not valid JSON \(Expecting value\)"):
        read_prompts(j)

    # a string column holding non-UTF-8 bytes (the UltraChat report: 0xde)
    strings = pa.array([b"fine", b"\xde\xad\xbe\xef\xff"], pa.binary()).view(pa.string())
    p = tmp_path / "u.parquet"
    pq.write_table(pa.table({"prompt": strings}), p)
    with pytest.raises(PromptFileError, match=r"u.parquet: record 2: column 'prompt' holds bytes that are not UTF-8") as e:
        read_prompts(p)
    assert e.value.key == "prompt"
    p.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(PromptFileError, match=r"u.parquet: not a readable parquet file"):
        read_prompts(p)
    with pytest.raises(PromptFileError, match=r"nothere.parquet: prompt file does not exist"):
        read_prompts(tmp_path / "nothere.parquet")
    rows = _parquet(tmp_path / "rows.parquet", [{"input_ids": [1, 2], "loss_mask": [0, 1]}])
    with pytest.raises(PromptFileError, match=r"rows.parquet: record 1: a pretokenized record; this command takes "
                                              r"conversation or prompt_ids records"):
        read_prompts(rows, accept=("conversation", "prompt_ids"))


# ----------------------------------------------------------------------------- selection


def test_max_samples_and_shuffle_are_deterministic(tmp_path):
    import datasets

    rows = [{"prompt": f"p{i}"} for i in range(40)]
    f = _jsonl(tmp_path / "p.jsonl", rows)
    text = lambda recs: [r[0]["content"] for r in recs]  # noqa: E731
    assert text(read_prompts(f, max_samples=3)) == ["p0", "p1", "p2"]
    a = text(read_prompts(f, shuffle_seed=7))
    assert a == text(read_prompts(f, shuffle_seed=7)) and sorted(a) == sorted(r["prompt"] for r in rows)
    assert a != text(read_prompts(f)) and a != text(read_prompts(f, shuffle_seed=8))
    assert a == datasets.Dataset.from_list(rows).shuffle(seed=7)["prompt"]  # speculators' order
    assert text(read_prompts(f, shuffle_seed=7, max_samples=5)) == a[:5]
    assert len(read_prompts("builtin:stdlib:30", max_samples=4, shuffle_seed=1)) == 4
    with pytest.raises(PromptFileError, match="max_samples is 0"):
        read_prompts(f, max_samples=0)


def test_recipe_prepare_fields_are_validated():
    from specjax.train.config import PrepareArgs
    from specjax.train.pipeline import DataSpec

    p = PrepareArgs(prompts="hf:HuggingFaceH4/ultrachat_200k::train_sft", max_samples=100, shuffle_seed=3)
    spec = DataSpec(**p.model_dump())
    assert spec.max_samples == 100 and spec.shuffle_seed == 3
    for bad, msg in ((dict(max_samples=0), "greater than or equal to 1"), (dict(prompts="hf:"), "expected hf:<id>"),
                     (dict(prompts="builtin:stdlib:x"), "positive integer n"), (dict(prompts=" "), "empty")):
        with pytest.raises(ValueError, match=msg):
            PrepareArgs(**bad)


# ----------------------------------------------------------------------------- data prepare


def _prepare(args):
    from typer.testing import CliRunner

    from specjax.cli import app

    return CliRunner().invoke(app, ["data", "prepare", *args])


def test_data_prepare_bad_input_fails_before_the_target_loads(tmp_path, monkeypatch):
    import specjax.commands.data as data_cmd

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the prompts were checked")

    monkeypatch.setattr(data_cmd, "_load_target", no_target)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"messages": [{"role": "narrator", "content": "x"}]}])
    out = tmp_path / "out"
    r = _prepare(["--out", str(out), "--prompts", str(bad), "--target", str(tmp_path / "no-such-target")])
    assert r.exit_code == 2, r.output
    assert "bad.jsonl: record 2 (line 2): turn 0 has role 'narrator'" in " ".join(r.output.split())
    assert not out.exists()
    p = tmp_path / "u.parquet"
    pq.write_table(pa.table({"prompt": pa.array([b"\xde\x00"], pa.binary()).view(pa.string())}), p)
    r = _prepare(["--out", str(out), "--prompts", str(p)])
    assert r.exit_code == 2 and "u.parquet: record 1: column 'prompt'" in " ".join(r.output.split()), r.output
    assert not out.exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"speculator_type: eagle3\ntarget: {tmp_path / 'no-such-target'}\n"
                      f"data: {{path: {out}, prepare: {{prompts: {bad}}}}}\ntrainer: {{output_dir: {tmp_path / 'run'}}}\n")
    r = _prepare(["--config", str(recipe)])
    assert r.exit_code == 2 and "bad.jsonl: record 2 (line 2)" in " ".join(r.output.split()), r.output
    assert not out.exists()
    from typer.testing import CliRunner

    from specjax.cli import app

    r = CliRunner().invoke(app, ["train", "--config", str(recipe)])  # the target path does not exist either
    assert r.exit_code == 2 and "bad.jsonl: record 2 (line 2)" in " ".join(r.output.split()), r.output
    assert not out.exists() and not (tmp_path / "run").exists()


def test_data_prepare_end_to_end_on_each_input_kind(tmp_path, tiny_target_dir):
    """parquet, save_to_disk and ShareGPT json into the tiny target's data directory (rendered
    rows, no regeneration), --max-samples and --shuffle-seed on the way."""
    import datasets

    from specjax.train.pipeline import load_data_dir

    pqf = _parquet(tmp_path / "ultrachat.parquet", ULTRACHAT)
    datasets.Dataset.from_list(ULTRACHAT).save_to_disk(str(tmp_path / "saved"))
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps(SHAREGPT))
    common = ["--target", str(tiny_target_dir), "--no-regenerate", "--seq-length", "96",
              "--aux-layer-ids", ",".join(map(str, TINY_AUX)), "--json"]
    metas = {}
    for name, src, extra in (("pq", pqf, ["--max-samples", "3", "--shuffle-seed", "1"]), ("disk", tmp_path / "saved", []),
                             ("sg", sg, [])):
        r = _prepare(["--out", str(tmp_path / name), "--prompts", str(src), *common, *extra])
        assert r.exit_code == 0, r.output
        metas[name] = json.loads(r.output.strip().splitlines()[-1])
        assert metas[name]["complete"]
    assert metas["pq"]["rows"] == 3 and metas["disk"]["rows"] == 5  # one assistant turn each
    assert metas["sg"]["rows"] == 3  # 1 + 2 assistant turns
    assert metas["pq"]["spec"]["max_samples"] == 3 and metas["pq"]["spec"]["shuffle_seed"] == 1
    rows, _ = load_data_dir(tmp_path / "disk")
    assert all(int(np.asarray(m).sum()) > 0 for m in rows.loss_mask)
