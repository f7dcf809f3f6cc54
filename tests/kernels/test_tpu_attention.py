"""TPU attention kernels (specjax.kernels.tpu): numerics in Pallas interpret mode on the CPU
against the XLA path with the models' own masks, the selection rule, and deviceless compiles
for v5e/v6e (libtpu) with temp memory of the flash path against the XLA path.

Tolerances (max abs error; inputs N(0, 1), outputs O(1)): float32 forward <= 1e-5 (measured
~1e-6); float32 gradients <= 1e-5 relative to the largest gradient entry; bfloat16 <= 2e-2
(one or two bf16 ulps at 1.0: splash pre-scales q in bf16 and feeds bf16 probabilities to the
second matmul, as the XLA path rounds differently).
"""

from __future__ import annotations

import os

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # quiets libtpu's host checks
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from specjax import placement  # noqa: E402
from specjax.kernels import tpu as kt  # noqa: E402
from specjax.models.drafts.dflash import block_mask  # noqa: E402
from specjax.models.drafts.eagle3 import ttt_mask  # noqa: E402
from specjax.models.layers import attend, attend_cache, causal_mask  # noqa: E402

F32_TOL, BF16_TOL = 1e-5, 2e-2


def rnd(i, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32).astype(dtype)


def err(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def flash(spec, dtype=jnp.float32):
    return jax.jit(lambda q, k, v: kt.tpu_attention(q, k, v, mask_spec=spec, impl="pallas", interpret=True))


# packed row: documents 0, 1, 2 and padding (-1); T = 200 is not a multiple of 128 (padded inside)
DOCS = jnp.array([[0] * 60 + [1] * 70 + [2] * 40 + [-1] * 30, [0] * 120 + [3] * 80])


def test_causal_specs_are_the_models_masks():
    """What each causal spec admits is exactly the mask the target / MTP build (the XLA path)."""
    T = DOCS.shape[1]
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    valid = jnp.arange(T)[None] < jnp.array([[150], [200]])
    same = DOCS[:, None, :, None] == DOCS[:, None, None, :]
    for spec, ref in [(kt.causal(), causal_mask(pos, pos[0])),
                      (kt.causal(window=37), causal_mask(pos, pos[0], sliding_window=37)),
                      (kt.causal(window=37, segment_ids=DOCS), causal_mask(pos, pos[0], sliding_window=37) & same),
                      (kt.causal(kv_valid=valid), causal_mask(pos, pos[0], kv_valid=valid)),
                      (kt.ttt(DOCS, window=None, steps_before=0), ttt_mask(DOCS, None, 0))]:
        assert bool(jnp.all(kt.dense_mask(spec, T, T) == ref)), spec


@pytest.mark.parametrize("case", ["window_gqa", "packed_padded", "kv_valid"])
def test_flash_matches_attend_f32(case):
    """window_gqa: T = 256 (no padding, static mask only); packed_padded: T = 200 (padded to 256
    inside) with document segment ids and a window; kv_valid: HF padding of keys."""
    B, Hq, Hkv, D = 2, 4, 2, 64
    T = 256 if case == "window_gqa" else 200
    q, k, v = rnd(0, (B, T, Hq, D)), rnd(1, (B, T, Hkv, D)), rnd(2, (B, T, Hkv, D))
    valid = jnp.arange(T)[None] < jnp.array([[150], [200]])
    spec = {"window_gqa": kt.causal(window=100), "packed_padded": kt.causal(window=37, segment_ids=DOCS),
            "kv_valid": kt.causal(kv_valid=valid)}[case]
    out = flash(spec)(q, k, v)
    ref = attend(q, k, v, kt.dense_mask(spec, T, T))
    assert err(out, ref) <= F32_TOL


def test_under_a_mesh_runs_in_shard_map():
    """With a mesh set around the trace (``jax.set_mesh``) both entry points run the kernel inside
    shard_map over it; the result is the unsharded one."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    B, T, Hq, Hkv, D = 2, 128, 2, 1, 128
    q, k, v = rnd(0, (B, T, Hq, D)), rnd(1, (B, T, Hkv, D)), rnd(2, (B, T, Hkv, D))
    spec = kt.causal(segment_ids=DOCS[:, :T])
    f = jax.jit(lambda q, k, v: kt.tpu_attention(q, k, v, mask_spec=spec, impl="pallas", interpret=True))
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(f)(q, k, v))
        out = f(q, k, v)
    assert "shard_map" in jaxpr
    assert err(out, attend(q, k, v, kt.dense_mask(spec, T, T))) <= F32_TOL


def test_tree_verify_under_a_mesh_runs_in_shard_map():
    """The tree verify's cache part runs the decode kernel inside shard_map (with its log-sum-exp
    sharded as the output); the result is the unsharded one."""
    from specjax.models.layers import tree_cache_mask

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    q, k, v, nk, nv, lengths, q_pos, tm = _tree_case(B=2)
    f = jax.jit(lambda *a: kt.tree_cache_attention(*a, interpret=True, block_kv=128))
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(f)(q, k, v, nk, nv, lengths, q_pos, tm))
        out = f(q, k, v, nk, nv, lengths, q_pos, tm)
    assert "shard_map" in jaxpr
    assert err(out, attend_cache(q, k, v, tree_cache_mask(q_pos, lengths, tm, k.shape[2]))) <= F32_TOL


def test_flash_bf16_tolerance():
    B, T, Hq, Hkv, D = 1, 256, 4, 1, 128
    q, k, v = (rnd(i, (B, T, h, D), jnp.bfloat16) for i, h in ((0, Hq), (1, Hkv), (2, Hkv)))
    spec = kt.causal(window=100)
    ref = attend(q, k, v, kt.dense_mask(spec, T, T))
    out = flash(spec)(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert 0 < err(out, ref) <= BF16_TOL  # bf16 rounding shows, within the stated bound


def _grads(f, q, k, v):
    w = rnd(9, q.shape)  # a fixed random cotangent
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)


def _check_fwd_bwd(spec, ref_mask, q, k, v):
    f = lambda q, k, v: kt.tpu_attention(q, k, v, mask_spec=spec, impl="pallas", interpret=True)
    r = lambda q, k, v: attend(q, k, v, ref_mask)
    assert err(jax.jit(f)(q, k, v), r(q, k, v)) <= F32_TOL
    for g, gr in zip(_grads(f, q, k, v), _grads(r, q, k, v)):
        assert err(g, gr) <= F32_TOL * float(jnp.max(jnp.abs(gr)))


@pytest.mark.parametrize("steps_before,window", [(2, 24)])
def test_ttt_mask_forward_and_grads(steps_before, window):
    B, T, Hq, Hkv, D = 2, 200, 4, 2, 64
    S = (steps_before + 1) * T
    spec = kt.ttt(DOCS, window=window, steps_before=steps_before)
    ref_mask = ttt_mask(DOCS, window, steps_before)
    assert bool(jnp.all(kt.dense_mask(spec, T, S) == ref_mask))
    _check_fwd_bwd(spec, ref_mask, rnd(0, (B, T, Hq, D)), rnd(1, (B, S, Hkv, D)), rnd(2, (B, S, Hkv, D)))


@pytest.mark.parametrize("window,non_causal", [(16, False)])
def test_dflash_block_mask_forward_and_grads(window, non_causal):
    B, T, Hq, Hkv, D, Bk = 2, 200, 4, 2, 64, 8
    anchors = jnp.array([[3, 50, 70, 90, 120], [10, 20, 99, 130, 150]])
    m = block_mask(DOCS, anchors, Bk, window=window, non_causal=non_causal)
    Q, S = anchors.shape[1] * Bk, T + anchors.shape[1] * Bk
    _check_fwd_bwd(kt.dense(m), m, rnd(0, (B, Q, Hq, D)), rnd(1, (B, S, Hkv, D)), rnd(2, (B, S, Hkv, D)))


@pytest.mark.parametrize("dtype,window,seq_major", [(jnp.float32, None, False), (jnp.float32, 50, True),
                                                    (jnp.bfloat16, None, False)])
def test_decode_reads_only_valid_slots(dtype, window, seq_major):
    """k = 4 verify queries per sequence over a 384-slot cache with ragged lengths; every slot at
    or past a sequence's length holds NaN, which must not reach the output."""
    B, T, Hq, Hkv, D, S = 3, 4, 8, 2, 128, 384
    lengths = jnp.array([5, 200, 379])
    pos = lengths[:, None] + jnp.arange(T)[None] - T  # the last T written slots
    q, k, v = rnd(0, (B, T, Hq, D), dtype), rnd(1, (B, Hkv, S, D), dtype), rnd(2, (B, Hkv, S, D), dtype)
    ref = attend_cache(q, k, v, causal_mask(pos, jnp.arange(S), sliding_window=window))
    stale = jnp.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
    kn, vn = jnp.where(stale, jnp.nan, k), jnp.where(stale, jnp.nan, v)
    if seq_major:
        kn, vn = jnp.swapaxes(kn, 1, 2), jnp.swapaxes(vn, 1, 2)
    lo, hi = kt.position_ranges(pos, window)
    out = jax.jit(lambda q, k, v, lo, hi: kt.cache_attention(q, k, v, lo, hi, seq_major=seq_major, impl="pallas",
                                                             interpret=True, block_kv=128))(q, kn, vn, lo, hi)
    assert not bool(jnp.any(jnp.isnan(out)))
    assert err(out, ref) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL)
    # the XLA path of the same entry point agrees on a finite cache
    assert err(kt.cache_attention(q, k, v, lo, hi, impl="xla"), ref) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL)


