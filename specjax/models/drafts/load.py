"""Build a ready draft from a speculators checkpoint and its verifier (target).

``load_draft(path, target)``:
1. ``bridge.audit(path, verifier)``: any error refuses the load (:class:`DraftAuditError`).
2. ``bridge.load_checkpoint``: typed config + lazy tensors.
3. t2d/d2t validated (:func:`vocab.check_mapping`).
4. Verifier-owned tensors filled from the target exactly as speculators does
   (:mod:`verifier_weights`); still absent/NaN is an error naming the tensor.
5. The module for ``speculators_model_type`` is built (abstract, no random init) and every
   param is loaded through :func:`specjax.models.params.load_tree` (path-level errors).

Placement is a hook: ``place(path, view) -> jax.Array`` puts each tensor on its device(s)
(default ``jnp.asarray``), and ``check(module)`` sees the abstract module before any tensor is
read. ``specjax.sharding.load_draft`` is this loader with ``place`` = a slice loader over a mesh
and ``check`` = the partition-rule check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge
from bridge import layout
from specjax import hub
from specjax.models.drafts.registry import draft_class
from specjax.models.drafts.verifier_weights import VerifierSource, fill_verifier_weights
from specjax.models.drafts.vocab import check_mapping
from specjax.models.errors import ModelError
from specjax.models.params import load_tree


class DraftAuditError(ModelError):
    """``bridge.audit`` found contract errors in the checkpoint; the load is refused."""


#: ``place(path, view) -> jax.Array``: one tensor (a numpy / memory-map view, PyTorch layout
#: already mapped to the param tree) onto its device(s). It receives the checkpoint's own dtype
#: and is responsible for any cast (``specjax.sharding.slice_loader(mesh, rules, dtype)`` casts
#: floats slice by slice).
Place = Callable[[tuple, Any], jax.Array]


def build_draft(config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32, abstract: bool = False,
                verifier_norm_unit_offset: bool = False, verifier_heads: bool = True):
    """The (randomly initialised, or ``abstract``) draft module for a bridge config."""
    cls = draft_class(config.speculators_model_type)
    kw = {"param_dtype": param_dtype}
    if cls.verifier_fill.gemma_norm_offset:
        kw["verifier_norm_unit_offset"] = verifier_norm_unit_offset
    if cls.verifier_fill.verifier_heads:
        kw["verifier_heads"] = verifier_heads
    if abstract:
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), **kw))
    return cls(config, rngs=rngs or nnx.Rngs(0), **kw)


def _source(target: Any, config) -> VerifierSource | None:
    if target is not None:
        return VerifierSource.of(target)
    vp = config.verifier_path
    if vp and Path(vp).is_dir():
        return VerifierSource.from_dir(vp)
    return None


def _verifier_dir(target: Any) -> str | None:
    """The verifier directory the audit can read (config.json), if the target has one."""
    for cand in (target, getattr(target, "source", None), getattr(target, "path", None)):
        if isinstance(cand, (str, os.PathLike)) and (Path(cand) / "config.json").is_file():
            return str(cand)
    return None


def module_from_flat(config, flat: dict, *, dtype=None, where: str = "", verifier_norm_unit_offset: bool = False,
                     verifier_heads: bool = True, place: Place | None = None,
                     check: Callable[[nnx.Module], None] | None = None):
    """Build the draft for ``config`` and load a complete flat (PyTorch-layout) tensor dict.

    ``place``: see :data:`Place` (default: ``jnp.asarray`` after casting floats to ``dtype``);
    the vocab maps go through it too, as ``("t2d",)`` / ``("d2t",)``. ``check(module)`` runs
    on the abstract module before any tensor is read (e.g. a partition-rule check)."""
    flat = dict(flat)
    t2d, d2t = flat.pop("t2d", None), flat.pop("d2t", None)
    tree = layout.unflatten(flat, layout.TABLES[config.speculators_model_type], where=where)
    ref = np.asarray(flat["lm_head.weight"]).dtype
    pdtype = dtype or ref
    model = build_draft(config, param_dtype=pdtype, abstract=True, verifier_norm_unit_offset=verifier_norm_unit_offset,
                        verifier_heads=verifier_heads)
    if check is not None:
        check(model)
    if place is None:
        load_tree(model, tree, where=where, dtype=dtype)
        put = lambda path, a: jnp.asarray(a)  # noqa: E731
    else:  # the hook casts (slice by slice); a whole-tensor host cast here would defeat it
        load_tree(model, tree, where=where, place=place)
        put = place
    if config.draft_vocab_size != config.layer.vocab_size:
        model.t2d.set_value(put(("t2d",), np.asarray(t2d).astype(bool)))
        model.d2t.set_value(put(("d2t",), np.asarray(d2t).astype(np.int32)))
    return model


def load_draft(path: str | os.PathLike, target: Any = None, *, dtype=None, audit: bool = True,
               verifier_heads: bool = True, place: Place | None = None,
               check: Callable[[nnx.Module], None] | None = None, download: bool | None = None,
               opened=None, verifier_checked: bool = False):
    """A ready draft module from checkpoint ``path`` (a directory, or a Hub repo id: from the local
    HF cache, downloaded only with ``download`` / ``SPECJAX_ALLOW_DOWNLOAD=1``, :mod:`specjax.hub`)
    and its verifier ``target`` (an HF
    directory, a loaded specjax target model, or a ``{name: array}`` mapping). ``target=None``
    uses ``speculators_config.verifier.name_or_path`` when that directory exists (as
    speculators does); without any verifier every verifier-owned tensor must be in the
    checkpoint. ``dtype``: None keeps the checkpoint's float dtype. ``verifier_heads=False``
    (inference only) builds no ``verifier_lm_head`` / ``verifier_norm``: less memory, and a
    checkpoint that carries embed_tokens and lm_head then loads without any verifier.
    ``place`` / ``check``: placement hooks (:func:`module_from_flat`); ``specjax.sharding.load_draft``
    passes a mesh's slice loader and the partition-rule check. ``opened``: the checkpoint's
    ``bridge.open_checkpoint`` when the caller read it already (config.json and the headers are
    parsed once per load); ``verifier_checked``: the caller ran the compatibility check against
    ``target`` (``check_pair``), so the audit does not repeat it."""
    path = hub.resolve(path, kind="draft", download=download)
    if opened is None:
        try:
            opened = bridge.open_checkpoint(path)
        except bridge.BridgeError as e:
            if not audit:
                raise
            raise DraftAuditError(f"audit could not read the checkpoint: {e}", path=str(path)) from e
    if audit:
        vdir = None if verifier_checked else _verifier_dir(target)
        rep = bridge.audit(path, verifier=vdir, opened=opened)
        errors = [f for f in rep.errors if f.rule != "vocab.values"]  # check_mapping names the draft id below
        if errors:
            msgs = "; ".join(f"[{f.rule}] {f.message}" for f in errors[:6])
            raise DraftAuditError(f"audit found {len(errors)} error(s): {msgs}", path=str(path),
                                  key=rep.errors[0].key)
    ckpt = bridge.load_checkpoint(path, check_vocab=False, opened=opened)  # check_mapping below: VocabMappingError
    cfg = ckpt.config
    lc = cfg.layer
    flat = ckpt.flat()
    check_mapping(flat.get("t2d"), flat.get("d2t"), vocab_size=lc.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
                  where=str(path))
    source = _source(target, cfg)
    fill = draft_class(cfg.speculators_model_type).verifier_fill
    flat = fill_verifier_weights(fill, flat, hidden_size=lc.hidden_size, vocab_size=lc.vocab_size,
                                 draft_vocab_size=cfg.draft_vocab_size, source=source, where=str(path),
                                 verifier_heads=verifier_heads)
    unit = bool(source is not None and source.gemma_style_norm and fill.gemma_norm_offset)
    return module_from_flat(cfg, flat, dtype=dtype, where=str(path), verifier_norm_unit_offset=unit,
                            verifier_heads=verifier_heads, place=place, check=check)
