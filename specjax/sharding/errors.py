"""Typed errors of the sharding layer. Each message names the mesh, the parameter (dotted path)
or the flag, what was found and what was expected; the CLI prints it without a traceback."""

from __future__ import annotations

from specjax.models.errors import ModelError


class ShardingError(ModelError):
    """Base class of every error ``specjax.sharding`` raises on bad input."""


class MeshConfigError(ShardingError, ValueError):
    """A mesh preset / file / inline spec is malformed, unknown, or does not fit the devices."""


class PartitionRuleError(ShardingError, ValueError):
    """Parameters that no partition rule matches, or whose sharded dimensions do not divide."""

    def __init__(self, message: str, *, problems=(), key: str | None = None):
        self.problems = list(problems)  # [(param path, reason)]
        super().__init__(message, key=key)


class UnmatchedParamError(PartitionRuleError):
    """A parameter that no rule of the table matches."""


class IndivisibleShardError(PartitionRuleError):
    """A sharded dimension that is not a multiple of its mesh axes' size (or a spec that does not fit)."""


class DistributedConfigError(ShardingError, ValueError):
    """Incomplete or late multi-process settings (coordinator / process count / process id)."""
