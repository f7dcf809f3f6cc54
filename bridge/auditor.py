"""Offline audit of the speculators format contract.

Reads config.json and the safetensors headers only (``deep=True`` also scans tensor data
for NaN/Inf). Errors are contract violations that make a draft load wrong or not at all;
warnings are keys whose absence or value means different things to speculators and vLLM,
or settings that are lossy. Warnings never change the exit code.

Exit codes of ``specjax audit``: 0 clean (warnings allowed), 1 errors, 2 unreadable input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bridge.checkpoint import Opened
from bridge.contract import FLOAT, FLOAT_TAGS, expected_tensors, open_prefixes
from bridge.errors import BridgeError, CheckpointNotFoundError, ConfigError
from bridge.jsonio import read_json
from bridge.safetensors_io import open_tensors
from bridge.schema import DFlashConfig, DraftConfig, Eagle3Config, MTPConfig, PEagleConfig, aux_id_problems, read_config
from bridge.vocab_maps import vocab_map_problems

EAGLE3_FAMILIES = ("llama", "qwen3")


@dataclass
class Finding:
    level: str  # "error" | "warning"
    rule: str
    message: str
    key: str | None = None


@dataclass
class Report:
    path: str
    algorithm: str | None = None
    findings: list[Finding] = field(default_factory=list)
    unreadable: str | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def exit_code(self) -> int:
        return 2 if self.unreadable else (1 if self.errors else 0)

    def error(self, rule, msg, key=None):
        self.findings.append(Finding("error", rule, msg, key))

    def warn(self, rule, msg, key=None):
        self.findings.append(Finding("warning", rule, msg, key))

    def to_json(self) -> dict:
        return {"path": self.path, "algorithm": self.algorithm, "exit_code": self.exit_code,
                "unreadable": self.unreadable, "errors": [asdict(f) for f in self.errors],
                "warnings": [asdict(f) for f in self.warnings]}


def audit(path: str | Path, verifier: "str | Path | VerifierFacts | None" = None, *, deep: bool = False,
          opened: Opened | None = None) -> Report:
    """Audit a checkpoint directory; never raises on bad input (it is reported). ``verifier``: its
    directory, or :class:`VerifierFacts` of a loaded one. ``opened``: the directory's
    :func:`~bridge.checkpoint.open_checkpoint`, when the caller has read it already."""
    rep = Report(str(path))
    if opened is not None:
        cfg, store = opened.config, opened.store
    else:
        try:
            cfg = read_config(path)
            store = open_tensors(path)
        except BridgeError as e:
            rep.unreadable = str(e)
            return rep
    rep.algorithm = cfg.speculators_model_type
    infos = {n: i for n, i in store.infos().items()}
    check_config(cfg, {n: (tuple(i.shape), i.dtype) for n, i in infos.items()}, rep)
    check_vocab_values(cfg, store, rep, deep=deep)
    if verifier is not None:
        check_verifier(cfg, verifier if isinstance(verifier, VerifierFacts) else Path(verifier), rep)
    if deep:
        for n in store.names:
            a = store.array(n)
            if a.dtype.kind in "fV" and a.size:
                a32 = a.astype(np.float32)
                nan = int(np.isnan(a32).sum())
                inf = int(np.isinf(a32).sum())
                if nan:
                    rep.error("deep.nan", f"tensor {n!r} holds {nan} NaN value(s): the unloaded-weight sentinel "
                                          "(a verifier weight never filled, or a diverged run)", n)
                if inf:
                    rep.error("deep.inf", f"tensor {n!r} holds {inf} Inf value(s)", n)
    return rep


def check_vocab_values(cfg: DraftConfig, store, rep: Report, *, deep: bool) -> None:
    """``d2t``/``t2d`` values (small buffers, read even without ``deep``), once their header-level
    checks passed: ranges, order and agreement (:mod:`bridge.vocab_maps`)."""
    if "d2t" not in store or "t2d" not in store or any(f.key in ("d2t", "t2d") for f in rep.findings if f.level == "error"):
        return
    d2t, t2d = store.array("d2t"), store.raw_bytes("t2d")
    if not deep and not any(t2d) and not np.any(d2t):  # never filled, or a header-only (sparse) file
        rep.warn("vocab.unfilled", "d2t and t2d hold only zeros: the vocabulary mapping was never filled in (or this "
                 "is a header-only file); --deep (and loading) treat it as an error", "t2d")
        return
    for key, msg in vocab_map_problems(d2t, t2d, cfg.layer.vocab_size):
        rep.error("vocab.values", msg, key)


def check_config(cfg: DraftConfig, shapes: dict[str, tuple[tuple[int, ...], str]], rep: Report) -> None:
    """All header-level rules. ``shapes``: name -> (shape, safetensors dtype tag)."""
    exp = expected_tensors(cfg)
    shp = {n: s for n, (s, _) in shapes.items()}
    if not isinstance(cfg, MTPConfig):
        _check_seed_shapes(cfg, shp, rep)
    _check_algorithm_rules(cfg, shp, rep)
    _check_tensor_contract(cfg, exp, shapes, rep)
    _check_aux_ids(cfg, rep)
    _check_ambiguous_keys(cfg, rep)
    _check_proposals_and_binding(cfg, rep)


def _check_seed_shapes(cfg: DraftConfig, shp: dict[str, tuple[int, ...]], rep: Report) -> None:
    """The seed's shape rules of a draft with its own fc/lm_head: fc width, lm_head, embed rows,
    vocab buffers, draft vocabulary no larger than the verifier's."""
    H, V = cfg.layer.hidden_size, cfg.layer.vocab_size
    A = cfg.num_aux
    if "fc.weight" in shp and shp["fc.weight"][1:] != (A * H,):
        rep.error("fc.in_features", f"fc in_features {shp['fc.weight'][1]} != {A} aux x {H}"
                  + (" (no aux ids recorded: speculators and vLLM both assume 3)" if not cfg.aux_layer_ids else ""),
                  "fc.weight")
    Vd = cfg.draft_vocab_size
    if "lm_head.weight" in shp and shp["lm_head.weight"] != (Vd, H):
        rep.error("lm_head.shape", f"lm_head {list(shp['lm_head.weight'])} != {[Vd, H]} (draft_vocab_size x hidden)",
                  "lm_head.weight")
    if "embed_tokens.weight" in shp and shp["embed_tokens.weight"][0] != V:
        rep.error("embed.rows", f"embed_tokens rows {shp['embed_tokens.weight'][0]} != verifier vocab_size {V}",
                  "embed_tokens.weight")
    if cfg.vocab_pruned:
        for name, want in (("t2d", (V,)), ("d2t", (Vd,))):
            if name in shp and shp[name] != want:
                rep.error("vocab.buffers", f"{name} length {shp[name][0]} != {want[0]} "
                          f"(t2d: verifier vocab {V}, d2t: draft vocab {Vd})", name)
    else:
        for name in ("t2d", "d2t"):
            if name in shp:
                rep.warn("vocab.buffers", f"{name} is present but draft_vocab_size == vocab_size ({V}); "
                         "speculators ignores the mapping", name)
    if Vd > V:
        rep.error("vocab.size", f"draft_vocab_size {Vd} > verifier vocab_size {V}", "draft_vocab_size")


