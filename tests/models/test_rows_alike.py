"""The decode path's rows round alike whatever the program's shapes: the rotary-embedding kernel
(``specjax_rope``: products and sums rounded one by one, the eager arithmetic), the RMSNorm kernel
(``specjax_rmsnorm``: each row summed in one order), the decode attention's softmax sums (a tree
row equals the decode step over its accepted path), and the forwards that take them: a verify of
any number of rows equals its decode steps bit for bit. (The rope's case shows only in optimised
codegen of the whole SmolLM2 loop: the bf16 loop at batch 1 against batch 2, docs/main-job.md.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import kernels
from specjax.models import panels
from specjax.models.hf import load_hf_dir
from specjax.models.rope import RopeConfig, apply_rope, rope_cos_sin
from specjax.models.target import KVCache
from tests.refs.speculators_ckpts import make_verifier

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels unavailable: {kernels.status()}")


def _np_rope(x, cos, sin):
    """PyTorch's eager arithmetic: x * cos, rotate_half(x) * sin and their sum, each rounded."""
    R = cos.shape[-1]
    h = R // 2
    xr = x[..., :R]
    rot = np.concatenate([-xr[..., h:], xr[..., :h]], -1)
    out = xr * cos[..., None, :] + rot * sin[..., None, :]
    return np.concatenate([out, x[..., R:]], -1).astype(np.float32)


@pytest.mark.parametrize("B,T,Hq,Hk,D,R", [(1, 1, 9, 3, 64, 64), (2, 5, 4, 2, 128, 128), (3, 7, 8, 8, 64, 32),
                                          (1, 300, 2, 1, 16, 8)])
def test_rope_kernel_is_eager_arithmetic(B, T, Hq, Hk, D, R):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32) * 7
    k = rng.standard_normal((B, T, Hk, D)).astype(np.float32) * 7
    rc = RopeConfig(head_dim=D, rotary_dim=R if R < D else None)
    pos = jnp.asarray(rng.integers(0, 4000, (B, T)), jnp.int32)
    cos, sin = rope_cos_sin(pos, rc)
    qo, ko = jax.jit(panels.rope)(jnp.asarray(q), jnp.asarray(k), cos, sin)
    c, s = np.asarray(cos), np.asarray(sin)
    np.testing.assert_array_equal(np.asarray(qo), _np_rope(q, c, s))  # bit for bit
    np.testing.assert_array_equal(np.asarray(ko), _np_rope(k, c, s))
    # XLA's fused version differs from it by at most float32 rounding (a contracted product)
    ref = np.asarray(jax.jit(apply_rope)(jnp.asarray(q), cos, sin))
    assert np.abs(ref - np.asarray(qo)).max() <= 4e-7 * np.abs(ref).max()


def test_rope_kernel_rejects_mismatched_shapes():
    q = jnp.zeros((1, 2, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match="rope"):
        panels.rope(q, jnp.zeros((1, 3, 2, 16), jnp.float32), jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)))
    with pytest.raises(ValueError, match="rope"):
        panels.rope(q, jnp.zeros((1, 2, 2, 16), jnp.float32), jnp.zeros((1, 2, 32)), jnp.zeros((1, 2, 32)))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return load_hf_dir(make_verifier(tmp_path_factory.mktemp("rope") / "tied", "llama", tie_word_embeddings=True))


def test_decode_forwards_take_the_kernel_and_a_float32_prefill_does_not(tied, monkeypatch):
    """In the panel view a decode step and a verify rotate on the kernel (their keys are the
    eager arithmetic's); a float32 prefill past the kernels' rows keeps XLA's rope, bit for bit
    the plain params'."""
    calls = []
    real = panels.rope
    monkeypatch.setattr(panels, "rope", lambda *a: calls.append(a[0].shape) or real(*a))
    graphdef, state = nnx.split(tied)
    view = panels.decode_state(tied, state)
    cfg = tied.config

    def fwd(st, ids, cache):
        return nnx.merge(graphdef, st)(ids, cache=cache).cache

    prompt = jnp.asarray(np.arange(1, 25)[None], jnp.int32)
    fwd(view, prompt, KVCache.init(cfg, 1, 40))
    assert calls == []
    for T in (1, 4):
        calls.clear()
        fwd(view, jnp.ones((1, T), jnp.int32), KVCache.init(cfg, 1, 40))
        assert calls and all(s[:2] == (1, T) for s in calls)