def test_decode_draft_chain_ranges_and_empty_rows():
    """Per-query ranges as a draft chain step uses them (cache_range), and a query with an empty
    range gets zeros."""
    from specjax.models.drafts.common import cache_mask, cache_range

    B, Hq, Hkv, D, S = 2, 4, 4, 128, 256
    base = jnp.array([[10], [140]])
    hi = base + 3
    lo_r, hi_r = cache_range(base, window=None, hi=hi)
    q, k, v = rnd(0, (B, 1, Hq, D)), rnd(1, (B, S, Hkv, D)), rnd(2, (B, S, Hkv, D))
    ref = attend(q, k, v, cache_mask(S, base, lo=base + 1, hi=hi))
    run = jax.jit(lambda lo, hi: kt.cache_attention(q, k, v, lo, hi, seq_major=True, impl="pallas", interpret=True))
    assert err(run(lo_r, hi_r), ref) <= F32_TOL
    out = run(jnp.array([[5], [0]]), jnp.array([[4], [S - 1]]))  # sequence 0: empty range
    assert float(jnp.max(jnp.abs(out[0]))) == 0.0
    assert err(out[1], attend(q[1:], k[1:], v[1:])[0]) <= F32_TOL


def _tree_case(B=3, T=6, Hq=8, Hkv=2, D=128, S=384, dtype=jnp.float32):
    """A token-tree verify as the target runs it: T nodes of vLLM's example tree plus a root row,
    written at slots ``lengths + t`` of a cache whose slots past the tree hold NaN."""
    from specjax.decode.tree import TokenTree

    tree = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    tm = jnp.asarray(tree.mask)
    assert tm.shape == (T, T)
    lengths = jnp.array([0, 150, 378 - T])[:B]  # an empty committed prefix, a block edge, nearly full
    q_pos = lengths[:, None] + jnp.asarray(tree.depth)[None]
    q = rnd(0, (B, T, Hq, D), dtype)
    nk, nv = rnd(1, (B, T, Hkv, D), dtype), rnd(2, (B, T, Hkv, D), dtype)
    k, v = rnd(3, (B, Hkv, S, D), dtype), rnd(4, (B, Hkv, S, D), dtype)
    slots = lengths[:, None] + jnp.arange(T)[None]
    k = jax.vmap(lambda c, s, n: c.at[:, s].set(jnp.swapaxes(n, 0, 1)))(k, slots, nk)
    v = jax.vmap(lambda c, s, n: c.at[:, s].set(jnp.swapaxes(n, 0, 1)))(v, slots, nv)
    return q, k, v, nk, nv, lengths, q_pos, tm


