"""MTP draft (speculators ``MTPDraftModel``, 0.9.0): one verifier-family decoder layer under
``mtp_layers.0`` with hidden/token layernorms and ``input_proj``; full vocabulary.

Param tree::

    mtp_layers[0]: hidden_layernorm, token_layernorm, input_proj.kernel [2H, H], final_layernorm,
                   input_layernorm, self_attn.{q,k,v,o}_proj (+ q/k_norm), post_attention_layernorm, mlp
    embed_tokens.embedding [V, H]   lm_head.kernel [H, V]     (filled from the verifier)

Only the dense Qwen3 family is implemented (``transformer_layer_config.model_type == "qwen3"``);
the hybrid / MoE verifier families (qwen3_next, qwen3_5*) need gated and linear attention and
routed experts and are refused with :class:`DraftConfigError`.

Training forward (:meth:`MTPDraft.__call__`), teacher forced: ``K_eff = min(K, T-2)`` steps,
``Tv = T - K_eff - 1``; step k on rows t < Tv: ``p = input_proj(cat[token_layernorm(embed(
x_{t+1+k})), hidden_layernorm(h_t)])`` (``h`` = verifier hidden at k=0, else step k-1's
output), the decoder layer (causal, per document: a new document starts wherever the position
id does not increase by one, as HF's ``create_causal_mask`` infers), ``final_layernorm``,
``logits = lm_head(out)``. Positions are ``position_ids[:, :Tv]`` at every step.

Inference (``extend`` / ``step`` / ``propose`` over a :class:`DraftCache`): context row t holds
(token x_{t+1}, verifier hidden y_t, position pos(t)) exactly as training step 0; chain step
s feeds (drafted token, previous output) at ``pos + s`` against the context and its own
earlier chain rows (vLLM's recursive MTP drafting). Only step 0 is a position the training
forward also computes: its later steps attend to step-k states of earlier rows, which a
decoder never has.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import tpu as kt
from specjax.models.drafts.common import (
    DraftCache, attention, cache_mask, cache_range, init_vocab, mlp_block, take_rows,
)
from specjax.models.drafts.eagle3 import ChainOutput, ChainProposer
from specjax.models.drafts.spec import DecoderSpec, DraftConfigError
from specjax.models.drafts.verifier_weights import VerifierFill
from specjax.models.layers import DecoderLayer, RMSNorm, dense
from specjax.models.rope import rope_cos_sin

IGNORE_INDEX = -100


class MTPOutput(NamedTuple):
    logits: jax.Array  # [K, B, Tv, V]
    hidden: jax.Array  # [K, B, Tv, H] each step's output (fed to the next step)
    labels: jax.Array  # [K, B, Tv] input_ids[:, k+2 : k+2+Tv], IGNORE_INDEX where loss_mask == 0


class MTPLayer(DecoderLayer):
    def __init__(self, hidden_size, *args, **kw):
        super().__init__(hidden_size, *args, **kw)
        eps, pd = kw.get("norm_eps", 1e-6), kw.get("param_dtype", jnp.float32)
        self.hidden_layernorm = RMSNorm(hidden_size, eps, param_dtype=pd)
        self.token_layernorm = RMSNorm(hidden_size, eps, param_dtype=pd)
        self.input_proj = dense(2 * hidden_size, hidden_size, bias=False, rngs=kw["rngs"], param_dtype=pd)
        self.final_layernorm = RMSNorm(hidden_size, eps, param_dtype=pd)

    def project_in(self, embeds, hidden):
        return self.input_proj(jnp.concatenate([self.token_layernorm(embeds), self.hidden_layernorm(hidden)], -1))


def packed_causal_mask(position_ids, attention_mask=None):
    """HF ``create_causal_mask`` for a packed row without a cache: causal by index, and (no
    attention_mask) same sequence, a sequence starting wherever ``pos[i] - pos[i-1] != 1``;
    with ``attention_mask`` [B, T] it hides padded keys instead. -> bool [B, 1, T, T]."""
    B, T = position_ids.shape
    i = jnp.arange(T)
    m = jnp.broadcast_to(i[None, :] <= i[:, None], (B, T, T))
    if attention_mask is not None:
        m &= attention_mask.astype(bool)[:, None, :]
    else:
        diff = jnp.diff(position_ids, axis=-1, prepend=position_ids[:, :1] - 1)
        seq = jnp.cumsum(diff != 1, axis=-1)
        m &= seq[:, :, None] == seq[:, None, :]
    return m[:, None]


def packed_causal_spec(position_ids, attention_mask=None):
    """:func:`packed_causal_mask` as a :class:`~specjax.kernels.tpu.MaskSpec` (TPU programs):
    causal by index, with the sequences as segment ids, or ``attention_mask`` as valid keys."""
    if attention_mask is not None:
        return kt.causal(kv_valid=attention_mask)
    diff = jnp.diff(position_ids, axis=-1, prepend=position_ids[:, :1] - 1)
    return kt.causal(segment_ids=jnp.cumsum(diff != 1, axis=-1))


class MTPDraft(ChainProposer, nnx.Module):
    algorithm = "mtp"
    token_position_offset = 0  # a row's position is its hidden state's, pos(t)
    # the verifier's own embedding and head, over its full vocabulary; no verifier heads
    verifier_fill = VerifierFill(embed="always", lm_head="always", verifier_heads=False)
    vocab_reduction = False  # speculators 0.9.0: "Vocab reduction is not supported for MTP speculators"

    def tap_ids(self, num_target_layers: int) -> tuple[int, ...]:
        return (int(num_target_layers),)  # the final pre-norm state only

    def __init__(self, config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32):
        """``config``: bridge ``MTPConfig`` (``transformer_layer_config`` is the verifier's own)."""
        rngs = rngs or nnx.Rngs(0)
        tl = config.transformer_layer_config
        mt = tl.get("model_type")
        if mt != "qwen3":
            raise DraftConfigError(f"MTP heads of model_type {mt!r} are not implemented (only the dense 'qwen3' "
                                   "family; qwen3_next / qwen3_5 need gated+linear attention and MoE)",
                                   key="transformer_layer_config.model_type")
        spec = DecoderSpec.from_layer({**tl, "num_hidden_layers": 1, "layer_types": None, "use_sliding_window": False},
                                      qk_norm=True, mlp_bias=False)
        self.spec = spec
        self.speculative_tokens = int(config.speculative_tokens)
        init_vocab(self, spec, spec.vocab_size, rngs=rngs, param_dtype=param_dtype, verifier_heads=False)
        self.mtp_layers = nnx.List([spec.layer(0, rngs=rngs, param_dtype=param_dtype, cls=MTPLayer)])

    @property
    def layer(self) -> MTPLayer:
        return self.mtp_layers[0]

    def _run(self, embeds, hidden, cos, sin, mask, *, cache=None, slots=None, rows=None, ranges=None):
        """``rows`` int [B, m]: only these rows are queried and returned (``mask`` [B, 1, m, S]);
        every row's K/V is still written. ``ranges``: ``mask`` as ``cache_range`` (decoding)."""
        layer = self.layer
        p = layer.project_in(embeds, hidden)
        c = None if cache is None else (cache.k[0], cache.v[0])
        a, _, nc = attention(layer.self_attn, layer.input_layernorm(p), cos, sin, mask, cache=c, slots=slots,
                             query_rows=rows, ranges=ranges)
        if rows is not None:
            p = take_rows(p, rows)
        out = layer.final_layernorm(mlp_block(layer, p + a))
        return out, nc

    def __call__(self, input_ids, hidden_states, attention_mask=None, position_ids=None, loss_mask=None,
                 **_ignored) -> MTPOutput:
        """speculators ``MTPDraftModel.forward`` (after ``shift_batch_mtp``): input_ids [B, T],
        hidden_states = verifier last hidden states [B, T, H], position_ids [B, T] (default
        arange), loss_mask [B, T]. Extra batch keys (document_ids, ...) are ignored as there."""
        B, T = input_ids.shape
        K = min(self.speculative_tokens, max(0, T - 2))
        Tv = T - K - 1
        if Tv <= 0 or K == 0:
            raise DraftConfigError(f"a row of {T} tokens leaves no MTP step (num_speculative_steps "
                                   f"{self.speculative_tokens})", key="input_ids")
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(T), (B, T))
        pos = position_ids[:, :Tv]
        am = None if attention_mask is None else attention_mask[:, :Tv]
        mask = packed_causal_spec(pos, am) if kt.attention_impl() == "pallas" else packed_causal_mask(pos, am)
        cos, sin = rope_cos_sin(pos, self.spec.rope, dtype=hidden_states.dtype)
        cur = hidden_states
        logits, hidden, labels = [], [], []
        for k in range(K):
            e = self.embed_tokens(input_ids[:, k + 1:k + 1 + Tv])
            out, _ = self._run(e, cur[:, :Tv], cos, sin, mask)
            logits.append(self.lm_head(out))
            hidden.append(out)
            lab = input_ids[:, k + 2:k + 2 + Tv]
            if loss_mask is not None:
                lab = jnp.where(loss_mask[:, k + 2:k + 2 + Tv] == 0, IGNORE_INDEX, lab)
            labels.append(lab)
            cur = out
        return MTPOutput(jnp.stack(logits), jnp.stack(hidden), jnp.stack(labels))

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, lengths=None) -> DraftCache:
        return DraftCache.init(self.spec, batch, max_len, dtype, lengths, num_layers=1)

    def extend(self, cache: DraftCache, hidden_states, input_ids, positions, n_valid=None, *,
               rows=None) -> ChainOutput:
        """Context rows: verifier hidden y_t [B, n, H], the next token x_{t+1} [B, n], position pos(t).
        Returns every row's logits/output [B, n, *], or only ``rows`` (int [B, m]) [B, m, *]: the
        decode path, where attention queries, MLP and the full-vocabulary lm_head run on m rows."""
        B, n = input_ids.shape
        slots = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
        cos, sin = rope_cos_sin(positions, self.spec.rope, dtype=hidden_states.dtype)
        qslots = slots if rows is None else take_rows(slots, rows)
        mask = cache_mask(cache.max_len, qslots)
        out, nc = self._run(self.embed_tokens(input_ids), hidden_states, cos, sin, mask, cache=cache, slots=slots,
                            rows=rows, ranges=cache_range(qslots))
        adv = n if n_valid is None else n_valid
        return ChainOutput(self.lm_head(out), out, DraftCache((nc[0],), (nc[1],), cache.lengths + adv))

    def step(self, cache: DraftCache, tokens, hidden, positions, s) -> ChainOutput:
        base = (cache.lengths - 1)[:, None]
        lo = cache.lengths[:, None]
        slots = lo + (s - 1)
        cos, sin = rope_cos_sin(positions[:, None], self.spec.rope, dtype=hidden.dtype)
        mask = cache_mask(cache.max_len, base, lo=lo, hi=slots)
        out, nc = self._run(self.embed_tokens(tokens[:, None]), hidden[:, None], cos, sin, mask, cache=cache,
                            slots=slots, ranges=cache_range(base, hi=slots))
        return ChainOutput(self.lm_head(out)[:, 0], out[:, 0], cache._replace(k=(nc[0],), v=(nc[1],)))
