"""Draft configs for a target, verifier-weight filling, and export of a trained draft as a
speculators 0.9.0 checkpoint through ``bridge`` (every config key explicit).

The draft decoder config follows speculators' ``create_transformer_layer_config``: geometry,
``rms_norm_eps``, ``max_position_embeddings``, ``initializer_range`` and rope parameters from the
target (``partial_rotary_factor`` dropped), ``num_layers`` and ``draft_arch`` from the recipe,
every layer ``sliding_attention`` (window 2048) except ``full_attention_indices``.

Saved tensors follow the 0.9.0 wheel's ``save_pretrained``: ``verifier_lm_head`` and
``verifier_norm`` are never saved; DFlash / DSpark also drop ``embed_tokens`` always and
``lm_head`` with a full vocabulary; MTP drops ``embed_tokens`` and ``lm_head``; P-EAGLE keeps its
trained ``embed_tokens`` (and ``mask_hidden``).

MTP's ``transformer_layer_config`` is the verifier's own config (:func:`mtp_layer_config`), as
speculators' ``MTPSpeculatorConfig`` holds it. Floats are written in ``export_dtype`` (bf16, as speculators' training
checkpoints), ``t2d`` bool, ``d2t`` int64.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

import bridge
from bridge.config_doc import speculators_config_doc
from bridge.errors import WriteError
from bridge.hf_values import rope_parameters
from bridge.layout import path_to_flat, to_torch
from specjax import storage
from specjax.models.drafts.common import VocabBuffer
from specjax.models.drafts.load import build_draft, module_from_flat
from specjax.models.drafts.registry import draft_class
from specjax.models.drafts.verifier_weights import VerifierSource, fill_verifier_weights
from specjax.train.errors import TrainError

KNOWN_VERIFIERS = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def verifier_name(target, override: str | None = None) -> str:
    """What goes into ``speculators_config.verifier.name_or_path``: the recipe's value, else the
    hub id of a known embedded model, else the target's path."""
    if override:
        return override
    src = str(getattr(target, "source", "") or "")
    stem = Path(src).name.split(".")[0] if src else ""
    if stem in KNOWN_VERIFIERS:
        return KNOWN_VERIFIERS[stem]
    return src


def _rope_parameters(hf: dict) -> dict:
    """The target's rope as one flat transformers-5 object for the draft layer (a nested
    per-layer-type one: its sliding entry, else its full one)."""
    rp = rope_parameters(hf, theta_type=float)
    if "rope_theta" not in rp:
        sub = rp.get("sliding_attention") or rp.get("full_attention") or {}
        rp = dict(sub) if isinstance(sub, dict) else {}
        rp.setdefault("rope_type", "default")
        rp.setdefault("rope_theta", 10000.0)
    rp.pop("type", None)
    rp.pop("mrope_interleaved", None)
    if "mrope_section" not in rp:
        rp.pop("partial_rotary_factor", None)
    return rp


def draft_layer_config(target_cfg, *, draft_arch: str, num_layers: int, sliding_window: int,
                       full_attention_indices=(), hidden_act: str = "silu") -> dict:
    """``transformer_layer_config`` for a draft of ``target_cfg`` (a specjax ``TargetConfig``)."""
    hf = target_cfg.to_hf_dict()
    heads, kv, hd = target_cfg.num_attention_heads, target_cfg.num_key_value_heads, target_cfg.head_dim
    H = target_cfg.hidden_size
    if H % heads != 0 and H % hd == 0:
        heads = H // hd
        if heads % kv:
            kv = heads
    types = ["full_attention" if i in set(full_attention_indices) else "sliding_attention" for i in range(num_layers)]
    eos = hf.get("eos_token_id", list(target_cfg.eos_token_ids) or None)
    d = {
        "architectures": ["LlamaForCausalLM" if draft_arch == "llama" else "Qwen3ForCausalLM"],
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": hf.get("bos_token_id", target_cfg.bos_token_id), "eos_token_id": eos,
        "pad_token_id": hf.get("pad_token_id", target_cfg.pad_token_id),
        "dtype": "bfloat16", "head_dim": hd, "hidden_act": hidden_act, "hidden_size": H,
        "initializer_range": float(hf.get("initializer_range", 0.02)),
        "intermediate_size": int(target_cfg.intermediate_size), "layer_types": types,
        "max_position_embeddings": int(target_cfg.max_position_embeddings), "model_type": draft_arch,
        "num_attention_heads": heads, "num_hidden_layers": int(num_layers), "num_key_value_heads": kv,
        "rms_norm_eps": float(target_cfg.rms_norm_eps), "rope_parameters": _rope_parameters(hf),
        "sliding_window": int(sliding_window), "use_sliding_window": "sliding_attention" in types,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": int(target_cfg.vocab_size),
    }
    if draft_arch == "llama":
        d["mlp_bias"] = False
        d["pretraining_tp"] = 1
    else:
        d["max_window_layers"] = int(num_layers)
    return d


def mtp_layer_config(target_cfg) -> dict:
    """MTP's ``transformer_layer_config``: the verifier's own text config (rope parameters in
    transformers-5 form, as speculators saves it)."""
    hf = dict(target_cfg.to_hf_dict())
    if "text_config" in hf and isinstance(hf["text_config"], dict):
        hf = dict(hf["text_config"])
    for k in ("torch_dtype", "transformers_version", "_name_or_path", "auto_map", "quantization_config"):
        hf.pop(k, None)
    if "rope_parameters" not in hf:
        hf["rope_parameters"] = _rope_parameters(hf)
        hf.pop("rope_theta", None)
        hf.pop("rope_scaling", None)
    hf["tie_word_embeddings"] = False
    hf.setdefault("model_type", "qwen3")
    return hf


