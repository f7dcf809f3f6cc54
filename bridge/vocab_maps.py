"""The pruned-vocabulary buffers' values (speculators' ``vocab_mapping``): draft id ``i`` means
target id ``i + d2t[i]``, the selection is sorted ascending (so ``d2t`` is non-negative and the
target ids strictly increase), and ``t2d`` (bool [V]) is True exactly at those target ids. The
header only fixes their shapes; garbage values pass it and then map proposals to wrong or
out-of-range tokens, or (a ``t2d`` byte that is neither 0 nor 1) make an Orbax save unreadable."""

from __future__ import annotations

import numpy as np


def vocab_map_problems(d2t: np.ndarray, t2d_bytes: bytes, verifier_vocab: int) -> list[tuple[str, str]]:
    """``[(tensor, what is wrong)]`` for ``d2t`` int [Vd] and the raw bytes of ``t2d`` bool [V];
    empty when they are a valid mapping into a vocabulary of ``verifier_vocab`` tokens."""
    out: list[tuple[str, str]] = []
    raw = np.frombuffer(t2d_bytes, np.uint8)
    bad = np.flatnonzero(raw > 1)
    if bad.size:
        out.append(("t2d", f"t2d holds byte value {int(raw[bad[0]])} at index {int(bad[0])} (and {bad.size - 1} more); "
                           "a bool tensor stores only 0 or 1"))
    d2t = np.asarray(d2t, np.int64)
    tgt = np.arange(d2t.size, dtype=np.int64) + d2t
    if d2t.size and int(d2t.min()) < 0:
        i = int(np.argmin(d2t))
        out.append(("d2t", f"d2t[{i}] = {int(d2t[i])} is negative; speculators stores the non-negative offset "
                           "target id - draft id of an ascending selection"))
    outside = np.flatnonzero((tgt < 0) | (tgt >= verifier_vocab))
    if outside.size:
        i = int(outside[0])
        out.append(("d2t", f"draft id {i} maps to target id {int(tgt[i])} (d2t[{i}] = {int(d2t[i])}), outside the "
                           f"verifier vocabulary [0, {verifier_vocab}) ({outside.size} such ids)"))
    elif tgt.size > 1 and not np.all(np.diff(tgt) > 0):
        i = int(np.flatnonzero(np.diff(tgt) <= 0)[0])
        out.append(("d2t", f"target ids of draft ids {i} and {i + 1} are {int(tgt[i])} and {int(tgt[i + 1])}; "
                           "expected strictly increasing (each target id once, in ascending order)"))
    if not out and raw.size == verifier_vocab:
        sel = np.flatnonzero(raw)
        if sel.size != tgt.size or not np.array_equal(sel, tgt):
            extra = np.setdiff1d(sel, tgt)
            miss = np.setdiff1d(tgt, sel)
            out.append(("t2d", f"t2d marks {sel.size} target ids but d2t maps {tgt.size}; they disagree"
                               + (f" (t2d marks {int(extra[0])}, which no draft id maps to)" if extra.size else "")
                               + (f" (d2t maps to {int(miss[0])}, which t2d does not mark)" if miss.size else "")))
    return out
