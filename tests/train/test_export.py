"""Export of a trained draft: the checkpoint lands with ordinary modes (0755 dirs, 0644 files under
umask 022), so vLLM in a container or another user can read it."""

from __future__ import annotations

from specjax.train.config import load_recipe
from specjax.train.draft_doc import draft_config_doc
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
