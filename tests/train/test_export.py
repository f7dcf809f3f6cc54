"""Export of a trained draft: the checkpoint lands with ordinary modes (0755 dirs, 0644 files under
umask 022), so vLLM in a container or another user can read it; its proposal length."""

from __future__ import annotations

import pytest

from specjax.train.config import load_recipe
from specjax.train.draft_doc import draft_config_doc
from specjax.train.errors import RecipeError
from specjax.train.export import export_draft, init_draft
from tests.conftest import unreadable_modes
from tests.train.conftest import TINY_AUX


def test_exported_draft_is_readable_by_others(tmp_path, tiny_target, umask022):
    cfg = load_recipe(None, [f"draft.target_layer_ids={TINY_AUX}"])
    doc = draft_config_doc(cfg, tiny_target, aux_layer_ids=TINY_AUX,
                           draft_vocab_size=tiny_target.config.vocab_size)
    _, model = init_draft(doc, tiny_target.model, seed=0)
    out = export_draft(tmp_path / "run" / "last", model, doc)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert unreadable_modes(out) == []


def test_proposal_length_follows_ttt_steps_unless_set(tiny_target):
    """speculators writes EAGLE-3's speculative_tokens = ttt_steps; draft.speculative_tokens sets
    the length vLLM proposes for a draft trained with fewer TTT steps; other algorithms refuse it."""
    def length(*sets):
        cfg = load_recipe(None, [f"draft.target_layer_ids={TINY_AUX}", *sets])
        doc = draft_config_doc(cfg, tiny_target, aux_layer_ids=TINY_AUX, draft_vocab_size=tiny_target.config.vocab_size)
        return doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"]

    assert length() == 3 and length("loss.ttt_steps=2") == 2
    assert length("loss.ttt_steps=2", "draft.speculative_tokens=3") == 3
    with pytest.raises(RecipeError, match="draft.speculative_tokens is an eagle3 setting"):
        load_recipe(None, ["speculator_type=dflash", "draft.speculative_tokens=3"])
    # export-only: not part of a run's resume identity
    a, b = load_recipe(None, []), load_recipe(None, ["draft.speculative_tokens=5"])
    assert a.resume_key() == b.resume_key()
