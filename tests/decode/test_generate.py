"""Target-only generation: transformers parity, batch == one-by-one, independent EOS stops,
length limits, one compile per shape, and the sampling rules against HF's logits warpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.decode import generate as gen
from specjax.decode.generate import DecodeState, emit, generate_ids
from specjax.decode.sampling import SamplingParams, process_logits, sample
from specjax.models.errors import ContextLengthError
from specjax.models.hf import load_hf_dir
from tests.refs.speculators_ckpts import VOCAB, make_verifier

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gen")
    out = {}
    for fam, over in (("llama", {}), ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=3))):
        d = make_verifier(root / fam, fam, **over)
        out[fam] = (load_hf_dir(d), AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
    return out


@pytest.mark.parametrize("fam", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tiny, fam):
    model, ref = tiny[fam]
    res = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[])
    for p, toks in zip(PROMPTS, res.tokens):
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        assert toks == want
    assert res.stop_reasons == ["length"] * 3


def test_cached_split_same_tokens(tiny):
    """``split=`` (a cached nnx.split of the model) runs the same program as re-splitting."""
    from flax import nnx

    model, _ = tiny["llama"]
    want = generate_ids(model, PROMPTS, max_new_tokens=6, eos_token_ids=[]).tokens
    assert generate_ids(model, PROMPTS, max_new_tokens=6, eos_token_ids=[], split=nnx.split(model)).tokens == want


def test_batch_equals_one_by_one(tiny):
    model, _ = tiny["qwen3"]
    batch = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[])
    single = [generate_ids(model, [p], max_new_tokens=8, eos_token_ids=[]).tokens[0] for p in PROMPTS]
    assert batch.tokens == single


def _padded_prompts(model, P: int = 32):
    """PROMPTS right-padded to P, their lengths and an empty cache of P + 8 slots."""
    from specjax.models.target import KVCache

    ids = np.zeros((len(PROMPTS), P), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    return [len(p) for p in PROMPTS], ids, KVCache.init(model.config, len(PROMPTS), P + 8)


def _assert_same_prefill(ref, got, lens):
    """Two prefills' (last logits, cache, taps) agree on every real row and slot."""
    (l1, c1, a1), (l2, c2, a2) = ref, got
    np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-5)
    assert c2.lengths.tolist() == c1.lengths.tolist() == lens and [a.shape for a in a2] == [a.shape for a in a1]
    for b, n in enumerate(lens):
        for x, y in zip(c1.k + c1.v, c2.k + c2.v):
            np.testing.assert_allclose(y[b, :, :n], x[b, :, :n], rtol=1e-5, atol=1e-5)
        for x, y in zip(a1, a2):
            np.testing.assert_allclose(y[b, :n], x[b, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fam", ["llama", "qwen3"])
def test_packed_prefill_equals_padded(tiny, fam):
    """Prompts back to back in one row (qwen3: sliding window 4) give the padded prefill's last
    logits, cache rows, lengths and tapped hidden states; generation from it is token-identical."""
    model, _ = tiny[fam]
    lens, ids, cache = _padded_prompts(model)
    taps = (1, model.config.num_hidden_layers)
    l1, c1, a1 = gen.prefill(model, jnp.asarray(ids), jnp.asarray(lens), cache, tap_ids=taps)
    l2, c2, a2 = gen.prefill(model, jnp.asarray(ids), jnp.asarray(lens), cache, tap_ids=taps, packed_len=24)
    _assert_same_prefill((l1, c1, a1), (l2, c2, a2), lens)
    assert gen.packed_length(lens, 32) == 32 and gen.packed_length(lens, 16) == 32 and gen.packed_length(lens, 9) == 18
    assert gen.packed_length([5], 32) is None and gen.packed_length([30, 30], 32) is None
    assert gen.packed_length([4] * 1000, 4) is None  # past PACK_MAX: stays padded
    padded = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], packed_len=None)
    packed = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], packed_len=17)
    assert packed.tokens == padded.tokens
    with pytest.raises(ValueError, match="packed_len 16 is shorter than the prompts together \\(17 tokens\\)"):
        generate_ids(model, PROMPTS, max_new_tokens=8, packed_len=16)
    with pytest.raises(ValueError, match="one row and a cache"):
        model(jnp.asarray(ids), cache=cache, segments=jnp.zeros((ids.shape[1],), jnp.int32))


