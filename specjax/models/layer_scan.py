"""Target (and multi-layer draft) layers under ``lax.scan``: the setting (``SPECJAX_SCAN_LAYERS``,
:func:`layer_scan`), where a forward's layers split into runs of alike layers (:func:`layer_runs`),
a run's weights stacked and scanned (:func:`scan_run`), a target's layers stored stacked from load
(:class:`StackedLayers`, :func:`stack_layers`, scanned as they lie by :func:`scan_stacked`), and a
per-layer target's stacks built once per decode program (:func:`stack_layer_runs`,
:func:`using_stacked_layers`). The forwards themselves are in :mod:`specjax.models.target` and
:mod:`specjax.models.drafts.dflash`."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from specjax import placement
from specjax.kernels.tpu.dispatch import ambient_mesh
from specjax.models import panels


_SCAN_LAYERS: contextvars.ContextVar[str | None] = contextvars.ContextVar("specjax_scan_layers", default=None)
_SCAN_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("specjax_scan_log", default=None)
SCAN_SETTINGS = placement.SCAN_SETTINGS


def scan_setting() -> str:
    """``"off"`` (the default), ``"on"`` or ``"auto"``: from :func:`layer_scan`, else the
    ``SPECJAX_SCAN_LAYERS`` environment variable (``0``/``1``/``auto``)."""
    v = _SCAN_LAYERS.get()
    return v if v is not None else placement.scan_env()


def scan_layers_on() -> bool | None:
    """Whether target forwards without a KV cache run their layers under ``lax.scan`` (one compiled
    layer body per run of alike layers; each run's weights are stacked into one transient copy)
    instead of unrolled: True (``on``), False (``off``, the default: the CPU's native kernels run
    per layer, and on v6e the unrolled extraction moves 10-20 % fewer HBM bytes), or None
    (``auto`` in a program built for a TPU or a GPU: scan where a layer's float32 residual stream
    per chip outweighs its weights per chip, :func:`_scan_pays`; on v5e-8 that halves an 8192-token
    Llama-3.1-8B extraction's peak memory and quarters the temporaries at 16384)."""
    s = scan_setting()
    if s == "auto":
        return None if placement.platform() != "cpu" else False
    return s == "on"


@contextlib.contextmanager
def layer_scan(on: bool | str = True):
    """Within the block, target forwards without a cache scan their layers (``on``: True or
    ``"on"``), unroll them (False / ``"off"``) or scan where it pays (``"auto"``)."""
    setting = on if isinstance(on, str) else ("on" if on else "off")
    if setting not in SCAN_SETTINGS:
        raise ValueError(f"layer scan setting {on!r}: expected one of {SCAN_SETTINGS}")
    token = _SCAN_LAYERS.set(setting)
    try:
        yield
    finally:
        _SCAN_LAYERS.reset(token)


@contextlib.contextmanager
def recording_layer_scans():
    """Yields a list that collects, for every target forward traced in the block that scans its
    layers, its :func:`layer_runs` (``specjax plan`` asks whether a program scanned)."""
    log: list = []
    token = _SCAN_LOG.set(log)
    try:
        yield log
    finally:
        _SCAN_LOG.reset(token)


def _scan_pays(layer, x) -> bool:
    """Per chip of the mesh the program is built for: a layer's float32 residual stream (the
    unrolled forward keeps about one ``[B, T, hidden]`` float32 temporary per layer alive; batch
    split over ``data`` x ``fsdp``) at least the layer's weights (split over ``fsdp`` x ``tensor``;
    a scan stacks each run's weights into one copy). Llama-3.1-8B on tensor=8: an 8192-token row
    134 MB against 55 MB (peak 6.4 -> 3.2 GiB); 1024 tokens 17 MB (unrolled); data=8, a row per chip:
    134 MB against 436 MB (unrolled: the replicated weights' copy would not fit)."""
    mesh = ambient_mesh()
    sizes = dict(mesh.shape) if mesh is not None else {}
    rows = -(-x.shape[0] // (sizes.get("data", 1) * sizes.get("fsdp", 1)))
    act = rows * x.shape[1] * x.shape[2] * 4
    weights = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    return act >= weights / (sizes.get("fsdp", 1) * sizes.get("tensor", 1))


def use_layer_scan(layers, x) -> bool:
    if isinstance(layers, StackedLayers):  # stored stacked: scanning copies nothing
        return True
    on = scan_layers_on()
    return bool(on) if on is not None else _scan_pays(layers[0], x)


def draft_layer_scan(num_layers: int) -> bool:
    """Whether a multi-layer draft's training forward (DFlash, DSpark) runs its layers under
    ``lax.scan`` (:func:`scan_run`, one run per sliding window): ``on`` scans; ``off`` (the default)
    and ``auto`` unroll. Measured on the 5-layer DFlash Qwen3-8B train step at 8192 tokens, v5e-8
    tensor=8 (``specjax plan --programs train --scan-layers on``): the scan compiles in 95 s
    instead of 127 s but its peak is 9.94 GiB against 7.55 unrolled and it moves 109 GB of HBM
    against 84 (the stacked weights, the stacked gradient and each iteration's saved activations in
    loop buffers), for the same compute-bound roofline: a draft's few layers pay more in memory
    than they save in compile time, so ``auto`` keeps them unrolled."""
    return num_layers > 1 and scan_setting() == "on"


def layer_runs(num_layers: int, taps: Sequence[int], windows: Sequence[int | None]) -> list[tuple[int, int]]:
    """``[a, b)`` runs of consecutive layers that one scan can take: a run starts at every tap id
    (its input is a tapped state) and wherever the sliding window changes (a static property of
    the layer's mask)."""
    cuts = {0, num_layers}
    cuts.update(t for t in taps if 0 < t < num_layers)
    cuts.update(i for i in range(1, num_layers) if windows[i] != windows[i - 1])
    c = sorted(cuts)
    return list(zip(c[:-1], c[1:]))


class StackedLayers(nnx.Module):
    """A target's decoder layers held stacked, as :func:`stack_layers` leaves them: one module per
    run of alike layers (``runs``: ``[a, b)``, cut where the sliding window changes) whose params
    carry a leading layer axis (state paths ``model.layers.stacked.<run>.<param>``; the sharding
    rules put ``None`` on that axis). Forwards scan these stacks as they lie
    (:func:`scan_stacked`), so no program stacks the weights again; ``layers[i]`` (and iterating)
    gives layer ``i`` as a module of slices, for the code that walks layers one by one (a slice
    per use: a per-layer KV cache, a self-draft's first layers)."""

    def __init__(self, mods, runs, windows):
        self.runs = tuple((int(a), int(b)) for a, b in runs)
        self.windows = tuple(windows)
        self.stacked = nnx.List(mods)

    def __len__(self) -> int:
        return len(self.windows)

    def run_of(self, i: int) -> int:
        for r, (a, b) in enumerate(self.runs):
            if a <= i < b:
                return r
        raise IndexError(f"layer {i} of {len(self)}")

    def __getitem__(self, i: int):
        i = int(i) + (len(self) if int(i) < 0 else 0)
        r = self.run_of(i)
        graphdef, state = nnx.split(self.stacked[r])
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[i - self.runs[r][0]], state))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def stacked_layers(model) -> bool:
    """Whether ``model`` (a target) holds its layers stacked (:func:`stack_layers`)."""
    return isinstance(model.model.layers, StackedLayers)


def stack_on_load() -> bool:
    """Whether loading a target stores its layers stacked (:func:`stack_layers`): with the layer
    scan setting ``on`` (``SPECJAX_SCAN_LAYERS=1``), whose forwards and decode loops scan them."""
    return scan_setting() == "on"


def _stack_leaves(xs, donate: bool):
    """One param of a run's layers stacked on a new leading axis: abstract leaves
    (``ShapeDtypeStruct``) stay abstract, host arrays stack on the host, device arrays on their
    devices in their sharding with the layer axis unsplit (``donate``: each layer's own buffer is
    freed as soon as the stack exists, so stacking a loaded model holds one param's stack extra,
    not a second model)."""
    x0 = xs[0]
    sharding = getattr(x0, "sharding", None)
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    if isinstance(x0, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *x0.shape), x0.dtype, sharding=sharding)
    if not isinstance(x0, jax.Array):
        return np.stack([np.asarray(x) for x in xs])
    if isinstance(sharding, NamedSharding):
        out = jax.jit(lambda *a: jnp.stack(a), out_shardings=sharding)(*xs)
    else:
        out = jnp.stack(xs)
    if donate:
        for x in xs:
            x.delete()
    return out


