"""A training run's directory and what it keeps besides the loop: the output-directory check
(resume identity, overwrite), the Orbax checkpoints (save / restore into the run's shardings),
the recovery helpers (partial saves, ``metrics.jsonl`` trimmed to the restored step), and the
target as the run needs it once the draft is built (:class:`TargetInfo`)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from specjax import storage
from specjax.sharding import abstract_with_shardings
from specjax.train.errors import ResumeError, TrainError
from specjax.models.config import TargetConfig
from specjax.models.loading import resolve_target
from specjax.models.tokenizer import Tokenizer

PARALLEL_KEY = "_parallel"  # resume.json: rows per step and the mesh of the run


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
    kind, path = resolve_target(target)
    if kind not in ("hf_dir", "hf_cache"):
        return None
    return TargetInfo(TargetConfig.from_file(Path(path) / "config.json"), Tokenizer.from_dir(path), str(path))


def partial_saves(ckpt_dir: Path) -> list[Path]:
    """Orbax's saves that never finished: local temporary directories (``<step>.orbax-checkpoint-tmp-<n>``),
    on a bucket step directories without their commit file."""
    if not ckpt_dir.is_dir():
        return []
    if storage.is_remote(ckpt_dir):
        return sorted((p for p in ckpt_dir.iterdir() if p.name.isdigit() and not ocp.path.step.is_path_finalized(p)),
                      key=str)
    return sorted(p for p in ckpt_dir.iterdir() if ".orbax-checkpoint-tmp" in p.name)


def has_checkpoint(ckpt_dir: Path) -> bool:
    """Whether a save finished here (a local step directory is renamed into place when complete; a
    bucket's has its commit file)."""
    if not ckpt_dir.is_dir():
        return False
    steps = [p for p in ckpt_dir.iterdir() if p.name.isdigit()]
    if storage.is_remote(ckpt_dir):
        return any(ocp.path.step.is_path_finalized(p) for p in steps)
    return bool(steps)


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
    storage.write_text(path, "".join(k + "\n" for k in kept))


def write_run_files(out: Path, cfg, parallel: dict) -> None:
    """run.yaml (the resolved recipe) and resume.json (what a resume must share)."""
    storage.write_text(out / "run.yaml", cfg.to_yaml())
    storage.write_text(out / "resume.json", json.dumps({**cfg.resume_key(), PARALLEL_KEY: parallel}, indent=1,
                                                       sort_keys=True))


def check_output_dir(out: Path, cfg, *, resume: bool, overwrite: bool, replicas: int, mesh_desc: str,
                     main: bool) -> bool:
    """Refuse an output directory the run cannot use (a resume of another recipe or data order, a
    finished run without ``overwrite``); with ``overwrite``, clear it (process 0). Returns whether
    a resume must start over (killed before its first save finished)."""
    ck = out / "checkpoints"
    has = has_checkpoint(ck)
    if resume:
        rj = out / "resume.json"
        from_scratch = False
        if not has:
            if not (rj.is_file() or partial_saves(ck)):
                raise ResumeError("--resume: no complete checkpoint in this run directory", path=str(ck))
            # the run started but was killed before (or during) its first save: its state then is the
            # initial state, so resuming is starting over (the partial save is removed in train())
            from_scratch = True
        if rj.is_file():
            _check_resume_identity(rj, cfg, replicas, mesh_desc)
        return from_scratch
    if has or (out / "last").exists():
        if not overwrite:
            raise TrainError("trainer.output_dir already holds a run; pass --resume to continue it or --overwrite "
                             "to start over", path=str(out))
        if main:
            for sub in ("checkpoints", "best", "last", "metrics.jsonl", "summary.json", "resume.json"):
                storage.remove(out / sub)
    return False


# resume-key settings added after runs were made, with the value such a run had in effect
ADDED_LATER = {"data.noise_std": 0.0}


def changed_settings(old: dict, cfg) -> list[str]:
    """The resume-key settings in which ``cfg`` differs from a run's ``resume.json`` contents
    ``old`` (its parallel layout left out), sorted."""
    old = {k: v for k, v in old.items() if k != PARALLEL_KEY}
    new = cfg.resume_key()
    # a setting added after the run was made reads as its default there (the run trained without it)
    return sorted(k for k in set(old) | set(new) if old.get(k, ADDED_LATER.get(k)) != new.get(k))


def _check_resume_identity(rj: Path, cfg, replicas: int, mesh_desc: str) -> None:
    """The resumed run's rows per step and recipe (its resume key) must equal the original's."""
    old = json.loads(rj.read_text(encoding="utf-8"))
    old_n = int(old.pop(PARALLEL_KEY, {}).get("rows_per_step", 1))
    if old_n != replicas:
        old_mesh = json.loads(rj.read_text(encoding="utf-8")).get(PARALLEL_KEY, {}).get("mesh", "1 device (no mesh)")
        raise ResumeError(
            f"this run was trained with {old_n} packed row(s) per step on {old_mesh}; resuming on "
            f"{mesh_desc} gives {replicas} (data x fsdp), which changes the data order. Resume on "
            f"a mesh whose data x fsdp is {old_n} (or pass data_parallel={old_n}), or start a new "
            "trainer.output_dir", path=str(rj), key="data_parallel")
    changed = changed_settings(old, cfg)
    if changed:
        new = cfg.resume_key()
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:6])
        raise ResumeError(f"the recipe changed in a way that breaks resumption ({detail}); resume with the "
                          "original recipe or start a new trainer.output_dir", path=str(rj), key=changed[0])


def checkpoint_manager(ckpt_dir: Path, keep: int) -> ocp.CheckpointManager:
    """The run's Orbax manager (synchronous saves: a save has finished when the call returns)."""
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(storage.absolute(ckpt_dir), options=opts)


def save_state(mngr, step: int, state: dict, extra: dict) -> None:
    """Save ``state`` (params and optimizer state) and the JSON ``extra`` as checkpoint ``step``."""
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(extra)),
              force=True)
    mngr.wait_until_finished()


def restore_state(mngr, state: dict, shardings: dict | None):
    """``(step, state, extra)`` of the latest checkpoint, restored into ``state``'s shapes and dtypes
    (and ``shardings``, on a mesh), bit for bit."""
    step = mngr.latest_step()
    if step is None:
        raise ResumeError("no complete checkpoint to resume from", path=str(mngr.directory))
    if shardings is None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    else:
        abstract = abstract_with_shardings(state, shardings)
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    return step, got["state"], dict(got["meta"])
