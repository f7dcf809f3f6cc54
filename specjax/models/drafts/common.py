"""Pieces every draft shares: the vocabulary heads (``DraftVocabMixin``), the draft KV
cache, attention over a cache with an explicit mask, and packing helpers.

Draft KV cache (:class:`DraftCache`, a pytree NamedTuple)::

    k, v     one [batch, max_len, kv_heads, head_dim] array per draft layer (post-rope keys,
             post-k_norm for Qwen3-style layers)
    lengths  int32 [batch]: committed context rows of each sequence

Context rows are written at slots ``lengths[b] + arange(n)`` and advance ``lengths``.
Drafting writes scratch rows at slots ``>= lengths[b]`` without advancing it, so after
verification the next context write simply overwrites them (rollback = ``lengths`` only).
Masks are built from slot indices, so the position ids (RoPE) can be anything.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import tpu as kt
from specjax.kernels.tpu.decode import LANES
from specjax.models import panels
from specjax.models.drafts.spec import DecoderSpec, DraftConfigError
from specjax.models.drafts.verifier_weights import VerifierFill
from specjax.models.layers import INIT_STD, Embed, RMSNorm, attend, dense, first_argmax
from specjax.models.rope import apply_rope


class VocabBuffer(nnx.Variable):
    """Non-trainable integer/bool buffers (``t2d`` [V] bool, ``d2t`` [Vd] int)."""


class DraftCache(NamedTuple):
    k: tuple
    v: tuple
    lengths: jax.Array
    heads_axis = 2  # (class constant, not a field) seq-major [B, S, H, D]; the target's KVCache is heads-major

    @classmethod
    def init(cls, spec: DecoderSpec, batch: int, max_len: int, dtype=jnp.float32, lengths=None,
             num_layers: int | None = None) -> "DraftCache":
        n = spec.num_layers if num_layers is None else num_layers
        shape = (batch, max_len, spec.kv_heads, spec.head_dim)
        ln = jnp.zeros((batch,), jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(n)), tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                   ln)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def rollback(self, lengths) -> "DraftCache":
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_rows(buf, slots, rows):
    """buf [B, S, ...]; slots int [B, n]; rows [B, n, ...] -> buf with rows at slots (out of range dropped)."""
    b = jnp.arange(buf.shape[0])[:, None]
    return buf.at[b, slots].set(rows.astype(buf.dtype), mode="drop")


def cache_mask(max_len: int, ctx_slot, *, window: int | None = None, win_ref=None, lo=None, hi=None):
    """Boolean [B, 1, n, S] over cache slots for n queries.

    A query sees context slots ``kv <= ctx_slot`` (and ``kv > win_ref - window`` on sliding
    layers; ``win_ref`` defaults to ``ctx_slot``; slot ``ctx_slot`` itself always), plus the
    scratch range ``lo <= kv <= hi`` (its own draft chain). All index arrays are int [B, n].
    """
    kv = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    c = ctx_slot[..., None]
    m = kv <= c
    if window is not None:
        ref = c if win_ref is None else win_ref[..., None]
        m &= (kv > ref - window) | (kv == c)
    if lo is not None:
        m |= (kv >= lo[..., None]) & (kv <= hi[..., None])
    return m[:, None]


def cache_range(ctx_slot, *, window: int | None = None, hi=None):
    """The slots :func:`cache_mask` admits, as one inclusive range ``(lo, hi)`` (int [B, n] each),
    for the two decode patterns where they are contiguous: a context row (``hi`` None: slots
    ``<= ctx_slot``, within ``window`` of it) and a chain step whose scratch rows start right
    after its base row (``cache_mask(.., lo=ctx_slot + 1, hi=hi)``: the base's context, then its
    own chain up to ``hi``). This is what :func:`specjax.models.panels.range_attention` reads."""
    c = jnp.asarray(ctx_slot, jnp.int32)
    return panels.window_start(c, window), (c if hi is None else jnp.broadcast_to(jnp.asarray(hi, jnp.int32), c.shape))


def take_rows(x, rows):
    """x [B, n, ...], rows int [B, m] -> x[b, rows[b]] [B, m, ...]."""
    rows = jnp.asarray(rows, jnp.int32)
    return jnp.take_along_axis(x, rows.reshape(*rows.shape, *([1] * (x.ndim - 2))), axis=1)


def attention(attn, x_in, cos, sin, mask, *, kv_prefix=None, cache=None, slots=None, zero_empty_rows=False,
              query_rows=None, ranges=None):
    """One attention block on already-normed input ``x_in`` [B, n, d_in].

    Keys/values: ``kv_prefix`` (list of (k, v) pairs prepended in order, training), or a
    cache pair ``(K [B,S,...], V)`` into which the new rows are written at ``slots``.
    Returns (output [B, n, hidden], (k, v) of the new rows, updated cache pair or None).
    ``zero_empty_rows``: a query that may attend to nothing gets a zero attention output (what
    torch's flex attention and CPU sdpa give; eager gives NaN), instead of a uniform average.
    ``query_rows`` int [B, m]: every row still yields keys/values, but only these rows are
    queried (``mask`` is then [B, 1|H, m, S]) and the output is [B, m, hidden] -- the decode
    path, where only the last context row's output is used.
    ``ranges`` ``(lo, hi)`` int [B, n or m] (:func:`cache_range`): the same visibility as
    ``mask`` as one slot range per query; with a cache in the decode-time panel view
    (:func:`specjax.models.panels.attention_fits`) attention runs on the native kernel over only
    those slots instead of scoring every slot of the cache.

    In a TPU program (``kt.attention_impl() == "pallas"``) attention runs on the Pallas kernels:
    ``ranges`` with a cache on the decode kernel (only the blocks in range are read), otherwise
    the flash kernel with ``mask`` as a :class:`~specjax.kernels.tpu.MaskSpec` (``mask`` may be
    one already: the training masks, built without their dense ``[T, S]`` form).
    """
    if query_rows is None:
        q, k, v = attn.project(x_in)
        q = apply_rope(q, cos, sin)
    else:
        k, v = attn.project_kv(x_in)
        q = apply_rope(attn.project_q(take_rows(x_in, query_rows)), take_rows(cos, query_rows),
                       take_rows(sin, query_rows))
    k = apply_rope(k, cos, sin)
    new_cache = None
    if cache is not None:
        K, V = write_rows(cache[0], slots, k), write_rows(cache[1], slots, v)
        new_cache = (K, V)
        kk, vv = K.astype(q.dtype), V.astype(q.dtype)
    elif kv_prefix:
        kk = jnp.concatenate([p[0] for p in kv_prefix] + [k], axis=1)
        vv = jnp.concatenate([p[1] for p in kv_prefix] + [v], axis=1)
    else:
        kk, vv = k, v
    if isinstance(mask, kt.MaskSpec) or kt.attention_impl() == "pallas":
        return attn.output(_tpu_attention(attn, q, kk, vv, mask, ranges if cache is not None else None,
                                          zero_empty_rows)), (k, v), new_cache
    if cache is not None and ranges is not None and panels.attention_fits(attn.q_proj, q, kk):
        return attn.output(panels.range_attention(q, kk, vv, *ranges, scale=attn.scaling, seq_major=True)), (k, v), \
            new_cache
    o = attend(q, kk, vv, mask, scale=attn.scaling)
    if zero_empty_rows and mask is not None:
        o = jnp.where(jnp.moveaxis(mask.any(-1), 1, -1)[..., None], o, 0)
    return attn.output(o), (k, v), new_cache


def _tpu_attention(attn, q, kk, vv, mask, ranges, zero_empty_rows: bool):
    """:func:`attention`'s TPU path. q [B, n, Hq, D]; kk, vv [B, S, Hkv, D] (seq-major: a
    DraftCache or the concatenated training keys); ``mask`` a MaskSpec or a bool [B, 1, n, S]."""
    if ranges is not None and (vv.shape[2] == 1 or q.shape[-1] % LANES == 0):
        return kt.cache_attention(q, kk, vv, *ranges, scale=attn.scaling, seq_major=True)
    spec = mask if isinstance(mask, kt.MaskSpec) else kt.dense(mask)
    o = kt.tpu_attention(q, kk, vv, mask_spec=spec, scale=attn.scaling)
    if zero_empty_rows:
        if spec.kind != "dense":
            raise kt.MaskSpecError(f"zero_empty_rows needs the mask's rows: a dense spec, got {spec.kind!r}")
        o = jnp.where(spec.dense.any(-1)[:, :, None, None], o, 0)
    return o


def mlp_block(layer, x):
    return x + layer.mlp(layer.post_attention_layernorm(x))


def init_vocab(module, spec: DecoderSpec, draft_vocab_size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
               verifier_heads: bool = True, verifier_norm_unit_offset: bool = False):
    """``DraftVocabMixin._init_vocab``: embed_tokens [V, H], lm_head H -> Vd, verifier_lm_head,
    verifier_norm, and the t2d/d2t buffers when the vocabulary is pruned."""
    H, V = spec.hidden, spec.vocab_size
    module.vocab_size = V
    module.draft_vocab_size = int(draft_vocab_size)
    module.embed_tokens = Embed(V, H, rngs=rngs, param_dtype=param_dtype,
                                embedding_init=nnx.initializers.normal(INIT_STD))
    module.lm_head = dense(H, draft_vocab_size, bias=False, rngs=rngs, param_dtype=param_dtype)
    if verifier_heads:
        module.verifier_lm_head = dense(H, draft_vocab_size, bias=False, rngs=rngs, param_dtype=param_dtype)
        module.verifier_norm = RMSNorm(H, spec.eps, param_dtype=param_dtype, unit_offset=verifier_norm_unit_offset)
    else:
        module.verifier_lm_head = None
        module.verifier_norm = None
    if draft_vocab_size != V:
        module.t2d = VocabBuffer(jnp.zeros((V,), bool))
        module.d2t = VocabBuffer(jnp.zeros((draft_vocab_size,), jnp.int32))
    else:
        module.t2d = None
        module.d2t = None


def d2t_of(module):
    return None if module.d2t is None else module.d2t[...]


def verifier_targets(module, verifier_last_hidden_states):
    """``verifier_lm_head(verifier_norm(y))`` under stop_gradient: the training targets [.., Vd]."""
    if module.verifier_lm_head is None:
        raise DraftConfigError("this draft was built without verifier heads (verifier_heads=False), so it cannot "
                               "compute training targets; load it with verifier_heads=True", key="verifier_lm_head")
    y = jax.lax.stop_gradient(verifier_last_hidden_states)
    return jax.lax.stop_gradient(module.verifier_lm_head(module.verifier_norm(y)))


def last_valid(x, n_valid):
    """x [B, n, ...] -> x[b, n_valid[b] - 1] [B, ...]."""
    idx = (n_valid - 1).astype(jnp.int32)
    return jnp.take_along_axis(x, idx.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


def last_rows(n_valid, n: int):
    """n_valid int [B] -> rows int [B, 1]: each sequence's last real row ``n_valid - 1`` (the
    ``query_rows`` of the decode path); ``n_valid == 0`` (a finished sequence) wraps to row n - 1,
    the row :func:`last_valid` picks."""
    return ((jnp.asarray(n_valid, jnp.int32) - 1) % n)[:, None]


def greedy(logits, key=None):  # noqa: ARG001
    """Default draft sampler: argmax (first index on ties, like torch)."""
    return first_argmax(logits)


def frozen_params(model) -> tuple[str, ...]:
    """Top-level param names speculators freezes (``requires_grad=False``) for this draft:
    lm_head, verifier_lm_head and verifier_norm always; embed_tokens unless the draft trains
    it (a class with ``embed_trainable`` and a config with ``embed_requires_grad``: P-EAGLE;
    EAGLE-3's lookup runs under ``no_grad`` anyway)."""
    names = ["lm_head", "verifier_lm_head", "verifier_norm"]
    if not (type(model).embed_trainable and getattr(model, "embed_requires_grad", False)):
        names.append("embed_tokens")
    return tuple(names)


def trainable(model):
    """nnx filter selecting the params speculators trains (for ``nnx.state`` / ``nnx.grad``)."""
    return nnx.All(nnx.Param, nnx.Not(nnx.Any(*(nnx.PathContains(n) for n in frozen_params(model)))))


class TargetTaps:
    """Which target hidden states a draft consumes, as tap ids of ``specjax.models.CausalLM``
    (id k < n: residual stream entering layer k = HF ``hidden_states[k]``; id n: final pre-norm
    state), and how they are concatenated (aux-id order, the order ``fc`` was trained on).

    The base of every draft class, and so the home of what the rest of the code asks about an
    algorithm at the model level (each draft class overrides what differs):

    - ``algorithm``: the ``speculators_model_type`` (the registry key,
      :mod:`specjax.models.drafts.registry`);
    - ``verifier_fill``: how the verifier-owned tensors are filled and saved
      (:class:`~specjax.models.drafts.verifier_weights.VerifierFill`);
    - ``embed_trainable``: the draft may train its embedding (with ``embed_requires_grad``);
    - ``vocab_reduction``: the draft may predict over a pruned vocabulary (t2d / d2t);
    - :meth:`max_proposal`: the most tokens one proposal holds (block drafts);
    - ``tree_drafting``: how a token tree's children are drafted (:mod:`specjax.decode.tree_loop`):
      "chain" (one chain step per node from its parent's state: EAGLE-3, MTP), "parallel" (one
      proposal whose depth-d logits ignore the drafted tokens, so every node of a depth has the
      same children: P-EAGLE, DFlash), "markov" (the block once, the depth-d logits re-run with
      each node's path fed: DSpark's Markov head), None (no trees).

    (Whether a checkpoint fits a verifier is a format fact: :func:`bridge.auditor.check_verifier`.)"""

    algorithm: str = ""
    aux_layer_ids: tuple | None = None
    verifier_fill: VerifierFill = VerifierFill()
    embed_trainable: bool = False
    vocab_reduction: bool = True
    tree_drafting: str | None = None

    def tap_ids(self, num_target_layers: int) -> tuple[int, ...]:
        n = int(num_target_layers)
        # speculators resolves a missing list to [2, n // 2, n - 3] from the verifier config
        return tuple(self.aux_layer_ids) if self.aux_layer_ids else (2, n // 2, n - 3)

    def max_proposal(self) -> int | None:
        """Tokens one proposal can hold: None for a chain draft (any k); a block draft's block."""
        return None

    def aux_from_taps(self, taps):
        """Target ``aux_hidden_states`` (one [B, T, H] per tap id, in tap_ids order) -> [B, T, A*H]."""
        taps = tuple(taps)
        return taps[0] if len(taps) == 1 else jnp.concatenate(taps, axis=-1)
