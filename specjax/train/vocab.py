"""Token frequencies over supervised tokens and the pruned draft vocabulary (``t2d`` / ``d2t``),
identical to speculators 0.9.0 (``speculators.train.vocab_mapping``).

* :func:`token_frequencies`: ``{token_id: count}`` over tokens with ``loss_mask == 1``.
* :func:`build_vocab_mapping`: ids sorted by ``(-count, id)`` (ties -> lower id), the first
  ``Vd`` kept; with fewer than ``Vd`` distinct ids, ids ``0, 1, 2, ...`` not yet present are
  appended; the selection is sorted ascending; ``d2t[i] = selected[i] - i`` (int64 offset),
  ``t2d[selected] = True`` (bool ``[V]``).
* Files, beside the data as the 0.9.0 wheel names them: ``token_freq.pt`` (a ``torch.save``d
  plain dict, written here without torch), ``d2t-<Vd>.npy``, ``t2d-<Vd>.npy``.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from bridge.atomic import atomic_file
from specjax.train.errors import VocabMappingError

TOKEN_FREQ_NAME = "token_freq.pt"


def token_frequencies(rows: Iterable[tuple[np.ndarray, np.ndarray]]) -> dict[int, int]:
    """``rows``: ``(input_ids, loss_mask)`` pairs -> ``{token_id: count}`` of supervised tokens."""
    freq: Counter[int] = Counter()
    for ids, mask in rows:
        ids = np.asarray(ids).reshape(-1)
        mask = np.asarray(mask).reshape(-1).astype(bool)
        u, c = np.unique(ids[mask], return_counts=True)
        freq.update(dict(zip(u.tolist(), c.tolist())))
    return dict(freq)


def build_vocab_mapping(token_freq: Mapping[int, int], draft_vocab_size: int,
                        target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """-> ``(d2t int64 [Vd], t2d bool [V])``, speculators' ``build_vocab_mappings_from_distribution``."""
    vd, v = int(draft_vocab_size), int(target_vocab_size)
    if vd < 1:
        raise VocabMappingError(f"draft_vocab_size must be >= 1, got {vd}", key="draft_vocab_size")
    if vd > v:
        raise VocabMappingError(f"draft_vocab_size {vd} is larger than the target vocabulary ({v} tokens); "
                                f"expected at most {v}", key="draft_vocab_size")
    bad = [t for t in token_freq if not 0 <= int(t) < v]
    if bad:
        raise VocabMappingError(f"token frequencies name {len(bad)} id(s) outside the target vocabulary [0, {v}), "
                                f"e.g. {sorted(bad)[:5]}; were they counted with another tokenizer?",
                                key="token_freq")
    order = sorted(token_freq, key=lambda t: (-token_freq[t], t))
    selected = [int(t) for t in order[:vd]]
    if len(selected) < vd:
        present = set(selected)
        for t in range(vd):
            if t not in present:
                selected.append(t)
            if len(selected) >= vd:
                break
    selected.sort()
    sel = np.asarray(selected, np.int64)
    d2t = sel - np.arange(vd, dtype=np.int64)
    t2d = np.zeros(v, bool)
    t2d[sel] = True
    return d2t, t2d


def mapping_paths(directory: str | os.PathLike, draft_vocab_size: int) -> tuple[Path, Path]:
    d = Path(directory)
    return d / f"d2t-{int(draft_vocab_size)}.npy", d / f"t2d-{int(draft_vocab_size)}.npy"


def save_vocab_mapping(directory: str | os.PathLike, d2t: np.ndarray, t2d: np.ndarray) -> tuple[Path, Path]:
    """Write ``d2t-<Vd>.npy`` (int64) and ``t2d-<Vd>.npy`` (bool) atomically."""
    pd, pt = mapping_paths(directory, len(d2t))
    for p, a in ((pd, np.asarray(d2t, np.int64)), (pt, np.asarray(t2d, bool))):
        with atomic_file(p) as f:
            np.save(f, a)
    return pd, pt


def load_vocab_mapping(directory: str | os.PathLike, draft_vocab_size: int,
                       target_vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached pair for ``Vd`` (checked as speculators' ``load_vocab_mappings`` does), or None."""
    pd, pt = mapping_paths(directory, draft_vocab_size)
    if not (pd.is_file() and pt.is_file()):
        return None
    d2t, t2d = np.load(pd), np.load(pt)
    vd, v = int(draft_vocab_size), int(target_vocab_size)
    if t2d.shape != (v,):
        raise VocabMappingError(f"t2d has shape {list(t2d.shape)}; expected [{v}] (the target vocabulary)", path=str(pt))
    if d2t.shape != (vd,):
        raise VocabMappingError(f"d2t has shape {list(d2t.shape)}; expected [{vd}]", path=str(pd))
    if int(t2d.astype(bool).sum()) != vd:
        raise VocabMappingError(f"t2d selects {int(t2d.sum())} ids; expected {vd}", path=str(pt))
    sel = np.nonzero(t2d.astype(bool))[0]
    if not np.array_equal(np.arange(vd) + d2t.astype(np.int64), sel):
        raise VocabMappingError("d2t and t2d disagree (draft id i + d2t[i] must be the i-th id t2d selects)",
                                path=str(pd))
    return d2t.astype(np.int64), t2d.astype(bool)


# ----------------------------------------------------------------------------- token_freq.pt


def save_token_freq(path: str | os.PathLike, freq: Mapping[int, int]) -> Path:
    """Write ``{int: int}`` in ``torch.save``'s zip format (readable by
    ``torch.load(weights_only=True)``) without importing torch."""
    path = Path(path)
    data = pickle.dumps({int(k): int(v) for k, v in freq.items()}, protocol=2)
    stem = path.stem or "archive"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, body in (("data.pkl", data), (".format_version", b"1"), (".storage_alignment", b"64"),
                           ("byteorder", b"little"), ("version", b"3\n"), (".data/serialization_id", b"0" * 40)):
            # a fixed entry time (a name alone stamps the current time): the same counts, the same bytes
            z.writestr(zipfile.ZipInfo(f"{stem}/{name}", date_time=(1980, 1, 1, 0, 0, 0)), body)
    with atomic_file(path) as f:
        f.write(buf.getvalue())
    return path


class _IntDictUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # a plain dict of ints needs no globals
        raise pickle.UnpicklingError(f"token_freq.pt references {module}.{name}; expected a plain dict of ints")


def load_token_freq(path: str | os.PathLike) -> dict[int, int]:
    """Read a ``token_freq.pt`` written by speculators (``torch.save``) or by :func:`save_token_freq`."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                raise VocabMappingError("not a torch.save archive (no data.pkl)", path=str(path))
            obj = _IntDictUnpickler(io.BytesIO(z.read(name))).load()
    except zipfile.BadZipFile as e:
        raise VocabMappingError(f"not a torch.save zip archive: {e}", path=str(path)) from None
    if not isinstance(obj, dict) or not all(isinstance(k, int) and isinstance(v, int) for k, v in obj.items()):
        raise VocabMappingError("expected a dict {token_id: count} of ints", path=str(path))
    return obj