def _check_algorithm_rules(cfg: DraftConfig, shp: dict[str, tuple[int, ...]], rep: Report) -> None:
    """Per-algorithm rules: EAGLE-3's first-layer width and family, DFlash's block settings and
    required keys, P-EAGLE's mask token."""
    lc = cfg.layer
    H = lc.hidden_size
    algo = cfg.speculators_model_type
    if isinstance(cfg, Eagle3Config):
        q = "layers.0.self_attn.q_proj.weight"
        if q in shp and shp[q][1] != 2 * H:
            rep.error("eagle3.first_layer", f"q_proj in_features {shp[q][1]} != {2 * H} (first layer takes cat[embed, hidden])", q)
        for p in ("k_proj", "v_proj"):
            n = f"layers.0.self_attn.{p}.weight"
            if n in shp and shp[n][1] != 2 * H:
                rep.error("eagle3.first_layer", f"{p} in_features {shp[n][1]} != {2 * H}", n)
        if lc.model_type not in EAGLE3_FAMILIES:
            rep.error("eagle3.family", f"vLLM cannot dispatch {algo} draft model_type {lc.model_type!r}; "
                      f"expected one of {list(EAGLE3_FAMILIES)}", "transformer_layer_config.model_type")
    if isinstance(cfg, DFlashConfig):
        want = cfg.expected_speculative_tokens
        if cfg.speculative_tokens != want:
            rep.error("dflash.speculative_tokens",
                      f"speculative_tokens {cfg.speculative_tokens} != block_size-{0 if cfg.sample_from_anchor else 1}"
                      f" = {want} (sample_from_anchor={cfg.sample_from_anchor})",
                      "speculators_config.proposal_methods.0.speculative_tokens")
        if not cfg.aux_layer_ids:
            rep.error("dflash.aux_ids", "aux_hidden_state_layer_ids is missing; vLLM requires it and the fc width "
                      "depends on it", "aux_hidden_state_layer_ids")
        if cfg.mask_token_id is None:
            rep.error("dflash.mask_token", "mask_token_id is missing; the block drafter cannot run without it "
                      "(vLLM requires it)", "mask_token_id")
    if isinstance(cfg, PEagleConfig) and cfg.mask_token_id is None:
        rep.error("peagle.mask_token", "mask_token_id is missing; vLLM requires it (pard_token)", "mask_token_id")


