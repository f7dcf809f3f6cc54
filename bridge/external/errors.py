"""Errors of the external-draft converters. Each names the source file or key, what was
found and what was expected; nothing is written when one is raised."""

from __future__ import annotations

from bridge.errors import BridgeError


class ExternalSourceError(BridgeError):
    """A third-party draft cannot be converted: wrong kind, missing or mis-shaped tensors,
    a config key the conversion needs is absent, or an option does not apply."""


class UnrecognizedSourceError(ExternalSourceError):
    """``--from auto`` found none of the markers of a supported source kind."""


class VerifierError(ExternalSourceError):
    """The verifier directory (``--verifier``) is missing or its config.json is unusable."""


class ExternalAuditError(ExternalSourceError):
    """The converted checkpoint failed ``bridge.audit``; it was not published."""

    exit_code = 1

    def __init__(self, message: str, report=None, **kw):
        super().__init__(message, **kw)
        self.report = report
