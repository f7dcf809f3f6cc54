"""Static description of a draft decoder, derived once from bridge's typed config.

``DecoderSpec`` is frozen and hashable (a static attribute of an nnx module and a valid
jit-static argument). It applies the rules speculators 0.9.0 gets through transformers'
config classes when it rebuilds ``transformer_layer_config``:

* Qwen2/Qwen3 configs drop ``sliding_window`` unless ``use_sliding_window`` is true
  (``Qwen3Config.__post_init__``), and derive ``layer_types`` from ``max_window_layers``
  when absent; Llama configs keep ``sliding_window``/``layer_types`` as given.
* a layer is sliding iff ``layer_types[i] == "sliding_attention"``; a sliding layer whose
  window resolved to None attends like a full layer (speculators builds its mask with
  ``sliding_window=None``).
* nested per-layer-type rope dicts use the ``sliding_attention`` entry
  (``speculators.models.utils.flatten_rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax.numpy as jnp
from flax import nnx

from specjax.models.errors import ModelError, UnknownArchitectureError
from specjax.models.layers import DecoderLayer
from specjax.models.rope import RopeConfig

# transformers config classes whose __post_init__ drops sliding_window without use_sliding_window
_QWEN_STYLE_WINDOW = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


class DraftConfigError(ModelError, ValueError):
    """A draft config asks for something this port does not implement (names the key)."""


def flatten_rope(layer: Mapping[str, Any]) -> dict:
    """``flatten_rope_parameters``: nested {full_attention, sliding_attention} -> the sliding entry."""
    d = dict(layer)
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and "sliding_attention" in rp:
        d["rope_parameters"] = dict(rp["sliding_attention"])
    return d


def layer_windows(layer: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    mt = layer.get("model_type", "qwen3")
    window = layer.get("sliding_window")
    types = layer.get("layer_types")
    if mt in _QWEN_STYLE_WINDOW:
        if not layer.get("use_sliding_window", False):
            window = None
        if types is None:
            mwl = int(layer.get("max_window_layers", 28))
            types = ["sliding_attention" if window is not None and i >= mwl else "full_attention"
                     for i in range(num_layers)]
    types = list(types or [])
    if types and len(types) < num_layers:
        raise DraftConfigError(f"layer_types has {len(types)} entries; expected num_hidden_layers = {num_layers}",
                               key="transformer_layer_config.layer_types")
    return tuple(int(window) if (window is not None and i < len(types) and types[i] == "sliding_attention") else None
                 for i in range(num_layers))


@dataclass(frozen=True)
class DecoderSpec:
    """Geometry of the draft's decoder layers (llama family: no q/k norm; qwen3: q/k norm)."""

    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int
    eps: float
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple  # per layer: int window or None (full attention)
    vocab_size: int
    rope: RopeConfig

    @classmethod
    def from_layer(cls, layer: Mapping[str, Any], *, qk_norm: bool | None = None, mlp_bias: bool | None = None,
                   where: str = "transformer_layer_config") -> "DecoderSpec":
        """``layer`` is the raw ``transformer_layer_config`` dict. ``qk_norm`` None: from model_type
        (qwen3 -> True); DFlash passes True (Qwen3-style layers whatever model_type says)."""
        mt = layer.get("model_type", "qwen3")
        act = layer.get("hidden_act", "silu")
        if act != "silu":
            raise DraftConfigError(f"hidden_act {act!r} is not supported; expected 'silu'", path=where, key="hidden_act")
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        kv = int(layer.get("num_key_value_heads") or heads)
        hd = int(layer.get("head_dim") or hidden // heads)
        n = int(layer["num_hidden_layers"])
        rope = RopeConfig.from_hf(flatten_rope(layer), head_dim=hd, where=where)
        if rope.rotary_dim is not None:
            raise DraftConfigError("partial_rotary_factor < 1 is not supported for draft layers "
                                   "(speculators' Llama/Qwen3 draft layers rotate the full head)", path=where,
                                   key="partial_rotary_factor")
        return cls(
            model_type=mt, hidden=hidden, heads=heads, kv_heads=kv, head_dim=hd,
            intermediate=int(layer["intermediate_size"]), num_layers=n, eps=float(layer.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)) if mlp_bias is None else mlp_bias,
            qk_norm=(mt == "qwen3") if qk_norm is None else qk_norm,
            windows=layer_windows(layer, n), vocab_size=int(layer["vocab_size"]), rope=rope)

    @classmethod
    def eagle_family(cls, layer: Mapping[str, Any], *, where: str = "transformer_layer_config") -> "DecoderSpec":
        """EAGLE-3 / P-EAGLE: speculators only has Llama and Qwen3 draft layers."""
        mt = layer.get("model_type", "qwen3")
        if mt not in ("llama", "qwen3"):
            raise UnknownArchitectureError(f"EAGLE-3 draft layers of model_type {mt!r} do not exist in speculators "
                                           "0.9.0; expected 'llama' or 'qwen3'", path=where, key="model_type")
        # Qwen3MLP has no bias whatever mlp_bias says; LlamaMLP honours it.
        return cls.from_layer(layer, mlp_bias=bool(layer.get("mlp_bias", False)) if mt == "llama" else False,
                              where=where)

    def layer(self, i: int, *, rngs: nnx.Rngs, in_features: int | None = None, param_dtype=jnp.float32,
              cls=DecoderLayer, **kw) -> DecoderLayer:
        return cls(self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, rngs=rngs,
                   norm_eps=self.eps, attn_in_features=in_features, attention_bias=self.attention_bias,
                   mlp_bias=self.mlp_bias, qk_norm=self.qk_norm, sliding_window=self.windows[i],
                   param_dtype=param_dtype, **kw)

    @property
    def distinct_windows(self) -> tuple:
        return tuple(dict.fromkeys(self.windows))
