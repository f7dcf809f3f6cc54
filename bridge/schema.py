"""Typed speculators configs: one class per ``speculators_model_type``.

Fields and defaults follow speculators 0.9.0 (REFERENCE section 1). A config is parsed
once at the boundary; unknown keys are kept verbatim so that writing a config back
reproduces every key and value it was read from (``to_dict``).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, ValidationError, model_validator

from bridge.errors import CheckpointNotFoundError, ConfigError, UnknownModelTypeError
from bridge.hf_values import DTYPES, layer_problems, one_of
from bridge.jsonio import read_json

CONFIG_NAME = "config.json"


class _Strict(BaseModel):
    # allow_inf_nan=False: a NaN/inf float (rms_norm_eps, accept_tolerance) is refused here; Orbax would
    # store it as null and fail to restore
    model_config = ConfigDict(extra="allow", strict=True, validate_assignment=True, allow_inf_nan=False)


class ProposalMethod(_Strict):
    proposal_type: Literal["greedy"] = "greedy"
    speculative_tokens: int = Field(5, ge=1)
    verifier_accept_k: int = Field(1, ge=1)
    accept_tolerance: float = Field(0.0, ge=0.0)


class VerifierBinding(_Strict):
    name_or_path: str | None = None
    architectures: list[str] = Field(default_factory=list)


class SpeculatorsBlock(_Strict):
    algorithm: str
    proposal_methods: list[ProposalMethod] = Field(min_length=1)
    default_proposal_method: str = "greedy"
    verifier: VerifierBinding = Field(default_factory=VerifierBinding)

    @model_validator(mode="after")
    def _default_is_listed(self):
        types = [p.proposal_type for p in self.proposal_methods]
        if self.default_proposal_method not in types:
            raise ValueError(f"default_proposal_method {self.default_proposal_method!r} is not one of {types}")
        return self


class LayerConfig(_Strict):
    """Typed view of ``transformer_layer_config`` (the draft decoder definition)."""

    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False)
    model_type: str = "qwen3"  # speculators rebuilds a Qwen3Config when the key is absent
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(ge=0)
    vocab_size: int = Field(gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0.0)
    hidden_act: str = "silu"
    attention_bias: StrictBool = False  # "false" would be a truthy string to transformers
    mlp_bias: StrictBool = False
    max_position_embeddings: int = Field(2048, gt=0)
    layer_types: list[str] | None = None
    sliding_window: int | None = Field(None, gt=0)
    pad_token_id: int | None = None
    tie_word_embeddings: StrictBool = False

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _layer_types_fit(self):
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers "
                                 f"{self.num_hidden_layers}; expected one per layer")
        return self

    @model_validator(mode="after")
    def _heads_fit(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"head_dim is absent and hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}; expected an explicit head_dim")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.kv_heads}; expected grouped-query heads")
        return self

    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types or []) if t == "sliding_attention"]


class DraftConfig(_Strict):
    """Keys every speculators checkpoint has (REFERENCE 1.1)."""

    REGISTRY: ClassVar[dict[str, type["DraftConfig"]]] = {}
    algorithm: ClassVar[str] = ""
    binds_verifier_family: ClassVar[bool] = False  # the draft's layer is the verifier's own (MTP)

    speculators_model_type: str
    speculators_version: str | None = None
    architectures: list[str] = Field(default_factory=list)
    speculators_config: SpeculatorsBlock
    transformer_layer_config: dict
    _raw: dict | None = PrivateAttr(default=None)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.algorithm:
            DraftConfig.REGISTRY[cls.algorithm] = cls

    # -- derived views
    @property
    def layer(self) -> LayerConfig:
        return LayerConfig.model_validate(self.transformer_layer_config)

    @property
    def proposal(self) -> ProposalMethod:
        return self.speculators_config.proposal_methods[0]

    @property
    def speculative_tokens(self) -> int:
        return self.proposal.speculative_tokens

    @property
    def verifier_path(self) -> str | None:
        return self.speculators_config.verifier.name_or_path

    @property
    def aux_layer_ids(self) -> list[int] | None:
        return None

    @property
    def num_aux(self) -> int:
        ids = self.aux_layer_ids
        return len(ids) if ids else 3

    @property
    def verifier_vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def vocab_pruned(self) -> bool:
        return self.draft_vocab_size != self.verifier_vocab_size

    # -- serialization
    def to_dict(self, *, explicit: bool = False) -> dict:
        """The config.json object. Keys read from disk keep their order and values;
        ``explicit`` also writes every known field that was left at its default."""
        raw = self._raw
        dumped = self.model_dump(mode="json", exclude_unset=not explicit)
        if raw is None:
            return dumped
        out = copy.deepcopy(raw)
        for k, v in dumped.items():
            if k not in out or out[k] != v:
                out[k] = v
        return out


class Eagle3Config(DraftConfig):
    algorithm: ClassVar[str] = "eagle3"
    speculators_model_type: Literal["eagle3"] = "eagle3"
    draft_vocab_size: int = 32000
    norm_before_residual: bool = False
    target_hidden_size: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    embed_requires_grad: bool = False

    @model_validator(mode="after")
    def _exclusive_norms(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        return self

    @property
    def aux_layer_ids(self):
        return self.eagle_aux_hidden_state_layer_ids


class PEagleConfig(Eagle3Config):
    algorithm: ClassVar[str] = "peagle"
    speculators_model_type: Literal["peagle"] = "peagle"  # type: ignore[assignment]
    mask_token_id: int | None = None
    embed_requires_grad: bool = True


class DFlashConfig(DraftConfig):
    algorithm: ClassVar[str] = "dflash"
    speculators_model_type: Literal["dflash"] = "dflash"
    draft_vocab_size: int = 32000
    block_size: int = Field(8, ge=1)
    target_hidden_size: int | None = None
    aux_hidden_state_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    sliding_window_non_causal: bool = False
    sample_from_anchor: bool = False

    @property
    def aux_layer_ids(self):
        return self.aux_hidden_state_layer_ids

    @property
    def expected_speculative_tokens(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


class DSparkConfig(DFlashConfig):
    algorithm: ClassVar[str] = "dspark"
    speculators_model_type: Literal["dspark"] = "dspark"  # type: ignore[assignment]
    sample_from_anchor: bool = True
    markov_rank: int = Field(256, ge=0)
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True


class MTPConfig(DraftConfig):
    algorithm: ClassVar[str] = "mtp"
    binds_verifier_family: ClassVar[bool] = True  # its layer is the verifier's own (model_type must match)
    speculators_model_type: Literal["mtp"] = "mtp"
    num_nextn_predict_layers: int = 1

    @model_validator(mode="after")
    def _one_layer(self):
        if self.num_nextn_predict_layers != 1:
            raise ValueError(f"num_nextn_predict_layers must be 1 (speculators supports one MTP layer), got {self.num_nextn_predict_layers}")
        return self

    @property
    def draft_vocab_size(self) -> int:  # MTP always predicts over the verifier vocabulary
        return self.layer.vocab_size


ALGORITHMS = tuple(DraftConfig.REGISTRY)

# No transformer has come near this depth (the deepest published LLMs have ~130 layers); an aux id
# beyond it is a corrupted value, refused even when no verifier config is at hand to give the real bound.
MAX_LAYER_ID = 4096


def aux_id_problems(cfg: DraftConfig) -> list[tuple[str, str, str]]:
    """``[(rule, key, message)]`` for the recorded aux layer ids, from the config alone."""
    key = "aux_hidden_state_layer_ids" if isinstance(cfg, DFlashConfig) else "eagle_aux_hidden_state_layer_ids"
    ids = cfg.aux_layer_ids
    if ids is None:
        return []
    out = []
    if not ids:
        out.append(("aux_ids.empty", key, f"{key} is an empty list; expected the verifier layers the draft reads "
                                          "(null or no key for the default)"))
    if len(set(ids)) != len(ids):
        out.append(("aux_ids.distinct", key, f"aux layer ids {ids} repeat a layer; speculators 0.9.0 requires "
                                             "distinct ids"))
    if any(i < 0 for i in ids):
        out.append(("aux_ids.range", key, f"aux layer ids {ids} contain a negative id"))
    if any(i > MAX_LAYER_ID for i in ids):
        out.append(("aux_ids.range", key, f"aux layer id {max(ids)} is beyond any verifier's depth "
                                          f"(expected <= {MAX_LAYER_ID}; the verifier's layer count bounds it)"))
    return out


def _loc(err: dict) -> str:
    return ".".join(str(p) for p in err.get("loc", ())) or "<root>"


def _describe(err: dict, prefix: str) -> str:
    """One pydantic error as ``key: what (found value)``; a whole-section rule (a model validator)
    names the section and states its own finding, without dumping the section."""
    msg = err["msg"].removeprefix("Value error, ")
    if not err.get("loc"):
        return f"{prefix.rstrip('.') or '<root>'}: {msg}"
    return f"{prefix}{_loc(err)}: {msg} (found {err.get('input')!r})"


def parse_config(raw: Any, *, path: str | None = None) -> DraftConfig:
    """Validate a config.json object. Refuses to guess a missing model type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config is a JSON {type(raw).__name__}; expected an object", path=path)
    mt = raw.get("speculators_model_type")
    if mt is None:
        raise UnknownModelTypeError(
            "no 'speculators_model_type' key; expected one of " + ", ".join(ALGORITHMS)
            + " (speculators refuses to guess, and so does specjax)", path=path, key="speculators_model_type")
    if not isinstance(mt, str) or mt not in DraftConfig.REGISTRY:
        raise UnknownModelTypeError(
            f"speculators_model_type {mt!r} is not supported; expected one of {', '.join(ALGORITHMS)}",
            path=path, key="speculators_model_type")
    cls = DraftConfig.REGISTRY[mt]
    if not isinstance(raw.get("transformer_layer_config"), dict):
        raise ConfigError("'transformer_layer_config' must be an object (the draft decoder config)",
                          path=path, key="transformer_layer_config")
    for model, prefix in ((cls, ""), (LayerConfig, "transformer_layer_config.")):
        try:
            cfg = model.model_validate(raw if model is cls else raw["transformer_layer_config"])
        except ValidationError as e:
            msgs = "; ".join(_describe(x, prefix) for x in e.errors()[:4])
            raise ConfigError(f"invalid {mt} config: {msgs}", path=path, key=prefix + _loc(e.errors()[0])) from None
        if model is cls:
            out = cfg
    tl = raw["transformer_layer_config"]
    for key, msg in layer_problems(tl):
        raise ConfigError(f"invalid {mt} config: transformer_layer_config.{key}: {msg}", path=path,
                          key=f"transformer_layer_config.{key}")
    for k in ("dtype", "torch_dtype"):
        if raw.get(k) is not None and not one_of(raw[k], DTYPES):
            raise ConfigError(f"{k} {raw[k]!r} is not a dtype name transformers reads; expected one of "
                              f"{sorted(DTYPES)}", path=path, key=k)
    for i, pm in enumerate(out.speculators_config.proposal_methods):
        # verifier_accept_k is a top-k over the verifier's vocabulary (lossy above 1: an audit warning);
        # beyond the vocabulary it is no setting anyone meant
        if pm.verifier_accept_k > out.layer.vocab_size:
            raise ConfigError(f"verifier_accept_k {pm.verifier_accept_k} exceeds the verifier vocabulary "
                              f"({out.layer.vocab_size} tokens); expected 1 (exact) or a lossy top-k within it",
                              path=path, key=f"speculators_config.proposal_methods.{i}.verifier_accept_k")
    algo = out.speculators_config.algorithm
    if algo != mt:
        raise ConfigError(f"speculators_config.algorithm is {algo!r} but speculators_model_type is {mt!r}; "
                          "expected the same algorithm in both", path=path, key="speculators_config.algorithm")
    if "tie_word_embeddings" in raw and not isinstance(raw["tie_word_embeddings"], bool):
        raise ConfigError(f"tie_word_embeddings is {raw['tie_word_embeddings']!r}; expected true or false (a JSON "
                          "boolean: transformers reads any other value by its truthiness)", path=path,
                          key="tie_word_embeddings")
    out._raw = copy.deepcopy(raw)
    return out


def read_config(directory: str | Path) -> DraftConfig:
    d = Path(directory)
    p = d / CONFIG_NAME
    if not d.exists():
        raise CheckpointNotFoundError("checkpoint directory does not exist", path=str(d))
    if not os.path.lexists(p):  # anything else there (a FIFO, a symlink loop) is refused by read_json, unopened
        raise CheckpointNotFoundError(f"no {CONFIG_NAME} in the checkpoint directory", path=str(d), key=CONFIG_NAME)
    raw = read_json(p, what=CONFIG_NAME, error=ConfigError)
    return parse_config(raw, path=str(p))


def dumps_config(cfg: DraftConfig | dict, *, explicit: bool = False) -> str:
    d = cfg if isinstance(cfg, dict) else cfg.to_dict(explicit=explicit)
    # transformers writes indent=2, sorted keys, trailing newline
    return json.dumps(d, indent=2, sort_keys=True) + "\n"
