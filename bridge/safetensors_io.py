"""safetensors I/O without torch: strict header parsing, memory-mapped lazy reads,
sharded checkpoints (``model.safetensors.index.json``) and atomic writes.

The on-disk format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data buffer; offsets are relative to the start of the buffer.

Reading never copies: ``SafetensorsFile.array(name)`` is a read-only numpy view over an
mmap of the file, so pages are read only when touched (and a device transfer of a slice
reads only that slice).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from bridge.errors import (
    CheckpointNotFoundError,
    SafetensorsFormatError,
    ShardIndexError,
    WriteError,
)
from bridge.jsonio import loads_bounded, read_json, regular_file
from bridge.atomic import atomic_dir, atomic_file

# safetensors dtype tag -> numpy dtype
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
TAGS: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
# Same order the safetensors library writes tensors in: larger alignment first, then name.
_ALIGN = {k: v.itemsize for k, v in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library refuses larger headers too
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def dtype_tag(dtype) -> str:
    dt = np.dtype(dtype)
    if dt not in TAGS:
        raise SafetensorsFormatError(f"numpy dtype {dt} has no safetensors equivalent; expected one of {sorted(DTYPES)}")
    return TAGS[dt]


@dataclass(frozen=True)
class TensorInfo:
    """What the header says about one tensor."""

    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets into the data buffer
    end: int
    file: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _no_duplicate_keys(path: str):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise SafetensorsFormatError(f"header names tensor {k!r} twice; expected unique names", path=path, key=k)
            seen[k] = v
        return seen

    return hook


def parse_header(path: str | os.PathLike, *, file_size: int | None = None, raw: bytes | None = None):
    """Parse and validate a safetensors header.

    Returns ``(tensors: dict[name, TensorInfo], metadata: dict[str, str], data_start: int)``.
    Reads only the header bytes. Raises SafetensorsFormatError naming the file and tensor.
    """
    path = str(path)
    if raw is None:
        raw, n, size = _read_header_bytes(path)
    else:
        size = file_size
        n = len(raw)
    header = loads_bounded(raw, path=path, what="header", error=SafetensorsFormatError, hook=_no_duplicate_keys(path))
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"header is a JSON {type(header).__name__}; expected an object", path=path)
    data_start = 8 + n
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsFormatError("__metadata__ must be an object of string -> string", path=path, key="__metadata__")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(path, name, entry, data_len)
    check_coverage(tensors, data_len, path)
    return tensors, metadata, data_start


def _read_header_bytes(path: str) -> tuple[bytes, int, int]:
    """The header bytes of a file on disk, with their length and the file's size: refuses a
    length prefix the file or :data:`MAX_HEADER_BYTES` cannot hold, and names the file when it
    is missing, a directory or unreadable."""
    try:
        size = regular_file(path, "a safetensors file", SafetensorsFormatError)  # a FIFO would block open()
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(f"file is {size} bytes; expected at least 8 (the header length)", path=path)
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SafetensorsFormatError(
                    f"header length {n} is larger than the file allows ({size - 8} bytes after the length prefix)",
                    path=path,
                )
            if n > MAX_HEADER_BYTES:
                raise SafetensorsFormatError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit", path=path)
            return f.read(n), n, size
    except FileNotFoundError as e:
        raise CheckpointNotFoundError("safetensors file does not exist", path=path) from e
    except IsADirectoryError as e:
        raise SafetensorsFormatError("expected a safetensors file, found a directory", path=path) from e
    except PermissionError as e:
        raise SafetensorsFormatError(f"cannot read file: {e.strerror}", path=path) from e


def _tensor_info(path: str, name: str, entry, data_len: int) -> TensorInfo:
    """One header entry as a :class:`TensorInfo`, once its dtype, shape and data offsets are valid
    and the offsets span exactly the bytes the shape and dtype need, inside the data buffer."""
    if not isinstance(entry, dict):
        raise SafetensorsFormatError(f"tensor {name!r}: entry is {type(entry).__name__}; expected an object", path=path, key=name)
    missing = {"dtype", "shape", "data_offsets"} - set(entry)
    if missing:
        raise SafetensorsFormatError(f"tensor {name!r}: entry lacks {sorted(missing)}", path=path, key=name)
    tag = entry["dtype"]
    if not isinstance(tag, str) or tag not in DTYPES:
        raise SafetensorsFormatError(
            f"tensor {name!r}: unknown dtype {tag!r}; expected one of {sorted(DTYPES)}", path=path, key=name
        )
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsFormatError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints", path=path, key=name)
    offs = entry["data_offsets"]
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(type(o) is int and o >= 0 for o in offs)
        or offs[0] > offs[1]
    ):
        raise SafetensorsFormatError(
            f"tensor {name!r}: data_offsets {offs!r}; expected [begin, end] with 0 <= begin <= end", path=path, key=name
        )
    b, e = offs
    if e > data_len:
        raise SafetensorsFormatError(
            f"tensor {name!r}: data_offsets [{b}, {e}] run past the data buffer ({data_len} bytes)", path=path, key=name
        )
    want = math.prod(shape) * DTYPES[tag].itemsize
    if e - b != want:
        raise SafetensorsFormatError(
            f"tensor {name!r}: shape {shape} x {tag} needs {want} bytes but data_offsets span {e - b}",
            path=path,
            key=name,
        )
    return TensorInfo(name, tag, tuple(shape), b, e, path)


def check_coverage(tensors: Mapping[str, "TensorInfo"], data_len: int | None, path: str) -> None:
    """The tensors' byte ranges tile the data buffer exactly, as the reference safetensors library
    requires: sorted by offset, each starts where the previous one ended, the first at 0 and the
    last at the buffer's end. A header length off by one, a hole, an overlap or trailing bytes
    would otherwise shift or leave unread bytes silently."""
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values())
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsFormatError(
                f"tensors {n0!r} [{b0}, {e0}] and {n1!r} [{b1}, {e1}] overlap; expected disjoint byte ranges",
                path=path,
                key=n1,
            )
        if b1 > e0:
            raise SafetensorsFormatError(
                f"{b1 - e0} unused byte(s) between tensors {n0!r} (ends at {e0}) and {n1!r} (starts at {b1}); "
                "expected the tensors to tile the data buffer", path=path, key=n1)
    first = spans[0][0] if spans else 0
    if first:
        raise SafetensorsFormatError(f"the first tensor {spans[0][2]!r} starts at byte {first} of the data buffer; "
                                     "expected 0 (is the header length right?)", path=path, key=spans[0][2])
    end = spans[-1][1] if spans else 0
    if data_len is not None and end != data_len:
        raise SafetensorsFormatError(
            f"the tensors cover {end} bytes but the data buffer after the header holds {data_len}; expected them to "
            "match exactly (a header length off by one, or bytes appended to the file)", path=path)


class SafetensorsFile:
    """One safetensors file: header parsed eagerly, data mapped lazily (read-only)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.tensors, self.metadata, self.data_start = parse_header(self.path)
        self._mm: mmap.mmap | None = None

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def array(self, name: str) -> np.ndarray:
        """Read-only zero-copy view of one tensor (pages load on first touch)."""
        info = self.tensors[name]
        n = math.prod(info.shape)
        if n == 0:
            return np.zeros(info.shape, info.np_dtype)
        mm = self._map()
        arr = np.frombuffer(mm, dtype=info.np_dtype, count=n, offset=self.data_start + info.begin)
        return arr.reshape(info.shape)

    def raw_bytes(self, name: str) -> bytes:
        info = self.tensors[name]
        mm = self._map()
        return bytes(mm[self.data_start + info.begin : self.data_start + info.end])

    def close(self):
        # Views handed out keep the mmap alive through their base; dropping ours is enough.
        self._mm = None