@pytest.mark.parametrize("fam", ["llama", "qwen3"])
def test_shared_prefix_prefill_equals_one_pass(tiny, fam):
    """Prompts that share their first tokens (a chat template's system turn; qwen3: sliding
    window 4, so windows span the prefix's end): the prefix run once and copied into every row
    gives the one-pass prefill's last logits, cache rows, lengths and taps; the generate loop
    with it is token-identical; a prefix that leaves a prompt nothing of its own, or one combined
    with another layout, is refused."""
    from specjax.decode.prefill import shared_prefix_prefill
    from specjax.models.target import KVCache

    model, _ = tiny[fam]
    head = [30, 31, 32, 33, 34]
    prompts = [head + p for p in PROMPTS]
    lens = [len(p) for p in prompts]
    ids = np.zeros((len(prompts), 32), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    cache = KVCache.init(model.config, len(prompts), 40)
    taps = (0, 2, model.config.num_hidden_layers)
    ref = gen.prefill(model, jnp.asarray(ids), jnp.asarray(lens), cache, tap_ids=taps)
    for S in (1, 5):
        got = jax.jit(lambda i, n, c: gen.prefill(model, i, n, c, tap_ids=taps, shared_prefix=S))(
            jnp.asarray(ids), jnp.asarray(lens), cache)
        _assert_same_prefill(ref, got, lens)
    with pytest.raises(ValueError, match="shared_prefix 32 must lie in \\(0, 32\\)"):
        shared_prefix_prefill(model, jnp.asarray(ids), jnp.asarray(lens), cache, prefix=32)
    with pytest.raises(ValueError, match="without packed_len or chunk"):
        gen.prefill(model, jnp.asarray(ids), jnp.asarray(lens), cache, shared_prefix=5, chunk=4)
    graphdef, params = __import__("flax").nnx.split(model)
    b = len(prompts) + 1  # a filler row past the prompts
    ids_b = np.concatenate([ids, ids[:1]]).astype(np.int32)
    lens_b = np.asarray(lens + lens[:1], np.int32)
    limits = np.asarray([8] * len(prompts) + [0], np.int32)
    runs = [gen.generate_padded(graphdef, params, jnp.asarray(ids_b), jnp.asarray(lens_b), jnp.asarray(limits),
                                jax.random.key(0), jnp.zeros((0,), jnp.int32), max_new_tokens=8, max_len=40,
                                sampling=SamplingParams(), pad_id=0, cache_dtype=jnp.float32, shared_prefix=S)
            for S in (0, 5)]
    assert b == ids_b.shape[0]
    np.testing.assert_array_equal(np.asarray(runs[1][0])[:-1], np.asarray(runs[0][0])[:-1])
    np.testing.assert_array_equal(np.asarray(runs[1][1]), np.asarray(runs[0][1]))


@pytest.mark.parametrize("fam", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [2, 4, 7])
def test_chunked_prefill_equals_one_pass(tiny, fam, chunk):
    """Chunks of 2 / 4 / 7 tokens through the cache (qwen3: sliding window 4, so windows span
    chunks) give the one-pass prefill's last logits, cache rows, lengths and taps, for ragged
    prompts in a bucket padded far past them; the loop stops after the longest prompt's chunks;
    generation from it is token-identical; one compile serves prompts of other lengths."""
    model, _ = tiny[fam]
    lens, ids, cache = _padded_prompts(model)
    taps = (0, 2, model.config.num_hidden_layers)
    l1, c1, a1 = gen.prefill(model, jnp.asarray(ids), jnp.asarray(lens), cache, tap_ids=taps)
    l2, c2, a2 = jax.jit(lambda i, n, c: gen.prefill(model, i, n, c, tap_ids=taps, chunk=chunk))(
        jnp.asarray(ids), jnp.asarray(lens), cache)
    _assert_same_prefill((l1, c1, a1), (l2, c2, a2), lens)
    # no trip past the longest prompt: slots from its last chunk's end on are never written
    end = -(-max(lens) // chunk) * chunk
    for x in c2.k:
        assert not np.asarray(x[:, :, end:]).any()
    one = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], packed_len=None, prompt_bucket=32)
    before = gen.TRACE_COUNT["generate"]
    chunked = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], packed_len=None, prompt_bucket=32,
                           prefill_chunk=chunk)
    assert chunked.tokens == one.tokens
    other = [[3, 4], [9] * 20, [7, 8, 9]]
    again = generate_ids(model, other, max_new_tokens=8, eos_token_ids=[], packed_len=None, prompt_bucket=32,
                         prefill_chunk=chunk)
    assert gen.TRACE_COUNT["generate"] == before + 1
    assert again.tokens == generate_ids(model, other, max_new_tokens=8, eos_token_ids=[], packed_len=None,
                                        prompt_bucket=32).tokens


