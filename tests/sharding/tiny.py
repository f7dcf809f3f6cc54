"""Tiny checkpoints for the sharding tests, written without torch (fast to import in every
subprocess): an HF Llama/Qwen3 target directory and an EAGLE-3 speculators draft for it.

Sizes divide every test mesh (1..8 on each axis): hidden 32, 16 query heads and 8 KV heads of
head_dim 4, MLP 64, vocab 96, draft vocab 48. Weights are N(0, 1/fan_in) so logits are spread
(greedy ties would make "same tokens" flaky under reordered reductions).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

V, H, NH, NKV, HD, INTER, VD = 96, 32, 16, 8, 4, 64, 48


def target_config(family: str = "llama", layers: int = 2) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"], "model_type": family,
        "vocab_size": V, "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": layers,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0,
    }
    if family == "qwen3":
        cfg.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    return cfg


def _fill(tree: dict, rng: np.random.Generator) -> dict:
    from bridge.layout import iter_leaves, set_path

    out: dict = {}
    for path, leaf in iter_leaves(tree):
        shape = tuple(leaf.shape)
        name = str(path[-1])
        if name == "scale":
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "kernel":
            a = rng.standard_normal(shape) / np.sqrt(shape[0])
        elif name == "bias":
            a = 0.1 * rng.standard_normal(shape)
        else:  # embedding, mask_hidden, ...
            a = rng.standard_normal(shape)
        set_path(out, path, a.astype(np.float32))
    return out


def write_target(out: Path, family: str = "llama", *, seed: int = 0, layers: int = 2,
                 max_shard_bytes: int | None = 40_000) -> Path:
    """An HF target directory (config.json + safetensors, sharded with an index by default)."""
    from bridge.layout import flatten
    from bridge.safetensors_io import write_tensors_into
    from specjax.models.config import TargetConfig
    from specjax.models.params import tree_of
    from specjax.models.target import build_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = target_config(family, layers)
    model = build_model(TargetConfig.from_hf(cfg), abstract=True)
    flat = flatten(_fill(tree_of(model), np.random.default_rng(seed)))
    write_tensors_into(out, flat, {"format": "pt"}, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out)
    return out


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer over the tiny vocab: ``<pad> <s> </s> w3 ... w95`` (whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(out) / "tokenizer.json"))
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}))


def eagle3_config() -> dict:
    return {
        "architectures": ["Eagle3Speculator"], "draft_vocab_size": VD, "norm_before_residual": True,
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 3, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None}},
        "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "num_attention_heads": NH,
                                     "num_key_value_heads": NKV, "head_dim": HD, "intermediate_size": INTER,
                                     "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-6,
                                     "max_position_embeddings": 128, "rope_theta": 10000.0},
    }


def write_eagle3(out: Path, *, seed: int = 1) -> Path:
    """A complete EAGLE-3 speculators checkpoint (verifier-owned tensors included, pruned vocab)."""
    import bridge
    from specjax.models.drafts.load import build_draft
    from specjax.models.params import tree_of

    cfg = bridge.parse_config(eagle3_config())
    model = build_draft(cfg, abstract=True)
    rng = np.random.default_rng(seed)
    tree = _fill(tree_of(model), rng)
    sel = np.sort(rng.choice(V, size=VD, replace=False))
    t2d = np.zeros(V, bool)
    t2d[sel] = True
    tree["t2d"] = t2d
    tree["d2t"] = (sel - np.arange(VD)).astype(np.int64)
    bridge.save_checkpoint(out, cfg, tree=tree, progress=False)
    return Path(out)


def eagle3_inputs(batch: int = 4, T: int = 12, seed: int = 2) -> dict:
    """A packed training row for the EAGLE-3 forward: hidden_states [B, T, 3H], ids, doc ids, positions."""
    rng = np.random.default_rng(seed)
    return {
        "hidden_states": rng.standard_normal((batch, T, 3 * H)).astype(np.float32),
        "input_ids": rng.integers(3, V, (batch, T)).astype(np.int32),
        "document_ids": np.zeros((batch, T), np.int32),
        "position_ids": np.broadcast_to(np.arange(T, dtype=np.int32), (batch, T)).copy(),
    }


def draft_config(algo: str, **over) -> dict:
    """A tiny config of any algorithm (same layer sizes as the target), for abstract builds."""
    cfg = eagle3_config()
    cfg["speculators_model_type"] = algo
    cfg["speculators_config"]["algorithm"] = algo
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg.pop("norm_before_residual")
    if algo in ("eagle3", "peagle"):
        cfg.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2], norm_before_residual=True)
    if algo == "peagle":
        cfg.update(mask_token_id=V - 1)
    if algo in ("dflash", "dspark"):
        cfg.update(aux_hidden_state_layer_ids=[0, 1], mask_token_id=V - 1, block_size=4)
        cfg["transformer_layer_config"].update(num_hidden_layers=2, model_type="qwen3")
    if algo == "dspark":
        cfg.update(markov_rank=8)
    if algo == "mtp":
        cfg.pop("draft_vocab_size")
        cfg["transformer_layer_config"].update(model_type="qwen3")
    cfg.update(over)
    return cfg
