"""Flax nnx models: shared blocks (:mod:`layers`, :mod:`rope`), target LMs (:mod:`target`),
loaders (:mod:`hf`, :mod:`gguf`, :mod:`loading`) and the GGUF tokenizer (:mod:`tokenizer`).

Names below are imported lazily so ``import specjax.models`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RMSNorm": "layers", "Attention": "layers", "MLP": "layers", "DecoderLayer": "layers", "attend": "layers",
    "causal_mask": "layers",
    "RopeConfig": "rope", "rope_cos_sin": "rope", "apply_rope": "rope",
    "TargetConfig": "config",
    "CausalLM": "target", "LlamaForCausalLM": "target", "Qwen3ForCausalLM": "target", "KVCache": "target",
    "TargetOutput": "target", "build_model": "target",
    "load_tree": "params",
    "load_hf_dir": "hf",
    "load_target": "loading", "LoadedTarget": "loading",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"specjax.models.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specjax.models' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
