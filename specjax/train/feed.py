"""Feeding the trainer: the rows of a data directory with their cached hidden states, packed per
(seed, epoch, rows per step) in speculators' multipack order, and a background thread that
builds the next packed rows while the device computes."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specjax.train.errors import HiddenStateCacheError
from specjax.train.hidden_states import hs_path, read_hs
from specjax.train import algorithms, online
from specjax.train.packing import collate, multipack_batches


class TrainData:
    """Rows of a data directory with their cached hidden states, packed per (seed, epoch)."""

    def __init__(self, data_dir: str | os.PathLike, rows, indices, *, algo: str, num_aux: int, hidden_size: int,
                 total_seq_len: int, seed: int, replicas: int = 1, prompt_loss: bool = False, online=None,
                 max_context_tokens: int | None = None, context_loss: bool = False):
        self.dir = Path(data_dir)
        self.online = bool(online)  # hidden states from the target inside the step (specjax.train.online)
        self.target_lengths: set[int] = set()  # online: the target-row lengths built (one step compile each)
        self.rows = rows
        self.indices = np.asarray(list(indices), np.int64)
        self.algo = algo
        self.shift = algorithms.get(algo).shift_batch  # speculators' shift_batch, or None
        self.num_aux = num_aux
        self.hidden = hidden_size
        self.T = total_seq_len
        self.seed = seed
        self.replicas = int(replicas)
        self.prompt_loss = bool(prompt_loss)  # every position supervised (the targets are the target's logits)
        # at most this many unsupervised positions kept before a row's first supervised one (None: all)
        self.context = None if prompt_loss or max_context_tokens is None else int(max_context_tokens)
        # every position a trimmed row keeps is supervised (its kept prompt tail too)
        self.context_loss = bool(context_loss) and self.context is not None
        self._starts: dict[int, int] = {}
        self._epochs: dict[int, list[np.ndarray]] = {}
        self._steps: dict[int, list[tuple[np.ndarray, ...]]] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def start(self, i: int) -> int:
        """Where row ``i``'s training slice begins: 0, or ``max_context_tokens`` before its first
        supervised position (the prompt beyond that is dropped; the kept positions' hidden states are
        the target's over the whole prompt, so only the draft's own attention span shrinks)."""
        if self.context is None:
            return 0
        if i not in self._starts:
            sup = np.flatnonzero(np.asarray(self.rows.loss_mask[i]))
            self._starts[i] = max(0, int(sup[0]) - self.context) if len(sup) else 0
        return self._starts[i]

    def length(self, i: int) -> int:
        """Row ``i``'s training length (after :meth:`start`)."""
        i = int(i)
        return len(self.rows.input_ids[i]) - self.start(i)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._epochs:
            lens = [self.length(i) for i in self.indices]
            self._epochs[epoch] = [self.indices[b] for b in
                                   multipack_batches(lens, self.T, seed=self.seed, epoch=epoch)]
        return self._epochs[epoch]

    def step_batches(self, epoch: int) -> list[tuple[np.ndarray, ...]]:
        """One tuple of ``replicas`` row-index arrays per step: element ``r`` is the packed row
        speculators' multipack sampler gives rank ``r`` of ``replicas`` (``(b,)`` for one replica:
        :meth:`epoch_batches`)."""
        if epoch not in self._steps:
            if self.replicas == 1:
                self._steps[epoch] = [(b,) for b in self.epoch_batches(epoch)]
            else:
                lens = [self.length(i) for i in self.indices]
                per_rank = [multipack_batches(lens, self.T, seed=self.seed, epoch=epoch, num_replicas=self.replicas,
                                              rank=r) for r in range(self.replicas)]
                self._steps[epoch] = [tuple(self.indices[b] for b in step) for step in zip(*per_rank)]
        return self._steps[epoch]

    def tokens(self, idx: np.ndarray) -> int:
        """Non-padding positions of the packed row of ``idx`` (from the row lengths alone)."""
        shift = 1 if self.shift is not None else 0
        return min(self.T, sum(max(self.length(i) - shift, 0) for i in idx))

    def sample(self, i: int, hs=None) -> dict:
        """Row ``i`` as speculators' dataset gives it, its states from the cache (or ``hs`` [T, L, H])."""
        ids = self.rows.input_ids[i]
        if hs is None:
            p = hs_path(self.dir, i)
            rec = read_hs(p)
            hs = rec.hidden_states
            if hs.shape[0] != len(ids) or not np.array_equal(rec.token_ids, ids):
                raise HiddenStateCacheError(f"token ids of hs_{i} do not match dataset row {i}", path=str(p),
                                            key="token_ids")
        T = hs.shape[0]
        mask = (np.ones(T, np.int64) if self.prompt_loss or self.context_loss
                else np.asarray(self.rows.loss_mask[i], np.int64))
        a = self.start(i)
        return {"hidden_states": hs[a:, :-1].reshape(T - a, -1), "input_ids": np.asarray(ids[a:], np.int64),
                "verifier_last_hidden_states": hs[a:, -1], "loss_mask": mask[a:],
                "position_ids": np.arange(a, T, dtype=np.int64)}

    def batch(self, idx: np.ndarray, target_len: int | None = None) -> dict:
        """The packed row of rows ``idx``; online, with the target's input and gather indices in place
        of the states (``target_len``: the target row's length, default :meth:`target_need`'s)."""
        if not self.online:
            return collate([self.sample(int(i)) for i in idx], self.T, hidden_size=self.hidden,
                           num_aux=self.num_aux, preprocess=self.shift)
        whole, off = self._target_samples(idx)
        samples = []
        # the cache path's own sample / shift / collate, on 1 + target-row positions instead of states
        for (i, n), o in zip(whole, off):
            t = np.arange(len(self.rows.input_ids[i]))
            pos = np.where(t < n, o + t + 1, 0)
            samples.append(self.sample(i, hs=np.repeat(pos[:, None, None], 2, axis=1)))
        out = collate(samples, self.T, hidden_size=1, num_aux=1, preprocess=self.shift)
        if not samples:  # collate's empty row holds float zeros
            out = {k: (v.astype(np.int64) if "hidden_states" in k else v) for k, v in out.items()}
        L = online.target_length(self.T, sum(n for _, n in whole)) if target_len is None else int(target_len)
        self.target_lengths.add(L)
        out["hs_index"] = out.pop("hidden_states")[..., 0].astype(np.int32)
        out["last_index"] = out.pop("verifier_last_hidden_states")[..., 0].astype(np.int32)
        out.update(online.pack_targets([self.rows.input_ids[i][:n] for i, n in whole], L))
        return out

    def _target_samples(self, idx) -> tuple[list[tuple[int, int]], list[int]]:
        """Online: ``[(row, tokens the target runs on it)]`` (from token 0, enough for every draft
        position the packed row can hold) and each row's offset in the target row."""
        shift = 1 if self.shift is not None else 0
        whole = [(int(i), min(len(self.rows.input_ids[int(i)]), self.start(int(i)) + self.T + shift)) for i in idx]
        off = np.cumsum([0] + [n for _, n in whole])[:-1].tolist()
        return whole, off

    def target_need(self, step: tuple[np.ndarray, ...]) -> int:
        """Online: one step's target-row length (its longest packed row's need; every process computes
        the same from the step's row indices)."""
        return max(online.target_length(self.T, sum(n for _, n in self._target_samples(idx)[0])) for idx in step)


