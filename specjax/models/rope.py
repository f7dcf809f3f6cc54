"""Rotary position embeddings with the HF rope variants (transformers ``modeling_rope_utils``).

``RopeConfig`` is a frozen (hashable, jit-static) description parsed from an HF config dict:
``rope_parameters`` (transformers 5) or the legacy ``rope_theta`` / ``rope_scaling`` keys.
Supported ``rope_type``: ``default``, ``linear``, ``llama3``, ``yarn``, ``dynamic``.

    rc = RopeConfig.from_hf(config_dict, head_dim=64)
    cos, sin = rope_cos_sin(positions, rc)          # positions: int [batch, seq] (any int dtype)
    q = apply_rope(q, cos, sin)                     # q: [batch, seq, heads, head_dim]

Numerics follow HF: inverse frequencies in float32, ``freqs = pos * inv_freq``, ``emb =
concat(freqs, freqs)``, ``cos = cos(emb) * attention_scaling`` cast to the activation dtype, and
neox ``rotate_half``. With ``rotary_dim < head_dim`` (``partial_rotary_factor``) only the first
``rotary_dim`` channels rotate (vLLM partial-neox); the rest pass through.

``dynamic`` (NTK) recomputes the base from ``seq_len = max(positions) + 1`` of the call when it
exceeds ``max_position_embeddings``, like HF's ``dynamic_rope_update`` does per forward; keys
already in a KV cache keep the rotation they were written with (as in HF generation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from bridge.hf_values import rope_parameters
from specjax.models.errors import ModelError

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic")


class RopeConfigError(ModelError, ValueError):
    """rope_parameters / rope_scaling of an unsupported type or missing a required key."""


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    rotary_dim: int | None = None  # None -> head_dim
    factor: float = 1.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    extra: tuple = field(default=(), compare=False)

    @property
    def dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, head_dim: int, where: str = "config.json") -> "RopeConfig":
        """Parse rope settings from an HF config dict (transformers 5 ``rope_parameters`` or the
        legacy ``rope_theta`` + ``rope_scaling``). Nested per-layer-type dicts take the
        ``full_attention`` entry (else ``sliding_attention``)."""
        params = rope_parameters(cfg)
        if params and all(isinstance(v, Mapping) for v in params.values()):
            key = "full_attention" if "full_attention" in params else "sliding_attention"
            if key not in params:
                raise RopeConfigError(f"nested rope_parameters with keys {sorted(params)}; expected 'full_attention'",
                                      path=where, key="rope_parameters")
            params = dict(params[key])
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED:
            raise RopeConfigError(f"rope_type {rope_type!r} is not supported; expected one of {list(SUPPORTED)}",
                                  path=where, key="rope_parameters.rope_type")
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        orig = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if rope_type in ("llama3", "yarn") and orig is None:
            orig = max_pos
        factor = params.get("factor")
        if rope_type in ("linear", "llama3", "dynamic") and factor is None:
            raise RopeConfigError(f"rope_type {rope_type!r} needs 'factor'", path=where, key="rope_parameters.factor")
        if rope_type == "yarn" and factor is None:
            factor = max_pos / orig
        if rope_type == "llama3":
            for k in ("low_freq_factor", "high_freq_factor"):
                if k not in params:
                    raise RopeConfigError(f"rope_type 'llama3' needs {k!r}", path=where, key=f"rope_parameters.{k}")
        return cls(
            head_dim=int(head_dim),
            theta=float(theta),
            rope_type=rope_type,
            rotary_dim=int(head_dim * prf) if prf != 1.0 else None,
            factor=float(factor if factor is not None else 1.0),
            max_position_embeddings=max_pos,
            original_max_position_embeddings=None if orig is None else int(orig),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)))).astype(np.float32)


def inv_freq_and_scale(rc: RopeConfig) -> tuple[np.ndarray, float]:
    """Static inverse frequencies ``[dim // 2]`` (float32) and the cos/sin scaling factor.
    For ``dynamic`` this is the un-stretched table (seq_len <= max_position_embeddings)."""
    dim = rc.dim
    inv = _base_inv_freq(rc.theta, dim)
    if rc.rope_type in ("default", "dynamic"):
        return inv, 1.0
    if rc.rope_type == "linear":
        return (inv / np.float32(rc.factor)).astype(np.float32), 1.0
    if rc.rope_type == "llama3":
        old = rc.original_max_position_embeddings
        low_w, high_w = old / rc.low_freq_factor, old / rc.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_w, inv / rc.factor, inv)
        smooth = (old / wavelen - rc.low_freq_factor) / (rc.high_freq_factor - rc.low_freq_factor)
        smoothed = (1 - smooth) * out / rc.factor + smooth * out
        medium = ~(wavelen < high_w) & ~(wavelen > low_w)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if rc.rope_type == "yarn":
        factor = rc.factor

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = rc.attention_factor
        if att is None:
            if rc.mscale and rc.mscale_all_dim:
                att = float(get_mscale(factor, rc.mscale) / get_mscale(factor, rc.mscale_all_dim))
            else:
                att = get_mscale(factor)
        orig = rc.original_max_position_embeddings

        def corr_dim(n_rot):
            return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(rc.theta))

        low, high = corr_dim(rc.beta_fast), corr_dim(rc.beta_slow)
        if rc.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extra_f = (1 - ramp).astype(np.float32)
        pos_freqs = (np.float32(rc.theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
        inv_ex = 1.0 / pos_freqs
        inv_in = 1.0 / (np.float32(factor) * pos_freqs)
        return (inv_in * (1 - extra_f) + inv_ex * extra_f).astype(np.float32), float(att)
    raise RopeConfigError(f"rope_type {rc.rope_type!r} is not supported; expected one of {list(SUPPORTED)}")


def _dynamic_inv_freq(rc: RopeConfig, positions) -> jnp.ndarray:
    """NTK-dynamic inverse frequencies for ``seq_len = max(positions) + 1`` (traced)."""
    dim = rc.dim
    mp = rc.max_position_embeddings
    seq_len = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1.0, float(mp))
    base = rc.theta * ((rc.factor * seq_len / mp) - (rc.factor - 1)) ** (dim / (dim - 2))
    expo = jnp.asarray(np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    return (1.0 / (base.astype(jnp.float32) ** expo)).astype(jnp.float32)


def rope_cos_sin(positions, rc: RopeConfig, dtype=jnp.float32):
    """cos, sin ``[*positions.shape, rotary_dim]`` for integer positions of any shape."""
    if rc.rope_type == "dynamic":
        inv = _dynamic_inv_freq(rc, positions)
        scale = 1.0
    else:
        inv_np, scale = inv_freq_and_scale(rc)
        inv = jnp.asarray(inv_np)
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [..., dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """Neox-style rotation. x ``[batch, seq, heads, head_dim]``; cos/sin ``[batch, seq, rotary_dim]``
    (broadcast over heads). Channels past ``rotary_dim`` pass through unchanged."""
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rd], x[..., rd:]
    return jnp.concatenate([xr * cos + rotate_half(xr) * sin, xp], axis=-1)
