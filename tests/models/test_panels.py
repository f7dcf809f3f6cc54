"""The CPU panel kernel and the decode-time panel layout: the kernel against float64 numpy over
ragged shapes, the pack/unpack round trip, which params a decode state packs (and that the
module is left alone), forward parity with the plain layout, identical generation with the
kernels on and off, and the fall-back when the kernels cannot be built."""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import kernels
from specjax.decode.generate import generate_ids
from specjax.models import panels
from specjax.models.hf import load_hf_dir
from specjax.models.target import KVCache
from tests.refs.speculators_ckpts import make_verifier

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels unavailable: {kernels.status()}")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Llama whose LM head is its embedding (as SmolLM2's)."""
    return load_hf_dir(make_verifier(tmp_path_factory.mktemp("panels") / "tied", "llama", tie_word_embeddings=True))


def test_panel_width():
    assert [panels.panel_width(n) for n in (576, 192, 1536, 49152, 96, 48, 100, 16)] == [64, 16, 64, 64, 16, 16,
                                                                                       None, 16]
    assert panels.panel_width(512) == 64 and panels.panel_width(256) == 32  # 8 panels of 32 beat 4 of 64


def test_pack_round_trip_is_exact():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    for width in (16, 32):
        wp = panels.pack(jnp.asarray(w), width)
        assert wp.shape == (96 // width, 40, width)
        np.testing.assert_array_equal(np.asarray(wp)[1, 3], w[3, width:2 * width])
        np.testing.assert_array_equal(np.asarray(panels.unpack(wp)), w)
    e = rng.standard_normal((96, 40)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(panels.unpack(panels.pack_embedding(jnp.asarray(e)))), e.T)
    with pytest.raises(ValueError, match="multiple of 16"):
        panels.pack(jnp.zeros((4, 40)))


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("K,N", [(7, 16), (64, 48), (100, 96), (576, 192), (300, 2048)])
def test_kernel_matches_float64(M, K, N):
    rng = np.random.default_rng(M * 1000 + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    y = np.asarray(jax.jit(panels.matmul)(jnp.asarray(x), panels.pack(jnp.asarray(w))))
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (M, N) and y.dtype == np.float32
    assert np.abs(y - want).max() <= 1e-5 * np.sqrt(K) * np.abs(want).max()


@needs_kernels
def test_kernel_leading_dims_and_errors():
    x = jnp.ones((2, 3, 32), jnp.float32)
    wp = panels.pack(jnp.ones((32, 16), jnp.float32))
    np.testing.assert_allclose(np.asarray(panels.matmul(x, wp)), np.full((2, 3, 16), 32.0))
    with pytest.raises(ValueError, match="expects 32"):
        panels.matmul(jnp.ones((1, 8), jnp.float32), wp)
    with pytest.raises(TypeError, match="float32"):
        panels.matmul(x.astype(jnp.bfloat16), wp)


def _bf16_valued(tree):
    """float32 params holding bfloat16 values (a bf16 checkpoint loaded in float32)."""
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype) if a.dtype == jnp.float32 else a, tree)


