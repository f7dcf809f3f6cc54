"""Draft models (speculators 0.9.0 algorithms) as Flax nnx modules.

    from specjax.models.drafts import load_draft
    draft = load_draft("ckpt_dir", target)          # audit, verifier weights, params
    out = draft(**packed_row)                        # training forward, logits over the draft vocab
    prop = draft.propose(cache, ...)                 # inference: k draft tokens with its own KV cache

Names are imported lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Eagle3Draft": "eagle3", "PEagleDraft": "peagle", "DFlashDraft": "dflash", "DSparkDraft": "dspark",
    "MTPDraft": "mtp", "DraftCache": "common", "DecoderSpec": "spec", "trainable": "common",
    "frozen_params": "common", "greedy": "common",
    "load_draft": "load", "build_draft": "load", "module_from_flat": "load", "DraftAuditError": "load",
    "VerifierSource": "verifier_weights", "fill_verifier_weights": "verifier_weights",
    "MissingVerifierWeightsError": "verifier_weights",
    "draft_to_target": "vocab", "target_to_draft": "vocab", "to_target_logits": "vocab", "check_mapping": "vocab",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"specjax.models.drafts.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specjax.models.drafts' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
