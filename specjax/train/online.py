"""Hidden states computed by the frozen target while training (``data.online: true``), instead of
read from the data directory's cache: no terabytes of ``hs_*.safetensors`` for a big target, at
the price of one target forward per training row.

``OnlineStates(model, layer_ids, dtype)(ids)`` runs the same jitted tap program that
``specjax data`` extraction writes the cache with (:func:`specjax.train.hidden_states.make_tap_fn`)
on one row, right-padded to a multiple of ``bucket`` tokens (causal attention: the padding cannot
reach the real positions), so a run compiles one program per bucket, not per row length. It
returns ``[T, L, H]`` in the cache dtype, the layout ``TrainData.sample`` reads from a cache file.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from specjax.decode.batch import bucket as round_up
from specjax.processes import process_count
from specjax.sharding import batch_divisor
from specjax.train.errors import TrainError
from specjax.train.hidden_states import make_tap_fn


class OnlineStates:
    def __init__(self, model, layer_ids: Sequence[int], out_dtype, *, mesh=None, bucket: int = 64):
        if process_count() > 1:
            raise TrainError("data.online runs the target on each process's own rows; multi-process runs need the "
                             "hidden-state cache (data.online: false)", key="data.online")
        self.tap = make_tap_fn(model, layer_ids, out_dtype, mesh)
        self.rows = batch_divisor(mesh) if mesh is not None else 1  # the tap splits its batch over data x fsdp
        self.bucket = int(bucket)
        self.lengths: set[int] = set()  # padded lengths seen: one compile each

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        T = len(ids)
        Tp = round_up(T, self.bucket)
        x = np.zeros((self.rows, Tp), np.int32)
        x[:, :T] = ids
        self.lengths.add(Tp)
        return np.asarray(jax.device_get(self.tap(x)))[0, :T]  # [T, L, H]
