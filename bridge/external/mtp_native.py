"""Native MTP heads (``mtp.*`` inside a verifier checkpoint) -> speculators mtp.

Mirrors speculators 0.9.0 ``convert/mtp/converter.py`` (REFERENCE 6.3):

* only ``mtp.*`` tensors are read (a sharded index is followed, so only the shards that
  hold them are opened; the verifier body is never touched);
* renames: ``mtp.fc.weight -> mtp_layers.0.input_proj.weight``, ``mtp.norm.weight ->
  mtp_layers.0.final_layernorm.weight``, prefixes ``mtp.pre_fc_norm_hidden. ->
  mtp_layers.0.hidden_layernorm.``, ``mtp.pre_fc_norm_embedding. ->
  mtp_layers.0.token_layernorm.``, ``mtp.layers.0. -> mtp_layers.0.``;
* per-expert ``...experts.{e}.{gate,up,down}_proj.weight`` fused into
  ``experts.gate_up_proj [E, 2I, H]`` (``stack_e cat[gate_e; up_e]``) and
  ``experts.down_proj [E, H, I]`` (``stack_e down_e``);
* ``transformer_layer_config`` = the source config (its ``text_config`` for multimodal
  wrappers) rebuilt as its transformers class; ``speculative_tokens`` =
  ``num_speculative_steps`` (default 3); weights keep the source float dtype.

speculators also writes ``verifier_lm_head.weight`` [V, H] filled with its NaN sentinel
(the converter never loads verifier weights, and ``MTPDraftModel`` deletes the tensor on
load). specjax does not write it: it carries no information and fails the audit.
"""

from __future__ import annotations

import re

import numpy as np

from bridge.contract import expected_tensors
from bridge.external.common import NAME_OF_DTYPE, POS_INT, Option, Plan, cast, config_doc, is_float, \
    resolve_options
from bridge.external.errors import ExternalSourceError
from bridge.external.hf_config import layer_config_dict
from bridge.external.source import Source, Verifier
from bridge.schema import parse_config

