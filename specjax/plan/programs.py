"""A recipe's programs over abstract params, ready to lower for a mesh: the project's own jitted
entry points (``make_step_fns``, ``make_tap_fn``, ``sharded_generate_fn``, ``sharded_spec_fn``)
and, for the two loops, one loop iteration as a program of its own (``decode_step``,
``spec_round``: ``cost_analysis`` counts a ``while_loop`` body once).

Params are never materialised: modules are built with ``nnx.eval_shape`` and every leaf becomes a
``jax.ShapeDtypeStruct`` carrying the ``NamedSharding`` the project's rules give it
(``TARGET_RULES`` / ``DRAFT_RULES`` / ``OPTIMIZER_RULES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import bridge
import specjax.sharding as shd
from specjax import placement
from specjax.decode.batch import prepare
from specjax.decode.generate import DecodeState, decode_step, padded_mesh_inputs, sharded_generate_fn
from specjax.decode.speculative import (
    GREEDY, SpecParams, SpecState, draft_dtype_of, place_pair, sharded_spec_fn, spec_round, split_pair,
)
from specjax.decode.tree import parse_tree
from specjax.decode.tree_draft import Drafted, check_tree_draft
from specjax.decode.tree_loop import TreeState, sharded_tree_fn, tree_round
from specjax.kernels import tpu as kt
from specjax.models.config import TargetConfig
from specjax.models.drafts.load import build_draft
from specjax.models.layers import first_argmax
from specjax.models.layer_scan import decode_layer_scan, layer_scan, stack_layers, stack_on_load, tree_layer_scan
from specjax.models.target import KVCache, build_model
from specjax.train.algorithms.base import trainable_filter_for
from specjax.train.draft_doc import draft_config_doc
from specjax.train.hidden_states import DTYPES, cache_layer_ids, default_aux_layer_ids, make_tap_fn
from specjax.train.optim import build_optimizer
from specjax.train.sharded import BATCH_NDIM, ONLINE_BATCH_NDIM, step_shardings
from specjax.train.step import OnlineTarget, make_step_fns

PROGRAMS = ("train", "extract", "generate", "speculate", "verify", "tree", "train-online")
DEFAULT_PROGRAMS = PROGRAMS[:4]  # verify (a sweep over tree sizes), tree and train-online: on request
DEFAULT_TREE = "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"  # vLLM's speculative_token_tree example


class PlanError(ValueError):
    """A plan request that cannot be built (a batch that does not divide the mesh, an unknown program)."""


@dataclass
class Program:
    """One program to compile: ``lower()`` the whole program; ``step_lower()`` one loop iteration
    (loops only) for per-step figures. ``tokens``: tokens one call (or one step) processes;
    ``resident``: bytes per chip a run holds on the device outside this program (none today: a
    training ``Run`` keeps no target weights and its frozen tensors only as the step's argument)."""

    name: str
    shape: dict
    lower: Callable
    step_lower: Callable | None = None
    # the same program with the target's layers unrolled, compiled only for its cost analysis when
    # the program scanned them (``cost_analysis`` and the kernels' flop records count a body once)
    cost_lower: Callable | None = None
    tokens: int = 0
    resident_bytes: int = 0
    notes: list = field(default_factory=list)
    # how many times each traced flash-attention call's forward flops the program executes: 1 for
    # inference; a train step 4.5 (the forward, then splash's backward: its dq kernel recomputes the
    # scores and runs 3 matmuls, its dkv kernel 4, against the forward's 2)
    kernel_passes: float = 1.0


@dataclass
class PlanInputs:
    cfg: object  # specjax.train.config.TrainConfig
    target: TargetConfig
    mesh: jax.sharding.Mesh
    batch: int | None = None  # rows (train/extract) or sequences (decode); default per program
    seq: int | None = None  # train/extract row length (default data.total_seq_len)
    prompt_len: int = 2048  # decode: padded prompt length
    new_tokens: int = 2048  # decode: max_new_tokens (cache = prompt_len + new_tokens slots)
    k: int | None = None  # speculate: draft tokens per round (default loss.ttt_steps)
    tree: str | None = None  # tree: a speculative_token_tree path list (default DEFAULT_TREE)
    target_dtype: object = jnp.bfloat16


# ----------------------------------------------------------------------------- abstract state


def per_chip_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s leaves (``ShapeDtypeStruct`` or arrays with shardings):
    the largest per-device sum, so an uneven layout counts its fullest device."""
    per_dev: dict = {}
    for x in jax.tree.leaves(tree):
        sh = x.sharding
        shard = sh.shard_shape(tuple(x.shape))
        nbytes = math.prod(shard) * jnp.dtype(x.dtype).itemsize
        for d in sh.device_set:
            per_dev[d] = per_dev.get(d, 0) + nbytes
    return max(per_dev.values(), default=0)


def _abstract(module, rules, mesh):
    """``(graphdef, state)`` of an ``nnx.eval_shape`` module, leaves sharded by ``rules`` on ``mesh``."""
    graphdef, state = nnx.split(module)
    return graphdef, shd.abstract_with_shardings(state, shd.named_shardings(state, rules, mesh))


def abstract_target(p: PlanInputs):
    """The recipe's target as abstract params sharded by the target rules; its layers stored
    stacked where a loaded target's would be (:func:`specjax.models.layer_scan.stack_on_load`)."""
    model = build_model(p.target, param_dtype=p.target_dtype, abstract=True)
    graphdef, state = _abstract(model, shd.TARGET_RULES, p.mesh)
    model = nnx.merge(graphdef, state)
    return stack_layers(model) if stack_on_load() else model


def _target_stub(p: PlanInputs):
    """What the draft-config translation reads of a loaded target (config, tokenizer, source)."""
    return SimpleNamespace(config=p.target, tokenizer=None, source=str(p.cfg.target), model=None)


def _aux_ids(p: PlanInputs) -> list[int]:
    d = p.cfg.draft
    return list(d.target_layer_ids) if d.target_layer_ids else default_aux_layer_ids(p.target.num_hidden_layers)


def draft_config(p: PlanInputs):
    V = p.target.vocab_size
    Vd = p.cfg.draft.draft_vocab_size or V
    doc = draft_config_doc(p.cfg, _target_stub(p), aux_layer_ids=_aux_ids(p), draft_vocab_size=Vd)
    return bridge.parse_config(doc)


def _rows(p: PlanInputs, what: str) -> int:
    div = shd.batch_divisor(p.mesh)
    n = div if p.batch is None else int(p.batch)
    if n < 1 or n % div:
        raise PlanError(f"{what}: batch {n} is not a positive multiple of data x fsdp = {div} on "
                        f"{shd.describe(p.mesh)}")
    return n


def _batch_or_rep(mesh, x):
    """Batch sharding for a ``[B, ...]`` leaf whose B divides data x fsdp, else replicated."""
    if x.ndim >= 1 and x.shape[0] % shd.batch_divisor(mesh) == 0:
        return shd.batch_sharding(mesh, x.ndim)
    return shd.replicated(mesh)


# ----------------------------------------------------------------------------- train


def train_program(p: PlanInputs, online: bool = False) -> Program:
    """The recipe's train step (``make_step_fns`` with ``step_shardings``, as ``Run`` builds it) for
    ``N`` packed rows of ``seq`` tokens; ``online``: the ``data.online`` step, the target (sharded by
    ``TARGET_RULES``, in ``target_dtype``) computing the hidden states inside it."""
    cfg, mesh = p.cfg, p.mesh
    dcfg = draft_config(p)
    model = build_draft(dcfg, param_dtype=jnp.float32, abstract=True)
    graphdef, params, frozen = nnx.split(model, nnx.All(nnx.Param, trainable_filter_for(cfg.speculator_type)), ...)
    o = cfg.optimizer
    tx, _ = build_optimizer(params, optimizer=o.optimizer, lr=o.lr, weight_decay=o.weight_decay, muon_lr=o.muon_lr,
                            muon_momentum=o.muon_momentum, muon_weight_decay=o.muon_weight_decay,
                            muon_ns_steps=o.muon_ns_steps, muon_adjust_lr_fn=o.muon_adjust_lr_fn,
                            scheduler_type=cfg.scheduler.scheduler_type, warmup=10, total=1000,
                            num_cycles=cfg.scheduler.scheduler_num_cosine_cycles, max_grad_norm=o.max_grad_norm,
                            mesh=mesh)
    sh = step_shardings(params, frozen, tx, mesh, online)
    params_a = shd.abstract_with_shardings(params, sh.params)
    frozen_a = shd.abstract_with_shardings(frozen, sh.frozen)
    opt_a = shd.abstract_with_shardings(jax.eval_shape(tx.init, params), sh.opt_state)
    N, T = _rows(p, "train"), int(p.seq or cfg.data.total_seq_len)
    H, A = p.target.hidden_size, len(_aux_ids(p))
    hs_dt = jnp.dtype(cfg.data.hidden_states_dtype)
    taps = cache_layer_ids(_aux_ids(p), p.target.num_hidden_layers)

    def build():
        # online: the target row is the draft row's length (rows not trimmed by data.max_context_tokens)
        target = OnlineTarget.of(abstract_target(p), taps, hs_dt) if online else None
        fns = make_step_fns(graphdef, frozen_a, tx, cfg, sh, target)
        return lambda: fns.lower_train(params_a, opt_a, batch)

    shapes = {"hidden_states": ((N, T, A * H), hs_dt), "verifier_last_hidden_states": ((N, T, H), hs_dt)}
    batch = {}
    for key, nd in (ONLINE_BATCH_NDIM if online else BATCH_NDIM).items():
        shape, dt = shapes.get(key, ((N, T), jnp.int32))
        assert len(shape) == nd
        batch[key] = jax.ShapeDtypeStruct(shape, dt, sharding=sh.batch[key])
    batch["rng"] = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sh.batch["rng"])
    # Run (specjax/train/trainer.py) trains from cached hidden states: the target's weights are not on
    # the device (an HF target is never loaded when the data is cached; a loaded one is released once
    # the draft is built), and the frozen tensors live on the device once, in the compute dtype, as
    # the step's argument (their float32 originals stay on the host). Online, the target's weights are
    # the step's argument too, and its attention runs forward only (kernels.tpu.forward_only).
    notes = (["the target's weights are the step's argument; its extraction-like forward runs once, the draft's "
              "forward and backward as in train (flash-attention flops: the draft's 4.5 passes, the target's 1)"]
             if online else
             ["nothing resident beside the step: no target weights, frozen tensors once (compute dtype)"])
    return Program("train-online" if online else "train", {"rows": N, "seq": T, "algorithm": cfg.speculator_type,
                                                           "optimizer": o.optimizer},
                   build(), tokens=N * T, resident_bytes=0, kernel_passes=4.5, notes=notes,
                   cost_lower=_unrolled(build))


