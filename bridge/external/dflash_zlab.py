"""z-lab DFlash (z-lab.ai/projects/dflash) -> speculators dflash.

Mirrors speculators 0.9.0 ``convert/dflash/converter.py`` (REFERENCE 6.2):

* config: ``transformer_layer_config`` = the source config minus ``architectures``,
  ``auto_map``, ``block_size``, ``dflash_config``, ``num_target_layers`` (rebuilt as the
  transformers class of its ``model_type``, Qwen3 when absent); ``block_size`` from the top
  level or ``dflash_config``; ``mask_token_id`` from ``dflash_config``; full vocabulary;
  ``speculative_tokens = block_size - 1``; ``sample_from_anchor`` and
  ``sliding_window_non_causal`` at their False defaults (written explicitly);
* aux ids: z-lab reads HF ``hidden_states[t + 1]`` for each ``target_layer_ids`` entry t,
  speculators reads ``hidden_states[id]``: ids = ``[t + 1 for t in target_layer_ids if
  t + 1 != num_verifier_layers]`` (the final layer arrives implicitly as
  ``verifier_last_hidden_states``), unless ``aux_hidden_state_layer_ids`` is given;
* tensors: the draft body copied 1:1 in the dtype of its first tensor (name order);
  Laguna variants: fused ``qkv_proj`` split into q/k/v rows, ``g_proj`` and
  ``aux_hidden_norms.*`` dropped, ``fc.weight`` column-sliced to ``A*H`` when wider.
  ``embed_tokens`` / ``lm_head`` are not written (0.9.0 save rule for a full-vocabulary
  DFlash draft: both come from the verifier at load time).
"""

from __future__ import annotations

import numpy as np

from bridge.contract import expected_tensors
from bridge.external.common import IDS, NAME_OF_DTYPE, Option, Plan, cast, config_doc, resolve_options
from bridge.external.errors import ExternalSourceError
from bridge.external.hf_config import layer_config_dict
from bridge.external.source import Source, Verifier
from bridge.schema import parse_config

KIND = "dflash-zlab"
ALGORITHM = "dflash"
OPTIONS = {
    "aux_hidden_state_layer_ids": Option(**IDS,
                                         help="override the aux ids derived from dflash_config.target_layer_ids"),
}
NON_TRANSFORMER_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"})
VERIFIER_FILLED = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                             "verifier_norm.weight", "t2d", "d2t"})


def detect(config: dict | None, names: list[str]) -> str | None:
    if not isinstance(config, dict):
        return None
    if "dflash_config" in config:
        return "config.json has dflash_config (z-lab DFlash)"
    arch = [a for a in (config.get("architectures") or []) if isinstance(a, str) and "DFlash" in a]
    if arch:
        return f"config.json architectures {arch} (z-lab DFlash)"
    return None


