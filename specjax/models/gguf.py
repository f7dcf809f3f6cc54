"""Load a GGUF (llama.cpp) target: config from the metadata, tensors dequantised in numpy
(``gguf.quants``), names mapped through ``bridge.gguf_names``, llama.cpp's Q/K row permutation
undone, then the usual ``bridge.layout`` table into the nnx module. No torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from bridge import gguf_names, layout
from bridge.errors import CheckpointNotFoundError
from specjax.models.config import TargetConfig
from specjax.models.errors import GGUFError, UnsupportedGGUFError

# Tensor types with a numpy dequantiser in the gguf package that we accept.
SUPPORTED_QTYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


class GGUFFile:
    """A parsed GGUF file: ``arch``, scalar/str ``metadata`` and the reader's tensors."""

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = str(path)
        p = Path(path)
        if not p.is_file():
            raise CheckpointNotFoundError("GGUF file does not exist", path=self.path)
        try:
            self.reader = GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError/struct errors on non-GGUF input
            raise GGUFError(f"not a readable GGUF file ({type(e).__name__}: {e})", path=self.path) from e
        self._meta: dict[str, Any] = {}
        arch = self.get("general.architecture")
        if arch is None:
            raise GGUFError("metadata lacks 'general.architecture'", path=self.path, key="general.architecture")
        self.arch = str(arch)

    def get(self, key: str, default=None):
        if key in self._meta:
            return self._meta[key]
        f = self.reader.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        self._meta[key] = v
        return v

    def keys(self):
        return list(self.reader.fields)

    @property
    def tensors(self):
        return self.reader.tensors

    def check_supported(self) -> None:
        if self.arch not in gguf_names.ARCHITECTURES:
            raise UnsupportedGGUFError(
                f"architecture {self.arch!r} is not supported; expected one of {sorted(gguf_names.ARCHITECTURES)}",
                path=self.path, key="general.architecture")
        for t in self.tensors:
            q = t.tensor_type.name
            if q not in SUPPORTED_QTYPES:
                raise UnsupportedGGUFError(
                    f"tensor {t.name!r} has quantisation type {q}, which cannot be dequantised; expected one of "
                    f"{list(SUPPORTED_QTYPES)}", path=self.path, key=t.name)
            why = gguf_names.unsupported_reason(t.name)
            if why:
                raise UnsupportedGGUFError(f"tensor {t.name!r} ({why}) is not supported", path=self.path, key=t.name)


