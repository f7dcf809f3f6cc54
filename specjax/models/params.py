"""Load a nested param tree (as produced by ``bridge.layout.unflatten``) into an nnx module.

Paths are compared exactly (``("model", "layers", 0, "self_attn", "q_proj", "kernel")``); every
missing, unexpected or mis-shaped param is reported at once, by dotted path, in one
:class:`ParamMismatchError`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.layout import iter_leaves
from specjax.models.errors import ParamMismatchError


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def param_paths(module: nnx.Module) -> dict[tuple, Any]:
    """``{path: variable}`` for every ``nnx.Param`` of ``module`` (path parts: str attrs, int list indices)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        out[tuple(path)] = var
    return out


def load_tree(module: nnx.Module, tree: Mapping, *, where: str = "", dtype=None, ignore: Callable[[tuple], bool] | None = None,
              place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> None:
    """Replace the params of ``module`` in place with the leaves of ``tree``.

    ``dtype``: None keeps each array's own dtype (bf16 stays bf16); otherwise cast to it.
    ``ignore(path)``: tree leaves for which it returns True are skipped (e.g. a tied ``lm_head``).
    ``place(path, array)``: converts a leaf to a device array (default ``jnp.asarray``).
    Raises :class:`ParamMismatchError` naming every missing / unexpected / mis-shaped path.
    """
    want = param_paths(module)
    got = {tuple(p): v for p, v in iter_leaves(tree) if not (ignore and ignore(tuple(p)))}
    missing = sorted(_dotted(p) for p in want if p not in got)
    unexpected = sorted(_dotted(p) for p in got if p not in want)
    shapes = []
    for p, v in got.items():
        if p in want:
            ws = tuple(want[p].shape)
            gs = tuple(np.shape(v))
            if ws != gs:
                shapes.append(f"{_dotted(p)}: found {list(gs)}, expected {list(ws)}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} param(s): {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {unexpected[:8]}" + (" ..." if len(unexpected) > 8 else ""))
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es): {shapes[:8]}" + (" ..." if len(shapes) > 8 else ""))
        raise ParamMismatchError(
            f"weights do not fit {type(module).__name__}: " + "; ".join(parts),
            path=where or None, key=(missing or unexpected or [None])[0])
    for p, var in want.items():
        arr = got[p]
        if dtype is not None:
            arr = np.asarray(arr).astype(dtype) if not isinstance(arr, jax.Array) else arr.astype(dtype)
        var.set_value(place(p, arr) if place is not None else jnp.asarray(arr))


def tree_of(module: nnx.Module) -> dict:
    """The inverse: ``{nested path: array}`` of the module's params (for ``bridge.layout.flatten``)."""
    out: dict = {}
    for path, var in param_paths(module).items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = var.get_value()
    return out
