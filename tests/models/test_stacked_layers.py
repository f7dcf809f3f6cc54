"""A target whose decoder layers are stored stacked (``specjax.models.layer_scan.stack_layers``,
what loading does with ``SPECJAX_SCAN_LAYERS=1``): the stacks hold the layers' own values, cut
into runs where the sliding window changes, and the per-layer buffers are freed when donated;
every forward (no cache, a stacked cache, a per-layer cache) and every decode loop (generate, the
speculative chain, the token tree) gives what the per-layer model gives, taps inside a run
included; the sharding rules put the layer axis unsplit; ``load_target`` stacks under the setting
and not without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import specjax.sharding as shd
from specjax.models.layer_scan import (StackedLayers, decode_layer_scan, layer_scan, recording_layer_scans,
                                       stack_layer_runs, stack_layers, stacked_layers)
from tests.decode.test_decode_layer_scan import MODELS, assert_same, steps
from tests.models.test_layer_scan import N, tiny

# the interior taps (1, 3) fall inside a stored run: the scan body records them
TAPS = [(0, 1, 3, N), (), (2, N), tuple(range(N + 1))]


def stacked_copy(model):
    return stack_layers(nnx.clone(model))


def test_stacks_hold_each_layer_and_runs_cut_at_window_changes():
    model = tiny(**MODELS["qwen3-sliding"])
    s = stacked_copy(model)
    layers = s.model.layers
    assert isinstance(layers, StackedLayers) and stacked_layers(s) and not stacked_layers(model)
    assert layers.runs == ((0, 2), (2, N)) and layers.windows == (None, None, 4, 4, 4, 4) and len(layers) == N
    flat = {shd.path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(s))}
    q = flat["model.layers.stacked.1.self_attn.q_proj.kernel"]
    assert q.shape == (N - 2, 32, 32)
    assert not any(".layers.0." in p for p in flat)
    for i in range(N):  # layer i as a module of slices: bit-equal to the original layer
        want, got = nnx.state(model.model.layers[i]), nnx.state(layers[i])
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, got)
    assert [la.sliding_window for la in layers] == list(layers.windows)
    assert stack_layers(s) is s and stack_layer_runs(s, (1, 3)) == {}  # nothing left to stack


def test_donated_layers_are_freed_and_abstract_leaves_stay_abstract():
    model = tiny()
    olds = [model.model.layers[i].mlp.down_proj.kernel.get_value() for i in range(N)]
    stack_layers(model, donate=True)
    assert all(x.is_deleted() for x in olds)
    assert model.model.layers.stacked[0].mlp.down_proj.kernel.get_value().shape == (N, 48, 32)
    from specjax.models.target import build_model

    abstract = stack_layers(build_model(model.config, abstract=True))
    k = abstract.model.layers.stacked[0].self_attn.o_proj.kernel.get_value()
    assert isinstance(k, jax.ShapeDtypeStruct) and k.shape == (N, 32, 32)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_without_a_cache_equals_the_per_layer_model(name):
    model = tiny(**MODELS[name])
    s = stacked_copy(model)
    ids = jax.random.randint(jax.random.key(0), (2, 11), 0, 64)
    mask = jnp.asarray(np.arange(11)[None] < np.array([[11], [6]]), jnp.int32)
    f = nnx.jit(lambda m, ids, mask, taps: m(ids, attention_mask=mask, tap_ids=taps), static_argnames="taps")
    for taps in TAPS:
        with layer_scan("off"):  # the per-layer model unrolls; the stacked one scans its runs
            a, b = f(model, ids, mask, taps), f(s, ids, mask, taps)
        assert len(b.aux_hidden_states) == len(taps)
        assert_same([a.logits, *a.aux_hidden_states], [b.logits, *b.aux_hidden_states], tol=1e-6)


@pytest.mark.parametrize("name,layout", [("qwen3-sliding", "padded"), ("llama", "packed"), ("llama", "shared")])
def test_cached_forwards_equal_the_per_layer_model(name, layout):
    """Prefill, verify and decode over a stacked cache (scanned runs, taps (1, 3, N) inside them)
    against the per-layer model over a per-layer cache."""
    model = tiny(**MODELS[name])
    assert_same(steps(stacked_copy(model), True, layout), steps(model, False, layout))


def test_a_per_layer_cache_reads_the_stacks_layer_by_layer():
    """A forward over a per-layer cache (a caller's own): the stacked model walks its layers as slices."""
    model = tiny(**MODELS["llama"])
    s = stacked_copy(model)
    from specjax.models.target import KVCache

    def verify(m):
        cache = KVCache.init(m.config, 1, 64, stacked=False)
        out = m(jnp.array([[3, 4, 5, 6]]), cache=cache, tap_ids=(1, N))
        tm = jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
        o2 = m(jnp.array([[7, 8, 9]]), cache=out.cache, tree_mask=tm, tap_ids=(1, N))
        return [out.logits, o2.logits, *o2.aux_hidden_states, *o2.cache.k]

    assert_same(nnx.jit(verify)(s), nnx.jit(verify)(model))


@pytest.mark.parametrize("cpu_kernels", ["0", "1"])
def test_decode_loops_give_the_per_layer_models_tokens(cpu_kernels, monkeypatch):
    """generate, the speculative chain and the token tree on the stacked target: the per-layer
    target's tokens (with the CPU panel view on and off), the loops scanning the stored stacks."""
    from specjax.decode.generate import generate_ids
    from specjax.decode.selfdraft import SelfDraft
    from specjax.decode.speculative import speculative_generate_ids
    from specjax.decode.tree_loop import tree_generate_ids

    monkeypatch.setenv("SPECJAX_CPU_KERNELS", cpu_kernels)
    model = tiny(**MODELS["qwen3-sliding"])
    s = stacked_copy(model)
    assert decode_layer_scan(s) and not decode_layer_scan(model)  # scanned whatever the setting
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]

    def run(m):  # the stacked target's generate, chain and tree loops
        g = generate_ids(m, prompts, max_new_tokens=10, eos_token_ids=[]).tokens
        c = speculative_generate_ids(m, SelfDraft(m, num_layers=3, speculative_tokens=3), prompts,
                                     max_new_tokens=10, eos_token_ids=[]).tokens
        t = tree_generate_ids(m, SelfDraft(m, num_layers=3, speculative_tokens=2), prompts, max_new_tokens=10,
                              eos_token_ids=[], tree=[(0,), (1,), (0, 0), (1, 0)]).tokens
        return g, c, t

    with recording_layer_scans() as log:
        got = run(s)
    assert log, "the stacked target's loops did not scan"
    # greedy speculation is lossless, so all three equal the per-layer target's own greedy tokens
    assert got[0] == got[1] == got[2] == generate_ids(model, prompts, max_new_tokens=10, eos_token_ids=[]).tokens


