"""Optimizers and schedules as speculators 0.9.0 builds them (``train/optimizers.py``,
``trainer.py``), in Optax.

* ``adamw``: one AdamW (betas 0.9/0.999, eps 1e-8, decoupled decay) over every trainable param.
* ``muon``: torch's ``Muon`` on trainable 2-D matrices with both dims > 1 whose names contain
  none of ``embed_tokens, lm_head, codebook, markov_w1, markov_w2``; AdamW on the rest. Muon
  here is torch 2.13's exactly: momentum buffer ``b = lerp(b, g, 1 - mu)``, Nesterov update
  ``lerp(g, b, mu)``, 5 quintic Newton-Schulz steps in bf16 (coefficients 3.4445, -4.7750,
  2.0315, Frobenius normalisation clamped at 1e-7), ``p *= 1 - lr * wd`` then
  ``p -= lr * adjust * update`` with ``adjust = 0.2 * sqrt(max(A, B))`` (match_rms_adamw) or
  ``sqrt(max(1, A / B))`` (original; ``A, B`` = torch's ``[out, in]``).
* Gradients are clipped to global norm 1.0 first, as ``clip_grad_norm_`` (coefficient
  ``max_norm / (norm + 1e-6)``, clamped to 1).
* Schedules (per optimizer step, HF's): linear warm-up then linear decay to 0, or cosine with
  ``num_cycles`` (0.5), or constant; total steps ``max_steps`` or ``epochs * steps_per_epoch``;
  warm-up = explicit steps, else ratio * total, else 1 % of total.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def resolve_schedule_steps(*, total: int, warmup_steps: int | None, warmup_ratio: float | None) -> tuple[int, int]:
    if warmup_steps is not None:
        return int(warmup_steps), int(total)
    if warmup_ratio is not None:
        return int(total * warmup_ratio), int(total)
    return int(total) // 100, int(total)


def lr_lambda(kind: str, warmup: int, total: int, num_cycles: float = 0.5) -> Callable:
    """HF ``get_{linear,cosine}_schedule_with_warmup`` multipliers as a jnp function of the step."""

    def f(step):
        step = jnp.asarray(step, jnp.float32)
        if kind == "none":
            return jnp.ones_like(step)
        warm = step / max(1, warmup)
        if kind == "linear":
            after = jnp.maximum(0.0, (total - step) / max(1, total - warmup))
        else:
            prog = (step - warmup) / max(1, total - warmup)
            after = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * num_cycles * 2.0 * prog)))
        return jnp.where(step < warmup, warm, after)

    return f


def clip_like_torch(max_norm: float) -> optax.GradientTransformation:
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        norm = optax.tree.norm(updates)
        coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(init, update)


def ns_axes(mesh, n: int) -> tuple:
    """The mesh axes a Newton-Schulz iterate ``[short, long]`` is split over along ``long``:
    every axis of size > 1, dropped from the last while their product does not divide ``n``."""
    if mesh is None:
        return ()
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    while axes and n % math.prod(mesh.shape[a] for a in axes):
        axes.pop()
    return tuple(axes)


def _newton_schulz(g, steps: int, eps: float = 1e-7, mesh=None):
    """Orthogonalise ``g`` (torch orientation) as torch's ``zeropower_via_newtonschulz``, in bf16.

    With a ``mesh`` the iterate is split along its long dimension over the mesh (``ns_axes``):
    ``X X^T`` is a local partial product summed across chips (accumulated and summed in f32,
    rounded to bf16 once, as one chip's dot), ``G @ G`` is computed by rows, and ``(bG + cG^2) X``
    stays local, so every chip does 1/N of the work instead of all of it. Without a mesh (or
    when no axis divides the long dimension) nothing is constrained."""
    a, b, c = NS_COEFFS
    x = g.astype(jnp.bfloat16)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    axes = ns_axes(mesh, x.shape[1])
    if axes:
        def pin(v, spec):
            return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))

        wide, rows, rep = P(None, axes), P(ns_axes(mesh, x.shape[0]) or None, None), P()
        if len(axes) > 1:  # a 2-D tiled param to one dim over several axes: gather, then slice
            x = pin(x, rep)  # (what the partitioner would do anyway, with a warning)
        x = pin(x, wide)
    x = x / jnp.maximum(jnp.linalg.norm(x.astype(jnp.float32)), eps).astype(jnp.bfloat16)
    for _ in range(steps):
        if axes:
            gram = pin(jnp.matmul(x, x.T, preferred_element_type=jnp.float32), rep).astype(jnp.bfloat16)
            upd = pin(b * gram + c * pin(gram @ gram, rows), rep)
            x = pin(a * x + upd @ x, wide)
        else:
            gram = x @ x.T
            upd = b * gram + c * (gram @ gram)
            x = a * x + upd @ x
    if len(axes) > 1:
        x = pin(x, rep)
    return x.T if tall else x


def _dot_bf16(a, b, ca: int, cb: int):
    """bf16 ``dot_general`` over the leading batch dims, accumulated in float32 and rounded once to
    bf16 (torch's bf16 matmul). Written with a float32 result because XLA's CPU backend runs a
    ``bf16 x bf16 -> bf16`` dot as a float32 Eigen dot, and ``-> f32`` on its native bf16 path."""
    nb = a.ndim - 2
    batch = tuple(range(nb))
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), (batch, batch)),
                               preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _newton_schulz_stacked(x, steps: int, eps: float = 1e-7):
    """:func:`_newton_schulz` without a mesh, for a stack ``[n, short, long]`` of same-shape
    iterates (already in the wide orientation) at once: each matrix is normalised by its own
    Frobenius norm and iterated on its own (the leading dim is a batch dim of every dot). Muon's
    matrices come in few shapes (a decoder layer's gate/up/down projections share one), and one
    batched dot per step keeps both of a small CPU's cores busy where a dot per matrix did not:
    the one-layer SmolLM2 draft's eight matrices take 0.19 s a step instead of 0.35 s on 2 cores."""
    a, b, c = NS_COEFFS
    x = x.astype(jnp.bfloat16)
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
    x = x / jnp.maximum(norm, eps).astype(jnp.bfloat16)
    last = x.ndim - 1
    for _ in range(steps):
        gram = _dot_bf16(x, x, last, last)  # X X^T
        upd = b * gram + c * _dot_bf16(gram, gram, last, last - 1)
        x = a * x + _dot_bf16(upd, x, last, last - 1)
    return x


class MuonState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates


def torch_muon(lr: Callable, *, momentum: float = 0.95, weight_decay: float = 0.1, ns_steps: int = 5,
               adjust_lr_fn: str = "match_rms_adamw", nesterov: bool = True, mesh=None) -> optax.GradientTransformation:
    """torch.optim.Muon on Flax kernels (``[in, out]`` = torch ``[out, in]`` transposed); ``mesh``:
    the mesh the step is compiled for, to split Newton-Schulz over (see ``_newton_schulz``)."""

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params):
        lr_t = lr(state.count)

        gl, treedef = jax.tree_util.tree_flatten(grads)
        bl = treedef.flatten_up_to(state.momentum)
        pl = treedef.flatten_up_to(params)
        bufs, us = [], []
        for g, buf in zip(gl, bl):
            buf = buf + (g - buf) * (1.0 - momentum)
            bufs.append(buf)
            us.append(g + (buf - g) * momentum if nesterov else buf)
        # Orthogonalise in torch orientation (u.T), wide side last. Iterates split over a mesh go
        # one by one (_newton_schulz); the rest are stacked by shape and iterated together.
        orth: list = [None] * len(us)
        stacks: dict = {}
        for i, u in enumerate(us):
            t = u.T
            wide = t if t.shape[0] <= t.shape[1] else t.T
            if ns_axes(mesh, wide.shape[1]):
                orth[i] = _newton_schulz(t, ns_steps, mesh=mesh).T
            else:
                stacks.setdefault(wide.shape, []).append((i, t.shape[0] > t.shape[1]))
        for shape, items in stacks.items():
            xs = jnp.stack([us[i] if tall else us[i].T for i, tall in items])  # (u.T).T = u when tall
            # a real row-major copy: XLA would fold the transposes into the dots as a layout that
            # its CPU backend cannot run as bf16 x bf16 -> f32 (DotThunk: unsupported element type)
            xs = jax.lax.optimization_barrier(xs)
            ys = _newton_schulz_stacked(xs, ns_steps)
            for j, (i, tall) in enumerate(items):
                orth[i] = ys[j] if tall else ys[j].T  # back to the flax orientation of u
        steps = []
        for o, p in zip(orth, pl):
            A, B = p.shape[1], p.shape[0]  # torch [out, in]
            adj = 0.2 * math.sqrt(max(A, B)) if adjust_lr_fn == "match_rms_adamw" else math.sqrt(max(1.0, A / B))
            step = -(lr_t * weight_decay) * p - (lr_t * adj) * o.astype(p.dtype)
            steps.append(step.astype(p.dtype))
        upd = jax.tree_util.tree_unflatten(treedef, steps)
        mom = jax.tree_util.tree_unflatten(treedef, bufs)
        return upd, MuonState(state.count + 1, mom)

    return optax.GradientTransformation(init, update)


def muon_label(path: tuple, shape) -> str:
    name = ".".join(str(p) for p in path)
    if len(shape) == 2 and min(shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS):
        return "muon"
    return "adamw"


def labels_for(params) -> object:
    """Pytree of "muon" / "adamw" labels with the structure of ``params``."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    treedef = jax.tree_util.tree_structure(params)
    labs = []
    for kp, leaf in paths:
        parts = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in kp)
        labs.append(muon_label(parts, leaf.shape))
    return jax.tree_util.tree_unflatten(treedef, labs)


def build_optimizer(params, *, optimizer: str, lr: float, weight_decay: float, muon_lr: float, muon_momentum: float,
                    muon_weight_decay: float, muon_ns_steps: int, muon_adjust_lr_fn: str, scheduler_type: str,
                    warmup: int, total: int, num_cycles: float = 0.5, max_grad_norm: float = 1.0, mesh=None):
    """-> (optax transformation, {"adamw": lr_fn, "muon": lr_fn}) for the trainable ``params`` tree;
    ``mesh``: the mesh the train step is compiled for (Muon splits its Newton-Schulz over it)."""
    mult = lr_lambda(scheduler_type, warmup, total, num_cycles)
    adam_lr = lambda c: lr * mult(c)  # noqa: E731
    muon_lr_fn = lambda c: muon_lr * mult(c)  # noqa: E731
    adamw = optax.adamw(adam_lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
    if optimizer == "adamw":
        tx = optax.chain(clip_like_torch(max_grad_norm), adamw)
        return tx, {"adamw": adam_lr}
    labels = labels_for(params)
    muon = torch_muon(muon_lr_fn, momentum=muon_momentum, weight_decay=muon_weight_decay, ns_steps=muon_ns_steps,
                      adjust_lr_fn=muon_adjust_lr_fn, mesh=mesh)
    tx = optax.chain(clip_like_torch(max_grad_norm), optax.multi_transform({"adamw": adamw, "muon": muon}, labels))
    return tx, {"adamw": adam_lr, "muon": muon_lr_fn}
