"""`specjax bench` and `specjax generate --draft` on a tiny torch-free target + EAGLE-3 draft
(tests/sharding/tiny.py): JSON fields, the PNG, greedy outputs equal to target-only, and bad
input refused with a message (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specjax.cli import app
from specjax.decode.bench import PromptFileError, load_prompts
from tests.sharding import tiny


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join([json.dumps("w5 w6 w7 w8"), json.dumps({"prompt": "w10 w11 w12"}), "",
                                  json.dumps({"prompt_ids": [3, 4, 5, 6, 7]})]) + "\n")
    return {"target": tiny.write_target(root / "t"), "draft": tiny.write_eagle3(root / "d"),
            "qwen": tiny.write_target(root / "q", "qwen3"), "prompts": prompts, "root": root}


def _run(args):
    r = CliRunner().invoke(app, args)
    return r.exit_code, r.output


def test_bench_json_and_plot(ckpts):
    png = ckpts["root"] / "plot.png"
    code, out = _run(["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["draft"]), "--prompts",
                      str(ckpts["prompts"]), "--k", "2", "-n", "6", "-b", "2", "--no-chat", "--json", "--plot",
                      str(png), "--no-progress"])
    assert code == 0, out
    d = json.loads(out.strip().splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert d["prompts"] == 3 and d["k"] == 2 and d["algorithm"] == "eagle3" and d["batch_size"] == 2
    assert d["identical_greedy_outputs"] == "3/3" and d["target_only"]["tokens"] == d["speculative"]["tokens"] == 18
    assert 1.0 <= d["tau"] <= 3.0 and len(d["per_position_acceptance"]) == 2
    assert sum(d["tokens_per_step"].values()) == d["rounds"] > 0
    for key in ("speedup", "predicted_speedup", "speedup_over_predicted", "predicted_speedup_with_verify_cost"):
        assert d[key] > 0
    assert d["cost"]["c"] > 0 and d["cost"]["target_step_ms"] > 0 and not d["lossy"]
    if d["cpu_kernels"]:  # random float32 weights are not bf16 values: float32 panels on both sides
        assert d["panel_dtypes"] == {"target": ["float32"], "draft": ["float32"]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_with_draft(ckpts):
    base = ["generate", "-t", str(ckpts["target"]), "-p", "w5 w6 w7 w8", "-p", "w10 w11 w12", "-n", "6", "--json"]
    code, out = _run(base)
    assert code == 0, out
    ref = json.loads(out)
    code, out = _run(base + ["--draft", str(ckpts["draft"]), "--k", "2"])
    assert code == 0, out
    got = json.loads(out)
    assert [c["token_ids"] for c in got["completions"]] == [c["token_ids"] for c in ref["completions"]]
    acc = got["acceptance"]
    assert acc["k"] == 2 and acc["rounds"] > 0 and len(acc["per_position_acceptance"]) == 2 and not acc["lossy"]
    code, out = _run(base[:-1] + ["--draft", "self", "--k", "2"])  # the oracle draft, text output
    assert code == 0, out
    assert "tau 3.00" in out


def test_bad_input(ckpts, tmp_path):
    args = ["bench", "-t", str(ckpts["target"]), "--no-progress", "--json", "-n", "2"]
    code, out = _run(args + ["--prompts", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "does not exist" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"nope": 1}\n')
    code, out = _run(args + ["--prompts", str(bad)])
    assert code == 2 and "bad.jsonl: record 2 (line 2): no 'conversations', 'messages', 'prompt'" in out
    code, out = _run(["bench", "-t", str(ckpts["qwen"]), "-d", str(ckpts["draft"]), "--prompts", str(ckpts["prompts"]),
                      "--no-progress"])
    assert code == 2 and "does not fit target" in out and "LlamaForCausalLM" in out and "Qwen3ForCausalLM" in out
    code, out = _run(["generate", "-t", str(ckpts["target"]), "-p", "w5", "--draft", "self:9"])
    assert code == 2 and "1..2 of the target's 2 layers" in out
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PromptFileError, match="holds no prompts"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "x.jsonl").write_text("not json\n")
    with pytest.raises(PromptFileError, match="x.jsonl:1: not JSON"):
        load_prompts(tmp_path / "x.jsonl")


def test_bench_own_buckets_at_batch_1(ckpts):
    """Batch 1 on one device: each prompt pads to its own 32-multiple (one compile per bucket), and
    every bucket's outputs still equal target-only."""
    prompts = ckpts["root"] / "ragged.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": ids}) for ids in
                                 ([3, 4, 5], [(i % 40) + 3 for i in range(45)], [5, 6, 7, 8])) + "\n")
    code, out = _run(["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["draft"]), "--prompts", str(prompts),
                      "--k", "2", "-n", "5", "-b", "1", "--no-chat", "--json", "--no-progress"])
    assert code == 0, out
    d = json.loads(out.strip().splitlines()[-1])
    assert d["prompt_buckets"] == [32, 64] and d["prompt_bucket"] == 64
    assert d["identical_greedy_outputs"] == "3/3" and d["target_only"]["tokens"] == d["speculative"]["tokens"] == 15
    assert d["compile_s"]["target_only"] > 0 and d["compile_s"]["speculative"] > 0


