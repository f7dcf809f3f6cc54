"""The trainer: one jitted step ``(params, opt_state, batch) -> (params, opt_state, metrics)``,
Orbax checkpoints with exact resume, validation with best/last exports, JSONL metrics and a
progress bar.

Run directory (``trainer.output_dir``)::

    run.yaml          the resolved recipe              resume.json   what a resume must share
    metrics.jsonl     one JSON object per logged step (and per validation)
    checkpoints/<step>/   Orbax: trainable params (f32), optimizer state, step
    best/  last/      speculators checkpoints (lowest validation loss / end of training)
    summary.json

Precision: float32 master weights; the step casts params and inputs to ``compute_dtype``
(bf16 by default, as speculators' autocast) and computes losses in float32.

Exact resume: the data order is a function of (seed, epoch, rows per step) (speculators'
multipack order), the step's randomness (DFlash / DSpark anchors, P-EAGLE COD elements) is
``fold_in(key(seed), step)``, and
params / optimizer state are restored bit for bit, so a resumed run ends at the parameters of an
uninterrupted one.

On a mesh (``Run(cfg, mesh=...)``; ``None`` = one device, the default): draft params, frozen
tensors and optimizer state are placed by ``DRAFT_RULES`` / ``OPTIMIZER_RULES`` and the train and
eval steps are ``jax.jit`` with explicit in/out shardings (params and optimizer state keep theirs,
metrics replicated); see :mod:`specjax.train.sharded`.

Data parallelism, as speculators' DDP: with ``N = data x fsdp`` (or ``data_parallel=N``) each
step takes ``N`` packed rows, ``[N, T]``: row ``r`` of step ``i`` is what speculators'
``MultipackDistributedBatchSamplerV2`` gives rank ``r`` of ``N`` at step ``i``. The loss is the
*mean of the per-row losses* (each row's loss is normalised by its own supervised tokens), so
the gradient is the mean of the per-row gradients: what DDP's all-reduce average of per-rank
gradients gives. Gradient clipping then acts on that averaged gradient, as in DDP. Logged
accuracy metrics pool the counts of all rows. Validation packs the held-out rows as on one
device (``N = 1`` packing), evaluates ``N`` of them per step (empty filler rows count nothing)
and sums every metric over rows, so validation numbers do not depend on the mesh.

A resume must use the same ``N`` (the data order depends on it); a different one is refused
with an error naming both meshes. The mesh itself may change (same ``N``): the checkpoint is
restored into the new mesh's shardings.

Multi-process: every process runs the same ``Run``; Orbax writes checkpoints collectively;
only process 0 writes ``metrics.jsonl``, ``summary.json``, ``run.yaml``, ``resume.json``, the
exports, and prints progress.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.atomic import atomic_file
from specjax.models.drafts.registry import draft_class
from specjax.train import algorithms
from specjax.train.config import TrainConfig
from specjax.train.errors import DatasetError, HiddenStateCacheError, ResumeError, TrainError
from specjax.train.feed import Prefetch, TrainData
from specjax.train.metric_sinks import open_sinks
from specjax.train.hidden_states import cache_layer_ids, default_aux_layer_ids, verify_cache
from specjax.train.objectives import normalize_metrics
from specjax.train.optim import build_optimizer, resolve_schedule_steps
from specjax.train.step import device_batch, make_step_fns

PARALLEL_KEY = "_parallel"  # resume.json: rows per step and the mesh of the run
FROZEN = ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm")


def trainable_filter_for(algo: str):
    """Which params an algorithm trains: everything but :data:`FROZEN`, except ``embed_tokens`` for
    a draft class with ``embed_trainable`` (P-EAGLE: its config's ``embed_requires_grad`` is always
    True; EAGLE-3 looks its embedding up under no_grad)."""
    trains_embed = draft_class(algo).embed_trainable
    frozen = tuple(f for f in FROZEN if not (trains_embed and f == "embed_tokens"))
    return lambda path, _value: not any(str(p) in frozen for p in path)


# ----------------------------------------------------------------------------- run


class Run:
    """Everything one ``specjax train`` needs, built before any long work starts.

    ``mesh``: ``None`` (one device), a ``jax.sharding.Mesh``, or anything
    :func:`specjax.sharding.make_mesh` takes (``"cpu-8"``, ``"data=2,tensor=4"``, ``(2, 2, 2)``).
    ``data_parallel``: packed rows per step, ``N`` (default: the mesh's ``data x fsdp``, 1 without
    a mesh); a multiple of ``data x fsdp``. ``Run(cfg, data_parallel=8)`` on one device takes the
    same rows, in the same order, as an 8-way data-parallel mesh (and speculators' DDP on 8 ranks)."""

    def __init__(self, cfg: TrainConfig, *, target=None, mesh=None, data_parallel: int | None = None,
                 resume: bool = False, overwrite: bool = False, progress: bool = True,
                 log: Callable[[str], None] | None = None, log_to: list[str] | None = None):
        from specjax.sharding import batch_divisor, describe, is_main_process, make_mesh
        from specjax.train.metric_sinks import check_available

        self.cfg = cfg
        self.algorithm = algorithms.get(cfg.speculator_type)(cfg)  # everything algorithm-specific
        self.main = is_main_process()
        self.log = (log or (lambda s: None)) if self.main else (lambda s: None)
        self.progress = progress and self.main
        self.out = Path(cfg.trainer.output_dir)
        self.resume = resume
        self.mesh = None if mesh is None else make_mesh(mesh)
        self.mesh_desc = describe(self.mesh) if self.mesh is not None else "1 device (no mesh)"
        div = batch_divisor(self.mesh) if self.mesh is not None else 1
        n = div if data_parallel is None else int(data_parallel)
        if n < 1 or n % div:
            raise TrainError(f"data_parallel={data_parallel}: the rows per step must be a positive multiple of data x "
                             f"fsdp = {div} on {self.mesh_desc}", key="data_parallel")
        self.replicas = n
        self.log_to = list(dict.fromkeys(["jsonl", *(log_to or [])]))  # metrics.jsonl always: resume reads it
        check_available(self.log_to)
        self._check_output(resume, overwrite)
        from specjax.train.pipeline import needs_prepare, recipe_prompts

        records = None
        if cfg.data.prepare is not None and needs_prepare(cfg):
            records = recipe_prompts(cfg)  # a bad prompt input fails here, before the target loads
        from specjax.models.loading import LoadedTarget

        if target is None and not needs_prepare(cfg) and not self.algorithm.reads_target_layers \
                and not cfg.data.online:
            target = target_info_if_light(cfg.target)  # data cached: no target weights on the device
        if target is None:  # on a mesh: straight into its shardings (TARGET_RULES), no full copy on one device
            from specjax.sharding.placement import Placement

            target = Placement(self.mesh).load_target(cfg.target, progress=self.progress)
        elif not isinstance(target, (LoadedTarget, TargetInfo)):
            raise TrainError("target must be a LoadedTarget")
        self.target = target
        tc = target.config
        algo = cfg.speculator_type
        n = tc.num_hidden_layers
        self.aux = list(cfg.draft.target_layer_ids) if cfg.draft.target_layer_ids else default_aux_layer_ids(n)
        self.layer_ids = cache_layer_ids(self.aux, n)
        # ---- data
        from specjax.train.pipeline import load_data_dir, prepare_data, recipe_data_spec

        ddir = Path(cfg.data.path)
        if not (ddir / "state.json").is_file():
            if cfg.data.prepare is None:
                raise DatasetError("no tokenized dataset here; run `specjax data prepare` or give data.prepare in the "
                                   "recipe", path=str(ddir))
            spec = recipe_data_spec(cfg, n)
            self.log(f"preparing data in {ddir}")
            prepare_data(ddir, spec, target, progress=progress, log=self.log, records=records)
        rows, meta = load_data_dir(ddir)
        self.data_meta = meta
        if meta:
            for k, want in (("hidden_size", tc.hidden_size), ("num_hidden_layers", n), ("vocab_size", tc.vocab_size)):
                if k in meta and int(meta[k]) != int(want):
                    raise HiddenStateCacheError(f"the data was made by a target with {k} {meta[k]}; this target has "
                                                f"{want}", path=str(ddir), key=k)
            if meta.get("layer_ids") and list(meta["layer_ids"]) != self.layer_ids:
                raise HiddenStateCacheError(f"the cache holds layers {meta['layer_ids']}; the recipe needs "
                                            f"{self.layer_ids} (draft.target_layer_ids + the final layer)",
                                            path=str(ddir), key="layer_ids")
        for i in range(len(rows)):
            if int(rows.input_ids[i].max(initial=0)) >= tc.vocab_size:
                raise DatasetError(f"row {i} has token id {int(rows.input_ids[i].max())} >= the target vocabulary "
                                   f"({tc.vocab_size})", path=str(ddir), key="input_ids")
        self.online = None
        if cfg.data.online:  # the target computes each row's hidden states as training reads it
            from specjax.train.hidden_states import DTYPES
            from specjax.train.online import OnlineStates

            self.online = OnlineStates(target.model, self.layer_ids, jnp.dtype(DTYPES[cfg.data.hidden_states_dtype]),
                                       mesh=self.mesh)
        else:
            verify_cache(rows, ddir, aux_layer_ids=self.aux, num_layers=n, hidden_size=tc.hidden_size,
                         sample=min(len(rows), 64))
        from specjax.train.dataset import split_indices

        tr, va = split_indices(len(rows), cfg.data.train_data_ratio)
        if len(tr) == 0:
            raise DatasetError(f"the train split is empty ({len(rows)} rows, train_data_ratio "
                               f"{cfg.data.train_data_ratio})", path=str(ddir), key="train_data_ratio")
        mk = dict(algo=algo, num_aux=len(self.aux), hidden_size=tc.hidden_size, total_seq_len=cfg.data.total_seq_len,
                  seed=cfg.seed, online=self.online)
        self.train_data = TrainData(ddir, rows, tr, replicas=self.replicas,
                                    prompt_loss=cfg.data.prompt_loss, **mk)
        self.val_data = TrainData(ddir, rows, va, **mk) if len(va) else None  # packed as on one device
        # ---- vocabulary
        V = tc.vocab_size
        Vd = cfg.draft.draft_vocab_size or V
        if Vd > V:
            raise TrainError(f"draft.draft_vocab_size {Vd} is larger than the target vocabulary ({V})",
                             key="draft.draft_vocab_size")
        self.algorithm.check_target(target, Vd)  # before any vocabulary work (MTP has none)
        self.t2d = self.d2t = None
        if Vd != V:
            from specjax.train.vocab import (
                TOKEN_FREQ_NAME, build_vocab_mapping, load_token_freq, load_vocab_mapping, save_vocab_mapping,
                token_frequencies,
            )

            got = load_vocab_mapping(ddir, Vd, V)
            if got is None:
                fp = ddir / TOKEN_FREQ_NAME
                freq = load_token_freq(fp) if fp.is_file() else token_frequencies(rows)
                got = build_vocab_mapping(freq, Vd, V)  # the same on every process; process 0 writes it
                if self.main:
                    save_vocab_mapping(ddir, *got)
            self.d2t, self.t2d = got
        # ---- draft
        from specjax.train.draft_doc import draft_config_doc

        self.config_doc = draft_config_doc(cfg, target, aux_layer_ids=self.aux, draft_vocab_size=Vd)
        # ---- schedule
        self.steps_per_epoch = len(self.train_data.step_batches(0))
        if self.steps_per_epoch == 0:
            why = "the train split is empty" if self.replicas == 1 else (
                f"the train split has {len(tr)} rows; {self.replicas} packed rows per step ({self.mesh_desc}) need "
                f"at least {self.replicas}")
            raise DatasetError(f"no training batches ({why})", path=str(ddir))
        # The LR schedule spans epochs x len(epoch 0's loader), as speculators computes it; the loop runs
        # every packed batch of every epoch (multipack gives each epoch its own count, a few more or
        # fewer), so the run ends, saves and exports at its real last step.
        planned = cfg.trainer.epochs * self.steps_per_epoch
        actual = sum(len(self.train_data.step_batches(e)) for e in range(cfg.trainer.epochs))
        self.total_steps = min(actual, cfg.trainer.max_steps) if cfg.trainer.max_steps else actual
        sched_total = cfg.scheduler.scheduler_total_steps or (cfg.trainer.max_steps or planned)
        self.warmup, self.sched_total = resolve_schedule_steps(total=sched_total,
                                                               warmup_steps=cfg.scheduler.scheduler_warmup_steps,
                                                               warmup_ratio=cfg.scheduler.scheduler_warmup_ratio)

    def _check_output(self, resume: bool, overwrite: bool):
        ck = self.out / "checkpoints"
        has = ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir())
        self.resume_from_scratch = False
        if resume:
            rj = self.out / "resume.json"
            if not has:
                partial = partial_saves(ck)
                if not (rj.is_file() or partial):
                    raise ResumeError("--resume: no complete checkpoint in this run directory", path=str(ck))
                # the run started but was killed before (or during) its first save: its state then is the
                # initial state, so resuming is starting over (the partial save is removed in train())
                self.resume_from_scratch = True
            if rj.is_file():
                old = json.loads(rj.read_text(encoding="utf-8"))
                old_n = int(old.pop(PARALLEL_KEY, {}).get("rows_per_step", 1))
                if old_n != self.replicas:
                    old_mesh = json.loads(rj.read_text(encoding="utf-8")).get(PARALLEL_KEY, {}).get(
                        "mesh", "1 device (no mesh)")
                    raise ResumeError(
                        f"this run was trained with {old_n} packed row(s) per step on {old_mesh}; resuming on "
                        f"{self.mesh_desc} gives {self.replicas} (data x fsdp), which changes the data order. Resume on "
                        f"a mesh whose data x fsdp is {old_n} (or pass data_parallel={old_n}), or start a new "
                        "trainer.output_dir", path=str(rj), key="data_parallel")
                new = self.cfg.resume_key()
                changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                if changed:
                    detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:6])
                    raise ResumeError(f"the recipe changed in a way that breaks resumption ({detail}); resume with the "
                                      "original recipe or start a new trainer.output_dir", path=str(rj), key=changed[0])
        elif has or (self.out / "last").exists():
            if not overwrite:
                raise TrainError("trainer.output_dir already holds a run; pass --resume to continue it or --overwrite "
                                 "to start over", path=str(self.out))
            if self.main:
                for sub in ("checkpoints", "best", "last", "metrics.jsonl", "summary.json", "resume.json"):
                    p = self.out / sub
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif p.exists():
                        p.unlink()
        from specjax.sharding import sync

        sync("specjax-train-output")  # unconditional: every process reaches it, whatever it saw on disk

    # ------------------------------------------------------------------ state
    def build_state(self):
        from specjax.train.export import init_draft

        cfg = self.cfg
        hook = self.algorithm.flat_hook(self.target)
        # the verifier's embedding / head: from the loaded model, else read from its checkpoint files
        source = self.target.model if self.target.model is not None else self.target.source
        self.draft_cfg, model = init_draft(self.config_doc, source, seed=cfg.seed, t2d=self.t2d,
                                           d2t=self.d2t, flat_hook=hook)
        graphdef, params, frozen = nnx.split(model, nnx.All(nnx.Param, trainable_filter_for(cfg.speculator_type)),
                                             ...)
        self.graphdef, self.frozen = graphdef, frozen
        o = cfg.optimizer
        self.tx, self.lr_fns = build_optimizer(
            params, optimizer=o.optimizer, lr=o.lr, weight_decay=o.weight_decay, muon_lr=o.muon_lr,
            muon_momentum=o.muon_momentum, muon_weight_decay=o.muon_weight_decay, muon_ns_steps=o.muon_ns_steps,
            muon_adjust_lr_fn=o.muon_adjust_lr_fn, scheduler_type=cfg.scheduler.scheduler_type, warmup=self.warmup,
            total=self.sched_total, num_cycles=cfg.scheduler.scheduler_num_cosine_cycles, max_grad_norm=o.max_grad_norm)
        self.shardings = None
        if self.mesh is None:
            opt_state = self.tx.init(params)
        else:
            from specjax.train import sharded

            self.shardings = sh = sharded.step_shardings(params, frozen, self.tx, self.mesh)
            params = sharded.place(params, sh.params)
            self.frozen = frozen = sharded.place(frozen, sh.frozen)
            opt_state = jax.jit(self.tx.init, out_shardings=sh.opt_state)(params)
        self.fns = make_step_fns(graphdef, frozen, self.tx, cfg, self.shardings)
        # The step holds the frozen tensors (the verifier's embedding / head) once, in the compute
        # dtype (fns.frozen); their float32 originals go to the host, for exports, instead of
        # staying on the device beside that copy.
        from specjax.train import sharded

        self.frozen = sharded.to_host_tree(frozen)
        del frozen
        return params, opt_state

    def model_of(self, params):
        return nnx.merge(self.graphdef, params, self.frozen)

    def host_model_of(self, params):
        """``model_of`` with host copies when some leaf lives on other processes (a collective:
        every process calls it; exports then happen on process 0)."""
        from specjax.train import sharded

        if not (sharded.needs_gather(params) or sharded.needs_gather(self.frozen)):
            return self.model_of(params)
        return nnx.merge(self.graphdef, sharded.to_host_tree(params), sharded.to_host_tree(self.frozen))

    # ------------------------------------------------------------------ checkpoints
    def _manager(self):
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.trainer.keep_checkpoints, create=True,
                                            enable_async_checkpointing=False)
        return ocp.CheckpointManager((self.out / "checkpoints").absolute(), options=opts)

    def save(self, mngr, step: int, params, opt_state, extra: dict):
        import orbax.checkpoint as ocp

        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                                                meta=ocp.args.JsonSave(extra)), force=True)
        mngr.wait_until_finished()

    def restore(self, mngr, params, opt_state):
        import orbax.checkpoint as ocp

        step = mngr.latest_step()
        if step is None:
            raise ResumeError("no complete checkpoint to resume from", path=str(self.out / "checkpoints"))
        state = {"params": params, "opt_state": opt_state}
        if self.shardings is None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        else:
            from specjax.sharding import abstract_with_shardings

            abstract = abstract_with_shardings(state, {"params": self.shardings.params,
                                                       "opt_state": self.shardings.opt_state})
        got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                         meta=ocp.args.JsonRestore()))
        return step, got["state"]["params"], got["state"]["opt_state"], dict(got["meta"])

    # ------------------------------------------------------------------ validation / export
    def val_steps(self) -> list[tuple[np.ndarray, ...]]:
        """Validation rows packed as on one device, ``replicas`` per step (the last step filled
        with empty rows, which count nothing)."""
        rows = [b for (b,) in self.val_data.step_batches(0)]
        n = self.replicas
        rows += [np.zeros((0,), np.int64)] * (-len(rows) % n)
        return [tuple(rows[i: i + n]) for i in range(0, len(rows), n)]

    def host_rows(self, data: TrainData, step: tuple[np.ndarray, ...]) -> dict[int, dict]:
        """The packed rows of one step that this process feeds: ``{row: [1, T, ...] arrays}``."""
        return {r: data.batch(step[r]) for r in self.local_rows}

    def device_batch(self, rows: dict[int, dict], step: int) -> dict:
        """Host rows -> the step's batch: ``[N, T, ...]`` on one device, or global arrays split
        over ``("data", "fsdp")`` with the key data replicated."""
        if self.shardings is None:
            cat = {k: np.concatenate([rows[r][k] for r in range(self.replicas)]) for k in rows[0]}
            return device_batch(cat, self._rng(step))
        from specjax.train import sharded

        return sharded.global_batch(rows, self.replicas, self.shardings.batch,
                                    np.asarray(jax.random.key_data(self._rng(step))))

    @property
    def local_rows(self) -> list[int]:
        """The rows (of the ``N`` per step) this process's devices hold: all of them on one process."""
        if self.mesh is None:
            return list(range(self.replicas))
        from specjax.sharding import batch_sharding
        from specjax.train import sharded

        return sharded.local_rows(batch_sharding(self.mesh, 2), self.replicas)

    def validate(self, params) -> dict | None:
        if self.val_data is None:
            return None
        sums: dict = {}
        for b in self.val_steps():
            m = self.fns.eval_step(params, self.device_batch(self.host_rows(self.val_data, b), -1))
            for k, (s, t) in jax.device_get(m).items():
                a = sums.setdefault(k, [0.0, 0.0])
                a[0] += float(s)
                a[1] += float(t)
        return normalize_metrics(sums)

    def export(self, name: str, params, metadata: dict | None = None) -> Path:
        """Write a speculators checkpoint on process 0 (every process must call: gathering the
        params of a multi-process mesh is a collective)."""
        from specjax.sharding import sync
        from specjax.train.export import export_draft

        model = self.host_model_of(params)
        out = self.out / name
        if self.main:
            out = export_draft(out, model, self.config_doc, overwrite=True,
                               metadata={k: str(v) for k, v in (metadata or {}).items()})
        sync(f"specjax-export-{name}")
        return out

    def _rng(self, step: int):
        return jax.random.fold_in(jax.random.key(self.cfg.seed), step + 1)

    # ------------------------------------------------------------------ loop
    def schedule_items(self, start: int) -> list[tuple[int, tuple[np.ndarray, ...], int, bool]]:
        """(global step, row indices of its ``N`` packed rows, epoch, last of its epoch) from ``start``
        to the end."""
        items, step, epoch = [], 0, 0
        while step < self.total_steps and epoch < self.cfg.trainer.epochs:
            bs = self.train_data.step_batches(epoch)
            for k, b in enumerate(bs):
                if step >= self.total_steps:
                    break
                if step >= start:
                    items.append((step, b, epoch, k == len(bs) - 1 or step + 1 == self.total_steps))
                step += 1
            epoch += 1
        return items

    def train(self, *, stop_after: int | None = None) -> dict:
        """Train (or resume) to the end. ``stop_after``: return after this many steps of this call
        (tests: simulates a killed run; the last checkpoint is written at that point)."""
        from tqdm.auto import tqdm

        from specjax.sharding import sync

        cfg = self.cfg
        main = self.main
        t_start = time.perf_counter()
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
        sync("specjax-train-start")
        params, opt_state = self.build_state()
        # Training reads cached hidden states: the target's weights are not needed on the device any
        # more (its config and tokenizer stay). A caller that passed target= keeps its own reference.
        if self.online is None:
            self.target = TargetInfo.of(self.target)
        mngr = self._manager()
        start, best = 0, {"val_loss": None, "step": None}
        if self.resume and main:
            for p in partial_saves(self.out / "checkpoints"):  # a save the kill interrupted
                shutil.rmtree(p, ignore_errors=True)
        if self.resume and self.resume_from_scratch:
            self.log("no complete checkpoint: the run was stopped before its first save finished; starting it over "
                     "from step 0 (the same state)")
        elif self.resume:
            start, params, opt_state, meta = self.restore(mngr, params, opt_state)
            best = meta.get("best", best)
            self.log(f"resumed from step {start}")
        if self.resume and main:
            keep_metrics_through(self.out / "metrics.jsonl", start)
        parallel = {"rows_per_step": self.replicas, "mesh": self.mesh_desc}
        if main:
            with atomic_file(self.out / "run.yaml", text=True) as f:
                f.write(cfg.to_yaml())
            with atomic_file(self.out / "resume.json", text=True) as f:
                f.write(json.dumps({**cfg.resume_key(), PARALLEL_KEY: parallel}, indent=1, sort_keys=True))
        items = self.schedule_items(start)
        # TensorBoard drops points at steps > start (the killed run's); the restored step's stay
        sinks = open_sinks(self.out, self.log_to, config=cfg.model_dump(mode="json"),
                           resume_step=start + 1 if self.resume else None) if main else None
        bar = tqdm(total=self.total_steps, initial=start, unit="step", desc=f"train {cfg.speculator_type}",
                   disable=not self.progress, dynamic_ncols=True)
        step = start
        last_val_epoch = None
        tok_seen = 0
        t0 = time.perf_counter()
        done_here = 0
        stopped = None
        summary_metrics: dict = {}
        val_every = cfg.trainer.val_every

        def write(rec: dict) -> None:
            if sinks is not None:
                sinks.write(rec)

        build = lambda st: self.host_rows(self.train_data, st)  # noqa: E731
        for (gstep, b, epoch, end_of_epoch), (_, rows) in zip(
                items, Prefetch(build, [(it[0], it[1]) for it in items])):
            tok = sum(self.train_data.tokens(idx) for idx in b)
            params, opt_state, m = self.fns.train_step(params, opt_state, self.device_batch(rows, gstep))
            step = gstep + 1
            done_here += 1
            tok_seen += tok
            if step % cfg.trainer.log_every == 0 or step == self.total_steps:
                mh = normalize_metrics(jax.device_get(m))
                el = time.perf_counter() - t0
                rec = {"step": step, "epoch": epoch, "tokens": tok,
                       "lr": {k: float(fn(gstep)) for k, fn in self.lr_fns.items()},
                       "tok_per_s": round(tok_seen / max(el, 1e-9), 1), **{k: round(v, 6) for k, v in mh.items()}}
                rec.update(self.algorithm.record_fields(mh))
                write(rec)
                summary_metrics = rec
                post = {"loss": f"{mh['loss']:.3f}", **self.algorithm.postfix(mh, rec)}
                post["tok/s"] = f"{rec['tok_per_s']:.0f}"
                bar.set_postfix(post)
            bar.update(1)
            do_val = (val_every and step % val_every == 0) or (not val_every and end_of_epoch)
            if do_val and self.val_data is not None and last_val_epoch != step:
                vm = self.validate(params)
                last_val_epoch = step
                vrec = {"split": "val", "step": step, "epoch": epoch, **{k: round(v, 6) for k, v in vm.items()}}
                vrec.update(self.algorithm.record_fields(vm))
                write(vrec)
                if cfg.trainer.save_best and (best["val_loss"] is None or vm["loss"] < best["val_loss"]):
                    best = {"val_loss": vm["loss"], "step": step, "metrics": vrec}
                    self.export("best", params, {"step": step, "val_loss": vm["loss"]})
            # every process takes the same decision (process 0's clock), or the collectives below deadlock
            timeout = bool(cfg.trainer.max_minutes) and _agree(
                (time.perf_counter() - t_start) / 60 >= cfg.trainer.max_minutes)
            killed = stop_after is not None and done_here >= stop_after
            if step % cfg.trainer.checkpoint_every == 0 or step == self.total_steps or timeout or killed:
                self.save(mngr, step, params, opt_state, {"step": step, "best": best, "fingerprint": cfg.fingerprint(),
                                                          "parallel": parallel})
            if timeout:
                stopped = "max_minutes"
                break
            if killed:
                stopped = "stop_after"
                break
        bar.close()
        if sinks is not None:
            sinks.close()
        if step < self.total_steps and stopped is None:
            stopped = "epochs"
        summary = {"steps": step, "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
                   "stopped": stopped, "seconds": round(time.perf_counter() - t_start, 2),
                   "train_seconds": round(time.perf_counter() - t0, 2), "tokens_seen": tok_seen,
                   "compiles": dict(self.fns.traces), "best": best, "last_metrics": summary_metrics,
                   "online_tap_lengths": sorted(self.online.lengths) if self.online is not None else None,
                   "mesh": self.mesh_desc, "rows_per_step": self.replicas, "processes": jax.process_count(),
                   "output_dir": str(self.out)}
        if stopped != "stop_after":
            summary["last"] = str(self.export("last", params, {"step": step}))
            if main:
                with atomic_file(self.out / "summary.json", text=True) as f:
                    f.write(json.dumps(summary, indent=2, default=str))
        self.params, self.opt_state = params, opt_state
        return summary


