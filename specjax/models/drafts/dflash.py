"""DFlash draft (speculators ``DFlashDraftModel``, 0.9.0): block drafting over a context
injected into every layer's keys/values.

Param tree::

    fc.kernel [A*H, H]   hidden_norm.scale [H]   norm.scale [H]
    layers[l]: input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm (always: Qwen3-style
               layers whatever model_type says), post_attention_layernorm, mlp
    embed_tokens.embedding [V, H]   lm_head.kernel [H, Vd]   verifier_lm_head   verifier_norm   t2d / d2t

Training forward (:meth:`DFlashDraft.__call__`, given anchors): context ``ctx =
hidden_norm(fc(aux))`` [B, T, H] is shared unchanged by all layers; N blocks of B_k slots
(slot 0 = ``input_ids[a_j]``, then ``mask_token_id``) at positions ``pos(a_j) + k``. Each
layer: ``x = input_layernorm(noise)``, ``q = q_norm(q_proj(x))``, ``k = k_norm(k_proj(cat[ctx, x]))``,
``v = v_proj(cat[ctx, x])``, RoPE (context rows at their own positions), attention, residual,
MLP. A block sees context rows of its anchor's document strictly before the anchor (sliding
layers: ``p >= a - W``) and its own block (bidirectional on full layers; causal on sliding
layers unless ``sliding_window_non_causal``).

Inference: :meth:`extend` writes the context rows' per-layer K/V into a :class:`DraftCache`;
:meth:`propose` runs one block ``[anchor, M, ..., M]`` at positions ``p_a + k`` against every
cached row (``slot < lengths``; sliding ``slot >= lengths - W``), which is the training
pattern for an anchor right after the cached context. The block itself is not cached.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import tpu as kt
from specjax.models.drafts.common import (
    DraftCache, TargetTaps, d2t_of, greedy, init_vocab, last_valid, mlp_block, verifier_targets, write_rows,
)
from specjax.models.drafts.eagle3 import Proposal
from specjax.models.drafts.spec import DecoderSpec, DraftConfigError
from specjax.models.drafts.verifier_weights import VerifierFill
from specjax.models.drafts.vocab import draft_to_target
from specjax.models.layers import RMSNorm, attend, dense
from specjax.models.rope import apply_rope, rope_cos_sin
from specjax.models.layer_scan import draft_layer_scan, layer_runs, log_layer_scan, scan_run


def _block_layer(layer, noise, kc, vc, qcos, qsin, m, pallas: bool):
    """One layer over block states ``noise`` [B, Q, H]: the blocks attend to the context K/V
    ``kc``/``vc`` and to their own projections under mask ``m``."""
    attn = layer.self_attn
    x = layer.input_layernorm(noise)
    q = apply_rope(attn.project_q(x), qcos, qsin)
    kn, vn = attn.project_kv(x)
    kn = apply_rope(kn, qcos, qsin)
    k = jnp.concatenate([kc.astype(kn.dtype), kn], axis=1)
    v = jnp.concatenate([vc.astype(vn.dtype), vn], axis=1)
    o = (kt.tpu_attention(q, k, v, mask_spec=kt.dense(m), scale=attn.scaling) if pallas
         else attend(q, k, v, m, scale=attn.scaling))
    return mlp_block(layer, noise + attn.output(o))


class DFlashOutput(NamedTuple):
    logits: jax.Array  # [B, N*Bk, Vd]
    hidden: jax.Array  # [B, N*Bk, H] post-norm block states
    targets: jax.Array | None  # [B, N*Bk, Vd] verifier logits aligned to the slots
    loss_mask: jax.Array | None  # [B, N*Bk] loss_mask[a+k] * anchor_valid (slot 0 zero unless sample_from_anchor)
    block_indices: jax.Array  # [B, N*Bk] a_j + k (packed-row index of each slot)


class BlockOutput(NamedTuple):
    logits: jax.Array  # [B, Bk, Vd]
    hidden: jax.Array  # [B, Bk, H]


def block_mask(document_ids, anchors, block_size: int, *, window: int | None, non_causal: bool):
    """speculators ``create_anchor_block_mask_mod`` as a dense bool [B, 1, N*Bk, T + N*Bk]."""
    B, T = document_ids.shape
    Q = anchors.shape[1] * block_size
    qa = jnp.repeat(anchors, block_size, axis=1)  # [B, Q]
    qdoc = jnp.take_along_axis(document_ids, qa, axis=1)
    kv = jnp.arange(T)[None, None, :]
    base = (qdoc[..., None] == document_ids[:, None, :]) & (qdoc[..., None] != -1) & (kv < qa[..., None])
    if window is not None:
        base &= kv >= qa[..., None] - window
    qi = jnp.arange(Q)
    blk = (qi[:, None] // block_size) == (qi[None, :] // block_size)
    if not (window is None or non_causal):
        blk &= qi[None, :] <= qi[:, None]
    return jnp.concatenate([base, jnp.broadcast_to(blk, (B, Q, Q))], axis=-1)[:, None]


class DFlashDraft(TargetTaps, nnx.Module):
    algorithm = "dflash"
    tree_drafting = "parallel"  # one block of mask tokens: no drafted token is fed back
    verifier_fill = VerifierFill(embed="always", lm_head="always_full_vocab", gemma_norm_offset=True)

    def __init__(self, config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 verifier_norm_unit_offset: bool = False, verifier_heads: bool = True):
        """``config``: bridge ``DFlashConfig`` (or ``DSparkConfig``). ``verifier_norm_unit_offset``:
        the verifier's final norm is ``x * (1 + w)`` (Gemma / Qwen3.5 families; 0.9.0's
        ``resolve_verifier_norm_class``)."""
        rngs = rngs or nnx.Rngs(0)
        spec = DecoderSpec.from_layer(config.transformer_layer_config, qk_norm=True, mlp_bias=False)
        self.spec = spec
        H = spec.hidden
        if config.aux_layer_ids is None:
            raise DraftConfigError("aux_hidden_state_layer_ids is not set; the fc width depends on it",
                                   key="aux_hidden_state_layer_ids")
        self.num_aux = len(config.aux_layer_ids)
        self.aux_layer_ids = tuple(config.aux_layer_ids)
        self.block_size = int(config.block_size)
        self.mask_token_id = config.mask_token_id
        self.sample_from_anchor = bool(config.sample_from_anchor)
        self.non_causal = bool(config.sliding_window_non_causal)
        self.speculative_tokens = int(config.speculative_tokens)
        init_vocab(self, spec, config.draft_vocab_size, rngs=rngs, param_dtype=param_dtype,
                   verifier_norm_unit_offset=verifier_norm_unit_offset, verifier_heads=verifier_heads)
        self.layers = nnx.List([spec.layer(i, rngs=rngs, param_dtype=param_dtype) for i in range(spec.num_layers)])
        self.norm = RMSNorm(H, spec.eps, param_dtype=param_dtype)
        self.fc = dense(self.num_aux * H, H, bias=False, rngs=rngs, param_dtype=param_dtype)
        self.hidden_norm = RMSNorm(H, spec.eps, param_dtype=param_dtype)

    def _mask_token(self) -> int:
        if self.mask_token_id is None:
            raise DraftConfigError("mask_token_id is not set on the config", key="mask_token_id")
        return int(self.mask_token_id)

    def context(self, aux):
        """aux [B, T, A*H] -> hidden_norm(fc(aux)) [B, T, H]."""
        return self.hidden_norm(self.fc(aux))

    def ctx_kv(self, layer, ctx, cos, sin):
        k, v = layer.self_attn.project_kv(ctx)
        return apply_rope(k, cos, sin), v

    def _blocks(self, noise, qcos, qsin, ctx_kvs, masks):
        """Run the layers on block states ``noise`` [B, Q, H] against per-layer context K/V. In a
        TPU program the (runtime) masks go to the flash kernel's dense-mask path."""
        pallas = kt.attention_impl() == "pallas"
        for layer, (kc, vc), m in zip(self.layers, ctx_kvs, masks):
            noise = _block_layer(layer, noise, kc, vc, qcos, qsin, m, pallas)
        return self.norm(noise)

    def _train_blocks(self, noise, ctx, ccos, csin, qcos, qsin, masks_by_window):
        """The training forward's layers: each layer projects the shared context to its K/V and runs
        the blocks against them, one layer at a time, or, where the layer scan is on
        (:func:`specjax.models.layer_scan.draft_layer_scan`), each run of alike layers (same sliding
        window) under one ``lax.scan`` (:func:`specjax.models.layer_scan.scan_run`: the same math)."""
        windows, n = self.spec.windows, len(self.layers)
        pallas = kt.attention_impl() == "pallas"
        runs = layer_runs(n, (), windows) if draft_layer_scan(n) else [(i, i + 1) for i in range(n)]
        log_layer_scan(runs)
        for a, b in runs:
            m = masks_by_window[windows[a]]

            def step(layer, h, m=m):
                kc, vc = self.ctx_kv(layer, ctx, ccos, csin)
                return _block_layer(layer, h, kc, vc, qcos, qsin, m, pallas)

            noise = scan_run(self.layers, a, b, noise, step)
        return self.norm(noise)

    def targets(self, verifier_last_hidden_states):
        return verifier_targets(self, verifier_last_hidden_states)

    # ------------------------------------------------------------------ training forward
    def __call__(self, hidden_states, input_ids, loss_mask, verifier_last_hidden_states, document_ids,
                 position_ids=None, *, anchor_positions, anchor_valid=None) -> DFlashOutput:
        """speculators ``DFlashDraftModel._backbone_forward`` with the anchors given.

        hidden_states [B, T, A*H]; input_ids, loss_mask, document_ids, position_ids (default
        arange(T)) [B, T]; verifier_last_hidden_states [B, T, H] or None; anchor_positions int
        [N] or [B, N] (packed-row indices), anchor_valid bool like it (default all True).
        """
        B, T = input_ids.shape
        Bk = self.block_size
        anchors = jnp.asarray(anchor_positions, jnp.int32)
        if anchors.ndim == 1:
            anchors = jnp.broadcast_to(anchors[None], (B, anchors.shape[0]))
        valid = (jnp.ones(anchors.shape, bool) if anchor_valid is None
                 else jnp.broadcast_to(jnp.asarray(anchor_valid, bool), anchors.shape))
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(T), (B, T))
        N = anchors.shape[1]
        Q = N * Bk
        offs = jnp.arange(Bk, dtype=jnp.int32)
        idx = (anchors[:, :, None] + offs).reshape(B, Q)  # block slot -> packed index a + k
        ids = jnp.full((B, N, Bk), self._mask_token(), input_ids.dtype)
        ids = ids.at[:, :, 0].set(jnp.take_along_axis(input_ids, anchors, axis=1)).reshape(B, Q)
        noise = jax.lax.stop_gradient(self.embed_tokens(ids))
        ctx = self.context(hidden_states)
        qpos = (jnp.take_along_axis(position_ids, anchors, axis=1)[:, :, None] + offs).reshape(B, Q)
        ccos, csin = rope_cos_sin(position_ids, self.spec.rope, dtype=ctx.dtype)
        qcos, qsin = rope_cos_sin(qpos, self.spec.rope, dtype=ctx.dtype)
        mk = {w: block_mask(document_ids, anchors, Bk, window=w, non_causal=self.non_causal)
              for w in self.spec.distinct_windows}
        hidden = self._train_blocks(noise, ctx, ccos, csin, qcos, qsin, mk)
        logits = self.lm_head(hidden)
        targets = None
        if verifier_last_hidden_states is not None:
            tidx = idx if self.sample_from_anchor else (idx - 1) % T
            y = jnp.take_along_axis(verifier_last_hidden_states, tidx[..., None], axis=1)
            targets = self.targets(y)
        lm = None
        if loss_mask is not None:
            lm = jnp.take_along_axis(loss_mask, idx, axis=1) * jnp.repeat(valid, Bk, axis=1).astype(loss_mask.dtype)
            if not self.sample_from_anchor:
                lm = lm.reshape(B, N, Bk).at[:, :, 0].set(0).reshape(B, Q)
        return DFlashOutput(logits, hidden, targets, lm, idx)

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, lengths=None) -> DraftCache:
        return DraftCache.init(self.spec, batch, max_len, dtype, lengths)

    def extend(self, cache: DraftCache, hidden_states, positions, n_valid=None) -> DraftCache:
        """Append context rows (aux [B, n, A*H] of verified tokens at RoPE ``positions`` [B, n]);
        ``n_valid`` [B] real rows per sequence (right padding), default n."""
        B, n = positions.shape
        slots = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
        ctx = self.context(hidden_states)
        cos, sin = rope_cos_sin(positions, self.spec.rope, dtype=ctx.dtype)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            k, v = self.ctx_kv(layer, ctx, cos, sin)
            ks.append(write_rows(cache.k[i], slots, k))
            vs.append(write_rows(cache.v[i], slots, v))
        return DraftCache(tuple(ks), tuple(vs), cache.lengths + (n if n_valid is None else n_valid))

    def block(self, cache: DraftCache, anchor_tokens, anchor_positions) -> BlockOutput:
        """One block ``[anchor, M, ..., M]`` per sequence: anchor_tokens [B] (target ids, the token
        right after the cached context), anchor_positions [B]. Slot k predicts the token at
        ``a + k`` (``sample_from_anchor=False``; slot 0 unused) or ``a + k + 1`` (True)."""
        hidden = self.block_hidden(cache, anchor_tokens, anchor_positions)
        return BlockOutput(self.lm_head(hidden), hidden)

    def block_hidden(self, cache: DraftCache, anchor_tokens, anchor_positions):
        """:meth:`block` without the lm_head: the post-norm block states [B, Bk, H]."""
        B = anchor_tokens.shape[0]
        Bk = self.block_size
        S = cache.max_len
        ids = jnp.full((B, Bk), self._mask_token(), jnp.int32).at[:, 0].set(anchor_tokens.astype(jnp.int32))
        noise = jax.lax.stop_gradient(self.embed_tokens(ids))
        qpos = anchor_positions[:, None] + jnp.arange(Bk, dtype=jnp.int32)
        qcos, qsin = rope_cos_sin(qpos, self.spec.rope, dtype=noise.dtype)
        slot = jnp.arange(S, dtype=jnp.int32)[None, None, :]
        a = cache.lengths[:, None, None]
        qi = jnp.arange(Bk)
        masks = {}
        for w in self.spec.distinct_windows:
            ctx_m = slot < a
            if w is not None:
                ctx_m &= slot >= a - w
            blk = jnp.ones((Bk, Bk), bool)
            if not (w is None or self.non_causal):
                blk = qi[None, :] <= qi[:, None]
            m = jnp.concatenate([jnp.broadcast_to(ctx_m, (B, Bk, S)), jnp.broadcast_to(blk, (B, Bk, Bk))], axis=-1)
            masks[w] = m[:, None]
        return self._blocks(noise, qcos, qsin, list(zip(cache.k, cache.v)), [masks[w] for w in self.spec.windows])

    def draft_slots(self) -> slice:
        return slice(0, None) if self.sample_from_anchor else slice(1, None)

    def num_block_tokens(self, k: int | None = None) -> int:
        """Tokens one block drafts: ``k`` (default all the block proposes); more is an error."""
        full = self.block_size - (0 if self.sample_from_anchor else 1)
        if k is None:
            return full
        if k > full:
            raise DraftConfigError(f"a {self.algorithm} block drafts {full} tokens; asked for {k}", key="k")
        return int(k)

    def max_proposal(self) -> int:
        return self.num_block_tokens()

    def propose(self, cache: DraftCache, anchor_tokens, anchor_positions, *, sample: Callable = greedy,
                key=None, k: int | None = None) -> Proposal:
        """Draft ``k`` (default: the whole block) tokens in one block (parallel, no feedback); the
        lm_head runs only on the k slots drafted."""
        hidden = self.block_hidden(cache, anchor_tokens, anchor_positions)
        first = self.draft_slots().start
        full = self.num_block_tokens()
        k = self.num_block_tokens(k)
        logits = self.lm_head(hidden[:, first:first + k])
        # the same per-slot keys whatever k is (a shorter proposal is a prefix of the full one)
        keys = jax.random.split(key if key is not None else jax.random.key(0), full)[:k]
        draft = jax.vmap(sample, in_axes=(1, 0), out_axes=1)(logits, keys)
        return Proposal(draft_to_target(draft, d2t_of(self)), draft, logits, cache)

    def speculate(self, cache: DraftCache, hidden_states, next_tokens, positions, *, n_valid=None,
                  k: int | None = None, sample: Callable = greedy, key=None):
        """Shared decode-loop entry (see ``ChainProposer.speculate``): extend the context with the
        new rows, then one block anchored at the token after the last real row, at its position + 1."""
        k = self.num_block_tokens(k)  # refuse a k the block cannot draft before any work
        return self.propose(*self.extend_anchor(cache, hidden_states, next_tokens, positions, n_valid=n_valid),
                            sample=sample, key=key, k=k)

    def extend_anchor(self, cache: DraftCache, hidden_states, next_tokens, positions, *, n_valid=None):
        """:meth:`speculate`'s first half: the new rows into the context. Returns the cache, the
        anchor tokens [B] (the token after the last real row) and their positions [B] (+1)."""
        B, n = next_tokens.shape
        nv = jnp.full((B,), n, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
        cache = self.extend(cache, hidden_states, positions, nv)
        return cache, last_valid(next_tokens, nv), last_valid(positions, nv) + 1
