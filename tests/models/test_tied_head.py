"""The ``[hidden, vocab]`` head copy of tied targets (``CausalLM.prepare_head`` / ``TiedHeadKernel``):
same logits as ``embed_tokens.attend``, never a Param, never in saved / exported tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.layout import flatten
from specjax.models.config import TargetConfig
from specjax.models.layers import TiedHeadKernel
from specjax.models.params import param_paths, tree_of
from specjax.models.target import build_model
from tests.models.conftest import rel_err


def _tiny(tied: bool = True):
    cfg = TargetConfig.from_hf({"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 64, "tie_word_embeddings": tied})
    return build_model(cfg, rngs=nnx.Rngs(0))


def _logits(model, ids):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).logits)(state, ids)


def test_kernel_path_equals_attend_path():
    m = _tiny()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (3, 7)), jnp.int32)
    ref = np.asarray(_logits(m, ids))
    assert m.tied_head is None
    assert m.prepare_head()
    assert isinstance(m.tied_head, TiedHeadKernel)
    np.testing.assert_array_equal(np.asarray(m.tied_head[...]), np.asarray(m.model.embed_tokens.embedding[...]).T)
    got = np.asarray(_logits(m, ids))
    assert rel_err(got, ref) <= 1e-6
    # eager (unjitted) forward too
    assert rel_err(np.asarray(m(ids).logits), ref) <= 1e-6


def test_prepare_head_is_cached_and_follows_the_embedding():
    m = _tiny()
    m.prepare_head()
    first = m.tied_head[...]
    m.prepare_head()
    assert m.tied_head[...] is first  # same embedding array: not remade
    m.model.embed_tokens.embedding.set_value(m.model.embed_tokens.embedding[...] * 2.0)
    m.prepare_head()  # a new embedding array: remade from it
    np.testing.assert_array_equal(np.asarray(m.tied_head[...]), np.asarray(m.model.embed_tokens.embedding[...]).T)
    m.release_head()
    assert m.tied_head is None


def test_untied_targets_have_no_copy():
    m = _tiny(tied=False)
    assert not m.prepare_head()
    assert m.tied_head is None


def test_kernel_is_not_a_param_nor_saved():
    m = _tiny()
    before = set(param_paths(m))
    m.prepare_head()
    assert set(param_paths(m)) == before
    assert not any("tied_head" in ".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param)))
    assert any("tied_head" in ".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(m)))  # it is there
    flat = flatten(tree_of(m))  # the HF tensor names a saved / exported target carries
    assert not any("tied_head" in n for n in flat)
    assert "lm_head.weight" not in flat and "model.embed_tokens.weight" in flat
    # an optimizer over the Param state never sees it
    import optax

    opt_state = optax.adam(1e-3).init(nnx.state(m, nnx.Param))
    assert not any("tied_head" in jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0])


def test_decode_entry_points_prepare_the_head():
    from specjax.decode.generate import generate_ids

    m = _tiny()
    ref = _tiny()
    out = generate_ids(m, [[1, 2, 3], [4, 5]], max_new_tokens=4, eos_token_ids=[])
    assert m.tied_head is not None
    # greedy tokens of the copy agree with the attend path (same model weights, no copy)
    ids = jnp.asarray([[1, 2, 3]], jnp.int32)
    np.testing.assert_allclose(np.asarray(m(ids).logits), np.asarray(ref.model.embed_tokens.attend(
        ref.model.norm(ref(ids, tap_ids=(2,), return_logits=False).aux_hidden_states[0]))), rtol=0, atol=1e-6)
    assert [len(t) for t in out.tokens] == [4, 4]


_MESH_SCRIPT = r'''
import numpy as np, jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import specjax.sharding as shd
from specjax.decode.generate import generate_ids
from specjax.decode.selfdraft import SelfDraft
from specjax.decode.speculative import speculative_generate_ids
from tests.models.test_tied_head import _tiny

prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
ref = _tiny()
want = generate_ids(ref, prompts, max_new_tokens=6, eos_token_ids=[]).tokens
want_spec = speculative_generate_ids(ref, SelfDraft(ref, 1), prompts, k=2, max_new_tokens=6, eos_token_ids=[]).tokens
m = _tiny()
mesh = shd.make_mesh((2, 2, 2))
shd.shard_params(m, shd.TARGET_RULES, mesh)
assert m.prepare_head()
assert m.tied_head[...].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tensor")), 2)
np.testing.assert_array_equal(np.asarray(m.tied_head[...]), np.asarray(m.model.embed_tokens.embedding[...]).T)
assert generate_ids(m, prompts, max_new_tokens=6, eos_token_ids=[]).tokens == want
assert speculative_generate_ids(m, SelfDraft(m, 1), prompts, k=2, max_new_tokens=6, eos_token_ids=[]).tokens == want_spec
# an unsharded prepared model handed a mesh: placed as a copy by TARGET_RULES (rule covers tied_head)
assert generate_ids(ref, prompts, max_new_tokens=6, eos_token_ids=[], mesh=mesh).tokens == want
print("MESH-OK")
'''


def test_sharded_tied_head_on_eight_devices():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], cwd=str(root), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "MESH-OK" in r.stdout, (r.stdout + r.stderr)[-4000:]
