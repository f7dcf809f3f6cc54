"""`specjax plan`: the recipe's real programs compiled for TPU topologies on this CPU host
(libtpu, deviceless), on a scaled-down Llama-3.1-8B (8B widths, 2 layers, short rows), and the
platform-specific code paths chosen from the devices a program is built for."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # quiets libtpu's host checks
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest -n 2: two processes load libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from specjax.plan import CHIPS, plan  # noqa: E402
from specjax.models.layer_scan import layer_scan  # noqa: E402
from specjax.train.config import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "eagle3-llama3.1-8b-tpu.yaml"
# 8B widths, 2 target layers (aux taps 0 and 1), one TTT step, AdamW: the programs' structure at a
# size that compiles in seconds
SMALL = ["draft.target_layer_ids=[0,1]", "loss.ttt_steps=1", "optimizer.optimizer=adamw", "data.total_seq_len=128"]
LAYERS = {"num_hidden_layers": 2}
KEYS = {"program", "topology", "compiled", "peak_gib", "hbm_gib", "fits", "flops", "bytes", "hbm_bytes", "roofline_ms",
        "bound", "tok_per_s", "compile_s"}


@pytest.fixture(scope="module")
def cfg():
    return load_recipe(RECIPE, SMALL)


@pytest.fixture(scope="module")
def v5e(cfg):
    rows = plan(cfg, "v5e:2x4", programs="train,extract,generate,speculate,train-online", target_overrides=LAYERS, k=3,
                prompt_len=64, new_tokens=32)
    return {r.program: r for r in rows}


def _check_row(r, chip):
    assert r.compiled, r.error
    assert r.error is None
    assert 0 < r.peak_gib < r.hbm_gib == chip.hbm_gib
    assert r.fits and 0 < r.headroom_pct < 100
    assert r.flops > 0 and r.bytes > 0 and 0 < r.hbm_bytes <= r.bytes  # HBM traffic: a part of XLA's count
    tc, tm = r.flops / (chip.peak_tflops * 1e12), r.hbm_bytes / (chip.hbm_gbps * 1e9)
    assert r.bound == ("compute" if tc >= tm else "memory")
    assert r.roofline_ms == pytest.approx(max(tc, tm) * 1e3, rel=1e-3)
    assert r.tok_per_s == pytest.approx(r.tokens / max(tc, tm), rel=1e-3)
    assert 0 < r.mfu_ceiling <= 1
    assert not [t for t in r.custom_calls if t.startswith("specjax_")]  # no CPU kernel in a TPU program
    assert KEYS <= set(r.to_dict())


def test_v5e_programs_compile_and_fit(v5e):
    assert set(v5e) == {"train", "extract", "generate", "speculate", "train-online"}
    for r in v5e.values():
        _check_row(r, CHIPS["v5e"])
        assert r.topology == "v5e:2x4" and "tensor: 8" in r.mesh and "tpu" in r.mesh
    # a run holds nothing on the device beside its programs (train: no target weights, frozen tensors once)
    assert v5e["train"].resident_gib == 0 and v5e["train"].tokens == 128
    # the draft's flash attention (one 128 x 128 block per row and chip's 4 heads) is counted forward
    # and backward (4.5 passes); the decode loops' steps run no flash kernel
    t = v5e["train"]
    assert t.kernel_flops == 4.5 * 4 * t.shape["rows"] * 4 * 128 ** 3, t.kernel_flops
    assert v5e["generate"].kernel_flops == v5e["speculate"].kernel_flops == 0
    assert v5e["extract"].resident_gib == 0
    # tensor parallel: the steps exchange partial sums
    assert v5e["train"].collectives["all-reduce"] > 0
    # loops: the roofline is of one loop iteration, compiled on its own
    for name in ("generate", "speculate"):
        r = v5e[name]
        assert r.per == "step" and r.step_compile_s is not None and r.loop_collectives is not None
    assert v5e["speculate"].tokens == 4  # B=1 x (k=3 + 1) at full acceptance
    # one decode step is a bandwidth problem, a training step a compute one
    assert v5e["generate"].bound == "memory" and v5e["generate"].mfu_ceiling < 0.1
    # TPU programs attend on the Pallas (Mosaic) kernels: flash for training/extraction, the decode kernel
    # over the cache for the loops' steps
    for r in v5e.values():
        assert r.custom_calls.get("tpu_custom_call", 0) > 0, (r.program, r.custom_calls)
    # prefill writes the head-sharded cache shard by shard: no K/V all-gather in the generate program
    assert v5e["generate"].loop_collectives["all-gather"] == 0
    # a decode step reads each weight from HBM once: its HBM traffic is at most its arguments (weights,
    # cache, state; the embedding table is read one row at a time) and at least the layers' weights
    g = v5e["generate"]
    layer_bytes = 2 * 218_112_000 * 2 / 8  # 2 Llama-3.1-8B layers, bf16, over tensor=8
    assert layer_bytes < g.hbm_bytes <= (g.argument_gib + g.output_gib) * 2**30, (g.hbm_bytes, g.argument_gib)


def test_online_train_step_is_the_train_step_plus_an_extraction(v5e):
    """data.online's step (the target sharded by TARGET_RULES inside the train step) compiles and fits
    on v5e-8; it computes what the cached step and an extraction of the same rows compute (flops,
    flash-attention flops: the target's forward once, the draft's forward and backward) and moves
    about what both move, the hidden states staying on the chip; the target's weights are its argument."""
    o, t, e = v5e["train-online"], v5e["train"], v5e["extract"]
    assert o.compiled and o.fits, o.error
    assert o.shape == t.shape and e.shape["rows"] == t.shape["rows"] and e.shape["seq"] == t.shape["seq"]
    assert o.kernel_flops == t.kernel_flops + e.kernel_flops, (o.kernel_flops, t.kernel_flops, e.kernel_flops)
    assert abs(o.flops - (t.flops + e.flops)) <= 0.01 * o.flops, (o.flops, t.flops, e.flops)
    assert o.hbm_bytes <= 1.05 * (t.hbm_bytes + e.hbm_bytes), (o.hbm_bytes, t.hbm_bytes, e.hbm_bytes)
    target_bytes = 2 * 218_112_000 * 2 / 8  # the 2 layers' bf16 weights per chip (tensor=8)
    assert o.argument_gib * 2**30 >= t.argument_gib * 2**30 + target_bytes, (o.argument_gib, t.argument_gib)
    assert o.custom_calls["tpu_custom_call"] == t.custom_calls["tpu_custom_call"] + e.custom_calls["tpu_custom_call"]


