"""``convert_external``: one code path behind the API and ``specjax convert --from``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.atomic import atomic_dir
from bridge.auditor import audit as audit_checkpoint
from bridge.checkpoint import save_checkpoint
from bridge.errors import BridgeError, TensorMismatchError, WriteError
from bridge.external import dflash_zlab, eagle3_safeailab, mtp_native
from bridge.external.common import Plan
from bridge.external.errors import ExternalAuditError, ExternalSourceError, UnrecognizedSourceError
from bridge.external.source import Source, open_source, open_verifier
from bridge.schema import parse_config

CONVERTERS = {m.KIND: m for m in (eagle3_safeailab, dflash_zlab, mtp_native)}
SOURCES = tuple(CONVERTERS)  # eagle3-safeailab, dflash-zlab, mtp
# speculators' own algorithm names (convert_model / `speculators convert --algorithm`) are accepted too
ALIASES = {"eagle3": "eagle3-safeailab", "dflash": "dflash-zlab"}
DETECT_ORDER = (dflash_zlab, eagle3_safeailab, mtp_native)  # config markers first, then tensor prefixes
AUX_OPTION = {"eagle3-safeailab": "eagle_aux_hidden_state_layer_ids", "dflash-zlab": "aux_hidden_state_layer_ids"}
LOOKED_FOR = ("config.json with dflash_config or a *DFlash* architecture (dflash-zlab)",
              "midlayer.* tensors (eagle3-safeailab)",
              "mtp.* tensors (mtp)")


@dataclass
class ExternalConversion:
    """What ``convert_external`` did."""

    out: Path
    source_kind: str
    algorithm: str  # speculators_model_type written
    detected: str | None  # why --from auto chose source_kind (None when it was given)
    options: dict[str, Any]  # after defaults
    config: dict
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    notes: list[str] = field(default_factory=list)
    report: Any = None  # bridge.Report of the audit (None with audit=False)

    def to_json(self) -> dict:
        return {"out": str(self.out), "source_kind": self.source_kind, "algorithm": self.algorithm,
                "detected": self.detected, "options": self.options, "tensors": len(self.tensors),
                "notes": self.notes, "audit": self.report.to_json() if self.report is not None else None}


def detect_source(src: str | os.PathLike | Source) -> tuple[str, str]:
    """``(kind, reason)`` for a source directory, from its config and tensor names."""
    s = src if isinstance(src, Source) else open_source(src)
    cfg = s.config
    if isinstance(cfg, dict) and "speculators_model_type" in cfg:
        raise ExternalSourceError(f"already a speculators checkpoint (speculators_model_type="
                                  f"{cfg['speculators_model_type']!r}); nothing to convert from: use "
                                  "`specjax convert SRC DST --to orbax|speculators`", path=str(s.path / "config.json"),
                                  key="speculators_model_type")
    names = s.names
    for m in DETECT_ORDER:
        why = m.detect(cfg, names)
        if why:
            return m.KIND, why
    prefixes = sorted({n.split(".")[0] for n in names})
    raise UnrecognizedSourceError(
        "cannot tell what kind of draft this is. Looked for: " + "; ".join(LOOKED_FOR)
        + f". Found config keys {sorted(cfg)[:12] if isinstance(cfg, dict) else '(no config.json)'} and "
        f"{len(names)} tensors with prefixes {prefixes[:12]}. Pass --from {{{', '.join(SOURCES)}}} if you know it.",
        path=str(s.path))


def resolve_kind(algorithm: str | None) -> str:
    a = "auto" if algorithm is None else str(algorithm)
    a = ALIASES.get(a, a)
    if a != "auto" and a not in CONVERTERS:
        raise ExternalSourceError(f"unknown source kind --from {algorithm!r}; expected one of "
                                  f"{', '.join(SOURCES + ('auto',))} (speculators' names "
                                  f"{', '.join(ALIASES)} and mtp are accepted too)", key="from")
    return a


def plan_external(src, algorithm: str | None, verifier, **options) -> tuple[str, str | None, Plan]:
    """Everything ``convert_external`` decides, without writing: ``(kind, detected, plan)``."""
    kind = resolve_kind(algorithm)
    v = open_verifier(verifier)
    s = open_source(src)
    detected = None
    if kind == "auto":
        kind, detected = detect_source(s)
    if "aux_layer_ids" in options:  # the generic name (CLI --aux-layer-ids) -> the source's own option
        target = AUX_OPTION.get(kind)
        if target is None:
            raise ExternalSourceError(f"aux layer ids do not apply to --from {kind}", key="aux_layer_ids")
        if target in options:
            raise ExternalSourceError(f"give aux_layer_ids or {target}, not both", key=target)
        options = dict(options)
        options[target] = options.pop("aux_layer_ids")
    try:
        plan = CONVERTERS[kind].plan(s, v, options)
    except ExternalSourceError as e:
        if detected is None:  # explicit --from: say so if the source looks like another kind
            try:
                other, why = detect_source(s)
            except BridgeError:
                other = None
            if other is not None and other != kind:
                raise type(e)(f"{e} -- the source looks like --from {other} ({why})", key=e.key) from e
        raise
    return kind, detected, plan


def convert_external(src: str | os.PathLike, algorithm: str | None, verifier: str | os.PathLike | None,
                     out: str | os.PathLike, *, overwrite: bool = False, audit: bool = True,
                     max_shard_bytes: int | None = None, **options) -> ExternalConversion:
    """Convert a third-party draft into a speculators checkpoint at ``out``.

    ``algorithm``: ``"eagle3-safeailab"``, ``"dflash-zlab"``, ``"mtp"`` or ``"auto"`` (None);
    ``verifier``: local directory of the target model (its config.json is read; the string
    is recorded verbatim as ``speculators_config.verifier.name_or_path``). ``options``:
    eagle3-safeailab ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``,
    ``norm_output``, ``eagle_aux_hidden_state_layer_ids``; dflash-zlab
    ``aux_hidden_state_layer_ids``; mtp ``num_speculative_steps``; ``aux_layer_ids`` names
    the source's aux-ids option whatever the kind. ``max_shard_bytes`` shards the output.

    The checkpoint is written to a temporary directory beside ``out``, audited
    (``bridge.audit`` with the verifier), and renamed into place only if the audit has no
    errors; any failure leaves nothing at ``out``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise WriteError("destination exists; pass --overwrite (overwrite=True) to replace it", path=str(out))
    kind, detected, plan = plan_external(src, algorithm, verifier, **options)
    cfg = parse_config(plan.config, path=str(out / "config.json"))
    report = None
    with atomic_dir(out, overwrite=overwrite) as tmp:
        try:
            save_checkpoint(tmp, cfg, flat=plan.tensors, overwrite=True, metadata={"format": "pt"},
                                   max_shard_bytes=max_shard_bytes)
        except TensorMismatchError as e:  # the contract check inside save: name the real destination
            raise ExternalSourceError(f"the converted {kind} tensors do not match the config: "
                                      f"{str(e).split(': ', 1)[-1]}", path=str(out), key=e.key) from e
        if audit:
            report = audit_checkpoint(tmp, verifier=Path(str(verifier)))
            if report.exit_code:
                msgs = "; ".join(f"[{f.rule}] {f.message}" for f in report.errors[:6]) or report.unreadable
                raise ExternalAuditError(f"the converted {kind} checkpoint fails the audit, nothing written: {msgs}",
                                         report=report, path=str(out))
        if report is not None:
            report.path = str(out)
    tensors = {n: (str(a.dtype), tuple(a.shape)) for n, a in plan.tensors.items()}
    return ExternalConversion(out, kind, plan.config["speculators_model_type"], detected, plan.options, plan.config,
                              tensors, plan.notes, report)
