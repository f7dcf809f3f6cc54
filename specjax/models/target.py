"""Target LMs (HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``) as Flax nnx modules, with a
preallocated KV cache and auxiliary hidden-state taps.

Param tree (HF names through ``bridge.layout`` table ``hf_lm``)::

    model.embed_tokens.embedding                [vocab, hidden]
    model.layers[i].input_layernorm.scale       [hidden]
    model.layers[i].self_attn.{q,k,v,o}_proj.kernel (+ .bias)
    model.layers[i].self_attn.{q,k}_norm.scale  [head_dim]        (Qwen3)
    model.layers[i].post_attention_layernorm.scale
    model.layers[i].mlp.{gate,up,down}_proj.kernel
    model.norm.scale
    lm_head.kernel                              [hidden, vocab]   (absent when tied)

KV cache (:class:`KVCache`, a pytree NamedTuple)::

    k, v     tuple of num_hidden_layers arrays [batch, num_kv_heads, max_len, head_dim]
             (heads-major: attention reads it as it lies, see ``layers.attend_cache``;
             post-rope keys; post-k_norm for Qwen3)
    lengths  int32 [batch]: tokens of each sequence that are valid in the cache

Slot j of sequence b holds the token at position j (slot == position). A forward over the
cache writes its T new tokens at their positions (default ``lengths[b] + arange(T)``; slots past
``max_len`` are dropped) and lets query t see every slot j with ``j <= pos[b, t]`` (and ``j >
pos[b, t] - W`` on sliding-window layers). Hence:

* several tokens per step (verify k+1 drafted tokens at once) is just T = k+1;
* rolling back rejected tokens is ``cache.rollback(new_lengths)`` (only ``lengths`` changes):
  stale slots past a sequence's length sit at positions larger than any later query's
  position until they are overwritten, so they are never attended;
* ragged prompts are right-padded: the padding writes garbage past each length, which the
  next step overwrites before anyone can see it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import tpu as kt
from specjax.models.config import TargetConfig
from specjax.models.errors import ContextLengthError, TapIdError, UnknownArchitectureError
from specjax.models.layer_scan import StackedLayers, layer_runs, log_layer_scan, scan_run, scan_stacked, use_layer_scan
from specjax.models import panels
from specjax.models.layers import (INIT_STD, DecoderLayer, Embed, RMSNorm, attend, attend_cache, causal_mask, dense,
                                   tree_cache_mask, write_cache, write_packed)
from specjax.models.rope import apply_rope, rope_cos_sin


class KVCache(NamedTuple):
    # num_layers x [batch, kv_heads, max_len, head_dim]; or, stacked (the decode layer scan,
    # :func:`decode_layer_scan`), one [num_layers, batch, kv_heads, max_len, head_dim] array each
    k: tuple | jax.Array
    v: tuple | jax.Array
    lengths: jax.Array  # int32 [batch]
    heads_axis = 1  # (class constant, not a field) where kv_heads lies in a layer's k/v; DraftCache has 2

    @classmethod
    def init(cls, config: TargetConfig, batch: int, max_len: int, dtype=jnp.float32, lengths=None,
             stacked: bool = False) -> "KVCache":
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
        L = config.num_hidden_layers
        ln = jnp.zeros((batch,), jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        if stacked:
            return cls(jnp.zeros((L,) + shape, dtype), jnp.zeros((L,) + shape, dtype), ln)
        z = tuple(jnp.zeros(shape, dtype) for _ in range(L))
        zv = tuple(jnp.zeros(shape, dtype) for _ in range(L))
        return cls(z, zv, ln)

    @property
    def stacked(self) -> bool:
        """k / v are one array each, layers on the leading axis (not a tuple of layers)."""
        return not isinstance(self.k, (tuple, list))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[-2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[-4]

    def rollback(self, lengths) -> "KVCache":
        """Keep only the first ``lengths[b]`` tokens of each sequence (no data moves)."""
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))


class TargetOutput(NamedTuple):
    logits: jax.Array | None  # [B, T, V] (or [B, V] / [B, K, V] with logits_at)
    cache: KVCache | None
    aux_hidden_states: tuple  # one [B, T, hidden] per requested tap id, in tap_ids order


def check_tap_ids(tap_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in tap_ids)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise TapIdError(f"tap ids {bad} are outside [0, {num_layers}] (num_hidden_layers = {num_layers}; id k < n is "
                         f"the residual entering layer k, id n the final pre-norm state)", key="tap_ids")
    return ids


class Backbone(nnx.Module):
    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None):
        c = config
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, rngs=rngs, param_dtype=param_dtype, dtype=dtype,
                                  embedding_init=nnx.initializers.normal(INIT_STD))
        self.layers = nnx.List([
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         rngs=rngs, norm_eps=c.rms_norm_eps, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
                         qk_norm=c.qk_norm, sliding_window=c.layer_window(i), param_dtype=param_dtype, dtype=dtype)
            for i in range(c.num_hidden_layers)
        ])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)


class CausalLM(nnx.Module):
    """Decoder-only target LM (Llama / Qwen3 families).

    ``__call__(input_ids, *, positions=None, cache=None, attention_mask=None, tap_ids=(),
    logits_at=None, return_logits=True) -> TargetOutput`` is the one forward for prefill and
    decode; see the module docstring for the cache contract.
    """

    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None):
        self.config = config
        self.model = Backbone(config, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = dense(config.hidden_size, config.vocab_size, bias=False, rngs=rngs,
                                 param_dtype=param_dtype, dtype=dtype)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def head(self, h):
        """Final norm + lm_head over pre-norm hidden states ``[..., hidden]`` -> logits ``[..., vocab]``."""
        w = self.model.embed_tokens.embedding if self.lm_head is None else self.lm_head.kernel
        h = norm_rows(self.model.norm, h, panels.rows_fit(w.get_value(), h))
        if self.lm_head is None:
            return self.model.embed_tokens.attend(h)
        return self.lm_head(h)

    def __call__(self, input_ids, *, positions=None, cache: KVCache | None = None, attention_mask=None,
                 tap_ids: Sequence[int] = (), logits_at=None, return_logits: bool = True,
                 segments=None, tree_mask=None) -> TargetOutput:
        """One forward.

        input_ids int [B, T]. positions int [B, T]: default ``arange(T)`` without a cache,
        ``cache.lengths[:, None] + arange(T)`` with one.

        Without a cache: causal attention by index within the T tokens; ``attention_mask``
        [B, T] (1 = real token) hides padded keys, as in HF. With a cache: new K/V are written at
        slot = position and queries see slots ``<= position``; ``attention_mask`` only sets how
        far ``lengths`` advance (default +T; with a mask, + its row sums).

        tap_ids (static): hidden states to return, id k < n = residual stream entering layer k
        (HF ``hidden_states[k]``), id n = final hidden state before the final norm.
        logits_at: None for logits at every position, or int [B] / [B, K] indices into T.

        segments int [T] (with a cache and one packed row, ``input_ids`` [1, T]): a packed
        prefill. Token t belongs to sequence ``segments[t]`` of the cache (``>= cache.batch``:
        padding, dropped) at position ``positions[0, t]``; it attends to the earlier tokens of its own sequence in
        the row (not to the cache) and its K/V go to that sequence's cache row. ``lengths``
        advance by each sequence's token count; ``logits_at`` int [B'] indexes the row (logits
        [B', V]). Equal to a right-padded prefill of the sequences without the padding's work.
        Without a cache, ``segments`` int [B, T] packs several sequences per row (training's
        online target): token t attends to the earlier tokens of its own segment only, at
        ``positions`` (give each sequence's own, from 0); each sequence's tokens are contiguous.

        tree_mask bool [T, T] or [B, T, T] (with a cache): a token-tree verify
        (:mod:`specjax.decode.tree`). The T tokens are written at slots ``lengths + arange(T)``
        (not at their positions); ``positions`` default to ``lengths + depth`` with depth =
        ``tree_mask`` row sum - 1; token t attends to the committed slots and to the tree tokens
        j with ``tree_mask[t, j]`` (itself and its ancestors). ``lengths`` advance by T; keep the
        accepted path with :func:`specjax.decode.tree.compact_cache`.
        """
        cfg = self.config
        n = cfg.num_hidden_layers
        taps = check_tap_ids(tap_ids, n)
        tree_mask, positions = _tree_and_positions(input_ids, positions, cache, segments, tree_mask)
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(positions, cfg.rope, dtype=x.dtype)
        mode = _Mode.of(input_ids, positions, cache, attention_mask, segments, tree_mask)
        aux = {}
        new_k, new_v = [], []
        if cache is not None and cache.stacked:
            x, new_k, new_v = _scan_layers(self.model.layers, x, cos, sin, mode, taps, aux, cache.k, cache.v)
        elif cache is None and n > 1 and use_layer_scan(self.model.layers, x):
            x = _scan_layers(self.model.layers, x, cos, sin, mode, taps, aux)
        else:
            for i, layer in enumerate(self.model.layers):
                if i in taps:
                    aux[i] = x
                ck, cv = (None, None) if cache is None else (cache.k[i], cache.v[i])
                x, k, v = _layer_step(layer, x, cos, sin, mode, ck, cv)
                if cache is not None:
                    new_k.append(k)
                    new_v.append(v)
        if n in taps:
            aux[n] = x
        logits = self.head(mode.rows(x, logits_at)) if return_logits else None
        new_cache = None if cache is None else mode.advance(new_k, new_v)
        return TargetOutput(logits, new_cache, tuple(aux[i] for i in taps))



def norm_rows(norm, x, on_kernels: bool):
    """``norm(x)``, its rows normalised on the CPU kernel where ``on_kernels``
    (:func:`specjax.models.panels.rows_fit`): summed in one order whatever the number of rows."""
    if on_kernels and isinstance(norm, RMSNorm):
        return norm.scaled(x, panels.rms_normed(x, norm.eps))
    return norm(x)


def _layer_step(layer, x, cos, sin, mode, ck, cv, l=None):
    """One decoder layer of a target forward -> (x, K, V) (K/V as the cache now holds them when
    ``ck``/``cv``, the layer's cache, are given; with ``l``, the int32 layer index, ``ck``/``cv``
    are the whole stacked cache and come back with layer ``l`` written)."""
    attn = layer.self_attn
    rows = panels.rows_fit(attn.q_proj.kernel.get_value(), x)  # a decode loop's forward on the CPU kernels
    q, k, v = attn.project(norm_rows(layer.input_layernorm, x, rows))
    if rows and q.dtype == k.dtype == cos.dtype == jnp.float32:  # rounded alike whatever the program's shapes
        q, k = panels.rope(q, k, cos, sin)
    else:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, k, v = mode.attend(attn, q, k, v, layer.sliding_window, ck, cv, layer=l)
    x = x + attn.output(o)
    return x + layer.mlp(norm_rows(layer.post_attention_layernorm, x, rows)), k, v


def _scan_layers(layers, x, cos, sin, mode, taps, aux, K=None, V=None):
    """The layers of a forward, each :func:`layer_runs` run of two or more under one ``lax.scan``
    (:func:`scan_run`), tapped states recorded into ``aux`` at run starts. Without a cache the carry
    is ``x``; over a stacked cache (``K``/``V`` [L, B, Hkv, S, D]) it is ``(x, K, V)``, each layer
    writing its rows into its slice in place. Same math as the unrolled loop, per layer. Returns
    ``x``, or ``(x, K, V)``."""
    stored = isinstance(layers, StackedLayers)
    runs = layers.runs if stored else layer_runs(len(layers), taps, [layer.sliding_window for layer in layers])
    log_layer_scan(runs)
    stacked_cache = K is not None

    def step(layer, c, i):
        if not stacked_cache:
            return _layer_step(layer, c, cos, sin, mode, None, None)[0]
        return _layer_step(layer, c[0], cos, sin, mode, c[1], c[2], i)

    carry = (x, K, V) if stacked_cache else x
    if stored:  # the layers held stacked (stack_layers): each stored run scanned as it lies
        if not mode.pallas:
            for w in set(layers.windows):
                mode.mask(w)  # built once, outside the scans
        carry, got = scan_stacked(layers, carry, step, taps, (lambda c: c[0]) if stacked_cache else (lambda c: c),
                                  cut_at_taps=not stacked_cache)
        aux.update(got)
        return carry
    for a, b in runs:
        if a in taps:
            aux[a] = carry[0] if stacked_cache else carry
        if not mode.pallas:
            mode.mask(layers[a].sliding_window)  # built once, outside the scan body
        carry = scan_run(layers, a, b, carry, step, indexed=True)
    return carry


def _tree_and_positions(input_ids, positions, cache, segments, tree_mask):
    """A tree verify's mask (checked) and every forward's int32 positions: given, else a tree's
    ``lengths + depth``, a cache's ``lengths + arange(T)``, or ``arange(T)``."""
    B, T = input_ids.shape
    ar = jnp.arange(T, dtype=jnp.int32)
    if tree_mask is not None:
        if cache is None or segments is not None:
            raise ValueError("a tree verify (tree_mask) needs a KV cache and no packed segments")
        tree_mask = jnp.asarray(tree_mask, bool)
        if tree_mask.shape[-2:] != (T, T):
            raise ValueError(f"tree_mask {tree_mask.shape} does not fit {T} input tokens: expected [{T}, {T}] "
                             f"or [{B}, {T}, {T}]")
        if positions is None:
            depth = jnp.broadcast_to(tree_mask.sum(-1).astype(jnp.int32) - 1, (B, T))
            positions = cache.lengths[:, None] + depth
    if positions is None:
        positions = (cache.lengths[:, None] + ar[None]) if cache is not None else jnp.broadcast_to(ar, (B, T))
    return tree_mask, positions.astype(jnp.int32)


class _Mode:
    """How one forward's layers attend and write the KV cache, decided once per forward: no cache
    (causal within the T tokens), a cache (prefill, decode, chain verify), a packed prefill (one
    row of several sequences, ``segments``) or a tree verify (``tree_mask``); and, in each, which
    kernel runs: Pallas in TPU programs, the native CPU kernels where they fit, else XLA's
    masked attention (the reference)."""

    def __init__(self, kind: str, *, positions, cache, attention_mask, q_pos, kv_pos, kv_valid=None, seg=None,
                 same=None, tree_mask=None, slots=None):
        self.kind, self.positions, self.cache, self.attention_mask = kind, positions, cache, attention_mask
        self.q_pos, self.kv_pos, self.kv_valid, self.seg, self.same = q_pos, kv_pos, kv_valid, seg, same
        self.tree_mask, self.slots = tree_mask, slots
        self.pallas = kt.attention_impl() == "pallas"  # no [T, S] mask is built on the Pallas path
        self.masks: dict = {}

    @classmethod
    def of(cls, input_ids, positions, cache, attention_mask, segments, tree_mask) -> "_Mode":
        B, T = input_ids.shape
        ar = jnp.arange(T, dtype=jnp.int32)
        kw = dict(positions=positions, cache=cache, attention_mask=attention_mask)
        if segments is not None and cache is None:  # packed rows without a cache (training's online target)
            seg = jnp.asarray(segments, jnp.int32)
            if seg.shape != (B, T):
                raise ValueError(f"segments {seg.shape} do not fit input_ids {input_ids.shape}: without a cache they "
                                 f"are int [B, T], one sequence id per token")
            if attention_mask is not None:
                raise ValueError("give segments or attention_mask, not both (padding is a segment of its own)")
            return cls("plain", q_pos=jnp.broadcast_to(ar, (B, T)), kv_pos=ar, seg=seg,
                       same=seg[:, :, None] == seg[:, None, :], **kw)
        if segments is not None:
            if B != 1:
                raise ValueError(f"a packed prefill (segments [T]) takes one row and a cache, got input_ids "
                                 f"{input_ids.shape}; without a cache, segments are [B, T]")
            seg = jnp.asarray(segments, jnp.int32)
            same = (seg[:, None] == seg[None, :]) & (seg[None, :] < cache.batch)
            return cls("packed", q_pos=positions, kv_pos=positions[0], seg=seg, same=same, **kw)
        if cache is not None:
            S = cache.max_len
            if T > S:
                raise ContextLengthError(f"{T} new tokens do not fit a KV cache of max_len {S}", key="input_ids")
            tree = tree_mask is not None
            slots = cache.lengths[:, None] + ar[None] if tree else positions  # where the new K/V rows go
            return cls("tree" if tree else "cache", q_pos=positions, kv_pos=jnp.arange(S, dtype=jnp.int32),
                       tree_mask=tree_mask, slots=slots, **kw)
        kv_valid = None if attention_mask is None else attention_mask.astype(bool)
        return cls("plain", q_pos=jnp.broadcast_to(ar, (B, T)), kv_pos=ar, kv_valid=kv_valid, **kw)

    def mask(self, w):
        """The XLA path's boolean mask for sliding window ``w`` (built once per window)."""
        if w not in self.masks and self.kind == "tree":
            self.masks[w] = tree_cache_mask(self.q_pos, self.cache.lengths, self.tree_mask, self.cache.max_len,
                                            sliding_window=w)
        if w not in self.masks:
            self.masks[w] = causal_mask(self.q_pos, self.kv_pos, sliding_window=w, kv_valid=self.kv_valid)
            if self.kind == "packed":
                self.masks[w] = self.masks[w] & self.same[None, None]
            elif self.seg is not None:  # packed rows without a cache: [B, T, T]
                self.masks[w] = self.masks[w] & self.same[:, None]
        return self.masks[w]

    def attend(self, attn, q, k, v, w, ck=None, cv=None, layer=None):
        """One layer's attention output, and its K/V as the cache now holds them (with a cache:
        ``ck``/``cv`` are that layer's cache arrays before this forward; with ``layer``, the int32
        index of a stacked cache [L, B, Hkv, S, D], the whole stacked arrays, returned with that
        layer's rows written in place)."""
        if self.kind == "packed":
            seg = self.seg
            nk = write_packed(ck, seg, self.kv_pos, k[0], layer=layer)
            nv = write_packed(cv, seg, self.kv_pos, v[0], layer=layer)
            if self.pallas:  # exact: a sequence's tokens are contiguous in the row, at consecutive positions
                return kt.tpu_attention(q, k, v, mask_spec=kt.causal(window=w, segment_ids=seg[None]),
                                        scale=attn.scaling), nk, nv
            return attend(q, k, v, self.mask(w), scale=attn.scaling), nk, nv
        if self.kind in ("cache", "tree"):
            nk, nv = write_cache(ck, self.slots, k, layer=layer), write_cache(cv, self.slots, v, layer=layer)
            return self._attend_cache(attn, ck, cv, q, k, v, nk, nv, w, layer), nk, nv
        if self.pallas:  # packed rows: a sequence's tokens are contiguous, so causal within a segment is exact
            spec = kt.causal(window=w, segment_ids=self.seg) if self.seg is not None else \
                kt.causal(window=w, kv_valid=self.kv_valid)
            return kt.tpu_attention(q, k, v, mask_spec=spec, scale=attn.scaling), k, v
        return attend(q, k, v, self.mask(w), scale=attn.scaling), k, v

    def _attend_cache(self, attn, ck, cv, q, rows_k, rows_v, k, v, w, layer=None):
        """One layer's attention over the cache: the kernel that fits. ``ck``/``cv``: the layer's
        cache before this forward; ``rows_k``/``rows_v``: this forward's own K/V rows; ``k``, ``v``:
        the cache with them written. ``layer``: ``k``/``v`` (and ``ck``/``cv``) are a stacked cache
        [L, B, Hkv, S, D] and layer ``layer`` is attended; the Pallas decode kernel reads that
        layer's visible blocks by the prefetched index (its operand is the whole stack, which the
        compiler neither copies nor reads beyond the blocks the index maps name; ``plan`` charges
        the kernel its declared bytes, the layer's slots)."""
        T = q.shape[1]
        if self.kind == "tree":
            if self.pallas:
                # the committed blocks of the cache as it was (the write does not touch them) on the kernel,
                # the tree's own rows beside (rounded to the cache's dtype, as the cache holds them): the
                # attention does not wait on the cache update
                return kt.tree_cache_attention(q, ck, cv, rows_k.astype(ck.dtype), rows_v.astype(cv.dtype),
                                               self.cache.lengths, self.positions, self.tree_mask, window=w,
                                               scale=attn.scaling, layer=layer)
            if layer is not None:
                k, v = k[layer], v[layer]
            if panels.attention_fits(attn.q_proj, q, k) and panels.tree_fits(w, T):
                return panels.tree_attention(q, k, v, self.positions, self.cache.lengths, self.tree_mask, window=w,
                                             scale=attn.scaling)
            return attend_cache(q, k, v, self.mask(w), scale=attn.scaling)
        if self.pallas:  # reads only the cache blocks at or before each query's position
            return kt.cache_attention(q, k, v, *kt.position_ranges(self.positions, w), scale=attn.scaling,
                                      layer=layer)
        if layer is not None:
            k, v = k[layer], v[layer]
        if panels.attention_fits(attn.q_proj, q, k):
            return panels.decode_attention(q, k, v, self.positions, window=w, scale=attn.scaling)
        return attend_cache(q, k, v, self.mask(w), scale=attn.scaling)

    def rows(self, x, logits_at):
        """The final hidden states the head reads: every position, or ``logits_at``'s."""
        if logits_at is None:
            return x
        idx = jnp.asarray(logits_at, jnp.int32)
        if self.kind == "packed":
            return x[0, idx]
        if idx.ndim == 1:
            return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]
        return jnp.take_along_axis(x, idx[:, :, None], axis=1)

    def advance(self, new_k, new_v) -> KVCache:
        """The cache after this forward: the new K/V, ``lengths`` advanced by each sequence's tokens."""
        cache, T = self.cache, self.q_pos.shape[1]
        if self.kind == "packed":
            adv = jnp.zeros((cache.batch,), jnp.int32).at[self.seg].add(1, mode="drop")
        else:
            adv = T if self.attention_mask is None else self.attention_mask.astype(jnp.int32).sum(-1)
        if isinstance(new_k, list):
            new_k, new_v = tuple(new_k), tuple(new_v)
        return KVCache(new_k, new_v, cache.lengths + adv)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: TargetConfig, **kw):
        if config.family != "llama":
            raise UnknownArchitectureError(f"LlamaForCausalLM got a {config.family!r} config")
        super().__init__(config, **kw)


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: TargetConfig, **kw):
        if config.family != "qwen3":
            raise UnknownArchitectureError(f"Qwen3ForCausalLM got a {config.family!r} config")
        super().__init__(config, **kw)


MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


def build_model(config: TargetConfig, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32, dtype=None,
                abstract: bool = False) -> CausalLM:
    """Instantiate the target class for ``config.family``. ``abstract=True`` allocates nothing
    (params are ShapeDtypeStructs until :func:`specjax.models.params.load_tree` fills them)."""
    cls = MODEL_CLASSES.get(config.family)
    if cls is None:
        raise UnknownArchitectureError(f"no target class for family {config.family!r}; expected one of {sorted(MODEL_CLASSES)}")
    if abstract:
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype))
    return cls(config, rngs=rngs or nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype)
