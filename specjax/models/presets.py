"""Known target architectures by hub id: the public ``config.json`` of each (geometry, rope,
vocabulary, special ids), for work that needs a target's shapes but not its weights (``specjax
plan`` compiles a recipe's programs with abstract params). A local directory or a cached hub
snapshot always wins over these (:func:`target_config_for`)."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.models.config import TargetConfig
from specjax.models.errors import TargetNotFoundError

_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}

_QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

#: hub id -> config.json object
PRESETS: dict[str, dict] = {
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "meta-llama/Llama-3.1-8B": {**_LLAMA31_8B, "eos_token_id": 128001},
    "Qwen/Qwen3-8B": _QWEN3_8B,
}


def target_config_for(target: str, *, overrides: dict | None = None) -> TargetConfig:
    """The ``TargetConfig`` of ``target``: a ``config.json`` file, a directory holding one, a hub id
    in the local HF cache, or a hub id in :data:`PRESETS`. ``overrides`` replace config keys (a
    scaled-down copy: ``{"num_hidden_layers": 2}``). Raises :class:`TargetNotFoundError` listing
    what was tried."""
    doc, where = None, None
    p = Path(str(target)).expanduser()
    if p.is_file():
        doc, where = json.loads(p.read_text(encoding="utf-8")), str(p)
    elif (p / "config.json").is_file():
        doc, where = json.loads((p / "config.json").read_text(encoding="utf-8")), str(p / "config.json")
    else:
        from specjax.models.loading import hf_cache_snapshot  # heavy: flax and the model code (presets need neither)

        snap = hf_cache_snapshot(str(target)) if "/" in str(target) and not p.exists() else None
        if snap is not None and (snap / "config.json").is_file():
            doc, where = json.loads((snap / "config.json").read_text(encoding="utf-8")), str(snap / "config.json")
        elif str(target) in PRESETS:
            doc, where = dict(PRESETS[str(target)]), f"preset {target}"
    if doc is None:
        raise TargetNotFoundError(f"target {target!r}: not a config.json, a directory holding one, a hub id in the "
                                  f"local HF cache, or a known architecture preset ({sorted(PRESETS)})")
    if overrides:
        doc = {**doc, **overrides}
        if "num_hidden_layers" in overrides and "layer_types" in doc and doc["layer_types"]:
            doc["layer_types"] = list(doc["layer_types"])[: int(overrides["num_hidden_layers"])]
    return TargetConfig.from_hf(doc, where=where)