def test_rmsnorm_kernel_rows_alone_and_together():
    """Each row is normalised in one order: N rows in a call give each row's bits alone, within
    float32 rounding of XLA's RMSNorm; bad dtypes are refused."""
    from specjax.models.layers import RMSNorm

    rng = np.random.default_rng(5)
    for D in (576, 64, 40):
        x = jnp.asarray(rng.standard_normal((11, D)) * 4, jnp.float32)
        together = np.asarray(jax.jit(lambda a: panels.rms_normed(a, 1e-5))(x))
        alone = np.concatenate([np.asarray(panels.rms_normed(x[i:i + 1], 1e-5)) for i in range(11)])
        np.testing.assert_array_equal(together, alone)
        norm = RMSNorm(D, 1e-5)
        ref = np.asarray(norm(x))
        got = np.asarray(norm.scaled(x, jnp.asarray(together)))
        assert np.abs(ref - got).max() <= 2e-6 * np.abs(ref).max()
    with pytest.raises(TypeError, match="float32"):
        panels.rms_normed(x.astype(jnp.bfloat16), 1e-5)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """SmolLM2's widths (576 hidden, 9 x 64 heads, 3 kv heads), two layers."""
    return load_hf_dir(make_verifier(tmp_path_factory.mktemp("rope") / "wide", "llama", tie_word_embeddings=True,
                                     hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                     intermediate_size=256, num_hidden_layers=2))