def test_eos_stops_each_sequence_independently(tiny):
    model, _ = tiny["llama"]
    free = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[]).tokens
    # an EOS that sequence 0 emits early and some other sequence never emits
    eos = next(t for t in free[0][1:5] if t not in free[1] or t not in free[2])
    res = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[eos])
    for toks, got, reason in zip(free, res.tokens, res.stop_reasons):
        if eos in toks:
            cut = toks.index(eos) + 1
            assert got == toks[:cut] and reason == "eos"  # EOS kept, nothing after it
        else:
            assert got == toks and reason == "length"  # unaffected by the others stopping
    assert res.stop_reasons[0] == "eos" and len(res.tokens[0]) <= 5
    assert "length" in res.stop_reasons


def test_context_limit_per_sequence_and_too_long_prompt(tiny):
    model, _ = tiny["llama"]
    res = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], context_length=12)
    assert [len(t) for t in res.tokens] == [7, 8, 3]  # 12 - prompt length, capped at 8
    full = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[]).tokens
    assert all(full[i][: len(t)] == t for i, t in enumerate(res.tokens))
    with pytest.raises(ContextLengthError, match="prompt 2 has 9 tokens; the context length is 9"):
        generate_ids(model, PROMPTS, max_new_tokens=4, context_length=9)
    with pytest.raises(ContextLengthError, match="context length is 256"):
        generate_ids(model, [[1] * 300], max_new_tokens=4)


def test_same_shapes_compile_once(tiny):
    model, _ = tiny["llama"]
    generate_ids(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, eos_token_ids=[2])
    n = gen.TRACE_COUNT["generate"]
    a = generate_ids(model, [[1, 2, 3], [4, 5]], max_new_tokens=5, eos_token_ids=[2])
    b = generate_ids(model, [[7, 8, 9, 10], [11]], max_new_tokens=5, eos_token_ids=[2])  # same prompt bucket
    assert gen.TRACE_COUNT["generate"] == n
    generate_ids(model, [[7, 8, 9, 10], [11]], max_new_tokens=6, eos_token_ids=[2])
    assert gen.TRACE_COUNT["generate"] == n + 1
    assert a.tokens != b.tokens


def test_runtime_limit_is_a_prefix_in_the_same_program(tiny):
    """``limit`` caps each sequence's tokens inside the program compiled for ``max_new_tokens``."""
    model, _ = tiny["llama"]
    full = generate_ids(model, PROMPTS, max_new_tokens=7, eos_token_ids=[])
    n = gen.TRACE_COUNT["generate"]
    for lim in (1, 3):
        cut = generate_ids(model, PROMPTS, max_new_tokens=7, eos_token_ids=[], limit=lim)
        assert cut.tokens == [t[:lim] for t in full.tokens] and cut.stop_reasons == ["length"] * 3
    assert gen.TRACE_COUNT["generate"] == n
    for bad in (0, 8):
        with pytest.raises(ValueError, match="limit must be in 1..max_new_tokens"):
            generate_ids(model, PROMPTS, max_new_tokens=7, limit=bad)


