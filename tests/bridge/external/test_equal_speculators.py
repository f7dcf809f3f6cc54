"""specjax's conversion equals speculators 0.9.0's ``convert_model`` on the same source:
identical tensors (names, dtypes, shapes, bytes) and config values apart from
``speculators_version``. MTP: speculators also writes an all-NaN ``verifier_lm_head.weight``
sentinel that specjax leaves out (checked to be all NaN)."""

from __future__ import annotations

import pytest
import torch

import bridge
from tests.bridge.external import sources
from tests.bridge.external.conftest import assert_same_checkpoint, read_config, spec_convert

LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_type": "llama3"}

# name -> (verifier family, builder kwargs, options: the same kwargs go to speculators' convert_model)
EAGLE = {
    "fp16-pruned-nbr": ("llama", {}, {"norm_before_residual": True}),
    "bf16-full-vocab-embed": ("llama", {"dtype": "bfloat16", "draft_vocab": None, "embed": True}, {}),
    "fp32-llama3-rope-flags-aux": ("llama", {"dtype": "float32", "rope_scaling": LLAMA3_ROPE},
                                   {"norm_output": True, "norm_before_residual": False,
                                    "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}),
    "pytorch-bin-qwen3-verifier": ("qwen3", {"fmt": "bin"}, {}),
    "fp32-weights-cast-to-bf16": ("llama", {"dtype": "bfloat16", "weights_dtype": "float32"}, {}),
    "no-torch_dtype-means-float32": ("llama", {"config_over": {"torch_dtype": None, "dtype": "bfloat16"},
                                               "weights_dtype": "bfloat16"}, {}),
    "linear-rope-head_dim-config-flag": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0},
                                                   "config_over": {"head_dim": 8, "max_position_embeddings": 999,
                                                                   "norm_output": True}},
                                         {"norm_before_residual": True}),
    "extra-source-tensor-dropped": ("llama", {"extra": {"embed_layernorm.weight": torch.ones(32, dtype=torch.float16)}},
                                    {}),
}

DFLASH = {
    "bf16-block-top": ("qwen3", {}, {}),
    "f32-block-nested-llama-verifier": ("llama", {"dtype": "float32", "block_in": "nested", "block_size": 6}, {}),
    "aux-override": ("qwen3", {"target_layer_ids": (1, 3)}, {"aux_hidden_state_layer_ids": [2, 4]}),
    "laguna-fused-qkv-final-layer-dropped": ("qwen3", {"fused_qkv": True, "target_layer_ids": (0, 2, 5)}, {}),
    "3-layers-fp16-sliding": ("qwen3", {"layers": 3, "dtype": "float16", "config_over": {
        "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}}, {}),
}

MTP = {
    "qwen3-f32": ("qwen3", {}, {}),
    "qwen3-bf16-sharded-steps2": ("qwen3", {"dtype": "bfloat16", "shards": 3}, {"num_speculative_steps": 2}),
    "qwen3-next-moe-bf16-sharded": ("qwen3_next", {"dtype": "bfloat16", "shards": 2, "body": False}, {}),
}


def _verifier(verifiers, next_verifier, fam):
    return next_verifier if fam == "qwen3_next" else verifiers[fam]


def build_case(kind, case, ext_root, verifiers, next_verifier):
    """(source dir, verifier dir, options)."""
    table, builder = {"eagle3": (EAGLE, sources.safeailab_eagle3), "dflash": (DFLASH, sources.zlab_dflash),
                      "mtp": (MTP, sources.native_mtp)}[kind]
    fam, kw, opts = table[case]
    v = _verifier(verifiers, next_verifier, fam)
    src = builder(ext_root / f"src-{kind}-{case}", v, **kw)
    return src, v, opts


@pytest.mark.parametrize("kind,case", [("eagle3", c) for c in EAGLE] + [("dflash", c) for c in DFLASH]
                         + [("mtp", c) for c in MTP])
def test_same_checkpoint_as_speculators(kind, case, ext_root, verifiers, next_verifier, tmp_path):
    src, v, opts = build_case(kind, case, ext_root, verifiers, next_verifier)
    theirs = spec_convert(src, v, kind, tmp_path / "speculators", **opts)
    res = bridge.convert_external(src, {"eagle3": "eagle3-safeailab", "dflash": "dflash-zlab"}.get(kind, kind),
                                  v, tmp_path / "specjax", **opts)
    assert res.report is not None and res.report.exit_code == 0, res.report.to_json()
    assert bridge.load_checkpoint(tmp_path / "specjax").algorithm == kind
    assert_same_checkpoint(tmp_path / "specjax", theirs,
                           nan_sentinels_in_theirs=("verifier_lm_head.weight",) if kind == "mtp" else ())


def test_case_details(ext_root, verifiers, next_verifier, tmp_path):
    """The cases above exercise what they claim (guards against a fixture silently degenerating)."""
    src, v, o = build_case("eagle3", "no-torch_dtype-means-float32", ext_root, verifiers, next_verifier)
    r = bridge.convert_external(src, "eagle3-safeailab", v, tmp_path / "a", **o)
    assert r.config["dtype"] == "float32" and any("torch_dtype" in n for n in r.notes)
    src, v, o = build_case("eagle3", "extra-source-tensor-dropped", ext_root, verifiers, next_verifier)
    r = bridge.convert_external(src, "eagle3-safeailab", v, tmp_path / "d", **o)
    assert any("embed_layernorm.weight" in n for n in r.notes) and "embed_layernorm.weight" not in r.tensors
    src, v, o = build_case("eagle3", "linear-rope-head_dim-config-flag", ext_root, verifiers, next_verifier)
    assert bridge.convert_external(src, "eagle3-safeailab", v, tmp_path / "e", **o).config["norm_output"] is True
    src, v, o = build_case("dflash", "laguna-fused-qkv-final-layer-dropped", ext_root, verifiers, next_verifier)
    r = bridge.convert_external(src, "dflash-zlab", v, tmp_path / "b", **o)
    assert r.options["aux_hidden_state_layer_ids"] == [1, 3]  # 5 + 1 == 6 layers: dropped
    assert r.tensors["fc.weight"][1] == (32, 64) and "layers.0.self_attn.q_proj.weight" in r.tensors
    assert any("sliced" in n for n in r.notes) and any("fused" in n for n in r.notes)
    src, v, o = build_case("mtp", "qwen3-next-moe-bf16-sharded", ext_root, verifiers, next_verifier)
    r = bridge.convert_external(src, "mtp", v, tmp_path / "c", **o)
    assert r.tensors["mtp_layers.0.mlp.experts.gate_up_proj"] == ("bfloat16", (4, 32, 32))
    assert r.tensors["mtp_layers.0.mlp.experts.down_proj"] == ("bfloat16", (4, 32, 16))
    assert read_config(tmp_path / "c")["transformer_layer_config"]["model_type"] == "qwen3_next"