@pytest.mark.parametrize("dtype,window", [(jnp.float32, None), (jnp.float32, 40), (jnp.bfloat16, None)])
def test_tree_verify_kernel_matches_the_tree_mask(dtype, window):
    """The Pallas tree verify (committed blocks on the decode kernel with its log-sum-exp, merged
    with the tree rows) equals XLA's attention over ``tree_cache_mask``, with an empty committed
    prefix, a sliding window and GQA; NaN in the slots past the tree never reaches the output."""
    from specjax.models.layers import tree_cache_mask

    q, k, v, nk, nv, lengths, q_pos, tm = _tree_case(dtype=dtype)
    S = k.shape[2]
    ref = attend_cache(q, k, v, tree_cache_mask(q_pos, lengths, tm, S, sliding_window=window))
    stale = jnp.arange(S)[None, None, :, None] >= (lengths + tm.shape[0])[:, None, None, None]
    kn, vn = jnp.where(stale, jnp.nan, k), jnp.where(stale, jnp.nan, v)
    run = jax.jit(lambda *a: kt.tree_cache_attention(*a, window=window, interpret=True, block_kv=128))
    out = run(q, kn, vn, nk, nv, lengths, q_pos, tm)
    assert out.dtype == q.dtype and not bool(jnp.any(jnp.isnan(out)))
    assert err(out, ref) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL)


