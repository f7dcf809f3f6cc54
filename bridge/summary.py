"""A checkpoint's summary from config.json and the safetensors header alone (no tensor
data read): what ``specjax inspect`` prints and notebooks display."""

from __future__ import annotations

from pathlib import Path

from bridge.safetensors_io import open_tensors
from bridge.schema import read_config

FLAG_KEYS = ("block_size", "sample_from_anchor", "mask_token_id", "norm_before_residual", "norm_before_fc",
             "fc_norm", "norm_output", "markov_rank")


def summarize(path: str | Path) -> dict:
    cfg = read_config(path)
    store = open_tensors(path)
    lc = cfg.layer
    out = {
        "path": str(path),
        "algorithm": cfg.speculators_model_type,
        "speculators_version": cfg.speculators_version,
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "verifier_architectures": cfg.speculators_config.verifier.architectures,
        "speculative_tokens": cfg.speculative_tokens,
        "aux_layer_ids": cfg.aux_layer_ids,
        "draft_layers": lc.num_hidden_layers,
        "decoder_family": lc.model_type,
        "hidden_size": lc.hidden_size,
        "num_attention_heads": lc.num_attention_heads,
        "num_key_value_heads": lc.kv_heads,
        "head_dim": lc.head_size,
        "verifier_vocab_size": lc.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "vocab_pruned": cfg.vocab_pruned,
        "files": [f.path for f in store.files],
        "tensors": {n: {"shape": list(i.shape), "dtype": i.dtype, "bytes": i.nbytes}
                    for n, i in sorted(store.infos().items())},
        "total_bytes": store.total_bytes,
        "flags": {k: getattr(cfg, k) for k in FLAG_KEYS if k in type(cfg).model_fields},
    }
    return out