# ----------------------------------------------------------------------------- extract


def _unrolled(build: Callable) -> Callable:
    """``build()`` (a fresh jit, so no trace is shared) lowered with the layers unrolled (the target's,
    and a multi-layer draft's); compiled only when the program itself scanned."""
    def lower():
        with layer_scan(False):
            return build()()
    return lower


def extract_program(p: PlanInputs) -> Program:
    """Hidden-state extraction (``make_tap_fn``) of ``B`` rows of ``seq`` tokens."""
    n = p.target.num_hidden_layers
    layer_ids = cache_layer_ids(_aux_ids(p), n)
    B, T = _rows(p, "extract"), int(p.seq or p.cfg.data.total_seq_len)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def build():
        fn = make_tap_fn(abstract_target(p), layer_ids, jnp.dtype(DTYPES[p.cfg.data.hidden_states_dtype]), p.mesh)
        return lambda: fn.lower(ids)

    return Program("extract", {"rows": B, "seq": T, "layers": len(layer_ids)}, build(), tokens=B * T,
                   cost_lower=_unrolled(build))


# ----------------------------------------------------------------------------- decode


def _decode_batch(p: PlanInputs):
    B = 1 if p.batch is None else int(p.batch)
    if B < 1:
        raise PlanError(f"decode batch {B}: expected >= 1")
    P = int(p.prompt_len)
    b = prepare(p.target, [[0] * P] * B, max_new_tokens=int(p.new_tokens), prompt_bucket=32)
    max_len = min(b.padded_len + int(p.new_tokens), max(b.context_length, b.padded_len))
    return b, max_len


