"""Training recipes: YAML validated by a typed schema (pydantic), with speculators 0.9.0's
defaults and its derived per-algorithm defaults (``TrainConfig._resolve_derived_defaults``).

A recipe has the sections of speculators' ``TrainConfig`` groups (``draft``, ``data``, ``loss``,
``optimizer``, ``scheduler``, ``trainer``, ``dflash``) plus specjax's ``target`` and
``data.prepare`` (how to build the data directory when it does not exist yet). Field names are
speculators' flag names, so ``--set lr=3e-4`` works (a unique field name) as well as the dotted
``--set optimizer.lr=3e-4``. Unknown keys and wrong types are errors naming the key and the
accepted values.

Derived defaults (when left unset / null), as the 0.9.0 wheel's ``_resolve_derived_defaults``
and ``DFlashDraftModel._build_base_config_kwargs``:

==========================  ========  ========  ===============  ========  ==================
field                       eagle3    dflash    dspark           peagle    mtp
==========================  ========  ========  ===============  ========  ==================
draft.draft_arch            llama     qwen3     qwen3            qwen3     (verifier's layer)
draft.norm_before_fc        True      False     False            False     -
draft.norm_output           True      False     False            False     -
draft.num_layers            1         5         5 (wheel)        1         (one MTP layer)
loss.loss_fn                kl_div    ce        kl_div           kl_div    (own hard-label CE)
dflash.per_position_...     -         dpace     fixed-exp-decay  -         -
dflash.block_size           -         16        8                -         -
dflash.sample_from_anchor   -         False     True             -         -
optimizer.muon_lr           = lr      = lr      = lr             = lr      = lr
==========================  ========  ========  ===============  ========  ==================

The ``dspark``, ``peagle`` and ``mtp`` sections only matter to their algorithm and only enter
the resume identity of a run of that algorithm (so eagle3/dflash runs keep their identity).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specjax.train import algorithms
from specjax.train.algorithms import SPECULATOR_TYPES
from specjax.train.errors import RecipeError
from specjax.train.losses import parse_loss_spec
from specjax.train.prompts import parse_hf_spec


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)


def _prompt_source(v: str) -> str:
    """One prompt source's syntax."""
    if not v.strip():
        raise ValueError("empty; expected builtin:<set>[:<n>], hf:<id>[:<config>][:<split>] or a path")
    if v.startswith("builtin:"):
        n = v.split(":")[2:]
        if len(n) > 1 or (n and n[0] and not n[0].isdigit()):
            raise ValueError(f"{v!r}: expected builtin:<set>[:<n>] with a positive integer n")
    elif v.startswith("hf:"):
        parse_hf_spec(v)
    return v


class PrepareArgs(_Section):
    """How ``data.path`` is built when it does not exist (``specjax data prepare`` settings)."""

    prompts: str | list[str] = Field("builtin:stdlib", description="builtin:<set>[:<n>], hf:<id>[:<config>][:<split>], "
                                     "a .jsonl/.json/.parquet/.arrow file, a save_to_disk directory or a directory "
                                     "of files; a list of these is read in order and concatenated")
    regenerate: bool | Literal["unanswered"] = Field(
        True, description="true: the target writes every assistant turn; false: the conversations are used as "
        "given; unanswered: only conversations with no assistant turn are regenerated, the others used as given")
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seq_length: int = Field(2048, ge=2)
    minimum_valid_tokens: int | None = None
    batch_size: int = Field(32, ge=1)
    max_prompt_tokens: int = Field(512, ge=1)
    max_batch_tokens: int = Field(4096, ge=64)
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the target's matmuls while it regenerates and extracts hidden states: bfloat16 = "
        "bf16 products with float32 sums (the CPU kernels' vdpbf16ps, XLA's bf16 dot for a prefill; float32 elsewhere)")
    seed: int = 0
    max_samples: int | None = Field(None, ge=1, description="use the first N prompt records (after the shuffle)")
    shuffle_seed: int | None = Field(None, description="shuffle the prompt records first (datasets' shuffle order)")

    @field_validator("prompts")
    @classmethod
    def _prompt_sources(cls, v: str | list[str]) -> str | list[str]:
        """The sources' syntax (the files themselves are read when the data is built); a list of
        one is that source."""
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list; expected one prompt source or more")
            return [_prompt_source(x) for x in v] if len(v) > 1 else _prompt_source(v[0])
        return _prompt_source(v)


