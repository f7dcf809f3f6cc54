"""Reading a third-party source directory and its verifier's config.json.

A source is a directory with ``config.json`` (absent is allowed for native MTP, whose
config is the verifier's) and its weights: ``model.safetensors``, a sharded
``model.safetensors.index.json`` (both through ``bridge.safetensors_io``), or a
``pytorch_model.bin`` (read without torch, :mod:`bridge.external.torch_bin`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bridge.errors import BridgeError
from bridge.external.errors import ExternalSourceError, VerifierError
from bridge.safetensors_io import DTYPES, INDEX_NAME, SINGLE_NAME, open_tensors

BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"


@dataclass
class Source:
    path: Path
    config: dict | None
    store: Any  # TensorStore or TorchBinStore: names / info(n) / array(n)
    weights: str  # file the tensors come from (for messages)

    @property
    def names(self) -> list[str]:
        return list(self.store.names)

    def has(self, name: str) -> bool:
        return name in self.store

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.store.info(name).shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self.store.info(name).dtype])

    def array(self, name: str) -> np.ndarray:
        return self.store.array(name)


def read_json(path: Path, what: str, err=ExternalSourceError) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise err(f"{what}: config.json not found", path=str(path)) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise err(f"{what}: config.json is not valid JSON ({e})", path=str(path)) from None
    if not isinstance(raw, dict):
        raise err(f"{what}: config.json holds a JSON {type(raw).__name__}; expected an object", path=str(path))
    return raw


def open_source(src: str | Path) -> Source:
    d = Path(src)
    if not d.is_dir():
        raise ExternalSourceError("source checkpoint directory does not exist (specjax converts local "
                                  "directories; download hub models first)", path=str(d))
    cfg_path = d / "config.json"
    config = read_json(cfg_path, "source") if cfg_path.exists() else None
    if (d / INDEX_NAME).exists() or (d / SINGLE_NAME).exists() or any(d.glob("*.safetensors")):
        try:
            store = open_tensors(d)
        except BridgeError as e:
            raise ExternalSourceError(f"cannot read the source weights: {e}", path=str(d)) from e
        weights = store.index_path or store.files[0].path
    elif (d / BIN_NAME).exists():
        from bridge.external.torch_bin import TorchBinStore

        store = TorchBinStore(d / BIN_NAME)
        weights = str(d / BIN_NAME)
    elif (d / BIN_INDEX_NAME).exists():
        raise ExternalSourceError(f"sharded {BIN_INDEX_NAME} is not supported; convert the shards to safetensors",
                                  path=str(d / BIN_INDEX_NAME))
    else:
        raise ExternalSourceError(f"no weights: expected {SINGLE_NAME}, {INDEX_NAME} or {BIN_NAME}", path=str(d))
    return Source(d, config, store, weights)


@dataclass
class Verifier:
    ref: str  # as the user gave it; written verbatim into speculators_config.verifier.name_or_path
    path: Path
    config: dict

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    def text_get(self, key: str, default=None):
        """``key`` from the top level, else from ``text_config`` (multimodal wrappers)."""
        if key in self.config:
            return self.config[key]
        tc = self.config.get("text_config")
        return tc.get(key, default) if isinstance(tc, dict) else default


def open_verifier(verifier) -> Verifier:
    if verifier is None or str(verifier) == "":
        raise VerifierError("a verifier is required (--verifier DIR): the converted draft records it, and its "
                            "config supplies the vocab size, layer count and architectures")
    ref = str(verifier)
    p = Path(ref)
    if not p.is_dir():
        raise VerifierError("verifier directory does not exist (specjax converts offline: pass a local "
                            "directory holding the verifier's config.json)", path=ref)
    return Verifier(ref, p, read_json(p / "config.json", "verifier", VerifierError))


def find_vocab_size(cfg: dict) -> int | None:
    """speculators' recursive lookup: top level first, then nested dicts in order."""
    if isinstance(cfg, dict):
        if "vocab_size" in cfg:
            return cfg["vocab_size"]
        for v in cfg.values():
            if isinstance(v, dict):
                r = find_vocab_size(v)
                if r is not None:
                    return r
    return None