def test_decode_lse_is_the_logits_logsumexp():
    """``return_lse``: each query head's log-sum-exp over its range (-inf for an empty range), and
    two disjoint ranges merged by :func:`merge_attention` give attention over their union."""
    B, T, Hq, Hkv, D, S = 2, 3, 4, 2, 128, 256
    q, k, v = rnd(0, (B, T, Hq, D)), rnd(1, (B, Hkv, S, D)), rnd(2, (B, Hkv, S, D))
    lo, hi = jnp.array([[0, 5, 9], [4, 0, 3]]), jnp.array([[99, 130, 8], [200, 255, 60]])  # [9, 8]: empty
    run = jax.jit(lambda lo, hi: kt.decode_attention(q, k, v, lo, hi, interpret=True, block_kv=128,
                                                     return_lse=True))
    out, lse = run(lo, hi)
    kk = jnp.repeat(k, Hq // Hkv, axis=1)  # [B, Hq, S, D]
    s = jnp.einsum("bthd,bhsd->bths", q, kk) * D ** -0.5
    j = jnp.arange(S)
    vis = (j >= lo[..., None, None]) & (j <= hi[..., None, None])
    want = jax.nn.logsumexp(jnp.where(vis, s, -jnp.inf), axis=-1)
    assert bool(jnp.isneginf(lse[0, 2]).all()) and float(jnp.abs(out[0, 2]).max()) == 0.0
    fin = jnp.isfinite(want)
    assert float(jnp.max(jnp.abs(jnp.where(fin, lse - want, 0.0)))) <= F32_TOL
    mid = (lo + hi) // 2
    a, la = run(lo, mid)
    b, lb = run(mid + 1, hi)
    assert err(kt.merge_attention(a, la, b, lb), out) <= F32_TOL


def test_errors_name_what_was_found():
    q, k = jnp.zeros((1, 8, 3, 64)), jnp.zeros((1, 8, 2, 64))
    with pytest.raises(kt.KernelShapeError, match="query heads 3 are not a multiple of kv heads 2"):
        kt.tpu_attention(q, k, k, mask_spec=kt.causal(), impl="pallas", interpret=True)
    with pytest.raises(kt.MaskSpecError, match="ttt spec implies 16 keys for 8 queries, got k with 8"):
        kt.tpu_attention(jnp.zeros((1, 8, 2, 64)), k, k, mask_spec=kt.ttt(jnp.zeros((1, 8), jnp.int32), window=None,
                                                                         steps_before=1), impl="pallas")
    with pytest.raises(kt.MaskSpecError, match="mask kind 'banded'"):
        kt.MaskSpec("banded")
    with pytest.raises(kt.KernelShapeError, match="head_dim a multiple of 128; got 64"):
        kt.cache_attention(jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 128, 2, 64)), jnp.zeros((1, 128, 2, 64)),
                           jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), seq_major=True, impl="pallas")
    with pytest.raises(kt.KernelShapeError, match="cache length 1200 has no kv block"):
        kt.cache_attention(jnp.zeros((1, 1, 2, 128)), jnp.zeros((1, 2, 1200, 128)), jnp.zeros((1, 2, 1200, 128)),
                           jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), impl="pallas")
    with pytest.raises(kt.AttentionImplError, match="'cudnn' is not one of"):
        kt.tpu_attention(q, q, q, mask_spec=kt.causal(), impl="cudnn")