def _decode_state(p: PlanInputs, Bp: int, max_len: int, cache_dtype, stacked: bool = False):
    """Abstract :class:`specjax.decode.generate.DecodeState` of ``Bp`` rows, sharded as the loop
    pins it (cache: batch x heads; rows on the batch axes when they divide; scalars replicated).
    ``stacked``: the cache as the decode layer scan keeps it (the generate and chain loops under
    :func:`specjax.models.layer_scan.decode_layer_scan`)."""
    mesh = p.mesh
    cache = jax.eval_shape(lambda: KVCache.init(p.target, Bp, kt.cache_slots(max_len, mesh), cache_dtype,
                                                stacked=stacked))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    st = DecodeState(step=i32(), tokens=i32(Bp, int(p.new_tokens)), num_tokens=i32(Bp), limit=i32(Bp),
                     done=jax.ShapeDtypeStruct((Bp,), bool), eos_hit=jax.ShapeDtypeStruct((Bp,), bool), last=i32(Bp),
                     cache=cache, key=jax.eval_shape(lambda: jax.random.key(0)))
    sh = st._replace(**{f: _batch_or_rep(mesh, getattr(st, f)) for f in DecodeState._fields if f not in ("cache",)},
                     cache=shd.kv_cache_sharding(mesh, cache))
    return shd.abstract_with_shardings(st, sh), sh


