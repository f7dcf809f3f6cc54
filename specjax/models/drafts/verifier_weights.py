"""Fill the verifier-owned draft tensors from the target, exactly as speculators 0.9.0 does
(``DraftVocabMixin._load_verifier_weights``, ``utils/loading.py``).

Tensors (flat PyTorch names): ``embed_tokens.weight`` [V, H], ``lm_head.weight`` [Vd, H],
``verifier_lm_head.weight`` [Vd, H], ``verifier_norm.weight`` [H] (not MTP).

Lookup in the verifier, per wanted name (``_resolve_key``): for the name and then each alias,
an exact key, else the *shortest* key ending with it (plain ``str.endswith``, no dot boundary).
Aliases: embed ``tok_embeddings.weight``, ``llm.embed.weight``, ``backbone.embeddings.weight``;
lm_head ``output.weight``, ``llm.unembed.weight``; final norm ``llm.norm.weight``,
``backbone.norm_f.weight``, ``norm.weight``. A verifier without an lm_head (tied embeddings)
gives the embedding. lm_head / verifier_lm_head rows are ``W[t2d]`` for a pruned vocabulary.

When each tensor is (re)written, per algorithm:

=============  ==========================  =================================  ================  ==============
algorithm      embed_tokens                lm_head                            verifier_lm_head  verifier_norm
=============  ==========================  =================================  ================  ==============
eagle3/peagle  only if absent or any NaN   only if absent or any NaN          always            always*
dflash/dspark  always                      always (full vocab), else if NaN   always            always*
mtp            always                      always                             (deleted)         (none)
=============  ==========================  =================================  ================  ==============

(*) ones, with a warning, when the verifier has no final norm, as speculators does.

A tensor that is still absent or holds a NaN after this is an error naming it
(:class:`MissingVerifierWeightsError`), never a silent NaN.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from bridge.layout import path_to_flat
from bridge.safetensors_io import open_tensors
from specjax.models.drafts.vocab import select_rows
from specjax.models.errors import ModelError
from specjax.processes import to_host

ALIASES: dict[str, list[str]] = {
    "embed_tokens.weight": ["tok_embeddings.weight", "llm.embed.weight", "backbone.embeddings.weight"],
    "lm_head.weight": ["output.weight", "llm.unembed.weight"],
    "model.norm.weight": ["llm.norm.weight", "backbone.norm_f.weight", "norm.weight"],
}
# verifier families whose final norm is x * (1 + w) (speculators.models.utils, used by DFlash/DSpark only)
GEMMA_STYLE_FINAL_NORM = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text",
                                    "recurrent_gemma"})
VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


@dataclass(frozen=True)
class VerifierFill:
    """One row of the table above: how a draft algorithm's verifier-owned tensors are filled from
    the verifier and which of them its checkpoint stores. Each draft class carries its row as
    ``verifier_fill``.

    ``embed``: ``"always"`` (rewritten from the verifier) or ``"if_missing"`` (only if absent or
    NaN). ``lm_head``: ``"always"``, ``"always_full_vocab"`` (always for a full vocabulary, else
    only if absent or NaN) or ``"if_missing"``. ``verifier_heads``: the draft has
    ``verifier_lm_head`` / ``verifier_norm``. ``gemma_norm_offset``: ``verifier_norm`` follows a
    Gemma-style verifier's ``x * (1 + w)``."""

    embed: str = "if_missing"
    lm_head: str = "if_missing"
    verifier_heads: bool = True
    gemma_norm_offset: bool = False

    def owned(self) -> tuple[str, ...]:
        """The verifier-owned tensors a complete draft of this algorithm holds."""
        return VERIFIER_OWNED if self.verifier_heads else VERIFIER_OWNED[:2]

    def always_embed(self) -> bool:
        return self.embed == "always"

    def always_lm_head(self, *, pruned: bool) -> bool:
        return self.lm_head == "always" or (self.lm_head == "always_full_vocab" and not pruned)

    def saved(self, flat: Mapping[str, Any], *, full_vocab: bool) -> dict[str, Any]:
        """``flat`` without what a speculators checkpoint of this algorithm leaves to the verifier:
        the verifier heads always, and every tensor the load rewrites anyway."""
        drop = {"verifier_lm_head.weight", "verifier_norm.weight"}
        if self.always_embed():
            drop.add("embed_tokens.weight")
        if self.always_lm_head(pruned=not full_vocab):
            drop.add("lm_head.weight")
        return {k: v for k, v in flat.items() if k not in drop}


