"""bridge.external.hf_config reproduces what transformers (installed: 5.19) writes for a
nested ``transformer_layer_config``, without importing transformers at run time."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from bridge.external import hf_config

ZLAB = {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "max_window_layers": 5,
        "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "transformers_version": "4.57.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936}
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4}

CASES = {
    "zlab-qwen3-8b-dflash": ("qwen3", ZLAB),
    "qwen3-defaults-head_dim-torch_dtype": ("qwen3", {k: v for k, v in ZLAB.items()
                                                      if k not in ("head_dim", "layer_types", "dtype")}
                                            | {"torch_dtype": "float16"}),
    "qwen3-sliding-yarn-type-key": ("qwen3", ZLAB | {"use_sliding_window": True, "sliding_window": 2048,
                                                     "layer_types": None, "max_window_layers": 2, "rope_scaling": {
                                                         "type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}}),
    "qwen3-nested-rope": ("qwen3", TINY | {"rope_parameters": {"full_attention": {"rope_theta": 1e4, "rope_type":
                                                                                  "default"}},
                                           "layer_types": ["full_attention"] * 4}),
    "llama-eagle3-llama3-rope": ("llama", {"vocab_size": 96, "hidden_size": 32, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "dtype": "float16", "max_position_embeddings": 99,
                                           "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0}}),
    "llama-extras-generation-keys": ("llama", {"vocab_size": 96, "hidden_size": 32, "num_attention_heads": 4,
                                               "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                               "sliding_window": 8, "pad_token_id": 0, "max_length": 20,
                                               "do_sample": True, "foo": [1, 2], "_name_or_path": "x",
                                               "partial_rotary_factor": 0.5, "rope_theta": 1e6}),
    "qwen2-base-keys": ("qwen2", TINY | {"torch_dtype": "bfloat16", "output_attentions": True,
                                         "return_dict": False, "id2label": {"0": "a"}}),
    "qwen3_next-minimal": ("qwen3_next", TINY | {"num_experts": 4, "full_attention_interval": 2}),
    "qwen3_5_text-mrope": ("qwen3_5_text", TINY | {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        "partial_rotary_factor": 0.25}, "dtype": "bfloat16", "architectures": ["Qwen3_5ForCausalLM"]}),
    "qwen3_5_moe_text-layers": ("qwen3_5_moe_text", TINY | {"layer_types": ["linear_attention", "full_attention"] * 2,
                                                           "num_experts": 8, "use_cache": False}),
}


def transformers_reference(model_type: str, kw: dict) -> dict:
    """What speculators writes: ``Config(**kw)`` of the model type, ``to_diff_dict`` and then the
    outer ``recursive_diff_dict`` against the base defaults, with model_type re-added."""
    from transformers import AutoConfig, PreTrainedConfig
    from transformers.configuration_utils import recursive_diff_dict

    c = AutoConfig.for_model(model_type).__class__(**copy.deepcopy(kw))
    d = recursive_diff_dict(c.to_diff_dict(), PreTrainedConfig().to_dict(), config_obj=c)
    d["model_type"] = model_type
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("case", list(CASES))
def test_layer_config_dict_matches_transformers(case):
    mt, kw = CASES[case]
    ours, exact = hf_config.layer_config_dict(mt, kw)
    assert exact
    assert json.loads(json.dumps(ours)) == transformers_reference(mt, kw)


def test_tables_are_the_installed_transformers():
    from transformers import AutoConfig, GenerationConfig, PreTrainedConfig

    base = {f.name: f.default for f in dataclasses.fields(PreTrainedConfig) if f.name != "transformers_version"}
    assert base == hf_config.BASE_FIELDS
    bd = json.loads(json.dumps(PreTrainedConfig().to_dict()))
    bd.pop("transformers_version"), bd.pop("model_type")
    assert bd == hf_config.BASE_DEFAULTS
    assert set(GenerationConfig._get_default_generation_params()) == hf_config.GENERATION_PARAMS
    import transformers

    assert transformers.__version__ == hf_config.HF_FORMAT_VERSION
    for mt, fam in hf_config.FAMILIES.items():
        cls = AutoConfig.for_model(mt).__class__
        own = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
               for f in dataclasses.fields(cls) if f.name not in base and f.name != "transformers_version"}
        assert own == fam.fields, (mt, {k: (own.get(k), fam.fields.get(k)) for k in set(own) | set(fam.fields)
                                        if own.get(k) != fam.fields.get(k)})
        assert cls.default_theta == fam.default_theta


def test_unknown_family_passes_saved_config_through():
    """A family outside the tables: a transformers-saved config comes back as transformers would
    write it, except class fields the saved file lacked (reported as not exact)."""
    from transformers import AutoConfig

    c = AutoConfig.for_model("qwen3_moe", **TINY, num_experts=4, dtype="bfloat16")
    saved = json.loads(c.to_json_string(use_diff=True))
    ours, exact = hf_config.layer_config_dict("qwen3_moe", saved)
    assert not exact
    assert ours == transformers_reference("qwen3_moe", saved)
