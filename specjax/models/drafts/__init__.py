"""Draft models (speculators 0.9.0 algorithms) as Flax nnx modules.

    draft = load_draft("ckpt_dir", target)           # audit, verifier weights, params
    out = draft(**packed_row)                         # training forward, logits over the draft vocab

    # decode loop (every algorithm):
    taps = draft.tap_ids(target.config.num_hidden_layers)
    t = target(ids, tap_ids=taps, cache=tcache)
    cache = draft.init_cache(batch, max_len)
    prop = draft.speculate(cache, draft.aux_from_taps(t.aux_hidden_states), next_tokens, positions,
                           n_valid=n_valid)        # prop.tokens [B, k] target ids, prop.logits [B, k, Vd]
    cache = prop.cache                                # no rollback needed: only context rows commit

Names are imported lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Eagle3Draft": "eagle3", "PEagleDraft": "peagle", "DFlashDraft": "dflash", "DSparkDraft": "dspark",
    "MTPDraft": "mtp", "DraftCache": "common", "DecoderSpec": "spec", "trainable": "common",
    "frozen_params": "common", "greedy": "common",
    "draft_class": "registry", "DRAFTS": "registry",
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
