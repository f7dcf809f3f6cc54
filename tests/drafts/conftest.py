"""Drafts: speculators-built tiny checkpoints (cached per build arguments) and comparison helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest

TOL = 1e-5


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref| over finite reference entries."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    ok = np.isfinite(ref)
    return float(np.abs(ours - ref)[ok].max() / np.abs(ref[ok]).max())


@pytest.fixture(scope="session")
def draft_ckpt(spec_root, verifiers):
    """``draft_ckpt(algo, family, **build_kwargs) -> Path``: built once per distinct arguments."""
    from tests.refs.speculators_ckpts import build

    cache = {}

    def make(algo: str, family: str = "llama", **kw):
        key = (algo, family, json.dumps(kw, sort_keys=True, default=str))
        if key not in cache:
            out = spec_root / f"drafts-{algo}-{family}-{len(cache)}"
            cache[key] = build(algo, out, verifiers[family], **kw)
        return cache[key]

    return make
