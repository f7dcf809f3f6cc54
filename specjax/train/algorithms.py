"""The draft algorithms ``specjax train`` trains: the recipe's ``speculator_type`` values.

The one list of them: the recipe schema (``config.TrainConfig.speculator_type``) and the CLI's help
read it from here. A module of its own so the CLI can name them without importing the schema
(pydantic, the losses, jax)."""

from __future__ import annotations

SPECULATOR_TYPES: tuple[str, ...] = ("eagle3", "dflash", "peagle", "dspark", "mtp")