def test_extract_attention_memory_does_not_grow_with_t_squared(cfg):
    """Extraction compiled for v5e (8B widths, 2 layers) attends on the flash kernel and holds no
    [T, T] scores: at 4096 tokens its temporaries stay under one layer's float32 scores of the
    chip's 4 query heads (256 MiB; XLA's attention here: 395 MiB at 4096 tokens, 36 at 2048, 11x for
    twice the tokens; the kernel: 172 MiB, 37 at 2048). A 2048-token twin is no longer compiled: the
    bound at 4096 already tells the two apart (with it the test took 38-52 s in suite runs; alone,
    without it, 11.5 s)."""
    (b,) = plan(cfg, "v5e:2x4", programs="extract", target_overrides=LAYERS, seq=4096)
    assert b.compiled, b.error
    assert b.custom_calls.get("tpu_custom_call", 0) > 0
    assert b.temp_gib * 1024 < 256, b.temp_gib
    # the kernel's flops (a custom call XLA counts as 0) are in the count: per chip 4 query heads of
    # 128 dims, 512 x 512 blocks, the causal triangle's non-empty blocks (36 of 64), two layers
    assert b.kernel_flops == 4 * b.shape["rows"] * 4 * 36 * 512 * 512 * 128 * 2, b.kernel_flops
    assert b.flops > b.kernel_flops
    # HBM traffic counts the whole program (the kernel's multi-line attributes end no computation):
    # more than the two layers' weights per chip plus the 4096-token residual stream written per layer
    assert b.hbm_bytes > 2 * 218_112_000 * 2 / 8 + 2 * 4096 * 4096 * 2, b.hbm_bytes


