"""JAX-side calls of the native CPU kernels that are not matmul panels or attention
(:mod:`specjax.models.panels` has those): the first maximum of logit rows and a tree verify's
cache compaction, and the one gate both use (:func:`native_here`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax import kernels, placement


def native_here() -> bool:
    """The program being traced is built for one CPU device (no mesh given to
    :func:`specjax.placement.building_for`, no abstract mesh) and the native kernels are
    available: a kernel XLA cannot partition may run."""
    if placement.mesh() is not None or not jax.sharding.get_abstract_mesh().empty:
        return False
    return placement.is_cpu() and kernels.available("cpu")


def row_argmax_fits(x, axis: int) -> bool:
    """:func:`row_argmax` takes this :func:`specjax.models.layers.first_argmax`: float32 rows of at
    least 1024 (logits) along the last axis, where :func:`native_here`."""
    if x.dtype != jnp.float32 or x.ndim < 1 or axis % x.ndim != x.ndim - 1 or x.shape[-1] < 1024:
        return False
    return native_here()


def row_argmax(x):
    """The first maximum along the last axis on the native kernel, as
    :func:`specjax.models.layers.first_argmax` gives it (-0 and +0 equal; a row holding NaN gives
    ``x.shape[-1]``), in one pass: float32 [..., N] -> int32 [...]."""
    lead = x.shape[:-1]
    y = jax.ffi.ffi_call("specjax_row_argmax", jax.ShapeDtypeStruct((math.prod(lead),), jnp.int32),
                         vmap_method="sequential")(jnp.reshape(x, (-1, x.shape[-1])))
    return jnp.reshape(y, lead)


def compact_rows(base, path, bufs):
    """A tree verify's accepted path moved to consecutive rows of every heads-major cache buffer
    (``bufs``: [B, H, S, Dh] each, any dtype) on one native kernel call, each output aliased to its
    buffer: slot ``base + j`` takes the row slot ``min(base + max(path[:, j], 0), S - 1)`` held,
    for every j < D1 (all sources read before any write; slots past S dropped): the gathers and
    scatters of :func:`specjax.decode.tree.compact_cache`, bit for bit. base int32 [B], path
    int32 [B, D1]."""
    bufs = tuple(bufs)
    for i, b in enumerate(bufs):
        if b.ndim != 4 or b.shape[0] != base.shape[0]:
            raise ValueError(f"compact_rows: buffer {i} {b.shape} is not [B={base.shape[0]}, H, S, Dh]")
    out = jax.ffi.ffi_call("specjax_compact_rows", tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs),
                           input_output_aliases={i + 2: i for i in range(len(bufs))},
                           vmap_method="sequential")(jnp.asarray(base, jnp.int32), jnp.asarray(path, jnp.int32), *bufs)
    return tuple(out)
