"""Which process this is, in a ``jax.distributed`` run of several (one process: index 0 of 1), and
the two things every layer may need from that: a barrier and the full host value of an array.

A base module (it imports only jax): models, sharding, decode and train all use it, so the
model layer never reaches up into ``specjax.sharding`` for them.
"""

from __future__ import annotations

import jax
import numpy as np


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0 (the one that writes files and prints progress); always True single-process."""
    return process_index() == 0


def sync(name: str = "specjax") -> None:
    """Barrier across processes (no-op single-process), e.g. after process 0 wrote a file."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def agree(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a broadcast; the flag itself when single-process):
    a decision every process must take alike, or the collectives after it deadlock."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def to_host(x) -> np.ndarray:
    """The full value of a (possibly multi-process) array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
