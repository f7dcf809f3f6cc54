"""The tokenized training set, stored exactly as speculators' ``prepare-data`` stores it: an
HF ``datasets`` directory (``save_to_disk``) with columns ``input_ids`` (list<int64>),
``loss_mask`` (list<int64>, 0/1) and ``seq_len`` (int64), torch format; written and read here
with pyarrow alone (no ``datasets`` needed at run time).

A data directory (speculators' ``--data-path``) holds::

    data-00000-of-00001.arrow, dataset_info.json, state.json   the rows (this module)
    hidden_states/hs_{i}.safetensors                            target hidden states (hidden_states.py)
    token_freq.pt, d2t-<Vd>.npy, t2d-<Vd>.npy                    vocabulary (vocab.py)
    specjax_data.json                                            what made it (target, layer ids, counts)
    conversations.jsonl                                          the rendered conversations (provenance)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from bridge.atomic import atomic_file
from specjax import storage
from specjax.train.errors import DatasetError

ARROW_NAME = "data-00000-of-00001.arrow"
META_NAME = "specjax_data.json"

_FEATURES = {
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}


@dataclass
class TokenRows:
    """Rows of a tokenized dataset: ``input_ids[i]`` int64 [T_i], ``loss_mask[i]`` int64 [T_i]."""

    input_ids: list[np.ndarray] = field(default_factory=list)
    loss_mask: list[np.ndarray] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    def append(self, ids: Sequence[int], mask: Sequence[int]) -> None:
        ids, mask = np.asarray(ids, np.int64), np.asarray(mask, np.int64)
        if ids.shape != mask.shape or ids.ndim != 1:
            raise DatasetError(f"row {len(self)}: input_ids {list(ids.shape)} and loss_mask {list(mask.shape)} must be "
                               "equal-length 1-D sequences")
        self.input_ids.append(ids)
        self.loss_mask.append(mask)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(x) for x in self.input_ids], np.int64)

    def select(self, idx: Sequence[int]) -> "TokenRows":
        return TokenRows([self.input_ids[i] for i in idx], [self.loss_mask[i] for i in idx])

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iter(zip(self.input_ids, self.loss_mask))

    def supervised_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self.loss_mask))


def write_rows(directory: str | os.PathLike, rows: TokenRows) -> Path:
    """Write ``rows`` as a ``datasets.save_to_disk`` directory (the three files; other files in
    ``directory`` such as ``hidden_states/`` are left alone). Each file is written atomically."""
    import pyarrow as pa

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    i64 = pa.list_(pa.int64())
    table = pa.table({
        "input_ids": pa.array([r.tolist() for r in rows.input_ids], type=i64),
        "loss_mask": pa.array([r.tolist() for r in rows.loss_mask], type=i64),
        "seq_len": pa.array(rows.lengths.tolist(), type=pa.int64()),
    })
    info = {"citation": "", "description": "", "features": _FEATURES, "homepage": "", "license": ""}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": _FEATURES}})})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1000)
    with atomic_file(d / ARROW_NAME) as f:
        f.write(sink.getvalue().to_pybytes())
    state = {"_data_files": [{"filename": ARROW_NAME}], "_fingerprint": f"specjax{len(rows):010d}",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
             "_split": None}
    with atomic_file(d / "dataset_info.json", text=True) as f:
        f.write(json.dumps(info, indent=2))
    with atomic_file(d / "state.json", text=True) as f:
        f.write(json.dumps(state, indent=2))
    return d


def is_dataset_dir(directory: str | os.PathLike) -> bool:
    return (Path(directory) / "state.json").is_file()


def read_rows(directory: str | os.PathLike) -> TokenRows:
    """Read a ``save_to_disk`` directory (ours or speculators') with columns input_ids / loss_mask."""
    import pyarrow as pa

    d = Path(directory)
    state_p = d / "state.json"
    if not state_p.is_file():
        raise DatasetError("no state.json: not a tokenized dataset directory (run `specjax data prepare` first)",
                           path=str(d))
    try:
        state = json.loads(state_p.read_text(encoding="utf-8"))
        files = [x["filename"] for x in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"state.json is malformed ({e}); expected datasets' save_to_disk layout",
                           path=str(state_p)) from None
    if state.get("_indices_data_files"):
        raise DatasetError("dataset has an indices mapping; re-save it with datasets' flatten_indices() first",
                           path=str(state_p))
    rows = TokenRows()
    for name in files:
        p = d / name
        if not p.is_file():
            raise DatasetError(f"data file {name} listed in state.json is missing", path=str(d))
        with pa.memory_map(str(p)) as src:
            try:
                table = pa.ipc.open_stream(src).read_all()
            except pa.ArrowInvalid:
                src.seek(0)
                table = pa.ipc.open_file(src).read_all()
        missing = [c for c in ("input_ids", "loss_mask") if c not in table.column_names]
        if missing:
            raise DatasetError(f"columns {missing} are missing; found {table.column_names}", path=str(p),
                               key=missing[0])
        ids = table.column("input_ids").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        for k, (a, m) in enumerate(zip(ids, masks)):
            if a is None or m is None or len(a) != len(m):
                raise DatasetError(f"row {len(rows)}: input_ids and loss_mask lengths differ "
                                   f"({None if a is None else len(a)} vs {None if m is None else len(m)})",
                                   path=str(p), key="loss_mask")
            rows.append(a, m)
    return rows


def write_meta(directory: str | os.PathLike, meta: dict) -> None:
    with atomic_file(Path(directory) / META_NAME, text=True) as f:
        f.write(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_meta(directory: str | os.PathLike) -> dict:
    """``specjax_data.json`` of a data directory, local or on a bucket; {} when there is none."""
    p = storage.path(directory) / META_NAME
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DatasetError(f"not valid JSON: {e}", path=str(p)) from None


def split_indices(n: int, train_ratio: float) -> tuple[range, range]:
    """speculators' split: the first ``int(n * ratio)`` rows train, the rest validate (no shuffle)."""
    if not 0.0 < train_ratio <= 1.0:
        raise DatasetError(f"train_data_ratio must be in (0, 1], got {train_ratio}", key="train_data_ratio")
    k = int(n * train_ratio)
    return range(0, k), range(k, n)
