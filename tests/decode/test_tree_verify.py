"""Tree verify in the target and cache compaction, on a tiny random Llama: one forward over the
tree with the tree mask gives, at every node, the logits of a plain chain verify of that node's
root-to-node path (a different tree per sequence, ragged committed lengths); on the CPU kernels'
panel view too. After compaction, the cache decodes exactly as a cache built by a chain over the
accepted path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import kernels
from specjax.kernels import ops as native_ops
from specjax.decode.tree import TokenTree, compact_cache, parse_tree
from specjax.models import panels
from specjax.models.config import TargetConfig
from specjax.models.target import KVCache, build_model

V = 64
TREES = [parse_tree("[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"), TokenTree.chain(5)]  # both 5 nodes
LENS = [7, 4]  # committed prompt lengths (ragged)


@pytest.fixture(scope="module")
def llama():
    cfg = TargetConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
    return build_model(cfg, rngs=nnx.Rngs(5))


def _prefilled(model, S=32):
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, V, (2, max(LENS))), jnp.int32)
    cache = KVCache.init(model.config, 2, S)
    out = model(prompt, cache=cache, attention_mask=jnp.arange(max(LENS))[None] < jnp.asarray(LENS)[:, None])
    return out.cache


def _tree_inputs():
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(1, V, (2, 6)), jnp.int32)  # column 0: the root (last committed) token
    mask = jnp.asarray(np.stack([t.mask for t in TREES]))  # [B, 6, 6]
    return tokens, mask


def _fwd(graphdef):
    @jax.jit
    def fwd(state, ids, cache, tree_mask=None):
        out = nnx.merge(graphdef, state)(ids, cache=cache, tree_mask=tree_mask)
        return out.logits, out.cache

    return fwd


def _check_nodes_equal_chains(fwd, state, cache, tol):
    tokens, mask = _tree_inputs()
    tl, tcache = fwd(state, tokens, cache, mask)
    np.testing.assert_array_equal(np.asarray(tcache.lengths), np.asarray(cache.lengths) + 6)
    for b, tr in enumerate(TREES):
        for i in range(tr.num_nodes + 1):
            nodes = tr.path_nodes[i][tr.path_nodes[i] >= 0]
            chain = jnp.broadcast_to(tokens[b, nodes], (2, len(nodes)))  # both rows: this path
            cl, _ = fwd(state, chain, cache)
            np.testing.assert_allclose(np.asarray(tl[b, i]), np.asarray(cl[b, -1]), atol=tol, rtol=0)
    return tl


def test_tree_verify_equals_chain_verify_per_node(llama):
    graphdef, state = nnx.split(llama)
    cache = _prefilled(llama)
    np.testing.assert_array_equal(np.asarray(cache.lengths), LENS)
    tl = _check_nodes_equal_chains(_fwd(graphdef), state, cache, 1e-5)
    assert np.abs(np.asarray(tl[0, 1]) - np.asarray(tl[0, 2])).max() > 1e-3  # siblings differ: the mask matters


needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels unavailable: {kernels.status()}")


@needs_kernels
def test_tree_verify_on_the_panel_view(llama, monkeypatch):
    """The panel view runs the tree verify's attention on the CPU kernel (traced once per layer)."""
    calls = []
    real = panels.tree_attention
    monkeypatch.setattr(panels, "tree_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    graphdef, state = nnx.split(llama)
    view = panels.decode_state(llama, state)
    assert view is not state
    cache = _prefilled(llama)
    _check_nodes_equal_chains(_fwd(graphdef), view, cache, 1e-5)
    assert len(calls) == llama.config.num_hidden_layers


@needs_kernels
@pytest.mark.parametrize("Hq,Hkv,D,window", [(8, 2, 64, None), (4, 4, 128, 9), (6, 2, 24, None), (12, 1, 64, 6)])
def test_tree_attention_kernel_equals_masked_attention(Hq, Hkv, D, window):
    """The kernel against ``attend_cache`` under ``tree_cache_mask``: vector (D 64 / 128) and
    scalar (D 24) paths, groups of 8 and more, sliding windows >= T, per-sequence trees."""
    from specjax.models.layers import attend_cache, tree_cache_mask

    B, S, T = 2, 40, 6
    rng = np.random.default_rng(D + Hq)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    base = jnp.asarray([11, 3], jnp.int32)
    mask = jnp.asarray(np.stack([t.mask for t in TREES]))
    pos = base[:, None] + jnp.asarray(np.stack([t.depth for t in TREES]))
    want = attend_cache(q, k, v, tree_cache_mask(pos, base, mask, S, sliding_window=window), scale=D ** -0.5)
    got = jax.jit(lambda *a: panels.tree_attention(*a, window=window, scale=D ** -0.5))(q, k, v, pos, base, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="sliding window >= 6"):
        panels.tree_attention(q, k, v, pos, base, mask, window=5, scale=1.0)


def test_tree_mask_errors(llama):
    cache = _prefilled(llama)
    tokens, mask = _tree_inputs()
    with pytest.raises(ValueError, match="needs a KV cache"):
        llama(tokens, tree_mask=mask)
    with pytest.raises(ValueError, match=r"does not fit 6 input tokens"):
        llama(tokens, cache=cache, tree_mask=mask[:, :5, :5])


def test_compacted_cache_decodes_like_a_chain_cache(llama):
    graphdef, state = nnx.split(llama)
    fwd = _fwd(graphdef)
    cache = _prefilled(llama)
    tokens, mask = _tree_inputs()
    _, tcache = fwd(state, tokens, cache, mask)
    # accepted paths: sequence 0 root -> 1 -> 3 -> 5 (n = 3), sequence 1 root -> 1 (n = 1)
    path = jnp.asarray([[0, 1, 3, 5], [0, 1, -1, -1]], jnp.int32)
    n = jnp.asarray([3, 1], jnp.int32)
    base = cache.lengths
    comp = jax.jit(compact_cache)(tcache, base, path, n)
    np.testing.assert_array_equal(np.asarray(comp.lengths), np.asarray(base + n + 1))
    # the same tokens through a chain verify, then rollback to the same lengths
    chain_tok = jnp.take_along_axis(tokens, jnp.maximum(path, 0), axis=1)
    _, ccache = fwd(state, chain_tok, cache)
    ccache = ccache.rollback(base + n + 1)
    for layer in range(len(comp.k)):
        for b in range(2):
            end = int(base[b] + n[b] + 1)
            np.testing.assert_allclose(np.asarray(comp.k[layer][b, :, :end]), np.asarray(ccache.k[layer][b, :, :end]),
                                       atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(comp.v[layer][b, :, :end]), np.asarray(ccache.v[layer][b, :, :end]),
                                       atol=1e-5, rtol=0)
    # and decodes identically: three greedy steps from each cache
    nxt = jnp.asarray([[11], [12]], jnp.int32)
    for _ in range(3):
        a, comp = fwd(state, nxt, comp)
        c, ccache = fwd(state, nxt, ccache)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5, rtol=0)
        nxt = jnp.argmax(a[:, -1], -1).astype(jnp.int32)[:, None]
    # without compaction (the tree rows left in place) the next step differs: the test can fail
    stale = tcache.rollback(base + n + 1)
    a, _ = fwd(state, jnp.asarray([[11], [12]], jnp.int32), stale)
    c, _ = fwd(state, jnp.asarray([[11], [12]], jnp.int32), fwd(state, chain_tok, cache)[1].rollback(base + n + 1))
    assert np.abs(np.asarray(a[0]) - np.asarray(c[0])).max() > 1e-3


