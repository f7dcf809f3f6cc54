"""Packed rows exactly as speculators 0.9.0 builds them (``train/data.py``,
``distributed_batch_sampler.py``, ``models/eagle3/data.py``).

* :func:`multipack_batches`: the multipack/LPT sampler. Each epoch, row indices are permuted
  with ``numpy.random.default_rng(seed + epoch)``; consecutive rows go into one packed row while
  their lengths (clipped to ``total_seq_len``) fit. Same batches, same order as speculators.
* :func:`collate`: concatenates the samples (after the per-algorithm shift), truncates the last
  to fit, zero-pads the tail; ``document_ids`` = sample index, -1 on padding; ``position_ids``
  restart per sample (0 on padding).
* :func:`shift_eagle3`: row ``j`` holds ``(x_{j+1}, g_j, y_{j+1}, l_{j+1}, pos_{j+1})``.

A sample dict: ``hidden_states`` [T, A*H] (aux, flattened), ``input_ids`` [T],
``verifier_last_hidden_states`` [T, H], ``loss_mask`` [T], ``position_ids`` [T].
"""

from __future__ import annotations

from heapq import heapreplace
from typing import Callable, NamedTuple, Sequence

import numpy as np


class _Bin(NamedTuple):
    fill: int
    slot: int


def _lpt_packed_batch(lengths, max_len, num_replicas, start_index, rank, rotation):
    local, heap = [], [_Bin(0, i) for i in range(num_replicas)]
    target_slot = (rank - rotation) % num_replicas
    indices = np.argsort(lengths)[::-1]
    for idx, size in zip(indices, lengths[indices]):
        new_fill = heap[0].fill + size
        if new_fill > max_len:
            return None
        if heap[0].slot == target_slot:
            local.append(start_index + idx)
        heapreplace(heap, _Bin(new_fill, heap[0].slot))
    return local


def _assign(lengths, max_len, rank, replicas):
    so_far, ind, result = 0, 0, []
    cums = np.cumsum(lengths)
    while True:
        if len(lengths) - ind < replicas:
            break
        left = 1
        right = 1 + np.searchsorted(cums[ind:], so_far + max_len * replicas, "right")
        rotation = len(result)
        batch = None
        while right - left > 1 and right > replicas:
            mid = (left + right) // 2
            batch = _lpt_packed_batch(lengths[ind: ind + mid], max_len, replicas, ind, rank, rotation)
            if batch is None:
                right = mid
            else:
                left = mid
        if batch is None:
            batch = _lpt_packed_batch(lengths[ind: ind + left], max_len, replicas, ind, rank, rotation)
        ind += left
        so_far = cums[ind - 1]
        result.append(batch)
    return result


def multipack_batches(lengths: Sequence[int], total_seq_len: int, *, seed: int, epoch: int, num_replicas: int = 1,
                      rank: int = 0) -> list[np.ndarray]:
    """speculators' ``MultipackDistributedBatchSamplerV2._generate_batches(epoch)`` (rows longer
    than ``total_seq_len`` are truncated, not dropped)."""
    lens = np.clip(np.asarray(lengths, np.int64), 0, total_seq_len)
    rng = np.random.default_rng(seed=seed + epoch)
    indices = rng.permutation(np.arange(len(lens)))
    batches = _assign(lens[indices], total_seq_len, rank, num_replicas)
    return [indices[np.asarray(b, np.int64)] if len(b) else np.zeros((0,), np.int64) for b in batches]


def shift_eagle3(s: dict) -> dict:
    return {"input_ids": s["input_ids"][1:], "hidden_states": s["hidden_states"][:-1],
            "verifier_last_hidden_states": s["verifier_last_hidden_states"][1:], "loss_mask": s["loss_mask"][1:],
            "position_ids": s["position_ids"][1:]}


_KEYS = ("hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "position_ids")


def collate(samples: list[dict], max_len: int, *, hidden_size: int, num_aux: int, preprocess: Callable | None = None,
            hs_dtype=None) -> dict[str, np.ndarray]:
    """One packed row ``[1, max_len, ...]`` (speculators' ``CollateFn``)."""
    samples = [preprocess(s) if preprocess else s for s in samples]
    if not samples:
        samples = [{"hidden_states": np.zeros((0, num_aux * hidden_size), np.float32),
                    "input_ids": np.zeros((0,), np.int64),
                    "verifier_last_hidden_states": np.zeros((0, hidden_size), np.float32),
                    "loss_mask": np.zeros((0,), np.int64), "position_ids": np.zeros((0,), np.int64)}]
        samples = [preprocess(s) if preprocess else s for s in samples] if preprocess else samples
    out = {}
    for k in _KEYS:
        first = np.asarray(samples[0][k])
        dt = (hs_dtype or first.dtype) if "hidden_states" in k else first.dtype
        buf = np.zeros((max_len, *first.shape[1:]), dt)
        off = 0
        for s in samples:
            t = np.asarray(s[k])
            n = min(t.shape[0], max_len - off)
            buf[off: off + n] = t[:n]
            off += n
            if off == max_len:
                break
        out[k] = buf[None]
    lengths, cum = [], 0
    for s in samples:
        n = int(np.asarray(s["input_ids"]).shape[0])
        if n + cum >= max_len:
            lengths.append(max_len - cum)
            break
        lengths.append(n)
        cum += n
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    out["document_ids"] = np.concatenate([doc, -np.ones(max_len - doc.shape[0], np.int64)])[None]
    return out