def _decode_forward(model, compute):
    """``model``'s panel view for decode steps (``compute`` arithmetic) and a jitted cached forward
    ``fwd(view, ids, cache, tree_mask=None) -> (logits, cache)``."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(st, ids, cache, tree_mask=None):
        out = nnx.merge(graphdef, st)(ids, cache=cache, tree_mask=tree_mask)
        return out.logits, out.cache
    return panels.decode_state(model, state, compute=compute, rows=1), fwd


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_verify_of_any_rows_equals_its_decode_steps(wide, compute):
    """In the panel view a cached forward of T rows (a chain or tree verify) gives each row's
    logits and keys bit for bit as T one-row decode steps do, for T up to past 8 (where XLA's CPU
    reduction changes its order: the norms run on the kernel)."""
    view, fwd = _decode_forward(wide, compute)
    cfg = wide.config
    rng = np.random.default_rng(7)
    _, cache = fwd(view, jnp.asarray(rng.integers(1, cfg.vocab_size, (1, 30)), jnp.int32), KVCache.init(cfg, 1, 64))
    extra = rng.integers(1, cfg.vocab_size, 12).tolist()
    steps, c1 = [], cache
    for t in extra:
        lg, c1 = fwd(view, jnp.asarray([[t]], jnp.int32), c1)
        steps.append(np.asarray(lg)[0, -1])
    for T in (4, 8, 9, 12):
        lg, cT = fwd(view, jnp.asarray([extra[:T]], jnp.int32), cache)
        np.testing.assert_array_equal(np.asarray(lg)[0], np.stack(steps[:T]))
        for a, b in zip(cT.k, c1.k):
            np.testing.assert_array_equal(np.asarray(a)[..., :30 + T, :], np.asarray(b)[..., :30 + T, :])


@pytest.mark.parametrize("D", [64, 128, 24])
def test_a_query_does_not_see_the_slots_past_its_own(D):
    """A query's output is the same bits whether its slot range stops at its own slot (a decode
    step, a chain verify) or runs on over masked tree slots (a tree verify): a chain-shaped tree's
    rows equal decode attention at their own positions, bit for bit, for every length mod 16."""
    B, T, Hq, Hkv, S = 1, 7, 6, 2, 96
    rng = np.random.default_rng(D)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)) * 3, jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    chain = jnp.asarray(np.tril(np.ones((T, T), bool))[None])
    for base in range(40, 57):  # the tree's first slot: every phase of the 16-slot blocks
        pos = jnp.asarray(base + np.arange(T)[None], jnp.int32)
        tree = panels.tree_attention(q, k, v, pos, jnp.asarray([base], jnp.int32), chain, window=None, scale=0.125)
        own = panels.decode_attention(q, k, v, pos, window=None, scale=0.125)
        np.testing.assert_array_equal(np.asarray(tree), np.asarray(own))


@pytest.mark.parametrize("D", [64, 128])
def test_a_tree_row_equals_a_decode_step_over_its_accepted_path(D):
    """A branching tree's row attends its ancestors among the tree's slots; once its path is the
    cache's next slots (what acceptance leaves), a decode step at its position gives the same bits."""
    parents = [-1, -1, 0, 1, 2, 2, 4]  # (0,), (1,), (0,0), (1,0), (0,0,0), (0,0,1), (0,0,0,0)
    T, Hq, Hkv, S = len(parents), 6, 2, 96
    anc = np.zeros((T, T), bool)
    for t in range(T):
        a = t
        while a >= 0:
            anc[t, a] = True
            a = parents[a]
    rng = np.random.default_rng(D + 1)
    q = jnp.asarray(rng.standard_normal((1, T, Hq, D)) * 3, jnp.float32)
    k = rng.standard_normal((1, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, S, D)).astype(np.float32)
    depth = anc.sum(1) - 1
    for base in range(40, 57):
        tree = np.asarray(panels.tree_attention(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(base + depth[None]),
                                                jnp.asarray([base], jnp.int32), jnp.asarray(anc[None]), window=None,
                                                scale=0.125))
        for t in range(T):
            path = np.flatnonzero(anc[t])  # ancestors in slot order, then itself
            k2, v2 = k.copy(), v.copy()
            k2[:, :, base:base + len(path)] = k[:, :, base + path]
            v2[:, :, base:base + len(path)] = v[:, :, base + path]
            own = panels.decode_attention(q[:, t:t + 1], jnp.asarray(k2), jnp.asarray(v2),
                                          jnp.asarray([[base + depth[t]]], jnp.int32), window=None, scale=0.125)
            np.testing.assert_array_equal(tree[:, t:t + 1], np.asarray(own))


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_tree_verify_row_equals_the_decode_steps_over_its_path(wide, compute):
    """In the panel view each row of a branching tree verify (tree mask, positions by depth) gives
    the logits that decode steps over its root-to-node path give, bit for bit: so a tree loop
    accepts exactly the tokens target-only decoding makes, in bf16 too."""
    from specjax.decode.tree import TokenTree

    tree = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)])
    view, fwd = _decode_forward(wide, compute)
    cfg = wide.config
    rng = np.random.default_rng(11)
    _, cache = fwd(view, jnp.asarray(rng.integers(1, cfg.vocab_size, (1, 37)), jnp.int32), KVCache.init(cfg, 1, 64))
    tokens = rng.integers(1, cfg.vocab_size, tree.num_nodes + 1)
    lg, _ = fwd(view, jnp.asarray(tokens[None], jnp.int32), cache, jnp.asarray(tree.mask))
    lg = np.asarray(lg)[0]
    for node in range(tree.num_nodes + 1):
        path = tree.path_nodes[node][tree.path_nodes[node] >= 0]
        c = cache
        for t in tokens[path]:
            step, c = fwd(view, jnp.asarray([[t]], jnp.int32), c)
        np.testing.assert_array_equal(lg[node], np.asarray(step)[0, -1], err_msg=f"node {node}, path {path.tolist()}")