def test_impl_follows_placement_not_default_backend():
    assert jax.default_backend() == "cpu"
    assert kt.attention_impl() == "xla"
    assert kt.attention_impl(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))) == "xla"
    assert kt.attention_impl("tpu") == "pallas"
    with placement.building_for("tpu"):
        assert kt.attention_impl() == "pallas"


# ---------------------------------------------------------------- deviceless TPU compiles

@pytest.fixture
def no_persistent_cache():
    """A deviceless TPU executable cannot be read back from the persistent compilation cache
    (the reader needs a TPU client): don't write any while compiling for a topology."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # the "is the cache used" answer is memoised at the first compile
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def _topology_mesh(name):
    pytest.importorskip("libtpu", reason="libtpu not installed: pip install 'jax[tpu]==0.10.2' to compile for TPU")
    from jax.experimental import topologies
    from jax.sharding import Mesh

    topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    return Mesh(np.array(topo.devices).reshape(1, 1, 8), ("data", "fsdp", "tensor"))


def _abstract(mesh, shape, dtype, spec):
    from jax.sharding import NamedSharding

    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_compiles_for_tpu_and_temp_does_not_grow_with_t_squared(topology, record_property, no_persistent_cache):
    """Llama-3.1-8B attention shapes (32 q / 8 kv heads of 128) on tensor=8 at T = 4096: a
    packed-row train step (forward + backward) and a B=8 verify step over a 4096-slot cache."""
    from jax.sharding import PartitionSpec as P

    mesh = _topology_mesh(topology)
    assert kt.attention_impl(mesh) == "pallas"
    T, Hq, Hkv, D = 4096, 32, 8, 128
    act = P(None, None, "tensor", None)
    q, k = _abstract(mesh, (1, T, Hq, D), jnp.bfloat16, act), _abstract(mesh, (1, T, Hkv, D), jnp.bfloat16, act)
    doc = _abstract(mesh, (1, T), jnp.int32, P(None, None))

    def attn(impl):
        return lambda q, k, v, doc: kt.tpu_attention(q, k, v, mask_spec=kt.causal(segment_ids=doc), mesh=mesh,
                                                     impl=impl)

    def loss(q, k, v, doc):
        return jnp.sum(attn("pallas")(q, k, v, doc).astype(jnp.float32))

    train = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, doc).compile()
    fwd = {impl: jax.jit(attn(impl)).lower(q, k, k, doc).compile() for impl in ("pallas", "xla")}
    for impl, c in fwd.items():
        assert ("tpu_custom_call" in c.as_text()) == (impl == "pallas")
    temp = {"pallas_train": train.memory_analysis().temp_size_in_bytes,
            **{impl: c.memory_analysis().temp_size_in_bytes for impl, c in fwd.items()}}
    record_property("temp_bytes", temp)
    print(f"\n{topology} T={T} temp per chip: forward pallas {temp['pallas'] / 2**20:.2f} MiB, xla "
          f"{temp['xla'] / 2**20:.1f} MiB; pallas forward+backward {temp['pallas_train'] / 2**20:.2f} MiB")
    assert max(temp["pallas"], temp["pallas_train"]) < 16 * 2**20  # O(T): blocks and residuals only
    assert temp["xla"] >= (Hq // 8) * T * T * 4  # the f32 scores of this chip's 4 heads

    if topology.startswith("v5e"):  # the training masks of the drafts, forward + backward (smaller T)
        Tt, Q = 1024, 512
        qt = _abstract(mesh, (1, Tt, Hq, D), jnp.bfloat16, act)
        k3 = _abstract(mesh, (1, 3 * Tt, Hkv, D), jnp.bfloat16, act)
        dt = _abstract(mesh, (1, Tt), jnp.int32, P(None, None))
        qb, kb = _abstract(mesh, (1, Q, Hq, D), jnp.bfloat16, act), _abstract(mesh, (1, Tt + Q, Hkv, D), jnp.bfloat16, act)
        mb = _abstract(mesh, (1, 1, Q, Tt + Q), jnp.bool_, P(None, None, None, None))
        for name, spec_of, args in (("ttt", lambda a: kt.ttt(a, window=None, steps_before=2), (qt, k3, k3, dt)),
                                    ("dflash", kt.dense, (qb, kb, kb, mb))):
            g = jax.grad(lambda q, k, v, a: jnp.sum(kt.tpu_attention(q, k, v, mask_spec=spec_of(a), mesh=mesh)
                                                    .astype(jnp.float32)), argnums=(0, 1, 2))
            c = jax.jit(g).lower(*args).compile()
            assert "tpu_custom_call" in c.as_text()
            print(f"{topology} {name} forward+backward temp per chip: {c.memory_analysis().temp_size_in_bytes / 2**20:.2f} MiB")

    B, S, kq = 8, 4096, 4
    qd = _abstract(mesh, (B, kq, Hq, D), jnp.bfloat16, act)
    cache = _abstract(mesh, (B, Hkv, S, D), jnp.bfloat16, P(None, "tensor", None, None))
    pos = _abstract(mesh, (B, kq), jnp.int32, P(None, None))

    def verify(q, k, v, pos):
        lo, hi = kt.position_ranges(pos)
        return kt.cache_attention(q, k, v, lo, hi, mesh=mesh)

    c = jax.jit(verify).lower(qd, cache, cache, pos).compile()
    assert "tpu_custom_call" in c.as_text()
    # the kernel's CostEstimate: XLA charges the call its upper bound (this chip's K and V slices
    # whole, every query row against every slot) instead of nothing
    kv_chip = 2 * B * (Hkv // 8) * S * D * 2
    cost = c.cost_analysis()
    assert cost["bytes accessed"] >= kv_chip, cost["bytes accessed"]
    assert cost["flops"] >= 4 * B * kq * (Hq // 8) * S * D, cost["flops"]
    print(f"{topology} verify B={B} k={kq} S={S} temp per chip: {c.memory_analysis().temp_size_in_bytes / 2**20:.2f} MiB")


# ----------------------------------------------------------------------------- the models' TPU path


def _tpu_path_vs_xla(fn, *args):
    """``fn`` jitted twice: the XLA path (this CPU program) and the models' TPU path (Pallas
    kernels in interpret mode). Two distinct jits: the platform is not part of jit's cache key."""
    ref = jax.jit(lambda *a: fn(*a))(*args)
    with kt.pallas_interpret():
        got = jax.jit(lambda *a: fn(*a))(*args)
    return got, ref


