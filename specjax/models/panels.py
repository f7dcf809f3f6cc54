"""Panel-packed weights for CPU decoding: ``Dense`` kernels (and a tied LM head) stored as
contiguous column panels, multiplied by the native kernel of :mod:`specjax.kernels`.

A decode step multiplies a few rows (the batch, or the k+1 tokens being verified) by every weight
once, so it runs at the speed the weights stream from memory. XLA's CPU dot reads a row-major
``[K, N]`` kernel at a stride of N floats per row; on SmolLM2's 210 chained linear layers (2
cores, ``benchmarks/cpu_kernels.py``) it streams about 39 GB/s at 1 row and 31 GB/s at 4 rows,
the panel kernel 45-50 and 47 GB/s (and more when XLA runs independent calls side by side).

Layout: a kernel ``w`` [K, N] becomes ``wp`` [N / Wd, K, Wd] with ``wp[p, k, j] = w[k, p Wd + j]``
(:func:`pack`); a tied embedding ``E`` [V, H] becomes the panels of ``E^T`` (:func:`pack_embedding`).
``Wd`` (16, 32 or 64) is chosen by :func:`panel_width` so that there are enough panels to share
out over the threads.

Packing is a decode-time view of the params (:func:`decode_state`): each packed param becomes a
:class:`Paneled` holding the plain array beside its panels, the module is not touched, training
never sees it, and the panels are cached per source array while it lives, so repeated generate
calls on the same model pack once. Only float32 params are packed, and only when the kernels
built (:func:`specjax.kernels.available`); sharded runs keep the plain layout.

A float32 param whose every value is a bfloat16 (a draft or target from a bf16 checkpoint, run in
float32: speculators exports bf16) is packed into **bfloat16 panels** (:func:`bf16_exact`): the
kernel streams half the bytes and widens each weight back to the same float32 exactly, so the
products, the sums and the outputs are those of the float32 panels. ``SPECJAX_PANEL_BF16=0``
keeps float32 panels for every param (for side-by-side timing).

A bf16-compute state (``decode_state(compute="bfloat16")``: regenerating training data, or
``--compute bfloat16`` decoding) takes one of two layouts (:func:`bf16_layout`): k-pair panels for
the bf16 kernel -- ``vdpbf16ps``, or on a CPU with AMX tiles (``amx_bf16``) ``TDPBF16PS`` on the
same panels, which then takes every input -- or the weight itself in bfloat16 for XLA's bf16 dot
(a CPU with AMX whose kernel was built without the tiles, past :data:`BF16_KERNEL_ROWS_AMX` rows).
``benchmarks/cpu_kernels.py`` (2 cores with AMX, 2026-12-07): SmolLM2's 210 linear layers chained
take 8.6 / 9.4 / 9.5 / 11.9 / 17.4 / 23.6 ms at 1 / 4 / 8 / 16 / 32 / 64 rows on the tiles against
30.2 / 25.9 / 27.1 / 28.9 / 33.5 / 41.4 on XLA's bf16 dot (the ``vdpbf16ps`` kernel, 2026-12-06:
15.9 at 4 rows, 21.1 at 8, 49.0 at 32, 87.0 at 64); a whole decode step of the model at batch 64
93.4 against 113.9 ms (most of the rest is the float32 KV cache's attention).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import kernels, placement

MAX_ROWS = 16  # rows (batch x tokens) up to which the panel kernel runs; longer inputs (prefill) use XLA's dot
# the same bound for a bf16-compute state's k-pair panels (regeneration) where the kernel has neither AMX tiles nor
# vdpbf16ps (bf16_row_limit: with either it takes every row): its rows are bf16-rounded either way, and a decode step
# of 32 or 64 rows still streams each weight once (64 prompts x 96 tokens: 306 new tokens/s at 16 rows a step, 348
# at 32, 360 at 64); a prefill's thousands of rows take XLA's bf16 dot
MAX_ROWS_BF16 = 64
# a bf16-compute state's decode steps of more rows than this take XLA's bf16 dot on a CPU with AMX whose k-pair
# kernel was built without the tiles (bf16_layout)
BF16_KERNEL_ROWS_AMX = 8
WIDTHS = (64, 32, 16)
MIN_PANELS = 8  # prefer the widest panel that still gives this many (work units for the threads)
PANEL_DTYPES = (jnp.float32, jnp.bfloat16)


def bf16_panels_enabled() -> bool:
    """bf16-exact params get bfloat16 panels unless ``SPECJAX_PANEL_BF16`` is 0 / false / no / off."""
    return os.environ.get("SPECJAX_PANEL_BF16", "1").strip().lower() not in ("0", "false", "no", "off")


@jax.jit
def bf16_exact(w):
    """True when every value of float32 ``w`` is a bfloat16 (the round trip through bf16 gives it back)."""
    return jnp.all(w.astype(jnp.bfloat16).astype(w.dtype) == w)


@functools.lru_cache(maxsize=None)
def host_has_flag(flag: str) -> bool:
    """This host's CPU lists ``flag`` in ``/proc/cpuinfo``'s flags (read once a flag)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(ln.startswith("flags") and flag in ln.split() for ln in f)
    except OSError:
        return False


