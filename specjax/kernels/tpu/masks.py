"""Attention masks as the TPU kernels take them: a static structure plus runtime segment ids.

A :class:`MaskSpec` says which keys a query may see without materialising ``[T, S]``:

============  ==============================================================  ===================
kind          query t sees key j iff                                          used by
============  ==============================================================  ===================
``causal``    ``j <= t`` (``j > t - window`` with a window) and               target prefill,
              ``q_seg[t] == kv_seg[j]``                                       packed rows, MTP
``ttt``       keys are ``steps_before + 1`` chunks of T: in chunk 0 as        EAGLE-3 TTT step
              ``causal``; in chunk s >= 1 only ``j == t + s*T``; always
              ``q_seg[t] == kv_seg[j]``
``dense``     ``mask[b, t, j]`` (a runtime bool array)                        DFlash/DSpark block
                                                                              masks, P-EAGLE
============  ==============================================================  ===================

The static part (causal, window, TTT diagonals) becomes a splash-attention mask object whose
block sparsity is worked out at trace time and whose partial blocks are computed inside the
kernel; segment ids are runtime arrays (``[B, T]`` and ``[B, S]``). ``dense`` masks depend on
runtime data (DFlash anchors), so they go to splash's dynamic-mask path: one bool per (query,
key) shared by every head, with fully masked blocks still skipped.

:func:`dense_mask` turns any spec into the boolean ``[B, 1, T, S]`` that ``layers.attend``
takes; it is the XLA path and the reference the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

KINDS = ("causal", "ttt", "dense")
PAD_SEGMENT = int(np.iinfo(np.int32).min)  # kv segment of padding columns the wrapper adds


class MaskSpecError(ValueError):
    """A mask description that the kernels cannot take (unknown kind, bad shapes)."""


@dataclass(frozen=True)
class MaskSpec:
    kind: str
    window: int | None = None  # HF sliding window: key j visible from t iff t - window < j <= t
    steps_before: int = 0  # ttt: earlier TTT steps whose keys follow chunk 0
    q_segment_ids: Any = None  # int [B, T]
    kv_segment_ids: Any = None  # int [B, S]
    dense: Any = None  # bool [B, T, S] (kind "dense")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise MaskSpecError(f"mask kind {self.kind!r} is not one of {KINDS}")
        if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
            raise MaskSpecError("q_segment_ids and kv_segment_ids come together; got only one of them")
        if self.kind == "dense" and (self.dense is None or self.dense.ndim != 3):
            raise MaskSpecError(f"a dense mask spec needs a bool [B, T, S] mask, got "
                                f"{None if self.dense is None else self.dense.shape}")
        if self.window is not None and self.window < 1:
            raise MaskSpecError(f"sliding window must be >= 1, got {self.window}")
        if self.steps_before < 0 or (self.kind != "ttt" and self.steps_before):
            raise MaskSpecError(f"steps_before={self.steps_before} is only for kind 'ttt' (>= 0)")

    @property
    def has_segments(self) -> bool:
        return self.q_segment_ids is not None

    def kv_len(self, T: int) -> int | None:
        """Key length the spec implies for T queries (None: taken from the keys)."""
        if self.kind == "ttt":
            return (self.steps_before + 1) * T
        if self.kind == "dense":
            return int(self.dense.shape[-1])
        return None


def segments_from_documents(document_ids):
    """Packed-row document ids (int [B, T], -1 = padding) -> segment ids where a padding row
    matches only itself (``-2 - t``), as EAGLE-3's mask gives padding rows their diagonal."""
    T = document_ids.shape[-1]
    doc = jnp.asarray(document_ids, jnp.int32)
    return jnp.where(doc >= 0, doc, -2 - jnp.arange(T, dtype=jnp.int32)[None])


def causal(*, window: int | None = None, segment_ids=None, kv_valid=None) -> MaskSpec:
    """Causal (sliding with ``window``) self-attention, optionally restricted to equal
    ``segment_ids`` (int [B, T]: packed rows) or to valid keys ``kv_valid`` (bool [B, T]: HF
    ``attention_mask`` padding)."""
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg = kv_seg = jnp.asarray(segment_ids, jnp.int32)
    if kv_valid is not None:
        valid = jnp.asarray(kv_valid).astype(bool)
        base = jnp.zeros(valid.shape, jnp.int32) if q_seg is None else q_seg
        # an invalid key gets a segment no query holds
        q_seg, kv_seg = base, jnp.where(valid, base, PAD_SEGMENT + 1)
    return MaskSpec("causal", window=window, q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def ttt(document_ids, *, window: int | None, steps_before: int) -> MaskSpec:
    """EAGLE-3's training-time-test mask of step ``steps_before`` (``eagle3.ttt_mask``): keys
    are chunk 0 (this row's context, causal within the document) then one chunk per earlier step
    (only the query's own row)."""
    seg = segments_from_documents(document_ids)
    return MaskSpec("ttt", window=window, steps_before=int(steps_before), q_segment_ids=seg,
                    kv_segment_ids=jnp.tile(seg, (1, int(steps_before) + 1)))


def dense(mask) -> MaskSpec:
    """A runtime mask (bool [B, T, S] or [B, 1, T, S], True = attend) shared by every head."""
    m = jnp.asarray(mask)
    if m.ndim == 4:
        if m.shape[1] != 1:
            raise MaskSpecError(f"a dense mask must be shared by all heads ([B, 1, T, S]), got {m.shape}")
        m = m[:, 0]
    return MaskSpec("dense", dense=m.astype(bool))


def static_mask_function(T: int, window: int | None, steps_before: int):
    """The static part of a causal/ttt spec as ``f(q_ids, kv_ids) -> bool`` (numpy or jnp)."""

    def fn(q, kv):
        m = kv <= q
        if window is not None:
            m = m & (kv > q - window)
        for s in range(1, steps_before + 1):
            m = m | (kv == q + s * T)
        return m

    return fn


class StaticMask(splash_mask._ComputableMask):
    """A causal/ttt spec's static part for splash attention over padded lengths (Tp, Sp): the
    mask is evaluated block by block at trace time (block sparsity) and inside the kernel."""

    def __init__(self, shape: tuple[int, int], T: int, window: int | None, steps_before: int):
        self.key = (tuple(shape), T, window, steps_before)
        super().__init__(shape=tuple(shape), mask_function=static_mask_function(T, window, steps_before))

    def __eq__(self, other):
        return isinstance(other, StaticMask) and self.key == other.key

    def __hash__(self):
        return hash((StaticMask, self.key))


def dense_mask(spec: MaskSpec, T: int, S: int):
    """The spec as bool [B|1, 1, T, S] (True = attend), ``layers.attend``'s mask argument."""
    if spec.kind == "dense":
        if spec.dense.shape[1:] != (T, S):
            raise MaskSpecError(f"dense mask is {spec.dense.shape[1:]} for {T} queries and {S} keys")
        return spec.dense[:, None]
    want = spec.kv_len(T)
    if want is not None and want != S:
        raise MaskSpecError(f"a {spec.kind} mask with steps_before={spec.steps_before} needs {want} keys for "
                            f"{T} queries, got {S}")
    if spec.kind == "causal" and S != T:
        raise MaskSpecError(f"a causal self-attention mask needs as many keys as queries, got T={T}, S={S}")
    fn = static_mask_function(T, spec.window, spec.steps_before)
    m = fn(jnp.arange(T)[:, None], jnp.arange(S)[None, :])[None]
    if spec.has_segments:
        m = m & (spec.q_segment_ids[:, :, None] == spec.kv_segment_ids[:, None, :])
    return m[:, None]
