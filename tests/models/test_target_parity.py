"""Targets vs transformers (PyTorch float32 CPU) on tiny random Llama / Qwen3 configs: logits and
every tap id, padding, and prefill + cached decode == one full forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.models.hf import load_hf_dir
from specjax.models.target import KVCache
from tests.models.conftest import jitted, rel_err
from tests.refs.speculators_ckpts import LAYERS, VOCAB

TOL = 1e-5

CONFIGS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied-bias": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                          mlp_bias=True)),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-rope-llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8})),
    "llama-rope-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 8})),
    # dynamic NTK only differs past max_position_embeddings: run 20 tokens against max 12
    "llama-rope-dynamic": ("llama", dict(max_position_embeddings=12,
                                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen3-qknorm-untied": ("qwen3", {}),
    "qwen3-tied-sliding": ("qwen3", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                                         max_window_layers=2)),
}


def hf_forward(ref, ids, attention_mask=None):
    """logits [B,T,V] and taps 0..n (n = pre-norm final state, captured at the final norm's input)."""
    seen = {}
    h = ref.model.norm.register_forward_hook(lambda m, inp, out: seen.__setitem__("pre", inp[0].detach()))
    try:
        with torch.no_grad():
            o = ref(torch.tensor(ids), attention_mask=None if attention_mask is None else torch.tensor(attention_mask),
                    output_hidden_states=True)
    finally:
        h.remove()
    taps = [t.numpy() for t in o.hidden_states[:-1]] + [seen["pre"].numpy()]
    return o.logits.numpy(), taps


def seq_len(name):
    return 20 if name == "llama-rope-dynamic" else 12


@pytest.fixture(params=sorted(CONFIGS))
def case(request, tiny_target):
    fam, over = CONFIGS[request.param]
    d, ref = tiny_target(fam, **over)
    return request.param, load_hf_dir(d), ref


def test_logits_and_every_tap_match_transformers(case):
    name, model, ref = case
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, seq_len(name)))
    want_logits, want_taps = hf_forward(ref, ids)
    taps = tuple(range(LAYERS + 1))
    out = model(jnp.asarray(ids), tap_ids=taps)
    assert rel_err(out.logits, want_logits) <= TOL
    assert len(out.aux_hidden_states) == LAYERS + 1
    for k, (got, want) in enumerate(zip(out.aux_hidden_states, want_taps)):
        assert rel_err(got, want) <= TOL, f"tap {k}"
    # the taps are returned in the requested order, not sorted
    sub = model(jnp.asarray(ids), tap_ids=(LAYERS, 2, 0), return_logits=False)
    assert sub.logits is None
    assert [rel_err(g, want_taps[k]) <= TOL for g, k in zip(sub.aux_hidden_states, (LAYERS, 2, 0))] == [True] * 3


def test_config_features_took_effect(case):
    name, model, _ = case
    cfg = model.config
    if "sliding" in name:
        assert [layer.sliding_window for layer in model.model.layers] == [None, None, 4, 4, 4, 4]
    assert (model.lm_head is None) == ("-tied" in name) == cfg.tie_word_embeddings
    if "qwen3" in name:
        assert model.model.layers[0].self_attn.q_norm is not None
    if "rope" in name:
        assert cfg.rope.rope_type == name.rsplit("-", 1)[1]


def test_right_padding_with_attention_mask_matches_transformers(tiny_target):
    d, ref = tiny_target("qwen3")
    model = load_hf_dir(d)
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, 10))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    want_logits, want_taps = hf_forward(ref, ids, mask)
    out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask), tap_ids=(3,))
    valid = mask.astype(bool)
    assert rel_err(np.asarray(out.logits)[valid], want_logits[valid]) <= TOL
    assert rel_err(np.asarray(out.aux_hidden_states[0])[valid], want_taps[3][valid]) <= TOL


