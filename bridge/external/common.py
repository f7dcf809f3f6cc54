"""Pieces every external converter shares: the plan it returns, option checking, the
config.json document (:func:`config_doc`, over bridge's one writer), dtypes, and tensor-set
checks with source-named errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np

from bridge.config_doc import CONVERTED_VERSION_STAMP, speculators_config_doc
from bridge.external.errors import ExternalSourceError

DTYPE_NAMES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
}
NAME_OF_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


def is_float(dt: np.dtype) -> bool:
    return np.dtype(dt) in NAME_OF_DTYPE or np.dtype(dt).kind == "f"


@dataclass
class Plan:
    """What a converter decided: the config.json object, the flat tensors (PyTorch names
    and layout, final dtypes), the options after defaults, and notes for the user."""

    config: dict
    tensors: dict[str, np.ndarray]
    options: dict[str, Any]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Option:
    check: Callable[[Any], bool]
    expects: str
    default: Any = None
    help: str = ""


def _is_bool(v):
    return isinstance(v, bool)


def _is_ids(v):
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(i, int) and not isinstance(i, bool)
                                                               for i in v)


def _is_pos_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


BOOL = dict(check=_is_bool, expects="true or false")
IDS = dict(check=_is_ids, expects="a non-empty list of integer layer ids")
POS_INT = dict(check=_is_pos_int, expects="an integer >= 1")


def resolve_options(kind: str, table: dict[str, Option], given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(table))
    if unknown:
        raise ExternalSourceError(f"option(s) {unknown} do not apply to --from {kind}; it accepts "
                                  f"{sorted(table)}", key=unknown[0])
    out = {}
    for name, opt in table.items():
        v = given.get(name, opt.default)
        if v is not None and not opt.check(v):
            raise ExternalSourceError(f"option {name}={v!r}: expected {opt.expects}", key=name)
        out[name] = list(v) if isinstance(v, tuple) else v
    return out


def config_doc(algorithm: str, layer: dict, *, dtype: str, speculative_tokens: int, verifier, architectures,
               **fields) -> dict:
    """The converted checkpoint's config.json object (:func:`bridge.config_doc.speculators_config_doc`):
    ``speculators_version`` marks it as written by specjax (speculators never parses the field;
    REFERENCE 1.1), the verifier is recorded as the caller named it."""
    return speculators_config_doc(algorithm, layer, dtype=dtype, speculative_tokens=speculative_tokens,
                                  verifier_name_or_path=verifier.ref, verifier_architectures=architectures,
                                  speculators_version=CONVERTED_VERSION_STAMP, **fields)


def cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast as torch's ``.to(dtype)`` / ``copy_`` does: floats round to nearest even."""
    a = np.asarray(a)
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if dtype == np.bool_:
        return a != 0
    return a.astype(dtype)


def require(src, names: dict[str, tuple[int, ...]], *, shown: Callable[[str], str] = lambda n: n,
            kind: str) -> None:
    """Every ``names`` (target name -> expected shape) must be in the source with that shape;
    ``shown`` maps a target name back to the source's own name for the message."""
    missing = [shown(n) for n in names if not src.has(shown(n))]
    if missing:
        raise ExternalSourceError(f"{len(missing)} tensor(s) a {kind} draft needs are missing from the source: "
                                  f"{missing[:8]}" + (" ..." if len(missing) > 8 else ""),
                                  path=src.weights, key=missing[0])
    for n, want in names.items():
        got = src.shape(shown(n))
        if want is not None and got != tuple(want):
            raise ExternalSourceError(f"tensor {shown(n)!r} has shape {list(got)}; expected {list(want)} "
                                      "(from the source config and the verifier)", path=src.weights, key=shown(n))
