"""Training drafts with Optax from cached target hidden states (speculators 0.9.0 semantics).

Public API (imported lazily)::

    from specjax.train import load_recipe, train, prepare_data, DataSpec
    cfg = load_recipe("configs/eagle3-smollm2.yaml", ["trainer.epochs=1"])
    summary = train(cfg)                      # -> runs/.../last (a speculators checkpoint)

Modules: ``config`` (typed YAML recipes), ``algorithms/`` (one training adapter per draft
algorithm), ``pipeline`` / ``prompts`` / ``prompt_datasets`` / ``render`` / ``selfdistill`` (data),
``online`` (the target inside the train step: ``data.online``), ``dataset`` / ``hidden_states``
(speculators' on-disk layout), ``vocab`` (t2d/d2t), ``losses`` / ``objectives`` (the algorithms'
objectives), ``optim`` (AdamW, Muon, schedules), ``packing`` / ``feed`` (multipack, collate, the
step schedule), ``fast_eagle3`` (block-structured TTT attention), ``step`` (the jitted steps),
``trainer`` / ``run_files`` (the run, its directory, Orbax, resume), ``export`` (bridge
checkpoints), ``evaluate`` (offline greedy acceptance).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_recipe": "config", "TrainConfig": "config",
    "train": "trainer", "Run": "trainer", "TRACE_COUNT": "step", "make_step_fns": "step",
    "prepare_data": "pipeline", "DataSpec": "pipeline", "load_data_dir": "pipeline",
    "extract_hidden_states": "hidden_states", "read_hs": "hidden_states", "write_hs": "hidden_states",
    "build_vocab_mapping": "vocab", "token_frequencies": "vocab",
    "eagle3_objective": "objectives", "dflash_objective": "objectives", "select_anchors": "objectives",
    "build_optimizer": "optim", "export_draft": "export", "evaluate_acceptance": "evaluate",
    "builtin_prompts": "prompts", "load_prompt_file": "prompts",
    "generate_with_hidden_states": "selfdistill", "ttt_forward": "fast_eagle3",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"specjax.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specjax.train' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