@pytest.mark.skipif(not kernels.available("cpu"), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_compaction_moves_the_same_bytes_as_the_gathers_and_scatters(dtype):
    """The one-call kernel compaction (``native``, the single-device CPU tree loop) leaves every
    slot of every layer's K and V buffer bit for bit as the XLA gathers and scatters do: accepted
    rows moved, the rows past the path (the root's, as the gather of index 0 gives) written,
    slots past S dropped, the source rows read before any write; float32 and bfloat16 caches."""
    rng = np.random.default_rng(3)
    B, H, S, Dh, D1 = 3, 2, 12, 8, 4
    ks = tuple(jnp.asarray(rng.standard_normal((B, H, S, Dh)), dtype) for _ in range(3))
    vs = tuple(jnp.asarray(rng.standard_normal((B, H, S, Dh)), dtype) for _ in range(3))
    cache = KVCache(ks, vs, jnp.asarray([5, 9, 2], jnp.int32))
    base = jnp.asarray([3, 10, 0], jnp.int32)  # sequence 1's tree reaches past S (slots dropped)
    path = jnp.asarray([[0, 2, 3, -1], [0, 1, -1, -1], [0, 1, 4, 6]], jnp.int32)
    n = jnp.asarray([2, 1, 3], jnp.int32)
    want = jax.jit(lambda c, b, p, n: compact_cache(c, b, p, n, native=False))(cache, base, path, n)
    got = jax.jit(lambda c, b, p, n: compact_cache(c, b, p, n, native=True))(cache, base, path, n)
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    for a, b in zip(got.k + got.v, want.k + want.v):
        assert a.dtype == dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    # the move did something: sequence 0's slot 4 now holds node 2's row (slot 5)
    np.testing.assert_array_equal(np.asarray(got.k[0][0, :, 4]), np.asarray(ks[0][0, :, 5]))
    with pytest.raises(ValueError, match="is not"):
        native_ops.compact_rows(base, path, (ks[0][0],))