class TensorStore:
    """All tensors of a checkpoint directory (single file or sharded via an index)."""

    def __init__(self, files: list[SafetensorsFile], where: dict[str, SafetensorsFile], index_path: str | None):
        self.files = files
        self._where = where
        self.index_path = index_path

    # -- mapping-like access
    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def infos(self) -> dict[str, TensorInfo]:
        return {n: f.tensors[n] for n, f in self._where.items()}

    def array(self, name: str) -> np.ndarray:
        return self._where[name].array(name)

    def raw_bytes(self, name: str) -> bytes:
        return self._where[name].raw_bytes(name)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.files[0].metadata) if self.files else {}

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos().values())


def open_tensors(directory: str | os.PathLike) -> TensorStore:
    """Open the tensors of a checkpoint directory: ``model.safetensors`` or the sharded
    ``model.safetensors.index.json``; falls back to the only ``*.safetensors`` file present."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointNotFoundError("checkpoint directory does not exist", path=str(d))
    index = d / INDEX_NAME
    if index.exists():
        return _open_index(d, index)
    single = d / SINGLE_NAME
    if not single.exists():
        found = sorted(p.name for p in d.glob("*.safetensors"))
        if len(found) == 1:
            single = d / found[0]
        else:
            raise CheckpointNotFoundError(
                f"no {SINGLE_NAME} or {INDEX_NAME}" + (f" (found {found})" if found else ""), path=str(d)
            )
    f = SafetensorsFile(single)
    return TensorStore([f], {n: f for n in f.tensors}, None)


def _open_index(d: Path, index: Path) -> TensorStore:
    ipath = str(index)
    doc = read_json(index, what="the index", error=ShardIndexError, hook=_dup_hook_index(ipath))
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ShardIndexError("expected an object with a 'weight_map' of tensor name -> shard file", path=ipath, key="weight_map")
    if not wm:
        raise ShardIndexError("weight_map is empty; expected tensor name -> shard file for every tensor", path=ipath,
                              key="weight_map")
    root = d.resolve()
    files: dict[str, SafetensorsFile] = {}
    where: dict[str, SafetensorsFile] = {}
    for shard in sorted(set(wm.values())):
        sp = (d / shard).resolve()
        if root not in sp.parents:
            raise ShardIndexError(f"shard {shard!r} lies outside the checkpoint directory", path=ipath, key=shard)
        if not sp.is_file():
            raise ShardIndexError(f"shard {shard!r} named by the index does not exist", path=ipath, key=shard)
        files[shard] = SafetensorsFile(sp)
    unnamed = sorted(p.name for p in d.glob("*.safetensors") if p.name not in set(wm.values()))
    if unnamed:
        raise ShardIndexError(f"{unnamed[0]!r} is in the checkpoint directory but the index names no tensor in it "
                              f"(its tensors would be ignored); expected every shard in weight_map", path=ipath,
                              key=unnamed[0])
    owner: dict[str, str] = {}
    for shard, f in files.items():
        for n in f.tensors:
            if n in owner:
                raise ShardIndexError(f"tensor {n!r} appears in both {owner[n]!r} and {shard!r}", path=ipath, key=n)
            owner[n] = shard
    for name, shard in wm.items():
        f = files[shard]
        if name not in f.tensors:
            raise ShardIndexError(f"index maps tensor {name!r} to {shard!r}, which does not contain it", path=ipath, key=name)
        where[name] = f
    extra = sorted(set(owner) - set(wm))
    if extra:
        raise ShardIndexError(f"shards hold tensors the index does not list: {extra[:5]}", path=ipath, key=extra[0])
    return TensorStore(list(files.values()), where, ipath)


def _dup_hook_index(path):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise ShardIndexError(f"index names {k!r} twice; expected each tensor once", path=path, key=k)
            seen[k] = v
        return seen

    return hook


# ----------------------------------------------------------------------------- writing


def _order(tensors: Mapping[str, np.ndarray]) -> list[str]:
    return sorted(tensors, key=lambda n: (-np.dtype(tensors[n].dtype).itemsize, n))


def _header_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    off = 0
    order = _order(tensors)
    for name in order:
        a = tensors[name]
        nb = int(a.size) * np.dtype(a.dtype).itemsize
        header[name] = {"dtype": dtype_tag(a.dtype), "shape": list(a.shape), "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)  # the library pads the header to 8 bytes with spaces
    return raw, order


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None,
                      *, progress=None) -> None:
    """Write one safetensors file atomically (temp file + rename). Arrays are written in C
    order byte-for-byte; ``progress(nbytes)`` is called after each tensor."""
    raw, order = _header_bytes(tensors, metadata)
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            a = np.ascontiguousarray(tensors[name])
            f.write(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
            if progress is not None:
                progress(a.nbytes)


def plan_shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in name order, as transformers does: a new shard starts when the next
    tensor would push the current one past the limit (a single larger tensor gets its own)."""
    if max_shard_bytes <= 0:
        raise WriteError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nb = tensors[name].nbytes
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb
    return shards


def write_tensors_into(directory: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None,
                       max_shard_bytes: int | None = None, progress=None) -> list[str]:
    """Write tensors into an existing (temporary) directory, single file or sharded with an index."""
    if not max_shard_bytes or sum(a.nbytes for a in tensors.values()) <= max_shard_bytes:
        write_safetensors(directory / SINGLE_NAME, tensors, metadata, progress=progress)
        return [SINGLE_NAME]
    groups = plan_shards(tensors, max_shard_bytes)
    n = len(groups)
    weight_map = {}
    names = []
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(directory / fname, {k: tensors[k] for k in group}, metadata, progress=progress)
        weight_map.update({k: fname for k in group})
        names.append(fname)
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    with atomic_file(directory / INDEX_NAME, text=True) as f:
        f.write(json.dumps(index, indent=2) + "\n")
    return names + [INDEX_NAME]


def iter_infos(store: TensorStore) -> Iterable[TensorInfo]:
    return store.infos().values()
