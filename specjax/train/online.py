"""Hidden states computed by the frozen target inside the training step (``data.online: true``),
instead of read from the data directory's cache: no terabytes of ``hs_*.safetensors`` for a big
target, at the price of one target forward per packed row, in the same jitted program as the
draft's forward and update (same mesh: the target sharded by ``TARGET_RULES``, the draft and its
optimizer by theirs; the hidden states never leave the device).

The host builds each packed row as for the cache, with two changes (:meth:`TrainData.batch`):

* the **target's input**: the row's samples whole (from token 0, not from the trimmed start of
  ``data.max_context_tokens``: a kept position's state depends on the whole prompt), packed
  one after another into ``target_ids`` int32 [1, Tt] with ``target_positions`` (each sample from
  0) and ``target_segments`` (sample k -> k, padding -1). ``Tt`` is ``total_seq_len``, or more
  (:func:`target_length`) when trimmed prompts need more context than the draft row holds; one
  compile per ``Tt``.
* **gather indices** in place of the states: ``hs_index`` / ``last_index`` int32 [1, T] hold, for
  each draft position, 1 + the target-row position whose state the cache would have put there
  (0: padding, zeros as ``collate`` pads). They are made by running the cache path's own
  ``sample`` + ``preprocess`` (speculators' shift) + ``collate`` on position numbers instead of
  states, so the layout is the cache path's by construction.

:func:`fill` runs the target on the packed rows (segment-masked causal attention,
:class:`specjax.models.target.CausalLM`'s ``segments`` without a cache) and gathers the states:
the batch the cached path reads, up to float rounding (tests: loss and gradients within 1e-5).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import tpu as kt
from specjax.decode.batch import bucket as round_up
from specjax.train.hidden_states import tapped_states

BUCKET = 64  # target rows longer than the draft row grow in steps of this many tokens, or T / 8 if more
TARGET_KEYS = ("target_ids", "target_positions", "target_segments", "hs_index", "last_index")


def target_length(total_seq_len: int, needed: int) -> int:
    """The target row's length for ``needed`` tokens: ``total_seq_len`` (T), or more by steps of
    ``max(BUCKET, T // 8)`` (a handful of step shapes, each a compile, at any T)."""
    T, needed = int(total_seq_len), int(needed)
    return T if needed <= T else T + round_up(needed - T, max(BUCKET, T // 8))


def pack_targets(samples: Sequence[np.ndarray], length: int) -> dict[str, np.ndarray]:
    """Whole samples (token ids) packed into one target row of ``length`` tokens."""
    ids = np.zeros((1, length), np.int32)
    pos = np.zeros((1, length), np.int32)
    seg = np.full((1, length), -1, np.int32)
    off = 0
    for k, s in enumerate(samples):
        n = len(s)
        if off + n > length:
            raise ValueError(f"samples of {off + n} tokens do not fit a target row of {length}")
        ids[0, off: off + n] = s
        pos[0, off: off + n] = np.arange(n)
        seg[0, off: off + n] = k
        off += n
    return {"target_ids": ids, "target_positions": pos, "target_segments": seg}


def fill(model, layer_ids: Sequence[int], out_dtype, batch: dict) -> dict:
    """The batch with ``hidden_states`` / ``verifier_last_hidden_states`` computed by ``model`` (the
    target) from its ``target_*`` arrays and gathered by ``hs_index`` / ``last_index``; the online
    keys removed. Traced inside the train / eval step; no gradient flows into the target."""
    L = len(layer_ids)
    with kt.forward_only():  # (specjax plan's flop count: no backward pass runs through the target)
        hs = tapped_states(model, batch["target_ids"], layer_ids, out_dtype, positions=batch["target_positions"],
                           segments=batch["target_segments"])
    hs = jax.lax.stop_gradient(hs)  # [N, Tt, L, H]
    N, T = batch["hs_index"].shape

    def gather(index, layers):
        idx = jnp.asarray(index, jnp.int32)
        rows = jnp.take_along_axis(hs[:, :, layers], jnp.maximum(idx - 1, 0)[:, :, None, None], axis=1)
        return jnp.where((idx > 0)[:, :, None, None], rows, jnp.zeros((), hs.dtype))

    aux = gather(batch["hs_index"], slice(0, L - 1)).reshape(N, T, -1)
    last = gather(batch["last_index"], slice(L - 1, L))[:, :, 0]
    rest = {k: v for k, v in batch.items() if k not in TARGET_KEYS}
    return dict(rest, hidden_states=aux, verifier_last_hidden_states=last)
