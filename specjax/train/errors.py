"""Typed errors of the training package. Each message names the file, key, row or line,
what was found and what was expected; the CLI prints the message, not a traceback."""

from __future__ import annotations

from bridge.errors import BridgeError


class TrainError(BridgeError):
    """Base class of every error ``specjax.train`` raises on bad input."""


class RecipeError(TrainError, ValueError):
    """A training recipe (YAML / --set) has an unknown key, a wrong type or an invalid value."""


class PromptFileError(TrainError, ValueError):
    """A prompt / conversation file is malformed (names the line)."""


class VocabMappingError(TrainError, ValueError):
    """Token frequencies or t2d/d2t that cannot form a draft vocabulary of the asked size."""


class DatasetError(TrainError, ValueError):
    """The tokenized dataset (arrow) is missing, malformed or inconsistent."""


class HiddenStateCacheError(TrainError, ValueError):
    """A cached ``hs_{i}.safetensors`` does not match the target or the dataset row."""


class ResumeError(TrainError, ValueError):
    """``--resume`` into a run whose recipe changed in a way that breaks resumption, or a
    run directory without a complete checkpoint."""
