"""The jitted train and eval steps: ``(params, opt_state, batch) -> (params, opt_state, metrics)``
and ``(params, batch) -> metrics`` for every draft algorithm (the forward and objective are the
algorithm's adapter's ``loss``, :mod:`specjax.train.algorithms`), on one device or with explicit
shardings on a mesh (:mod:`specjax.train.sharded`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import specjax.sharding as shd
from specjax import placement
from specjax.train import algorithms, online
from specjax.train.config import TrainConfig
from specjax.train.hidden_states import on_mesh

TRACE_COUNT = {"train_step": 0, "eval_step": 0}  # every trace in this process (per run: StepFns.traces)


def _cast(tree, dtype):
    """Floating leaves as ``dtype``. Abstract leaves (``jax.ShapeDtypeStruct``, e.g. for a deviceless
    compile) become abstract leaves of the new dtype with the same sharding: decided from the
    dtypes alone, nothing is materialised."""
    def one(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(one, tree)


@dataclass
class StepFns:
    train_step: Callable  # (params, opt_state, batch) -> (params, opt_state, metrics)
    eval_step: Callable  # (params, batch) -> metrics
    traces: dict  # {"train_step": n, "eval_step": n}: compiles of these two functions
    train_jit: Callable | None = None  # the jitted (params, opt_state, batch, frozen) -> ...: .lower() it
    eval_jit: Callable | None = None  # the jitted (params, batch, frozen) -> metrics
    frozen: object = None  # the frozen tensors in the compute dtype, as the steps pass them
    loss: Callable | None = None  # (params, frozen, batch) -> (loss, metrics): what the train step differentiates

    def lower_train(self, params, opt_state, batch):
        """``train_jit.lower`` with the frozen tensors the step passes (arrays or abstract
        ``ShapeDtypeStruct`` leaves with shardings: a deviceless compile)."""
        return self.train_jit.lower(params, opt_state, batch, self.frozen)


def _key(rng):
    """A batch's ``rng``: a typed key, or raw key data ``uint32 [2]`` (what a mesh batch carries)."""
    return jax.random.wrap_key_data(rng) if rng.dtype == jnp.uint32 else rng


def _objective(graphdef, algorithm, cdt):
    """The loss a step differentiates: the draft merged in the compute dtype, the algorithm's ``loss``."""
    def forward(params, frozen, batch):  # -> (loss, metrics)
        model = nnx.merge(graphdef, _cast(params, cdt), _cast(frozen, cdt))
        if "rng" in batch:
            batch = dict(batch, rng=_key(batch["rng"]))
        return algorithm.loss(model, batch, cdt)

    return forward


def _no_target(frozen, batch):
    return frozen, batch


def _online_prepare(target_graphdef, layer_ids, out_dtype):
    """``(frozen, batch) -> (frozen, batch)`` for ``data.online``: ``frozen`` is ``(the draft's
    frozen tensors, the target's state)``; the batch's hidden states are computed by the target
    (:func:`specjax.train.online.fill`)."""
    def prepare(frozen, batch):
        draft_frozen, target_state = frozen
        target = nnx.merge(target_graphdef, target_state)
        return draft_frozen, online.fill(target, layer_ids, out_dtype, batch)

    return prepare


def add_state_noise(batch, noise: float):
    """The batch with ``U(-noise, noise)`` added to its auxiliary hidden states (``hidden_states``,
    not the verifier's last states the targets come from), drawn from the batch's ``rng``: the
    feature augmentation of EAGLE and of speculators before 0.9.0 (``AddUniformNoise``, train split
    only). Unchanged when ``noise`` is 0 or the batch has no such states."""
    if not noise or "hidden_states" not in batch:
        return batch
    hs = batch["hidden_states"]
    key = jax.random.fold_in(_key(batch["rng"]), 0x6E6F)
    u = jax.random.uniform(key, hs.shape, jnp.float32, -noise, noise)
    return dict(batch, hidden_states=(hs.astype(jnp.float32) + u).astype(hs.dtype))


def _train_step(forward, tx, where, traces: dict, prepare=_no_target, noise: float = 0.0):
    """The train step before jit: the gradient of ``forward`` and one optimizer update, traced for
    ``where`` (``noise``: :func:`add_state_noise` on the training batch)."""
    def _train(params, opt_state, batch, frozen):
        with placement.building_for(where):
            return _train_body(params, opt_state, batch, frozen)

    def _train_body(params, opt_state, batch, frozen):
        TRACE_COUNT["train_step"] += 1
        traces["train_step"] += 1
        frozen, batch = prepare(frozen, batch)
        batch = add_state_noise(batch, noise)
        (loss, metrics), grads = jax.value_and_grad(forward, has_aux=True)(params, frozen, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=(optax.tree.norm(grads), jnp.ones((), jnp.float32)))
        return params, opt_state, metrics

    return _train


