"""GGUF loading on tiny files written like llama.cpp's converter: names, Q/K permutation,
dequantisation, and refusals of what the loader cannot handle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge import gguf_names
from specjax.models.errors import GGUFError, UnsupportedGGUFError
from specjax.models.gguf import load_gguf
from tests.models.conftest import rel_err, write_tiny_gguf
from tests.models.test_target_parity import hf_forward
from tests.refs.speculators_ckpts import LAYERS, VOCAB


def test_qk_permutation_round_trips_and_is_not_identity():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    p = gguf_names.permute_qk(w, 4)
    assert not np.array_equal(p, w)
    assert np.array_equal(gguf_names.unpermute_qk(p, 4), w)
    # per head, llama.cpp interleaves the two rotate-half halves: rows (0, 4, 1, 5, 2, 6, 3, 7)
    assert p[:8, 0].tolist() == w[[0, 4, 1, 5, 2, 6, 3, 7], 0].tolist()


def test_name_table_covers_every_hf_target_tensor(tiny_target):
    from bridge.safetensors_io import open_tensors

    d, _ = tiny_target("qwen3")
    names = set(open_tensors(d).names)
    mapped = {gguf_names.hf_name(f"blk.{i}.{g}.weight") for i in range(LAYERS)
              for g in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                        "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down")}
    mapped |= {gguf_names.hf_name(n) for n in ("token_embd.weight", "output_norm.weight", "output.weight")}
    assert names <= mapped
    assert gguf_names.hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_names.hf_name("blk.0.ffn_gate_exps.weight") is None


@pytest.mark.parametrize("family,qtype", [("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_1"),
                                          ("llama", "Q5_0")])
def test_tiny_gguf_matches_transformers_gguf_loader(tiny_target, tmp_path, family, qtype):
    from transformers import AutoModelForCausalLM

    d, ref = tiny_target(family)
    g = write_tiny_gguf(d, tmp_path / f"t-{qtype}.gguf", arch=family, qtype=qtype)
    model, config, cfg_dict, flat, _ = load_gguf(g, progress=False)
    assert config.family == family and config.num_hidden_layers == LAYERS
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9))
    got = model(jnp.asarray(ids)).logits
    gref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=g.name, dtype=torch.float32).eval()
    want, _ = hf_forward(gref, ids)
    assert rel_err(got, want) <= 1e-5
    if qtype == "F32":  # lossless: identical to the original safetensors model
        want0, _ = hf_forward(ref, ids)
        assert rel_err(got, want0) <= 1e-5


def test_tiny_qwen3_gguf_is_lossless_and_not_permuted(tiny_target, tmp_path):
    # transformers' GGUF loader ignores qwen3.attention.key_length (falls back to head_dim 128), so
    # the reference here is the original safetensors model; F32 makes the round trip lossless.
    d, ref = tiny_target("qwen3", tie_word_embeddings=True)
    g = write_tiny_gguf(d, tmp_path / "q.gguf", arch="qwen3", qtype="F32")
    model, config, cfg_dict, flat, _ = load_gguf(g, progress=False)
    assert config.family == "qwen3" and config.qk_norm and config.tie_word_embeddings
    assert "qwen3" not in gguf_names.QK_PERMUTED
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9))
    want, _ = hf_forward(ref, ids)
    assert rel_err(model(jnp.asarray(ids)).logits, want) <= 1e-5


def test_unpermute_matters(tiny_target, tmp_path, monkeypatch):
    """Loading a llama GGUF without undoing the permutation must visibly break parity."""
    d, ref = tiny_target("llama")
    g = write_tiny_gguf(d, tmp_path / "t.gguf")
    monkeypatch.setattr(gguf_names, "QK_PERMUTED", frozenset())
    model, *_ = load_gguf(g, progress=False)
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 9))
    want, _ = hf_forward(ref, ids)
    assert rel_err(model(jnp.asarray(ids)).logits, want) > 1e-3


def test_unsupported_architecture(tiny_target, tmp_path):
    d, _ = tiny_target("llama")
    g = write_tiny_gguf(d, tmp_path / "gpt2.gguf", arch="llama", arch_name="gpt2")
    with pytest.raises(UnsupportedGGUFError, match="architecture 'gpt2' is not supported"):
        load_gguf(g, progress=False)


def test_unsupported_quantisation_type_names_tensor(tiny_target, tmp_path):
    d, _ = tiny_target("llama")
    g = write_tiny_gguf(d, tmp_path / "f64.gguf", extra_tensors={"blk.0.extra.weight": np.zeros((4, 4), np.float64)})
    with pytest.raises(UnsupportedGGUFError, match=r"'blk.0.extra.weight' has quantisation type F64"):
        load_gguf(g, progress=False)


def test_unknown_tensor_and_unmatched_rope_freqs_refused(tiny_target, tmp_path):
    d, _ = tiny_target("llama")
    g = write_tiny_gguf(d, tmp_path / "x.gguf", extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(UnsupportedGGUFError, match="ffn_gate_exps.*no HF equivalent"):
        load_gguf(g, progress=False)
    bad = np.array([1.0, 3.0, 1.5, 7.0], np.float32)  # no llama3 scaling gives these
    g = write_tiny_gguf(d, tmp_path / "r.gguf", extra_tensors={"rope_freqs.weight": bad})
    with pytest.raises(UnsupportedGGUFError, match="rope_freqs.*match no llama3 rope scaling"):
        load_gguf(g, progress=False)
    g = write_tiny_gguf(d, tmp_path / "r3.gguf", extra_tensors={"rope_freqs.weight": np.ones(3, np.float32)})
    with pytest.raises(UnsupportedGGUFError, match="3 factors; expected head_dim/2 = 4"):
        load_gguf(g, progress=False)


def test_llama3_rope_stored_as_rope_freqs_matches_transformers(tiny_target, tmp_path):
    """llama.cpp stores llama3 rope scaling as per-dimension factors (``rope_freqs.weight``); they are
    turned back into HF rope_parameters, and the logits equal transformers' llama3 model."""
    theta, orig = 100.0, 64  # every band of the llama3 curve is hit by head_dim 8
    rp = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": orig}
    d, ref = tiny_target("llama", rope_parameters=rp)
    f = gguf_names.llama3_rope_factors(theta, 8, 8.0, 1.0, 4.0, orig).astype(np.float32)
    assert f[0] == 1.0 and f[-1] == 8.0 and 1.0 < f[1] < 8.0  # high, medium and low frequency dims
    meta = {"llama.rope.scaling.original_context_length": orig}
    g = write_tiny_gguf(d, tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": f}, extra_meta=meta)
    model, config, cfg_dict, flat, _ = load_gguf(g, progress=False)
    assert cfg_dict["rope_parameters"] == rp and "rope_freqs.weight" not in flat
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 40))
    want, _ = hf_forward(ref, ids)
    assert rel_err(model(jnp.asarray(ids)).logits, want) <= 1e-5
    plain, *_ = load_gguf(write_tiny_gguf(d, tmp_path / "plain.gguf", extra_meta=meta), progress=False)
    assert rel_err(plain(jnp.asarray(ids)).logits, want) > 1e-4  # the factors matter at these positions


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(bad, progress=False)