def test_batch_far_too_large_does_not_fit(cfg):
    # 512 rows x 8192 tokens: the replicated [B, T, 3, 4096] bf16 output alone is 96 GiB per chip
    (r,) = plan(cfg, "v5e:2x4", programs="extract", target_overrides=LAYERS, batch=512, seq=8192)
    assert r.fits is False and not r.compiled and "memory" in r.error.lower()
    assert r.peak_gib is not None and r.peak_gib > r.hbm_gib
    assert r.headroom_pct < 0


def test_cli_json_v6e(tmp_path):
    from typer.testing import CliRunner

    from specjax.cli import app

    args = ["plan", "--config", str(RECIPE), "--topology", "v6e:2x4", "--programs", "extract", "--layers", "2",
            "--seq", "128", "--json"]
    for s in SMALL:
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert isinstance(rows, list) and len(rows) == 1
    r = rows[0]
    assert KEYS <= set(r)
    assert r["program"] == "extract" and r["topology"] == "v6e:2x4" and r["compiled"] and r["fits"]
    assert r["hbm_gib"] == 32 and 0 < r["peak_gib"] < 32 and r["flops"] > 0 and r["bound"] in ("compute", "memory")


def test_cli_bad_topology_is_an_error():
    from typer.testing import CliRunner

    from specjax.cli import app

    res = CliRunner().invoke(app, ["plan", "--config", str(RECIPE), "--topology", "v9x:2x4"])
    assert res.exit_code == 2
    assert "v9x:2x4" in res.output and "v5e" in res.output


def test_cli_bad_scan_layer_settings_are_errors(monkeypatch):
    from typer.testing import CliRunner

    from specjax.cli import app

    res = CliRunner().invoke(app, ["plan", "--config", str(RECIPE), "--topology", "v5e:2x4", "--scan-layers", "some"])
    assert res.exit_code == 2 and "--scan-layers 'some'" in res.output and "auto" in res.output
    monkeypatch.setenv("SPECJAX_SCAN_LAYERS", "maybe")
    res = CliRunner().invoke(app, ["plan", "--config", str(RECIPE), "--topology", "v5e:2x4"])
    assert res.exit_code == 2 and "SPECJAX_SCAN_LAYERS='maybe'" in res.output


# ----------------------------------------------------------------------------- backend by placement


def _tpu_mesh():
    from specjax.plan import tpu_mesh

    return tpu_mesh("v5e:2x4", "data=1,tensor=-1")


