"""A target forward without a KV cache with its layers under ``lax.scan`` (TPU and GPU programs'
default, :func:`specjax.models.layer_scan.scan_layers_on`) equals the unrolled forward (the CPU's):
logits and every tap, with padding, packed segments, sliding-window layers and on the Pallas path
(interpret mode); and the scanned program compiles fewer layer bodies."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import placement
from specjax.kernels import tpu as kt
from specjax.models.config import TargetConfig
from specjax.models.layer_scan import layer_runs, layer_scan, scan_layers_on, use_layer_scan
from specjax.models.target import build_model

N = 6


def tiny(family="llama", **over):
    hf = dict(architectures=["LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"],
              model_type=family, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=N,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=64, tie_word_embeddings=False)
    hf.update(over)
    return build_model(TargetConfig.from_hf(hf), rngs=nnx.Rngs(3))


# every layer (0..n) tapped, none, and the EAGLE-3 default shape (a few interior ids)
TAPS = [tuple(range(N + 1)), (), (1, 3, N)]


def forward(model, ids, scan, **kw):
    with layer_scan(scan):
        @nnx.jit(static_argnames=("tap_ids",))
        def f(m, ids, tap_ids, **kw):
            return m(ids, tap_ids=tap_ids, **kw)

        out = f(model, ids, **kw)
    return np.asarray(out.logits), [np.asarray(a) for a in out.aux_hidden_states]


def assert_same(a, b, tol=1e-5):
    (la, ta), (lb, tb) = a, b
    assert len(ta) == len(tb)
    np.testing.assert_allclose(la, lb, rtol=tol, atol=tol)
    for x, y in zip(ta, tb):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_layer_runs_start_at_taps_and_window_changes():
    assert layer_runs(6, (), [None] * 6) == [(0, 6)]
    assert layer_runs(6, (0, 2, 6), [None] * 6) == [(0, 2), (2, 6)]
    assert layer_runs(6, (3,), [4, 4, None, None, None, 4]) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert layer_runs(32, (2, 16, 29), [None] * 32) == [(0, 2), (2, 16), (16, 29), (29, 32)]


def test_scan_setting_default_env_and_platform(monkeypatch):
    monkeypatch.delenv("SPECJAX_SCAN_LAYERS", raising=False)
    assert placement.platform() == "cpu" and scan_layers_on() is False
    with placement.building_for("tpu"):
        assert scan_layers_on() is False  # off unless asked
        monkeypatch.setenv("SPECJAX_SCAN_LAYERS", "auto")
        assert scan_layers_on() is None  # where it pays, decided per forward
        with layer_scan(False):
            assert scan_layers_on() is False
    assert scan_layers_on() is False  # auto on the CPU: never
    monkeypatch.setenv("SPECJAX_SCAN_LAYERS", "1")
    assert scan_layers_on() is True
    monkeypatch.setenv("SPECJAX_SCAN_LAYERS", "sometimes")
    with pytest.raises(ValueError, match="SPECJAX_SCAN_LAYERS='sometimes'"):
        scan_layers_on()
    with pytest.raises(ValueError, match="expected one of"):
        with layer_scan("maybe"):
            pass


def test_auto_scans_a_tpu_forward_where_the_residual_stream_outweighs_the_weights():
    """Per chip: a layer here holds 4 * (32*32 + 2*32*16 + 32*32) + 3 * 4 * 32*48 + 2 * 4 * 32 = 30,976
    bytes of float32 weights; a [B, T, 32] float32 residual stream outweighs them from B*T = 242."""
    model = tiny()
    x = jnp.zeros((2, 121, 32))
    assert sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(model.model.layers[0], nnx.Param))) \
        == 30_976
    with placement.building_for("tpu"), layer_scan("auto"):
        assert use_layer_scan(model.model.layers, x)
        assert not use_layer_scan(model.model.layers, x[:, :120])
    with placement.building_for("tpu"):
        assert not use_layer_scan(model.model.layers, x)  # the default: off
        with layer_scan(True):
            assert use_layer_scan(model.model.layers, x[:, :8])
    with layer_scan("auto"):
        assert not use_layer_scan(model.model.layers, x)  # the CPU unrolls


@pytest.mark.parametrize("taps", TAPS)
def test_scanned_forward_equals_unrolled_llama(taps):
    model = tiny()
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)
    assert_same(forward(model, ids, True, tap_ids=taps), forward(model, ids, False, tap_ids=taps))


def test_scanned_forward_equals_unrolled_with_padding_and_sliding_layers():
    model = tiny("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert [model.model.layers[i].sliding_window for i in range(N)] == [None, None, 4, 4, 4, 4]
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    mask = jnp.asarray(np.arange(12)[None] < np.array([[12], [7]]), jnp.int32)
    for taps in TAPS:
        assert_same(forward(model, ids, True, tap_ids=taps, attention_mask=mask),
                    forward(model, ids, False, tap_ids=taps, attention_mask=mask))


def test_scanned_forward_equals_unrolled_on_packed_rows():
    model = tiny()
    ids = jax.random.randint(jax.random.key(2), (1, 12), 0, 64)
    seg = jnp.asarray([[0] * 5 + [1] * 4 + [2] * 3])
    pos = jnp.asarray([list(range(5)) + list(range(4)) + list(range(3))])
    assert_same(forward(model, ids, True, tap_ids=(1, 3, N), segments=seg, positions=pos),
                forward(model, ids, False, tap_ids=(1, 3, N), segments=seg, positions=pos))


def test_scanned_forward_equals_unrolled_on_the_pallas_path():
    model = tiny("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    ids = jax.random.randint(jax.random.key(3), (1, 16), 0, 64)
    with kt.pallas_interpret():
        assert_same(forward(model, ids, True, tap_ids=(1, 3, N)), forward(model, ids, False, tap_ids=(1, 3, N)))


def test_scanned_program_holds_one_body_per_run():
    model = tiny()
    ids = jnp.zeros((1, 8), jnp.int32)
    graphdef, state = nnx.split(model)

    def hlo(scan):
        with layer_scan(scan):
            f = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids, tap_ids=(0, 3)).logits)
            return f.lower(state, ids).as_text()

    unrolled, scanned = hlo(False), hlo(True)
    dots = lambda t: len(re.findall(r"stablehlo\.dot_general", t))  # noqa: E731
    assert "stablehlo.while" not in unrolled and scanned.count("stablehlo.while") == 2  # runs [0, 3), [3, 6)
    assert dots(scanned) < dots(unrolled) / 2