class DraftArgs(_Section):
    num_layers: int | None = Field(None, ge=1)
    draft_arch: Literal["llama", "qwen3"] | None = None
    target_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = Field(None, ge=1)
    mask_token_id: int | None = None
    norm_before_residual: bool = True
    embed_requires_grad: bool = False
    norm_before_fc: bool | None = None
    fc_norm: bool = False
    norm_output: bool | None = None
    sliding_window: int = Field(2048, ge=1)
    full_attention_indices: list[int] = Field(default_factory=list)
    sliding_window_non_causal: bool | None = None
    speculative_tokens: int | None = Field(
        None, ge=1, description="EAGLE-3: the proposal length the exported config.json gives vLLM "
        "(speculators_config.proposal_methods[0].speculative_tokens); unset: loss.ttt_steps, as speculators "
        "writes it. A draft trained with fewer TTT steps than it proposes at serving time sets it")


class DataArgs(_Section):
    path: str = "runs/data"
    prepare: PrepareArgs | None = None
    total_seq_len: int = Field(8192, ge=8)
    train_data_ratio: float = Field(0.9, gt=0.0, le=1.0)
    hidden_states_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    online: bool = Field(False, description="compute the target's hidden states inside the train step (the target "
                         "stays loaded; no cache files are read or written) instead of reading data.path's "
                         "hidden-state cache")
    max_anchors: int = Field(512, ge=1)
    prompt_loss: bool = Field(False, description="also supervise the prompt positions of training rows (KL to the "
                              "target's own distribution there); validation keeps the assistant-only mask")
    max_context_tokens: int | None = Field(None, ge=0, description="train on at most this many prompt positions "
                                           "before each row's first supervised token (the rest of the prompt is "
                                           "dropped from the training row: its cost goes to more answers); "
                                           "validation keeps whole rows")
    context_loss: bool = Field(False, description="with max_context_tokens: also supervise the prompt positions a "
                               "training row keeps (KL to the target's distribution there, as prompt_loss does for "
                               "whole prompts): more supervised tokens at no extra step cost; validation keeps the "
                               "assistant-only mask")
    noise_std: float = Field(0.0, ge=0.0, description="add U(-noise_std, noise_std) to the auxiliary hidden states "
                             "of training batches (EAGLE's feature augmentation; speculators' snapshot default "
                             "0.05, removed in 0.9.0); validation sees them unchanged")


class LossArgs(_Section):
    # a loss name, or weighted terms: a YAML mapping ({kl_div: 1.0, ce: 0.5}) or speculators' JSON string of one
    loss_fn: str | dict[str, Any] | None = None
    ttt_steps: int = Field(3, ge=1)
    ttt_step_loss_decay: float = 1.0


class OptimizerArgs(_Section):
    optimizer: Literal["adamw", "muon"] = "muon"
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    muon_lr: float | None = Field(None, gt=0.0)
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0)
    muon_weight_decay: float = Field(0.1, ge=0.0)
    muon_ns_steps: int = Field(5, ge=1, lt=100)
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    max_grad_norm: float = Field(1.0, gt=0.0)


class SchedulerArgs(_Section):
    scheduler_type: Literal["linear", "cosine", "none"] = "linear"
    scheduler_warmup_steps: int | None = Field(None, ge=0)
    scheduler_warmup_ratio: float | None = Field(None, ge=0.0, le=1.0)
    scheduler_total_steps: int | None = Field(None, ge=1)
    scheduler_num_cosine_cycles: float = 0.5


class TrainerArgs(_Section):
    output_dir: str = "runs/train"
    epochs: int = Field(20, ge=1)
    max_steps: int | None = Field(None, ge=1)
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    checkpoint_every: int = Field(100, ge=1, description="steps between Orbax checkpoints (and one at the end)")
    keep_checkpoints: int = Field(2, ge=1)
    val_every: int | None = Field(None, ge=1, description="steps between validations (default: each epoch end)")
    save_best: bool = True
    log_every: int = Field(1, ge=1)
    max_minutes: float | None = Field(None, gt=0.0, description="stop at a step boundary after this long")


class DFlashArgs(_Section):
    block_size: int | None = Field(None, ge=2)
    sample_from_anchor: bool | None = None
    dflash_decay_gamma: float = Field(4.0, gt=0.0)
    per_position_loss_weight: Literal["fixed-exp-decay", "dpace"] | None = None
    dpace_alpha: float = 0.5


class DSparkArgs(_Section):
    """DSpark heads (speculators' ``DSparkArgs``): Markov logit bias and confidence head."""

    markov_rank: int = Field(256, ge=0, description="low-rank dim of the Markov logit-bias head (0 disables it)")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_head_alpha: float = Field(1.0, ge=0.0, description="weight of the confidence-head BCE term")


