"""Load a GGUF (llama.cpp) target: config from the metadata, tensors dequantised in numpy
(``gguf.quants``), names mapped through ``bridge.gguf_names``, llama.cpp's Q/K row permutation
undone, then the usual ``bridge.layout`` table into the nnx module. No torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bridge import gguf_names, layout
from bridge.errors import CheckpointNotFoundError
from specjax.models.config import TargetConfig
from specjax.models.errors import GGUFError, UnsupportedGGUFError

# Tensor types with a numpy dequantiser in the gguf package that we accept.
SUPPORTED_QTYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # GGUFValueType -> numpy
_STRING, _ARRAY = 8, 9
_MAGIC = 0x46554747  # b"GGUF" little-endian


class ReaderTensor(NamedTuple):
    """One tensor as ``gguf.GGUFReader`` describes it (``shape`` in GGUF order, ``data`` a read-only
    view of the file: elements for float/int types, the packed bytes of each row for quantised ones)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class FastReader:
    """The GGUF container read directly: ``fields`` (key -> value, as ``ReaderField.contents()``
    gives them: Python scalars, str, flat lists) and ``tensors`` (:class:`ReaderTensor`).

    ``gguf.GGUFReader`` builds a numpy view per metadata element (SmolLM2's 98,000 tokenizer
    strings: 3.7 of the 7 s a load took); this parses the header with ``struct`` over the file's
    one ``np.memmap``, which the tensors view too (tested equal to ``GGUFReader`` field by field and tensor by tensor). Little-endian files only;
    :class:`GGUFFile` hands byte-swapped ones to the package's reader."""

    def __init__(self, path: str):
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        data = np.memmap(path, mode="r")
        mm = memoryview(data)
        magic, version = struct.unpack_from("<II", mm, 0)
        if magic != _MAGIC:
            raise ValueError("GGUF magic invalid")
        if version & 0xFFFF == 0:
            raise _ByteSwapped()
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        self.fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}

        def string(o):
            (n,) = struct.unpack_from("<Q", mm, o)
            if o + 8 + n > len(mm):
                raise ValueError(f"a string at byte {o} runs past the end of the file")
            return str(mm[o + 8:o + 8 + n], encoding="utf-8"), o + 8 + n

        def value(o, vt):
            if vt == _STRING:
                return string(o)
            t = _SCALARS.get(vt)
            if t is not None:
                return np.frombuffer(mm, t, 1, o)[0].item(), o + np.dtype(t).itemsize
            if vt != _ARRAY:
                raise ValueError(f"unknown GGUF value type {vt} at byte {o}")
            it, n = struct.unpack_from("<IQ", mm, o)
            o += 12
            t = _SCALARS.get(it)
            if t is not None:
                a = np.frombuffer(mm, t, n, o)
                return a.tolist(), o + a.nbytes
            out = []
            for _ in range(n):  # strings; nested arrays are flattened, as gguf's reader does
                v, o = value(o, it)
                out.extend(v) if it == _ARRAY else out.append(v)
            return out, o

        o = 24
        for _ in range(n_kv):
            key, o = string(o)
            (vt,) = struct.unpack_from("<I", mm, o)
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r} at byte {o}")
            self.fields[key], o = value(o + 4, vt)
        infos = []
        for _ in range(n_tensors):
            name, o = string(o)
            (nd,) = struct.unpack_from("<I", mm, o)
            dims = np.frombuffer(mm, np.uint64, nd, o + 4).copy()
            o += 4 + 8 * nd
            typ, off = struct.unpack_from("<IQ", mm, o)
            o += 12
            infos.append((name, dims, GGMLQuantizationType(typ), off))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a positive power of two")
        start = o + (-o % align)
        plain = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
        self.tensors: list[ReaderTensor] = []
        seen = set()
        for name, dims, qt, off in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            n = int(np.prod(dims))
            block, size = GGML_QUANT_SIZES[qt]
            nbytes = n * size // block
            shape = tuple(reversed(dims.tolist()))
            at = int(start + off)
            dt = plain.get(qt.name)
            if dt is None:
                dt, shape = np.uint8, quant_shape_to_byte_shape(shape, qt)
            arr = data[at:at + nbytes]  # nbytes: the elements' bytes for plain types too (block 1)
            if arr.size != nbytes:
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors.append(ReaderTensor(name, qt, dims, n, nbytes, at, arr.view(dt).reshape(shape)))


class _ByteSwapped(ValueError):
    pass


class _PackageReader:
    """A byte-swapped (big-endian) GGUF through ``gguf.GGUFReader``, with :class:`FastReader`'s shape."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        r = GGUFReader(path)
        self.fields = {k: f.contents() for k, f in r.fields.items()}
        self.tensors = [ReaderTensor(t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset, t.data)
                        for t in r.tensors]


class GGUFFile:
    """A parsed GGUF file: ``arch``, scalar/str ``metadata`` and its tensors (``reader``: a
    :class:`FastReader`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        p = Path(path)
        if not p.is_file():
            raise CheckpointNotFoundError("GGUF file does not exist", path=self.path)
        try:
            try:
                self.reader = FastReader(self.path)
            except _ByteSwapped:
                self.reader = _PackageReader(self.path)
        except ModuleNotFoundError:  # the gguf package is missing: an install problem, not a bad file
            raise
        except Exception as e:  # ValueError / struct.error on a malformed or non-GGUF file
            raise GGUFError(f"not a readable GGUF file ({type(e).__name__}: {e})", path=self.path) from e
        arch = self.get("general.architecture")
        if arch is None:
            raise GGUFError("metadata lacks 'general.architecture'", path=self.path, key="general.architecture")
        self.arch = str(arch)

    def get(self, key: str, default=None):
        return self.reader.fields.get(key, default)

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
        toks = gf.get("tokenizer.ggml.tokens")
        if toks is None:
            raise GGUFError(f"metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens", path=gf.path,
                            key=f"{arch}.vocab_size")
        cfg["vocab_size"] = len(toks)
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
