"""Training tests: speculators-built tiny drafts (cached per build arguments), relative errors."""

from __future__ import annotations

import json

import numpy as np
import pytest


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.fixture(scope="session")
def spec_draft(spec_root, verifiers):
    """``spec_draft(algo, family, **build_kwargs) -> Path`` built by speculators once per arguments."""
    from tests.refs.speculators_ckpts import build

    cache = {}

    def make(algo: str, family: str = "llama", **kw):
        key = (algo, family, json.dumps(kw, sort_keys=True, default=str))
        if key not in cache:
            out = spec_root / f"train-{algo}-{family}-{len(cache)}"
            cache[key] = build(algo, out, verifiers[family], **kw)
        return cache[key]

    return make
