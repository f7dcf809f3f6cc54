"""The draft algorithms ``specjax train`` trains, one module each: ``<name>.py`` holds that
algorithm's training adapter (:class:`specjax.train.algorithms.base.TrainAlgorithm`: recipe
defaults and checks, the ``config.json`` fields, the training forward and objective with one
signature, progress metrics). The model-level facts (verifier-owned tensors, trainable embedding,
vocabulary reduction, pair checks) are attributes of the draft class
(:mod:`specjax.models.drafts.registry`).

:data:`SPECULATOR_TYPES` is the one list of names: the recipe schema
(``config.TrainConfig.speculator_type``) and the CLI's help read it from here. This package's
``__init__`` stays light (no jax) so the CLI can name the algorithms without importing them;
:func:`get` imports an adapter module when a recipe first asks for it.

A sixth algorithm: its draft class in ``specjax/models/drafts/<name>.py`` (added to
``registry.DRAFTS``), its config class in ``bridge/schema.py`` (plus its rows in
``bridge/config_doc.py`` and ``bridge/layout.py``), its adapter here (and its name below)."""

from __future__ import annotations

import importlib

SPECULATOR_TYPES: tuple[str, ...] = ("eagle3", "dflash", "peagle", "dspark", "mtp")


def get(name: str):
    """The :class:`~specjax.train.algorithms.base.TrainAlgorithm` subclass that trains ``name``."""
    if name not in SPECULATOR_TYPES:
        raise ValueError(f"speculator_type {name!r} is not one of {', '.join(SPECULATOR_TYPES)}")
    return importlib.import_module(f"specjax.train.algorithms.{name}").ALGORITHM
