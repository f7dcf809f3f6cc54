"""Read a ``pytorch_model.bin`` state dict without torch.

SafeAILab publishes its EAGLE-3 drafts as ``pytorch_model.bin`` (``torch.save`` zip
archives). The archive holds ``<name>/data.pkl`` (a pickle whose tensors are
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` calls and whose
storages are persistent ids ``('storage', torch.<Type>Storage, key, device, numel)``) and
one raw little-endian file per storage, ``<name>/data/<key>``.

The unpickler below resolves only those few globals (anything else is refused, so a
hostile pickle cannot run code) and returns lazy tensors: the header walk reads only the
pickle; a storage is read when one of its tensors is asked for. Legacy (pre-zip, torch <
1.6) files are refused with a message saying how to re-save them.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from bridge.errors import SafetensorsFormatError
from bridge.safetensors_io import dtype_tag

STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class TorchBinError(SafetensorsFormatError):
    """A pytorch_model.bin that this reader cannot (or will not) open."""


@dataclass(frozen=True)
class _StorageType:
    name: str

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(STORAGE_DTYPES[self.name])


@dataclass
class _Storage:
    key: str
    dtype: np.dtype
    numel: int


@dataclass
class LazyTensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:  # safetensors tag, like TensorInfo.dtype
        return dtype_tag(self.storage.dtype)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return LazyTensor(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _rebuild_parameter_with_state(data, requires_grad=False, backward_hooks=None, state=None):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, fp, path: str):
        super().__init__(fp)
        self.path = path

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        raise TorchBinError(f"pickle asks for {module}.{name}; only plain tensor state dicts are read "
                            "(re-save the weights as safetensors)", path=self.path)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise TorchBinError(f"unsupported persistent id {pid!r}", path=self.path)
        _, stype, key, _location, numel = pid
        return _Storage(str(key), stype.dtype, int(numel))


class TorchBinStore:
    """Mapping-like view of a torch.save'd state dict: ``names``, ``info(n)``, ``array(n)``."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if not zipfile.is_zipfile(self.path):
            raise TorchBinError("not a zip-format torch checkpoint (legacy torch<1.6 serialization); "
                                "re-save it with a recent torch or as safetensors", path=self.path)
        self._zip = zipfile.ZipFile(self.path)
        pkl = [n for n in self._zip.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise TorchBinError(f"expected one data.pkl in the archive, found {pkl}", path=self.path)
        self._prefix = pkl[0][: -len("data.pkl")]
        order = self._prefix + "byteorder"
        if order in self._zip.namelist() and self._zip.read(order).strip() != b"little":
            raise TorchBinError("big-endian torch checkpoint; expected little-endian", path=self.path)
        with self._zip.open(pkl[0]) as f:
            try:
                obj = _Unpickler(f, self.path).load()
            except TorchBinError:
                raise
            except Exception as e:  # noqa: BLE001 - any malformed pickle
                raise TorchBinError(f"cannot read the pickle ({type(e).__name__}: {e})", path=self.path) from e
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict) or not all(isinstance(v, LazyTensor) for v in obj.values()):
            raise TorchBinError("expected a state dict of tensors", path=self.path)
        self._tensors: dict[str, LazyTensor] = dict(obj)
        self._cache: dict[str, np.ndarray] = {}
        self.files = [self]
        self.index_path = None

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> LazyTensor:
        return self._tensors[name]

    def infos(self) -> dict[str, LazyTensor]:
        return dict(self._tensors)

    def _storage(self, s: _Storage) -> np.ndarray:
        if s.key not in self._cache:
            raw = self._zip.read(f"{self._prefix}data/{s.key}")
            want = s.numel * s.dtype.itemsize
            if len(raw) < want:
                raise TorchBinError(f"storage {s.key} holds {len(raw)} bytes; expected {want}", path=self.path)
            self._cache[s.key] = np.frombuffer(raw, dtype=s.dtype, count=s.numel)
        return self._cache[s.key]

    def array(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        flat = self._storage(t.storage)
        n = int(np.prod(t.shape)) if t.shape else 1
        if n == 0:
            return np.zeros(t.shape, flat.dtype)
        if not t.shape:
            return np.array(flat[t.offset])
        last = t.offset + sum((d - 1) * s for d, s in zip(t.shape, t.stride))
        if last >= flat.size:
            raise TorchBinError(f"tensor {name!r} reaches past its storage", path=self.path, key=name)
        view = np.lib.stride_tricks.as_strided(flat[t.offset:], shape=t.shape,
                                               strides=tuple(s * flat.itemsize for s in t.stride), writeable=False)
        return np.ascontiguousarray(view)
