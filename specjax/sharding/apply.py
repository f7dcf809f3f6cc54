"""Putting parameters, batches and caches onto a mesh, and jitting with explicit shardings.

Everything here works unchanged on one device, on 8 fake CPU devices, and across processes
(``jax.distributed``): host values go in with :func:`put` (every process passes the same full
value; each keeps only its devices' slices) or :func:`put_local_batch` (each process passes
its own rows), and come back with :func:`specjax.processes.to_host`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.sharding.errors import IndivisibleShardError
from specjax.sharding.mesh import BATCH_AXES, batch_divisor, describe, mesh_sizes
from specjax.sharding.rules import PartitionRules, check_spec, named_shardings, path_str

BATCH = BATCH_AXES  # the PartitionSpec entry of a batch dimension: ("data", "fsdp")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_spec(ndim: int = 1) -> P:
    """Batch dimension (dim 0) split over ``("data", "fsdp")``, the rest replicated."""
    return P(BATCH, *([None] * (ndim - 1))) if ndim >= 1 else P()


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """``NamedSharding`` for a ``[batch, ...]`` array: the batch over ``("data", "fsdp")``."""
    return NamedSharding(mesh, batch_spec(ndim))


def batch_shardings(tree, mesh: Mesh):
    """Same-structure tree of batch shardings for a batch dict (leaves ``[B, ...]``; rank 0
    replicated). Raises :class:`IndivisibleShardError` naming the leaf when B does not divide."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out, problems = [], []
    for kp, x in flat:
        shape = tuple(getattr(x, "shape", np.shape(x)))
        spec = batch_spec(len(shape))
        why = check_spec(path_str(kp), shape, spec, mesh)
        if why:
            problems.append(f"{path_str(kp)} {list(shape)}: {why}")
        out.append(NamedSharding(mesh, spec))
    if problems:
        raise IndivisibleShardError(f"batch does not fit {describe(mesh)}: " + "; ".join(problems[:8]) +
                                    f". The batch size must be a multiple of data x fsdp = {batch_divisor(mesh)}",
                                    key=problems[0].split(" ")[0])
    return jax.tree_util.tree_unflatten(treedef, out)


def pad_batch(n: int, mesh) -> int:
    """The smallest multiple of ``data * fsdp`` that is >= n (rows to allocate for n sequences)."""
    d = batch_divisor(mesh)
    return -(-int(n) // d) * d


def kv_cache_sharding(mesh: Mesh, cache):
    """Shardings for a KV cache (``specjax.models.target.KVCache``: ``k``/``v`` tuples of
    ``[batch, kv_heads, max_len, head_dim]``, or the drafts' ``DraftCache``: ``[batch, max_len,
    kv_heads, head_dim]``; ``lengths [batch]``), as
    the same NamedTuple. ``cache`` may be concrete or abstract (``jax.eval_shape``).

    Batch over ``("data", "fsdp")``, heads over ``tensor``. A dimension that does not divide its
    axes is replicated instead (a batch of 1 on a data-parallel mesh, 3 KV heads on tensor=8):
    correct, just not split - pad the batch with :func:`pad_batch` to keep it split."""
    sizes = mesh_sizes(mesh)
    nb = batch_divisor(mesh)
    nt = sizes.get("tensor", 1)

    ha = cache.heads_axis  # target KVCache: heads-major [B, H, S, D] (1); DraftCache [B, S, H, D] (2)

    def kv(x):  # a layer's [B, ...]; a stacked target cache [L, B, H, S, D] leaves its layer axis whole
        lead = x.ndim - 4
        spec = [None] * lead + [BATCH if x.shape[lead] % nb == 0 else None, None, None, None]
        spec[lead + ha] = "tensor" if x.shape[lead + ha] % nt == 0 else None
        return NamedSharding(mesh, P(*spec))

    def ln(x):
        return NamedSharding(mesh, P(BATCH if x.shape[0] % nb == 0 else None))

    return type(cache)(jax.tree.map(kv, cache.k), jax.tree.map(kv, cache.v), ln(cache.lengths))


def constrain_cache(cache, mesh: Mesh):
    """Inside a jit: pin a KV cache to :func:`kv_cache_sharding` (so the while-loop carry keeps it)."""
    return jax.lax.with_sharding_constraint(cache, kv_cache_sharding(mesh, cache))


def shard_params(module_or_tree, rules: "PartitionRules | Iterable", mesh: Mesh):
    """Place parameters by ``rules`` on ``mesh``.

    An nnx Module is updated in place (every variable: params and buffers) and returned; a
    pytree (nnx State, dict, optax state) is returned placed. Checks every leaf first
    (:func:`specjax.sharding.rules.partition_specs`), so nothing moves when a rule is missing or
    a dimension does not divide."""
    from flax import nnx

    if isinstance(module_or_tree, nnx.Module):
        state = nnx.state(module_or_tree)
        shardings = named_shardings(state, rules, mesh)
        nnx.update(module_or_tree, jax.device_put(state, shardings))
        return module_or_tree
    return jax.device_put(module_or_tree, named_shardings(module_or_tree, rules, mesh))


def shardings_of(tree):
    """Same-structure tree of each leaf's ``.sharding`` (what to pass as a jit in/out sharding)."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    return jax.tree.map(lambda x: x.sharding, tree)


def mesh_of(tree) -> Mesh | None:
    """The mesh of the first leaf placed with a ``NamedSharding`` over more than one device
    (``None`` for single-device / unplaced trees)."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def put(x, sharding: NamedSharding) -> jax.Array:
    """A host value (the same full array on every process) as a global array with ``sharding``;
    each process materialises only its devices' slices."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    a = np.asarray(x)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def put_local_batch(tree, mesh: Mesh):
    """Per-process batches (each process passes its own ``[B_local, ...]`` rows) -> global arrays
    ``[B_local * processes, ...]`` split over ``("data", "fsdp")`` (training input pipelines)."""
    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, batch_spec(x.ndim)), x)

    return jax.tree.map(one, tree)


def abstract_with_shardings(tree, shardings):
    """``ShapeDtypeStruct`` tree carrying ``shardings`` (for Orbax ``StandardRestore`` / ``jax.jit(...).lower``)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def sharded_jit(fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any, **jit_kwargs) -> Callable:
    """``jax.jit(fn, in_shardings=..., out_shardings=...)`` with PartitionSpec trees (or ready
    shardings) turned into ``NamedSharding`` on ``mesh``. ``jit_kwargs`` (``static_argnames``,
    ``donate_argnums``, ...) pass through. ``in_specs`` covers the positional arguments."""
    def to_sharding(tree):
        return jax.tree.map(lambda s: s if isinstance(s, jax.sharding.Sharding) else NamedSharding(mesh, s), tree,
                            is_leaf=lambda s: isinstance(s, (P, jax.sharding.Sharding)))

    return jax.jit(fn, in_shardings=to_sharding(in_specs), out_shardings=to_sharding(out_specs), **jit_kwargs)