class PEagleArgs(_Section):
    """P-EAGLE COD sampling (speculators' ``PEagleArgs``)."""

    num_depths: int = Field(8, ge=1, description="parallel prediction depths (= speculative_tokens)")
    down_sample_ratio: float = Field(0.7, gt=0.0, le=1.0)
    down_sample_ratio_min: float = Field(0.2, ge=0.0, le=1.0)


class MTPArgs(_Section):
    """MTP (speculators' ``MTPArgs``) plus where the MTP layer's first weights come from."""

    num_speculative_steps: int = Field(3, ge=1)
    step_weight_beta: float = Field(0.6, gt=0.0)
    init: Literal["native", "last_layer", "random"] = Field(
        "native", description="native: the target checkpoint's own mtp.* tensors (speculators' only way); "
                              "last_layer: the target's last decoder layer mirrored into the MTP layer; "
                              "random: the draft's own initialisation")


SECTIONS = {"draft": DraftArgs, "data": DataArgs, "loss": LossArgs, "optimizer": OptimizerArgs,
            "scheduler": SchedulerArgs, "trainer": TrainerArgs, "dflash": DFlashArgs, "dspark": DSparkArgs,
            "peagle": PEagleArgs, "mtp": MTPArgs}
# sections named after the one algorithm that reads them: part of a run's resume identity only when
# its algorithm reads them (``TrainAlgorithm.sections``); ``dflash`` stays in every run's identity,
# as it always has, so earlier runs' fingerprints still match
ALGORITHM_SECTIONS = ("dspark", "peagle", "mtp")
# keys that only change outputs / logging: a resumed run may change them freely
RESUME_SAFE = frozenset({"trainer.log_every", "trainer.keep_checkpoints", "trainer.checkpoint_every",
                         "trainer.max_minutes", "trainer.output_dir", "data.prepare", "target",
                         # the same rows in the same order; only where their hidden states come from
                         "data.online",
                         # written into the exported config.json only
                         "draft.speculative_tokens"})


class TrainConfig(_Section):
    speculator_type: Literal[SPECULATOR_TYPES] = "eagle3"
    seed: int = 42
    target: str = Field("default", description="'default' (embedded SmolLM2), a .gguf, an HF dir or cached repo id")
    verifier_name_or_path: str | None = Field(None, description="written into the exported config (default: target)")
    draft: DraftArgs = Field(default_factory=DraftArgs)
    data: DataArgs = Field(default_factory=DataArgs)
    loss: LossArgs = Field(default_factory=LossArgs)
    optimizer: OptimizerArgs = Field(default_factory=OptimizerArgs)
    scheduler: SchedulerArgs = Field(default_factory=SchedulerArgs)
    trainer: TrainerArgs = Field(default_factory=TrainerArgs)
    dflash: DFlashArgs = Field(default_factory=DFlashArgs)
    dspark: DSparkArgs = Field(default_factory=DSparkArgs)
    peagle: PEagleArgs = Field(default_factory=PEagleArgs)
    mtp: MTPArgs = Field(default_factory=MTPArgs)

    @model_validator(mode="after")
    def _derived(self):
        algo = algorithms.get(self.speculator_type)
        for key, value in algo.defaults().items():  # the algorithm's defaults for what the recipe left unset
            section, name = key.split(".")
            if getattr(getattr(self, section), name) is None:
                setattr(getattr(self, section), name, value)
        d = self.draft
        if d.sliding_window_non_causal is None:
            d.sliding_window_non_causal = False
        if self.optimizer.muon_lr is None:
            self.optimizer.muon_lr = self.optimizer.lr
        parse_loss_spec(self.loss.loss_fn)
        if d.norm_before_fc and d.fc_norm:
            raise ValueError("draft.norm_before_fc and draft.fc_norm are mutually exclusive")
        if self.data.context_loss and (self.data.max_context_tokens is None or self.data.prompt_loss):
            raise ValueError("data.context_loss supervises the prompt positions data.max_context_tokens keeps: it needs "
                             "max_context_tokens and no data.prompt_loss (which supervises whole prompts)")
        if d.speculative_tokens is not None and not algo.proposal_length_settable:
            raise ValueError(f"draft.speculative_tokens is an eagle3 setting; {self.speculator_type}'s proposal length "
                             "follows from its own settings (speculators' rule)")
        algo.validate(self)
        if d.full_attention_indices and (min(d.full_attention_indices) < 0
                                         or max(d.full_attention_indices) >= d.num_layers):
            raise ValueError(f"draft.full_attention_indices {d.full_attention_indices} must be layer ids in "
                             f"[0, {d.num_layers})")
        return self

    # -- identity for resume
    def resume_key(self) -> dict:
        """The settings a resumed run must share (everything but RESUME_SAFE keys)."""
        doc = self.model_dump(mode="json")
        own = algorithms.get(self.speculator_type).sections
        for sec in ALGORITHM_SECTIONS:
            if sec not in own:
                doc.pop(sec, None)
        flat = flatten(doc)
        return {k: v for k, v in flat.items() if not any(k == s or k.startswith(s + ".") for s in RESUME_SAFE)}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.resume_key(), sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "prepare":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ----------------------------------------------------------------------------- errors


