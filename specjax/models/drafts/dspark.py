"""DSpark draft (speculators ``DSparkDraftModel``, 0.9.0): the DFlash backbone plus a Markov
logit bias over the previous token and a per-slot confidence head.

Extra params::

    markov_head.markov_w1.embedding [V, r]   markov_head.markov_w2.kernel [r, Vd]
    markov_head.gate_proj.{kernel [H+r, r], bias}       (markov_head_type "gated")
    markov_head.joint_proj.{kernel [2r+H, 3r], bias}    ("rnn")
    confidence_head.proj.{kernel [H(+r), 1], bias [1]}

Per block, with ``prev`` the token before each slot's target (``sample_from_anchor``: ``prev[k] =
x_{a+k}``; else ``[x_a, x_a, x_{a+1}, ...]``) and ``e = w1(prev)``: vanilla ``bias = w2(e)``;
gated ``w2(sigmoid(gate_proj([h, e])) * e)``; rnn ``s = σ(g) s + (1-σ(g)) tanh(c)``,
``bias_k = w2(tanh(o))`` with ``(g, c, o) = chunk3(joint_proj([s, e_k, h_k]))``. Logits = backbone
logits + bias; confidence logit = ``proj([h, e])`` (or ``proj(h)``).

At inference the bias needs the token just drafted, so :meth:`DSparkDraft.propose` runs the
backbone block once and then the head slot by slot (``lax.scan``), feeding each sampled token.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.drafts.common import DraftCache, d2t_of, greedy
from specjax.models.drafts.dflash import BlockOutput, DFlashDraft, DFlashOutput
from specjax.models.drafts.spec import DraftConfigError
from specjax.models.drafts.vocab import draft_to_target
from specjax.models.layers import Embed, dense


class DSparkOutput(NamedTuple):
    logits: jax.Array  # [B, N*Bk, Vd] after the Markov bias
    hidden: jax.Array  # [B, N*Bk, H]
    confidence: jax.Array | None  # [B, N*Bk] confidence logits
    targets: jax.Array | None
    loss_mask: jax.Array | None
    block_indices: jax.Array
    backbone_logits: jax.Array  # [B, N*Bk, Vd] before the bias


class DSparkProposal(NamedTuple):
    tokens: jax.Array  # [B, k] target ids
    draft_ids: jax.Array  # [B, k]
    logits: jax.Array  # [B, k, Vd] (biased by the tokens drafted before each slot)
    confidence: jax.Array | None  # [B, k] confidence logits
    cache: DraftCache


class MarkovHead(nnx.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden: int, head_type: str, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        if head_type not in ("vanilla", "gated", "rnn"):
            raise DraftConfigError(f"markov_head_type {head_type!r}; expected vanilla, gated or rnn",
                                   key="markov_head_type")
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = Embed(vocab_size, rank, rngs=rngs, param_dtype=param_dtype,
                               embedding_init=nnx.initializers.normal(0.01))
        self.markov_w2 = dense(rank, draft_vocab_size, bias=False, rngs=rngs, param_dtype=param_dtype)
        self.gate_proj = dense(hidden + rank, rank, bias=True, rngs=rngs, param_dtype=param_dtype) \
            if head_type == "gated" else None
        self.joint_proj = dense(2 * rank + hidden, 3 * rank, bias=True, rngs=rngs, param_dtype=param_dtype) \
            if head_type == "rnn" else None

    def prev_embeddings(self, ids):
        return self.markov_w1(ids)

    def init_state(self, lead_shape, dtype):
        return jnp.zeros((*lead_shape, self.rank), dtype)

    def slot_bias(self, state, e, h):
        """One slot: e [..., r], h [..., H] -> (new state, bias [..., Vd]). state used by rnn only."""
        e = e.astype(self.markov_w2.kernel.dtype)
        if self.head_type == "vanilla":
            return state, self.markov_w2(e)
        h = h.astype(e.dtype)
        if self.head_type == "gated":
            return state, self.markov_w2(jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, e], -1))) * e)
        g, c, o = jnp.split(self.joint_proj(jnp.concatenate([state, e, h], -1)), 3, axis=-1)
        g = jax.nn.sigmoid(g)
        state = g * state + (1.0 - g) * jnp.tanh(c)
        return state, self.markov_w2(jnp.tanh(o))

    def block_bias(self, prev_emb, hidden):
        """prev_emb [..., Bk, r], hidden [..., Bk, H] -> bias [..., Bk, Vd]."""
        if self.head_type != "rnn":
            return self.slot_bias(None, prev_emb, hidden)[1]
        e = prev_emb.astype(self.markov_w2.kernel.dtype)
        state = self.init_state(e.shape[:-2], e.dtype)
        out = []
        for k in range(e.shape[-2]):  # block_size is small and static
            state, b = self.slot_bias(state, e[..., k, :], hidden[..., k, :])
            out.append(b)
        return jnp.stack(out, axis=-2)


class ConfidenceHead(nnx.Module):
    def __init__(self, in_features: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.proj = dense(in_features, 1, bias=True, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, features):
        return self.proj(features)[..., 0]


class DSparkDraft(DFlashDraft):
    algorithm = "dspark"

    @property
    def tree_drafting(self) -> str:
        # the Markov head conditions each slot on the token before it (DFlash's block without it)
        return "markov" if self.markov_head is not None else "parallel"

    def __init__(self, config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 verifier_norm_unit_offset: bool = False, verifier_heads: bool = True):
        rngs = rngs or nnx.Rngs(0)
        super().__init__(config, rngs=rngs, param_dtype=param_dtype, verifier_norm_unit_offset=verifier_norm_unit_offset,
                         verifier_heads=verifier_heads)
        H = self.spec.hidden
        r = int(config.markov_rank)
        self.markov_head = MarkovHead(self.vocab_size, self.draft_vocab_size, r, H, config.markov_head_type,
                                      rngs=rngs, param_dtype=param_dtype) if r > 0 else None
        self.confidence_with_markov = bool(config.confidence_head_with_markov)
        if config.enable_confidence_head:
            if self.confidence_with_markov and self.markov_head is None:
                raise DraftConfigError("confidence_head_with_markov=True requires markov_rank > 0",
                                       key="confidence_head_with_markov")
            self.confidence_head = ConfidenceHead(H + (r if self.confidence_with_markov else 0), rngs=rngs,
                                                  param_dtype=param_dtype)
        else:
            self.confidence_head = None

    def _confidence(self, hidden, prev_emb):
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.confidence_with_markov and prev_emb is not None:
            feats = jnp.concatenate([hidden, prev_emb.astype(hidden.dtype)], axis=-1)
        return self.confidence_head(feats)

    def __call__(self, hidden_states, input_ids, loss_mask, verifier_last_hidden_states, document_ids,
                 position_ids=None, *, anchor_positions, anchor_valid=None) -> DSparkOutput:
        """speculators ``DSparkDraftModel.forward`` up to the loss (anchors given, as DFlash)."""
        base: DFlashOutput = super().__call__(hidden_states, input_ids, loss_mask, verifier_last_hidden_states,
                                              document_ids, position_ids, anchor_positions=anchor_positions,
                                              anchor_valid=anchor_valid)
        B, Q = base.block_indices.shape
        Bk = self.block_size
        N = Q // Bk
        bt = jnp.take_along_axis(input_ids, base.block_indices, axis=1).reshape(B, N, Bk)
        prev = bt if self.sample_from_anchor else jnp.concatenate([bt[..., :1], bt[..., :-1]], axis=-1)
        hb = base.hidden.reshape(B, N, Bk, -1)
        logits = base.logits
        prev_emb = None
        if self.markov_head is not None:
            prev_emb = self.markov_head.prev_embeddings(prev)
            logits = (logits.reshape(B, N, Bk, -1) + self.markov_head.block_bias(prev_emb, hb)).reshape(B, Q, -1)
        conf = self._confidence(hb, prev_emb)
        return DSparkOutput(logits, base.hidden, None if conf is None else conf.reshape(B, Q), base.targets,
                            base.loss_mask, base.block_indices, base.logits)

    def propose(self, cache: DraftCache, anchor_tokens, anchor_positions, *, sample: Callable = greedy,
                key=None, forced=None, k: int | None = None) -> DSparkProposal:
        """One backbone block, then the Markov head slot by slot with the tokens just drafted.
        ``forced`` [B, k] target ids: feed these instead of the sampled tokens (tests). ``k``
        (default: the whole block): draft only the first k tokens -- the lm_head and the head's
        scan stop there (a shorter proposal is a prefix of the full one)."""
        hidden = self.block_hidden(cache, anchor_tokens, anchor_positions)
        first = 0 if self.sample_from_anchor else 1
        k = self.num_block_tokens(k)
        keys = jax.random.split(key if key is not None else jax.random.key(0), hidden.shape[1])[:first + k]
        hidden = hidden[:, :first + k]
        out = BlockOutput(self.lm_head(hidden), hidden)
        B, Bk = out.logits.shape[:2]
        d2t = d2t_of(self)
        mh = self.markov_head
        fx = jnp.zeros((Bk, B), jnp.int32)
        if forced is not None:
            fx = fx.at[first:].set(jnp.asarray(forced, jnp.int32).T[:k])
        state0 = mh.init_state((B,), out.hidden.dtype) if mh is not None and mh.head_type == "rnn" else jnp.zeros((B, 1))

        def body(carry, xs):
            state, prev = carry
            lg, h, kk, f, slot = xs
            emb = None
            if mh is not None:
                emb = mh.prev_embeddings(prev)
                state, bias = mh.slot_bias(state, emb, h)
                lg = lg + bias
            conf = self._confidence(h, emb)
            d = sample(lg, kk)
            nxt = draft_to_target(d, d2t) if forced is None else f
            prev = jnp.where(slot >= first, nxt, prev)
            return (state, prev), (d, lg, jnp.zeros((B,)) if conf is None else conf)

        xs = (jnp.moveaxis(out.logits, 1, 0), jnp.moveaxis(out.hidden, 1, 0), keys, fx, jnp.arange(Bk))
        _, (ds, ls, cs) = jax.lax.scan(body, (state0, anchor_tokens.astype(jnp.int32)), xs)
        draft = ds.T[:, first:]
        logits = jnp.moveaxis(ls, 0, 1)[:, first:]
        conf = None if self.confidence_head is None else cs.T[:, first:]
        return DSparkProposal(draft_to_target(draft, d2t), draft, logits, conf, cache)
