"""Host-side batches for the jitted loops: prompts validated, right-padded to a bucket of their
length (nearby lengths share one compiled program), per-sequence token limits; and whether a
batch's prefill runs packed (prompts back to back in one row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from specjax.models.errors import ContextLengthError


PACK_MAX = 2048  # longest packed prefill row: its attention scores are [heads, T, T]


def worth_packing(packed_len: int, batch: int, padded_len: int) -> bool:
    """A packed prefill row of ``packed_len`` tokens replaces ``batch`` rows of ``padded_len``
    when it is shorter and at most :data:`PACK_MAX` long (its attention is quadratic in the
    row, so many short prompts stay padded)."""
    return batch > 1 and packed_len < batch * padded_len and packed_len <= PACK_MAX


def packed_length(lens: Sequence[int], padded_len: int) -> int | None:
    """The packed-prefill row length for prompts of ``lens`` right-padded to ``padded_len`` (see
    :func:`prefill`): ``sum(lens)`` rounded up to a multiple of ``padded_len`` (so one padded
    length has at most ``len(lens) - 1`` packed variants to compile), or None (keep the padded
    layout) unless :func:`worth_packing`."""
    n = bucket(sum(int(x) for x in lens), padded_len)
    return n if worth_packing(n, len(lens), padded_len) else None


def overlapped(items: Iterable[Any], start: Callable[[Any], Any], finish: Callable[[Any, Any], None]) -> None:
    """``finish(item, start(item))`` for every item, in order, software-pipelined: item ``n + 1``
    is started (a jitted call JAX dispatches without waiting) before item ``n`` is finished (its
    result copied to the host, written), so the device computes while the host writes."""
    pending = None
    for item in items:
        out = start(item)
        if pending is not None:
            finish(*pending)
        pending = (item, out)
    if pending is not None:
        finish(*pending)


def bucket(n: int, multiple: int = 32) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclass(frozen=True)
class Batch:
    """Host-side prepared prompts: right-padded ids, lengths, per-sequence token limits."""

    ids: np.ndarray  # int32 [B, P]
    lens: np.ndarray  # int32 [B]
    limits: np.ndarray  # int32 [B]
    eos: tuple  # EOS ids
    pad: int
    context_length: int

    @property
    def padded_len(self) -> int:
        return int(self.ids.shape[1])


def prepare(config, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids: Sequence[int] | None = None,
            pad_id: int | None = None, context_length: int | None = None, prompt_bucket: int = 32,
            limit: int | None = None) -> Batch:
    """Validate and pad token-id prompts for the jitted loops (shared with speculative decoding).
    ``limit``: a lower cap than ``max_new_tokens`` on each sequence's tokens (a runtime value: the
    loop compiled for ``max_new_tokens`` runs it)."""
    cfg = config
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if limit is not None and not 1 <= int(limit) <= max_new_tokens:
        raise ValueError(f"limit must be in 1..max_new_tokens ({max_new_tokens}), got {limit}")
    ctx = int(context_length or cfg.max_position_embeddings)
    lens = [len(p) for p in prompts]
    for i, n in enumerate(lens):
        if n == 0:
            raise ValueError(f"prompt {i} is empty; expected at least one token")
        if n >= ctx:
            raise ContextLengthError(f"prompt {i} has {n} tokens; the context length is {ctx}, so at most {ctx - 1} "
                                     f"prompt tokens leave room to generate", key="prompt")
    eos = tuple(int(t) for t in (cfg.eos_token_ids if eos_token_ids is None else eos_token_ids))
    pad = int(pad_id if pad_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else (eos or (0,))[0]))
    P = min(bucket(max(lens), prompt_bucket), ctx)
    ids = np.full((len(prompts), P), pad, np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = np.asarray(p, np.int32)
    cap = max_new_tokens if limit is None else int(limit)
    limits = np.asarray([min(cap, ctx - n) for n in lens], np.int32)
    return Batch(ids, np.asarray(lens, np.int32), limits, eos, pad, ctx)


def resolve_packed_len(packed_len: int | str | None, b: "Batch") -> int | None:
    """``packed_len`` of :func:`generate_ids` for the prepared batch ``b`` (checked to fit)."""
    if packed_len == "auto":
        return packed_length(b.lens.tolist(), b.padded_len)
    if packed_len is not None:
        packed_len, total = int(packed_len), int(b.lens.sum())
        if total > packed_len:
            raise ValueError(f"packed_len {packed_len} is shorter than the prompts together ({total} tokens)")
    return packed_len