def _agree(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a broadcast; the flag itself when single-process)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


class TargetInfo:
    """What a run needs of its target once the draft is initialised: config, tokenizer, source."""

    model = None

    def __init__(self, config, tokenizer, source):
        self.config, self.tokenizer, self.source = config, tokenizer, source

    @classmethod
    def of(cls, target) -> "TargetInfo":
        return target if isinstance(target, TargetInfo) else cls(target.config, getattr(target, "tokenizer", None),
                                                                 getattr(target, "source", None))


def target_info_if_light(target) -> TargetInfo | None:
    """A :class:`TargetInfo` (config and tokenizer, no weights) for a target given as an HF checkpoint
    (a directory or a cached repo id), whose verifier tensors ``init_draft`` can then read from the
    files one at a time; None for a GGUF file (dequantised whole: load it)."""
    from specjax.models.config import TargetConfig
    from specjax.models.loading import resolve_target
    from specjax.models.tokenizer import Tokenizer

    kind, path = resolve_target(target)
    if kind not in ("hf_dir", "hf_cache"):
        return None
    return TargetInfo(TargetConfig.from_file(Path(path) / "config.json"), Tokenizer.from_dir(path), str(path))


def partial_saves(ckpt_dir: Path) -> list[Path]:
    """Orbax's temporary directories of saves that never finished (``<step>.orbax-checkpoint-tmp-<n>``)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if ".orbax-checkpoint-tmp" in p.name)


def keep_metrics_through(path: Path, step: int) -> None:
    """Rewrite ``metrics.jsonl`` (atomically) keeping the records of steps <= ``step``: the steps a
    resumed run recomputes are logged again, once. A torn last line (the kill) is dropped too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(line)
    with atomic_file(path, text=True) as f:
        f.write("".join(k + "\n" for k in kept))


def train(cfg: TrainConfig, *, target=None, mesh=None, data_parallel: int | None = None, resume: bool = False,
          overwrite: bool = False, progress: bool = True, log: Callable[[str], None] | None = None,
          log_to: list[str] | None = None) -> dict:
    """Library entry point of ``specjax train`` (``mesh``, ``data_parallel``: see :class:`Run`;
    ``log_to``: metric sinks besides ``metrics.jsonl``, :mod:`specjax.train.metric_sinks`)."""
    return Run(cfg, target=target, mesh=mesh, data_parallel=data_parallel, resume=resume, overwrite=overwrite,
               progress=progress, log=log, log_to=log_to).train()