def test_target_tpu_path_matches_xla():
    """CausalLM on the TPU path: no cache (with padding), prefill into a cache then a 3-token
    verify step or a 6-node token-tree verify, and a packed prefill of two sequences plus padding
    give the XLA path's logits and caches (float32, <= 1e-5)."""
    from flax import nnx

    from specjax.decode.tree import TokenTree
    from specjax.models.config import TargetConfig
    from specjax.models.target import KVCache, build_model
    from tests.sharding.tiny import target_config

    # qwen3's tiny config: layer 0 full attention, layer 1 a sliding window of 4
    model = build_model(TargetConfig.from_hf(target_config("qwen3", 2)), rngs=nnx.Rngs(0))
    gd, st = nnx.split(model)
    B, T = 2, 20
    ids = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, model.config.vocab_size)
    lens = jnp.array([20, 13])
    am = jnp.arange(T)[None] < lens[:, None]
    seg = jnp.array([0] * 7 + [1] * 9 + [2] * 4)  # 2 >= B: padding
    ppos = jnp.array(list(range(7)) + list(range(9)) + [0] * 4)[None]
    tree_mask = jnp.asarray(TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]).mask)

    def fwd(st):
        m = nnx.merge(gd, st)
        plain = m(ids, attention_mask=am).logits
        pre = m(ids, cache=KVCache.init(m.config, B, 64), attention_mask=am,
                positions=jnp.broadcast_to(jnp.arange(T), (B, T)))
        ver = m(ids[:, :3], cache=pre.cache)
        tree = m(ids[:, 3:9], cache=pre.cache, tree_mask=tree_mask)  # vLLM's example tree and its root
        packed = m(ids[:1], cache=KVCache.init(m.config, B, 64), segments=seg, positions=ppos)
        return (plain, pre.logits, ver.logits, ver.cache.k, tree.logits, tree.cache.v, packed.logits[0, :16],
                packed.cache.v)

    got, ref = _tpu_path_vs_xla(fwd, st)
    keep = np.asarray(am)[..., None]
    for g, r in zip(got[:2], ref[:2]):  # padded query rows are garbage on both paths
        np.testing.assert_allclose(np.where(keep, g, 0), np.where(keep, r, 0), atol=F32_TOL)
    for g, r in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(ref[2:])):
        np.testing.assert_allclose(g, r, atol=F32_TOL)