def stack_layers(model, *, donate: bool = False):
    """Store ``model``'s (a target's) decoder layers stacked, in place: ``model.model.layers``
    becomes a :class:`StackedLayers` of one module per run of alike layers (cut where the sliding
    window changes), each param stacked once (:func:`_stack_leaves`: abstract, host or device
    arrays, shardings kept with the layer axis unsplit). ``donate``: free each layer's buffers as
    its stack is made (what a loader does: peak one param's stack over the model, not two
    models). Forwards and decode loops then scan the stacks without copying them; the math is the
    per-layer one. Returns ``model``; a model already stacked is returned as it is."""
    layers = model.model.layers
    if isinstance(layers, StackedLayers):
        return model
    windows = [la.sliding_window for la in layers]
    runs = layer_runs(len(layers), (), windows)
    mods = []
    for a, b in runs:
        graphdef = nnx.graphdef(layers[a])
        states = [nnx.state(layers[i]) for i in range(a, b)]
        mods.append(nnx.merge(graphdef, jax.tree.map(lambda *xs: _stack_leaves(xs, donate), *states)))
    model.model.layers = StackedLayers(mods, runs, windows)
    return model


def scan_stacked(layers: StackedLayers, carry, step, taps: Sequence[int], x_of=lambda c: c, *,
                 cut_at_taps: bool = True):
    """``carry`` through every layer of ``layers`` (stacked), ``step(layer, carry, i)`` (``i`` the
    layer's int32 index), each layer taken out of its whole stored stack by index in the scan body
    (``lax.dynamic_index_in_dim``: no sub-stack is sliced off as a copy). Returns ``(carry, {tap id
    < L: x_of(carry) entering that layer})``; a tap at a run's start is read before its scan. Taps
    inside a run, two ways, measured on Llama-3.1-8B (taps 2, 15, 29) with ``plan``:

    - ``cut_at_taps`` (forwards without a cache): the run is cut at them into several scans. An
      8192-token extraction on v6e-8 moves 32.5 GB of HBM (30.5 unrolled); a scan body writing the
      tap into a buffer under ``lax.cond`` copied the [taps, B, T, H] buffer every layer: 42.2 GB.
    - otherwise (forwards over a stacked cache, whose ``x`` is a few rows): one scan per run, the
      body writing the tapped rows into a small buffer under ``lax.cond``. A k=3 round on v5e-8
      moves 2.290 GB at B=1 and 2.784 at B=8 this way, 2.516 and 3.124 cut into scans (each cut
      presumably hands the stacked cache from one loop to the next)."""
    got = {}
    for r, (a, b) in enumerate(layers.runs):
        graphdef, state = nnx.split(layers.stacked[r])

        def layer_at(i, a=a, graphdef=graphdef, state=state):
            return nnx.merge(graphdef, jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i - a, keepdims=False),
                                                    state))

        inner = sorted(t for t in set(taps) if a < t < b)
        if a in taps:
            got[a] = x_of(carry)
        if cut_at_taps or not inner:
            cuts = [a, *inner, b]
            for c, d in zip(cuts[:-1], cuts[1:]):
                if c != a:
                    got[c] = x_of(carry)
                carry = jax.lax.scan(lambda h, i: (step(layer_at(i), h, i), None), carry,
                                     jnp.arange(c, d, dtype=jnp.int32))[0]
            continue
        slots = jnp.asarray([inner.index(i) if i in inner else -1 for i in range(a, b)], jnp.int32)
        x0 = x_of(carry)
        buf = jnp.zeros((len(inner), *x0.shape), x0.dtype)

        def body(c, xs, layer_at=layer_at):
            c, buf = c
            i, s = xs
            x = x_of(c)
            buf = jax.lax.cond(s >= 0, lambda bb: jax.lax.dynamic_update_index_in_dim(bb, x, jnp.maximum(s, 0), 0),
                               lambda bb: bb, buf)
            return (step(layer_at(i), c, i), buf), None

        (carry, buf), _ = jax.lax.scan(body, (carry, buf), (jnp.arange(a, b, dtype=jnp.int32), slots))
        for j, t in enumerate(inner):
            got[t] = buf[j]
    return carry, got


