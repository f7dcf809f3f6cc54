"""Value rules for the HF keys of ``transformer_layer_config`` that the draft models, speculators
(through transformers' config classes) and Orbax read, beyond their JSON types.

Each rule returns the list of ``(key, what is wrong)`` it finds; ``bridge.schema`` raises the first
as a ConfigError naming the key. The sets are transformers 5.x's own names:

* ``ACTIVATIONS``: ``transformers.activations.ACT2CLS`` keys (a misspelt ``hidden_act`` is a
  KeyError inside speculators when the model is built);
* ``DTYPES``: the ``dtype`` / ``torch_dtype`` strings transformers maps to a torch dtype;
* ``ROPE_REQUIRED``: the keys ``modeling_rope_utils``' validators require per ``rope_type``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

ACTIVATIONS = frozenset({
    "gelu", "gelu_10", "gelu_fast", "gelu_new", "gelu_python", "gelu_pytorch_tanh", "gelu_accurate",
    "laplace", "leaky_relu", "linear", "mish", "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "silu",
    "swish", "tanh", "prelu", "xielu",
})

DTYPES = frozenset({
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "auto",
})

# decoder families whose config classes carry the llama-style fields the drafts read
DECODER_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text",
    "gemma", "gemma2", "gemma3", "gemma3_text", "deepseek_v3", "glm4_moe",
})

LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "linear_attention", "chunked_attention"})

ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "proportional": (),
}


def one_of(v: Any, names: frozenset) -> bool:
    """``v`` is one of the string ``names`` (a list or dict from a corrupted config is not, and is
    not hashable either)."""
    return isinstance(v, str) and v in names


def _positive_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def rope_parameters(cfg: Mapping[str, Any], *, theta_type: Callable[[Any], Any] | None = None) -> dict:
    """The one rope normaliser: transformers-5 ``rope_parameters`` from an HF config dict in either
    form. A non-empty ``rope_parameters`` object is returned as is (a copy; a nested per-layer-type
    one too); otherwise ``rope_theta`` (default 10000, cast by ``theta_type`` when given) with the
    legacy ``rope_scaling`` merged in (its ``type`` read as ``rope_type``, default "default")."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, Mapping) and rp:
        return dict(rp)
    theta = cfg.get("rope_theta", 10000.0)
    out = {"rope_theta": theta if theta_type is None else theta_type(theta), "rope_type": "default"}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping):
        out.update({k: v for k, v in scaling.items() if k not in ("rope_type", "type")})
        out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


def rope_problems(layer: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Rope settings, in transformers-5 form (``rope_parameters``, possibly nested per layer type)
    or the legacy ``rope_theta`` + ``rope_scaling``."""
    out: list[tuple[str, str]] = []
    if "rope_theta" in layer and not _positive_number(layer["rope_theta"]):
        out.append(("rope_theta", f"rope_theta is {layer['rope_theta']!r}; expected a finite number > 0"))
    if "rope_parameters" in layer:
        rp = layer["rope_parameters"]
        if not isinstance(rp, Mapping):
            return out + [("rope_parameters", f"rope_parameters is {rp!r}; expected an object with rope_type and "
                                              "rope_theta (or no key, for the legacy rope_theta/rope_scaling form)")]
        if rp and all(isinstance(v, Mapping) for v in rp.values()):  # per layer type
            unknown = sorted(k for k in rp if not one_of(k, LAYER_TYPES))
            if unknown:
                out.append(("rope_parameters", f"nested rope_parameters has keys {unknown}; expected layer types "
                                               f"from {sorted(LAYER_TYPES)}"))
            for lt, sub in rp.items():
                out += _one_rope(sub, f"rope_parameters.{lt}", needs_theta=True)
        else:
            out += _one_rope(rp, "rope_parameters", needs_theta="rope_theta" not in layer)
    elif layer.get("rope_scaling") is not None:
        rs = layer["rope_scaling"]
        if not isinstance(rs, Mapping):
            out.append(("rope_scaling", f"rope_scaling is {rs!r}; expected an object or null"))
        else:
            out += _one_rope(rs, "rope_scaling", needs_theta=False)
    return out


def _one_rope(rp: Any, key: str, *, needs_theta: bool) -> list[tuple[str, str]]:
    if not isinstance(rp, Mapping):
        return [(key, f"{key} is {rp!r}; expected an object")]
    out = []
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if not one_of(rtype, frozenset(ROPE_REQUIRED)):
        return [(f"{key}.rope_type", f"rope_type {rtype!r} is not a transformers rope type; expected one of "
                                     f"{sorted(ROPE_REQUIRED)}")]
    if "rope_theta" in rp or needs_theta:
        theta = rp.get("rope_theta")
        if not _positive_number(theta):
            out.append((f"{key}.rope_theta", f"rope_theta is {theta!r}; expected a finite number > 0"))
    for k in ROPE_REQUIRED[rtype]:
        if k not in rp or rp[k] is None:
            out.append((f"{key}.{k}", f"rope_type {rtype!r} needs {k!r} (transformers refuses the config without it)"))
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "partial_rotary_factor", "attention_factor"):
        if rp.get(k) is not None and not _positive_number(rp[k]):
            out.append((f"{key}.{k}", f"{k} is {rp[k]!r}; expected a finite number > 0"))
    return out


def layer_problems(layer: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Keys of ``transformer_layer_config`` that the typed fields do not cover."""
    out: list[tuple[str, str]] = []
    mt = layer.get("model_type", "qwen3")
    if not one_of(mt, DECODER_MODEL_TYPES):
        out.append(("model_type", f"model_type {mt!r} is not a decoder family a draft layer can be built from; "
                                  f"expected one of {sorted(DECODER_MODEL_TYPES)}"))
    act = layer.get("hidden_act", "silu")
    if not one_of(act, ACTIVATIONS):
        out.append(("hidden_act", f"hidden_act {act!r} is not a transformers activation; expected one of "
                                  f"{sorted(ACTIVATIONS)}"))
    for k in ("dtype", "torch_dtype"):
        v = layer.get(k)
        if v is not None and not one_of(v, DTYPES):
            out.append((k, f"{k} {v!r} is not a dtype name transformers reads; expected one of {sorted(DTYPES)}"))
    if "layer_types" in layer:
        lt = layer["layer_types"]
        if not isinstance(lt, list):
            out.append(("layer_types", f"layer_types is {lt!r}; expected a list with one entry per layer (or no key)"))
        else:
            bad = [t for t in lt if not one_of(t, LAYER_TYPES)]
            if bad:
                out.append(("layer_types", f"layer_types holds {bad[0]!r}; expected entries from {sorted(LAYER_TYPES)}"))
    out += rope_problems(layer)
    return out