def _rope_from_freqs(gf: GGUFFile, cfg: dict, head_dim: int) -> dict:
    """llama3 rope scaling that llama.cpp stored as ``rope_freqs.weight``, back as HF rope_parameters."""
    from gguf.quants import dequantize

    t = next(t for t in gf.tensors if t.name == gguf_names.ROPE_FREQS)
    f = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
    theta = float(cfg.get("rope_theta", 10000.0))
    if f.shape[0] != head_dim // 2:
        raise UnsupportedGGUFError(f"tensor {gguf_names.ROPE_FREQS!r} has {f.shape[0]} factors; expected head_dim/2 = "
                                   f"{head_dim // 2}", path=gf.path, key=gguf_names.ROPE_FREQS)
    if np.all(f == 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    rp = gguf_names.llama3_rope_from_factors(f, theta, head_dim, factor=gf.get(f"{gf.arch}.rope.scaling.factor"),
                                             original=gf.get(f"{gf.arch}.rope.scaling.original_context_length"))
    if rp is None:
        raise UnsupportedGGUFError(
            f"tensor {gguf_names.ROPE_FREQS!r} holds per-dimension rope factors that match no llama3 rope scaling "
            f"(factor, low/high_freq_factor, original context tried); min {f.min():.4g}, max {f.max():.4g}",
            path=gf.path, key=gguf_names.ROPE_FREQS)
    return rp


def gguf_config(gf: GGUFFile) -> dict:
    """An HF-style ``config.json`` dict from the GGUF metadata."""
    gf.check_supported()
    arch = gf.arch
    cfg: dict[str, Any] = {"architectures": [gguf_names.ARCHITECTURES[arch]], "model_type": gguf_names.MODEL_TYPES[arch]}
    for gkey, hkey in gguf_names.CONFIG_KEYS.items():
        v = gf.get(f"{arch}.{gkey}")
        if v is not None:
            cfg[hkey] = v
    for need in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if need not in cfg:
            gk = next(k for k, h in gguf_names.CONFIG_KEYS.items() if h == need)
            raise GGUFError(f"metadata lacks {arch}.{gk}", path=gf.path, key=f"{arch}.{gk}")
    if "vocab_size" not in cfg:
        toks = gf.reader.fields.get("tokenizer.ggml.tokens")
        if toks is None:
            raise GGUFError(f"metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens", path=gf.path,
                            key=f"{arch}.vocab_size")
        cfg["vocab_size"] = len(toks.data)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    st = gf.get(f"{arch}.rope.scaling.type")
    if st and st != "none":
        factor = gf.get(f"{arch}.rope.scaling.factor")
        rp: dict[str, Any] = {"rope_type": st, "factor": factor, "rope_theta": cfg.get("rope_theta", 10000.0)}
        orig = gf.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            rp["original_max_position_embeddings"] = orig
        cfg["rope_parameters"] = rp
    rot = gf.get(f"{arch}.rope.dimension_count")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if rot is not None and int(rot) != int(head_dim):
        raise UnsupportedGGUFError(f"rope dimension_count {rot} != head_dim {head_dim} (partial rotary) is not supported",
                                   path=gf.path, key=f"{arch}.rope.dimension_count")
    names = {t.name for t in gf.tensors}
    if gguf_names.ROPE_FREQS in names:
        cfg["rope_parameters"] = _rope_from_freqs(gf, cfg, int(head_dim))
    cfg["tie_word_embeddings"] = "output.weight" not in names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    for gk, hk in gguf_names.TOKEN_ID_KEYS.items():
        v = gf.get(gk)
        if v is not None:
            cfg[hk] = int(v)
    cfg["torch_dtype"] = "float32"
    return cfg


def gguf_tensors(gf: GGUFFile, config: TargetConfig, *, progress: bool = True) -> dict[str, np.ndarray]:
    """Dequantised float32 tensors under HF names ([out, in] PyTorch layout)."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    gf.check_supported()
    out: dict[str, np.ndarray] = {}
    permute = gf.arch in gguf_names.QK_PERMUTED
    for t in tqdm(gf.tensors, desc=f"dequantising {Path(gf.path).name}", unit="tensor", disable=not progress,
                  leave=False):
        name = gguf_names.hf_name(t.name)
        if name is None:
            if gguf_names.is_ignored(t.name):
                continue
            raise UnsupportedGGUFError(f"tensor {t.name!r} has no HF equivalent in the {gf.arch} name table",
                                       path=gf.path, key=t.name)
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if a.size != int(np.prod(shape)):
            raise GGUFError(f"tensor {t.name!r}: dequantised {a.size} values, header shape {list(shape)}",
                            path=gf.path, key=t.name)
        a = a.reshape(shape)
        if permute and ".self_attn.q_proj." in name:
            a = gguf_names.unpermute_qk(a, config.num_attention_heads)
        elif permute and ".self_attn.k_proj." in name:
            a = gguf_names.unpermute_qk(a, config.num_key_value_heads)
        out[name] = a
    return out


def read_gguf(path: str | os.PathLike, *, progress: bool = True):
    """``(hf_config_dict, config, flat_tensors, GGUFFile)``: the GGUF dequantised into HF names and
    layout, no module built (what an HF-directory export needs)."""
    gf = GGUFFile(path)
    cfg_dict = gguf_config(gf)
    config = TargetConfig.from_hf(cfg_dict, where=gf.path)
    return cfg_dict, config, gguf_tensors(gf, config, progress=progress), gf


def load_gguf(path: str | os.PathLike, *, dtype=None, progress: bool = True):
    """``(model, config, hf_config_dict, flat_tensors, GGUFFile)`` from a GGUF file; ``dtype`` None keeps float32."""
    from specjax.models.hf import model_from_tree

    cfg_dict, config, flat, gf = read_gguf(path, progress=progress)
    tree = layout.unflatten(flat, layout.TABLES["hf_lm"], where=gf.path)
    model = model_from_tree(config, tree, dtype=dtype, where=gf.path)
    return model, config, cfg_dict, flat, gf