def _check_tensor_contract(cfg: DraftConfig, exp: dict, shapes: dict[str, tuple[tuple[int, ...], str]],
                           rep: Report) -> None:
    """The tensor set, shapes and dtypes against the algorithm's contract (``exp``: its
    :func:`~bridge.contract.expected_tensors`)."""
    algo = cfg.speculators_model_type
    opened = open_prefixes(cfg)
    for n, spec in exp.items():
        if spec.required and n not in shapes:
            rep.error("tensors.missing", f"tensor {n!r} is missing ({algo} with these flags requires it)", n)
    for n, (s, tag) in shapes.items():
        spec = exp.get(n)
        if spec is None:
            if not n.startswith(opened):
                rep.error("tensors.unexpected", f"tensor {n!r} is not part of a {algo} checkpoint with these flags", n)
            continue
        if s != spec.shape and not _reported(rep, n):
            rep.error("tensors.shape", f"tensor {n!r} has shape {list(s)}; the config implies {list(spec.shape)}", n)
        if spec.dtype != FLOAT and tag != spec.dtype:
            rep.error("tensors.dtype", f"tensor {n!r} has dtype {tag}; expected {spec.dtype}", n)
        elif spec.dtype == FLOAT and tag not in FLOAT_TAGS:  # e.g. BF16 weights relabelled U16: same bytes, garbage
            rep.error("tensors.dtype", f"tensor {n!r} has dtype {tag}; expected a floating dtype "
                                       f"({', '.join(sorted(FLOAT_TAGS))})", n)


def _check_aux_ids(cfg: DraftConfig, rep: Report) -> None:
    """The aux hidden-state layer ids: their own problems, an EAGLE-3 draft without them, and
    DFlash's offset between speculators and vLLM."""
    algo = cfg.speculators_model_type
    ids = cfg.aux_layer_ids
    for rule, key, msg in aux_id_problems(cfg):
        rep.error(rule, msg, key)
    if ids is None and isinstance(cfg, Eagle3Config):
        rep.warn("aux_ids.absent", "no eagle_aux_hidden_state_layer_ids: speculators resolves [2, n//2, n-3] of the "
                 "verifier and vLLM defaults to the same tuple; a draft trained on other layers is served silently "
                 "wrong. Write the ids explicitly.", "eagle_aux_hidden_state_layer_ids")
    if isinstance(cfg, DFlashConfig) and ids:
        rep.warn("dflash.aux_offset", f"vLLM serves {algo} with target_layer_ids = aux - 1 = {[i - 1 for i in ids]} "
                 f"(z-lab indexing, vLLM PR #40727) while speculators reads hidden_states[{ids}] directly; both name "
                 "the same layers only if the engine applies that offset", _aux_key(cfg))


