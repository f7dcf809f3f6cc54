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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from specjax import storage
from specjax.models.loading import LoadedTarget
from specjax.sharding import batch_divisor, batch_sharding, describe, is_main_process, make_mesh, sync
from specjax.sharding.placement import Placement
from specjax.processes import agree
from specjax.train import algorithms, sharded, vocab
from specjax.train.algorithms.base import trainable_filter_for
from specjax.train.config import TrainConfig
from specjax.train.dataset import split_indices
from specjax.train.draft_doc import draft_config_doc
from specjax.train.errors import DatasetError, HiddenStateCacheError, TrainError
from specjax.train.export import export_draft, init_draft
from specjax.train.feed import Prefetch, TrainData, schedule_items, validation_steps
from specjax.train.hidden_states import DTYPES as HS_DTYPES, cache_layer_ids, default_aux_layer_ids, verify_cache
from specjax.train.metric_sinks import check_available, open_sinks
from specjax.train.objectives import normalize_metrics
from specjax.train.optim import build_optimizer, resolve_schedule_steps
from specjax.train.pipeline import (
    load_data_dir, local_data_dir, needs_prepare, prepare_data, recipe_data_spec, recipe_prompts,
)
from specjax.train.run_files import (
    TargetInfo, check_output_dir, checkpoint_manager, keep_metrics_through, partial_saves, restore_state, save_state,
    target_info_if_light, write_run_files,
)
from specjax.train.step import OnlineTarget, device_batch, make_step_fns


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
        self.cfg = cfg
        self.algorithm = algorithms.get(cfg.speculator_type)(cfg)  # everything algorithm-specific
        self.main = is_main_process()
        self.log = (log or (lambda s: None)) if self.main else (lambda s: None)
        self.progress = progress and self.main
        self.out = storage.path(cfg.trainer.output_dir)  # an epath.Path for a bucket URL
        self.resume = resume
        self._parallel(mesh, data_parallel)
        self.log_to = list(dict.fromkeys(["jsonl", *(log_to or [])]))  # metrics.jsonl always: resume reads it
        check_available(self.log_to)
        self.resume_from_scratch = check_output_dir(self.out, cfg, resume=resume, overwrite=overwrite,
                                                    replicas=self.replicas, mesh_desc=self.mesh_desc, main=self.main)
        sync("specjax-train-output")  # unconditional: every process reaches it, whatever it saw on disk
        records = None
        if cfg.data.prepare is not None and needs_prepare(cfg):
            records = recipe_prompts(cfg)  # a bad prompt input fails here, before the target loads
        self.target = target = self._target(target)
        n = target.config.num_hidden_layers
        self.aux = list(cfg.draft.target_layer_ids) if cfg.draft.target_layer_ids else default_aux_layer_ids(n)
        self.layer_ids = cache_layer_ids(self.aux, n)
        ddir, rows = self._data(storage.path(cfg.data.path), records)
        tr = self._feeds(ddir, rows)
        Vd = self._vocabulary(ddir, rows)
        self.config_doc = draft_config_doc(cfg, target, aux_layer_ids=self.aux, draft_vocab_size=Vd)
        self._schedule(ddir, len(tr))

    def _parallel(self, mesh, data_parallel: int | None) -> None:
        """The mesh and the packed rows per step (a positive multiple of data x fsdp)."""
        self.mesh = None if mesh is None else make_mesh(mesh)
        self.mesh_desc = describe(self.mesh) if self.mesh is not None else "1 device (no mesh)"
        div = batch_divisor(self.mesh) if self.mesh is not None else 1
        n = div if data_parallel is None else int(data_parallel)
        if n < 1 or n % div:
            raise TrainError(f"data_parallel={data_parallel}: the rows per step must be a positive multiple of data x "
                             f"fsdp = {div} on {self.mesh_desc}", key="data_parallel")
        self.replicas = n

    def _target(self, target):
        """The target as the run needs it: given, only its config and tokenizer (cached data and an HF
        checkpoint: no weights on the device), or loaded (on a mesh: straight into its shardings)."""
        cfg = self.cfg
        if target is None and not needs_prepare(cfg) and not self.algorithm.reads_target_layers \
                and not cfg.data.online:
            target = target_info_if_light(cfg.target)  # data cached: no target weights on the device
        if target is None:
            return Placement(self.mesh).load_target(cfg.target, progress=self.progress)
        if not isinstance(target, (LoadedTarget, TargetInfo)):
            raise TrainError("target must be a LoadedTarget")
        return target

    def _data(self, ddir, records):
        """The local data directory (a bucket's staged) and its tokenized rows (prepared first when the
        recipe says how), checked against the target."""
        cfg, tc = self.cfg, self.target.config
        n = tc.num_hidden_layers
        if not (ddir / "state.json").is_file():
            if cfg.data.prepare is None:
                raise DatasetError("no tokenized dataset here; run `specjax data prepare` or give data.prepare in the "
                                   "recipe", path=str(ddir))
            self.log(f"preparing data in {ddir}")
            prepare_data(ddir, recipe_data_spec(cfg, n), self.target, progress=self.progress, log=self.log,
                         records=records)
        ddir = local_data_dir(ddir, progress=self.progress)
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
        return ddir, rows

    def _feeds(self, ddir: Path, rows):
        """Where hidden states come from (the cache, checked, or the target online) and the train /
        validation feeds. Returns the train split's indices."""
        cfg, tc = self.cfg, self.target.config
        self.online = bool(cfg.data.online)
        if self.online:  # the target computes each row's hidden states inside the step
            if jax.process_count() > 1:
                raise TrainError("data.online is single-process for now (one host, any mesh on it); multi-process "
                                 "runs read the hidden-state cache (data.online: false)", key="data.online")
        elif self.data_meta.get("hidden_states") is False:
            raise HiddenStateCacheError("this data directory was prepared without a hidden-state cache (for "
                                        "data.online: true); train with data.online: true, or prepare the data again "
                                        "with data.online: false", path=str(ddir), key="data.online")
        else:
            verify_cache(rows, ddir, aux_layer_ids=self.aux, num_layers=tc.num_hidden_layers,
                         hidden_size=tc.hidden_size, sample=min(len(rows), 64))
        tr, va = split_indices(len(rows), cfg.data.train_data_ratio)
        if len(tr) == 0:
            raise DatasetError(f"the train split is empty ({len(rows)} rows, train_data_ratio "
                               f"{cfg.data.train_data_ratio})", path=str(ddir), key="train_data_ratio")
        mk = dict(algo=cfg.speculator_type, num_aux=len(self.aux), hidden_size=tc.hidden_size,
                  total_seq_len=cfg.data.total_seq_len, seed=cfg.seed, online=self.online)
        self.train_data = TrainData(ddir, rows, tr, replicas=self.replicas,
                                    prompt_loss=cfg.data.prompt_loss,
                                    max_context_tokens=cfg.data.max_context_tokens,
                                    context_loss=cfg.data.context_loss, **mk)
        self.val_data = TrainData(ddir, rows, va, **mk) if len(va) else None  # packed as on one device
        return tr

    def _vocabulary(self, ddir: Path, rows) -> int:
        """The draft vocabulary size; for a pruned one, t2d / d2t (read from the data directory, else
        built from the token counts, the same on every process; process 0 writes them)."""
        V = self.target.config.vocab_size
        Vd = self.cfg.draft.draft_vocab_size or V
        if Vd > V:
            raise TrainError(f"draft.draft_vocab_size {Vd} is larger than the target vocabulary ({V})",
                             key="draft.draft_vocab_size")
        self.algorithm.check_target(self.target, Vd)  # before any vocabulary work (MTP has none)
        self.t2d = self.d2t = None
        if Vd != V:
            got = vocab.load_vocab_mapping(ddir, Vd, V)
            if got is None:
                fp = ddir / vocab.TOKEN_FREQ_NAME
                freq = vocab.load_token_freq(fp) if fp.is_file() else vocab.token_frequencies(rows)
                got = vocab.build_vocab_mapping(freq, Vd, V)
                if self.main:
                    vocab.save_vocab_mapping(ddir, *got)
            self.d2t, self.t2d = got
        return Vd

    def _schedule(self, ddir: Path, n_train: int) -> None:
        """Steps per epoch, the run's real step count and the LR schedule's span."""
        cfg = self.cfg
        self.steps_per_epoch = len(self.train_data.step_batches(0))
        if self.steps_per_epoch == 0:
            why = "the train split is empty" if self.replicas == 1 else (
                f"the train split has {n_train} rows; {self.replicas} packed rows per step ({self.mesh_desc}) need "
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

    # ------------------------------------------------------------------ state
    def build_state(self):
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
            total=self.sched_total, num_cycles=cfg.scheduler.scheduler_num_cosine_cycles, max_grad_norm=o.max_grad_norm,
            mesh=self.mesh)
        self.shardings = None
        if self.mesh is None:
            opt_state = self.tx.init(params)
        else:
            self.shardings = sh = sharded.step_shardings(params, frozen, self.tx, self.mesh, self.online)
            params = sharded.place(params, sh.params)
            self.frozen = frozen = sharded.place(frozen, sh.frozen)
            opt_state = jax.jit(self.tx.init, out_shardings=sh.opt_state)(params)
        online = None
        if self.online:  # the target (placed by TARGET_RULES on a mesh) runs inside the step
            online = OnlineTarget.of(self.target.model, self.layer_ids, HS_DTYPES[cfg.data.hidden_states_dtype],
                                     self.mesh)
        self.fns = make_step_fns(graphdef, frozen, self.tx, cfg, self.shardings, online)
        # The step holds the frozen tensors (the verifier's embedding / head) once, in the compute
        # dtype (fns.frozen); their float32 originals go to the host, for exports, instead of
        # staying on the device beside that copy.
        self.frozen = sharded.to_host_tree(frozen)
        del frozen
        return params, opt_state

    def model_of(self, params):
        return nnx.merge(self.graphdef, params, self.frozen)

    def host_model_of(self, params):
        """``model_of`` with host copies when some leaf lives on other processes (a collective:
        every process calls it; exports then happen on process 0)."""
        if not (sharded.needs_gather(params) or sharded.needs_gather(self.frozen)):
            return self.model_of(params)
        return nnx.merge(self.graphdef, sharded.to_host_tree(params), sharded.to_host_tree(self.frozen))

    # ------------------------------------------------------------------ checkpoints
    def _manager(self):
        return checkpoint_manager(self.out / "checkpoints", self.cfg.trainer.keep_checkpoints)

    def save(self, mngr, step: int, params, opt_state, extra: dict):
        save_state(mngr, step, {"params": params, "opt_state": opt_state}, extra)

    def restore(self, mngr, params, opt_state):
        sh = None if self.shardings is None else {"params": self.shardings.params, "opt_state": self.shardings.opt_state}
        step, state, meta = restore_state(mngr, {"params": params, "opt_state": opt_state}, sh)
        return step, state["params"], state["opt_state"], meta

    # ------------------------------------------------------------------ validation / export
    def val_steps(self) -> list[tuple[np.ndarray, ...]]:
        return validation_steps(self.val_data, self.replicas)

    def host_rows(self, data: TrainData, step: tuple[np.ndarray, ...]) -> dict[int, dict]:
        """The packed rows of one step that this process feeds: ``{row: [1, T, ...] arrays}``."""
        tl = data.target_need(step) if data.online else None  # every row of a step: one target length
        return {r: data.batch(step[r], tl) if data.online else data.batch(step[r]) for r in self.local_rows}

    def device_batch(self, rows: dict[int, dict], step: int) -> dict:
        """Host rows -> the step's batch: ``[N, T, ...]`` on one device, or global arrays split
        over ``("data", "fsdp")`` with the key data replicated."""
        if self.shardings is None:
            cat = {k: np.concatenate([rows[r][k] for r in range(self.replicas)]) for k in rows[0]}
            return device_batch(cat, self._rng(step))
        return sharded.global_batch(rows, self.replicas, self.shardings.batch,
                                    np.asarray(jax.random.key_data(self._rng(step))))

    @property
    def local_rows(self) -> list[int]:
        """The rows (of the ``N`` per step) this process's devices hold: all of them on one process."""
        if self.mesh is None:
            return list(range(self.replicas))
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
    def train(self, *, stop_after: int | None = None) -> dict:
        """Train (or resume) to the end. ``stop_after``: return after this many steps of this call
        (tests: simulates a killed run; the last checkpoint is written at that point)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
        sync("specjax-train-start")
        params, opt_state, mngr, start, best = self._begin()
        parallel = {"rows_per_step": self.replicas, "mesh": self.mesh_desc}
        if self.main:
            write_run_files(self.out, cfg, parallel)
        items = schedule_items(self.train_data, start, self.total_steps, cfg.trainer.epochs)
        # TensorBoard drops points at steps > start (the killed run's); the restored step's stay
        sinks = open_sinks(self.out, self.log_to, config=cfg.model_dump(mode="json"),
                           resume_step=start + 1 if self.resume else None) if self.main else None
        bar = tqdm(total=self.total_steps, initial=start, unit="step", desc=f"train {cfg.speculator_type}",
                   disable=not self.progress, dynamic_ncols=True)
        lp = _Loop(step=start, best=best, t0=time.perf_counter(), sinks=sinks)
        build = lambda st: self.host_rows(self.train_data, st)  # noqa: E731
        with Prefetch(build, [(it[0], it[1]) for it in items]) as feed:  # closed when the loop stops early
            for (gstep, b, epoch, end_of_epoch), (_, rows) in zip(items, feed):
                tok = sum(self.train_data.tokens(idx) for idx in b)
                params, opt_state, m = self.fns.train_step(params, opt_state, self.device_batch(rows, gstep))
                lp.step, lp.done_here, lp.tok_seen = gstep + 1, lp.done_here + 1, lp.tok_seen + tok
                if lp.step % cfg.trainer.log_every == 0 or lp.step == self.total_steps:
                    self._log_step(lp, m, gstep, epoch, tok, bar)
                bar.update(1)
                self._maybe_validate(lp, params, epoch, end_of_epoch)
                # every process takes the same decision (process 0's clock), or the collectives below deadlock
                timeout = bool(cfg.trainer.max_minutes) and agree(
                    (time.perf_counter() - t_start) / 60 >= cfg.trainer.max_minutes)
                killed = stop_after is not None and lp.done_here >= stop_after
                if lp.step % cfg.trainer.checkpoint_every == 0 or lp.step == self.total_steps or timeout or killed:
                    meta = {"step": lp.step, "best": lp.best, "fingerprint": cfg.fingerprint(), "parallel": parallel}
                    self.save(mngr, lp.step, params, opt_state, meta)
                    lp.flush()  # a remote run's metrics reach the bucket with each checkpoint
                if timeout or killed:
                    lp.stopped = "max_minutes" if timeout else "stop_after"
                    break
        bar.close()
        if sinks is not None:
            sinks.close()
        return self._finish(lp, params, opt_state, t_start)

    def _begin(self):
        """The state the loop starts from: fresh, or restored from the last checkpoint (a resume
        killed before its first save starts over; the partial save is removed)."""
        params, opt_state = self.build_state()
        # Training reads cached hidden states: the target's weights are not needed on the device any
        # more (its config and tokenizer stay). A caller that passed target= keeps its own reference.
        if not self.online:
            self.target = TargetInfo.of(self.target)
        mngr = self._manager()
        start, best = 0, {"val_loss": None, "step": None}
        if self.resume and self.main:
            for p in partial_saves(self.out / "checkpoints"):  # a save the kill interrupted
                storage.remove(p, ignore_errors=True)
        if self.resume and self.resume_from_scratch:
            self.log("no complete checkpoint: the run was stopped before its first save finished; starting it over "
                     "from step 0 (the same state)")
        elif self.resume:
            start, params, opt_state, meta = self.restore(mngr, params, opt_state)
            best = meta.get("best", best)
            self.log(f"resumed from step {start}")
        if self.resume and self.main:
            keep_metrics_through(self.out / "metrics.jsonl", start)
        return params, opt_state, mngr, start, best

    def _log_step(self, lp: "_Loop", m, gstep: int, epoch: int, tok: int, bar) -> None:
        """One metrics record (sinks) and the progress bar's figures."""
        mh = normalize_metrics(jax.device_get(m))
        el = time.perf_counter() - lp.t0
        rec = {"step": lp.step, "epoch": epoch, "tokens": tok,
               "lr": {k: float(fn(gstep)) for k, fn in self.lr_fns.items()},
               "tok_per_s": round(lp.tok_seen / max(el, 1e-9), 1), **{k: round(v, 6) for k, v in mh.items()}}
        rec.update(self.algorithm.record_fields(mh))
        lp.write(rec)
        lp.summary_metrics = rec
        post = {"loss": f"{mh['loss']:.3f}", **self.algorithm.postfix(mh, rec)}
        post["tok/s"] = f"{rec['tok_per_s']:.0f}"
        bar.set_postfix(post)

    def _maybe_validate(self, lp: "_Loop", params, epoch: int, end_of_epoch: bool) -> None:
        """Validation when due (every ``val_every`` steps, else at each epoch's end), exporting
        ``best`` when it improves."""
        cfg, step = self.cfg, lp.step
        val_every = cfg.trainer.val_every
        do_val = (val_every and step % val_every == 0) or (not val_every and end_of_epoch)
        if not (do_val and self.val_data is not None and lp.last_val != step):
            return
        vm = self.validate(params)
        lp.last_val = step
        vrec = {"split": "val", "step": step, "epoch": epoch, **{k: round(v, 6) for k, v in vm.items()}}
        vrec.update(self.algorithm.record_fields(vm))
        lp.write(vrec)
        if cfg.trainer.save_best and (lp.best["val_loss"] is None or vm["loss"] < lp.best["val_loss"]):
            lp.best = {"val_loss": vm["loss"], "step": step, "metrics": vrec}
            self.export("best", params, {"step": step, "val_loss": vm["loss"]})

    def _finish(self, lp: "_Loop", params, opt_state, t_start: float) -> dict:
        """The run's summary; the ``last`` export and summary.json unless the call was cut short."""
        if lp.step < self.total_steps and lp.stopped is None:
            lp.stopped = "epochs"
        summary = {"steps": lp.step, "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
                   "stopped": lp.stopped, "seconds": round(time.perf_counter() - t_start, 2),
                   "train_seconds": round(time.perf_counter() - lp.t0, 2), "tokens_seen": lp.tok_seen,
                   "compiles": dict(self.fns.traces), "best": lp.best, "last_metrics": lp.summary_metrics,
                   "online_target_lengths": sorted(self.train_data.target_lengths) if self.online else None,
                   "mesh": self.mesh_desc, "rows_per_step": self.replicas, "processes": jax.process_count(),
                   "output_dir": str(self.out)}
        if lp.stopped != "stop_after":
            summary["last"] = str(self.export("last", params, {"step": lp.step}))
            if self.main:
                storage.write_text(self.out / "summary.json", json.dumps(summary, indent=2, default=str))
        self.params, self.opt_state = params, opt_state
        return summary


@dataclass
class _Loop:
    """The training loop's running figures."""

    step: int
    best: dict
    t0: float
    sinks: object = None
    tok_seen: int = 0
    done_here: int = 0
    last_val: int | None = None
    stopped: str | None = None
    summary_metrics: dict = field(default_factory=dict)

    def write(self, rec: dict) -> None:
        if self.sinks is not None:
            self.sinks.write(rec)

    def flush(self) -> None:
        if self.sinks is not None:
            self.sinks.flush()


def train(cfg: TrainConfig, *, target=None, mesh=None, data_parallel: int | None = None, resume: bool = False,
          overwrite: bool = False, progress: bool = True, log: Callable[[str], None] | None = None,
          log_to: list[str] | None = None) -> dict:
    """Library entry point of ``specjax train`` (``mesh``, ``data_parallel``: see :class:`Run`;
    ``log_to``: metric sinks besides ``metrics.jsonl``, :mod:`specjax.train.metric_sinks`)."""
    return Run(cfg, target=target, mesh=mesh, data_parallel=data_parallel, resume=resume, overwrite=overwrite,
               progress=progress, log=log, log_to=log_to).train()