def _split_fused(src: Source, body: list[str], layer: dict, fc_width: int, notes: list[str]):
    """speculators' _remap_weights for Laguna-style checkpoints. Returns name -> getter."""
    fused = [k for k in body if "qkv_proj" in k]
    if not fused:
        return {k: (lambda k=k: src.array(k)) for k in body}
    q = layer["num_attention_heads"] * layer["head_dim"]
    kv = layer["num_key_value_heads"] * layer["head_dim"]
    out, dropped = {}, []
    for k in body:
        if "qkv_proj" in k:
            parts = [k.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            clash = [p for p in parts if src.has(p)]
            if clash:
                raise ExternalSourceError(f"source has both fused {k!r} and separate projections {clash}",
                                          path=src.weights, key=k)
            rows = src.shape(k)[0]
            if rows != q + 2 * kv:
                raise ExternalSourceError(f"fused {k!r} has {rows} rows; expected q {q} + k {kv} + v {kv} = "
                                          f"{q + 2 * kv}", path=src.weights, key=k)
            for p, lo, hi in zip(parts, (0, q, q + kv), (q, q + kv, q + 2 * kv)):
                out[p] = lambda k=k, lo=lo, hi=hi: src.array(k)[lo:hi]
        elif ".g_proj." in k or k.startswith("aux_hidden_norms."):
            dropped.append(k)
        elif k == "fc.weight" and src.shape(k)[1] > fc_width:
            notes.append(f"fc.weight sliced from {src.shape(k)[1]} to {fc_width} input columns (as speculators does "
                         "for fused-qkv sources)")
            out[k] = lambda k=k: src.array(k)[:, :fc_width]
        else:
            out[k] = lambda k=k: src.array(k)
    notes.append(f"split {len(fused)} fused qkv_proj tensor(s) into q/k/v_proj")
    if dropped:
        notes.append(f"dropped {len(dropped)} tensor(s) with no DFlash equivalent: {dropped[:8]}")
    return out


def _block_settings(sc: dict, cfg_path: str) -> tuple[dict, int, int]:
    """``dflash_config``, the block size (top level first) and the mask token: all three must be there."""
    dflash = sc.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ExternalSourceError(f"dflash_config is a {type(dflash).__name__}; expected an object", path=cfg_path,
                                  key="dflash_config")
    block_size = sc.get("block_size") or dflash.get("block_size")
    if block_size is None:
        raise ExternalSourceError("no block_size: looked at the top level and in dflash_config; the block size "
                                  "fixes the draft's proposal length and cannot be guessed", path=cfg_path,
                                  key="block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ExternalSourceError(f"block_size {block_size!r}: expected an integer >= 2 (speculative_tokens = "
                                  "block_size - 1 must be >= 1)", path=cfg_path, key="block_size")
    mask = dflash.get("mask_token_id")
    if mask is None:
        raise ExternalSourceError("no dflash_config.mask_token_id; the block drafter cannot run without it",
                                  path=cfg_path, key="dflash_config.mask_token_id")
    return dflash, block_size, mask


def _transformer_keys(sc: dict, verifier: Verifier, cfg_path: str) -> dict:
    """The source config minus the DFlash-only keys, once it has a vocabulary and the verifier's width."""
    transformer = {k: v for k, v in sc.items() if k not in NON_TRANSFORMER_KEYS}
    if "vocab_size" not in transformer:
        raise ExternalSourceError("no vocab_size in the source config", path=cfg_path, key="vocab_size")
    sh, vh = transformer.get("hidden_size"), verifier.get("hidden_size")
    if sh and vh and sh != vh:
        raise ExternalSourceError(f"source hidden_size {sh} != verifier hidden_size {vh} "
                                  f"({verifier.path}/config.json); the draft reads the verifier's hidden states",
                                  path=cfg_path, key="hidden_size")
    return transformer


def _aux_ids(aux, dflash: dict, verifier: Verifier, cfg_path: str, notes: list[str]):
    """The aux ids: the caller's, else z-lab's ``target_layer_ids`` + 1 without the verifier's final
    layer. Returns ``(aux, target_layer_ids, num_verifier_layers)``; the last two are None when
    the caller gave the ids."""
    tl, n = None, None
    if aux is None:
        tl = dflash.get("target_layer_ids")
        if tl is None:
            raise ExternalSourceError("no dflash_config.target_layer_ids; pass aux_hidden_state_layer_ids "
                                      "(--aux-layer-ids) explicitly", path=cfg_path,
                                      key="dflash_config.target_layer_ids")
        n = verifier.text_get("num_hidden_layers")
        if not isinstance(n, int):
            raise ExternalSourceError("verifier config has no num_hidden_layers (needed to drop the final layer "
                                      "from the aux ids)", path=str(verifier.path / "config.json"),
                                      key="num_hidden_layers")
        aux = [t + 1 for t in tl if t + 1 != n]
        notes.append(f"aux ids {aux} = z-lab target_layer_ids {list(tl)} + 1"
                     + (f", final layer {n} dropped (it arrives as verifier_last_hidden_states)"
                        if len(aux) != len(tl) else ""))
    return aux, tl, n


def _body_arrays(src: Source, exp: dict, layer: dict, aux, tl, n, notes: list[str]) -> dict:
    """The draft body read from the source (fused projections split), refused unless its tensor set
    and shapes are the contract's (``exp``) for this config."""
    A, H = len(aux), layer["hidden_size"]
    body = sorted(k for k in src.names if k not in ("t2d", "d2t"))
    getters = _split_fused(src, body, layer, A * H, notes)
    unexpected = sorted(k for k in getters if k not in exp)
    if unexpected:
        raise ExternalSourceError(f"{len(unexpected)} source tensor(s) have no place in a DFlash draft with "
                                  f"{layer['num_hidden_layers']} layer(s): {unexpected[:8]}",
                                  path=src.weights, key=unexpected[0])
    missing = sorted(k for k, s in exp.items() if s.required and k not in getters and k not in VERIFIER_FILLED)
    if missing:
        raise ExternalSourceError(f"{len(missing)} tensor(s) a DFlash draft needs are missing from the source: "
                                  f"{missing[:8]}", path=src.weights, key=missing[0])
    arrays = {k: g() for k, g in getters.items()}
    for k, a in arrays.items():
        if tuple(a.shape) != exp[k].shape:
            why = f"from the source config, {A} aux ids x hidden {H}"
            if k == "fc.weight" and tl is not None and len(aux) < len(tl):
                why += (f"; the final-layer target id {n - 1} became aux id {n} and was dropped (speculators feeds "
                        "the final layer separately), but fc still has its columns: speculators 0.9.0 cannot load "
                        "this draft either (it slices fc only for fused-qkv sources)")
            raise ExternalSourceError(f"tensor {k!r} has shape {list(a.shape)}; expected {list(exp[k].shape)} "
                                      f"({why})", path=src.weights, key=k)
    if not arrays:
        raise ExternalSourceError("source has no DFlash body tensors", path=src.weights)
    return arrays


def plan(src: Source, verifier: Verifier, options: dict) -> Plan:
    """The speculators dflash config and tensors for a z-lab DFlash source."""
    opts = resolve_options(KIND, OPTIONS, options)
    sc = src.config
    cfg_path = str(src.path / "config.json")
    if sc is None:
        raise ExternalSourceError("z-lab DFlash source has no config.json", path=cfg_path)
    dflash, block_size, mask = _block_settings(sc, cfg_path)
    transformer = _transformer_keys(sc, verifier, cfg_path)
    notes: list[str] = []
    aux, tl, n = _aux_ids(opts["aux_hidden_state_layer_ids"], dflash, verifier, cfg_path, notes)
    resolved = {"aux_hidden_state_layer_ids": list(aux), "block_size": block_size, "mask_token_id": mask}

    layer, exact = layer_config_dict(transformer.get("model_type", "qwen3"), transformer)
    if not exact:
        notes.append(f"transformer_layer_config model_type {layer['model_type']!r} is outside specjax's transformers "
                     "tables: the source keys are kept as written (no class defaults added)")
    config = config_doc(
        ALGORITHM, layer, dtype="float32", speculative_tokens=block_size - 1,
        verifier=verifier, architectures=verifier.get("architectures", []), aux_layer_ids=list(aux),
        block_size=block_size, draft_vocab_size=transformer["vocab_size"], mask_token_id=mask,
        sample_from_anchor=False, sliding_window_non_causal=False, target_hidden_size=None,
    )
    typed = parse_config(config, path=cfg_path)
    arrays = _body_arrays(src, expected_tensors(typed), layer, aux, tl, n, notes)
    dtype = arrays[next(iter(arrays))].dtype  # speculators: dtype of the first body tensor
    keep = {k: cast(a, dtype) for k, a in arrays.items() if k not in VERIFIER_FILLED}
    skipped = sorted(set(arrays) - set(keep))
    if skipped:
        notes.append(f"not written (filled from the verifier at load time, 0.9.0 save rule): {skipped}")
    config["dtype"] = NAME_OF_DTYPE[np.dtype(dtype)]
    return Plan(config, keep, resolved, notes)
