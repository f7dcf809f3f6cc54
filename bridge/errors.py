"""Typed errors of the bridge. Every message names the file, the key or tensor,
what was found and what was expected; the CLI prints the message, not a traceback."""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every error the bridge raises on bad input."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        self.path = None if path is None else str(path)
        self.key = key
        self.message = message  # without the path prefix
        prefix = f"{self.path}: " if self.path else ""
        super().__init__(prefix + message)


class CheckpointNotFoundError(BridgeError):
    """A file or directory the checkpoint needs does not exist."""


class ConfigError(BridgeError):
    """config.json is missing, not JSON, or has a missing/invalid key."""


class ConfigContractError(ConfigError):
    """config.json parses but breaks the contract (aux layer ids, ...): exit 1, as ``audit`` reports it."""

    exit_code = 1


class UnknownModelTypeError(ConfigError):
    """speculators_model_type is absent or names no known algorithm."""


class SafetensorsFormatError(BridgeError):
    """A safetensors file is malformed (header, offsets, dtype, lengths)."""


class ShardIndexError(BridgeError):
    """model.safetensors.index.json is malformed or inconsistent with the shards."""


class TensorMismatchError(BridgeError):
    """Tensors missing, unexpected, or of the wrong shape/dtype/values for the declared config: a
    readable checkpoint that breaks the contract (exit 1, as ``audit`` reports it)."""

    exit_code = 1


class WriteError(BridgeError):
    """An output could not be written (destination exists, not writable, ...)."""


class OrbaxFormatError(BridgeError):
    """An Orbax checkpoint written by specjax is missing pieces or inconsistent."""
