"""A draft built from the target itself: its first ``m`` decoder layers, final norm and lm_head
(layer-skip self-speculation). With ``m = num_hidden_layers`` it proposes exactly what the
target would (the "oracle" draft: acceptance 1 under greedy decoding, up to float rounding),
which exercises the loop before a trained draft exists; smaller ``m`` is cheaper and accepts
less. It shares the target's parameters (no copy) and implements the shared draft decode
entry of :mod:`specjax.models.drafts` (``tap_ids``, ``aux_from_taps``, ``init_cache``,
``speculate``), so the speculative loop treats it like any speculators draft.

Hand-off: it taps the target's id 0 (the embedding of each row's own token), so the committed
rows ``[B, n, H]`` are exactly the embeddings of the tokens now in the target cache; it runs its
``m`` layers over them (writing their K/V at slot = position) and then chains ``k`` single-token
steps from the last row's next token. Like the target cache, its cache needs no rollback: slots
past the committed rows are overwritten before any query can see them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.drafts.common import greedy, last_valid
from specjax.models.drafts.eagle3 import Proposal
from specjax.models.layers import attend_cache, causal_mask, write_cache
from specjax.models.rope import apply_rope, rope_cos_sin
from specjax.models.target import CausalLM, KVCache


class SelfDraft(nnx.Module):
    algorithm = "self"
    d2t = None
    t2d = None

    def __init__(self, target: CausalLM, num_layers: int | None = None, speculative_tokens: int = 3):
        n = target.config.num_hidden_layers
        m = n if num_layers is None else int(num_layers)
        if not 1 <= m <= n:
            raise ValueError(f"a self draft uses 1..{n} of the target's {n} layers; got {m}")
        self.num_layers = m
        self.config = target.config.replace(num_hidden_layers=m)
        self.embed_tokens = target.model.embed_tokens
        self.layers = nnx.List(list(target.model.layers)[:m])
        self.norm = target.model.norm
        self.lm_head = target.lm_head
        self.speculative_tokens = int(speculative_tokens)
        self.vocab_size = self.draft_vocab_size = target.config.vocab_size

    # ---------------------------------------------------------------- draft protocol
    def tap_ids(self, num_target_layers: int) -> tuple[int, ...]:  # noqa: ARG002
        return (0,)

    def aux_from_taps(self, taps):
        return tuple(taps)[0]

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, lengths=None) -> KVCache:
        return KVCache.init(self.config, batch, max_len, dtype, lengths)

    def head(self, h):
        h = self.norm(h)
        return self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)

    def forward(self, x, positions, cache: KVCache):
        """x [B, T, H] input embeddings at ``positions`` [B, T]; writes K/V at slot = position."""
        cos, sin = rope_cos_sin(positions, self.config.rope, dtype=x.dtype)
        kv_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
        masks, ks, vs = {}, [], []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            K, V = write_cache(cache.k[i], positions, k), write_cache(cache.v[i], positions, v)
            ks.append(K)
            vs.append(V)
            w = layer.sliding_window
            if w not in masks:
                masks[w] = causal_mask(positions, kv_pos, sliding_window=w)
            o = attend_cache(q, K, V, masks[w], scale=attn.scaling)
            x = x + attn.output(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, cache._replace(k=tuple(ks), v=tuple(vs))

    def speculate(self, cache: KVCache, hidden_states, next_tokens, positions, *, n_valid=None, k: int | None = None,
                  sample: Callable = greedy, key=None, forced=None) -> Proposal:
        """hidden_states [B, n, H]: embeddings of the committed rows' tokens (tap 0) at ``positions``
        [B, n]; next_tokens [B, n] the token after each row; ``n_valid`` [B] real rows. ``forced``
        int [B, k-1]: the tokens fed to chain steps 1..k-1 instead of the drafted ones (teacher
        forcing: token-tree drafting, :mod:`specjax.decode.tree_loop`)."""
        k = self.speculative_tokens if k is None else int(k)
        B, n = next_tokens.shape
        nv = jnp.full((B,), n, jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
        _, cache = self.forward(hidden_states.astype(self.embed_tokens.embedding[...].dtype), positions, cache)
        tok0 = last_valid(next_tokens, nv).astype(jnp.int32)
        pos0 = last_valid(positions, nv) + 1
        cache = cache.rollback(pos0)
        keys = jax.random.split(key if key is not None else jax.random.key(0), k)

        fx = jnp.zeros((k, B), jnp.int32)
        if forced is not None:
            fx = fx.at[1:].set(jnp.asarray(forced, jnp.int32).reshape(B, k - 1).T)

        def body(carry, xs):
            c, tok = carry
            s, kk, f = xs
            if forced is not None:
                tok = jnp.where(s > 0, f, tok)
            h, c = self.forward(self.embed_tokens(tok[:, None]), (pos0 + s)[:, None], c)
            logits = self.head(h[:, 0])
            d = sample(logits, kk)
            return (c, d), (d, logits)

        (cache, _), (ds, ls) = jax.lax.scan(body, (cache, tok0), (jnp.arange(k, dtype=jnp.int32), keys, fx))
        draft = ds.T
        return Proposal(draft, draft, jnp.moveaxis(ls, 0, 1), cache)

    def propose(self, cache: KVCache, hidden_states, next_tokens, positions, *, k: int | None = None, n_valid=None,
                sample: Callable = greedy, key=None, forced=None) -> Proposal:
        """:meth:`speculate` (the chain drafts' teacher-forced entry, for token trees)."""
        return self.speculate(cache, hidden_states, next_tokens, positions, n_valid=n_valid, k=k, sample=sample,
                              key=key, forced=forced)
