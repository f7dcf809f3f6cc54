"""The draft algorithms specjax runs, by ``speculators_model_type``: the one table from an
algorithm's name to its draft class. Everything the model layer knows about an algorithm is an
attribute or method of that class (see :class:`specjax.models.drafts.common.TargetTaps`); the
training side's per-algorithm knowledge is in :mod:`specjax.train.algorithms`."""

from __future__ import annotations

from specjax.models.drafts.dflash import DFlashDraft
from specjax.models.drafts.dspark import DSparkDraft
from specjax.models.drafts.eagle3 import Eagle3Draft
from specjax.models.drafts.mtp import MTPDraft
from specjax.models.drafts.peagle import PEagleDraft
from specjax.models.errors import ModelError

DRAFTS: dict[str, type] = {c.algorithm: c for c in (Eagle3Draft, PEagleDraft, DFlashDraft, DSparkDraft, MTPDraft)}


class UnknownAlgorithmError(ModelError):
    """No draft class for this ``speculators_model_type``."""


def draft_class(algorithm: str) -> type:
    """The draft class of ``algorithm`` (a ``speculators_model_type``)."""
    try:
        return DRAFTS[algorithm]
    except KeyError:
        raise UnknownAlgorithmError(f"no draft model for algorithm {algorithm!r}; expected one of "
                                    f"{', '.join(DRAFTS)}", key="speculators_model_type") from None
