"""Target LM configuration, validated once from an HF ``config.json`` dict.

``TargetConfig`` is frozen and hashable, so it can be a static jit argument and a static
attribute of an nnx module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from bridge.errors import ConfigError
from specjax.models.errors import UnknownArchitectureError
from specjax.models.rope import RopeConfig

# HF architecture class name -> our family key
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3"}


@dataclass(frozen=True)
class TargetConfig:
    family: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    hf_config: tuple = field(default=(), compare=False, hash=False, repr=False)  # original dict items

    @property
    def architecture(self) -> str:
        return {v: k for k, v in ARCHITECTURES.items()}[self.family]

    def layer_window(self, i: int) -> int | None:
        if self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def to_hf_dict(self) -> dict:
        return dict(self.hf_config)

    def replace(self, **kw) -> "TargetConfig":
        return replace(self, **kw)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, where: str = "config.json") -> "TargetConfig":
        """Validate an HF ``config.json`` dict; errors name the key and ``where``."""
        arch = _family(cfg, where)
        hidden = _required(cfg, "hidden_size", where)
        heads = _required(cfg, "num_attention_heads", where)
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                              path=where, key="num_key_value_heads")
        n = _required(cfg, "num_hidden_layers", where)
        max_pos = int(cfg.get("max_position_embeddings") or 2048)
        rope = RopeConfig.from_hf(cfg, head_dim=head_dim, where=where)
        if rope.rotary_dim is not None:
            raise ConfigError(f"partial_rotary_factor < 1 is not supported for {arch} targets", path=where,
                              key="partial_rotary_factor")
        sliding, layer_types = _attention_windows(cfg, arch, n, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        return cls(
            family=arch,
            vocab_size=_required(cfg, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_required(cfg, "intermediate_size", where),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch == "qwen3",
            sliding_window=sliding,
            layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            hf_config=tuple(sorted(cfg.items())),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "TargetConfig":
        p = Path(path)
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError("config.json does not exist", path=str(p)) from e
        except ValueError as e:
            raise ConfigError(f"config.json is not valid JSON ({e})", path=str(p)) from e
        if not isinstance(doc, dict):
            raise ConfigError(f"config.json holds a JSON {type(doc).__name__}; expected an object", path=str(p))
        return cls.from_hf(doc, where=str(p))


def _family(cfg: Mapping[str, Any], where: str) -> str:
    """The target family: from a known ``architectures`` entry (the last one wins), else from ``model_type``."""
    arch = None
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            arch = ARCHITECTURES[a]
    if arch is None and archs:
        raise UnknownArchitectureError(
            f"architectures {archs} is not supported; expected one of {sorted(ARCHITECTURES)}",
            path=where, key="architectures")
    if arch is None:
        mt = cfg.get("model_type")
        if mt not in MODEL_TYPES:
            raise UnknownArchitectureError(
                f"model_type {mt!r} is not supported; expected one of {sorted(MODEL_TYPES)} "
                f"(or architectures one of {sorted(ARCHITECTURES)})", path=where, key="model_type")
        arch = MODEL_TYPES[mt]
    return arch


def _required(cfg: Mapping[str, Any], k: str, where: str, typ=int):
    """A key that must be present, not null, and convertible by ``typ``."""
    if k not in cfg or cfg[k] is None:
        raise ConfigError(f"missing required key {k!r}", path=where, key=k)
    try:
        return typ(cfg[k])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"key {k!r} = {cfg[k]!r} is not a valid {typ.__name__}", path=where, key=k) from e


def _attention_windows(cfg: Mapping[str, Any], arch: str, n: int, where: str) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and per-layer attention types (Qwen3 derives them from
    ``use_sliding_window``/``max_window_layers`` when ``layer_types`` is absent), checked against
    the layer count. Returns ``(sliding_window, layer_types)``."""
    sliding = None
    layer_types: tuple[str, ...] = ()
    if arch == "qwen3":
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            sliding = int(cfg["sliding_window"])
        lt = cfg.get("layer_types")
        if lt is None:
            mwl = int(cfg.get("max_window_layers", 28))
            lt = ["sliding_attention" if sliding is not None and i >= mwl else "full_attention" for i in range(n)]
        layer_types = tuple(lt)
    elif cfg.get("layer_types"):
        layer_types = tuple(cfg["layer_types"])
        if cfg.get("sliding_window"):
            sliding = int(cfg["sliding_window"])
    if layer_types and len(layer_types) != n:
        raise ConfigError(f"layer_types has {len(layer_types)} entries; expected num_hidden_layers = {n}",
                          path=where, key="layer_types")
    bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ConfigError(f"layer_types contains {bad}; expected 'full_attention' or 'sliding_attention'",
                          path=where, key="layer_types")
    if "sliding_attention" in layer_types and sliding is None:
        raise ConfigError("layer_types has 'sliding_attention' but sliding_window is not set", path=where,
                          key="sliding_window")
    return sliding, layer_types