def stack_run(layers, a: int, b: int):
    """The state of ``layers[a:b]`` (alike layers) stacked along a new leading axis (a copy)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layers[i]) for i in range(a, b)])


def scan_run(layers, a: int, b: int, x, step, *, indexed: bool = False):
    """``x`` (any pytree: the carry) through ``layers[a:b]`` with ``step(layer, x) -> x`` (with
    ``indexed``, ``step(layer, x, i)``, ``i`` the layer's int32 index): one layer called as it is;
    two or more as one ``lax.scan`` over their params stacked along a new leading axis, the body
    compiled once. The stack is the one :func:`using_stacked_layers` holds for the run, else a copy
    of the run's weights per call (a transient next to the activations; gradients flow back through
    it to each layer's own params). The layers must be alike (one graph: same shapes, same static
    settings such as the sliding window)."""
    if b - a == 1:
        return step(layers[a], x, jnp.int32(a)) if indexed else step(layers[a], x)
    graphdef = nnx.graphdef(layers[a])
    stacked = _prestacked(layers).get(f"{a}-{b}")
    if stacked is None:
        stacked = stack_run(layers, a, b)

    def body(h, xs):
        st, i = xs
        layer = nnx.merge(graphdef, st)
        return (step(layer, h, i) if indexed else step(layer, h)), None

    return jax.lax.scan(body, x, (stacked, jnp.arange(a, b, dtype=jnp.int32)))[0]


def log_layer_scan(runs) -> None:
    """Record a traced forward's runs for :func:`recording_layer_scans` when one of them scans."""
    log = _SCAN_LOG.get()
    if log is not None and any(b - a > 1 for a, b in runs):
        log.append(runs)