def test_packed_rows_without_cache_equal_separate_forwards():
    """Training's online target: rows packing several sequences (``segments`` without a cache, each
    sequence at its own positions from 0, padding a segment of its own) give each sequence's tapped
    states as a forward of that sequence alone, on the XLA path and on the TPU path (Pallas in
    interpret mode); the sliding-window layer included (float32, <= 1e-5)."""
    from flax import nnx

    from specjax.models.config import TargetConfig
    from specjax.models.target import build_model
    from tests.sharding.tiny import target_config

    model = build_model(TargetConfig.from_hf(target_config("qwen3", 2)), rngs=nnx.Rngs(0))
    gd, st = nnx.split(model)
    lens = [[7, 9], [12, 5]]  # two rows: sequences of 7 and 9 tokens, of 12 and 5, then padding to 20
    T = 20
    ids = jax.random.randint(jax.random.PRNGKey(2), (2, T), 0, model.config.vocab_size)
    seg = np.full((2, T), -1, np.int32)
    pos = np.zeros((2, T), np.int32)
    for b, row in enumerate(lens):
        o = 0
        for k, n in enumerate(row):
            seg[b, o: o + n], pos[b, o: o + n] = k, np.arange(n)
            o += n
    taps = (0, 1, 2)

    def fwd(st):
        out = nnx.merge(gd, st)(ids, segments=jnp.asarray(seg), positions=jnp.asarray(pos), tap_ids=taps,
                                return_logits=False)
        return jnp.stack(out.aux_hidden_states, axis=2)

    got, ref = _tpu_path_vs_xla(fwd, st)
    for b, row in enumerate(lens):
        o = 0
        for n in row:
            alone = jnp.stack(model(ids[b: b + 1, o: o + n], tap_ids=taps).aux_hidden_states, axis=2)[0]
            np.testing.assert_allclose(np.asarray(ref[b, o: o + n]), np.asarray(alone), atol=F32_TOL)
            np.testing.assert_allclose(np.asarray(got[b, o: o + n]), np.asarray(alone), atol=F32_TOL)
            o += n
    with pytest.raises(ValueError, match="segments"):
        model(ids, segments=jnp.asarray(seg[0]), positions=jnp.asarray(pos))


@pytest.mark.parametrize("algo", ["eagle3", "peagle", "dflash", "mtp"])
def test_draft_training_tpu_path_matches_xla(algo):
    """Each draft's training forward on the TPU path (EAGLE-3 TTT specs, P-EAGLE / DFlash dense
    masks with empty rows zeroed, MTP packed causal as segment ids) equals the XLA path on a
    packed row with two documents and padding."""
    import bridge
    from flax import nnx

    from specjax.models.drafts.load import build_draft
    from tests.sharding.tiny import H, V, draft_config

    d = build_draft(bridge.parse_config(draft_config(algo)), rngs=nnx.Rngs(0))
    gd, st = nnx.split(d)
    B, T = 2, 24
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32)
    doc = jnp.asarray([[0] * 10 + [1] * 10 + [-1] * 4, [0] * 24], jnp.int32)
    pos = jnp.asarray([list(range(10)) * 2 + [0] * 4, list(range(24))], jnp.int32)
    ones = jnp.ones((B, T), jnp.int32)
    hs = jnp.asarray(rng.standard_normal((B, T, getattr(d, "num_aux", 1) * H)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)

    def fwd(st):
        m = nnx.merge(gd, st)
        if algo == "eagle3":
            return m(hs, ids, doc, None, pos + 1, y, ttt_steps=3)[:2]
        if algo == "peagle":  # row 0's anchor 22 is padding: its rows attend to nothing
            return m(hs, ids, doc, None, ones, y, anchor_pos=jnp.asarray([[0, 3, 3, 12, 21, 22], [1, 2, 2, 2, 5, 9]]),
                     depth=jnp.asarray([[0, 0, 1, 0, 0, 1], [0, 0, 1, 2, 0, 0]]))[:2]
        if algo == "dflash":
            return m(hs, ids, ones, y, doc, pos, anchor_positions=jnp.asarray([[1, 5, 12], [0, 7, 15]]))[:2]
        return m(ids, y, None, pos, ones)[:2] + m(ids, y, ones.at[1, 20:].set(0), None, ones)[:2]

    got, ref = _tpu_path_vs_xla(fwd, st)
    for g, r in zip(got, ref):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=F32_TOL)