def test_whole_loop_is_one_program_with_a_while_loop(tiny):
    from flax import nnx

    model, _ = tiny["llama"]
    g, params = nnx.split(model)
    lowered = gen._generate_jit.lower(g, params, jnp.zeros((2, 32), jnp.int32), jnp.asarray([3, 2]),
                                      jnp.asarray([5, 5]), jax.random.key(0), jnp.asarray([2]), max_new_tokens=5,
                                      max_len=37, sampling=SamplingParams(), pad_id=0, cache_dtype=jnp.dtype("float32"))
    text = lowered.as_text()
    main = text[text.index("func.func public @main"):]
    main = main[: main.find("func.func", 10) if "func.func" in main[10:] else len(main)]
    assert main.count("stablehlo.while") == 1  # the decode loop (PRNG helpers have their own)


def test_emit_ragged_with_eos_and_limit():
    B, N = 3, 6
    st = DecodeState(step=jnp.int32(0), tokens=jnp.full((B, N), -1, jnp.int32), num_tokens=jnp.asarray([0, 1, 4]),
                     limit=jnp.asarray([6, 6, 5]), done=jnp.asarray([False, False, False]),
                     eos_hit=jnp.zeros(B, bool), last=jnp.zeros(B, jnp.int32), cache=None, key=None)
    new = jnp.asarray([[5, 6, 7], [8, 99, 9], [10, 11, 12]])
    out = emit(st, new, jnp.asarray([2, 3, 3]), jnp.asarray([99]), -1)
    assert np.asarray(out.tokens).tolist() == [[5, 6, -1, -1, -1, -1], [-1, 8, 99, -1, -1, -1],
                                               [-1, -1, -1, -1, 10, -1]]
    assert np.asarray(out.num_tokens).tolist() == [2, 3, 5]
    assert np.asarray(out.done).tolist() == [False, True, True]
    assert np.asarray(out.eos_hit).tolist() == [False, True, False]
    assert np.asarray(out.last).tolist() == [6, 99, 10]
    again = emit(out, new, jnp.asarray([3, 3, 3]), jnp.asarray([99]), -1)  # done rows take nothing
    assert np.asarray(again.num_tokens).tolist() == [5, 3, 5]


def test_sampling_reproducible_and_topk1_is_greedy(tiny):
    model, _ = tiny["llama"]
    greedy = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[]).tokens
    k1 = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[],
                      sampling=SamplingParams(temperature=1.0, top_k=1), seed=3).tokens
    assert k1 == greedy
    hot = SamplingParams(temperature=2.0, top_p=0.95)
    s1 = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], sampling=hot, seed=1).tokens
    s1b = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], sampling=hot, seed=1).tokens
    s2 = generate_ids(model, PROMPTS, max_new_tokens=8, eos_token_ids=[], sampling=hot, seed=2).tokens
    assert s1 == s1b and s1 != s2


@pytest.mark.parametrize("t,k,p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6), (1.0, 0, 0.05)])
def test_process_logits_matches_hf_warpers(t, k, p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else [])
                                + ([TopPLogitsWarper(p)] if p < 1 else []))
    want = procs(None, torch.tensor(logits)).numpy()
    got = np.asarray(process_logits(jnp.asarray(logits), SamplingParams(temperature=t, top_k=k, top_p=p)))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    assert np.allclose(got[fin], want[fin], rtol=1e-6)


def test_sample_only_draws_allowed_tokens():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(64, VOCAB)).astype(np.float32))
    params = SamplingParams(temperature=1.0, top_k=3)
    allowed = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    for s in range(5):
        tok = np.asarray(sample(jax.random.key(s), logits, params))
        assert all(tok[i] in allowed[i] for i in range(64))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