@needs_kernels
@pytest.mark.parametrize("M", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("K,N", [(7, 16), (100, 96), (576, 192)])
def test_bf16_panels_give_the_float32_kernels_bits(M, K, N):
    """bf16 panels widen each weight to the same float32 exactly: for bf16-valued weights the
    output is bit-equal to the float32 panels' (same products, same order of sums)."""
    rng = np.random.default_rng(M * 7 + K)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    wp = panels.pack(w)
    y32 = np.asarray(jax.jit(panels.matmul)(x, wp))
    y16 = np.asarray(jax.jit(panels.matmul)(x, wp.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(y16, y32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.abs(y16 - want).max() <= 1e-5 * np.sqrt(K) * np.abs(want).max()


def test_bf16_exact():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    assert not bool(panels.bf16_exact(w))
    assert bool(panels.bf16_exact(w.astype(jnp.bfloat16).astype(jnp.float32)))
    assert not bool(panels.bf16_exact(w.at[3, 4].set(jnp.nan)))  # NaN never compares equal: float32 panels


@needs_kernels
def test_bf16_valued_params_get_bf16_panels(tied, monkeypatch):
    """A model whose float32 params are all bf16 values (a bf16 checkpoint run in float32) packs
    bfloat16 panels; float32-valued params keep float32 panels; SPECJAX_PANEL_BF16=0 turns it off.
    Generation is token-identical to the plain XLA path either way, with the same logits bits as
    the float32 panels."""
    graphdef, state = nnx.split(tied)
    bstate = _bf16_valued(state)
    bf = nnx.merge(graphdef, bstate)

    def dtypes(root, st):
        return {v.get_value().packed.dtype for _, v in nnx.to_flat_state(panels.decode_state(root, st))
                if isinstance(v.get_value(), panels.Paneled)}

    assert dtypes(tied, state) == {jnp.dtype(jnp.float32)}
    assert dtypes(bf, bstate) == {jnp.dtype(jnp.bfloat16)}
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    on = generate_ids(bf, prompts, max_new_tokens=10, eos_token_ids=[])

    @jax.jit
    def step_logits(st, ids):
        return nnx.merge(graphdef, st)(ids, cache=KVCache.init(tied.config, 1, 8)).logits

    ids = jnp.asarray([[5, 6, 7]], jnp.int32)
    l16 = np.asarray(step_logits(panels.decode_state(bf, bstate), ids))
    monkeypatch.setenv("SPECJAX_PANEL_BF16", "0")
    assert dtypes(bf, bstate) == {jnp.dtype(jnp.float32)}
    l32 = np.asarray(step_logits(panels.decode_state(bf, bstate), ids))
    np.testing.assert_array_equal(l16, l32)
    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "0")
    assert generate_ids(bf, prompts, max_new_tokens=10, eos_token_ids=[]).tokens == on.tokens


def test_paneled_reads_as_the_plain_param():
    w = jnp.arange(64.0, dtype=jnp.float32).reshape(4, 16)
    p = panels.Paneled(w, panels.pack(w))
    v = nnx.Param(p)
    np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(w))
    assert (p.shape, p.dtype, p.ndim) == (w.shape, w.dtype, 2)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(p)), np.asarray(w))
    leaves = jax.tree_util.tree_leaves(p)
    assert len(leaves) == 2 and leaves[1].shape == (1, 4, 16)


@needs_kernels
def test_decode_state_packs_kernels_and_the_tied_head(tied):
    graphdef, state = nnx.split(tied)
    before = jax.tree_util.tree_leaves(state)
    view = panels.decode_state(tied, state)
    flat = dict(nnx.to_flat_state(view))
    paneled = sorted(".".join(map(str, k)) for k, v in flat.items() if isinstance(v.get_value(), panels.Paneled))
    n = tied.config.num_hidden_layers
    assert len(paneled) == 7 * n + 1 and "model.embed_tokens.embedding" in paneled
    assert not any("norm" in p for p in paneled)
    # the module and the state it was split into are untouched
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(state), before))
    assert all(not isinstance(v.get_value(), panels.Paneled) for _, v in nnx.to_flat_state(nnx.split(tied)[1]))
    # a second view reuses the packed arrays
    again = dict(nnx.to_flat_state(panels.decode_state(tied, state)))
    key = ("model", "layers", 0, "mlp", "up_proj", "kernel")
    assert again[key].get_value().packed is flat[key].get_value().packed


