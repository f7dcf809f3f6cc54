"""The one rope normaliser (bridge.hf_values.rope_parameters): both HF forms give one object, and
every reader (the models' RopeConfig, the training export, the SafeAILab converter) goes through it."""

import ast
from pathlib import Path

from bridge.hf_values import rope_parameters

ROOT = Path(__file__).resolve().parents[2]


def test_legacy_and_transformers5_forms_agree():
    legacy = {"rope_theta": 500000, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}}
    new = {"rope_parameters": {"rope_theta": 500000, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    assert rope_parameters(legacy) == rope_parameters(new) == new["rope_parameters"]
    assert rope_parameters(legacy, theta_type=float)["rope_theta"] == 500000.0
    assert rope_parameters({}) == {"rope_theta": 10000.0, "rope_type": "default"}
    # an empty object is no setting: the legacy keys count
    assert rope_parameters({"rope_parameters": {}, "rope_theta": 5.0}) == {"rope_theta": 5.0, "rope_type": "default"}


def test_nested_and_input_untouched():
    nested = {"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                  "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}
    out = rope_parameters(nested)
    assert out == nested["rope_parameters"] and out is not nested["rope_parameters"]


def test_no_other_module_reads_rope_scaling():
    """Outside the normaliser, only the validator (hf_values), transformers' serialisation
    reproduction (external/hf_config), the presets (HF configs as published) and the MTP layer
    writer (drops the legacy key once normalised) name ``rope_scaling``."""
    allowed = {"bridge/hf_values.py", "bridge/external/hf_config.py", "specjax/models/presets.py",
               "specjax/train/export.py"}
    found = []
    for p in sorted([*ROOT.glob("specjax/**/*.py"), *ROOT.glob("bridge/**/*.py")]):
        rel = p.relative_to(ROOT).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and node.value == "rope_scaling":
                found.append(f"{rel}:{node.lineno}")
    assert not found, found
