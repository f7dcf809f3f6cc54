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

# GGUF tensors that carry no HF weight and are safe to skip. ``rope_freqs.weight`` (llama3 rope
# scaling stored as per-dimension factors) is turned back into HF ``rope_parameters`` by
# :func:`llama3_rope_from_factors` when the config is read, and refused there if it cannot be.
IGNORED: tuple[str, ...] = (r"^blk\.\d+\.attn_rot_embd$", r"^rope_freqs\.weight$")
ROPE_FREQS = "rope_freqs.weight"

# Tensors whose presence changes the math in a way the HF side expresses differently.
UNSUPPORTED: dict[str, str] = {}

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


def llama3_rope_factors(theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int) -> np.ndarray:
    """The per-dimension divisors llama.cpp's converter stores as ``rope_freqs.weight`` for HF
    ``rope_type: llama3`` (HF's ``inv_freq_llama = inv_freq / factors``)."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    lo_w = original_max_position_embeddings / low_freq_factor
    hi_w = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < hi_w, 1.0, np.where(wavelen > lo_w, factor, mid))


def llama3_rope_from_factors(factors: np.ndarray, theta: float, dim: int, *, factor: float | None = None,
                             original: int | None = None) -> dict | None:
    """HF ``rope_parameters`` (llama3) whose factors equal ``factors`` (float32 precision), trying the
    metadata hints and the values published llama3 checkpoints use; None when nothing matches."""
    f = np.asarray(factors, np.float64).reshape(-1)
    if f.shape[0] != dim // 2:
        return None
    factors_c = [x for x in (factor, float(f.max()), 8.0, 16.0, 32.0, 4.0, 2.0, 64.0) if x]
    origs = [x for x in (original, 8192, 4096, 2048, 16384, 32768, 65536, 131072) if x]
    for fa in dict.fromkeys(factors_c):
        for orig in dict.fromkeys(int(o) for o in origs):
            for lo in (1.0, 0.5, 2.0):
                for hi in (4.0, 2.0, 8.0, 1.5):
                    if hi <= lo:
                        continue
                    want = llama3_rope_factors(theta, dim, fa, lo, hi, orig)
                    if np.allclose(f, want, rtol=1e-5, atol=1e-6):
                        return {"rope_type": "llama3", "factor": fa, "low_freq_factor": lo, "high_freq_factor": hi,
                                "original_max_position_embeddings": orig, "rope_theta": theta}
    return None
