"""Where a run's metric records go: ``metrics.jsonl``, TensorBoard event files, Weights & Biases.

``--log-to tensorboard,wandb,jsonl`` -> :func:`parse_log_to` -> :func:`open_sinks` -> a
:class:`Sinks` whose ``write(rec)`` takes each record exactly as ``metrics.jsonl`` holds it and
``close()`` ends the run. A record is a flat JSON object with ``step``, an optional ``split``
(``"val"`` for validation records; training records have none) and fields; nested objects
(``lr: {"default": ...}``) flatten to ``lr/default``.

=============  ==========================================================================
sink           what it writes
=============  ==========================================================================
jsonl          ``<run>/metrics.jsonl``: one JSON line per record, flushed each time
tensorboard    ``<run>/tensorboard/events.out.tfevents.*`` (tensorboardX): one scalar per
               numeric field, tag ``<split>/<field>`` (``train/loss``, ``val/loss``,
               ``train/lr/default``) at ``step``; on resume ``purge_step`` makes TensorBoard
               drop the killed run's later points
wandb          ``wandb.log({tag: value}, step=step)`` with the same tags, the recipe as the
               run config, files under ``<run>/wandb``; only when ``wandb`` is installed
               (it is an optional extra: ``pip install 'specjax[wandb]'``)
=============  ==========================================================================

Non-numeric fields (strings, lists) go to ``metrics.jsonl`` only.

A run directory on a bucket (``gs://...``): the sinks write into a local
:class:`specjax.storage.Spool` (``metrics.jsonl`` fetched first, so a resumed run appends to it)
and :meth:`Sinks.flush` (each checkpoint) and :meth:`Sinks.close` upload what changed.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from specjax import storage
from specjax.train.errors import TrainError

SINKS = ("jsonl", "tensorboard", "wandb")


class MetricSinkError(TrainError, ValueError):
    """``--log-to`` names an unknown sink, or one whose library is not installed."""


class Sink(Protocol):
    def write(self, rec: dict) -> None: ...

    def close(self) -> None: ...


def parse_log_to(text: str | None) -> list[str]:
    """``"tensorboard,wandb,jsonl"`` -> ``["tensorboard", "wandb", "jsonl"]`` (each once, in order);
    an empty value -> ``["jsonl"]``."""
    names = [n.strip().lower() for n in (text or "jsonl").split(",") if n.strip()]
    bad = [n for n in names if n not in SINKS]
    if bad:
        raise MetricSinkError(f"--log-to: unknown sink(s) {bad}; expected a comma-separated list of {', '.join(SINKS)}",
                              key="log_to")
    return list(dict.fromkeys(names)) or ["jsonl"]


def scalars(rec: dict) -> tuple[int, dict[str, float]]:
    """A metrics record -> (step, ``{"<split>/<field>": value}``) of its numeric fields."""
    split = rec.get("split", "train")
    out: dict[str, float] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[prefix] = float(v)

    for k, v in rec.items():
        if k not in ("step", "split"):
            walk(f"{split}/{k}", v)
    return int(rec["step"]), out


class JsonlSink:
    def __init__(self, path: Path):
        self.f = open(path, "a", encoding="utf-8")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    def __init__(self, logdir: Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        # event files are named by the second and host: the suffix keeps a quick resume's file apart
        self.w = SummaryWriter(logdir=str(logdir), purge_step=purge_step, flush_secs=10,
                               filename_suffix=f".{os.getpid()}.from{purge_step or 0}")

    def write(self, rec: dict) -> None:
        step, vals = scalars(rec)
        for tag, v in vals.items():
            self.w.add_scalar(tag, v, global_step=step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class WandbSink:
    def __init__(self, run_dir: Path, config: dict | None, project: str | None, resume: bool):
        self.wandb = _optional("wandb")
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=project or os.environ.get("WANDB_PROJECT", "specjax"), dir=str(run_dir),
                                   config=config or {}, name=run_dir.name, resume="allow" if resume else None)

    def write(self, rec: dict) -> None:
        step, vals = scalars(rec)
        self.run.log(vals, step=step)

    def close(self) -> None:
        self.run.finish()


def _optional(module: str):
    """An optional integration, imported only when asked for (declared as an extra, not a dependency)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MetricSinkError(f"--log-to {module}: the {module} package is not installed; pip install "
                              f"'specjax[{module}]' (or drop {module} from --log-to)", key="log_to") from None


class Sinks:
    """Every sink of a run; ``write`` sends a record to each. ``spool``: the local stand-in of a
    remote run directory, uploaded by :meth:`flush` and :meth:`close`."""

    def __init__(self, sinks: list, spool: storage.Spool | None = None):
        self.sinks, self.spool = sinks, spool

    def write(self, rec: dict) -> None:
        for s in self.sinks:
            s.write(rec)

    def flush(self) -> None:
        if self.spool is not None:
            self.spool.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()
        self.flush()

    def __enter__(self) -> "Sinks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_available(names: list[str]) -> None:
    """Fail before a run starts when a requested sink's library is missing."""
    if "wandb" in names:
        _optional("wandb")
    if "tensorboard" in names:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise MetricSinkError("--log-to tensorboard: tensorboardX is not installed (it is a dependency of "
                                  "specjax; reinstall it)", key="log_to") from None


def open_sinks(run_dir: str | os.PathLike, names: list[str], *, config: dict | None = None,
               resume_step: int | None = None, wandb_project: str | None = None) -> Sinks:
    """The sinks ``names`` (from :func:`parse_log_to`) of the run in ``run_dir``. ``resume_step``:
    the step a resumed run continues from (TensorBoard drops the points after it)."""
    check_available(names)
    spool = storage.Spool(run_dir, names=("metrics.jsonl",)) if storage.is_remote(run_dir) else None
    d = spool.dir if spool is not None else Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    out: list = []
    for n in names:
        if n == "jsonl":
            out.append(JsonlSink(d / "metrics.jsonl"))
        elif n == "tensorboard":
            out.append(TensorBoardSink(d / "tensorboard", purge_step=resume_step))
        else:
            out.append(WandbSink(d, config, wandb_project, resume_step is not None))
    return Sinks(out, spool)
