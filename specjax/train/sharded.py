"""The trainer on a device mesh: where params, optimizer state, frozen tensors and packed rows
live, and how host rows become global arrays.

* Draft params and frozen tensors (verifier embeddings / heads, vocab maps) by
  :data:`specjax.sharding.DRAFT_RULES`; the optax state by the matching optimizer rules
  (:data:`specjax.sharding.OPTIMIZER_RULES`: moments follow their parameter, counters replicated).
* A step's batch is ``[N, T, ...]``: ``N`` packed rows (one per data-parallel replica, as
  speculators' DDP gives one packed row to each rank), split over ``("data", "fsdp")``. The
  step's random key travels as raw key data ``uint32 [2]``, replicated.
* Each process builds only the rows its own devices hold (:func:`local_rows`) and the global
  arrays are assembled with ``jax.make_array_from_callback`` (:func:`global_batch`), so a
  multi-host run reads every cached hidden state once, on the host that trains on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

import specjax.sharding as shd

#: rank of each packed-row key (``specjax.train.packing.collate`` + ``document_ids``)
BATCH_NDIM = {"hidden_states": 3, "input_ids": 2, "verifier_last_hidden_states": 3, "loss_mask": 2,
              "position_ids": 2, "document_ids": 2}
# data.online: the target's packed input and the gather indices replace the states (specjax.train.online)
ONLINE_BATCH_NDIM = {**{k: n for k, n in BATCH_NDIM.items() if "hidden_states" not in k},
                     "target_ids": 2, "target_positions": 2, "target_segments": 2, "hs_index": 2, "last_index": 2}


@dataclass(frozen=True)
class StepShardings:
    """Explicit ``jax.jit`` shardings of the train / eval steps on ``mesh``."""

    mesh: Mesh
    params: Any  # same tree as the trainable params: NamedSharding leaves
    frozen: Any
    opt_state: Any
    batch: dict  # {key: NamedSharding}, "rng" replicated

    @property
    def replicated(self) -> NamedSharding:
        return shd.replicated(self.mesh)


def step_shardings(params, frozen, tx, mesh: Mesh, online: bool = False) -> StepShardings:
    """Shardings of every leaf, checked against the rules and the mesh before anything is placed
    (an unmatched leaf or an indivisible dimension raises one error naming the mesh); ``online``:
    the batch of ``data.online`` (:data:`ONLINE_BATCH_NDIM`)."""
    p_sh = shd.named_shardings(params, shd.DRAFT_RULES, mesh)
    f_sh = shd.named_shardings(frozen, shd.DRAFT_RULES, mesh)
    o_sh = shd.named_shardings(jax.eval_shape(tx.init, params), shd.OPTIMIZER_RULES, mesh)
    b_sh = {k: shd.batch_sharding(mesh, n) for k, n in (ONLINE_BATCH_NDIM if online else BATCH_NDIM).items()}
    b_sh["rng"] = shd.replicated(mesh)
    return StepShardings(mesh, p_sh, f_sh, o_sh, b_sh)


def place(tree, shardings):
    """Put a tree whose leaves every process holds in full (host or single-device arrays) into
    ``shardings``; each process materialises only its devices' slices."""
    def one(x, s):
        if isinstance(x, jax.Array) and x.is_fully_addressable and len(x.sharding.device_set) > 1:
            return jax.device_put(x, s)  # already on this process's devices: reshard
        a = np.asarray(x)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(one, tree, shardings)


def local_rows(sharding: NamedSharding, n: int) -> list[int]:
    """Indices (of ``n`` batch rows) that this process's devices hold under ``sharding``."""
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map((n,)).values():
        rows.update(range(n)[idx[0]])
    return sorted(rows)


def global_batch(rows: Mapping[int, dict], n: int, shardings: dict, rng_data: np.ndarray) -> dict:
    """``rows``: ``{row index: packed row dict ([1, T, ...] numpy)}`` holding at least this
    process's rows -> ``{key: global [n, T, ...] array}`` plus ``rng`` (key data, replicated)."""
    first = rows[next(iter(rows))]
    out = {}
    for k, sh in shardings.items():
        if k == "rng":
            continue
        shape = (n, *first[k].shape[1:])

        def cb(index, k=k):
            got = np.concatenate([rows[r][k] for r in range(n)[index[0]]], axis=0)
            return got[(slice(None), *index[1:])]

        out[k] = jax.make_array_from_callback(shape, sh, cb)
    key = np.asarray(rng_data, np.uint32)
    out["rng"] = jax.make_array_from_callback(key.shape, shardings["rng"], lambda idx: key[idx])
    return out


def to_host_tree(tree):
    """Full host copies of a (possibly multi-process) tree; a collective when some leaf is not
    fully addressable, so every process must call it."""
    return jax.tree.map(shd.to_host, tree)


def needs_gather(tree) -> bool:
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree.leaves(tree))
