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