@needs_kernels
def test_decode_state_walks_the_graph_once_per_state(tied, monkeypatch):
    """The packable paths are remembered for the same param arrays (a cached split, or a pair
    rebuilt around the same modules), and found again for new arrays (a cast or reload)."""
    monkeypatch.setattr(panels, "_PACKABLE", type(panels._PACKABLE)())  # other tests' entries
    calls = []
    real = panels.packable
    monkeypatch.setattr(panels, "packable", lambda root: calls.append(root) or real(root))
    _, state = nnx.split(tied)
    first = panels.decode_state(tied, state)
    again = panels.decode_state(tied, state)
    assert len(calls) == 1
    assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(again)
    # other arrays (a bfloat16 copy: nothing to pack) are walked anew; the float32 entry stays
    graphdef, _ = nnx.split(tied)
    m16 = nnx.merge(graphdef, jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state))
    view16 = panels.decode_state(m16, nnx.split(m16)[1])
    assert len(calls) == 2
    assert not any(isinstance(x, panels.Paneled) for x in jax.tree_util.tree_leaves(
        view16, is_leaf=lambda a: isinstance(a, panels.Paneled)))
    panels.decode_state(tied, state)
    assert len(calls) == 2


@needs_kernels
def test_panels_go_with_their_source():
    w = jnp.ones((32, 64), jnp.float32)
    key = (id(w), "kernel", panels.bf16_panels_enabled())
    panels.CACHE.get(w, "kernel")
    assert key in panels.CACHE.items
    del w
    assert key not in panels.CACHE.items


def test_decode_state_is_plain_when_disabled(tied, monkeypatch):
    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "0")
    _, state = nnx.split(tied)
    assert panels.decode_state(tied, state) is state


def test_bf16_params_are_not_packed(tmp_path):
    m = load_hf_dir(make_verifier(tmp_path / "bf", "llama"), dtype=jnp.bfloat16)
    assert panels.packable(m) == {}


@needs_kernels
def test_forward_on_panels_equals_plain(tied):
    """Decode steps (1 and 4 rows per sequence) on the panel view give the plain logits within
    float32 rounding; a prefill of more than MAX_ROWS rows takes the plain kernels (bit-equal)."""
    graphdef, state = nnx.split(tied)
    view = panels.decode_state(tied, state)
    cfg = tied.config
    rng = np.random.default_rng(1)

    @jax.jit
    def fwd(st, ids, cache):
        out = nnx.merge(graphdef, st)(ids, cache=cache)
        return out.logits, out.cache

    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 24)), jnp.int32)
    cache = KVCache.init(cfg, 2, 40)
    lp, cp = fwd(state, prompt, cache)
    lv, cv = fwd(view, prompt, cache)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(lv))
    for T in (1, 4):
        ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, T)), jnp.int32)
        a, _ = fwd(state, ids, cp)
        b, _ = fwd(view, ids, cv)
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


@needs_kernels
def test_generation_identical_with_kernels_on_and_off(tied, monkeypatch):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    on = generate_ids(tied, prompts, max_new_tokens=12, eos_token_ids=[])
    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "0")
    off = generate_ids(tied, prompts, max_new_tokens=12, eos_token_ids=[])
    assert on.tokens == off.tokens


def test_failed_build_falls_back_to_xla(tied, monkeypatch, tmp_path):
    """No working compiler: one warning naming the failure, ``available()`` False, decode states
    stay plain and generation still runs (XLA's dots)."""
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: "/bin/false")
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="CPU kernels unavailable.*failed building panel_matmul.cc"):
        assert not kernels.load()
    assert kernels.status()["reason"] and not kernels.available()
    _, state = nnx.split(tied)
    assert panels.decode_state(tied, state) is state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second warning
        res = generate_ids(tied, [[5, 6, 7]], max_new_tokens=3, eos_token_ids=[])
    assert len(res.tokens[0]) == 3


@needs_kernels
@pytest.mark.parametrize("B,T,Hq,Hkv,D,window", [(4, 1, 9, 3, 64, None), (1, 4, 9, 3, 64, None), (2, 3, 8, 2, 128, 5),
                                                  (1, 2, 12, 1, 64, None), (2, 1, 4, 4, 24, 3), (3, 2, 6, 2, 16, 1)])