class Prefetch:
    """Builds the next packed rows on a background thread (numpy releases the GIL while copying).

    :meth:`close` (or leaving a ``with`` block) stops the thread when the consumer stops early (a
    timeout, ``stop_after``, an error): it builds nothing more and exits within ``POLL_S`` once
    the item it is building is done, instead of waiting forever to hand over its next rows (and,
    online, running the target on them)."""

    POLL_S = 0.1

    def __init__(self, build: Callable[[Any], Any], items: list[tuple[int, Any]], depth: int = 2):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.err = None
        self._stop = threading.Event()

        def run():
            try:
                for key, idx in items:
                    if self._stop.is_set() or not self._put((key, build(idx))):
                        return
            except BaseException as e:  # surfaced in the consumer
                self.err = e
            self._put(None)

        self.t = threading.Thread(target=run, daemon=True)
        self.t.start()

    def _put(self, item) -> bool:
        """Hand ``item`` over, unless closed first (False)."""
        while not self._stop.is_set():
            try:
                self.q.put(item, timeout=self.POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread and wait for it (at most ``timeout`` s: the item being built finishes)."""
        self._stop.set()
        self.t.join(timeout)

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        while True:
            item = self.q.get()
            if item is None:
                if self.err is not None:
                    raise self.err
                return
            yield item


def schedule_items(train_data: TrainData, start: int, total_steps: int,
                   epochs: int) -> list[tuple[int, tuple[np.ndarray, ...], int, bool]]:
    """(global step, row indices of its ``N`` packed rows, epoch, last of its epoch) from ``start``
    to the end."""
    items, step, epoch = [], 0, 0
    while step < total_steps and epoch < epochs:
        bs = train_data.step_batches(epoch)
        for k, b in enumerate(bs):
            if step >= total_steps:
                break
            if step >= start:
                items.append((step, b, epoch, k == len(bs) - 1 or step + 1 == total_steps))
            step += 1
        epoch += 1
    return items


def validation_steps(val_data: TrainData, replicas: int) -> list[tuple[np.ndarray, ...]]:
    """Validation rows packed as on one device, ``replicas`` per step (the last step filled with
    empty rows, which count nothing)."""
    rows = [b for (b,) in val_data.step_batches(0)]
    rows += [np.zeros((0,), np.int64)] * (-len(rows) % replicas)
    return [tuple(rows[i: i + replicas]) for i in range(0, len(rows), replicas)]