def _eval_step(forward, where, traces: dict, prepare=_no_target):
    """The eval step before jit: each row scored alone, metrics summed over the rows that hold tokens."""
    def _eval(params, batch, frozen):
        with placement.building_for(where):
            return _eval_body(params, batch, frozen)

    def _eval_body(params, batch, frozen):
        TRACE_COUNT["eval_step"] += 1
        traces["eval_step"] += 1
        frozen, batch = prepare(frozen, batch)
        if batch["input_ids"].shape[0] == 1:
            return forward(params, frozen, batch)[1]
        rows = {k: v for k, v in batch.items() if k != "rng"}

        def one(row):  # one packed row as a batch of 1, as a single-row validation step sees it
            b = {k: v[None] for k, v in row.items()}
            if "rng" in batch:
                b["rng"] = batch["rng"]
            return forward(params, frozen, b)[1]

        per_row = jax.vmap(one)(rows)  # {name: (sum [N], total [N])}
        real = jnp.any(batch["document_ids"] >= 0, axis=-1).astype(jnp.float32)  # [N]
        return jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32) * real), per_row)

    return _eval


def _jit_steps(train, evaluate, shardings, target_shardings=None):
    """Both steps jitted: plain on one device, else explicit in/out shardings, params and optimizer
    state donated (online, the frozen argument is ``(draft frozen, target state)``)."""
    if shardings is None:
        return jax.jit(train), jax.jit(evaluate)
    s = shardings
    frozen = s.frozen if target_shardings is None else (s.frozen, target_shardings)
    train_j = jax.jit(train, in_shardings=(s.params, s.opt_state, s.batch, frozen),
                      out_shardings=(s.params, s.opt_state, s.replicated), donate_argnums=(0, 1))
    eval_j = jax.jit(evaluate, in_shardings=(s.params, s.batch, frozen), out_shardings=s.replicated)
    return train_j, eval_j


@dataclass
class OnlineTarget:
    """``data.online``: the target the step runs (its graphdef and state, placed: on a mesh by
    ``TARGET_RULES``), the layers it taps and the states' dtype (the cache's)."""
    graphdef: object
    state: object
    layer_ids: tuple[int, ...]
    out_dtype: object

    @classmethod
    def of(cls, model, layer_ids, out_dtype, mesh=None) -> "OnlineTarget":
        """``model``'s state; with ``mesh``, placed there by ``TARGET_RULES`` unless it already is
        (the caller's model is left alone)."""
        if mesh is not None:
            model, _ = on_mesh(model, mesh)
        graphdef, state = nnx.split(model)
        return cls(graphdef, state, tuple(int(i) for i in layer_ids), jnp.dtype(out_dtype))


def make_step_fns(graphdef, frozen, tx, cfg: TrainConfig, shardings=None, online_target: OnlineTarget | None = None
                  ) -> StepFns:
    """The jitted train / eval steps. ``shardings`` (:class:`specjax.train.sharded.StepShardings`)
    makes both ``jax.jit`` with explicit in/out shardings (params, optimizer state and frozen
    tensors as given, the batch on ``("data", "fsdp")``, metrics replicated) and donates the
    params and optimizer state; ``None`` = one device.

    A batch is ``[N, T, ...]``: the loss (and so the gradient) is the mean over the ``N`` rows of
    each row's loss. The eval step sums every metric over the rows of a batch that hold tokens
    (empty filler rows count nothing)."""
    cdt = jnp.bfloat16 if cfg.trainer.compute_dtype == "bfloat16" else jnp.float32
    algorithm = algorithms.get(cfg.speculator_type)(cfg)
    forward = _objective(graphdef, algorithm, cdt)
    traces = {"train_step": 0, "eval_step": 0}

    # where the steps run: the mesh's devices (a TPU mesh compiled from a CPU host included), else
    # the device the params live on; read at trace time by the platform-specific layers
    where = shardings.mesh if shardings is not None else placement.platform_of(frozen)
    prepare, target_sh = _no_target, None
    if online_target is not None:
        prepare = _online_prepare(online_target.graphdef, online_target.layer_ids, online_target.out_dtype)
        target_sh = None if shardings is None else shd.shardings_of(online_target.state)
    train_j, eval_j = _jit_steps(_train_step(forward, tx, where, traces, prepare, cfg.data.noise_std),
                                 _eval_step(forward, where, traces, prepare), shardings, target_sh)
    # The frozen tensors (the verifier's embedding and head) never change: cast them to the compute
    # dtype once here, not inside every step (a [V, H] convert per step otherwise). The target runs
    # in its own dtype, as extraction runs it.
    frozen_c = _cast(frozen, cdt)
    if online_target is not None:
        frozen_c = (frozen_c, online_target.state)
    loss = forward if online_target is None else (lambda p, f, b: forward(p, *prepare(f, b)))
    return StepFns(lambda p, o, b: train_j(p, o, b, frozen_c), lambda p, b: eval_j(p, b, frozen_c), traces,
                   train_jit=train_j, eval_jit=eval_j, frozen=frozen_c, loss=loss)


def device_batch(b: dict, rng=None) -> dict:
    out = {k: jnp.asarray(v) for k, v in b.items()}
    if rng is not None:
        out["rng"] = rng
    return out
