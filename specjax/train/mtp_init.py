"""Where a trained MTP layer starts from (``mtp.init``), on the draft's flat PyTorch-layout tensors.

* ``native`` (speculators 0.9.0's only way, ``MTPDraftModel.from_training_args``): the target
  checkpoint's own ``mtp.*`` tensors, renamed as speculators' MTP converter renames them
  (``bridge.external.mtp_native.remap``). A target without them is refused (key ``mtp.init``).
* ``last_layer`` (specjax): the target's last decoder layer (attention, MLP and their norms) is
  mirrored into ``mtp_layers.0``; ``hidden_layernorm`` and ``final_layernorm`` start as the
  target's final norm (the MTP layer reads the pre-norm last hidden state and feeds the target's
  lm_head); ``token_layernorm`` and ``input_proj`` keep the draft's initialisation.
* ``random``: the draft's own initialisation (Linear N(0, 0.02), norms 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from bridge.external.mtp_native import fuse_experts, remap
from bridge.external.source import open_source
from bridge.layout import path_to_flat, to_torch
from specjax.train.errors import TrainError

LAYER = "mtp_layers.0."


def _check_shapes(flat: dict, new: dict, where: str):
    for k, v in new.items():
        if k not in flat:
            raise TrainError(f"tensor {k!r} does not exist in the MTP draft (the target's MTP head does not match "
                             "the single speculators MTP layer)", path=where, key="mtp.init")
        if tuple(np.shape(v)) != tuple(np.shape(flat[k])):
            raise TrainError(f"tensor {k!r} has shape {list(np.shape(v))}; the MTP draft needs "
                             f"{list(np.shape(flat[k]))}", path=where, key="mtp.init")


def native_weights(target) -> dict[str, np.ndarray]:
    """``mtp.*`` tensors of the target checkpoint, renamed to ``mtp_layers.0.*``."""
    src = str(getattr(target, "source", "") or "")
    if getattr(target, "kind", "") not in ("hf_dir", "hf_cache") or not Path(src).is_dir():
        raise TrainError(f"mtp.init=native reads the target checkpoint's own mtp.* tensors, but the target "
                         f"{src or '(in memory)'} is not a safetensors checkpoint directory; use mtp.init=last_layer "
                         "or mtp.init=random", path=src or None, key="mtp.init")
    s = open_source(src)
    keys = [k for k in s.names if k.startswith("mtp.")]
    if not keys:
        raise TrainError("the target has no native MTP layers (no mtp.* tensors in its checkpoint), which is what "
                         "speculators trains MTP from; use mtp.init=last_layer (mirror the target's last decoder "
                         "layer) or mtp.init=random", path=src, key="mtp.init")
    return fuse_experts({remap(k): np.asarray(s.array(k), np.float32) for k in keys}, s.weights)


def last_layer_weights(target) -> dict[str, np.ndarray]:
    """The target's last decoder layer (and final norm) as ``mtp_layers.0.*`` tensors."""
    lm = target.model
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not layers:
        raise TrainError("mtp.init=last_layer: the target has no decoder layers to mirror", key="mtp.init")
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(layers[len(layers) - 1], nnx.Param)):
        val = var.get_value() if hasattr(var, "get_value") else var.value
        name, kind = path_to_flat(("mtp_layers", 0, *tuple(path)))
        out[name] = to_torch(kind, np.asarray(val, np.float32))
    norm = np.asarray(lm.model.norm.scale[...], np.float32)
    out[LAYER + "hidden_layernorm.weight"] = norm.copy()
    out[LAYER + "final_layernorm.weight"] = norm.copy()
    return out


def apply_mtp_init(flat: dict, target, mode: str) -> dict:
    """``flat`` (the draft's tensors, PyTorch layout) with the ``mtp.init`` weights put in."""
    if mode == "random":
        return flat
    new = native_weights(target) if mode == "native" else last_layer_weights(target)
    _check_shapes(flat, new, str(getattr(target, "source", "") or ""))
    out = dict(flat)
    out.update({k: v.astype(np.asarray(flat[k]).dtype) for k, v in new.items()})
    return out
