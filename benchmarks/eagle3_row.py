"""The SmolLM2-sized EAGLE-3 training row the train-step benchmarks share: the target's config and
a packed row of documents of varied length (random hidden states), collated by speculators
(``CollateFn`` + ``shift_batch``), so it needs the test venv."""

from __future__ import annotations

import numpy as np

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def make_batch(tokens: int, hidden: int, vocab: int, seed: int = 0):
    """Documents of varied length packed into ``tokens`` slots (speculators' collate + shift)."""
    import torch

    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    rng = np.random.default_rng(seed)
    samples, left = [], tokens + 4
    while left > 40:
        n = int(min(left, rng.integers(120, 400)))
        lm = np.ones(n, np.int64)
        lm[: n // 4] = 0
        samples.append({
            "hidden_states": torch.from_numpy(rng.standard_normal((n, 3 * hidden)).astype(np.float32)),
            "input_ids": torch.from_numpy(rng.integers(0, vocab, n).astype(np.int64)),
            "verifier_last_hidden_states": torch.from_numpy(rng.standard_normal((n, hidden)).astype(np.float32)),
            "loss_mask": torch.from_numpy(lm), "lengths": torch.tensor([n]), "position_ids": torch.arange(n)})
        left -= n
    b = CollateFn(tokens, hidden, num_target_layers=3, dtype=torch.bfloat16, preprocess=shift_batch)(samples)
    b.pop("error_records", None)
    return {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}


def smol_draft(draft_vocab: int):
    """A random SmolLM2-sized target (``SMOL``) and the speculators ``config.json`` of a one-layer
    EAGLE-3 draft for it (aux layers 2, 15, 27, k = 3, the TrainConfig norms), with a
    ``draft_vocab``-token vocabulary mapping from random counts (``None`` at the full vocabulary):
    ``(target, doc, t2d, d2t)``; ``init_draft(doc, target, seed=0, t2d=t2d, d2t=d2t)`` builds it."""
    from flax import nnx

    from specjax.models.config import TargetConfig
    from specjax.models.target import build_model
    from specjax.train.export import draft_layer_config, speculators_config
    from specjax.train.vocab import build_vocab_mapping

    V = SMOL["vocab_size"]
    tcfg = TargetConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMOL})
    target = build_model(tcfg, rngs=nnx.Rngs(0))
    layer = draft_layer_config(tcfg, draft_arch="llama", num_layers=1, sliding_window=2048)
    doc = speculators_config("eagle3", layer=layer, draft_vocab_size=draft_vocab, aux_layer_ids=[2, 15, 27],
                             speculative_tokens=3, verifier="bench", verifier_arch="LlamaForCausalLM",
                             norm_before_fc=True, norm_output=True, norm_before_residual=True)
    rng = np.random.default_rng(0)
    d2t, t2d = build_vocab_mapping({int(t): int(c) for t, c in enumerate(rng.integers(1, 1000, V))}, draft_vocab, V) \
        if draft_vocab != V else (None, None)
    return target, doc, t2d, d2t


def jax_batch(batch: dict):
    """``make_batch``'s torch row as the trainer's device batch, hidden states in bf16 (as cached)."""
    import jax.numpy as jnp

    from specjax.train.step import device_batch

    jb = device_batch({k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in batch.items()})
    return {k: (v.astype(jnp.bfloat16) if "hidden_states" in k else v) for k, v in jb.items()}
