"""Which attention a program runs, and the two entry points model code calls.

The choice follows where the program is built (``specjax.placement``), never
``jax.default_backend()``: a program compiled for a TPU topology from a CPU host (``specjax
plan``) takes the Pallas kernels, the same code on the CPU takes XLA.

* :func:`tpu_attention` -- ``layers.attend``'s contract with a :class:`MaskSpec`:
  self/cross attention without a cache (prefill, extraction, training).
* :func:`cache_attention` -- queries against a KV cache, each query seeing one slot range
  (decode, speculative verify, prefill into the cache, draft chain steps).
* :func:`tree_cache_attention` -- a token-tree verify: the committed cache through the decode
  kernel (with its log-sum-exp) merged with the tree's own rows under the ancestor mask.

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
from specjax.kernels.tpu.decode import LANES, decode_attention, merge_attention
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
                    impl: str | None = None, interpret: bool = False, layer=None, **block_kw):
    """q [B, T, Hq, D] against cache k, v ([B, Hkv, S, D], or [B, S, Hkv, D] with
    ``seq_major``); query t of sequence b sees slots ``lo[b, t] .. hi[b, t]`` -> [B, T, Hq, D].
    The XLA path scores every slot (NaN in unseen slots is masked out of the logits but not out
    of the weighted sum there: the cache must be finite); the Pallas path reads only the blocks
    the ranges touch (see :mod:`specjax.kernels.tpu.decode`). ``layer`` (int32 scalar): k, v are
    a stacked heads-major cache [L, B, Hkv, S, D] and layer ``layer`` is attended (the kernel
    reads it in place)."""
    mesh = ambient_mesh(mesh)
    impl = _impl(impl, mesh)
    interpret = interpret or _INTERPRET.get()
    if layer is not None and impl == "xla":
        k, v = k[layer], v[layer]
    elif layer is not None:
        return _decode(q, k, v, lo, hi, mesh, dict(scale=scale, interpret=interpret, **block_kw), layer=layer)
    if impl == "xla":
        S = k.shape[1] if seq_major else k.shape[2]
        kk, vv = (k, v) if seq_major else (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
        return jax.nn.dot_product_attention(q, kk.astype(q.dtype), vv.astype(q.dtype),
                                            mask=range_mask(lo, hi, S), scale=scale)
    return _decode(q, k, v, lo, hi, mesh, dict(scale=scale, seq_major=seq_major, interpret=interpret, **block_kw))


def _decode(q, k, v, lo, hi, mesh, kw, return_lse: bool = False, layer=None):
    """The decode kernel, inside ``jax.shard_map`` under a mesh (batch over data/fsdp, kv heads
    over tensor; the log-sum-exp [B, T, Hq] sharded as the output's heads). ``layer``: k, v are a
    stacked cache [L, B, Hkv, S, D], its layer axis unsplit."""
    if mesh is None:
        return decode_attention(q, k, v, lo, hi, return_lse=return_lse, layer=layer, **kw)
    from jax.sharding import PartitionSpec as P

    heads = k.shape[-3] if layer is not None else (k.shape[2] if kw.get("seq_major") else k.shape[1])
    bs, hs = mesh_specs(mesh, q.shape[0], heads)
    act = P(bs, None, hs, None)
    cache = act if kw.get("seq_major") else P(bs, hs, None, None)
    out_specs = (act, P(bs, None, hs)) if return_lse else act
    extra, extra_specs = (), ()
    if layer is not None:  # the layer axis unsplit, the index replicated
        cache = P(None, bs, hs, None, None)
        extra, extra_specs = (jnp.asarray(layer, jnp.int32),), (P(),)

    def call(q, k, v, lo, hi, *layer):
        return decode_attention(q, k, v, lo, hi, return_lse=return_lse, layer=layer[0] if layer else None, **kw)

    return jax.shard_map(call, mesh=mesh, in_specs=(act, cache, cache, P(bs, None), P(bs, None)) + extra_specs,
                         out_specs=out_specs, check_vma=False)(q, k, v, lo, hi, *extra)


def tree_rows_attention(q, k, v, q_pos, tree_mask, *, scale: float | None = None, window: int | None = None):
    """The tree's part of a tree verify: q [B, T, Hq, D] against the tree's own K/V [B, T, Hkv, D],
    node t seeing node j iff ``tree_mask[t, j]`` (ancestor or itself; [T, T] or [B, T, T]) and,
    with a sliding window, ``q_pos[j] > q_pos[t] - window`` -> (output [B, T, Hq, D] in q's dtype,
    log-sum-exp float32 [B, T, Hq]). T is a tree's size (a few dozen rows): plain XLA, float32."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    m = jnp.broadcast_to(jnp.asarray(tree_mask, bool), (B, T, T))
    if window is not None:
        m = m & (q_pos[:, None, :] > q_pos[:, :, None] - window)
    qg = q.reshape(B, T, Hkv, G, D).astype(jnp.float32)
    s = jnp.einsum("btkgd,bjkd->bkgtj", qg, k.astype(jnp.float32)) * scale
    s = jnp.where(m[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # finite: a node always sees itself
    o = jnp.einsum("bkgtj,bjkd->btkgd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return o.reshape(B, T, Hq, D).astype(q.dtype), lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)


def tree_cache_attention(q, k, v, new_k, new_v, lengths, q_pos, tree_mask, *, scale: float | None = None,
                         window: int | None = None, mesh=None, interpret: bool = False, layer=None, **block_kw):
    """A token-tree verify on the Pallas path: q [B, T, Hq, D] of the T tree nodes (rope positions
    ``q_pos`` int [B, T]), the heads-major cache k, v [B, Hkv, S, D] whose committed slots are
    ``< lengths`` (int [B]), the nodes' own K/V ``new_k``/``new_v`` [B, T, Hkv, D], and
    ``tree_mask`` as :func:`specjax.models.layers.tree_cache_mask` takes it. The committed part
    runs on the decode kernel (each node: slots ``[max(q_pos - window + 1, 0), lengths - 1]``,
    only those blocks read), the tree part in :func:`tree_rows_attention`; the two merge through
    their log-sum-exps. Equal to XLA's masked attention over ``tree_cache_mask``. ``layer`` (int32):
    k, v are a stacked cache [L, B, Hkv, S, D] and that layer is read, in place."""
    mesh = ambient_mesh(mesh)
    interpret = interpret or _INTERPRET.get()
    B, T = q.shape[:2]
    lo = jnp.zeros((B, T), jnp.int32) if window is None else jnp.maximum(q_pos - (window - 1), 0).astype(jnp.int32)
    hi = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32)[:, None] - 1, (B, T))
    o_c, lse_c = _decode(q, k, v, lo, hi, mesh, dict(scale=scale, interpret=interpret, **block_kw), return_lse=True,
                         layer=layer)
    o_t, lse_t = tree_rows_attention(q, new_k, new_v, q_pos, tree_mask, scale=scale, window=window)
    return merge_attention(o_c, lse_c, o_t, lse_t)