def test_rules_put_the_layer_axis_unsplit():
    model = stacked_copy(tiny())
    specs = {shd.path_str(p): s for p, s in
             jax.tree_util.tree_flatten_with_path(shd.partition_specs(model, shd.TARGET_RULES),
                                                  is_leaf=lambda x: isinstance(x, P))[0]}
    assert specs["model.layers.stacked.0.self_attn.q_proj.kernel"] == P(None, "fsdp", "tensor")
    assert specs["model.layers.stacked.0.mlp.down_proj.kernel"] == P(None, "tensor", "fsdp")
    assert specs["model.layers.stacked.0.input_layernorm.scale"] == P(None)
    assert specs["model.embed_tokens.embedding"] == P("tensor", "fsdp")


def test_load_target_stacks_under_the_setting(tmp_path, monkeypatch):
    from specjax.models.hf import load_hf_dir
    from specjax.models.loading import load_target
    from tests.sharding import tiny as tiny_ckpt

    d = tiny_ckpt.write_target(tmp_path / "t", layers=3)
    ref = load_hf_dir(d)
    ids = np.array([[5, 6, 7, 8]], np.int32)
    monkeypatch.delenv("SPECJAX_SCAN_LAYERS", raising=False)
    assert not stacked_layers(load_target(str(d), progress=False).model)
    monkeypatch.setenv("SPECJAX_SCAN_LAYERS", "1")
    lt = load_target(str(d), progress=False)
    assert stacked_layers(lt.model) and lt.model.model.layers.runs == ((0, 3),)
    np.testing.assert_allclose(np.asarray(lt.model(ids, tap_ids=(1,)).logits), np.asarray(ref(ids).logits),
                               rtol=1e-6, atol=1e-6)
    assert not stacked_layers(load_target(str(d), progress=False, stacked=False).model)