class MissingVerifierWeightsError(ModelError):
    """A verifier-owned draft tensor is absent or NaN and no verifier can supply it."""


class VerifierSourceError(ModelError):
    """The verifier given as the source of embeddings / lm_head lacks what speculators needs."""


def resolve_key(name: str, keys) -> str | None:
    """speculators ``_resolve_key``: exact, then shortest suffix match, for the name then each alias."""
    keys = list(keys)
    keyset = set(keys)
    for cand in [name, *ALIASES.get(name, [])]:
        if cand in keyset:
            return cand
        hits = [k for k in keys if k.endswith(cand)]
        if hits:
            return min(hits, key=len)
    return None


class VerifierSource:
    """Named tensors of the verifier in PyTorch layout, fetched one at a time.

    Build with :meth:`of`: an HF checkpoint directory, a ``bridge`` ``TensorStore``, a
    ``{name: array}`` mapping, or a loaded target module (``specjax.models.CausalLM``; its
    params are named through the ``hf_lm`` layout, so lookups see HF names).
    """

    def __init__(self, names, get: Callable[[str], np.ndarray], *, model_type: str | None = None, where: str = ""):
        self.names = list(names)
        self._get = get
        self.model_type = model_type
        self.where = where

    def get(self, name: str) -> np.ndarray:
        return self._get(name)

    @classmethod
    def of(cls, target: Any) -> "VerifierSource":
        if isinstance(target, VerifierSource):
            return target
        if isinstance(target, (str, os.PathLike)):
            return cls.from_dir(target)
        if hasattr(target, "names") and hasattr(target, "array"):  # bridge TensorStore
            return cls(target.names, target.array)
        if isinstance(target, Mapping):
            return cls(target.keys(), lambda n: np.asarray(target[n]))
        from flax import nnx

        if isinstance(target, nnx.Module):  # specjax CausalLM
            return cls.from_module(target)
        if isinstance(getattr(target, "model", None), nnx.Module):  # specjax LoadedTarget
            return cls.from_module(target.model)
        for attr in ("path", "directory", "checkpoint_path"):
            if isinstance(getattr(target, attr, None), (str, os.PathLike)):
                return cls.from_dir(getattr(target, attr))
        raise VerifierSourceError(f"cannot read verifier weights from a {type(target).__name__}; expected an HF "
                                  "checkpoint directory, a tensor mapping, or a specjax target model")

    @classmethod
    def from_dir(cls, directory) -> "VerifierSource":
        d = Path(directory)
        store = open_tensors(d)
        mt = None
        cfg = d / "config.json"
        if cfg.is_file():
            doc = json.loads(cfg.read_text(encoding="utf-8"))
            doc = doc.get("text_config", doc) if isinstance(doc.get("text_config"), dict) else doc
            mt = str(doc.get("model_type", "") or "").lower() or None
        return cls(store.names, store.array, model_type=mt, where=str(d))

    @classmethod
    def from_module(cls, module) -> "VerifierSource":
        from specjax.models.params import param_paths  # heavy: flax (this module imports without it)

        table = {}
        for path, var in param_paths(module).items():
            name, kind = path_to_flat(path)
            table[name] = (var, kind)

        def get(n):
            var, kind = table[n]
            a = to_host(var.get_value())  # the full value, even of a multi-process array
            return a.T if kind == "linear" else a

        family = getattr(getattr(module, "config", None), "family", None)
        return cls(table, get, model_type=family, where=type(module).__name__)

    @property
    def gemma_style_norm(self) -> bool:
        return self.model_type in GEMMA_STYLE_FINAL_NORM

    def lookup(self, name: str) -> np.ndarray | None:
        key = resolve_key(name, self.names)
        return None if key is None else self.get(key)


def _has_nan(a) -> bool:
    a = np.asarray(a)
    if a.dtype.kind == "f" or "float" in a.dtype.name:
        return bool(np.isnan(a.astype(np.float32)).any())
    return False


