"""The rotary-embedding CPU kernel (``specjax_rope``): products and sums rounded one by one (the
eager arithmetic), whatever the program's shapes, and the forwards that take it. (What it fixes
shows only in optimised codegen of the whole SmolLM2 loop, not in the tests' -O0 builds nor in a
tiny model: the bf16 loop at batch 1 against batch 2, docs/main-job.md.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import kernels
from specjax.models import panels
from specjax.models.hf import load_hf_dir
from specjax.models.rope import RopeConfig, apply_rope, rope_cos_sin
from specjax.models.target import KVCache
from tests.refs.speculators_ckpts import make_verifier

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels unavailable: {kernels.status()}")


def _np_rope(x, cos, sin):
    """PyTorch's eager arithmetic: x * cos, rotate_half(x) * sin and their sum, each rounded."""
    R = cos.shape[-1]
    h = R // 2
    xr = x[..., :R]
    rot = np.concatenate([-xr[..., h:], xr[..., :h]], -1)
    out = xr * cos[..., None, :] + rot * sin[..., None, :]
    return np.concatenate([out, x[..., R:]], -1).astype(np.float32)


@pytest.mark.parametrize("B,T,Hq,Hk,D,R", [(1, 1, 9, 3, 64, 64), (2, 5, 4, 2, 128, 128), (3, 7, 8, 8, 64, 32),
                                          (1, 300, 2, 1, 16, 8)])
def test_rope_kernel_is_eager_arithmetic(B, T, Hq, Hk, D, R):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32) * 7
    k = rng.standard_normal((B, T, Hk, D)).astype(np.float32) * 7
    rc = RopeConfig(head_dim=D, rotary_dim=R if R < D else None)
    pos = jnp.asarray(rng.integers(0, 4000, (B, T)), jnp.int32)
    cos, sin = rope_cos_sin(pos, rc)
    qo, ko = jax.jit(panels.rope)(jnp.asarray(q), jnp.asarray(k), cos, sin)
    c, s = np.asarray(cos), np.asarray(sin)
    np.testing.assert_array_equal(np.asarray(qo), _np_rope(q, c, s))  # bit for bit
    np.testing.assert_array_equal(np.asarray(ko), _np_rope(k, c, s))
    # XLA's fused version differs from it by at most float32 rounding (a contracted product)
    ref = np.asarray(jax.jit(apply_rope)(jnp.asarray(q), cos, sin))
    assert np.abs(ref - np.asarray(qo)).max() <= 4e-7 * np.abs(ref).max()


def test_rope_kernel_rejects_mismatched_shapes():
    q = jnp.zeros((1, 2, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="rope"):
        panels.rope(q, jnp.zeros((1, 3, 2, 16), jnp.float32), jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)))
    with pytest.raises(ValueError, match="rope"):
        panels.rope(q, jnp.zeros((1, 2, 2, 16), jnp.float32), jnp.zeros((1, 2, 32)), jnp.zeros((1, 2, 32)))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return load_hf_dir(make_verifier(tmp_path_factory.mktemp("rope") / "tied", "llama", tie_word_embeddings=True))


def test_decode_forwards_take_the_kernel_and_a_float32_prefill_does_not(tied, monkeypatch):
    """In the panel view a decode step and a verify rotate on the kernel (their keys are the
    eager arithmetic's); a float32 prefill past the kernels' rows keeps XLA's rope, bit for bit
    the plain params'."""
    calls = []
    real = panels.rope
    monkeypatch.setattr(panels, "rope", lambda *a: calls.append(a[0].shape) or real(*a))
    graphdef, state = nnx.split(tied)
    view = panels.decode_state(tied, state)
    cfg = tied.config

    def fwd(st, ids, cache):
        return nnx.merge(graphdef, st)(ids, cache=cache).cache

    prompt = jnp.asarray(np.arange(1, 25)[None], jnp.int32)
    fwd(view, prompt, KVCache.init(cfg, 1, 40))
    assert calls == []
    for T in (1, 4):
        calls.clear()
        fwd(view, jnp.ones((1, T), jnp.int32), KVCache.init(cfg, 1, 40))
        assert calls and all(s[:2] == (1, T) for s in calls)
