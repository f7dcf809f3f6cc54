"""Sampling rules over logits: greedy, temperature, top-k, top-p (HF warper order:
temperature -> top-k -> top-p). Pure functions, jit-friendly; ``SamplingParams`` is frozen and
hashable (a static jit argument).

For lossless speculative sampling the accept rule needs the *processed* distributions of target
and draft: :func:`probs` returns them (one-hot on the argmax for greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from specjax.models.layers import first_argmax


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy (argmax; ties pick the first index)
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def process_logits(logits, params: SamplingParams):
    """Temperature-scaled float32 logits with tokens outside top-k / top-p set to -inf. [..., V]."""
    x = logits.astype(jnp.float32)
    if params.greedy:
        return x
    x = x / params.temperature
    V = x.shape[-1]
    if params.top_k and params.top_k < V:
        kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if params.top_p < 1.0:
        srt = jnp.sort(x, axis=-1)[..., ::-1]  # descending
        p = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each sorted token
        keep = before < params.top_p
        keep = keep.at[..., 0].set(True)
        thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < thresh, -jnp.inf, x)
    return x


def probs(logits, params: SamplingParams):
    """The distribution tokens are drawn from, float32 [..., V]."""
    if params.greedy:
        return jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(logits, params), axis=-1)


def sample(key, logits, params: SamplingParams):
    """Draw token ids int32 [...] from logits [..., V]."""
    if params.greedy:
        return first_argmax(logits)
    return jax.random.categorical(key, process_logits(logits, params), axis=-1).astype(jnp.int32)
