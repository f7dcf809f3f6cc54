"""EAGLE-3 draft (speculators ``Eagle3DraftModel``, 0.9.0).

Param tree (flat names through ``bridge.layout``)::

    fc.kernel [A*H, H]        input_norm.scale [A*H] (norm_before_fc)   fc_norm[i].scale [H] (fc_norm)
    layers[0]: input_layernorm, hidden_norm, self_attn.{q,k,v}_proj [2H, .], o_proj, (q/k_norm),
               post_attention_layernorm, mlp          layers[l>0]: standard Llama/Qwen3 layer
    norm.scale   embed_tokens.embedding [V, H]   lm_head.kernel [H, Vd]
    verifier_lm_head.kernel [H, Vd]   verifier_norm.scale [H]   t2d [V] / d2t [Vd] (pruned vocab)

Training forward (:meth:`Eagle3Draft.__call__`) = speculators' forward on one packed row
(after ``shift_batch``): step 0 ``h = fc(norm(aux))``; each TTT step s runs the layers on
``(embed(ids_s), h)`` with keys of steps 0..s (step-0 block: causal, same document, query
not padding, sliding ``kv > q - W``, plus the diagonal; steps >= 1: diagonal only); then
``logits = lm_head(norm(out))``; ``h`` for the next step is ``norm(out)`` with
``norm_output`` else ``out``; ids shift left by one with zero padding, positions + 1.

Inference (:meth:`extend`, :meth:`step`, :meth:`propose`) uses a :class:`DraftCache`
(one K/V per layer). A context row j holds (aux g_j, token x_{j+1}, position of x_{j+1}),
exactly a training row; a chain step s >= 1 from base row j feeds (proposed token, own
hidden) at position pos_j + s and sees context slots <= j (window measured from j, as in
training) plus its own earlier chain rows, which is the training step-s pattern for row j.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import tpu as kt
from specjax.models.drafts.common import (
    DraftCache, TargetTaps, attention, cache_mask, cache_range, d2t_of, greedy, init_vocab, last_rows, last_valid,
    mlp_block, take_rows, verifier_targets,
)
from specjax.models.drafts.spec import DecoderSpec
from specjax.models.drafts.vocab import draft_to_target
from specjax.models.layers import DecoderLayer, RMSNorm, dense
from specjax.models.rope import rope_cos_sin


class Eagle3Output(NamedTuple):
    logits: jax.Array  # [S, B, T, Vd] one slab per TTT step (full length; align with targets[:, s:])
    hidden: jax.Array  # [S, B, T, H] the hidden state each step feeds forward
    targets: jax.Array | None  # [B, T, Vd] verifier_lm_head(verifier_norm(y)) when y is given


class ChainOutput(NamedTuple):
    logits: jax.Array  # [B, n, Vd]
    hidden: jax.Array  # [B, n, H] the hidden state a next chain step consumes
    cache: DraftCache


class Proposal(NamedTuple):
    tokens: jax.Array  # [B, k] target-vocabulary ids
    draft_ids: jax.Array  # [B, k] draft-vocabulary ids
    logits: jax.Array  # [B, k, Vd]
    cache: DraftCache


class ChainProposer(TargetTaps):
    """``propose`` for drafts that chain one token at a time over a :class:`DraftCache`
    (EAGLE-3, MTP): needs ``extend(cache, hidden_states, input_ids, positions, n_valid, rows=)`` and
    ``step(cache, tokens, hidden, positions, s)``."""

    token_position_offset = 0  # RoPE position of a context row = row position + this
    tree_drafting = "chain"

    def speculate(self, cache: DraftCache, hidden_states, next_tokens, positions, *, n_valid=None,
                  k: int | None = None, sample: Callable = greedy, key=None) -> Proposal:
        """The decode-loop entry every draft shares. New target rows since the last call:
        ``hidden_states`` [B, n, *] (``aux_from_taps`` of the target's taps), ``next_tokens`` [B, n]
        (the token after each row: the next input token, the bonus token for the last row),
        ``positions`` [B, n] (the rows' own positions), ``n_valid`` [B] real rows (right
        padding). Drafts ``k`` tokens after the last real row. No rollback is ever needed: the
        cache only commits context rows; drafted rows are scratch."""
        return self.propose(cache, hidden_states, next_tokens, positions + self.token_position_offset, k=k,
                            n_valid=n_valid, sample=sample, key=key)

    def propose(self, cache: DraftCache, hidden_states, input_ids, positions, *, k: int | None = None, n_valid=None,
                sample: Callable = greedy, key=None, forced=None) -> Proposal:
        """Extend with the new context rows, then draft ``k`` (default ``speculative_tokens``) tokens
        from each sequence's last row.
        ``sample(logits [B, Vd], key) -> draft ids [B]`` (default greedy). ``forced`` [B, k-1]
        target ids replaces the sampled token fed to chain steps 1..k-1 (teacher forcing; tests)."""
        k = self.speculative_tokens if k is None else k
        B, n = input_ids.shape
        nv = jnp.full((B,), n, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
        # only the last real row's output feeds the chain: the other rows just write their K/V
        ext = self.extend(cache, hidden_states, input_ids, positions, nv, rows=last_rows(nv, n))
        logits0, h0 = ext.logits[:, 0], ext.hidden[:, 0]
        pos0 = last_valid(positions, nv)
        keys = jax.random.split(key if key is not None else jax.random.key(0), k)
        d2t = d2t_of(self)
        d0 = sample(logits0, keys[0])

        def body(carry, xs):
            c, tok, h = carry
            s, kk, f = xs
            tok = tok if forced is None else f
            o = self.step(c, tok, h, pos0 + s, s)
            d = sample(o.logits, kk)
            return (o.cache, draft_to_target(d, d2t), o.hidden), (d, o.logits)

        if k > 1:
            steps = jnp.arange(1, k, dtype=jnp.int32)
            fx = jnp.zeros((k - 1, B), jnp.int32) if forced is None else jnp.asarray(forced, jnp.int32).T
            (c, _, _), (ds, ls) = jax.lax.scan(body, (ext.cache, draft_to_target(d0, d2t), h0),
                                               (steps, keys[1:], fx))
            draft = jnp.concatenate([d0[:, None], ds.T], axis=1)
            logits = jnp.concatenate([logits0[:, None], jnp.moveaxis(ls, 0, 1)], axis=1)
        else:
            c, draft, logits = ext.cache, d0[:, None], logits0[:, None]
        return Proposal(draft_to_target(draft, d2t), draft, logits, c)


class Eagle3FirstLayer(DecoderLayer):
    """Decoder layer on ``cat([embeds, hidden])``: q/k/v from 2H, ``hidden_norm`` on the hidden half,
    residual = hidden (normed with ``norm_before_residual``)."""

    def __init__(self, hidden_size, *args, norm_before_residual: bool = False, **kw):
        super().__init__(hidden_size, *args, **kw)
        self.hidden_norm = RMSNorm(hidden_size, kw.get("norm_eps", 1e-6), param_dtype=kw.get("param_dtype", jnp.float32))
        self.norm_before_residual = bool(norm_before_residual)

    def attn_input(self, embeds, hidden):
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        return jnp.concatenate([e, h], axis=-1), residual


def ttt_mask(document_ids, window: int | None, steps_before: int):
    """[B, 1, T, (steps_before+1)*T] boolean mask of TTT step ``steps_before`` (speculators
    ``create_combined_mask_mod`` + ``extend_*_mask_for_draft_tokens``)."""
    T = document_ids.shape[-1]
    q = jnp.arange(T)[:, None]
    kv = jnp.arange(T)[None, :]
    doc = document_ids
    causal = kv <= q
    if window is not None:
        causal = causal & (kv > q - window)
    same = (doc[:, :, None] != -1) & (doc[:, :, None] == doc[:, None, :])
    eye = jnp.broadcast_to(q == kv, (doc.shape[0], T, T))
    m0 = (causal[None] & same) | eye
    return jnp.concatenate([m0] + [eye] * steps_before, axis=-1)[:, None]


class Eagle3Draft(ChainProposer, nnx.Module):
    algorithm = "eagle3"
    token_position_offset = 1  # a row's token is x_{j+1}; training positions are 1-based (shift_batch)

    def __init__(self, config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 verifier_norm_unit_offset: bool = False, verifier_heads: bool = True):
        """``config``: bridge ``Eagle3Config`` (or ``PEagleConfig``). ``verifier_heads=False`` leaves out
        ``verifier_lm_head`` / ``verifier_norm`` (only the training targets need them)."""
        rngs = rngs or nnx.Rngs(0)
        spec = DecoderSpec.eagle_family(config.transformer_layer_config)
        self.spec = spec
        H = spec.hidden
        self.num_aux = config.num_aux
        self.aux_layer_ids = tuple(config.aux_layer_ids) if config.aux_layer_ids else None
        self.norm_output = bool(config.norm_output)
        self.speculative_tokens = int(config.speculative_tokens)
        self.embed_requires_grad = bool(config.embed_requires_grad)
        init_vocab(self, spec, config.draft_vocab_size, rngs=rngs, param_dtype=param_dtype,
                   verifier_norm_unit_offset=verifier_norm_unit_offset, verifier_heads=verifier_heads)
        A = self.num_aux
        self.fc = dense(A * H, H, bias=False, rngs=rngs, param_dtype=param_dtype)
        self.input_norm = RMSNorm(A * H, spec.eps, param_dtype=param_dtype) if config.norm_before_fc else None
        self.fc_norm = (nnx.List([RMSNorm(H, spec.eps, param_dtype=param_dtype) for _ in range(A)])
                        if config.fc_norm else None)
        self.layers = nnx.List(
            [spec.layer(0, rngs=rngs, in_features=2 * H, param_dtype=param_dtype, cls=Eagle3FirstLayer,
                        norm_before_residual=config.norm_before_residual)]
            + [spec.layer(i, rngs=rngs, param_dtype=param_dtype) for i in range(1, spec.num_layers)])
        self.norm = RMSNorm(H, spec.eps, param_dtype=param_dtype)

    # ------------------------------------------------------------------ pieces
    def project_aux(self, aux):
        """aux [..., A*H] -> fc input norms -> fc -> [..., H]."""
        x = aux
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = jnp.split(x, len(self.fc_norm), axis=-1)
            x = jnp.concatenate([n(c) for n, c in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(x)

    def embed(self, ids):
        e = self.embed_tokens(ids)
        return e if self.embed_trainable and self.embed_requires_grad else jax.lax.stop_gradient(e)

    def head(self, out):
        """-> (logits [.., Vd], hidden fed forward)."""
        normed = self.norm(out)
        return self.lm_head(normed), (normed if self.norm_output else out)

    def targets(self, verifier_last_hidden_states):
        return verifier_targets(self, verifier_last_hidden_states)

    def _layers(self, e, h, cos, sin, masks, *, prefixes=None, cache=None, slots=None, zero_empty_rows=False,
                rows=None, ranges=None):
        """Run all layers. masks: per-layer masks. prefixes: per-layer lists of (k, v) (training).
        ``rows`` int [B, m]: the last layer queries (and returns) only these rows; earlier layers
        run every row, whose outputs the next layer's keys/values need (masks stay [.., n, S]).
        ``ranges``: per-layer ``cache_range`` of the masks (decoding on the native kernel).
        Returns (out, new per-layer (k, v), new cache k/v lists)."""
        new_kv, ks, vs = [], [], []
        x = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == 0:
                xin, res = layer.attn_input(e, h)
            else:
                xin, res = layer.input_layernorm(x), x
            qr = rows if i == last else None
            m = masks[i]
            r = None if ranges is None else ranges[i]
            if qr is not None:
                res = take_rows(res, qr)
                m = jnp.take_along_axis(m, qr[:, None, :, None], axis=2)
                r = None if r is None else tuple(take_rows(a, qr) for a in r)
            c = None if cache is None else (cache.k[i], cache.v[i])
            a, kv, nc = attention(layer.self_attn, xin, cos, sin, m,
                                  kv_prefix=None if prefixes is None else prefixes[i], cache=c, slots=slots,
                                  zero_empty_rows=zero_empty_rows, query_rows=qr, ranges=r)
            x = mlp_block(layer, res + a)
            new_kv.append(kv)
            if nc is not None:
                ks.append(nc[0])
                vs.append(nc[1])
        return x, new_kv, (ks, vs)

    # ------------------------------------------------------------------ training forward
    def __call__(self, hidden_states, input_ids, document_ids, loss_mask=None, position_ids=None,
                 verifier_last_hidden_states=None, *, ttt_steps: int = 3) -> Eagle3Output:
        """speculators ``Eagle3DraftModel.forward`` on a packed row (after ``shift_batch``).

        hidden_states [B, T, A*H]; input_ids, document_ids (-1 = padding), position_ids
        (default 1 + arange(T)) int [B, T]; loss_mask is accepted for signature parity (the
        loss belongs to the trainer). ``ttt_steps`` is static."""
        del loss_mask
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(1 + jnp.arange(T), (B, T))
        h = self.project_aux(hidden_states)
        ids0 = input_ids
        ids = input_ids
        pallas = kt.attention_impl() == "pallas"
        prefixes = [[] for _ in self.layers]
        all_logits, all_hidden = [], []
        for s in range(ttt_steps):
            e = self.embed(ids)
            cos, sin = rope_cos_sin(position_ids + s, self.spec.rope, dtype=h.dtype)
            # TPU programs: the flash kernel takes the mask as structure + segment ids, never [T, (s+1)T]
            mk = {w: (kt.ttt(document_ids, window=w, steps_before=s) if pallas else ttt_mask(document_ids, w, s))
                  for w in self.spec.distinct_windows}
            masks = [mk[w] for w in self.spec.windows]
            out, new_kv, _ = self._layers(e, h, cos, sin, masks, prefixes=prefixes)
            for i, kv in enumerate(new_kv):
                prefixes[i] = prefixes[i] + [kv]
            logits, h = self.head(out)
            all_logits.append(logits)
            all_hidden.append(h)
            ids = jnp.concatenate([ids0[:, 1 + s:], jnp.zeros((B, 1 + s), ids0.dtype)], axis=1)
        tg = None if verifier_last_hidden_states is None else self.targets(verifier_last_hidden_states)
        return Eagle3Output(jnp.stack(all_logits), jnp.stack(all_hidden), tg)

    # ------------------------------------------------------------------ inference
    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, lengths=None) -> DraftCache:
        return DraftCache.init(self.spec, batch, max_len, dtype, lengths)

    def extend(self, cache: DraftCache, hidden_states, input_ids, positions, n_valid=None, *,
               rows=None) -> ChainOutput:
        """Append n context rows per sequence (right-padded; ``n_valid`` [B] real rows, default n).
        Row j: aux ``hidden_states[:, j]`` [A*H], token ``input_ids[:, j]`` (the token after
        that aux state), RoPE position ``positions[:, j]``. Returns every row's logits/hidden
        [B, n, *], or with ``rows`` int [B, m] only those rows' [B, m, *] (the last layer's
        queries, final norm and lm_head run on m rows; every row's K/V is still cached)."""
        B, n = input_ids.shape
        slots = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
        h = self.project_aux(hidden_states)
        e = self.embed(input_ids)
        cos, sin = rope_cos_sin(positions, self.spec.rope, dtype=h.dtype)
        masks = [cache_mask(cache.max_len, slots, window=w) for w in self.spec.windows]
        ranges = [cache_range(slots, window=w) for w in self.spec.windows]
        out, _, (ks, vs) = self._layers(e, h, cos, sin, masks, cache=cache, slots=slots, rows=rows, ranges=ranges)
        logits, hid = self.head(out)
        adv = n if n_valid is None else n_valid
        return ChainOutput(logits, hid, DraftCache(tuple(ks), tuple(vs), cache.lengths + adv))

    def step(self, cache: DraftCache, tokens, hidden, positions, s) -> ChainOutput:
        """Chain step ``s`` >= 1 (int or traced) from the last context row: tokens [B] (target
        ids), hidden [B, H] (previous step's fed-forward hidden), positions [B] (base + s).
        Writes scratch slot ``lengths + s - 1``; ``lengths`` is unchanged."""
        base = (cache.lengths - 1)[:, None]
        lo = cache.lengths[:, None]
        slots = lo + (s - 1)
        e = self.embed(tokens[:, None])
        cos, sin = rope_cos_sin(positions[:, None], self.spec.rope, dtype=hidden.dtype)
        masks = [cache_mask(cache.max_len, base, window=w, lo=lo, hi=slots) for w in self.spec.windows]
        ranges = [cache_range(base, window=w, hi=slots) for w in self.spec.windows]
        out, _, (ks, vs) = self._layers(e, hidden[:, None], cos, sin, masks, cache=cache, slots=slots, ranges=ranges)
        logits, hid = self.head(out)
        return ChainOutput(logits[:, 0], hid[:, 0], cache._replace(k=tuple(ks), v=tuple(vs)))
