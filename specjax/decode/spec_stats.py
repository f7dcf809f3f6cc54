"""Acceptance statistics of a speculative run and the seed's speedup model: acceptance length
tau, per-position and conditional acceptance, the per-token rate alpha, tokens per verify
``(1 - a^(k+1)) / (1 - a)`` and the predicted speedup ``tau / (k c + 1)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class SpecStats:
    """Acceptance statistics of one run. ``hist[b, j]``: rounds (target verify forwards after the
    prefill) in which sequence b accepted exactly j of the k draft tokens."""

    k: int
    hist: np.ndarray  # int [B, k+1]
    lossy: bool = False

    @property
    def total(self) -> np.ndarray:
        return self.hist.sum(0)

    @property
    def rounds(self) -> int:
        return int(self.hist.sum())

    @property
    def tau(self) -> float:
        """Acceptance length: tokens committed per target forward, ``E[n + 1]``."""
        t = self.total
        return float((t * (np.arange(self.k + 1) + 1)).sum() / max(t.sum(), 1))

    @property
    def per_position(self) -> list[float]:
        """P(draft position i accepted) per round, i = 1..k (vLLM's per-position acceptance rate)."""
        t = self.total
        n = max(t.sum(), 1)
        return [float(t[i + 1:].sum() / n) for i in range(self.k)]

    @property
    def conditional(self) -> list[float | None]:
        """P(position i accepted | positions < i accepted); None where no round got that far."""
        t = self.total
        out = []
        for i in range(self.k):
            reach = t[i:].sum()
            out.append(float(t[i + 1:].sum() / reach) if reach else None)
        return out

    @property
    def alpha(self) -> float:
        """Per-token acceptance rate alpha solving ``(1 - a^(k+1)) / (1 - a) = tau`` (the seed's model)."""
        return alpha_from_tau(self.tau, self.k)

    def tokens_per_step(self) -> dict[int, int]:
        t = self.total
        return {j + 1: int(t[j]) for j in range(self.k + 1)}

    def to_dict(self) -> dict:
        return {"k": self.k, "rounds": self.rounds, "tau": round(self.tau, 4), "alpha": round(self.alpha, 4),
                "per_position_acceptance": [round(x, 4) for x in self.per_position],
                "conditional_acceptance": [None if x is None else round(x, 4) for x in self.conditional],
                "tokens_per_step": self.tokens_per_step(), "lossy": self.lossy}

    @classmethod
    def merge(cls, stats: Sequence["SpecStats"]) -> "SpecStats":
        return cls(stats[0].k, np.concatenate([s.hist for s in stats], 0), any(s.lossy for s in stats))


def expected_tokens(alpha: float, k: int) -> float:
    """Seed formula: tokens per verify ``(1 - a^(k+1)) / (1 - a)``."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_from_tau(tau: float, k: int) -> float:
    if tau >= k + 1:
        return 1.0
    if tau <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(tau: float, k: int, c: float) -> float:
    """Seed formula: wall time per token ``(k c + 1) / E[accepted]`` target forwards, so the speedup
    over one forward per token is ``E[accepted] / (k c + 1)`` (E[accepted] = tau)."""
    return tau / (k * c + 1.0)