KIND = "mtp"
ALGORITHM = "mtp"
OPTIONS = {"num_speculative_steps": Option(**POS_INT, default=3, help="tokens proposed per step (speculative_tokens)")}
PREFIX = "mtp."
# verifier families speculators 0.9.0 has an MTP layer for (models/mtp/model_definitions.py)
SUPPORTED = ("qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
EXACT_REMAP = {"mtp.fc.weight": "mtp_layers.0.input_proj.weight",
               "mtp.norm.weight": "mtp_layers.0.final_layernorm.weight"}
PREFIX_REMAP = (("mtp.pre_fc_norm_hidden.", "mtp_layers.0.hidden_layernorm."),
                ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.token_layernorm."),
                ("mtp.layers.0.", "mtp_layers.0."))
EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
HEAD = {"mtp_layers.0.hidden_layernorm.weight": "mtp.pre_fc_norm_hidden.weight",
        "mtp_layers.0.token_layernorm.weight": "mtp.pre_fc_norm_embedding.weight",
        "mtp_layers.0.input_proj.weight": "mtp.fc.weight",
        "mtp_layers.0.final_layernorm.weight": "mtp.norm.weight"}


def detect(config: dict | None, names: list[str]) -> str | None:
    n = sum(1 for k in names if k.startswith(PREFIX))
    return f"{n} mtp.* tensors (native MTP head inside a verifier checkpoint)" if n else None


def remap(key: str) -> str:
    if key in EXACT_REMAP:
        return EXACT_REMAP[key]
    for a, b in PREFIX_REMAP:
        if key.startswith(a):
            return b + key[len(a):]
    return key


def fuse_experts(weights: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    groups: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    out: dict[str, np.ndarray] = {}
    for k, a in weights.items():
        m = EXPERT.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = a
        else:
            out[k] = a
    for prefix, by_idx in groups.items():
        n = max(by_idx) + 1
        if set(by_idx) != set(range(n)):
            raise ExternalSourceError(f"non-contiguous expert indices at {prefix}: found {sorted(by_idx)}, expected "
                                      f"0..{n - 1}", path=where, key=prefix)
        for i in range(n):
            for p in ("gate_proj", "up_proj", "down_proj"):
                if p not in by_idx[i]:
                    raise ExternalSourceError(f"expert {i} at {prefix} has no {p} weight", path=where,
                                              key=f"{prefix}.{i}.{p}.weight")
        out[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([by_idx[i]["gate_proj"], by_idx[i]["up_proj"]], 0)
                                                  for i in range(n)])
        out[f"{prefix}.down_proj"] = np.stack([by_idx[i]["down_proj"] for i in range(n)])
    return out


def _text_config(src: Source, verifier: Verifier, cfg_path: str) -> dict:
    """The source's text config (``text_config`` of a multimodal wrapper), once its width matches the verifier's."""
    if src.config is None:
        raise ExternalSourceError("source has no config.json (the MTP layer is defined by the model's own config)",
                                  path=cfg_path)
    sc = src.config["text_config"] if "text_config" in src.config else src.config
    if not isinstance(sc, dict):
        raise ExternalSourceError("text_config is not an object", path=cfg_path, key="text_config")
    sh, vh = sc.get("hidden_size"), verifier.get("hidden_size")
    if sh and vh and sh != vh:
        raise ExternalSourceError(f"source hidden_size {sh} != verifier hidden_size {vh} "
                                  f"({verifier.path}/config.json)", path=cfg_path, key="hidden_size")
    return sc


def _shown(n: str) -> str:
    """The source name of a renamed MTP tensor, for messages."""
    return HEAD.get(n, "mtp.layers.0." + n[len("mtp_layers.0."):] if n.startswith("mtp_layers.0.") else n)


def _check_tensor_set(src: Source, weights: dict[str, np.ndarray], typed, model_type: str) -> None:
    """Refuse a renamed tensor set that is not one speculators MTP layer: missing or stray tensors,
    and (for the family the contract enumerates) shapes other than the contract's."""
    missing = [HEAD[n] for n in HEAD if n not in weights]
    stray = sorted(k for k in weights if not k.startswith("mtp_layers.0."))
    if model_type == "qwen3":  # the only family whose layer the contract enumerates
        exp = {n: s for n, s in expected_tensors(typed).items() if n.startswith("mtp_layers.0.")}
        missing = [_shown(n) for n in exp if n not in weights]
        stray = sorted(k for k in weights if k not in exp)
        for n, a in weights.items():
            if n in exp and tuple(a.shape) != exp[n].shape:
                raise ExternalSourceError(f"tensor {_shown(n)!r} has shape {list(a.shape)}; expected "
                                          f"{list(exp[n].shape)}", path=src.weights, key=_shown(n))
    if missing:
        raise ExternalSourceError(f"{len(missing)} MTP tensor(s) are missing from the source: {missing[:8]}",
                                  path=src.weights, key=missing[0])
    if stray:
        raise ExternalSourceError(f"{len(stray)} mtp.* tensor(s) do not map into the single speculators MTP layer "
                                  f"(after renaming): {stray[:8]}", path=src.weights, key=stray[0])


def plan(src: Source, verifier: Verifier, options: dict) -> Plan:
    """The speculators mtp config and tensors for the native MTP head inside a verifier checkpoint."""
    opts = resolve_options(KIND, OPTIONS, options)
    keys = [k for k in src.names if k.startswith(PREFIX)]
    if not keys:
        raise ExternalSourceError(f"no tensors with prefix {PREFIX!r}; --from mtp needs a checkpoint with native MTP "
                                  "layers (e.g. Qwen3-Next, Qwen3.5)", path=src.weights, key=PREFIX)
    cfg_path = str(src.path / "config.json")
    sc = _text_config(src, verifier, cfg_path)
    model_type = sc.get("model_type", "qwen2")  # MTPSpeculatorConfig builds a Qwen2Config without model_type
    if model_type not in SUPPORTED:
        raise ExternalSourceError(f"unsupported MTP model type {model_type!r}; speculators 0.9.0 has MTP layers for "
                                  f"{list(SUPPORTED)}", path=cfg_path, key="model_type")
    layer, exact = layer_config_dict(model_type, sc)
    notes: list[str] = []
    if not exact:
        notes.append(f"transformer_layer_config ({model_type}) is the source config as transformers saved it "
                     "(specjax has no class-default table for this family)")

    weights = {remap(k): src.array(k) for k in keys}
    weights = fuse_experts(weights, src.weights)
    floats = [a.dtype for a in weights.values() if is_float(a.dtype)]
    dtype = floats[0] if floats else np.dtype(np.float32)
    if len(set(floats)) > 1:
        notes.append(f"mixed float dtypes {sorted({str(d) for d in floats})}: all cast to {dtype} (speculators picks "
                     "one of them by set order)")
    config = config_doc(ALGORITHM, layer, dtype=NAME_OF_DTYPE.get(np.dtype(dtype), str(dtype)),
                        speculative_tokens=opts["num_speculative_steps"], verifier=verifier,
                        architectures=verifier.get("architectures", []), num_nextn_predict_layers=1)
    typed = parse_config(config, path=cfg_path)
    _check_tensor_set(src, weights, typed, model_type)
    tensors = {k: cast(a, dtype) if is_float(a.dtype) else a for k, a in weights.items()}
    notes.append(f"read {len(keys)} mtp.* tensor(s) of {len(src.names)} in the source; wrote {len(tensors)}")
    return Plan(config, tensors, dict(opts), notes)