def _assert_reader_equals_package(path):
    """specjax's GGUF reader gives what ``gguf.GGUFReader`` gives: every field's contents (value and
    Python type, in file order) and every tensor's name, type, shape, offsets and bytes."""
    from gguf import GGUFReader

    from specjax.models.gguf import FastReader

    ref, got = GGUFReader(str(path)), FastReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items()}
    assert list(got.fields) == list(want)
    for k, v in want.items():
        assert got.fields[k] == v and type(got.fields[k]) is type(v), k
        if isinstance(v, list):
            assert [type(x) for x in got.fields[k]] == [type(x) for x in v], k
    assert [t.name for t in got.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ref.tensors, got.tensors):
        assert (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset) == (a.tensor_type, a.n_elements, a.n_bytes,
                                                                           a.data_offset), a.name
        assert b.shape.dtype == a.shape.dtype and b.shape.tolist() == a.shape.tolist(), a.name
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape, a.name
        assert np.asarray(b.data).tobytes() == np.asarray(a.data).tobytes(), a.name


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1", "Q5_0"])
def test_reader_equals_the_gguf_package(tiny_target, tmp_path, qtype):
    from gguf import GGUFWriter

    d, _ = tiny_target("llama", hidden_size=256, intermediate_size=256, head_dim=64)
    path = write_tiny_gguf(d, tmp_path / "t.gguf", qtype=qtype)
    _assert_reader_equals_package(path)
    # every metadata value type, arrays of each (strings with non-ASCII text, empty arrays, nested arrays)
    w = GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    w.add_uint8("x.u8", 200), w.add_int8("x.i8", -5), w.add_uint16("x.u16", 60000), w.add_int16("x.i16", -300)
    w.add_uint32("x.u32", 4_000_000_000), w.add_int32("x.i32", -7), w.add_float32("x.f32", 0.1)
    w.add_uint64("x.u64", 2**63 + 5), w.add_int64("x.i64", -(2**40)), w.add_float64("x.f64", 1e-300)
    w.add_bool("x.bool", True), w.add_string("x.str", "naïve Ġtoken ✓")
    w.add_array("x.ints", [1, 2, 3]), w.add_array("x.floats", [0.5, -1.25]), w.add_array("x.bools", [True, False])
    w.add_array("x.strs", ["a", "", "ü"]), w.add_array("x.empty", []), w.add_array("x.nested", [[1, 2], [3]])
    w.add_uint32("general.alignment", 64)
    w.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("b", np.arange(5, dtype=np.int32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    _assert_reader_equals_package(tmp_path / "meta.gguf")


def test_reader_equals_the_gguf_package_on_smollm2(smol_dir):
    (path,) = sorted(smol_dir.glob("*.gguf"))
    _assert_reader_equals_package(path)


def test_truncated_gguf_is_refused_naming_the_file(tiny_target, tmp_path):
    d, _ = tiny_target("llama")
    path = write_tiny_gguf(d, tmp_path / "t.gguf")
    raw = path.read_bytes()
    for cut in (30, len(raw) // 3, len(raw) - 8):  # inside the metadata, the tensor infos, the last tensor
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(raw[:cut])
        with pytest.raises(GGUFError, match="not a readable GGUF") as e:
            load_gguf(bad, progress=False)
        assert str(bad) in str(e.value)