def _check_ambiguous_keys(cfg: DraftConfig, rep: Report) -> None:
    """Keys whose absence (or value) means different things to speculators and vLLM."""
    lc = cfg.layer
    algo = cfg.speculators_model_type
    raw = cfg._raw or {}
    if isinstance(cfg, Eagle3Config) and "norm_before_residual" not in raw:
        if isinstance(cfg, PEagleConfig):
            rep.warn("norm_before_residual.absent", "norm_before_residual is absent: speculators reads False and vLLM's "
                     "peagle path reads False, but speculators' TrainConfig default is True; write it explicitly",
                     "norm_before_residual")
        else:
            rep.warn("norm_before_residual.absent", "norm_before_residual is absent: speculators reads False (config "
                     "class default) but vLLM reads True (eagle3 default when absent); the two run different models. "
                     "Write it explicitly.", "norm_before_residual")
    if isinstance(cfg, DFlashConfig):
        if "sliding_window_non_causal" not in raw:
            rep.warn("sliding_window_non_causal.absent", "sliding_window_non_causal is absent: speculators reads False "
                     "(sliding layers causal in-block) but a vLLM variant computes causal = not "
                     "config.get('sliding_window_non_causal', True), i.e. non-causal; write it explicitly",
                     "sliding_window_non_causal")
        elif cfg.sliding_window_non_causal and lc.sliding_layers():
            rep.warn("sliding_window_non_causal.vllm", "sliding_window_non_causal is true with sliding layers "
                     f"{lc.sliding_layers()}: vLLM versions without that flag serve these layers causally",
                     "sliding_window_non_causal")
        if "sample_from_anchor" not in raw:
            rep.warn("sample_from_anchor.absent", f"sample_from_anchor is absent; speculators reads "
                     f"{cfg.sample_from_anchor} for {algo}; engines must match it", "sample_from_anchor")


def _check_proposals_and_binding(cfg: DraftConfig, rep: Report) -> None:
    """Lossy proposal settings, and a verifier binding that ties the draft to nothing."""
    for i, pm in enumerate(cfg.speculators_config.proposal_methods):
        if pm.verifier_accept_k > 1:
            rep.warn("proposal.lossy", f"verifier_accept_k = {pm.verifier_accept_k} > 1 accepts tokens outside the "
                     "verifier's argmax: output is no longer the target's distribution (lossy)",
                     f"speculators_config.proposal_methods.{i}.verifier_accept_k")
        if pm.accept_tolerance > 0:
            rep.warn("proposal.lossy", f"accept_tolerance = {pm.accept_tolerance} > 0 accepts near-miss tokens (lossy)",
                     f"speculators_config.proposal_methods.{i}.accept_tolerance")
    vb = cfg.speculators_config.verifier
    if not vb.name_or_path or not vb.architectures:
        missing = [k for k, v in (("name_or_path", vb.name_or_path), ("architectures", vb.architectures)) if not v]
        rep.warn("verifier.binding", f"verifier binding is empty ({', '.join(missing)}): nothing ties this draft to "
                 "its target, and vLLM needs name_or_path", "speculators_config.verifier")


def _reported(rep: Report, name: str) -> bool:
    return any(f.key == name and f.level == "error" for f in rep.findings)