def fill_verifier_weights(fill: VerifierFill, flat: Mapping[str, Any], *, hidden_size: int, vocab_size: int,
                          draft_vocab_size: int, source: VerifierSource | None, dtype=None,
                          where: str | None = None, verifier_heads: bool = True) -> dict[str, Any]:
    """Return ``flat`` (PyTorch-layout names) with the verifier-owned tensors filled per the
    table above (``fill``: the draft class's row, its ``verifier_fill``). ``dtype``: the dtype the
    filled tensors get (default: the float dtype of the checkpoint's own weights, else float32).
    ``verifier_heads=False``: verifier_lm_head and verifier_norm are neither required nor returned
    (inference-only drafts)."""
    out = dict(flat)
    pruned = draft_vocab_size != vocab_size
    t2d = np.asarray(out["t2d"]) if pruned and "t2d" in out else None
    dtype = _own_float_dtype(out) if dtype is None else dtype

    def needs(name: str) -> bool:
        return name not in out or _has_nan(out[name])

    if source is not None:
        embed, rows = _verifier_rows(source, vocab_size=vocab_size, hidden_size=hidden_size, t2d=t2d,
                                     pruned=pruned, where=where)
        if fill.always_embed() or needs("embed_tokens.weight"):
            out["embed_tokens.weight"] = np.asarray(embed).astype(dtype)
        if fill.always_lm_head(pruned=pruned) or needs("lm_head.weight"):
            out["lm_head.weight"] = np.asarray(rows).astype(dtype)
        if fill.verifier_heads:
            out["verifier_lm_head.weight"] = np.asarray(rows).astype(dtype)
            out["verifier_norm.weight"] = np.asarray(_verifier_norm(source, hidden_size)).astype(dtype)
    if not (verifier_heads and fill.verifier_heads):
        out.pop("verifier_lm_head.weight", None)
        out.pop("verifier_norm.weight", None)
    owned = [n for n in fill.owned() if verifier_heads or not n.startswith("verifier_")]
    bad = [n for n in owned if needs(n)]
    if bad:
        what = ", ".join(f"{n} ({'absent' if n not in out else 'NaN'})" for n in bad)
        raise MissingVerifierWeightsError(
            f"{what}: these verifier-owned tensors are not in the checkpoint (or hold NaN sentinels) and no verifier "
            "was given to fill them; pass the target model (directory or loaded model) as the verifier",
            path=where, key=bad[0])
    return out


def _own_float_dtype(flat: Mapping[str, Any]):
    """The checkpoint's own float dtype (bf16 training checkpoints stay bf16), else float32."""
    floats = [np.asarray(a).dtype for n, a in sorted(flat.items())
              if n not in VERIFIER_OWNED and (np.asarray(a).dtype.kind == "f" or "float" in np.asarray(a).dtype.name)]
    return floats[0] if floats else np.float32


def _verifier_rows(source: VerifierSource, *, vocab_size: int, hidden_size: int, t2d, pruned: bool, where):
    """The verifier's embedding and its head's rows for the draft vocabulary (``W[t2d]`` when pruned;
    the embedding for a verifier without a head), shapes checked."""
    embed = source.lookup("embed_tokens.weight")
    if embed is None:
        raise VerifierSourceError(f"the verifier has no embedding tensor (looked for 'embed_tokens.weight' and "
                                  f"its aliases {ALIASES['embed_tokens.weight']})", path=source.where,
                                  key="embed_tokens.weight")
    if tuple(embed.shape) != (vocab_size, hidden_size):
        raise VerifierSourceError(f"verifier embedding has shape {list(embed.shape)}; the draft needs "
                                  f"[{vocab_size}, {hidden_size}]", path=source.where, key="embed_tokens.weight")
    lm = source.lookup("lm_head.weight")
    lm = embed if lm is None else lm
    if tuple(lm.shape) != (vocab_size, hidden_size):
        raise VerifierSourceError(f"verifier lm_head has shape {list(lm.shape)}; the draft needs "
                                  f"[{vocab_size}, {hidden_size}]", path=source.where, key="lm_head.weight")
    if pruned and t2d is None:
        raise MissingVerifierWeightsError("the draft vocabulary is pruned but the checkpoint has no t2d, so the "
                                          "lm_head rows cannot be selected", path=where, key="t2d")
    return embed, select_rows(lm, t2d)


def _verifier_norm(source: VerifierSource, hidden_size: int):
    """The verifier's final norm weight; ones, with a warning, when it has none (as speculators)."""
    norm = source.lookup("model.norm.weight")
    if norm is None:
        warnings.warn(f"Could not find final norm weights in {source.where or 'the verifier'}; using ones "
                      "for verifier_norm (speculators does the same)", UserWarning, stacklevel=3)
        norm = np.ones((hidden_size,), np.float32)
    if tuple(np.shape(norm)) != (hidden_size,):
        raise VerifierSourceError(f"verifier final norm resolved to a tensor of shape {list(np.shape(norm))}; "
                                  f"expected [{hidden_size}]", path=source.where, key="model.norm.weight")
    return norm