def generate_program(p: PlanInputs) -> Program:
    """The generate loop (``sharded_generate_fn``: prefill + ``while_loop``) and one decode step."""
    mesh = p.mesh
    target = abstract_target(p)
    graphdef, params = nnx.split(target)
    b, max_len = _decode_batch(p)
    cdt = jnp.dtype(p.target_dtype)
    inputs = padded_mesh_inputs(b, mesh, 0, abstract=True)
    fn = sharded_generate_fn(mesh, params)
    full = lambda: fn.lower(params, *inputs, graphdef, int(p.new_tokens), int(max_len), GREEDY, b.pad, cdt)  # noqa: E731

    Bp = inputs[0].shape[0]
    st, st_sh = _decode_state(p, Bp, max_len, cdt, stacked=decode_layer_scan(target))
    rep = shd.replicated(mesh)

    # with the decode layer scan the target's layers are stored stacked (abstract_target), so the
    # step scans its params as they lie: no stacks of its own

    def step(params, s, eos):
        with placement.building_for(mesh):
            return decode_step(nnx.merge(graphdef, params), s, eos, sampling=GREEDY, pad_id=b.pad, mesh=mesh)

    step_j = jax.jit(step, in_shardings=(shd.shardings_of(params), st_sh, rep), out_shardings=st_sh,
                     donate_argnums=(1,))
    return Program("generate", {"batch": int(b.ids.shape[0]), "prompt": b.padded_len, "new_tokens": int(p.new_tokens),
                                "cache_slots": int(max_len)}, full,
                   step_lower=lambda: step_j.lower(params, st, inputs[4]), tokens=int(b.ids.shape[0]))


def _abstract_pair(p: PlanInputs):
    """The recipe's draft and the (target, draft) pair's abstract params placed on the plan's mesh:
    (draft, graphdef, state)."""
    target = abstract_target(p)
    draft = build_draft(draft_config(p), param_dtype=p.target_dtype, abstract=True, verifier_heads=False)
    graphdef, state = place_pair(target, draft, p.mesh, split=split_pair(target, draft))
    return draft, graphdef, state


def _draft_cache(p: PlanInputs, draft, Bp: int, draft_len: int, dtype):
    """The abstract draft KV cache of ``Bp`` rows and its sharding, as the loops pin it."""
    dcache = jax.eval_shape(lambda: draft.init_cache(Bp, kt.cache_slots(draft_len, p.mesh), dtype))
    return dcache, shd.kv_cache_sharding(p.mesh, dcache)