def test_dot_tn_follows_the_program_not_the_process():
    """bf16 ``a^T b`` with ``a`` the larger operand: the CPU path transposes ``b`` and hides the
    output transpose behind an optimisation barrier; a program built for a TPU mesh from this CPU
    process takes the plain contraction."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import placement
    from specjax.models.layers import dot_tn

    a = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((256, 16), jnp.bfloat16)
    assert jax.default_backend() == "cpu"
    cpu_hlo = jax.jit(dot_tn).lower(a, b).as_text()
    assert "optimization_barrier" in cpu_hlo

    mesh = _tpu_mesh()
    rep = NamedSharding(mesh, P())

    def on_tpu(a, b):
        with placement.building_for(mesh):
            return dot_tn(a, b)

    tpu = jax.jit(on_tpu, in_shardings=(rep, rep)).lower(
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=rep))
    assert "optimization_barrier" not in tpu.as_text()
    assert "optimization-barrier" not in tpu.compile().as_text()


def test_tensor_parallel_partial_sums_are_reduced_in_bf16_on_tpu():
    """A bf16 linear layer whose contraction is split over chips (o_proj, down_proj under tensor
    parallelism): built for a TPU mesh it all-reduces bf16 partial sums (vLLM's and Megatron's
    numerics, half the bytes); the CPU program keeps its float32 dot rounded once."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import placement
    from specjax.models.layers import bmm_f32acc
    from specjax.plan import hbm

    mesh = _tpu_mesh()
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tensor")))
    w = jax.ShapeDtypeStruct((512, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("tensor", None)))

    def on_tpu(x, w):
        with placement.building_for(mesh):
            return bmm_f32acc(x, w)

    hlo = jax.jit(on_tpu, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile().as_text()
    comps = hbm.parse(hlo)
    shapes = {i.name: i.shape for c in comps.values() for i in c.insts}
    sent = [shapes[o].split("[")[0] for c in comps.values() for i in c.insts if i.op.startswith("all-reduce")
            for o in i.operands]
    assert sent and set(sent) == {"bf16"}, sent  # was float32 partial sums rounded after the reduction
    cpu = jax.jit(bmm_f32acc).lower(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    assert "f32" in re.search(r"dot_general.*", cpu.as_text()).group(0)


def test_cpu_kernels_follow_the_program():
    """A decode-time (panel) state: the CPU program calls the native kernels; the same graph built
    for a TPU mesh takes XLA's dots (no CPU custom call can leak into it)."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from specjax import kernels, placement
    from specjax.models import panels
    from specjax.models.config import TargetConfig
    from specjax.models.target import build_model
    from tests.sharding.tiny import target_config

    if not kernels.available("cpu"):
        pytest.skip(f"CPU kernels unavailable here: {kernels.status()['reason']}")
    model = build_model(TargetConfig.from_hf(target_config("llama", 1)), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    dstate = panels.decode_state(model, state)
    assert panels.panel_dtypes(dstate)  # packed: the CPU decode path
    ids = jnp.zeros((1, 1), jnp.int32)

    def fwd(state, ids):
        return nnx.merge(graphdef, state)(ids).logits

    assert "specjax_panel_matmul" in jax.jit(fwd).lower(dstate, ids).as_text()

    mesh = _tpu_mesh()
    rep = NamedSharding(mesh, P())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), dstate)

    def fwd_tpu(state, ids):
        with placement.building_for(mesh):
            return fwd(state, ids)

    assert not kernels.available(placement.platform_of(mesh))
    assert panels.decode_state(model, abstract) is abstract  # params on a TPU: no panels
    lowered = jax.jit(fwd_tpu).lower(abstract, jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=rep))
    assert "specjax_" not in lowered.as_text()
    assert "specjax_" not in lowered.compile().as_text()
    np.testing.assert_equal(placement.platform_of(abstract), "tpu")


def test_verify_cost_is_flat_in_the_tree_size_on_v5e(cfg):
    """The tree loop's verify ('verify', k + 1 rows) on v5e-8: memory-bound, its bytes (the weights
    and the cache) barely move from 4 to 32 rows while its flops grow with the rows."""
    a, b = (plan(cfg, "v5e:2x4", programs="verify", target_overrides=LAYERS, k=k, prompt_len=64, new_tokens=64)[0]
            for k in (3, 31))
    assert a.compiled and b.compiled, (a.error, b.error)
    assert (a.shape["rows"], b.shape["rows"]) == (4, 32) and (a.tokens, b.tokens) == (4, 32)
    assert a.bound == b.bound == "memory" and a.fits
    assert b.flops == pytest.approx(8 * a.flops, rel=0.05)
    assert b.bytes < 1.5 * a.bytes and b.roofline_ms < 1.5 * a.roofline_ms


def test_tree_round_compiles_on_v5e(cfg, v5e):
    """The tree program ('tree': the tree loop and one round) on v5e-8 with vLLM's example tree
    (5 nodes, depth 3): compiles, fits, has no CPU kernel, counts a deepest path's tokens per
    round, and its round streams about what a k=3 chain round does (the verify's 6 rows against
    4 and the batched drafting of a depth's nodes barely move the bytes; the weights dominate)."""
    from specjax.plan.topology import chip_of

    chain = v5e["speculate"]  # the k=3 chain, planned alike
    tree, = plan(cfg, "v5e:2x4", programs="tree", target_overrides=LAYERS, k=3, prompt_len=64, new_tokens=32)
    for r in (chain, tree):
        _check_row(r, chip_of("v5e:2x4"))
        assert r.per == "step"
    assert tree.program == "tree" and (tree.shape["nodes"], tree.shape["depth"]) == (5, 3) and tree.tokens == 4
    assert chain.hbm_bytes <= tree.hbm_bytes < 1.3 * chain.hbm_bytes, (chain.hbm_bytes, tree.hbm_bytes)
    assert tree.flops > chain.flops  # more verified rows and drafted nodes


def test_extraction_scans_its_layers_on_tpu_and_counts_every_iteration(cfg):
    """With ``SPECJAX_SCAN_LAYERS=auto`` (``plan --scan-layers auto``), a TPU extraction of a 4-layer
    target (8B widths, taps 0, 1 and the last) at 4096 tokens, where
    a layer's float32 residual stream per chip (67 MB) outweighs its weights per chip (55 MB under
    tensor=8), runs layers 1-3 as one ``lax.scan``: its temporaries stay below the unrolled
    program's (one layer's activations live at a time), its flops are the unrolled twin's (all
    four layers), and its HBM bytes, each loop body counted per iteration
    (``tests/test_plan_hbm.py``), are of the unrolled program's order (1.01 GB against 1.38 GB here:
    the unrolled program writes and reads more float32 temporaries; at 32 layers and 8192 tokens
    33.8 against 33.5 GB)."""
    four = {"num_hidden_layers": 4}
    with layer_scan("auto"):
        (s,) = plan(cfg, "v5e:2x4", programs="extract", target_overrides=four, seq=4096)
    assert s.compiled and s.fits, s.error
    assert s.cost_compile_s is not None and any("layers scanned" in n for n in s.notes)
    # the unrolled twin (what the default compiles) reports what unrolling takes
    assert s.peak_gib < s.unrolled_peak_gib, (s.peak_gib, s.unrolled_peak_gib)
    assert 0.6 < s.hbm_bytes / s.unrolled_hbm_bytes < 1.15, (s.hbm_bytes, s.unrolled_hbm_bytes)
    # the flops are the twin's: every layer's matmuls and its flash kernel (a traced call per layer)
    H, T, I, kv = 4096, 4096, 14336, 1024
    layer_matmuls = 2 * T * (H * (H + 2 * kv) + H * H + 3 * H * I) / 8  # per chip under tensor=8
    assert s.flops > 4 * layer_matmuls
    # 4 layers x 4 query heads per chip x 36 causal 512 x 512 blocks x 2 matmuls (QK^T, PV) of 128 dims
    assert s.kernel_flops == 4 * 4 * 36 * 2 * 512 * 512 * 128 * 2


def test_decode_layer_scan_compiles_on_v5e(cfg, v5e):
    """The generate loop with the decode layer scan (``SPECJAX_SCAN_LAYERS=1``: a stacked,
    head-sharded KV cache, the layers under ``lax.scan``, the Pallas decode kernel reading a layer of
    the stacked cache by index) compiles for v5e-8, fits, runs no CPU kernel and gathers no K/V.
    The target's layers are stored stacked, as loading stores them under the setting
    (``stack_layers``), so neither the loop nor a step (compiled on its own) copies the weights:
    the loop's peak is no more than the unrolled loop's (stacking in the loop added a second copy
    of the layers, +1.8 to +3.1 GiB per chip at 32 layers) and a step moves less than half a
    layer's weights more than the unrolled step (stacking inside the step, a read and a write of
    every layer's weights, moved 1.6x at 4 layers; at 32 layers the scanned step moves 1.00x)."""
    with layer_scan("on"):
        (s,) = plan(cfg, "v5e:2x4", programs="generate", target_overrides=LAYERS, k=3, prompt_len=64, new_tokens=32)
    _check_row(s, CHIPS["v5e"])
    assert any("layers scanned" in n for n in s.notes), s.notes
    assert s.loop_collectives["all-gather"] == 0
    u = v5e["generate"]
    layer_bytes = 2 * 218_112_000 * 2 / 8  # 2 Llama-3.1-8B layers, bf16, over tensor=8
    assert layer_bytes < s.hbm_bytes < u.hbm_bytes + 0.5 * layer_bytes, (u.hbm_bytes, s.hbm_bytes)
    assert s.argument_gib == u.argument_gib and s.peak_gib <= u.peak_gib, (u.peak_gib, s.peak_gib)
