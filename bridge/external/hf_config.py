"""What transformers 5.19 makes of a decoder config dict, without transformers.

speculators stores ``transformer_layer_config`` by building a transformers config class
from a dict (``LlamaConfig(**kw)`` for SafeAILab EAGLE-3, ``AutoConfig.for_model(model_type,
**kw)`` for z-lab DFlash and native MTP) and serialising it nested inside the speculators
config (``to_diff_dict`` of the inner config, then ``recursive_diff_dict`` against the base
``PreTrainedConfig`` defaults). The converters must write the same dict, but importing
transformers imports torch, so the few steps that shape the output are reproduced here:

1. the class's dataclass fields take their value from the kwargs or their default;
2. the family ``__post_init__`` (head_dim / kv heads / sliding window / layer_types);
3. ``PreTrainedConfig.__post_init__``: ``torch_dtype`` -> ``dtype``; legacy ``rope_theta`` /
   ``rope_scaling`` folded into ``rope_parameters`` (``convert_rope_params_to_dict`` +
   ``standardize_rope_params``); generation parameters and loader-only keys dropped; every
   other key kept as an attribute;
4. serialisation: all class fields, extra attributes and ``model_type`` are kept; a base
   ``PreTrainedConfig`` key is kept only when it differs from the class default
   (``transformers_version`` and ``_name_or_path`` therefore never appear).

The tables below are transformers 5.19's for the families the three converters meet
(llama, qwen2, qwen3, qwen3_next, qwen3_5_text, qwen3_5_moe_text);
``tests/bridge/external/test_hf_config.py`` compares them and the whole function with the
installed transformers. Other families go through steps 3-4 only (plus ``use_cache``,
which ``save_pretrained`` strips and every decoder class restores as True): a config that
transformers itself saved holds every other field already, so the result is the same; a
hand-written config missing class fields would lack those defaults (``exact=False``,
reported to the user).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from bridge.config_doc import TRANSFORMERS_VERSION

HF_FORMAT_VERSION = TRANSFORMERS_VERSION  # the transformers version whose serialisation this reproduces

# PreTrainedConfig().to_dict() minus model_type / transformers_version (transformers 5.19)
BASE_DEFAULTS: dict[str, Any] = {
    "_name_or_path": "", "architectures": None, "chunk_size_feed_forward": 0, "dtype": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "output_attentions": False, "output_hidden_states": False,
    "problem_type": None, "return_dict": True,
}
# PreTrainedConfig's own dataclass fields and their defaults (before __post_init__)
BASE_FIELDS: dict[str, Any] = {
    "architectures": None, "output_hidden_states": False, "return_dict": True, "dtype": None,
    "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "id2label": None, "label2id": None,
    "problem_type": None,
}

# GenerationConfig._get_default_generation_params(): popped from the extra kwargs
GENERATION_PARAMS = frozenset({
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty", "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length", "min_length",
    "no_repeat_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "suppress_tokens", "target_lookbehind", "temperature", "top_k", "top_p", "typical_p",
    "use_cache",
})
# keys PreTrainedConfig.__post_init__ consumes without storing them
LOADER_KEYS = ("name_or_path", "_commit_hash", "attn_implementation", "experts_implementation",
               "_attn_implementation_internal", "_experts_implementation_internal", "num_labels",
               "transformers_version", "_name_or_path")
SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")


def _llama_post(c: dict, kw: dict) -> None:
    if c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]


def _qwen_post(c: dict, kw: dict) -> None:  # Qwen2Config and Qwen3Config share this __post_init__
    c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else None
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if c["layer_types"] is None:
        c["layer_types"] = ["sliding_attention" if c["sliding_window"] is not None and i >= c["max_window_layers"]
                            else "full_attention" for i in range(c["num_hidden_layers"])]


def _hybrid_post(c: dict, kw: dict) -> None:  # Qwen3-Next / Qwen3.5 text configs
    kw.setdefault("partial_rotary_factor", 0.25)
    if "mlp_only_layers" in c:
        c["mlp_only_layers"] = [] if c["mlp_only_layers"] is None else c["mlp_only_layers"]
    if c["layer_types"] is None:
        every = kw.pop("full_attention_interval", 4)
        c["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention"
                            for i in range(c["num_hidden_layers"])]


@dataclass(frozen=True)
class Family:
    fields: dict[str, Any]  # class dataclass fields (own, not the base ones) -> default
    post: Callable[[dict, dict], None]  # __post_init__ on (field values, remaining kwargs)
    default_theta: float = 10000.0


_QWEN_COMMON = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
    "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "layer_types": None, "attention_dropout": 0.0, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}

_HYBRID = {
    "vocab_size": 248320, "hidden_size": 4096, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
    "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "layer_types": None, "pad_token_id": None,
    "bos_token_id": None, "eos_token_id": None,
}

FAMILIES: dict[str, Family] = {
    "llama": Family({
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
    }, _llama_post),
    "qwen3": Family({**_QWEN_COMMON, "head_dim": 128, "attention_bias": False}, _qwen_post),
    "qwen2": Family(dict(_QWEN_COMMON), _qwen_post),
    "qwen3_next": Family({**_HYBRID, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                          "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                          "decoder_sparse_step": 1, "moe_intermediate_size": 512,
                          "shared_expert_intermediate_size": 512,
                          "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True,
                          "output_router_logits": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None},
                         _hybrid_post),
    "qwen3_5_text": Family({**_HYBRID, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
                            "num_key_value_heads": 4}, _hybrid_post),
    "qwen3_5_moe_text": Family({**_HYBRID, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                                "num_key_value_heads": 2, "moe_intermediate_size": 512,
                                "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
                                "output_router_logits": False, "router_aux_loss_coef": 0.001}, _hybrid_post),
}


def _nested_keys(rope: dict, layer_types) -> list[str]:
    labels = layer_types or ()
    return [k for k in rope if k in labels]


def _standardize_rope(c: dict, kw: dict, default_theta: float, layer_types) -> None:
    """convert_rope_params_to_dict + standardize_rope_params (flat and per-layer-type forms)."""
    scaling = kw.pop("rope_scaling", None)
    rope = scaling or c.get("rope_parameters")
    rope = copy.deepcopy(rope) if rope is not None else {}
    theta = kw.pop("rope_theta", default_theta)
    prf = kw.get("partial_rotary_factor")
    nested = _nested_keys(rope, layer_types)
    for params in ([rope[k] for k in nested] or [rope]):
        if params is None:
            continue
        params.setdefault("rope_theta", theta)
        if prf is not None:
            params.setdefault("partial_rotary_factor", prf)
    if not rope:
        c["rope_parameters"] = rope
        return
    for params in ([rope[k] for k in nested] or [rope]):
        if params is None:
            continue
        params.setdefault("rope_type", params.get("type", "default"))
        if prf is not None:
            params.setdefault("partial_rotary_factor", prf)
        if params["rope_type"] in SCALED_ROPE_TYPES:
            params.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
    c["rope_parameters"] = rope


def _norm_labels(d):
    return {str(k): v for k, v in d.items()} if isinstance(d, dict) else d


def layer_config_dict(model_type: str, kwargs: dict) -> tuple[dict, bool]:
    """The ``transformer_layer_config`` dict speculators 0.9.0 writes (under transformers
    5.19) for ``<Config of model_type>(**kwargs)``. Returns ``(dict, exact)``; ``exact`` is
    False for a family outside the tables (see the module docstring)."""
    fam = FAMILIES.get(model_type)
    kw = copy.deepcopy(dict(kwargs))
    kw.pop("model_type", None)
    c: dict[str, Any] = {}
    # 1. dataclass fields (the base ones first, as the generated __init__ does)
    for name, default in BASE_FIELDS.items():
        c[name] = kw.pop(name, default)
    if fam is not None:
        for name, default in fam.fields.items():
            c[name] = kw.pop(name, copy.deepcopy(default))
        # 2. family __post_init__
        fam.post(c, kw)
    else:
        c["rope_parameters"] = kw.pop("rope_parameters", None)
        # save_pretrained strips use_cache (a generation parameter) from config.json, but every decoder
        # config class has the field with default True, so transformers writes it back
        c["use_cache"] = kw.pop("use_cache", True)
    # 3. PreTrainedConfig.__post_init__
    torch_dtype = kw.pop("torch_dtype", None)
    if torch_dtype is not None and c["dtype"] is None:
        c["dtype"] = torch_dtype
    if c["id2label"] is None:
        n = kw.get("num_labels") or 2
        c["id2label"] = {str(i): f"LABEL_{i}" for i in range(n)}
        c["label2id"] = c["label2id"] if c["label2id"] is not None else {f"LABEL_{i}": i for i in range(n)}
    if fam is not None or "rope_parameters" in kwargs or "rope_theta" in kwargs or "rope_scaling" in kwargs:
        _standardize_rope(c, kw, fam.default_theta if fam else 10000.0, c.get("layer_types"))
    if c.get("rope_parameters") is None and fam is None:
        c.pop("rope_parameters", None)
    for k in GENERATION_PARAMS:
        if fam is None or k not in fam.fields:
            kw.pop(k, None)
    out_attn = kw.pop("output_attentions", False)
    for k in LOADER_KEYS:
        kw.pop(k, None)
    c.update(kw)  # 3b. every other key becomes an attribute
    c["output_attentions"] = out_attn
    # 4. serialisation: base keys only when they differ from the class default
    out = {}
    for k, v in c.items():  # (no family in the tables overrides a base default)
        if k in BASE_DEFAULTS:
            if k == "id2label":
                v = _norm_labels(v)
            if v == BASE_DEFAULTS[k]:
                continue
        out[k] = v
    out["model_type"] = model_type  # the class's model_type, whatever the kwargs said
    return out, fam is not None