def speculate_program(p: PlanInputs) -> Program:
    """The speculative loop (``sharded_spec_fn``) with the recipe's draft, and one round."""
    mesh = p.mesh
    draft, graphdef, state = _abstract_pair(p)
    k = int(p.k or p.cfg.loss.ttt_steps)
    params = SpecParams(k=k)
    b, _ = _decode_batch(p)
    P, new = b.padded_len, int(p.new_tokens)
    max_len, draft_len = P + new, P + new + 2 * (k + 1)
    cdt, ddt = jnp.dtype(p.target_dtype), draft_dtype_of(draft)
    rep = shd.replicated(mesh)
    inputs = padded_mesh_inputs(b, mesh, 0, abstract=True)
    relax = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=rep)
    fn = sharded_spec_fn(mesh, state)
    full = lambda: fn.lower(state, *inputs, relax, graphdef, params, new, max_len, draft_len, b.pad, cdt, ddt,  # noqa: E731
                            False)

    Bp = inputs[0].shape[0]
    dec, dec_sh = _decode_state(p, Bp, max_len, cdt, stacked=decode_layer_scan(abstract_target(p)))
    dcache, dcache_sh = _draft_cache(p, draft, Bp, draft_len, ddt)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    st = SpecState(dec, dcache, i32(Bp, k), jax.ShapeDtypeStruct((1,), jnp.float32), i32(Bp, k + 1), ())
    st_sh = SpecState(dec_sh, dcache_sh, _batch_or_rep(mesh, st.prop), rep,
                      _batch_or_rep(mesh, st.hist), ())
    st = shd.abstract_with_shardings(st, st_sh)

    def round_(state, s, eos, relax):
        with placement.building_for(mesh):
            pair = nnx.merge(graphdef, state)
            return spec_round(pair.target, pair.draft, s, eos, relax, params=params, pad_id=b.pad, mesh=mesh)

    round_j = jax.jit(round_, in_shardings=(shd.shardings_of(state), st_sh, rep, rep), out_shardings=st_sh,
                      donate_argnums=(1,))
    B = int(b.ids.shape[0])
    return Program("speculate", {"batch": B, "prompt": P, "new_tokens": new, "k": k, "cache_slots": max_len,
                                 "draft": p.cfg.speculator_type}, full,
                   step_lower=lambda: round_j.lower(state, st, inputs[4], relax), tokens=B * (k + 1),
                   notes=[f"tokens per round at full acceptance: batch x (k + 1) = {B * (k + 1)}"])


def verify_program(p: PlanInputs) -> Program:
    """One target verify forward of ``k + 1`` rows (a chain of k drafted tokens or a token tree of
    k nodes: the tree loop's verify, with an ancestor mask) over the decode cache, sharded as the
    loops shard it: what a round's verify costs as a function of the tree's size."""
    mesh = p.mesh
    target = abstract_target(p)
    graphdef, params = nnx.split(target)
    b, max_len = _decode_batch(p)
    k = int(p.k or p.cfg.loss.ttt_steps)
    T = k + 1
    Bp = shd.pad_batch(int(b.ids.shape[0]), mesh)
    cdt = jnp.dtype(p.target_dtype)
    cache = jax.eval_shape(lambda: KVCache.init(p.target, Bp, kt.cache_slots(max_len, mesh), cdt))
    cache_sh = shd.kv_cache_sharding(mesh, cache)
    cache = shd.abstract_with_shardings(cache, cache_sh)
    bs = lambda nd: shd.batch_sharding(mesh, nd) if Bp % shd.batch_divisor(mesh) == 0 else shd.replicated(mesh)  # noqa: E731
    ids = jax.ShapeDtypeStruct((Bp, T), jnp.int32, sharding=bs(2))
    mask = jax.ShapeDtypeStruct((Bp, T, T), bool, sharding=bs(3))

    def verify(params, ids, mask, cache):
        with placement.building_for(mesh):
            out = nnx.merge(graphdef, params)(ids, cache=cache, tree_mask=mask)
            return first_argmax(out.logits), out.cache

    fn = jax.jit(verify, in_shardings=(shd.shardings_of(params), bs(2), bs(3), cache_sh),
                 out_shardings=(bs(2), cache_sh), donate_argnums=(3,))
    return Program("verify", {"batch": Bp, "rows": T, "cache_slots": int(max_len)},
                   lambda: fn.lower(params, ids, mask, cache), tokens=Bp * T,
                   notes=[f"one verify of {T} rows per sequence (k = {k} drafted tokens or tree nodes)"])


