"""Tiny checkpoints written by speculators 0.9.0 itself (PyTorch, CPU), for tests.

Every builder goes through speculators' own constructors (`from_training_args` where
they exist, the config classes otherwise) and `save_pretrained`, so the files on disk
are exactly what the reference writes. Weights are random (seeded) except the
verifier-owned tensors, which speculators fills from the tiny verifier.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 96
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
INTER = 64
LAYERS = 6  # verifier layers: default aux ids [2, 3, 3]... so tests pass explicit ids
AUX = [1, 3, 4]


def verifier_config(family: str = "llama", **over):
    from transformers import LlamaConfig, Qwen3Config

    kw = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(over)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return cls(**kw)


def make_verifier(out: Path, family: str = "llama", seed: int = 0, **over) -> Path:
    """A tiny random HF verifier saved with transformers (safetensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = verifier_config(family, **over)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # make norms non-trivial so a missing norm shows up
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def vocab_mapping(draft_vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sel = np.sort(rng.choice(VOCAB, size=draft_vocab, replace=False))
    t2d = np.zeros(VOCAB, bool)
    t2d[sel] = True
    d2t = (sel - np.arange(draft_vocab)).astype(np.int64)
    return torch.from_numpy(t2d), torch.from_numpy(d2t)


def _randomize(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.split(".")[0] in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
                continue
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def build(algo: str, out: Path, verifier: Path, *, dtype=torch.float32, draft_vocab: int | None = None,
          seed: int = 1, aux=AUX, num_layers: int | None = None, layer_over: dict | None = None, **kw) -> Path:
    """Build and save a speculators draft for ``verifier``. kw go to from_training_args.

    ``num_layers`` sets the draft depth (default 1 for eagle3/peagle, 2 for dflash/dspark),
    ``layer_over`` overrides transformer_layer_config fields (e.g. layer_types,
    sliding_window), as speculators' training CLI does when it derives the draft config."""
    from transformers import AutoConfig

    import speculators.models  # noqa: F401  (registers the algorithms)
    from speculators.model import SpeculatorModel

    vcfg = AutoConfig.from_pretrained(verifier)
    vcfg._attn_implementation = "sdpa"
    if algo != "mtp":
        vcfg.num_hidden_layers = num_layers or (2 if algo in ("dflash", "dspark") else 1)
        if hasattr(vcfg, "layer_types") and vcfg.layer_types is not None:
            vcfg.layer_types = vcfg.layer_types[: vcfg.num_hidden_layers]
    for k, v in (layer_over or {}).items():
        setattr(vcfg, k, v)
    dv = draft_vocab or VOCAB
    t2d, d2t = vocab_mapping(dv, seed) if dv != VOCAB else (None, None)
    cls = SpeculatorModel.registry[algo]
    args = dict(verifier_name_or_path=str(verifier), draft_vocab_size=dv, target_layer_ids=list(aux),
                draft_attn_impl="sdpa")
    if algo == "eagle3":
        args.update(norm_before_residual=True, ttt_steps=3)
    if algo == "peagle":
        args.update(mask_token_id=VOCAB - 1, num_depths=4)
    if algo in ("dflash", "dspark"):
        args.update(mask_token_id=VOCAB - 1, block_size=4)
    if algo == "dspark":
        args.update(markov_rank=8)
    args.update(kw)
    if algo == "mtp":
        model = _build_mtp(vcfg, verifier, kw.get("num_speculative_steps", 3))
    else:
        torch.manual_seed(seed)
        model = cls.from_training_args(vcfg, t2d=t2d, d2t=d2t, **args)
    _randomize(model, seed)
    model = model.to(dtype)
    model.save_pretrained(out)
    return out


def _build_mtp(vcfg, verifier: Path, steps: int):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cfg = MTPSpeculatorConfig(
        transformer_layer_config=vcfg,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(verifier)),
        ),
    )
    model = MTPDraftModel(cfg)
    model.load_verifier_weights()
    return model


if __name__ == "__main__":
    import sys
    import tempfile

    from safetensors import safe_open

    root = Path(tempfile.mkdtemp())
    for fam in ("llama", "qwen3"):
        make_verifier(root / f"v-{fam}", fam)
    for algo, fam, extra in [("eagle3", "llama", {}), ("eagle3", "qwen3", {"draft_vocab": 40}),
                             ("peagle", "llama", {}), ("dflash", "qwen3", {"draft_vocab": 40}),
                             ("dspark", "qwen3", {}), ("mtp", "qwen3", {})]:
        out = root / f"{algo}-{fam}"
        build(algo, out, root / f"v-{fam}", **extra)
        print("=====", algo, fam, extra)
        with safe_open(out / "model.safetensors", "np") as f:
            for k in sorted(f.keys()):
                t = f.get_slice(k)
                print("  ", k, t.get_shape(), t.get_dtype())
        cfg = json.loads((out / "config.json").read_text())
        print(json.dumps(cfg, sort_keys=True)[:3000])