def speculators_config(algo: str, *, layer: dict, draft_vocab_size: int, aux_layer_ids, speculative_tokens: int,
                       verifier: str, verifier_arch: str, **fields) -> dict:
    """A complete speculators config.json object (every key explicit), written by
    :func:`bridge.config_doc.speculators_config_doc`."""
    return speculators_config_doc(algo, layer, speculative_tokens=speculative_tokens, verifier_name_or_path=verifier,
                                  verifier_architectures=[verifier_arch], draft_vocab_size=draft_vocab_size,
                                  aux_layer_ids=aux_layer_ids, **fields)


def model_flat(model) -> dict[str, np.ndarray]:
    """Every param and vocab buffer of a draft module in PyTorch layout (numpy)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, VocabBuffer))):
        val = var.get_value() if hasattr(var, "get_value") else var.value
        if val is None:
            continue
        name, kind = path_to_flat(tuple(path))
        out[name] = to_torch(kind, np.asarray(val))
    return out


def init_draft(config_doc: dict, target, *, seed: int, t2d=None, d2t=None, flat_hook=None):
    """A freshly initialised draft (float32 master weights) with the verifier-owned tensors
    (embed_tokens, lm_head, verifier_lm_head, verifier_norm) filled from ``target`` (a specjax
    ``CausalLM``), as speculators' ``from_training_args`` does. ``flat_hook(flat) -> flat``
    replaces initial tensors (PyTorch layout) before the module is built (MTP's ``mtp.init``)."""
    cfg = bridge.parse_config(config_doc)
    model = build_draft(cfg, rngs=nnx.Rngs(seed), param_dtype=jnp.float32)
    flat = model_flat(model)
    for n in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
        if n in flat:
            flat[n] = np.full(flat[n].shape, np.nan, np.float32)  # speculators' NaN sentinels
    if cfg.vocab_pruned:
        flat["t2d"], flat["d2t"] = np.asarray(t2d, bool), np.asarray(d2t, np.int64)
    src = VerifierSource.of(target)
    fill = draft_class(cfg.speculators_model_type).verifier_fill
    flat = fill_verifier_weights(fill, flat, hidden_size=cfg.layer.hidden_size, vocab_size=cfg.layer.vocab_size,
                                 draft_vocab_size=cfg.draft_vocab_size, source=src, dtype=np.float32)
    if flat_hook is not None:
        flat = flat_hook(flat)
    return cfg, module_from_flat(cfg, flat, dtype=jnp.float32,
                                 verifier_norm_unit_offset=src.gemma_style_norm and fill.gemma_norm_offset)


def export_draft(out: str | os.PathLike, model, config_doc: dict, *, export_dtype: str = "bfloat16",
                 overwrite: bool = True, audit: bool = True, metadata: dict | None = None) -> Path:
    """Write ``model`` as a speculators checkpoint (atomic), then ``bridge.audit`` it. ``out`` may
    be a bucket URL (``gs://...``): the checkpoint is written and audited in a local scratch
    directory, then published with ``config.json`` last (an ``epath.Path`` is returned)."""
    if storage.is_remote(out):
        if not overwrite and storage.path(out).exists():
            raise WriteError("destination exists; pass --overwrite (overwrite=True) to replace it", path=str(out))
        with storage.scratch_dir() as tmp:
            local = export_draft(Path(tmp) / "export", model, config_doc, export_dtype=export_dtype, audit=audit,
                                 metadata=metadata)
            storage.publish(local, out, markers=storage.CHECKPOINT_MARKERS, overwrite=overwrite, progress=False)
        return storage.path(out)
    algo = config_doc["speculators_model_type"]
    flat = model_flat(model)
    full = config_doc.get("draft_vocab_size", config_doc["transformer_layer_config"]["vocab_size"]) == \
        config_doc["transformer_layer_config"]["vocab_size"]
    flat = draft_class(algo).verifier_fill.saved(flat, full_vocab=full)
    dt = np.dtype(ml_dtypes.bfloat16) if export_dtype == "bfloat16" else np.dtype(export_dtype)
    conv = {}
    for k, v in flat.items():
        if k == "t2d":
            conv[k] = np.asarray(v, bool)
        elif k == "d2t":
            conv[k] = np.asarray(v, np.int64)
        else:
            conv[k] = np.asarray(v, np.float32).astype(dt)
    doc = dict(config_doc)
    doc["dtype"] = export_dtype
    doc["transformer_layer_config"] = dict(doc["transformer_layer_config"], dtype=export_dtype)
    cfg = bridge.parse_config(doc)
    meta = {"format": "pt", **(metadata or {})}
    path = bridge.save_checkpoint(out, cfg, flat=conv, overwrite=overwrite, explicit_config=True, metadata=meta,
                                  progress=False)
    if audit:
        rep = bridge.audit(path)
        if rep.errors:
            raise TrainError("the exported checkpoint fails the audit: " + "; ".join(
                f"[{f.rule}] {f.message}" for f in rep.errors[:5]), path=str(path))
    return Path(path)
