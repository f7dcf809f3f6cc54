"""Fixtures for the external-draft converters: sources in each third-party layout, speculators
0.9.0's own conversion of the same source, and checkpoint comparison helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.bridge.external import sources


@pytest.fixture(scope="session")
def ext_root(spec_root) -> Path:
    d = spec_root / "external"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def next_verifier(ext_root) -> Path:
    return sources.qwen3_next_verifier(ext_root / "verifier-qwen3-next")


def spec_convert(src, verifier, algorithm: str, out: Path, **kw) -> Path:
    """speculators 0.9.0's own conversion (``convert_model``, the function behind its CLI)."""
    from speculators.convert import convert_model

    convert_model(str(src), str(verifier), algorithm, str(out), **kw)
    return out


def read_tensors(d: Path) -> dict[str, np.ndarray]:
    from bridge.safetensors_io import open_tensors

    st = open_tensors(d)
    return {n: np.array(st.array(n)) for n in st.names}


def read_config(d: Path) -> dict:
    return json.loads((Path(d) / "config.json").read_text())


def assert_same_checkpoint(ours: Path, theirs: Path, *, nan_sentinels_in_theirs=()):
    """Tensors: same names, dtypes, shapes and bytes. Config: same values apart from the
    version stamp. ``nan_sentinels_in_theirs``: tensors speculators writes all-NaN that specjax
    leaves out (they must really be all NaN)."""
    a, b = read_tensors(ours), read_tensors(theirs)
    for n in nan_sentinels_in_theirs:
        t = b.pop(n)
        assert t.dtype.kind in "fV" and np.isnan(t.astype(np.float32)).all(), f"{n} is not an all-NaN sentinel"
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    for n in a:
        assert (a[n].dtype, a[n].shape) == (b[n].dtype, b[n].shape), (n, a[n].dtype, a[n].shape, b[n].dtype, b[n].shape)
        assert a[n].tobytes() == b[n].tobytes(), f"{n}: bytes differ"
    ca, cb = read_config(ours), read_config(theirs)
    assert ca.pop("speculators_version") == "0.9.0+specjax" and cb.pop("speculators_version") == "0.9.0"
    diff = {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb) if ca.get(k) != cb.get(k)}
    assert not diff, diff
    assert _types(ca) == _types(cb)  # 1000000 stays an int, 0.0 a float


def _types(x):
    if isinstance(x, dict):
        return {k: _types(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_types(v) for v in x]
    return type(x).__name__ if not (isinstance(x, float) and math.isnan(x)) else "nan"
