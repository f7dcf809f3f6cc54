"""End to end on the embedded SmolLM2 (slow): self-distilled data from built-in prompts, a few
EAGLE-3 steps with the shipped CPU recipe's settings, an export that passes the audit and loads
back, and the offline acceptance evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smollm2_recipe_end_to_end(tmp_path):
    import bridge
    from specjax.models.drafts import load_draft
    from specjax.models.loading import load_target
    from specjax.train.config import load_recipe
    from specjax.train.evaluate import evaluate_acceptance
    from specjax.train.prompts import builtin_prompts
    from specjax.train.trainer import Run

    lt = load_target(None, progress=False)
    cfg = load_recipe(REPO / "configs" / "eagle3-smollm2.yaml", [
        f"data.path={tmp_path / 'data'}", "data.prepare.prompts=[builtin:stdlib:6, builtin:stdlib-source:2]",
        "data.prepare.regenerate=unanswered", "data.prepare.max_new_tokens=24", "data.prepare.batch_size=8",
        "data.prepare.max_prompt_tokens=320", "data.total_seq_len=512",
        "draft.draft_vocab_size=2048",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.max_steps=3", "data.train_data_ratio=0.75"])
    run = Run(cfg, target=lt, progress=False)
    s = run.train()
    meta = json.loads((tmp_path / "data" / "specjax_data.json").read_text())
    assert meta["layer_ids"] == [2, 15, 27, 30] and meta["rows"] == 8  # 6 regenerated, 2 answered as given
    lines = (tmp_path / "data" / "conversations.jsonl").read_text().splitlines()
    convs = [json.loads(l)["conversations"] for l in lines]
    assert all(c in convs for c in builtin_prompts("stdlib-source", 2, seed=cfg.data.prepare.seed))
    assert (tmp_path / "data" / "d2t-2048.npy").is_file()
    last = Path(s["last"])
    assert not bridge.audit(last).errors
    cfg_json = json.loads((last / "config.json").read_text())
    assert cfg_json["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    draft = load_draft(last, lt.model)
    prompts = [lt.tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}],
                                                add_generation_prompt=True, tokenize=True)]
    rep = evaluate_acceptance(draft, lt, prompts, aux_layer_ids=[2, 15, 27], k=3, max_new_tokens=16)
    assert 1.0 <= rep.tau <= 4.0