def test_draft_decode_tpu_path_matches_xla():
    """EAGLE-3's decode (context rows into the draft cache, then a 3-step chain: the seq-major
    decode kernel, one kv head) and a DFlash block over its cache (dense flash) on the TPU path
    equal the XLA path."""
    import bridge
    from flax import nnx

    from specjax.models.drafts.load import build_draft
    from tests.sharding.tiny import H, V, draft_config

    B, n = 2, 6
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, V, (B, n)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(n), (B, n))
    nv = jnp.array([6, 4])
    for algo in ("eagle3", "dflash"):
        c = draft_config(algo)
        c["transformer_layer_config"]["num_key_value_heads"] = 1
        d = build_draft(bridge.parse_config(c), rngs=nnx.Rngs(0))
        gd, st = nnx.split(d)
        hs = jnp.asarray(rng.standard_normal((B, n, d.num_aux * H)), jnp.float32)

        def fwd(st):
            m = nnx.merge(gd, st)
            cache = m.init_cache(B, 32)
            if algo == "dflash":
                return m.block(m.extend(cache, hs, pos, nv), ids[:, 0], nv)
            return m.speculate(cache, hs, ids, pos, n_valid=nv, k=3)[:3]

        got, ref = _tpu_path_vs_xla(fwd, st)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(g, r, atol=F32_TOL)


def test_fast_eagle3_ttt_forward_tpu_path_matches_xla():
    """The train step's EAGLE-3 forward (``ttt_forward``) on the TPU path: each TTT step's keys
    (step 0's, then the later steps') on the flash kernel with the ``kt.ttt`` spec."""
    import bridge
    from flax import nnx

    from specjax.models.drafts.load import build_draft
    from specjax.train.fast_eagle3 import ttt_forward
    from tests.sharding.tiny import H, V, draft_config

    d = build_draft(bridge.parse_config(draft_config("eagle3")), rngs=nnx.Rngs(0))
    gd, st = nnx.split(d)
    rng = np.random.default_rng(3)
    B, T = 2, 24
    ids = jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32)
    doc = jnp.asarray([[0] * 10 + [1] * 10 + [-1] * 4, [0] * 24], jnp.int32)
    hs = jnp.asarray(rng.standard_normal((B, T, 3 * H)), jnp.float32)
    got, ref = _tpu_path_vs_xla(lambda st: ttt_forward(nnx.merge(gd, st), hs, ids, doc, ttt_steps=3)[:2], st)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=F32_TOL)


def test_flash_reports_the_blocks_it_runs():
    """The splash kernel is a custom call XLA counts as 0 flops: each traced flash call reports
    its forward flops from the blocks it runs. Causal 256 in 128-blocks: 3 of 4; a 100-token
    window over 512: the diagonal and the one below it, 7 of 16; a runtime (dense) mask: every
    block, flagged as an upper bound. Outside a collector nothing is recorded."""
    B, Hq, Hkv, D = 2, 4, 2, 64
    kw = dict(block_q=128, block_kv=128, interpret=True)
    cases = [(256, kt.causal(), 3, True), (512, kt.causal(window=100), 7, True),
             (256, kt.dense(jnp.tril(jnp.ones((B, 256, 256), bool))), 4, False)]
    for T, spec, blocks, exact in cases:
        q, k, v = rnd(0, (B, T, Hq, D)), rnd(1, (B, T, Hkv, D)), rnd(2, (B, T, Hkv, D))
        with kt.count_kernel_flops() as recs:
            jax.jit(lambda q, k, v: kt.flash_attention(q, k, v, mask=spec, **kw)).lower(q, k, v)
        (r,) = recs
        assert (r["blocks"], r["blocks_total"], r["exact"]) == (blocks, (T // 128) ** 2, exact), r
        assert r["flops"] == 4 * B * Hq * blocks * 128 * 128 * D
    jax.jit(lambda q, k, v: kt.flash_attention(q, k, v, mask=kt.causal(), **kw)).lower(q, k, v)
    from specjax.kernels.tpu import splash
    assert splash._COLLECTORS == []
