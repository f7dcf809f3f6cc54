"""Pruned draft vocabulary (speculators ``DraftVocabMixin`` buffers ``t2d`` / ``d2t``).

* ``d2t`` [Vd] int: an *offset*: draft id ``i`` means target id ``i + d2t[i]``.
* ``t2d`` [V] bool: which target ids are in the draft vocabulary; ``lm_head`` /
  ``verifier_lm_head`` rows are the verifier's rows ``W[t2d]`` in ascending target id order,
  so row ``i`` is target id ``nonzero(t2d)[i]``.

speculators never checks that the two agree (it selects lm_head rows with ``t2d`` and vLLM
maps ids with ``d2t``); :func:`check_mapping` does, and :func:`load_draft` refuses a
checkpoint where they disagree. With a full vocabulary (``Vd == V``) both are absent and
every function here is the identity.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.models.errors import ModelError


class VocabMappingError(ModelError, ValueError):
    """t2d / d2t missing, of the wrong shape, or inconsistent with each other."""


def check_mapping(t2d, d2t, *, vocab_size: int, draft_vocab_size: int, where: str | None = None) -> None:
    """Validate the pair as speculators' ``load_vocab_mappings`` does, plus consistency."""
    if draft_vocab_size == vocab_size:
        return  # speculators ignores mappings for a full vocabulary
    if t2d is None or d2t is None:
        missing = [n for n, a in (("t2d", t2d), ("d2t", d2t)) if a is None]
        raise VocabMappingError(f"draft_vocab_size {draft_vocab_size} != vocab_size {vocab_size} but {missing} "
                                "is absent", path=where, key=missing[0])
    t2d, d2t = np.asarray(t2d), np.asarray(d2t)
    if t2d.shape != (vocab_size,):
        raise VocabMappingError(f"t2d has shape {list(t2d.shape)}; expected [{vocab_size}]", path=where, key="t2d")
    if int(t2d.astype(bool).sum()) != draft_vocab_size:
        raise VocabMappingError(f"t2d selects {int(t2d.astype(bool).sum())} ids; expected draft_vocab_size "
                                f"{draft_vocab_size}", path=where, key="t2d")
    if d2t.shape != (draft_vocab_size,):
        raise VocabMappingError(f"d2t has shape {list(d2t.shape)}; expected [{draft_vocab_size}]", path=where, key="d2t")
    sel = np.nonzero(t2d.astype(bool))[0]
    tgt = np.arange(draft_vocab_size) + d2t.astype(np.int64)
    bad = np.nonzero(tgt != sel)[0]
    if bad.size:
        i = int(bad[0])
        raise VocabMappingError(f"d2t and t2d disagree: draft id {i} maps to target id {int(tgt[i])} by d2t but "
                                f"lm_head row {i} is target id {int(sel[i])} by t2d ({bad.size} ids differ)",
                                path=where, key="d2t")


def select_rows(weight, t2d):
    """The verifier's ``[V, H]`` rows kept by ``t2d`` (ascending target id), numpy."""
    w = np.asarray(weight)
    return w if t2d is None else w[np.asarray(t2d).astype(bool)]


def draft_to_target(ids, d2t):
    """Draft ids (any int shape) -> target ids: ``i + d2t[i]``."""
    if d2t is None:
        return ids
    return ids + jnp.asarray(d2t)[ids].astype(ids.dtype)


def target_to_draft(ids, t2d):
    """Target ids -> draft ids, ``-1`` for target ids outside the draft vocabulary."""
    if t2d is None:
        return ids
    t2d = jnp.asarray(t2d).astype(bool)
    rank = jnp.cumsum(t2d.astype(jnp.int32)) - 1  # [V]: draft id of each kept target id
    return jnp.where(t2d[ids], rank[ids], -1).astype(ids.dtype)


def to_target_logits(logits, d2t, vocab_size: int, fill=-jnp.inf):
    """Scatter draft logits ``[..., Vd]`` into a ``fill``-filled target-vocab tensor ``[..., V]``
    at ``arange(Vd) + d2t`` (vLLM's ``compute_logits``)."""
    if d2t is None:
        return logits
    vd = logits.shape[-1]
    idx = jnp.arange(vd) + jnp.asarray(d2t).astype(jnp.int32)
    out = jnp.full((*logits.shape[:-1], vocab_size), fill, logits.dtype)
    return out.at[..., idx].set(logits)