def _model_at(loc: tuple) -> type[BaseModel] | None:
    m: Any = TrainConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        f = m.model_fields.get(part) if isinstance(m, type) and issubclass(m, BaseModel) else None
        if f is None:
            return None
        ann = f.annotation
        cands = [a for a in (get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not cands:
            return None
        m = cands[0]
    return m


def _accepted(loc: tuple) -> str:
    model = _model_at(loc)
    if model is None:
        return ""
    f = model.model_fields.get(loc[-1]) if isinstance(loc[-1], str) else None
    if f is None:
        return "accepted keys: " + ", ".join(model.model_fields)
    ann = f.annotation
    lits = [a for a in get_args(ann) if get_origin(a) is Literal] + ([ann] if get_origin(ann) is Literal else [])
    if lits:
        return "accepted values: " + ", ".join(repr(x) for lit in lits for x in get_args(lit))
    args = [getattr(a, "__name__", str(a)) for a in (get_args(ann) or (ann,))]
    return "expected " + " | ".join("null" if a == "NoneType" else a for a in args)


def _format(e: ValidationError, where: str | None) -> RecipeError:
    msgs, first = [], None
    for x in e.errors()[:6]:
        loc = tuple(x.get("loc", ()))
        key = ".".join(str(p) for p in loc) or "<root>"
        first = first or key
        if x["type"] == "extra_forbidden":
            msg = f"unknown key {key!r}; {_accepted(loc)}"
        elif x["type"] == "value_error" and not loc:
            msg = x["msg"].removeprefix("Value error, ")
        else:
            inp = x.get("input")
            msg = f"{key}: {x['msg']} (found {inp!r}); {_accepted(loc)}".rstrip("; ")
        msgs.append(msg)
    return RecipeError("; ".join(msgs), path=where, key=first)


# ----------------------------------------------------------------------------- loading


def _parse_value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _unique_fields() -> dict[str, str]:
    where: dict[str, list[str]] = {}
    for sec, model in SECTIONS.items():
        for f in model.model_fields:
            where.setdefault(f, []).append(sec)
    return {f: secs[0] for f, secs in where.items() if len(secs) == 1}


def apply_overrides(doc: dict, overrides: list[str]) -> dict:
    """``key=value`` (YAML-parsed value); key dotted (``optimizer.lr``) or a unique field name (``lr``)."""
    doc = json.loads(json.dumps(doc))
    uniq = _unique_fields()
    for ov in overrides:
        if "=" not in ov:
            raise RecipeError(f"--set {ov!r}: expected key=value", key=ov)
        k, v = ov.split("=", 1)
        k = k.strip()
        parts = k.split(".")
        if len(parts) == 1 and k not in TrainConfig.model_fields:
            if k in uniq:
                parts = [uniq[k], k]
            elif k not in SECTIONS:
                raise RecipeError(f"--set: unknown key {k!r}; accepted: dotted keys (e.g. optimizer.lr) or one of "
                                  f"{sorted(set(TrainConfig.model_fields) | set(uniq))}", key=k)
        node = doc
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise RecipeError(f"--set {k}: {p!r} is not a section", key=k)
            node = node[p]
        node[parts[-1]] = _parse_value(v)
    return doc


def load_recipe(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML recipe (or start from defaults), apply ``--set`` overrides, validate."""
    doc: Any = {}
    where = None
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise RecipeError("recipe file does not exist", path=where)
        try:
            doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"not valid YAML: {e}", path=where) from None
        if not isinstance(doc, dict):
            raise RecipeError(f"a recipe is a YAML mapping, found a {type(doc).__name__}", path=where)
    doc = apply_overrides(doc, overrides or [])
    try:
        return TrainConfig.model_validate(doc)
    except ValidationError as e:
        raise _format(e, where) from None


def config_from_dict(doc: dict) -> TrainConfig:
    try:
        return TrainConfig.model_validate(doc)
    except ValidationError as e:
        raise _format(e, None) from None