def tree_program(p: PlanInputs) -> Program:
    """The tree loop (``sharded_tree_fn``) with the recipe's draft and a static token tree
    (``p.tree``, vLLM's path list), and one tree round (``tree_round``: the verify of N + 1 rows
    with the tree mask, acceptance, cache compaction, the hand-off and the next tree's drafting)."""
    mesh = p.mesh
    draft, graphdef, state = _abstract_pair(p)
    tree = parse_tree(p.tree or DEFAULT_TREE)
    check_tree_draft(draft, tree)
    b, _ = _decode_batch(p)
    P, new, N, D = b.padded_len, int(p.new_tokens), tree.num_nodes, tree.max_depth
    max_len, draft_len = P + new + N + 1, P + new + 2 * (D + 1)
    cdt, ddt = jnp.dtype(p.target_dtype), draft_dtype_of(draft)
    rep = shd.replicated(mesh)
    inputs = padded_mesh_inputs(b, mesh, 0, abstract=True)
    fn = sharded_tree_fn(mesh, state)
    full = lambda: fn.lower(state, *inputs, graphdef, tree, GREEDY, new, max_len, draft_len, b.pad, cdt,  # noqa: E731
                            ddt, "greedy", False)

    Bp = inputs[0].shape[0]
    target = nnx.merge(graphdef, state).target
    dec, dec_sh = _decode_state(p, Bp, max_len, cdt, stacked=tree_layer_scan(target))
    dcache, dcache_sh = _draft_cache(p, draft, Bp, draft_len, ddt)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    C = tree.children.shape[1]
    drafted = Drafted(i32(Bp, N + 1), i32(Bp, N + 1), jax.ShapeDtypeStruct((Bp, N + 1, N + 1), bool),
                      i32(Bp, N + 1, C), jax.ShapeDtypeStruct((1,), jnp.float32))
    st = TreeState(dec, dcache, drafted, i32(Bp, D + 1), i32(Bp, N + 1))
    st_sh = TreeState(dec_sh, dcache_sh,
                      Drafted(*(_batch_or_rep(mesh, x) for x in drafted[:4]), rep),
                      _batch_or_rep(mesh, st.hist), _batch_or_rep(mesh, st.hits))
    st = shd.abstract_with_shardings(st, st_sh)

    def round_(state, s, eos):
        with placement.building_for(mesh):
            pair = nnx.merge(graphdef, state)
            return tree_round(pair.target, pair.draft, s, eos, tree=tree, sampling=GREEDY, pad_id=b.pad, mesh=mesh)

    round_j = jax.jit(round_, in_shardings=(shd.shardings_of(state), st_sh, rep), out_shardings=st_sh,
                      donate_argnums=(1,))
    B = int(b.ids.shape[0])
    return Program("tree", {"batch": B, "prompt": P, "new_tokens": new, "nodes": N, "depth": D,
                            "cache_slots": max_len, "draft": p.cfg.speculator_type}, full,
                   step_lower=lambda: round_j.lower(state, st, inputs[4]), tokens=B * (D + 1),
                   notes=[f"tokens per round when a deepest path is accepted: batch x (depth + 1) = {B * (D + 1)}",
                          f"tree {[tuple(x) for x in tree.paths]}"])


BUILDERS = {"train": train_program, "extract": extract_program, "generate": generate_program,
            "speculate": speculate_program, "verify": verify_program, "tree": tree_program,
            "train-online": lambda p: train_program(p, online=True)}