def test_round_costs_keep_tiny_positive_times():
    """Reported per-round times keep 5 significant digits: a tiny draft's round the timing puts at
    0.0004 ms stays positive (``round(x, 3)`` made it 0.0 and a report read as a free draft), and
    ``per_round`` is positive whether the 2R call took longer than the R call or, in noise, not."""
    from specjax.decode.costs import per_round, round_ms

    assert round_ms(0.00041234) == 0.00041234 and round_ms(15.123456) == 15.123 and round_ms(1234.5678) == 1234.6
    assert per_round(1.0e-3, 1.0000012e-3, 3) > 0 and round_ms(1e3 * per_round(1.0e-3, 1.0000012e-3, 3)) > 0
    assert per_round(1.0e-3, 0.9e-3, 3) == pytest.approx(0.9e-3 / 6)


def test_bench_several_prompt_sets_in_one_process(ckpts, tmp_path):
    """``--prompts`` twice: each set benched in turn with one load; ``{name}`` in ``--out`` /
    ``--plot`` names each set's files, every report equals the same set benched alone, and several
    sets without ``{name}`` (or two sets of one name) are refused before any model loads."""
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"prompt_ids": ids}) for ids in ([3, 4, 5, 6], [9, 8, 7])) + "\n")
    base = ["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["draft"]), "--k", "2", "-n", "5", "-b", "1",
            "--no-chat", "--json", "--no-progress"]
    code, out = _run(base + ["--prompts", str(ckpts["prompts"]), "--prompts", str(other),
                             "--out", str(tmp_path / "r-{name}.json"), "--plot", str(tmp_path / "r-{name}.png")])
    assert code == 0, out
    lines = [json.loads(x) for x in out.strip().splitlines() if x.startswith("{")]
    assert [d["prompts"] for d in lines] == [3, 2]
    assert [d["prompts_source"] for d in lines] == [str(ckpts["prompts"]), str(other)]
    for name, d in zip(("prompts", "other"), lines):
        assert json.loads((tmp_path / f"r-{name}.json").read_text()) == d
        assert (tmp_path / f"r-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and d["plot"].endswith(f"r-{name}.png")
    for src, d in zip((ckpts["prompts"], other), lines):
        code, out = _run(base + ["--prompts", str(src)])
        assert code == 0, out
        alone = json.loads(out.strip().splitlines()[-1])
        for key in ("tau", "per_position_acceptance", "tokens_per_step", "rounds", "identical_greedy_outputs"):
            assert alone[key] == d[key], key
        assert alone["target_only"]["tokens"] == d["target_only"]["tokens"]
    code, out = _run(base + ["--prompts", str(ckpts["prompts"]), "--prompts", str(other), "--out",
                             str(tmp_path / "r.json")])
    assert code == 2 and "--out" in out and "'{name}'" in out and "prompts, other" in out
    code, out = _run(base + ["--prompts", str(other), "--prompts", str(other), "--plot", str(tmp_path / "{name}.png")])
    assert code == 2 and "share the name 'other'" in out


def test_bf16_compute_in_bench_and_generate(ckpts):
    """``--compute bfloat16``: every side of the bench (target-only, chain, tree) multiplies in bf16
    with float32 sums on the CPU kernels (the panels of both models are bf16), and speculative
    greedy output equals the bf16 target's own; ``generate`` takes the same option; anything else
    is refused by name before a model loads."""
    code, out = _run(["bench", "-t", str(ckpts["target"]), "-d", str(ckpts["draft"]), "--prompts",
                      str(ckpts["prompts"]), "--k", "2", "-n", "6", "-b", "1", "--no-chat", "--json", "--no-progress",
                      "--compute", "bfloat16", "--tree", "[(0,), (1,), (0, 0)]"])
    assert code == 0, out
    d = json.loads(out.strip().splitlines()[-1])
    assert d["compute"] == "bfloat16" and d["identical_greedy_outputs"] == "3/3"
    assert d["tree"]["identical_greedy_outputs"] == "3/3" and d["tree"]["nodes"] == 3
    if d["cpu_kernels"]:  # float32 weights rounded into k-pair panels
        assert d["panel_dtypes"] == {"target": ["bfloat16"], "draft": ["bfloat16"]}
    base = ["generate", "-t", str(ckpts["target"]), "-p", "w5 w6 w7 w8", "-p", "w10 w11 w12", "-n", "6", "--json",
            "--compute", "bfloat16"]
    outs = []
    for extra in ([], ["--draft", str(ckpts["draft"]), "--k", "2"], ["--draft", str(ckpts["draft"]), "--tree",
                                                                     "[(0,), (1,)]"]):
        code, out = _run(base + extra)
        assert code == 0, out
        outs.append([c["token_ids"] for c in json.loads(out)["completions"]])
    assert outs[0] == outs[1] == outs[2]
    for cmd in (["bench", "-d", str(ckpts["draft"]), "--prompts", str(ckpts["prompts"])], ["generate", "-p", "w5"]):
        code, out = _run([*cmd, "-t", str(ckpts["target"]), "--compute", "float16"])
        assert code == 2 and "float32" in out and "bfloat16" in out and "'float16'" in out, out
