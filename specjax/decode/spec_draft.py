"""A draft made ready for the speculative loop (:class:`SpecDraft`): loaded from a speculators
checkpoint (its config and headers read once, the one draft-target compatibility check, the
params placed by :class:`~specjax.sharding.placement.Placement`), the target's own first layers
(``"self"`` / ``"self:M"``), or a module; and ``k`` resolved against what it was trained for."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

import bridge
from bridge.auditor import Report, VerifierFacts, check_verifier
from specjax.decode.selfdraft import SelfDraft
from specjax.models.errors import ModelError
from specjax.models.target import CausalLM
from specjax.sharding.placement import Placement


class DraftTargetMismatchError(ModelError, ValueError):
    """The draft was built for a different target (hidden size, vocabulary, layers, architecture)."""


@dataclass
class SpecDraft:
    """A draft ready for the loop: the module plus what its checkpoint says about decoding."""

    module: Any
    config: Any = None  # bridge DraftConfig, None for a self draft / bare module
    source: str = "<module>"

    @property
    def algorithm(self) -> str:
        return getattr(self.module, "algorithm", type(self.module).__name__)

    @property
    def speculative_tokens(self) -> int:
        if self.config is not None:
            return int(self.config.speculative_tokens)
        return int(getattr(self.module, "speculative_tokens", 3))

    @property
    def verifier_accept_k(self) -> int:
        return 1 if self.config is None else int(self.config.proposal.verifier_accept_k)

    @property
    def accept_tolerance(self) -> float:
        return 0.0 if self.config is None else float(self.config.proposal.accept_tolerance)

    @property
    def max_k(self) -> int | None:
        """Tokens one block proposes (block drafts); None for chain drafts (any k)."""
        max_proposal = getattr(self.module, "max_proposal", None)
        return None if max_proposal is None else max_proposal()


def as_spec_draft(draft) -> SpecDraft:
    return draft if isinstance(draft, SpecDraft) else SpecDraft(draft)


def check_pair(draft_config, target_config, *, draft_src: str = "draft", target_src: str = "target") -> None:
    """Refuse a draft checkpoint built for another target, from the configs alone: the bridge's
    one compatibility check (:func:`bridge.auditor.check_verifier`) against the target's config.
    Every message names both sides. Raises :class:`DraftTargetMismatchError`."""
    tc = target_config
    facts = VerifierFacts(tc.hidden_size, tc.vocab_size, tc.num_hidden_layers, (tc.architecture,), tc.family,
                          where=str(target_src))
    rep = Report(str(draft_src))
    check_verifier(draft_config, facts, rep)
    if rep.errors:
        raise DraftTargetMismatchError(f"draft {draft_src} does not fit target {target_src}: "
                                       + "; ".join(f.message for f in rep.errors), key=rep.errors[0].key)


def parse_self_draft(spec: str | None) -> int | None | bool:
    """'self' -> None (all layers), 'self:M' -> M; anything else -> False."""
    if spec is None:
        return None
    s = str(spec)
    if s == "self":
        return None
    if s.startswith("self:"):
        try:
            return int(s.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--draft {s!r}: expected 'self' or 'self:M' with M an integer number of layers") from None
    return False


def load_spec_draft(draft, target, *, dtype=None, speculative_tokens: int = 3, mesh=None) -> SpecDraft:
    """A :class:`SpecDraft` for ``draft``: a speculators checkpoint directory (checked against the
    target, then ``load_draft``), ``None`` / ``"self"`` / ``"self:M"`` (a :class:`SelfDraft` of the
    target's first M layers), a draft module, or a ``SpecDraft``. ``target``: a ``LoadedTarget``
    or ``CausalLM``. ``dtype`` None: the target's parameter dtype (speculators exports bf16; on a
    CPU an f32 target runs an f32 draft much faster than a bf16 one, and the single-device loop
    streams such a draft's bf16-valued weights as bf16 panels, :mod:`specjax.models.panels`). ``mesh`` (more than one
    device): a checkpoint loads straight into its ``DRAFT_RULES`` shardings
    (``specjax.sharding.load_draft``)."""
    if isinstance(draft, SpecDraft):
        return draft
    model = target.model if hasattr(target, "model") and isinstance(target.model, CausalLM) else target
    layers = parse_self_draft(draft)
    if layers is not False:
        return SpecDraft(SelfDraft(model, layers, speculative_tokens), None,
                         "self" if layers is None else f"self:{layers}")
    if not isinstance(draft, (str, os.PathLike)):
        return SpecDraft(draft)
    path = os.fspath(draft)
    opened = bridge.open_checkpoint(path)  # config.json and headers, read once for the whole load
    check_pair(opened.config, model.config, draft_src=path, target_src=getattr(target, "source", "<module>"))
    if dtype is None:  # run the draft in the target's dtype (a bf16 checkpoint under an f32 target: f32)
        dtype = jnp.dtype(model.model.embed_tokens.embedding[...].dtype).name
    module = Placement.of(mesh).load_draft(path, target, dtype=dtype, verifier_heads=False, opened=opened,
                                           verifier_checked=True)
    return SpecDraft(module, opened.config, path)


def resolve_k(draft: SpecDraft, k: int | None) -> int:
    """k from the checkpoint (``proposal_methods[0].speculative_tokens``) unless overridden; a
    warning above what the draft was trained for; a block draft cannot propose more than its block."""
    trained = draft.speculative_tokens
    kk = trained if k is None else int(k)
    if kk < 1:
        raise ValueError(f"k (speculative tokens) must be >= 1, got {kk}")
    mk = draft.max_k
    if mk is not None and kk > mk:
        raise DraftTargetMismatchError(f"k = {kk}, but a {draft.algorithm} block of draft {draft.source} proposes "
                                       f"{mk} tokens per forward", key="k")
    if kk > trained and draft.config is not None:
        warnings.warn(f"k = {kk} is larger than the {trained} speculative tokens draft {draft.source} was trained "
                      "for (proposal_methods[0].speculative_tokens); later positions will be accepted less often",
                      stacklevel=3)
    return kk


# ----------------------------------------------------------------------------- the loop


def draft_dtype_of(module):
    """The draft's parameter dtype (its cache dtype), read from the dtypes alone (abstract params too)."""
    for name in ("embed_tokens", "fc", "lm_head"):
        m = getattr(module, name, None)
        for attr in ("embedding", "kernel"):
            v = getattr(m, attr, None) if m is not None else None
            if v is not None:  # the dtype alone: arrays and abstract (eval_shape) params alike
                return jnp.dtype(v.get_value().dtype)
    return jnp.dtype(jnp.float32)