def _aux_key(cfg) -> str:
    return "aux_hidden_state_layer_ids" if isinstance(cfg, DFlashConfig) else "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class VerifierFacts:
    """What the draft-verifier compatibility check reads of a verifier: from its ``config.json``
    (:meth:`from_hf`) or from a loaded target's config (the decode loader's ``check_pair``)."""

    hidden_size: Any = None
    vocab_size: Any = None
    num_hidden_layers: Any = None
    architectures: tuple = ()
    model_type: str | None = None
    where: str = "the verifier"

    @classmethod
    def from_hf(cls, raw: dict, where: str) -> "VerifierFacts":
        archs = raw.get("architectures") or ()
        return cls(raw.get("hidden_size"), raw.get("vocab_size"), raw.get("num_hidden_layers"),
                   tuple(archs) if isinstance(archs, (list, tuple)) else (), raw.get("model_type"), where)


def _verifier_text_config(vdir: Path, rep: Report) -> dict | None:
    p = vdir / "config.json"
    try:
        raw = read_json(p, what="the verifier's config.json", error=ConfigError)
    except CheckpointNotFoundError:
        rep.error("verifier.unreadable", f"{p}: verifier config.json not found", "verifier")
        return None
    except ConfigError as e:
        rep.error("verifier.unreadable", str(e), "verifier")
        return None
    if not isinstance(raw, dict):
        rep.error("verifier.unreadable", f"{p}: holds a JSON {type(raw).__name__}; expected an object", "verifier")
        return None
    if isinstance(raw.get("text_config"), dict):  # multimodal wrappers
        raw = {**raw["text_config"], "architectures": raw.get("architectures")}
    return raw


def check_verifier(cfg: DraftConfig, verifier: "Path | VerifierFacts", rep: Report) -> None:
    """The one draft-verifier compatibility check (audit, convert, and the decode loader's
    ``check_pair``): widths, aux layer ids against the verifier's depth, the bound architecture,
    and the verifier family of a draft whose layer is the verifier's own (MTP). Each message names
    both sides."""
    if isinstance(verifier, VerifierFacts):
        v = verifier
    else:
        raw = _verifier_text_config(verifier, rep)
        if raw is None:
            return
        v = VerifierFacts.from_hf(raw, f"{verifier}/config.json")
    lc = cfg.layer
    for key, label, mine in (("hidden_size", "hidden size", lc.hidden_size), ("vocab_size", "vocabulary", lc.vocab_size)):
        theirs = getattr(v, key)
        if theirs is not None and theirs != mine:
            rep.error(f"verifier.{key}", f"{label}: draft {mine} (transformer_layer_config.{key}) vs verifier {theirs} "
                                         f"({key}, {v.where})", f"transformer_layer_config.{key}")
    n = v.num_hidden_layers
    ids = cfg.aux_layer_ids
    if isinstance(n, int) and ids:
        bad = [i for i in ids if not 0 <= i <= n]
        if bad:
            rep.error("aux_ids.range", f"aux hidden-state layer ids: draft needs {list(ids)} ({bad} out of range) vs "
                                       f"verifier num_hidden_layers {n} (valid ids 0..{n})", _aux_key(cfg))
        if isinstance(cfg, DFlashConfig) and n in ids:
            rep.warn("aux_ids.last", f"aux id {n} (the final layer) is among the DFlash aux ids; it arrives implicitly "
                     "as verifier_last_hidden_states", _aux_key(cfg))
    bound = list(cfg.speculators_config.verifier.architectures or [])
    if bound and v.architectures and not set(bound) & set(v.architectures):
        rep.error("verifier.architecture", f"verifier architecture: draft was trained for {bound} "
                  f"(speculators_config.verifier.architectures) vs verifier {list(v.architectures)}",
                  "speculators_config.verifier.architectures")
    mt = cfg.transformer_layer_config.get("model_type") if cfg.binds_verifier_family else None
    if mt and v.model_type and mt != v.model_type:
        rep.error("verifier.family", f"verifier family: {cfg.speculators_model_type} layer of model_type {mt!r} vs "
                  f"verifier {v.model_type!r}", "transformer_layer_config.model_type")
