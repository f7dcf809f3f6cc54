"""P-EAGLE draft (speculators ``PEagleDraftModel``, 0.9.0): EAGLE-3 layers, one parallel pass.

Extra params: ``mask_hidden`` [1, 1, A*H] (aux-space stand-in for positions past the anchor)
and a trainable ``embed_tokens`` (``embed_requires_grad``, default True).

Training forward (:meth:`PEagleDraft.__call__`) over given COD elements ``(anchor_pos, depth)``
(flattened, N of them; ``orig = anchor + depth``): depth 0 takes ``input_ids[orig]`` and
``hidden_states[orig]``, depth >= 1 takes ``mask_token_id`` and ``mask_hidden``; aux ->
(input_norm | fc_norm) -> fc; layers as EAGLE-3 with RoPE positions ``orig`` (packed-row
indices, not per-document position ids); ``logits = lm_head(norm(h))``. Mask (q, kv):
query's anchor document is not padding and equals kv's, and either kv is depth 0 with
``anchor_kv <= anchor_q`` and ``anchor_kv > anchor_q + depth_q - W`` (sliding), or kv is in the
same rollout (``anchor_kv == anchor_q``) with ``depth_kv <= depth_q``.

Inference (:meth:`propose`): context rows are depth-0 elements in the :class:`DraftCache`
(:meth:`extend`, as EAGLE-3); the last row's logits give token 1 and one parallel pass of
k-1 mask elements at positions ``p + d`` gives tokens 2..k; each sees the context rows (window
from ``base + d``; the base row always) and the mask elements of depth <= its own.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.drafts.common import DraftCache, cache_mask, d2t_of, greedy, last_rows, last_valid
from specjax.models.drafts.eagle3 import Eagle3Draft, Proposal
from specjax.models.drafts.spec import DraftConfigError
from specjax.models.drafts.vocab import draft_to_target
from specjax.models.rope import rope_cos_sin


class PEagleOutput(NamedTuple):
    logits: jax.Array  # [B, N, Vd]
    hidden: jax.Array  # [B, N, H] post-norm
    targets: jax.Array | None  # [B, N, Vd] verifier targets at orig
    loss_mask: jax.Array | None  # [B, N] loss_mask[orig]


def peagle_mask(anchor_pos, depth, document_ids, window: int | None):
    """speculators ``create_peagle_mask_mod`` as a dense bool [B, 1, N, N]. anchor/depth [B, N]."""
    T = document_ids.shape[-1]
    doc = jnp.take_along_axis(document_ids, anchor_pos % T, axis=1)  # torch indexing wraps -1
    qa, ka = anchor_pos[:, :, None], anchor_pos[:, None, :]
    qd, kd = depth[:, :, None], depth[:, None, :]
    same_doc = doc[:, :, None] == doc[:, None, :]
    not_pad = (doc != -1)[:, :, None]
    in_window = True if window is None else (ka > qa + qd - window)
    m = not_pad & same_doc & (((kd == 0) & (qa >= ka) & in_window) | ((qa == ka) & (qd >= kd)))
    return m[:, None]


class PEagleDraft(Eagle3Draft):
    algorithm = "peagle"
    embed_trainable = True  # speculators' P-EAGLE config always has embed_requires_grad
    token_position_offset = 0  # training RoPE positions are packed-row indices of the aux rows
    tree_drafting = "parallel"  # the mask rows' logits do not see the drafted tokens

    def __init__(self, config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 verifier_norm_unit_offset: bool = False, verifier_heads: bool = True):
        rngs = rngs or nnx.Rngs(0)
        super().__init__(config, rngs=rngs, param_dtype=param_dtype, verifier_norm_unit_offset=verifier_norm_unit_offset,
                         verifier_heads=verifier_heads)
        self.mask_token_id = config.mask_token_id
        A, H = self.num_aux, self.spec.hidden
        self.mask_hidden = nnx.Param(jax.random.normal(rngs.params(), (1, 1, A * H), param_dtype))

    def _mask_token(self) -> int:
        if self.mask_token_id is None:
            raise DraftConfigError("mask_token_id is not set on the config", key="mask_token_id")
        return int(self.mask_token_id)

    def __call__(self, hidden_states, input_ids, document_ids, position_ids=None, loss_mask=None,
                 verifier_last_hidden_states=None, *, anchor_pos, depth) -> PEagleOutput:
        """speculators ``PEagleDraftModel.forward`` with the COD elements given.

        hidden_states [B, T, A*H]; input_ids, document_ids [B, T]; anchor_pos, depth int [N] or
        [B, N]; position_ids is accepted for signature parity (P-EAGLE positions are ``orig``)."""
        del position_ids
        B, T = input_ids.shape
        anchor_pos = jnp.asarray(anchor_pos, jnp.int32)
        depth = jnp.asarray(depth, jnp.int32)
        if anchor_pos.ndim == 1:
            anchor_pos = jnp.broadcast_to(anchor_pos[None], (B, anchor_pos.shape[0]))
            depth = jnp.broadcast_to(depth[None], anchor_pos.shape)
        orig = anchor_pos + depth
        d0 = depth == 0
        ids = jnp.where(d0, jnp.take_along_axis(input_ids, orig, axis=1), self._mask_token())
        e = self.embed(ids)
        aux = jnp.where(d0[..., None], jnp.take_along_axis(hidden_states, orig[..., None], axis=1),
                        self.mask_hidden[...].astype(hidden_states.dtype)[0])
        h = self.project_aux(aux)
        cos, sin = rope_cos_sin(orig, self.spec.rope, dtype=h.dtype)
        mk = {w: peagle_mask(anchor_pos, depth, document_ids, w) for w in self.spec.distinct_windows}
        # rows whose anchor is padding may attend to nothing: zero attention output, as torch's
        # flex / CPU sdpa give (speculators' eager path gives NaN there)
        out, _, _ = self._layers(e, h, cos, sin, [mk[w] for w in self.spec.windows], zero_empty_rows=True)
        hidden = self.norm(out)
        logits = self.lm_head(hidden)
        targets = None
        if verifier_last_hidden_states is not None:
            targets = self.targets(jnp.take_along_axis(verifier_last_hidden_states, orig[..., None], axis=1))
        lm = None if loss_mask is None else jnp.take_along_axis(loss_mask, orig, axis=1)
        return PEagleOutput(logits, hidden, targets, lm)

    def head(self, out):
        normed = self.norm(out)
        return self.lm_head(normed), normed  # P-EAGLE never feeds hidden states forward

    def propose(self, cache: DraftCache, hidden_states, input_ids, positions, *, k: int | None = None, n_valid=None,
                sample: Callable = greedy, key=None) -> Proposal:
        """Extend the context, then draft ``k`` (default ``speculative_tokens``) tokens in one parallel
        pass. Scratch slots ``lengths .. lengths + k - 2`` hold the mask elements."""
        k = self.speculative_tokens if k is None else k
        B, n = input_ids.shape
        nv = jnp.full((B,), n, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
        ext = self.extend(cache, hidden_states, input_ids, positions, nv, rows=last_rows(nv, n))
        logits0 = ext.logits[:, 0]
        pos0 = last_valid(positions, nv)
        keys = jax.random.split(key if key is not None else jax.random.key(0), k)
        cache = ext.cache
        logits = logits0[:, None]
        if k > 1:
            d = jnp.arange(1, k, dtype=jnp.int32)[None]  # [1, k-1]
            base = (cache.lengths - 1)[:, None] + 0 * d
            slots = cache.lengths[:, None] + d - 1
            e = self.embed(jnp.full((B, k - 1), self._mask_token(), jnp.int32))
            h = jnp.broadcast_to(self.project_aux(self.mask_hidden[...][0]), (B, k - 1, self.spec.hidden))
            cos, sin = rope_cos_sin(pos0[:, None] + d, self.spec.rope, dtype=h.dtype)
            masks = [cache_mask(cache.max_len, base, window=w, win_ref=base + d, lo=cache.lengths[:, None] + 0 * d,
                                hi=slots) for w in self.spec.windows]
            out, _, (ks, vs) = self._layers(e, h, cos, sin, masks, cache=cache, slots=slots)
            lk, _ = self.head(out)
            logits = jnp.concatenate([logits, lk], axis=1)
            cache = cache._replace(k=tuple(ks), v=tuple(vs))
        draft = jax.vmap(sample, in_axes=(1, 0), out_axes=1)(logits, keys)
        return Proposal(draft_to_target(draft, d2t_of(self)), draft, logits, cache)