def decode_layer_scan(model) -> bool:
    """Whether the decode loops (generate, the speculative chain) keep the target's KV cache
    stacked (:class:`specjax.models.target.KVCache` ``stacked``) and run the cached forwards' layers
    under ``lax.scan`` (one compiled layer body per run of alike layers; the cache is the scan's
    carry, each layer writes its rows in place and attends its layer, in TPU programs on the Pallas
    decode kernel reading the layer by index): always for a target whose layers are stored stacked
    (:func:`stack_layers`, what loading does under ``SPECJAX_SCAN_LAYERS=1``); for a per-layer
    target only with the setting ``on`` and never in the CPU panel view (whose native kernels take
    each layer's weights and cache as they lie), the loops then stacking its weights once
    (:func:`stack_layer_runs`: a second copy of the layers for the program's life).
    Llama-3.1-8B on v5e-8, tensor=8, stored stacked (docs/plan-kernels.md): the loops compile
    3-9x faster than unrolled, a step or a k=3 round moves the unrolled one's HBM bytes or fewer,
    and the peak is the unrolled loop's or lower (1.88 against 3.19 GiB for generate at B=1).
    The token-tree loop keeps its cache stacked only for a target stored stacked
    (:func:`tree_layer_scan`)."""
    if stacked_layers(model):  # stored stacked (:func:`stack_layers`): scanned whatever the setting
        return model.config.num_hidden_layers > 1
    if scan_setting() != "on" or model.config.num_hidden_layers < 2:
        return False
    return not isinstance(model.model.layers[0].self_attn.q_proj.kernel.get_value(), panels.Paneled)


def tree_layer_scan(model) -> bool:
    """Whether the token-tree loop keeps the target's KV cache stacked: only for a target stored
    stacked (its verify attends a layer of the stack by index, its compaction moves the accepted
    rows layer by layer, :func:`specjax.decode.tree.compact_cache`); a per-layer target keeps a
    per-layer cache there whatever the setting."""
    return stacked_layers(model) and decode_layer_scan(model)


_PRESTACKED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("specjax_prestacked", default=None)


def stack_layer_runs(model, tap_ids: Sequence[int] = ()) -> dict:
    """``{"a-b": the params of layers a..b-1 stacked on a new leading axis}`` for every
    :func:`layer_runs` run of two or more layers of a forward tapping ``tap_ids``: what a decode loop
    builds once, before its ``while_loop`` (:func:`using_stacked_layers`), so that its steps scan
    these instead of stacking the weights again every step (one copy of the layers' weights for
    the program's life)."""
    layers = model.model.layers
    if isinstance(layers, StackedLayers):  # stored stacked: nothing to build
        return {}
    runs = layer_runs(len(layers), tuple(int(t) for t in tap_ids), [la.sliding_window for la in layers])
    return {f"{a}-{b}": stack_run(layers, a, b) for a, b in runs if b - a > 1}


@contextlib.contextmanager
def using_stacked_layers(model, stacks: dict | None):
    """Within the block, ``model``'s forwards over a stacked cache scan the runs ``stacks`` holds
    (:func:`stack_layer_runs`) instead of stacking those layers' weights themselves."""
    token = _PRESTACKED.set(None if stacks is None else (id(model.model.layers), stacks))
    try:
        yield
    finally:
        _PRESTACKED.reset(token)


def _prestacked(layers) -> dict:
    """The stacks :func:`using_stacked_layers` holds for these layers (empty without)."""
    pre = _PRESTACKED.get()
    return pre[1] if pre is not None and pre[0] == id(layers) else {}
