"""Pieces every external converter shares: the plan it returns, option checking, the
speculators_config block, dtypes, and tensor-set checks with source-named errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np

from bridge.external.errors import ExternalSourceError
from bridge.external.hf_config import HF_FORMAT_VERSION

# speculators_version written into converted checkpoints: the speculators format they follow,
# marked as written by specjax (speculators never parses the field; REFERENCE 1.1)
VERSION_STAMP = "0.9.0+specjax"

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


def speculators_block(algorithm: str, speculative_tokens: int, verifier, architectures: list) -> dict:
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": speculative_tokens, "verifier_accept_k": 1}],
        "verifier": {"architectures": list(architectures), "name_or_path": verifier.ref},
    }


def top_level(model_type: str, arch: str, config_class: str, dtype: np.dtype, layer: dict, block: dict,
              **fields) -> dict:
    """The keys SpeculatorModelConfig.save_pretrained writes around the algorithm's own fields."""
    return {
        "architectures": [arch],
        "auto_map": {"": f"config.{config_class}"},
        "dtype": NAME_OF_DTYPE[np.dtype(dtype)],
        **fields,
        "speculators_config": block,
        "speculators_model_type": model_type,
        "speculators_version": VERSION_STAMP,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "transformers_version": HF_FORMAT_VERSION,
    }


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