@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-tied-sliding", "llama-rope-yarn"])
def test_prefill_then_cached_decode_equals_full_forward(tiny_target, name):
    fam, over = CONFIGS[name]
    d, _ = tiny_target(fam, **over)
    module = load_hf_dir(d)
    model = jitted(module)
    T, P = 12, 5
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, T))
    full = model(jnp.asarray(ids), tap_ids=(0, 4, LAYERS))
    cache = KVCache.init(module.config, 2, 16)
    out = model(jnp.asarray(ids[:, :P]), cache=cache, tap_ids=(0, 4, LAYERS))
    logits, taps = [out.logits], [out.aux_hidden_states]
    cache = out.cache
    assert cache.lengths.tolist() == [P, P]
    for t in range(P, T):
        out = model(jnp.asarray(ids[:, t : t + 1]), cache=cache, tap_ids=(0, 4, LAYERS))
        cache = out.cache
        logits.append(out.logits)
        taps.append(out.aux_hidden_states)
    assert cache.lengths.tolist() == [T, T]
    assert rel_err(np.concatenate(logits, 1), full.logits) <= TOL
    for j in range(3):
        assert rel_err(np.concatenate([tp[j] for tp in taps], 1), full.aux_hidden_states[j]) <= TOL


def test_multi_token_append_and_rollback(tiny_target):
    """Verify-style step: append 3 tokens at once, reject the last 2, append corrected tokens."""
    d, _ = tiny_target("qwen3", tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                       max_window_layers=2)
    module = load_hf_dir(d)
    model = jitted(module)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, VOCAB, (1, 6))
    draft = rng.integers(0, VOCAB, (1, 3))
    fix = rng.integers(0, VOCAB, (1, 2))
    cache = model(jnp.asarray(prompt), cache=KVCache.init(module.config, 1, 16)).cache
    step = model(jnp.asarray(draft), cache=cache)
    assert step.logits.shape == (1, 3, VOCAB) and step.cache.lengths.tolist() == [9]
    cache = step.cache.rollback([7])  # keep prompt + first drafted token
    out = model(jnp.asarray(fix), cache=cache)
    seq = np.concatenate([prompt, draft[:, :1], fix], 1)
    full = model(jnp.asarray(seq))
    assert rel_err(out.logits, np.asarray(full.logits)[:, 7:]) <= TOL
    assert out.cache.lengths.tolist() == [9]


def test_ragged_prefill_and_decode_per_sequence(tiny_target):
    d, _ = tiny_target("llama")
    module = load_hf_dir(d)
    model = jitted(module)
    rng = np.random.default_rng(5)
    lens = [3, 7]
    seqs = [rng.integers(0, VOCAB, 10) for _ in lens]
    P = max(lens)
    ids = np.zeros((2, P), np.int64)
    for i, n in enumerate(lens):
        ids[i, :n] = seqs[i][:n]
    mask = np.arange(P)[None] < np.asarray(lens)[:, None]
    out = model(jnp.asarray(ids), cache=KVCache.init(module.config, 2, 12), attention_mask=jnp.asarray(mask),
                logits_at=jnp.asarray(lens) - 1)
    assert out.cache.lengths.tolist() == lens and out.logits.shape == (2, VOCAB)
    cache, steps = out.cache, [out.logits]
    for s in range(3):
        nxt = np.asarray([[seqs[i][lens[i] + s]] for i in range(2)])
        o = model(jnp.asarray(nxt), cache=cache)
        cache = o.cache
        steps.append(o.logits[:, 0])
    for i, n in enumerate(lens):
        full = np.asarray(model(jnp.asarray(seqs[i][None, : n + 3])).logits)[0, n - 1 :]
        got = np.stack([np.asarray(s)[i] for s in steps])
        assert rel_err(got, full) <= TOL


def test_bf16_checkpoint_dtype_kept_or_cast(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    d, ref = tiny_target("llama")
    m16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    m16.save_pretrained(tmp_path / "bf16")
    kept = load_hf_dir(tmp_path / "bf16")
    assert kept.model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    assert kept.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(6).integers(0, VOCAB, (1, 8)))
    assert kept(ids).logits.dtype == jnp.bfloat16
    cast = load_hf_dir(tmp_path / "bf16", dtype="float32")
    assert cast.model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.float32
    # bf16 weights upcast exactly: the f32 model reproduces HF's f32 forward of the bf16 weights
    ref32 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32, attn_implementation="eager")
    want, _ = hf_forward(ref32.eval(), np.asarray(ids))
    assert rel_err(cast(ids).logits, want) <= TOL
