"""Which attention a program runs, and the two entry points model code calls.

The choice follows where the program is built (``specjax.placement``), never
``jax.default_backend()``: a program compiled for a TPU topology from a CPU host (``specjax
plan``) takes the Pallas kernels, the same code on the CPU takes XLA.

* :func:`tpu_attention` -- ``layers.attend``'s contract with a :class:`MaskSpec`:
  self/cross attention without a cache (prefill, extraction, training).
* :func:`cache_attention` -- queries against a KV cache, each query seeing one slot range
  (decode, speculative verify, prefill into the cache, draft chain steps).

Both take ``impl`` (``"pallas"`` | ``"xla"``, default :func:`attention_impl`) and ``mesh`` (default
the one set with ``jax.set_mesh`` around the trace, else the one given to
``placement.building_for``): under a mesh the Pallas kernels run inside
``jax.shard_map`` (batch over ``data``/``fsdp``, kv heads over ``tensor``), because XLA cannot
partition a Mosaic kernel.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from specjax import placement
from specjax.kernels.tpu.decode import LANES, decode_attention
from specjax.kernels.tpu.masks import MaskSpec, dense_mask
from specjax.kernels.tpu.splash import check_qkv, mesh_specs, sharded_flash_attention, flash_attention

IMPLS = ("xla", "pallas")
_INTERPRET: contextvars.ContextVar[bool] = contextvars.ContextVar("specjax_pallas_interpret", default=False)


class AttentionImplError(ValueError):
    """An unknown attention implementation name."""


def attention_impl(where=None) -> str:
    """``"pallas"`` when the program is built for a TPU, else ``"xla"``. ``where``: a Mesh,
    Sharding, Device, arrays or a platform name (``placement.platform_of``); default the
    platform of the program being traced (``placement.platform()``)."""
    if _INTERPRET.get():
        return "pallas"
    p = placement.platform_of(where) if where is not None else None
    return "pallas" if (p or placement.platform()) == "tpu" else "xla"


@contextlib.contextmanager
def pallas_interpret():
    """Within the block :func:`attention_impl` answers ``"pallas"`` whatever the platform and the
    kernels run in Pallas interpret mode: the models' TPU attention path, run on the CPU (tests)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def cache_slots(n: int, where=None) -> int:
    """Slots to allocate for a KV cache that must hold ``n``: on the Pallas path ``n`` rounded up
    to a multiple of 128 (the decode kernel reads the cache in blocks that divide its length),
    else ``n``. The extra slots lie past every position a query can see."""
    n = int(n)
    return -(-n // LANES) * LANES if attention_impl(where) == "pallas" else n


def _impl(impl, mesh) -> str:
    impl = impl or attention_impl(mesh)
    if impl not in IMPLS:
        raise AttentionImplError(f"attention impl {impl!r} is not one of {IMPLS}")
    return impl


def ambient_mesh(mesh=None):
    """``mesh``, else the mesh set with ``jax.set_mesh`` around the trace, else the one the jit
    boundary gave ``placement.building_for`` (None when there is none)."""
    if mesh is not None:
        return mesh
    am = jax.sharding.get_abstract_mesh()
    if am is not None and not am.empty:
        return am
    return placement.mesh()


def tpu_attention(q, k, v, *, mask_spec: MaskSpec, scale: float | None = None, mesh=None, impl: str | None = None,
                  interpret: bool = False, **block_kw):
    """q [B, T, Hq, D]; k, v [B, S, Hkv, D] -> [B, T, Hq, D]; visibility from ``mask_spec``."""
    mesh = ambient_mesh(mesh)
    impl = _impl(impl, mesh)
    interpret = interpret or _INTERPRET.get()
    if impl == "xla":
        check_qkv(q, k, v)
        m = dense_mask(mask_spec, q.shape[1], k.shape[1])
        return jax.nn.dot_product_attention(q, k, v, mask=m, scale=scale)
    if mesh is None:
        return flash_attention(q, k, v, mask=mask_spec, scale=scale, interpret=interpret, **block_kw)
    return sharded_flash_attention(q, k, v, mask=mask_spec, mesh=mesh, scale=scale, interpret=interpret,
                                   **block_kw)


def range_mask(lo, hi, S: int):
    """int [B, T] inclusive slot ranges -> bool [B, 1, T, S] (the XLA path's mask)."""
    j = jnp.arange(S, dtype=jnp.int32)[None, None, :]
    return ((j >= lo[..., None]) & (j <= hi[..., None]))[:, None]


def cache_attention(q, k, v, lo, hi, *, scale: float | None = None, seq_major: bool = False, mesh=None,
                    impl: str | None = None, interpret: bool = False, **block_kw):
    """q [B, T, Hq, D] against cache k, v ([B, Hkv, S, D], or [B, S, Hkv, D] with
    ``seq_major``); query t of sequence b sees slots ``lo[b, t] .. hi[b, t]`` -> [B, T, Hq, D].
    The XLA path scores every slot (NaN in unseen slots is masked out of the logits but not out
    of the weighted sum there: the cache must be finite); the Pallas path reads only the blocks
    the ranges touch (see :mod:`specjax.kernels.tpu.decode`)."""
    mesh = ambient_mesh(mesh)
    impl = _impl(impl, mesh)
    interpret = interpret or _INTERPRET.get()
    if impl == "xla":
        S = k.shape[1] if seq_major else k.shape[2]
        kk, vv = (k, v) if seq_major else (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
        return jax.nn.dot_product_attention(q, kk.astype(q.dtype), vv.astype(q.dtype),
                                            mask=range_mask(lo, hi, S), scale=scale)
    kw = dict(scale=scale, seq_major=seq_major, interpret=interpret, **block_kw)
    if mesh is None:
        return decode_attention(q, k, v, lo, hi, **kw)
    from jax.sharding import PartitionSpec as P

    bs, hs = mesh_specs(mesh, q.shape[0], k.shape[2] if seq_major else k.shape[1])
    act = P(bs, None, hs, None)
    cache = act if seq_major else P(bs, hs, None, None)
    return jax.shard_map(lambda q, k, v, lo, hi: decode_attention(q, k, v, lo, hi, **kw), mesh=mesh,
                         in_specs=(act, cache, cache, P(bs, None), P(bs, None)), out_specs=act,
                         check_vma=False)(q, k, v, lo, hi)
