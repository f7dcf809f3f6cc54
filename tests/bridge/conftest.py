"""Checkpoints written by speculators 0.9.0 itself, one per algorithm/flag/dtype case."""

from pathlib import Path

import pytest

# name -> (algorithm, verifier family, build kwargs)
CASES = {
    "eagle3-llama-f32": ("eagle3", "llama", {}),
    "eagle3-qwen3-bf16-pruned": ("eagle3", "qwen3", {"dtype": "bf16", "draft_vocab": 40}),
    "eagle3-llama-fc-norm-output": ("eagle3", "llama", {"norm_before_fc": True, "norm_output": True}),
    "eagle3-llama-fcnorm": ("eagle3", "llama", {"fc_norm": True, "norm_before_residual": False}),
    "eagle3-llama-2layers-swa": ("eagle3", "llama", {"num_layers": 2, "draft_vocab": 48,
                                                     "layer_over": {"layer_types": ["sliding_attention", "full_attention"],
                                                                    "sliding_window": 8}}),
    "peagle-llama-f32": ("peagle", "llama", {}),
    "peagle-qwen3-bf16-pruned": ("peagle", "qwen3", {"dtype": "bf16", "draft_vocab": 40}),
    "dflash-qwen3-f32-pruned": ("dflash", "qwen3", {"draft_vocab": 40}),
    "dflash-llama-bf16": ("dflash", "llama", {"dtype": "bf16"}),
    "dspark-qwen3-f32": ("dspark", "qwen3", {}),
    "dspark-qwen3-gated-pruned": ("dspark", "qwen3", {"markov_head_type": "gated", "draft_vocab": 40}),
    "dspark-qwen3-rnn-bf16": ("dspark", "qwen3", {"markov_head_type": "rnn", "dtype": "bf16"}),
    "mtp-qwen3-f32": ("mtp", "qwen3", {}),
    "mtp-qwen3-bf16": ("mtp", "qwen3", {"dtype": "bf16"}),
}


@pytest.fixture(scope="session")
def spec_ckpts(spec_root, verifiers) -> dict[str, Path]:
    import torch

    from tests.refs.speculators_ckpts import build

    out = {}
    for name, (algo, fam, kw) in CASES.items():
        kw = dict(kw)
        if kw.get("dtype") == "bf16":
            kw["dtype"] = torch.bfloat16
        out[name] = build(algo, spec_root / name, verifiers[fam], **kw)
    return out


@pytest.fixture(params=sorted(CASES))
def case(request, spec_ckpts):
    return request.param, spec_ckpts[request.param]