def host_has_amx() -> bool:
    """This host's CPU has AMX bf16 tiles (``amx_bf16`` in ``/proc/cpuinfo``'s flags)."""
    return host_has_flag("amx_bf16")


def kernel_has_amx() -> bool:
    """The k-pair kernel multiplies on AMX tiles here (:func:`specjax.kernels.amx_tiles`)."""
    return kernels.amx_tiles()


def bf16_layout(rows: int | None) -> str:
    """The layout of a bf16-compute state's weights for decode steps of ``rows`` rows (None: no
    decode steps, a prefill's many rows): ``"pairs"`` (k-pair panels, the bf16 kernel up to
    :func:`bf16_row_limit` rows) or ``"dot"`` (the weight in bfloat16, XLA's bf16 dot for every
    input). Where the kernel runs on AMX tiles (:func:`kernel_has_amx`): ``"pairs"`` for every
    input, decode steps and prefills alike (it streams each weight once at a few rows, where XLA's
    dot reads a weight at a fraction of the memory's speed, and beats it on a prefill; and a row's
    products and sums are the same whatever the other rows, so a prefill, a decode step and a
    verify multiply alike, bit for bit, where XLA's dot sums in an order of its choosing). On a
    host with AMX whose kernel lacks the tiles: ``"dot"`` with no decode steps or more than
    :data:`BF16_KERNEL_ROWS_AMX` rows. Without AMX: ``"pairs"``.
    ``SPECJAX_BF16_DOT`` = ``xla`` / ``kernel`` forces one."""
    force = os.environ.get("SPECJAX_BF16_DOT", "auto").strip().lower()
    if force not in ("auto", "xla", "kernel"):
        raise ValueError(f"SPECJAX_BF16_DOT must be auto, xla or kernel, got {force!r}")
    if force != "auto":
        return "dot" if force == "xla" else "pairs"
    if not host_has_amx() or kernel_has_amx():
        return "pairs"
    return "dot" if rows is None or rows > BF16_KERNEL_ROWS_AMX else "pairs"


