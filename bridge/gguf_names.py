"""GGUF (llama.cpp) target LMs <-> HF names, as data.

* ``TENSOR_RULES``: regex over a GGUF tensor name -> HF tensor name template.
* ``CONFIG_KEYS``: ``{arch}.<key>`` GGUF metadata -> HF ``config.json`` key.
* ``unpermute_qk``: undo the row permutation llama.cpp's converter applies to the Q and K
  projections of ``llama``-architecture models (it reorders each head's rows from the HF
  rotate-half layout into interleaved pairs). Other architectures (``qwen3``, ...) are stored
  unpermuted.

Numpy only; used by ``specjax.models.gguf``.
"""

from __future__ import annotations

import re

import numpy as np

# (GGUF name regex, HF name template); first match wins.
TENSOR_RULES: tuple[tuple[str, str], ...] = (
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.(weight|bias)$", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"^blk\.(\d+)\.attn_q_norm\.weight$", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"^blk\.(\d+)\.attn_k_norm\.weight$", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.(weight|bias)$", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"^blk\.(\d+)\.ffn_up\.(weight|bias)$", r"model.layers.\1.mlp.up_proj.\2"),
    (r"^blk\.(\d+)\.ffn_down\.(weight|bias)$", r"model.layers.\1.mlp.down_proj.\2"),
)
_COMPILED = tuple((re.compile(p), t) for p, t in TENSOR_RULES)

# GGUF tensors that carry no HF weight and are safe to skip.
IGNORED: tuple[str, ...] = (r"^blk\.\d+\.attn_rot_embd$",)

# Tensors whose presence changes the math in a way the HF side expresses differently.
UNSUPPORTED: dict[str, str] = {
    r"^rope_freqs\.weight$": "per-dimension rope frequency factors (llama3 rope scaling stored as a tensor)",
}

# HF architecture name for each GGUF general.architecture we load.
ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MODEL_TYPES: dict[str, str] = {"llama": "llama", "qwen3": "qwen3"}

# Architectures whose Q/K rows llama.cpp permuted at conversion.
QK_PERMUTED: frozenset[str] = frozenset({"llama"})

# GGUF metadata key (after the "{arch}." prefix) -> HF config key.
CONFIG_KEYS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# tokenizer.ggml.* ids -> HF config keys
TOKEN_ID_KEYS: dict[str, str] = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF tensor name, or None if no rule matches."""
    for rx, tmpl in _COMPILED:
        m = rx.match(gguf_name)
        if m:
            return m.expand(tmpl)
    return None


def is_ignored(gguf_name: str) -> bool:
    return any(re.match(p, gguf_name) for p in IGNORED)


def unsupported_reason(gguf_name: str) -> str | None:
    for p, why in UNSUPPORTED.items():
        if re.match(p, gguf_name):
            return why
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's ``convert_hf_to_gguf`` does to an HF q/k weight ``[n_head*hd, in]`` (or bias)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: GGUF q/k rows back to the HF (rotate-half) layout.
    ``n_head`` is the attention head count for Q and the KV head count for K."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
