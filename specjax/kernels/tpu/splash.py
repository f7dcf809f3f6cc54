"""Flash attention for TPU programs (prefill, extraction, training) on jax's splash kernel.

:func:`flash_attention` has ``layers.attend``'s contract with the mask given as a
:class:`~specjax.kernels.tpu.masks.MaskSpec` instead of a dense ``[B, 1, T, S]`` array::

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] (GQA: query head h reads kv head h // (Hq // Hkv))
    -> [B, T, Hq, D] in q's dtype

Memory is O(T) per head: scores are never stored; the backward pass (splash's dq/dkv kernels,
through its ``custom_vjp``) recomputes them block by block. Lengths that are not a multiple of
128 are padded here (padding keys get a segment no query holds; padding query rows are cut
off). A query row with no visible key gives finite garbage, as ``layers.attend`` does; a
``dense`` spec's empty rows see every key (exactly what ``attend`` computes for them).

Mosaic kernels cannot be partitioned by XLA: under a mesh call :func:`sharded_flash_attention`
(``jax.shard_map`` with batch over ``data``/``fsdp`` and heads over ``tensor``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info_lib

from specjax.kernels.tpu.masks import PAD_SEGMENT, MaskSpec, MaskSpecError, StaticMask

LANE = 128


class KernelShapeError(ValueError):
    """Inputs whose shapes the TPU attention kernels do not take (found vs expected)."""


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pick_block(n: int, target: int) -> int:
    """The largest multiple of 128 that is <= ``target`` and divides ``n`` (a multiple of 128)."""
    b = max(LANE, min(target, n) // LANE * LANE)
    while n % b:
        b -= LANE
    return b


def check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise KernelShapeError(f"expected q [B, T, Hq, D] and k = v [B, S, Hkv, D], got q {q.shape}, k {k.shape}, "
                               f"v {v.shape}")
    B, _, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise KernelShapeError(f"k {k.shape} does not match q {q.shape} in batch or head_dim")
    if Hq % k.shape[2]:
        raise KernelShapeError(f"query heads {Hq} are not a multiple of kv heads {k.shape[2]}")


@functools.lru_cache(maxsize=64)
def _static_tables(Tp: int, Sp: int, window, steps_before: int, heads: int, bq: int, bk: int, interpret: bool):
    """The block-sparsity tables of a static mask (numpy, computed once per shape) and the
    kernel's tree structure. Tables are kept as numpy so every trace embeds them as its own
    constants (a cached kernel would leak one trace's arrays into the next)."""
    mask = StaticMask((Tp, Sp), Tp, window, steps_before)
    with jax.ensure_compile_time_eval():
        kern = splash.make_splash_mha(splash_mask.MultiHeadMask([mask] * heads), block_sizes=_block_sizes(bq, bk),
                                      head_shards=1, q_seq_shards=1, interpret=interpret)
    bm = kern.fwd_mask_info.block_mask  # [1|heads, q blocks, kv blocks]: 0 skipped, 1 partial, 2 full
    active = (Tp // bq) * (Sp // bk) if bm is None else int(np.count_nonzero(np.asarray(bm)[0]))
    leaves, tree = jax.tree_util.tree_flatten(kern)
    return [np.asarray(x) for x in leaves], tree, active


def _static_kernel(*key):
    """A splash kernel for one batch row (q [Hq, Tp, D], k/v [Hkv, Sp, D]) of a static mask."""
    leaves, tree, _ = _static_tables(*key)
    return jax.tree_util.tree_unflatten(tree, [jnp.asarray(x) for x in leaves])


# ----------------------------------------------------------------------------- flop accounting
# Mosaic kernels are custom calls: XLA's cost_analysis counts no flops for them, and jax's splash
# kernel declares no CostEstimate. flash_attention reports what it runs to the active collectors
# instead (at trace time, one record per traced call), and `specjax plan` adds it to the compiler's
# count.

_COLLECTORS: list[list] = []
_PASSES: contextvars.ContextVar = contextvars.ContextVar("specjax_kernel_passes", default=None)


@contextlib.contextmanager
def forward_only():
    """Mark the flash-attention calls traced inside as run once, forward only, even inside a train
    step (the online target: no gradient reaches it): their records carry ``"passes": 1``."""
    token = _PASSES.set(1.0)
    try:
        yield
    finally:
        _PASSES.reset(token)


@contextlib.contextmanager
def count_kernel_flops():
    """Collect one record per :func:`flash_attention` traced inside the block (trace time, so wrap
    the ``lower()``): ``{"flops": forward flops the kernel executes (its non-empty blocks, whole),
    "exact": False where the mask is only known at run time (all blocks counted: an upper bound),
    "batch", "heads", "q_len", "kv_len", "head_dim", "blocks", "blocks_total", "passes": 1 inside
    :func:`forward_only`, else None}``. A call traced once
    inside a ``scan``/``while`` body is recorded once, whatever the trip count."""
    rec: list = []
    _COLLECTORS.append(rec)
    try:
        yield rec
    finally:
        _COLLECTORS.remove(rec)


def _record(*, B: int, Hq: int, Tp: int, Sp: int, D: int, bq: int, bk: int, active: int | None):
    if not _COLLECTORS:
        return
    total = (Tp // bq) * (Sp // bk)
    blocks = total if active is None else active
    rec = {"kernel": "splash", "batch": B, "heads": Hq, "q_len": Tp, "kv_len": Sp, "head_dim": D,
           "blocks": blocks, "blocks_total": total, "exact": active is not None,
           "flops": 4 * B * Hq * blocks * bq * bk * D,  # q k^T and p v: 2 matmuls of 2 flops per MAC
           "passes": _PASSES.get()}  # None: as many as the program runs (Program.kernel_passes)
    for c in _COLLECTORS:
        c.append(rec)


def _dynamic_kernel(mask, bq: int, bk: int, interpret: bool):
    """A splash kernel for a runtime mask [1, Tp, Sp] shared by all heads. Built from the mask
    tables directly: ``make_splash_mha`` turns the ``is_dynamic_mask`` flag into an array, which
    its own ``__call__`` then cannot branch on inside a trace."""
    kw = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1)
    fwd, _ = mask_info_lib.process_dynamic_mask(mask, (bq, bk), **kw)
    dq, _ = mask_info_lib.process_dynamic_mask(mask, (bq, bk), **kw)
    dkv, _ = mask_info_lib.process_dynamic_mask_dkv(mask, (bq, bk), shrink_grid=True, **kw)
    return splash.SplashAttentionKernel(fwd, dq, dkv, block_sizes=_block_sizes(bq, bk), is_mqa=False,
                                        save_residuals=False, mask_value=splash.DEFAULT_MASK_VALUE,
                                        attn_logits_soft_cap=None, residual_checkpoint_name=None,
                                        mask_function=None, interpret=interpret)


def _block_sizes(bq: int, bk: int) -> splash.BlockSizes:
    return splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                             block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _pad_chunks(x, chunks: int, T: int, Tp: int, value=0):
    """x [B, chunks*T, ...] -> [B, chunks*Tp, ...] with each chunk padded on its own."""
    if T == Tp:
        return x
    B, rest = x.shape[0], x.shape[2:]
    x = _pad_axis(x.reshape(B, chunks, T, *rest), 2, Tp, value)
    return x.reshape(B, chunks * Tp, *rest)


def flash_attention(q, k, v, *, mask: MaskSpec, scale: float | None = None, block_q: int = 512,
                    block_kv: int = 512, interpret: bool = False):
    """Masked GQA attention on the splash kernel (see the module docstring for the contract).
    ``interpret=True`` runs the kernel in Pallas interpret mode (CPU tests)."""
    check_qkv(q, k, v)
    B, T, Hq, D = q.shape
    S = k.shape[1]
    want = mask.kv_len(T)
    if mask.kind == "causal" and S != T:
        raise MaskSpecError(f"a causal self-attention spec needs as many keys as queries, got T={T}, S={S}")
    if want is not None and want != S:
        raise MaskSpecError(f"the {mask.kind} spec implies {want} keys for {T} queries, got k with {S}")
    scale = D ** -0.5 if scale is None else float(scale)

    Tp = round_up(T, LANE)
    chunks = mask.steps_before + 1 if mask.kind == "ttt" else 1
    Sp = chunks * Tp if mask.kind != "dense" else round_up(S, LANE)
    bq, bk = pick_block(Tp, block_q), pick_block(Sp, block_kv)

    # splash takes head-major [H, T, D] per batch row and does not scale the logits
    qh = _pad_axis((q * jnp.asarray(scale, q.dtype)).transpose(0, 2, 1, 3), 2, Tp)
    if mask.kind == "dense":
        kh, vh = (_pad_axis(x, 1, Sp).transpose(0, 2, 1, 3) for x in (k, v))
    else:
        kh, vh = (_pad_chunks(x, chunks, T, Tp).transpose(0, 2, 1, 3) for x in (k, v))

    seg = None
    if mask.has_segments or Tp != T or Sp != S:
        qs = jnp.zeros((B, T), jnp.int32) if not mask.has_segments else mask.q_segment_ids.astype(jnp.int32)
        ks = jnp.zeros((B, S), jnp.int32) if not mask.has_segments else mask.kv_segment_ids.astype(jnp.int32)
        if qs.shape != (B, T) or ks.shape != (B, S):
            raise MaskSpecError(f"segment ids {qs.shape} / {ks.shape} do not match [B, T] = {(B, T)} / "
                                f"[B, S] = {(B, S)}")
        ks = _pad_axis(ks, 1, Sp, PAD_SEGMENT) if mask.kind == "dense" else _pad_chunks(ks, chunks, T, Tp,
                                                                                        PAD_SEGMENT)
        seg = splash.SegmentIds(q=_pad_axis(qs, 1, Tp), kv=ks)

    if mask.kind == "dense":
        dm = mask.dense
        if dm.shape != (B, T, S):
            raise MaskSpecError(f"dense mask {dm.shape} does not match [B, T, S] = {(B, T, S)}")
        dm = _pad_axis(_pad_axis(dm, 1, Tp, False), 2, Sp, False)
        dm = dm | ~jnp.any(dm, axis=-1, keepdims=True)  # an empty row sees every key, as attend's uniform row

        def one(qb, kb, vb, mb, sb):
            return _dynamic_kernel(mb[None], bq, bk, interpret)(qb, kb, vb, segment_ids=sb)

        out = jax.vmap(one)(qh, kh, vh, dm, seg)
        _record(B=B, Hq=Hq, Tp=Tp, Sp=Sp, D=D, bq=bq, bk=bk, active=None)
    else:
        key = (Tp, Sp, mask.window, mask.steps_before, Hq, bq, bk, interpret)
        _record(B=B, Hq=Hq, Tp=Tp, Sp=Sp, D=D, bq=bq, bk=bk, active=_static_tables(*key)[2])
        kern = _static_kernel(*key)
        out = jax.vmap(lambda qb, kb, vb, sb: kern(qb, kb, vb, segment_ids=sb))(qh, kh, vh, seg)
    return out[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)


def mesh_specs(mesh, batch: int, kv_heads: int):
    """(batch spec entry, heads spec entry) for a mesh: batch over the ``data``/``fsdp`` axes whose
    product divides it (else replicated), heads over ``tensor`` when it divides the kv heads."""
    names = [a for a in ("data", "fsdp") if a in mesh.shape and mesh.shape[a] > 1]
    size = 1
    for a in names:
        size *= mesh.shape[a]
    bspec = (tuple(names) if len(names) > 1 else names[0]) if names and batch % size == 0 else None
    t = mesh.shape.get("tensor", 1)
    if t > 1 and kv_heads % t:
        raise KernelShapeError(f"kv heads {kv_heads} are not a multiple of the mesh's tensor axis {t}")
    return bspec, ("tensor" if t > 1 else None)


def sharded_flash_attention(q, k, v, *, mask: MaskSpec, mesh, scale: float | None = None, **kw):
    """:func:`flash_attention` inside ``jax.shard_map`` over ``mesh``: each device runs the
    kernel on its batch rows and heads (no communication)."""
    from jax.sharding import PartitionSpec as P

    check_qkv(q, k, v)
    bs, hs = mesh_specs(mesh, q.shape[0], k.shape[2])
    act = P(bs, None, hs, None)
    row = P(bs, None)
    arrays = {"q_segment_ids": mask.q_segment_ids, "kv_segment_ids": mask.kv_segment_ids, "dense": mask.dense}
    present = {n: a for n, a in arrays.items() if a is not None}
    specs = {n: (P(bs, None, None) if n == "dense" else row) for n in present}

    def body(q, k, v, extra):
        local = MaskSpec(mask.kind, window=mask.window, steps_before=mask.steps_before, **extra)
        return flash_attention(q, k, v, mask=local, scale=scale, **kw)

    return jax.shard_map(body, mesh=mesh, in_specs=(act, act, act, specs), out_specs=act,
                         check_vma=False)(q, k, v, present)
