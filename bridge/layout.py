"""Flat tensor names <-> Flax param-tree paths, as data.

A table is an ordered list of ``Rule(pattern, kind)``; the first rule whose regex matches
the flat name decides. A kind says how the leaf is renamed and transformed:

=========  ==========================  ==================  ===========================
kind       flat leaf (PyTorch)         tree leaf (Flax)    transform to Flax / back
=========  ==========================  ==================  ===========================
linear     ``x.weight`` [out, in]      ``x.kernel``        transpose / transpose
norm       ``x.weight`` [d]            ``x.scale``         none
embed      ``x.weight`` [rows, d]      ``x.embedding``     none
bias       ``x.bias``                  ``x.bias``          none
raw        ``x.name``                  ``x.name``          none (buffers, bare params)
=========  ==========================  ==================  ===========================

Path components that are decimal integers become ``int`` keys (``layers.0`` ->
``["layers"][0]``), which is how Flax nnx lists key their state. Transforms are numpy
views (a transpose of a memory map reads nothing), so layout costs no copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from bridge.errors import TensorMismatchError

LEAF = {"linear": "kernel", "norm": "scale", "embed": "embedding", "bias": "bias"}
SOURCE_LEAF = {"linear": "weight", "norm": "weight", "embed": "weight", "bias": "bias"}


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str  # linear | norm | embed | bias | raw

    def __post_init__(self):
        if self.kind not in (*LEAF, "raw"):
            raise ValueError(f"unknown layout kind {self.kind!r}")

    @property
    def regex(self) -> re.Pattern:
        return _compile(self.pattern)


_CACHE: dict[str, re.Pattern] = {}


def _compile(p: str) -> re.Pattern:
    if p not in _CACHE:
        _CACHE[p] = re.compile(p)
    return _CACHE[p]


# Rules shared by every decoder-style table (drafts and target LMs alike).
NORMS = Rule(r"(^|\.)([A-Za-z_]*norm[A-Za-z_]*)\.weight$", "norm")  # input_layernorm, q_norm, hidden_norm, ...
FC_NORMS = Rule(r"(^|\.)fc_norm\.\d+\.weight$", "norm")
EMBEDS = Rule(r"(^|\.)(embed_tokens|markov_w1|tok_embeddings|wte)\.weight$", "embed")
BIASES = Rule(r"\.bias$", "bias")
LINEARS = Rule(r"\.weight$", "linear")
BUFFERS = Rule(r"^(t2d|d2t)$", "raw")

DECODER_TABLE: tuple[Rule, ...] = (BUFFERS, FC_NORMS, NORMS, EMBEDS, BIASES, LINEARS)

# Per algorithm. They share the decoder rules; extra bare parameters are listed explicitly.
TABLES: dict[str, tuple[Rule, ...]] = {
    "eagle3": DECODER_TABLE,
    "peagle": (Rule(r"^mask_hidden$", "raw"), *DECODER_TABLE),
    "dflash": DECODER_TABLE,
    "dspark": DECODER_TABLE,
    # MoE MTP heads keep fused expert tensors as bare parameters [E, 2I, H] / [E, H, I].
    "mtp": (Rule(r"\.experts\.(gate_up_proj|down_proj)$", "raw"), *DECODER_TABLE),
    # HF target LMs (Llama / Qwen3): same decoder rules.
    "hf_lm": DECODER_TABLE,
}


def match(name: str, table: Iterable[Rule]) -> Rule | None:
    for rule in table:
        if rule.regex.search(name):
            return rule
    return None


def _key(c: str):
    return int(c) if c.isdigit() else c


def flat_to_path(name: str, rule: Rule) -> tuple:
    parts = name.split(".")
    if rule.kind != "raw":
        if parts[-1] != SOURCE_LEAF[rule.kind]:
            raise TensorMismatchError(f"tensor {name!r}: layout kind {rule.kind} expects a '.{SOURCE_LEAF[rule.kind]}' leaf")
        parts[-1] = LEAF[rule.kind]
    return tuple(_key(c) for c in parts)


def path_to_flat(path: tuple) -> tuple[str, str]:
    """Inverse name mapping; returns (flat name, kind)."""
    *head, leaf = (str(p) for p in path)
    inv = {"kernel": "linear", "scale": "norm", "embedding": "embed", "bias": "bias"}
    kind = inv.get(leaf, "raw")
    if kind != "raw":
        leaf = SOURCE_LEAF[kind]
    return ".".join([*head, leaf]), kind


def to_flax(kind: str, a):
    return a.T if kind == "linear" else a


def to_torch(kind: str, a):
    return a.T if kind == "linear" else a


def set_path(tree: dict, path: tuple, value) -> None:
    node = tree
    for p in path[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise TensorMismatchError(f"param path {'.'.join(map(str, path))} collides with a leaf")
    if path[-1] in node:
        raise TensorMismatchError(f"two tensors map to the same param path {'.'.join(map(str, path))}")
    node[path[-1]] = value


def get_path(tree: Mapping, path: tuple):
    node: Any = tree
    for p in path:
        node = node[p]
    return node


def iter_leaves(tree: Mapping, prefix: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from iter_leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def unflatten(flat: Mapping[str, Any], table: Iterable[Rule], *, where: str = "",
              load: Callable[[str, Any], Any] | None = None) -> dict:
    """Flat ``{name: array}`` (PyTorch layout) -> nested Flax tree.

    ``load(name, flax_view)`` may place each leaf (e.g. on a device); by default the
    numpy view is kept, so nothing is read yet.
    """
    table = tuple(table)
    tree: dict = {}
    for name, arr in flat.items():
        rule = match(name, table)
        if rule is None:
            raise TensorMismatchError(f"tensor {name!r} matches no layout rule of this algorithm", path=where or None, key=name)
        view = to_flax(rule.kind, arr)
        set_path(tree, flat_to_path(name, rule), load(name, view) if load else view)
    return tree


def flatten(tree: Mapping) -> dict[str, np.ndarray]:
    """Nested Flax tree -> flat ``{name: array}`` in PyTorch layout (numpy, no copy when possible)."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in iter_leaves(tree):
        name, kind = path_to_flat(path)
        out[name] = to_torch(kind, np.asarray(leaf))
    return out