def test_decode_attention_equals_masked_attention(B, T, Hq, Hkv, D, window):
    """The kernel against ``attend_cache`` under ``causal_mask`` over all S slots: D of 64 / 128
    (vector paths) and 24 (scalar), G from 1 to 12 (groups of 8), windows, a query past the cache
    end (all slots visible) and ragged positions."""
    from specjax.models.layers import attend_cache, causal_mask

    S = 40
    rng = np.random.default_rng(B * 100 + T * 10 + D)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    start = rng.integers(0, S - T, B)
    # positions past the last slot: every slot is visible (with a window, the last ones are)
    start[0] = S + 3 - T if window is None else S - T
    pos = jnp.asarray(start[:, None] + np.arange(T)[None], jnp.int32)
    want = attend_cache(q, k, v, causal_mask(pos, jnp.arange(S, dtype=jnp.int32), sliding_window=window),
                        scale=D ** -0.5)
    got = jax.jit(lambda *a: panels.decode_attention(*a, window=window, scale=D ** -0.5))(q, k, v, pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", [None, 3])
def test_range_attention_on_a_seq_major_draft_cache_equals_cache_mask(window):
    """A draft's cache is seq-major [B, S, Hkv, D]; a chain step sees its base row's context (within
    the window) and its own scratch rows after it: one slot range per query (``cache_range``),
    equal to the masked attention over every slot (``cache_mask`` + ``attend``)."""
    from specjax.models.drafts.common import cache_mask, cache_range
    from specjax.models.layers import attend

    B, T, Hq, Hkv, D, S = 2, 1, 6, 2, 64, 24
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.float32)
    base = jnp.asarray([[9], [15]], jnp.int32)  # last context row
    for s in (1, 2, 3):  # chain step s writes scratch slot base + s
        hi = base + s
        want = attend(q, k, v, cache_mask(S, base, window=window, lo=base + 1, hi=hi), scale=D ** -0.5)
        got = panels.range_attention(q, k, v, *cache_range(base, window=window, hi=hi), scale=D ** -0.5,
                                     seq_major=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    # context rows (extend): each sees itself and what came before it
    slots = jnp.asarray([[4, 5, 6], [10, 11, 12]], jnp.int32)
    q3 = jnp.asarray(rng.standard_normal((B, 3, Hq, D)), jnp.float32)
    want = attend(q3, k, v, cache_mask(S, slots, window=window), scale=0.2)
    got = panels.range_attention(q3, k, v, *cache_range(slots, window=window), scale=0.2, seq_major=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@needs_kernels
def test_decode_attention_errors():
    q = jnp.zeros((1, 1, 4, 16), jnp.float32)
    kv = jnp.zeros((1, 3, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match="does not fit"):
        panels.decode_attention(q, kv, kv, jnp.zeros((1, 1), jnp.int32), window=None, scale=1.0)
    with pytest.raises(TypeError, match="float32"):
        panels.decode_attention(q.astype(jnp.bfloat16), kv[:, :2], kv[:, :2], jnp.zeros((1, 1), jnp.int32),
                                window=None, scale=1.0)


@needs_kernels
def test_bf16_compute_layer_keeps_its_arithmetic():
    """float32 params under a bf16 compute dtype are packed, but the layer keeps computing as
    before (bf16): the kernel only serves layers that compute in float32."""
    from specjax.models.layers import dense

    layer = dense(32, 16, bias=False, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    graphdef, state = nnx.split(layer)
    view = nnx.merge(graphdef, panels.decode_state(layer, state))
    assert isinstance(view.kernel.get_value(), panels.Paneled)
    x = jnp.ones((2, 32), jnp.float32)
    assert view(x).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(view(x), np.float32), np.asarray(layer(x), np.float32))


def test_pack_pairs_layout():
    """k-pair panels: ``wp[p, h, j, t] = bf16(w[2h + t, p Wd + j])``; the embedding's are its transpose's."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    wb = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))
    for width in (16, 32):
        wp = np.asarray(panels.pack_pairs(jnp.asarray(w), width).astype(jnp.float32))
        assert wp.shape == (96 // width, 20, width, 2)
        np.testing.assert_array_equal(wp[2, 7, 5, 1], wb[15, 2 * width + 5])
        np.testing.assert_array_equal(np.transpose(wp, (1, 3, 0, 2)).reshape(40, 96), wb)
    e = rng.standard_normal((96, 40)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(panels.pack_embedding_pairs(jnp.asarray(e))),
                                  np.asarray(panels.pack_pairs(jnp.asarray(e.T))))
    with pytest.raises(ValueError, match="K must be even"):
        panels.pack_pairs(jnp.zeros((5, 32)))


@needs_kernels
@pytest.mark.parametrize("M", [1, 3, 4, 5, 7, 8, 16, 17, 40, 64])
@pytest.mark.parametrize("K,N", [(2, 16), (64, 48), (100, 96), (576, 192), (300, 2048), (1536, 576)])
def test_bf16_dot_kernel_matches_bf16_products(M, K, N):
    """The bf16-compute kernel: x and w rounded to bf16, the products summed in float32; against
    float64 sums of the same bf16 values (and XLA's bf16 dot, float32 accumulation). On a CPU with
    AMX the calls with K a multiple of 32 run on the tiles (16-row groups: 17 and 40 rows leave a
    short group; panel widths 16, 32 and 64), the others on the vector path."""
    rng = np.random.default_rng(M * 1000 + K)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    y = np.asarray(jax.jit(panels.matmul)(x, panels.pack_pairs(w)))
    xb, wb = (np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64) for a in (x, w))
    want = xb @ wb
    assert y.shape == (M, N) and y.dtype == np.float32
    bound = 1e-6 * np.sqrt(K) * (np.abs(xb) @ np.abs(wb)).max()
    assert np.abs(y - want).max() <= bound
    assert not np.allclose(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-6, atol=0)  # bf16 products
    xla = np.asarray(panels.bf16_dot(x, w))
    assert np.abs(y - xla).max() <= bound
    with pytest.raises(ValueError, match=f"expects {K}"):
        panels.matmul(jnp.ones((1, K + 2), jnp.float32), panels.pack_pairs(w))


@needs_kernels
def test_bf16_compute_decode_state(tied, monkeypatch):
    """``decode_state(compute="bfloat16")``: decode steps on the bf16 kernel equal the same
    arithmetic on XLA's bf16 dot (every row off the kernel) within float32 rounding, and differ
    from the float32 state by bf16 rounding only; a prefill takes XLA's bf16 dot; the layer's own
    bf16 arithmetic and bad dtypes are left alone / refused."""
    monkeypatch.setenv("SPECJAX_BF16_DOT", "kernel")  # the k-pair panels, whatever this host's CPU
    graphdef, state = nnx.split(tied)
    view = panels.decode_state(tied, state, compute="bfloat16")
    assert isinstance(view["model"]["layers"][0]["mlp"]["up_proj"]["kernel"].get_value(), panels.Paneled)
    assert panels.panel_dtypes(view) == {"model": ["bfloat16"]}
    cfg = tied.config
    rng = np.random.default_rng(4)

    def fwd(st, ids, cache):
        out = nnx.merge(graphdef, st)(ids, cache=cache)
        return out.logits, out.cache

    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 24)), jnp.int32)
    cache = KVCache.init(cfg, 2, 40)
    lf, cf = jax.jit(fwd)(state, prompt, cache)
    lb, cb = jax.jit(fwd)(view, prompt, cache)
    lf, lb = np.asarray(lf), np.asarray(lb)
    scale = np.abs(lf).max()
    assert 1e-6 * scale < np.abs(lf - lb).max() <= 5e-2 * scale  # bf16 products, not float32's
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 1)), jnp.int32)
    on_kernel, _ = jax.jit(fwd)(view, ids, cb)
    max_rows = panels.MAX_ROWS, panels.MAX_ROWS_BF16
    try:
        panels.MAX_ROWS = panels.MAX_ROWS_BF16 = 0  # every matmul off the kernel: XLA's bf16 dot, the same arithmetic
        on_xla, _ = jax.jit(fwd)(view, ids, cb)
    finally:
        panels.MAX_ROWS, panels.MAX_ROWS_BF16 = max_rows
    a, b = np.asarray(on_kernel), np.asarray(on_xla)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    f32, _ = jax.jit(fwd)(state, ids, cf)
    assert np.abs(np.asarray(f32) - a).max() <= 5e-2 * np.abs(np.asarray(f32)).max()
    with pytest.raises(ValueError, match="compute dtype"):
        panels.decode_state(tied, state, compute="float16")


@needs_kernels
@pytest.mark.parametrize("arith", ["fma", "dpbf16", "tiles"])
def test_bf16_compute_takes_the_kernels_up_to_its_own_row_limit(tied, monkeypatch, arith):
    """A bf16-compute state runs matmuls on the native kernel up to MAX_ROWS_BF16 rows (a
    regeneration batch of 32 or 64 sequences), beyond MAX_ROWS, and for any number of rows where
    the kernel runs on AMX tiles or on ``vdpbf16ps`` (``arith``: a prefill too), past that on XLA's
    bf16 dot; its cached attention takes the decode-attention kernel for any number of rows (a
    prefill's arithmetic then does not depend on the program around it); the float32 panel view
    keeps MAX_ROWS for both. Outputs on the kernels equal XLA's bf16 dot's within float32 rounding."""
    monkeypatch.setenv("SPECJAX_BF16_DOT", "kernel")
    monkeypatch.setattr(panels, "kernel_has_amx", lambda: arith == "tiles")
    monkeypatch.setattr(panels, "kernel_has_dpbf16", lambda: arith == "dpbf16")
    tiles = arith != "fma"
    graphdef, state = nnx.split(tied)
    view = panels.decode_state(tied, state, compute="bfloat16")
    f32_view = panels.decode_state(tied, state)
    cfg = tied.config
    assert panels.MAX_ROWS < 2 * 24 <= panels.MAX_ROWS_BF16 < 2 * 40

    def fwd(st, ids, cache):
        out = nnx.merge(graphdef, st)(ids, cache=cache)
        return out.logits, out.cache

    def calls(st, T):
        ids = jnp.ones((2, T), jnp.int32)
        txt = jax.jit(fwd).lower(st, ids, KVCache.init(cfg, 2, 48)).as_text()
        return {n: txt.count(n) for n in ("specjax_panel_dot_bf16", "specjax_panel_matmul", "specjax_decode_attention",
                                          "specjax_rope", "specjax_rmsnorm")}

    on = calls(view, 24)  # 48 rows
    assert on["specjax_panel_dot_bf16"] > 0 and on["specjax_decode_attention"] > 0, on
    assert not any(calls(f32_view, 24).values())  # 48 rows are past the float32 panels' limit
    far = calls(view, 40)  # 80 rows: matmuls on the tiles / vdpbf16ps, else XLA's bf16 dot; attention on its kernel
    assert far["specjax_panel_matmul"] == 0 and far["specjax_decode_attention"] == cfg.num_hidden_layers, far
    assert far["specjax_rope"] == cfg.num_hidden_layers and far["specjax_rmsnorm"] > 0, far
    assert (far["specjax_panel_dot_bf16"] > 0) == tiles, far
    assert not any(calls(f32_view, 40).values())
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 24)), jnp.int32)
    a = np.asarray(jax.jit(fwd)(view, ids, KVCache.init(cfg, 2, 48))[0])
    limits = panels.MAX_ROWS, panels.MAX_ROWS_BF16
    monkeypatch.setattr(panels, "kernel_has_amx", lambda: False)
    monkeypatch.setattr(panels, "kernel_has_dpbf16", lambda: False)
    try:
        panels.MAX_ROWS = panels.MAX_ROWS_BF16 = 0
        b = np.asarray(jax.jit(fwd)(view, ids, KVCache.init(cfg, 2, 48))[0])
    finally:
        panels.MAX_ROWS, panels.MAX_ROWS_BF16 = limits
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_bf16_layout_follows_the_cpu_and_the_rows(monkeypatch):
    """A bf16-compute state multiplies on the k-pair kernel for every input where the kernel runs
    on AMX tiles (prefills too); on a CPU with AMX whose kernel lacks them, on XLA's
    bf16 dot ("dot") past BF16_KERNEL_ROWS_AMX rows; with AMX and no decode steps (a prefill's
    rows) on XLA's dot; without AMX on the kernel. SPECJAX_BF16_DOT forces either and refuses
    anything else."""
    monkeypatch.delenv("SPECJAX_BF16_DOT", raising=False)
    n, top = panels.BF16_KERNEL_ROWS_AMX, panels.MAX_ROWS_BF16
    monkeypatch.setattr(panels, "host_has_amx", lambda: True)
    monkeypatch.setattr(panels, "kernel_has_amx", lambda: True)
    assert {panels.bf16_layout(r) for r in (1, n + 1, top, top + 1, None)} == {"pairs"}
    assert panels.bf16_row_limit() > 10**9
    monkeypatch.setattr(panels, "kernel_has_amx", lambda: False)
    monkeypatch.setattr(panels, "kernel_has_dpbf16", lambda: False)
    assert [panels.bf16_layout(r) for r in (1, n, n + 1, 64, None)] == ["pairs", "pairs", "dot", "dot", "dot"]
    assert panels.bf16_row_limit() == top
    monkeypatch.setattr(panels, "kernel_has_dpbf16", lambda: True)  # vdpbf16ps: every row, a prefill too
    assert panels.bf16_row_limit() > 10**9
    monkeypatch.setattr(panels, "kernel_has_dpbf16", lambda: False)
    monkeypatch.setattr(panels, "host_has_amx", lambda: False)
    assert {panels.bf16_layout(r) for r in (1, n + 1, 64, None)} == {"pairs"}
    monkeypatch.setenv("SPECJAX_BF16_DOT", "xla")
    assert panels.bf16_layout(1) == "dot"
    monkeypatch.setenv("SPECJAX_BF16_DOT", "kernel")
    monkeypatch.setattr(panels, "host_has_amx", lambda: True)
    assert panels.bf16_layout(64) == "pairs"
    monkeypatch.setenv("SPECJAX_BF16_DOT", "amx")
    with pytest.raises(ValueError, match="SPECJAX_BF16_DOT must be auto, xla or kernel, got 'amx'"):
        panels.bf16_layout(64)


@needs_kernels
@pytest.mark.parametrize("layout", ["pairs", "float32", "bf16"])
@pytest.mark.parametrize("K,N", [(576, 192), (100, 96), (1536, 576)])
def test_kernel_rows_do_not_depend_on_the_other_rows(K, N, layout):
    """A row's products and float32 sums come out bit for bit the same whatever rows share the call
    (1 to 70 rows: one pass of up to 6 rows, 7 on 64-column panels with vdpbf16ps, or 8 on narrower
    panels; several groups over the whole panel or over chunks of K; several 16-row tile groups, a
    short last group; K a multiple of 32 or not), on the bf16
    kernel's k-pair panels and on the float32 kernel's float32 and bfloat16 panels: so a prefill, a
    decode step and a verify of the same token multiply alike."""
    rng = np.random.default_rng(K + N)
    x = jnp.asarray(rng.standard_normal((70, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
    wp = {"pairs": panels.pack_pairs, "float32": panels.pack,
          "bf16": lambda w: panels.pack(w.astype(jnp.bfloat16))}[layout](w)
    mm = jax.jit(panels.matmul)
    full = np.asarray(mm(x, wp))
    for lo, hi in ((0, 1), (3, 4), (0, 5), (0, 6), (0, 7), (1, 8), (2, 11), (20, 37), (33, 70), (69, 70)):
        np.testing.assert_array_equal(np.asarray(mm(x[lo:hi], wp)), full[lo:hi])


@needs_kernels
@pytest.mark.skipif(not panels.host_has_amx() or os.environ.get("SPECJAX_KERNEL_ARCH", "native") != "native",
                    reason="the CPU has no AMX tiles, or the kernels are built for another CPU")
def test_the_bf16_kernel_takes_the_tiles_on_a_cpu_with_amx():
    """Built for this CPU (the default ``-march=native``), the k-pair kernel multiplies on the AMX
    tiles the CPU has, and a bf16-compute state keeps it for every decode step
    and for prefills (the tiles stream each weight once, where XLA's dot did not)."""
    assert kernels.amx_tiles()
    assert panels.kernel_has_amx() and panels.bf16_layout(None) == "pairs" and panels.bf16_row_limit() > 10**9


@needs_kernels
@pytest.mark.skipif(not panels.host_has_flag("avx512_bf16") or os.environ.get("SPECJAX_KERNEL_ARCH", "native") != "native",
                    reason="the CPU has no AVX512-BF16, or the kernels are built for another CPU")
def test_the_bf16_kernel_takes_vdpbf16ps_and_every_row_on_a_cpu_with_avx512_bf16():
    """Built for this CPU, the k-pair kernel's vector path multiplies with ``vdpbf16ps`` where the
    CPU has AVX512-BF16, and a bf16-compute state then takes it for prefills too."""
    assert kernels.dpbf16() and panels.kernel_has_dpbf16() and panels.bf16_row_limit() > 10**9


@needs_kernels
def test_bf16_dot_layout_equals_the_kernel(tied, monkeypatch):
    """The "dot" layout (the weights in bfloat16 for XLA's bf16 dot): every matmul leaves the
    k-pair kernel (decode steps and prefill alike) while the cached attention stays on the
    decode-attention kernel for every row, and the logits equal the k-pair kernel's
    within float32 rounding (the same bf16 products, summed in another order)."""
    graphdef, state = nnx.split(tied)
    cfg = tied.config
    monkeypatch.setenv("SPECJAX_BF16_DOT", "xla")
    dot = panels.decode_state(tied, state, compute="bfloat16", rows=48)
    w = dot["model"]["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    assert isinstance(w, panels.Paneled) and w.packed.shape == w.plain.shape and w.packed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w.packed), np.asarray(w.plain.astype(jnp.bfloat16)))
    monkeypatch.setenv("SPECJAX_BF16_DOT", "kernel")
    pairs = panels.decode_state(tied, state, compute="bfloat16", rows=48)
    assert pairs["model"]["layers"][0]["mlp"]["up_proj"]["kernel"].get_value().packed.ndim == 4

    def fwd(st, ids, cache):
        out = nnx.merge(graphdef, st)(ids, cache=cache)
        return out.logits, out.cache

    ids = jnp.ones((2, 24), jnp.int32)
    txt = jax.jit(fwd).lower(dot, ids, KVCache.init(cfg, 2, 48)).as_text()
    assert txt.count("specjax_panel_dot_bf16") == 0 and txt.count("specjax_decode_attention") > 0
    txt = jax.jit(fwd).lower(dot, jnp.ones((2, 40), jnp.int32), KVCache.init(cfg, 2, 48)).as_text()  # 80 rows
    assert txt.count("specjax_panel_dot_bf16") == 0 and txt.count("specjax_decode_attention") > 0
    rng = np.random.default_rng(6)
    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 40)), jnp.int32)  # 80 rows: a prefill
    step = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 24)), jnp.int32)  # 48 rows: on the kernels
    la, ca = jax.jit(fwd)(dot, prompt, KVCache.init(cfg, 2, 72))
    lb, cb = jax.jit(fwd)(pairs, prompt, KVCache.init(cfg, 2, 72))
    assert np.abs(np.asarray(la) - np.asarray(lb)).max() <= 1e-5 * np.abs(np.asarray(lb)).max()
    sa, _ = jax.jit(fwd)(dot, step, ca)
    sb, _ = jax.jit(fwd)(pairs, step, cb)
    assert np.abs(np.asarray(sa) - np.asarray(sb)).max() <= 1e-5 * np.abs(np.asarray(sb)).max()
    with pytest.raises(ValueError, match="expects 64"):
        panels.matmul(jnp.ones((1, 66), jnp.float32), panels.pack_dot(jnp.ones((64, 32))))

