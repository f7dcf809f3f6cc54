"""The decode layer scan (``SPECJAX_SCAN_LAYERS=1``): the target's KV cache stacked [L, B, Hkv, S, D]
and the cached forwards' layers under ``lax.scan`` equal the per-layer cache and the unrolled
layers: logits, taps and the cache itself after a padded prefill, a packed prefill, a shared-prefix
prefill, decode and verify steps (XLA path, sliding windows, and the Pallas path in interpret
mode); the Pallas decode kernel reads a layer of a stacked cache in place; the generate and
speculative chain loops give the unrolled loops' tokens."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decode.prefill import prefill
from specjax.kernels import tpu as kt
from specjax.kernels.tpu.decode import decode_attention
from specjax.models.layer_scan import decode_layer_scan, layer_scan, recording_layer_scans
from specjax.models.target import KVCache
from tests.models.test_layer_scan import N, tiny

# the 128-slot caches below need 128 positions
MODELS = {"llama": dict(max_position_embeddings=128),
          "qwen3-sliding": dict(family="qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2,
                                max_position_embeddings=128)}
TAPS = (1, 3, N)


def steps(model, stacked: bool, layout: str, P: int = 10):
    """A prefill of 2 prompts (P and P - 3 tokens; padded, packed or with a 3-token shared prefix), a
    3-token verify and a 1-token decode step over a cache ``stacked`` or not: every output."""
    ids = jax.random.randint(jax.random.key(1), (2, P), 0, 64).at[1, :3].set(jax.random.randint(
        jax.random.key(1), (3,), 0, 64)).at[0, :3].set(jax.random.randint(jax.random.key(1), (3,), 0, 64))
    lens = jnp.array([P, P - 3], jnp.int32)
    kw = dict(packed_len=2 * P - 3) if layout == "packed" else dict(shared_prefix=3) if layout == "shared" else {}

    @nnx.jit
    def run(m):
        with recording_layer_scans() as log:
            cache = KVCache.init(m.config, 2, 128, stacked=stacked)
            logits, cache, aux = prefill(m, ids, lens, cache, tap_ids=TAPS, **kw)
            o2 = m(jnp.array([[5, 6, 7], [8, 9, 10]]), cache=cache, tap_ids=TAPS)
            o3 = m(jnp.array([[11], [12]]), cache=o2.cache.rollback(o2.cache.lengths - 1), tap_ids=TAPS)
        assert bool(log) == stacked  # the stacked cache's forwards scanned their layers, the others did not
        c = o3.cache
        K, V = (c.k, c.v) if stacked else (jnp.stack(c.k), jnp.stack(c.v))
        return [logits, *aux, o2.logits, *o2.aux_hidden_states, o3.logits, *o3.aux_hidden_states, K, V, c.lengths]

    return run(model)


def assert_same(a, b, tol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("name,layout", [("qwen3-sliding", "padded"), ("llama", "packed"), ("qwen3-sliding", "shared")])
def test_stacked_cache_equals_per_layer_cache(name, layout):
    model = tiny(**MODELS[name])
    assert_same(steps(model, True, layout), steps(model, False, layout))


def test_stacked_cache_on_the_pallas_path():
    """TPU programs: the prefill, the verify and the decode step attend on the decode kernel, which
    reads a layer of the stacked cache by index."""
    model = tiny(**MODELS["qwen3-sliding"])
    with kt.pallas_interpret():
        assert_same(steps(model, True, "padded"), steps(model, False, "padded"))


def test_decode_kernel_reads_a_layer_of_a_stacked_cache():
    r = np.random.default_rng(0)
    L, B, H, S, D, T, Hq = 3, 2, 2, 256, 64, 3, 4
    K = jnp.asarray(r.standard_normal((L, B, H, S, D)), jnp.float32)
    V = jnp.asarray(r.standard_normal((L, B, H, S, D)), jnp.float32)
    q = jnp.asarray(r.standard_normal((B, T, Hq, D)), jnp.float32)
    hi = jnp.array([[100, 101, 102], [200, 201, 202]], jnp.int32)
    lo = jnp.maximum(hi - 150, 0)
    f = jax.jit(lambda q, K, V, l: decode_attention(q, K, V, lo, hi, interpret=True, block_kv=128, layer=l))
    for layer in range(L):
        want = decode_attention(q, K[layer], V[layer], lo, hi, interpret=True, block_kv=128)
        np.testing.assert_array_equal(np.asarray(f(q, K, V, jnp.int32(layer))), np.asarray(want))
    with pytest.raises(kt.KernelShapeError, match="stacked heads-major"):
        decode_attention(q, K[0], V[0], lo, hi, interpret=True, layer=0)


def test_the_setting_and_what_keeps_a_per_layer_cache(monkeypatch):
    model = tiny(**MODELS["llama"])
    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "0")
    from specjax import placement

    for setting, want in (("on", True), ("auto", False), ("off", False)):  # a TPU program's too
        for where in ("cpu", "tpu"):
            with layer_scan(setting), placement.building_for(where):
                assert decode_layer_scan(model) is want


def test_generate_and_speculative_chain_loops_give_the_unrolled_tokens(monkeypatch):
    from specjax.decode.generate import generate_ids
    from specjax.decode.selfdraft import SelfDraft
    from specjax.decode.speculative import speculative_generate_ids

    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "0")  # no CPU panel view: the decode loops may scan
    model = tiny(**MODELS["qwen3-sliding"])
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]

    def both():
        g = generate_ids(model, prompts, max_new_tokens=12, eos_token_ids=[]).tokens
        s = speculative_generate_ids(model, SelfDraft(model, num_layers=3, speculative_tokens=3), prompts,
                                     max_new_tokens=12, eos_token_ids=[]).tokens
        return g, s

    jax.clear_caches()  # the scan setting is read when a loop is traced
    with layer_scan("on"), recording_layer_scans() as log:
        scanned = both()
    assert log, "no forward scanned its layers"
    jax.clear_caches()
    with layer_scan("off"):
        unrolled = both()
    jax.clear_caches()
    assert scanned == unrolled
    assert scanned[0] == scanned[1]  # greedy speculation is lossless


def tree_round(model, stacked: bool):
    """A prefill, a token-tree verify (4 nodes: two siblings at depth 1) with taps, and the
    compaction of an accepted path (root, node 2, node 3) over a cache ``stacked`` or not."""
    from specjax.decode.tree import compact_cache

    @nnx.jit
    def run(m):
        cache = KVCache.init(m.config, 2, 128, stacked=stacked)
        ids = jnp.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
        _, cache, _ = prefill(m, ids, jnp.array([6, 4], jnp.int32), cache)
        L = cache.lengths
        tm = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
        out = m(jnp.array([[20, 21, 22, 23], [24, 25, 26, 27]]), cache=cache, tree_mask=tm, tap_ids=TAPS)
        path = jnp.array([[0, 2, 3], [0, 1, -1]], jnp.int32)
        c = compact_cache(out.cache, L, path, jnp.array([2, 1], jnp.int32))
        K, V = (c.k, c.v) if stacked else (jnp.stack(c.k), jnp.stack(c.v))
        return [out.logits, *out.aux_hidden_states, K, V, c.lengths]

    return run(model)


@pytest.mark.parametrize("pallas", [False, True], ids=["xla", "pallas"])
def test_tree_verify_and_compaction_over_a_stacked_cache(pallas):
    """The token tree's verify (the Pallas path reads a layer of the stacked cache by index) and
    its cache compaction (every layer at once) equal the per-layer cache's."""
    from specjax.models.layer_scan import stack_layers

    model = tiny(**MODELS["qwen3-sliding"])
    stored = stack_layers(nnx.clone(model))
    ctx = kt.pallas_interpret() if pallas else contextlib.nullcontext()
    with ctx:
        assert_same(tree_round(stored, True), tree_round(model, False))
