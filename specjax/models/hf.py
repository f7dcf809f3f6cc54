"""Load an HF target model directory (``config.json`` + single or sharded safetensors).

Tensor names go through ``bridge.layout`` table ``hf_lm``; arrays stay memory-mapped views until
each one is placed on the device, so peak host memory is one tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bridge import layout
from bridge.errors import CheckpointNotFoundError
from bridge.safetensors_io import open_tensors
from specjax.models.config import TargetConfig
from specjax.models.params import load_tree
from specjax.models.target import CausalLM, build_model

DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "f16": jnp.float16}


def resolve_dtype(dtype):
    """None / 'auto' keep the checkpoint dtype; a name or jnp dtype casts."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; expected 'auto' or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype


def tied_lm_head(config: TargetConfig):
    return lambda path: config.tie_word_embeddings and path[:1] == ("lm_head",)


def model_from_tree(config: TargetConfig, tree: dict, *, dtype=None, where: str = "", place=None) -> CausalLM:
    """Build the target for ``config`` and fill it from a nested Flax tree (numpy views).
    ``place(path, view) -> jax.Array`` (e.g. ``specjax.sharding.slice_loader``) puts each leaf on
    the device(s) and does the ``dtype`` cast itself."""
    dtype = resolve_dtype(dtype)
    try:  # the abstract module's dtype only matters until load_tree replaces every leaf
        leaf_dtype = dtype or np.asarray(tree["model"]["embed_tokens"]["embedding"]).dtype
    except (KeyError, TypeError):
        leaf_dtype = dtype or jnp.float32
    model = build_model(config, param_dtype=leaf_dtype, abstract=True)
    load_tree(model, tree, where=where, dtype=None if place is not None else dtype, ignore=tied_lm_head(config),
              place=place)
    return model


def load_hf_dir(directory: str | os.PathLike, *, dtype=None, place=None) -> CausalLM:
    """Load ``directory`` (config.json + model.safetensors or a sharded index). ``place``: see
    :func:`model_from_tree` (sharded loading)."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise CheckpointNotFoundError("no config.json in the target directory", path=str(d))
    config = TargetConfig.from_file(d / "config.json")
    store = open_tensors(d)
    # a native MTP head (``mtp.*``, e.g. Qwen3-Next / Qwen3.5) is not part of the LM body: skipped, as
    # transformers skips it; ``speculator_type: mtp`` training reads it (specjax.train.mtp_init)
    flat = {name: store.array(name) for name in store.names if not name.startswith("mtp.")}
    tree = layout.unflatten(flat, layout.TABLES["hf_lm"], where=str(d))
    return model_from_tree(config, tree, dtype=dtype, where=str(d), place=place)
