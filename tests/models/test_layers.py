"""Shared blocks against their transformers counterparts (PyTorch float32 CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models.layers import RMSNorm, attend, attend_cache, causal_mask, write_cache
from specjax.models.rope import RopeConfig, RopeConfigError, apply_rope, rope_cos_sin
from tests.models.conftest import rel_err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_matches_hf_cast_before_weight(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.normal(size=16)).astype(np.float32)
    ref = LlamaRMSNorm(16, eps=1e-6)
    ref.weight.data = torch.tensor(w)
    tdt = getattr(torch, dtype)
    ref = ref.to(tdt)
    want = ref(torch.tensor(x).to(tdt)).detach().float().numpy()
    n = RMSNorm(16, 1e-6, param_dtype=getattr(jnp, dtype))
    n.scale[...] = jnp.asarray(w, getattr(jnp, dtype))
    got = np.asarray(n(jnp.asarray(x, getattr(jnp, dtype))).astype(jnp.float32))
    tol = 1e-6 if dtype == "float32" else 0  # bf16 must agree bit-for-bit (same op order)
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_rmsnorm_unit_offset_matches_qwen3_5_style():
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    w = np.random.default_rng(2).normal(size=8).astype(np.float32) * 0.1
    n = RMSNorm(8, 1e-6, unit_offset=True)
    assert np.all(np.asarray(n.scale[...]) == 0)  # (1 + 0) = identity scale at init
    n.scale[...] = jnp.asarray(w)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * (1 + w)
    assert rel_err(n(jnp.asarray(x)), want) < 1e-6


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_cos_sin_match_hf(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=64,
                      rope_parameters=dict(ROPES[name]))
    rot = LlamaRotaryEmbedding(cfg)
    # dynamic: positions beyond max_position_embeddings stretch the base
    top = 100 if name == "dynamic" else 60
    pos = np.stack([np.arange(top - 20, top), np.arange(20)]).astype(np.int64)
    c_ref, s_ref = rot(torch.zeros(1, dtype=torch.float32), torch.tensor(pos))
    rc = RopeConfig.from_hf(cfg.to_dict(), head_dim=16)
    assert rc.rope_type == ROPES[name]["rope_type"]
    c, s = rope_cos_sin(jnp.asarray(pos, jnp.int32), rc)
    assert np.abs(np.asarray(c) - c_ref.numpy()).max() < 2e-6
    assert np.abs(np.asarray(s) - s_ref.numpy()).max() < 2e-6


def test_rope_legacy_keys_and_errors():
    rc = RopeConfig.from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 3.0}}, head_dim=8)
    assert (rc.rope_type, rc.theta, rc.factor) == ("linear", 5e5, 3.0)
    with pytest.raises(RopeConfigError, match="longrope"):
        RopeConfig.from_hf({"rope_parameters": {"rope_type": "longrope"}}, head_dim=8)
    with pytest.raises(RopeConfigError, match="factor"):
        RopeConfig.from_hf({"rope_parameters": {"rope_type": "linear"}}, head_dim=8)


def test_apply_rope_matches_hf_and_partial_passthrough():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)  # [B, T, H, D]
    rc = RopeConfig(head_dim=8, theta=100.0)
    pos = jnp.asarray(np.tile(np.arange(5), (2, 1)))
    c, s = rope_cos_sin(pos, rc)
    qt = torch.tensor(q).transpose(1, 2)
    want, _ = apply_rotary_pos_emb(qt, qt, torch.tensor(np.asarray(c)), torch.tensor(np.asarray(s)))
    assert np.abs(np.asarray(apply_rope(jnp.asarray(q), c, s)) - want.transpose(1, 2).numpy()).max() < 1e-6
    # partial rotary: the first 4 channels rotate, the rest pass through
    rp = RopeConfig(head_dim=8, theta=100.0, rotary_dim=4)
    c4, s4 = rope_cos_sin(pos, rp)
    out = np.asarray(apply_rope(jnp.asarray(q), c4, s4))
    assert c4.shape[-1] == 4 and np.array_equal(out[..., 4:], q[..., 4:])
    assert not np.allclose(out[:, 1:, :, :4], q[:, 1:, :, :4])


def test_attend_gqa_and_masks_match_naive_softmax():
    rng = np.random.default_rng(0)
    B, T, S, H, K, D = 2, 3, 7, 4, 2, 8
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k = rng.normal(size=(B, S, K, D)).astype(np.float32)
    v = rng.normal(size=(B, S, K, D)).astype(np.float32)
    mask = rng.random((B, 1, T, S)) < 0.6
    mask[..., 0] = True
    got = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), scale=D**-0.5))
    kk, vv = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, kk) * D**-0.5
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", p, vv)
    assert rel_err(got, want) < 1e-5
    # a per-head mask [B, H, T, S] is accepted too, and [B, T, S] broadcasts over heads
    got3 = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask[:, 0]), scale=D**-0.5)
    gotH = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(np.repeat(mask, H, 1)), scale=D**-0.5)
    assert np.allclose(got3, got, atol=1e-6) and np.allclose(gotH, got, atol=1e-6)


def test_heads_major_cache_write_and_attend_equal_seq_major():
    """write_cache + attend_cache over [B, Hkv, S, D] == scatter + attend over [B, S, Hkv, D]: GQA,
    ragged positions, dropped out-of-range slots, a query row with no visible key (uniform weights
    in both), bf16 inputs; and a bad mask shape is refused."""
    rng = np.random.default_rng(1)
    B, T, S, H, K, D = 3, 4, 9, 6, 2, 8
    cache = rng.normal(size=(B, S, K, D)).astype(np.float32)
    rows = rng.normal(size=(B, T, K, D)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3], [5, 6, 7, 8], [7, 8, 9, 10]], np.int32)  # row 2: slots 9, 10 dropped
    want_c = cache.copy()
    for b in range(B):
        for t in range(T):
            if pos[b, t] < S:
                want_c[b, pos[b, t]] = rows[b, t]
    got_c = write_cache(jnp.asarray(cache.transpose(0, 2, 1, 3)), jnp.asarray(pos), jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(got_c).transpose(0, 2, 1, 3), want_c)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    mask = np.array(causal_mask(jnp.asarray(pos), jnp.arange(S)))
    mask[1, :, 2] = False  # a query that sees nothing
    for dt, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
        kc = jnp.asarray(want_c, dt)
        want = attend(jnp.asarray(q, dt), kc, kc * 0.5, jnp.asarray(mask), scale=D**-0.5)
        got = attend_cache(jnp.asarray(q, dt), kc.transpose(0, 2, 1, 3), (kc * 0.5).transpose(0, 2, 1, 3),
                           jnp.asarray(mask), scale=D**-0.5)
        assert got.dtype == dt and got.shape == (B, T, H, D)
        assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < tol
    with pytest.raises(ValueError, match=r"mask shared by all heads"):
        attend_cache(jnp.asarray(q), kc.transpose(0, 2, 1, 3), kc.transpose(0, 2, 1, 3),
                     jnp.asarray(np.repeat(mask, H, 1)))


def test_causal_mask_sliding_window_rule():
    q = jnp.asarray([[5, 6]])
    m = np.asarray(causal_mask(q, jnp.arange(8), sliding_window=3))[0, 0]
    # HF: visible iff q - W < j <= q
    assert m[0].tolist() == [False, False, False, True, True, True, False, False]
    assert m[1].tolist() == [False, False, False, False, True, True, True, False]
    valid = jnp.asarray([[True] * 7 + [False]])
    assert not np.asarray(causal_mask(jnp.asarray([[7]]), jnp.arange(8), kv_valid=valid))[0, 0, 0, 7]


def test_blocks_have_hf_param_names():
    from flax import nnx

    from specjax.models.layers import DecoderLayer
    from specjax.models.params import param_paths

    layer = DecoderLayer(16, 32, 4, 2, 8, rngs=nnx.Rngs(0), qk_norm=True, attn_in_features=32, attention_bias=True)
    paths = {".".join(map(str, p)): tuple(v.shape) for p, v in param_paths(layer).items()}
    assert paths["self_attn.q_proj.kernel"] == (32, 32)  # in = 2 * hidden (EAGLE-3 first layer)
    assert paths["self_attn.k_proj.kernel"] == (32, 16)
    assert paths["self_attn.o_proj.kernel"] == (32, 16)
    assert paths["self_attn.q_norm.scale"] == (8,)
    assert paths["self_attn.q_proj.bias"] == (32,)
    assert {"input_layernorm.scale", "post_attention_layernorm.scale", "mlp.gate_proj.kernel", "mlp.up_proj.kernel",
            "mlp.down_proj.kernel"} <= set(paths)
    x = jax.random.normal(jax.random.key(0), (1, 4, 16))
    from specjax.models.rope import RopeConfig

    c, s = rope_cos_sin(jnp.arange(4)[None], RopeConfig(head_dim=8))
    with pytest.raises(TypeError):  # q/k/v expect 32-wide input
        layer(x, c, s)


# ----------------------------------------------------------------------------- low-precision matmuls


def _bf(x):
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("batch", [(), (2, 3)])
@pytest.mark.parametrize("M", [7, 32])
@pytest.mark.parametrize("K,N", [(5, 6), (20, 3)])
def test_dot_tn_is_the_row_contraction(batch, M, K, N):
    """``dot_tn(a, b) = a^T b`` over the rows, for f32 and bf16 operands (the CPU path transposes
    and zero-pads bf16 operands; M = 7 and 32 cover a ragged and a full pad; K, N = 20, 3 makes
    ``a`` the larger operand, computed as ``(b^T a)^T``)."""
    from specjax.models.layers import dot_tn

    rng = np.random.default_rng(0)
    a = rng.normal(size=(*batch, M, K)).astype(np.float32)
    b = rng.normal(size=(*batch, M, N)).astype(np.float32)
    want = np.einsum("...mk,...mn->...kn", a, b)
    got = dot_tn(jnp.asarray(a), jnp.asarray(b))
    assert got.dtype == jnp.float32 and got.shape == (*batch, K, N)
    assert rel_err(got, want) <= 1e-6
    ab, bb = np.asarray(_bf(a).astype(jnp.float32)), np.asarray(_bf(b).astype(jnp.float32))
    got = dot_tn(_bf(a), _bf(b))  # bf16 products are exact in f32: only the summation order differs
    assert got.dtype == jnp.float32 and rel_err(got, np.einsum("...mk,...mn->...kn", ab, bb)) <= 1e-6


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("keep_f32", [False, True])
def test_bmm_f32acc_values_and_grads(transpose_rhs, keep_f32):
    """float32: value and gradients equal autodiff of the einsum; bf16: the value is the float32
    product rounded once (or kept), gradients within bf16 rounding of the float32 ones."""
    from specjax.models.layers import bmm_f32acc

    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 9, 8)).astype(np.float32)
    w = rng.normal(size=(2, 3, 10, 8) if transpose_rhs else (2, 3, 8, 10)).astype(np.float32)
    ct = rng.normal(size=(2, 3, 9, 10)).astype(np.float32)
    eq = "bhmk,bhnk->bhmn" if transpose_rhs else "bhmk,bhkn->bhmn"

    def f_ref(x, w):
        return jnp.sum(jnp.einsum(eq, x.astype(jnp.float32), w.astype(jnp.float32)) * ct)

    def f(x, w):
        return jnp.sum(bmm_f32acc(x, w, transpose_rhs, keep_f32).astype(jnp.float32) * ct)

    v_ref, g_ref = jax.value_and_grad(f_ref, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    v, g = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    assert abs(float(v - v_ref)) <= 1e-5 * abs(float(v_ref))
    assert all(rel_err(a, b) <= 1e-6 for a, b in zip(g, g_ref))

    out = bmm_f32acc(_bf(x), _bf(w), transpose_rhs, keep_f32)
    exact = jnp.einsum(eq, _bf(x).astype(jnp.float32), _bf(w).astype(jnp.float32))
    assert out.dtype == (jnp.float32 if keep_f32 else jnp.bfloat16)
    assert rel_err(out.astype(jnp.float32), exact) <= (1e-6 if keep_f32 else 4e-3)
    gb = jax.grad(f, argnums=(0, 1))(_bf(x), _bf(w))
    assert [t.dtype for t in gb] == [jnp.bfloat16, jnp.bfloat16]
    assert all(rel_err(a.astype(jnp.float32), b) <= 2e-2 for a, b in zip(gb, g_ref))


def test_dense_bf16_accumulates_in_f32_and_f32_is_unchanged():
    """A bf16 linear layer runs ``bf16 x bf16 -> f32`` products (no f32 dot on upcast operands)
    and rounds once; a float32 one is exactly ``x @ kernel``, value and gradients."""
    from flax import nnx

    from specjax.models.layers import dense

    rng = np.random.default_rng(2)
    lin = dense(12, 7, bias=True, rngs=nnx.Rngs(0))
    lin.bias[...] = jnp.asarray(rng.normal(size=7), jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 5, 12)), jnp.float32)
    k, b = lin.kernel[...], lin.bias[...]
    assert np.array_equal(np.asarray(lin(x)), np.asarray(x @ k + b))
    gdef, params = nnx.split(lin)

    def loss(p, x, cast):
        m = nnx.merge(gdef, jax.tree.map(lambda a: a.astype(cast), p))
        return jnp.sum(m(x.astype(cast)).astype(jnp.float32) ** 2)

    g32 = jax.grad(loss)(params, x, jnp.float32)
    g_ref = jax.grad(lambda k, b: jnp.sum((x @ k + b) ** 2), argnums=(0, 1))(k, b)
    assert rel_err(g32["kernel"][...], g_ref[0]) <= 1e-6 and rel_err(g32["bias"][...], g_ref[1]) <= 1e-6
    jaxpr = jax.make_jaxpr(lambda p: jax.grad(loss)(p, x, jnp.bfloat16))(params)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots, "no dot in the bf16 layer"
    for sub in jaxpr.jaxpr.eqns:  # the custom-vjp bodies hold the products
        for v in sub.params.values():
            inner = getattr(v, "jaxpr", None)
            dots += [e for e in getattr(inner, "eqns", []) if e.primitive.name == "dot_general"]
    for e in dots:
        assert [str(a.aval.dtype) for a in e.invars] == ["bfloat16", "bfloat16"], e
        assert str(e.outvars[0].aval.dtype) == "float32", e
    gbf = jax.grad(loss)(params, x, jnp.bfloat16)
    assert rel_err(gbf["kernel"][...].astype(jnp.float32), g_ref[0]) <= 2e-2


def test_embed_follows_the_table_dtype():
    """A float32-built table cast to bf16 embeds in bf16 (nnx.Embed kept float32, which silently
    ran every downstream layer in float32); an explicit dtype wins; float ids are refused."""
    from flax import nnx

    from specjax.models.layers import Embed

    e = Embed(11, 4, rngs=nnx.Rngs(0))
    ids = jnp.asarray([[1, 3, 10]])
    assert e(ids).dtype == jnp.float32
    assert np.array_equal(np.asarray(e(ids)), np.asarray(e.embedding[...])[np.asarray(ids)])
    gdef, state = nnx.split(e)
    eb = nnx.merge(gdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), state))
    out = eb(ids)
    assert out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out.astype(jnp.float32)),
                          np.asarray(e.embedding[...].astype(jnp.bfloat16).astype(jnp.float32))[np.asarray(ids)])
    assert Embed(11, 4, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)(ids).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="integers"):
        e(ids.astype(jnp.float32))
