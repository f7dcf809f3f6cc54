"""The native CPU kernels beside the matmul panels (:mod:`specjax.kernels.ops`): the one-pass
first maximum of logit rows against ``first_argmax``'s XLA form, and where it is taken. (The tree
compaction kernel is tested in tests/decode/test_tree_verify.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.kernels import ops as native_ops

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels unavailable: {kernels.status()}")


def _xla_first_argmax(x):
    """first_argmax's XLA form (the max, then the smallest index reaching it)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == m, idx, x.shape[-1]), axis=-1)


@needs_kernels
@pytest.mark.parametrize("N", [1030, 49152, 4101])
def test_row_argmax_kernel_gives_first_argmax_indices(N):
    """The one-pass argmax kernel gives first_argmax's index on every row: ties within a lane and
    across lanes (first index wins), -0 against +0 (equal), the maximum in the tail past the last
    16 columns, all -inf, NaN anywhere (N), at 1 to 9 rows; and first_argmax takes it for float32
    logits in a CPU program (jnp.argmax's indices)."""
    rng = np.random.default_rng(N)
    x = rng.integers(-3, 4, size=(9, N)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 17], x[2, 5] = 9.0, 9.0  # tie: lanes 1 and 5, first index 5
    x[3] = 0.0
    x[3, 40], x[3, 7] = 0.0, -0.0  # -0 and +0 equal: index 0 holds +0 first
    x[3, 0] = -1.0  # so the first maximum is at 1
    x[4, N - 1] = 50.0  # in the tail
    x[5, N // 2] = np.nan
    x[6, 3] = np.nan
    x[7] = rng.standard_normal(N).astype(np.float32)
    x[8, :] = -5.0
    x[8, N - 3], x[8, 33] = 7.0, 7.0
    xj = jnp.asarray(x)
    want = np.array(jax.jit(_xla_first_argmax)(xj))
    want[5] = want[6] = N  # NaN rows: N (XLA's CPU max may drop a NaN, so its index there is any)
    assert want[2] == 5 and want[3] == 1 and want[4] == N - 1 and want[8] == 33
    for rows in (slice(0, 9), slice(4, 5), slice(2, 8)):
        np.testing.assert_array_equal(np.asarray(jax.jit(native_ops.row_argmax)(xj[rows])), want[rows])
    from specjax.models.layers import first_argmax
    assert native_ops.row_argmax_fits(xj, -1) and not native_ops.row_argmax_fits(xj[:, :1000], -1)
    assert not native_ops.row_argmax_fits(xj.astype(jnp.bfloat16), -1) and not native_ops.row_argmax_fits(xj, 0)
    ok = np.isfinite(x).all(-1)
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(xj[ok])), np.argmax(x[ok], -1))
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(xj.reshape(3, 3, N))), want.reshape(3, 3))