def panel_width(n: int) -> int | None:
    """Panel width for an output dimension ``n``: the widest of 64/32/16 dividing it with at
    least ``MIN_PANELS`` panels, else the narrowest dividing it; None when 16 does not divide it."""
    fits = [w for w in WIDTHS if n % w == 0]
    if not fits:
        return None
    wide = [w for w in fits if n // w >= MIN_PANELS]
    return wide[0] if wide else fits[-1]


def pack(w, width: int | None = None):
    """Kernel [K, N] -> panels [N / Wd, K, Wd]."""
    K, N = w.shape
    width = width or panel_width(N)
    if width is None or N % width:
        raise ValueError(f"cannot pack a [{K}, {N}] kernel into panels of {width}: N must be a multiple of 16")
    return jnp.transpose(jnp.reshape(w, (K, N // width, width)), (1, 0, 2))


def pack_embedding(e, width: int | None = None):
    """Embedding [V, H] -> the panels of its transpose, [V / Wd, H, Wd] (the tied LM head)."""
    V, H = e.shape
    width = width or panel_width(V)
    if width is None or V % width:
        raise ValueError(f"cannot pack a [{V}, {H}] embedding into panels of {width}: V must be a multiple of 16")
    return jnp.transpose(jnp.reshape(e, (V // width, width, H)), (0, 2, 1))


def pack_pairs(w, width: int | None = None):
    """Kernel [K, N] -> bfloat16 k-pair panels [N / Wd, K / 2, Wd, 2] with
    ``wp[p, h, j, t] = w[2 h + t, p Wd + j]`` (rounded to bfloat16): the layout of the bf16-compute
    kernel (``specjax_panel_dot_bf16``), whose one instruction multiplies a pair of k per column."""
    K, N = w.shape
    width = width or panel_width(N)
    if width is None or N % width or K % 2:
        raise ValueError(f"cannot pack a [{K}, {N}] kernel into k-pair panels of {width}: K must be even and N a "
                         "multiple of 16")
    w = jnp.reshape(w.astype(jnp.bfloat16), (K // 2, 2, N // width, width))
    return jnp.transpose(w, (2, 0, 3, 1))


def pack_embedding_pairs(e, width: int | None = None):
    """Embedding [V, H] -> the k-pair panels of its transpose (a tied LM head in bf16 compute)."""
    return pack_pairs(jnp.transpose(e), width)


def pack_dot(w):
    """Kernel [K, N] -> the same in bfloat16: a bf16-compute state's ``"dot"`` layout (:func:`bf16_layout`)."""
    return w.astype(jnp.bfloat16)


def pack_embedding_dot(e):
    """Embedding [V, H] -> its transpose [H, V] in bfloat16 (a tied LM head in the ``"dot"`` layout)."""
    return pack_dot(jnp.transpose(e))


def _dot_layout(wp) -> bool:
    return wp.ndim == 2


def _bf16_state(value) -> bool:
    """``value`` is a weight of a bf16-compute decode state: k-pair panels (4-D) or the ``"dot"`` layout (2-D)."""
    return isinstance(value, Paneled) and value.packed.ndim in (2, 4)


def unpack(wp):
    """Panels [P, K, Wd] -> kernel [K, P Wd]."""
    P, K, W = wp.shape
    return jnp.reshape(jnp.transpose(wp, (1, 0, 2)), (K, P * W))


def _fits(dtype, rows: int, limit: int | None = None) -> bool:
    return jnp.dtype(dtype) == jnp.float32 and rows <= (MAX_ROWS if limit is None else limit) and kernels.available()


def row_limit(value) -> int:
    """How many rows (batch x tokens) a decode-time weight's matmul takes in its packed layout:
    :func:`bf16_row_limit` for bf16-compute k-pair panels, any number for the bf16 ``"dot"`` layout
    (XLA's dot), else :data:`MAX_ROWS`."""
    if isinstance(value, Paneled) and _dot_layout(value.packed):
        return 1 << 62
    return bf16_row_limit() if _bf16_state(value) else MAX_ROWS


def kernel_has_dpbf16() -> bool:
    """The k-pair kernel's vector path multiplies with ``vdpbf16ps`` here (:func:`specjax.kernels.dpbf16`)."""
    return kernels.dpbf16()


def bf16_row_limit() -> int:
    """How many rows a bf16-compute state's k-pair kernel and cached attention take: any number
    where the kernel runs on AMX tiles (:func:`kernel_has_amx`) or on ``vdpbf16ps``
    (:func:`kernel_has_dpbf16`): a prefill too; else :data:`MAX_ROWS_BF16` (the kernel's two float32
    FMAs a pair, where XLA's dot is the better choice for a prefill). On 2 cores with AVX512-BF16 and
    no AMX (2026-12-07, SmolLM2, one prompt, ``/tmp`` script): a prefill of 128 / 256 / 480 / 1000 /
    2000 rows took 0.12 / 0.25 / 0.41 / 1.1 / 2.15 s on the kernels against 0.23 / 0.39 / 0.55 / 1.4 /
    3.2 s with XLA's bf16 dot and masked attention past 64 rows."""
    return 1 << 62 if kernel_has_amx() or kernel_has_dpbf16() else MAX_ROWS_BF16


def attention_row_limit(value) -> int:
    """Query rows the cached attention (and :func:`rows_fit`'s work) of a layer holding ``value``
    takes on the kernels: any number in a bf16-compute state, a prefill's too (XLA's masked attention
    rounded a bf16 prefill by the program around it: docs/main-job.md, 2026-12-08); else :data:`MAX_ROWS`."""
    return (1 << 62) if _bf16_state(value) else MAX_ROWS


def fits(x, limit: int | None = None) -> bool:
    """The panel kernel takes this input: float32, at most ``limit`` (default :data:`MAX_ROWS`)
    rows (batch x tokens) -- more rows (a prefill) are compute-bound, where XLA's GEMM on the
    plain kernel is the better choice -- and the kernels are available."""
    return _fits(x.dtype, math.prod(x.shape[:-1]), limit)


def bf16_compute(value, dtype=None, out_sharding=None) -> bool:
    """``value`` is a decode-time :class:`Paneled` weight of a bf16-compute state
    (``decode_state(..., compute="bfloat16")``: k-pair panels or the bf16 ``"dot"`` layout, bf16
    products for every input),
    for a layer computing in float32 (``dtype`` None or float32) with no output sharding asked for."""
    return _bf16_state(value) and out_sharding is None and (dtype is None or jnp.dtype(dtype) == jnp.float32)


def panels_for(value, x, *, dtype=None, out_sharding=None):
    """The panels to multiply ``x`` by, or None for the layer's own path: ``value`` (a kernel or
    tied embedding's value) is a decode-time :class:`Paneled`, the layer computes in float32
    (``dtype`` None or float32: a bf16-compute layer keeps its own arithmetic), no output
    sharding is asked for, and ``x`` :func:`fits`."""
    if (isinstance(value, Paneled) and out_sharding is None
            and (dtype is None or jnp.dtype(dtype) == jnp.float32) and fits(x, row_limit(value))):
        return value.packed
    return None


def attention_fits(q_proj, q, k) -> bool:
    """The target's cached attention runs on :func:`decode_attention`: the forward is in the panel
    view (``q_proj``'s kernel is :class:`Paneled`: single-device CPU), ``q`` [B, T, Hq, D] has at
    most :data:`MAX_ROWS` tokens (:func:`row_limit` of ``q_proj``'s kernel: more in a bf16-compute
    state), and ``q`` and the cache ``k`` are float32."""
    value = q_proj.kernel.get_value()
    return (isinstance(value, Paneled) and k.dtype == jnp.float32
            and _fits(q.dtype, q.shape[0] * q.shape[1], attention_row_limit(value)))


def rows_fit(value, x) -> bool:
    """A decode-loop forward's row-wise work (rotary embedding, RMSNorm) runs on the kernels
    (:func:`rope`, :func:`rms_normed`): the layer is in the panel view (``value``, one of its
    weights, is :class:`Paneled`) and ``x`` [..., hidden] is float32 with no more rows than the
    cached attention takes on its kernel (:func:`attention_row_limit`): the steps and verifies of a
    decode loop (and a bf16 state's prefills) round alike whatever their shapes; a float32 prefill
    keeps XLA's arithmetic, bit for bit the plain params' own."""
    return isinstance(value, Paneled) and _fits(x.dtype, math.prod(x.shape[:-1]), attention_row_limit(value))


def rms_normed(x, eps: float):
    """``x / sqrt(mean(x^2) + eps)`` over the last axis on the native kernel, each row summed in
    one order whatever the number of rows (XLA's CPU reduction changes its order at 8 rows).
    float32 [..., D] -> float32 [..., D]."""
    if x.dtype != jnp.float32:
        raise TypeError(f"rmsnorm kernel takes float32, got {x.dtype}")
    D = x.shape[-1]
    y = jax.ffi.ffi_call("specjax_rmsnorm", jax.ShapeDtypeStruct((math.prod(x.shape[:-1]), D), jnp.float32),
                         vmap_method="sequential")(jnp.reshape(x, (-1, D)), eps=np.float32(eps))
    return jnp.reshape(y, x.shape)


def rope(q, k, cos, sin):
    """The neox rotary embedding of ``q`` [B, T, Hq, D] and ``k`` [B, T, Hkv, D] by ``cos``/``sin``
    [B, T, R] (R <= D rotary channels) on the native kernel, each product and sum rounded on its
    own: :func:`specjax.models.rope.apply_rope`'s arithmetic as PyTorch's eager ops do it, where
    XLA's CPU fusions contract a product into the add or not depending on the program's shapes
    (a batch-1 decode loop's keys then differed by an ulp from a batch-2 or a verify forward's,
    enough to change bf16 greedy tokens). All float32."""
    B, T, Hq, D = q.shape
    Hk, R = k.shape[2], cos.shape[-1]
    if k.shape[:2] != (B, T) or k.shape[3] != D or cos.shape != (B, T, R) or sin.shape != cos.shape or R % 2 or R > D:
        raise ValueError(f"rope: q {q.shape}, k {k.shape}, cos {cos.shape} and sin {sin.shape} do not fit")
    N = B * T
    qo, ko = jax.ffi.ffi_call("specjax_rope", (jax.ShapeDtypeStruct((N, Hq, D), jnp.float32),
                                               jax.ShapeDtypeStruct((N, Hk, D), jnp.float32)),
                              vmap_method="sequential")(jnp.reshape(q, (N, Hq, D)), jnp.reshape(k, (N, Hk, D)),
                                                        jnp.reshape(cos, (N, R)), jnp.reshape(sin, (N, R)))
    return jnp.reshape(qo, q.shape), jnp.reshape(ko, k.shape)


def matmul(x, wp):
    """``x @ w`` on the panel kernel: ``x`` [..., K] float32 and packed ``wp`` [P, K, Wd] (float32,
    or bfloat16 widened exactly to float32 in the kernel) -> float32 [..., P Wd]. K-pair panels
    ``wp`` [P, K/2, Wd, 2] (:func:`pack_pairs`) compute in bf16 instead: ``x`` rounded to
    bfloat16, products accumulated in float32. Needs :func:`specjax.kernels.available`. A bf16
    ``"dot"`` layout ``wp`` [K, N] (:func:`pack_dot`): the same arithmetic on XLA's bf16 dot."""
    if _dot_layout(wp):
        if x.shape[-1] != wp.shape[0]:
            raise ValueError(f"bf16 dot: x has {x.shape[-1]} features, the weight expects {wp.shape[0]}")
        return bf16_dot(x, wp)
    if wp.ndim == 4:
        P, H, W, _ = wp.shape
        if x.shape[-1] != 2 * H:
            raise ValueError(f"panel matmul: x has {x.shape[-1]} features, the packed kernel expects {2 * H}")
        lead = x.shape[:-1]
        M = math.prod(lead)
        y = jax.ffi.ffi_call("specjax_panel_dot_bf16", jax.ShapeDtypeStruct((M, P * W), jnp.float32),
                             vmap_method="sequential")(jnp.reshape(x, (M, 2 * H)).astype(jnp.bfloat16), wp)
        return jnp.reshape(y, (*lead, P * W))
    P, K, W = wp.shape
    if x.shape[-1] != K:
        raise ValueError(f"panel matmul: x has {x.shape[-1]} features, the packed kernel expects {K}")
    if x.dtype != jnp.float32 or wp.dtype not in PANEL_DTYPES:
        raise TypeError(f"panel matmul takes float32 rows and float32 or bfloat16 panels, got x {x.dtype} and "
                        f"panels {wp.dtype}")
    lead = x.shape[:-1]
    M = math.prod(lead)
    target = "specjax_panel_matmul_bf16" if wp.dtype == jnp.bfloat16 else "specjax_panel_matmul"
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((M, P * W), jnp.float32),
                         vmap_method="sequential")(jnp.reshape(x, (M, K)), wp)
    return jnp.reshape(y, (*lead, P * W))


def bf16_dot(x, w):
    """``x @ w`` with both rounded to bfloat16, products accumulated in float32 and float32 out
    (XLA's native bf16 dot on the CPU: AMX tiles where the CPU has them): the bf16-compute
    kernels' arithmetic, for the ``"dot"`` layout and for a prefill's rows past the k-pair
    kernel's limit. ``x`` [..., K], ``w`` [K, N]."""
    lead = x.shape[:-1]
    y = jax.lax.dot_general(jnp.reshape(x, (-1, x.shape[-1])).astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                            (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.reshape(y, (*lead, w.shape[-1]))


def decode_attention(q, k, v, positions, *, window: int | None, scale: float):
    """Attention of a few query tokens over a heads-major cache on the native kernel, reading only
    the visible slots: ``q`` [B, T, Hq, D], ``k``/``v`` [B, Hkv, S, D], ``positions`` int [B, T]
    -> [B, T, Hq, D]. Slot j is visible from query (b, t) iff ``j <= positions[b, t]`` (and
    ``j > positions[b, t] - window``): :func:`specjax.models.layers.attend_cache` under
    :func:`specjax.models.layers.causal_mask`, which scores all S slots and masks. All float32."""
    hi = jnp.asarray(positions, jnp.int32)
    return range_attention(q, k, v, window_start(hi, window), hi, scale=scale)


def window_start(hi, window: int | None):
    """The first slot a query at slot ``hi`` (int [...]) sees: ``hi - window + 1`` clipped at 0,
    or 0 without a window (None or 0)."""
    hi = jnp.asarray(hi, jnp.int32)
    return jnp.maximum(hi - (window - 1), 0) if window else jnp.zeros_like(hi)


def range_attention(q, k, v, lo, hi, *, scale: float, seq_major: bool = False):
    """Attention of a few query tokens over a cache on the native kernel, query (b, t) seeing the
    slots ``lo[b, t] .. hi[b, t]`` (inclusive; int [B, T]): ``q`` [B, T, Hq, D], ``k``/``v``
    [B, Hkv, S, D] (heads-major, the target's cache) or [B, S, Hkv, D] (``seq_major``, a draft's
    :class:`specjax.models.drafts.common.DraftCache`) -> [B, T, Hq, D]. All float32."""
    B, T, Hq, D = q.shape
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype != jnp.float32:
            raise TypeError(f"decode attention takes float32, got {name} {a.dtype}")
    hkv = k.shape[2] if seq_major else k.shape[1]
    if k.shape != v.shape or k.ndim != 4 or k.shape[0] != B or k.shape[3] != D or Hq % hkv:
        raise ValueError(f"decode attention: q {q.shape} does not fit k {k.shape} / v {v.shape}")
    return jax.ffi.ffi_call("specjax_decode_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")(q, k, v, jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32),
                                                      scale=np.float32(scale), seq_major=np.int64(bool(seq_major)))


def tree_fits(window: int | None, T: int) -> bool:
    """:func:`tree_attention` is exact for a tree of T tokens under this sliding window: none, or
    at least T wide (then every ancestor is inside the window and the committed slots' window
    starts at or before the tree's first slot)."""
    return not window or window >= T


def tree_attention(q, k, v, positions, base, tree_mask, *, window: int | None, scale: float):
    """A token-tree verify's attention on the native kernel: ``q`` [B, T, Hq, D], heads-major
    ``k``/``v`` [B, Hkv, S, D] with tree token t at slot ``base[b] + t`` (int [B]), rope
    ``positions`` int [B, T], ``tree_mask`` bool [B, T, T] (ancestor-or-self, diagonal set) ->
    [B, T, Hq, D]: :func:`specjax.models.layers.attend_cache` under
    :func:`specjax.models.layers.tree_cache_mask`. Needs :func:`tree_fits`. All float32."""
    B, T = q.shape[:2]
    if not tree_fits(window, T):
        raise ValueError(f"tree attention on the kernel needs a sliding window >= {T} tree tokens, got {window}")
    base = jnp.asarray(base, jnp.int32)
    lo = window_start(jnp.asarray(positions, jnp.int32), window)
    hi = jnp.broadcast_to(base[:, None] + (T - 1), (B, T))
    tm = jnp.broadcast_to(jnp.asarray(tree_mask, bool), (B, T, T)).astype(jnp.uint8)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype != jnp.float32:
            raise TypeError(f"tree attention takes float32, got {name} {a.dtype}")
    return jax.ffi.ffi_call("specjax_tree_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")(q, k, v, lo, hi, base, tm, scale=np.float32(scale))


@jax.tree_util.register_pytree_node_class
class Paneled:
    """A weight in both layouts, the value of a ``Dense.kernel`` (or a tied embedding) in a
    decode-time state: ``plain`` (the param as it is, shared with the module) and ``packed`` (its
    panels). It reads as the plain array -- ``variable[...]``, ``.shape``, ``.dtype``,
    ``jnp.asarray`` -- so code that is not panel-aware sees the ordinary param; ``Dense`` and
    ``Embed.attend`` take ``packed`` for inputs that :func:`fits` (:func:`panels_for`)."""

    __slots__ = ("plain", "packed")

    def __init__(self, plain, packed):
        self.plain, self.packed = plain, packed

    def tree_flatten(self):
        return (self.plain, self.packed), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def __getitem__(self, index):
        return self.plain[index]

    def __jax_array__(self):
        return self.plain

    shape = property(lambda self: self.plain.shape)
    dtype = property(lambda self: self.plain.dtype)
    ndim = property(lambda self: self.plain.ndim)
    size = property(lambda self: self.plain.size)

    def __repr__(self):
        return f"Paneled({self.plain.shape} {self.plain.dtype}, panels {self.packed.shape})"


# ----------------------------------------------------------------------------- decode-time state


def packable(root) -> dict:
    """State paths of ``root`` to pack: ``{path: "kernel" | "embedding"}`` for every ``Dense``
    kernel (float32, 2-D, output dim a multiple of 16) and every tied target LM head's embedding.
    A ``Dense`` is recognised by its ``panel_param`` class attribute (layers imports panels, not
    the other way round)."""

    def ok(a, n):
        return a.ndim == 2 and a.dtype == jnp.float32 and panel_width(a.shape[n]) is not None

    out = {}
    for path, node in nnx.iter_graph(root):
        if getattr(node, "panel_param", None) == "kernel":
            if ok(node.kernel.get_value(), 1):
                out[tuple(path) + ("kernel",)] = "kernel"
        elif getattr(node, "lm_head", 0) is None and hasattr(node, "model") and hasattr(node.model, "embed_tokens"):
            if ok(node.model.embed_tokens.embedding.get_value(), 0):
                out[tuple(path) + ("model", "embed_tokens", "embedding")] = "embedding"
    return out


_PACKABLE: OrderedDict = OrderedDict()  # ids of a state's leaves -> (weakrefs to them, packable(root))
_PACKABLE_MAX = 16
_PACKABLE_LOCK = threading.Lock()


def _packable_cached(root, leaves) -> dict:
    """:func:`packable` of ``root``, remembered for the same param arrays (the same objects, alive:
    a decode loop's cached ``nnx.split``; the module classes around them are taken to be the
    same, as they are for a ``Pair`` rebuilt around the same target and draft). Walking the
    graph costs ~18 ms on SmolLM2 with its draft (3 ms remembered), on every decode call of a
    bench or a generate loop."""
    key = tuple(map(id, leaves))
    with _PACKABLE_LOCK:
        hit = _PACKABLE.get(key)
        if hit is not None and all(r() is x for r, x in zip(hit[0], leaves)):
            _PACKABLE.move_to_end(key)
            return hit[1]
    paths = packable(root)
    try:
        refs = [weakref.ref(x) for x in leaves]
    except TypeError:  # a leaf that is not weak-referenceable: not remembered
        return paths
    with _PACKABLE_LOCK:
        _PACKABLE[key] = (refs, paths)
        while len(_PACKABLE) > _PACKABLE_MAX:
            _PACKABLE.popitem(last=False)
    return paths


class _Cache:
    """Packed arrays per source array, keyed by ``id`` and held only while the source lives (a
    weak reference; its finaliser drops the entry), so a model that goes away takes its panels
    with it."""

    def __init__(self):
        self.items: dict = {}  # key -> (weakref to the source, packed)
        self.lock = threading.Lock()

    def _drop(self, key):
        with self.lock:
            self.items.pop(key, None)

    def get(self, x, kind: str):
        key = (id(x), kind, bf16_panels_enabled())
        with self.lock:
            hit = self.items.get(key)
        if hit is not None and hit[0]() is x:
            return hit[1]
        packed = _PACKERS[kind](x)
        with self.lock:
            self.items[key] = (weakref.ref(x), packed)
        weakref.finalize(x, self._drop, key)
        return packed


def _packer(layout):
    as_f32, as_bf16 = jax.jit(layout), jax.jit(lambda w: layout(w).astype(jnp.bfloat16))

    def run(x):
        """Panels of ``x``: bfloat16 when every value is one (lossless, half the bytes), else float32."""
        return as_bf16(x) if bf16_panels_enabled() and bool(bf16_exact(x)) else as_f32(x)
    return run


_PACKERS = {"kernel": _packer(pack), "embedding": _packer(pack_embedding),
            "kernel-bf16": jax.jit(pack_pairs), "embedding-bf16": jax.jit(pack_embedding_pairs),
            "kernel-bf16dot": jax.jit(pack_dot), "embedding-bf16dot": jax.jit(pack_embedding_dot)}
COMPUTE_DTYPES = ("float32", "bfloat16")
CACHE = _Cache()


def _single_device(x) -> bool:
    return isinstance(x, jax.Array) and len(x.sharding.device_set) == 1


def decode_state(root, state, *, compute: str = "float32", rows: int | None = None):
    """``state`` (``nnx.split(root)[1]``) with the :func:`packable` params in panel layout, for
    a single-device CPU decode when the kernels are available; else ``state`` unchanged (params
    on another platform, e.g. a TPU, whatever the process's default backend is).

    ``compute="bfloat16"``: every packed matmul computes in bf16 with float32 accumulation (k-pair
    panels on the ``vdpbf16ps`` kernel for a few rows, XLA's bf16 dot for a prefill; weights and
    inputs rounded to bfloat16, outputs float32; attention, norms and the residual stream stay
    float32). Not float32's outputs: for work that takes bf16 arithmetic anyway (regenerating
    training data), about twice the throughput on a CPU with AVX512-BF16. ``rows``: the rows
    (batch x tokens) of the state's decode steps (None: none, prefills only), which pick the bf16
    layout (:func:`bf16_layout`)."""
    check_compute(compute)
    if not kernels.available(placement.platform_of(state)):
        return state
    leaves = jax.tree_util.tree_leaves(state)
    paths = _packable_cached(root, leaves)
    if not paths:
        return state
    if not all(_single_device(x) for x in leaves):
        return state
    suffix = "bf16dot" if compute == "bfloat16" and bf16_layout(rows) == "dot" else "bf16"

    def swap(kp, x):
        path = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in kp)
        if path and path[-1] == "value":
            path = path[:-1]
        kind = paths.get(path)
        if kind is None:
            return x
        return Paneled(x, CACHE.get(x, kind if compute == "float32" else f"{kind}-{suffix}"))

    return jax.tree_util.tree_map_with_path(swap, state)


def check_compute(compute: str, mesh=None) -> str:
    """``compute`` for a decode loop: one of :data:`COMPUTE_DTYPES`; ``"bfloat16"`` is the
    single-device CPU kernels' arithmetic, refused for a loop sharded over ``mesh`` (more than one
    device: there the params' own dtype decides, ``--dtype bfloat16``)."""
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"decode compute dtype must be one of {COMPUTE_DTYPES}, got {compute!r}")
    if compute != "float32" and mesh is not None and mesh.size > 1:
        raise ValueError(f"compute={compute!r} is the single-device CPU kernels' arithmetic; a loop sharded over "
                         f"{mesh.size} devices computes in its params' dtype (load them as bfloat16 instead)")
    return compute


def panel_dtypes(state) -> dict[str, list[str]]:
    """``{part: sorted panel dtypes}`` of a decode-time ``state`` (``part`` = the first path
    element, e.g. ``target`` / ``draft`` of a pair); parts with no panels are left out."""
    out: dict[str, set] = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda a: isinstance(a, Paneled))[0]:
        if isinstance(x, Paneled):
            head = getattr(kp[0], "key", getattr(kp[0], "name", kp[0]))
            out.setdefault(str(head), set()).add(jnp.dtype(x.packed.dtype).name)
    return {k: sorted(v) for k, v in out.items()}
