"""The jitted speculative loop on tiny float32 models, for every draft algorithm (speculators-built
random drafts: low acceptance) and the target-derived oracle draft (acceptance 1):

* greedy output is token-identical to target-only output, ragged batch 4 and batch 1;
* hand-off: every round's proposal equals the draft run from scratch on the committed prefix
  (so the draft state is rebuilt from the target's hidden states of the committed tokens only),
  also with several tokens committed per round (speculators' relaxed rule forces acceptance);
* rollback: the target and draft caches after rejections equal the caches of a run that never
  saw the rejected tokens;
* ragged batch == one by one (tokens and per-round acceptance), EOS per sequence;
* one compile per shape; bad draft/target pairs refused naming both sides.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decode import speculative as spec
from specjax.decode.generate import generate_ids
from specjax.decode.spec_stats import SpecStats, expected_tokens, predicted_speedup
from specjax.decode.speculative import (
    DraftTargetMismatchError, check_pair, load_spec_draft, resolve_k, speculative_generate_ids,
)
from specjax.models.hf import load_hf_dir
from specjax.models.target import KVCache

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4]]
NEW = 10
CASES = {  # algorithm -> (verifier family, speculators build kwargs)
    "eagle3": ("llama", {"draft_vocab": 40, "norm_output": True, "num_layers": 2}),
    "peagle": ("llama", {"draft_vocab": 40}),
    "dflash": ("llama", {"draft_vocab": 40}),
    "dspark": ("qwen3", {"markov_head_type": "rnn"}),
    "mtp": ("qwen3", {}),
    "self": ("llama", None),  # oracle: the target's own layers
}
RELAXED = dict(verifier_accept_k=40, accept_tolerance=1.0)  # lossy: accepts random drafts' near misses


@pytest.fixture(scope="module")
def targets(verifiers):
    return {fam: load_hf_dir(d) for fam, d in verifiers.items()}


@pytest.fixture(scope="module")
def drafts(verifiers, targets, tmp_path_factory):
    """algo -> SpecDraft (speculators checkpoints built once per module)."""
    from tests.refs.speculators_ckpts import build

    root = tmp_path_factory.mktemp("spec-drafts")
    out = {}
    for algo, (fam, kw) in CASES.items():
        if kw is None:
            out[algo] = load_spec_draft("self", targets[fam])
        else:
            path = build(algo, root / algo, verifiers[fam], **kw)
            out[algo] = load_spec_draft(str(path), targets[fam])
    return out


T_FIX = 32  # every from-scratch sequence padded to this (one compile per draft)


def _pad(seqs, T, pad=0):
    ids = np.full((len(seqs), T), pad, np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s[:T]
    return jnp.asarray(ids)


@functools.partial(nnx.jit, static_argnames=("k",))
def _from_scratch(target, draft, ids, n_valid, *, k):
    """ids [N, T+1] whole sequences. The target over ids[:, :T] into a fresh cache (taps for the
    draft), then the draft speculating from a fresh cache on rows 0..n_valid-1."""
    N, T = ids.shape[0], ids.shape[1] - 1
    out = target(ids[:, :T], cache=KVCache.init(target.config, N, T),
                 tap_ids=draft.tap_ids(target.config.num_hidden_layers))
    pos = jnp.broadcast_to(jnp.arange(T), (N, T))
    prop = draft.speculate(draft.init_cache(N, T + 2 * k + 2), draft.aux_from_taps(out.aux_hidden_states),
                           ids[:, 1:], pos, n_valid=n_valid, k=k)
    return prop.tokens[:, :k], prop.cache, out.cache


def check_handoff_and_caches(target, sd, prompts, res):
    """(1) every live round's proposal == the draft speculating from scratch on that round's
    committed prefix (rows 0..L-1, anchor = the last emitted token); (2) valid slots of the final
    target and draft caches == caches built from the committed tokens alone (rejected tokens
    leave no trace). Returns the number of rounds checked."""
    tr = res.trace
    seqs = [list(p) + list(t) for p, t in zip(prompts, res.tokens)]
    B = len(seqs)
    rr, bb = np.nonzero(tr["live"])
    L = tr["start_length"][rr, bb]
    assert (L + 1 <= np.asarray([len(seqs[b]) for b in bb])).all()
    tc, dc = tr["target_cache"], tr["draft_cache"]
    n_t = np.minimum(np.asarray(tc.lengths), [len(s) for s in seqs])
    n_d = np.minimum(np.asarray(dc.lengths), [len(s) - 1 for s in seqs])
    R, k = tr["proposals"].shape[0], tr["proposals"].shape[-1]
    rows = list(bb) + list(range(B)) + [0] * (R * B - len(bb))  # fixed N = (R + 1) * B rows
    nv = np.concatenate([L, n_d, np.ones(R * B - len(bb), np.int64)])
    toks, fd, ft = _from_scratch(target, sd.module, _pad([seqs[b] for b in rows], T_FIX + 1), jnp.asarray(nv), k=k)
    np.testing.assert_array_equal(np.asarray(toks)[: len(bb)], tr["proposals"][rr, bb])
    off = len(bb)
    for b in range(B):
        for i in range(len(tc.k)):
            for got, want in ((tc.k[i], ft.k[i]), (tc.v[i], ft.v[i])):
                np.testing.assert_allclose(_seq_major(tc, got)[b, : n_t[b]], _seq_major(ft, want)[off + b, : n_t[b]],
                                           atol=2e-5)
        for i in range(len(dc.k)):
            for got, want in ((dc.k[i], fd.k[i]), (dc.v[i], fd.v[i])):
                np.testing.assert_allclose(_seq_major(dc, got)[b, : n_d[b]], _seq_major(fd, want)[off + b, : n_d[b]],
                                           atol=1e-4)
    return len(bb)


def _seq_major(cache, x):
    """One layer's K or V as [B, S, H, D] (the target's KVCache is heads-major, DraftCache is not)."""
    x = np.asarray(x)
    return np.swapaxes(x, 1, 2) if type(cache).heads_axis == 1 else x


@pytest.mark.parametrize("algo", list(CASES))
def test_greedy_equal_handoff_and_rollback(targets, drafts, algo):
    fam = CASES[algo][0]
    target, sd = targets[fam], drafts[algo]
    ref = generate_ids(target, PROMPTS, max_new_tokens=NEW, eos_token_ids=[]).tokens
    res = speculative_generate_ids(target, sd, PROMPTS, max_new_tokens=NEW, eos_token_ids=[], trace=True)
    assert res.tokens == ref  # lossless, ragged batch 4
    assert not res.stats.lossy
    if algo == "self":
        assert res.stats.tau == res.stats.k + 1  # the oracle's proposals are always accepted
    assert check_handoff_and_caches(target, sd, PROMPTS, res) == res.stats.rounds
    # relaxed acceptance (same compiled program): several committed rows per round
    n = spec.TRACE_COUNT["speculative"]
    lossy = speculative_generate_ids(target, sd, PROMPTS, max_new_tokens=NEW, eos_token_ids=[], trace=True, **RELAXED)
    assert spec.TRACE_COUNT["speculative"] == n
    assert lossy.stats.lossy and lossy.stats.hist[:, 2:].sum() > 0  # rounds committing 3+ tokens
    assert check_handoff_and_caches(target, sd, PROMPTS, lossy) == lossy.stats.rounds
    # batch 1
    one = speculative_generate_ids(target, sd, PROMPTS[2:3], max_new_tokens=NEW, eos_token_ids=[])
    assert one.tokens == ref[2:3]
    # a runtime limit: the same program stops every sequence after that many tokens
    n = spec.TRACE_COUNT["speculative"]
    for lim in (1, 4):
        cut = speculative_generate_ids(target, sd, PROMPTS, max_new_tokens=NEW, eos_token_ids=[], trace=True,
                                       limit=lim)
        assert cut.tokens == [t[:lim] for t in ref]
    assert spec.TRACE_COUNT["speculative"] == n


@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
def test_chunked_prefill_same_tokens_and_acceptance(targets, drafts, algo):
    """The prompt prefill in chunks of 4 through the cache (a 32-token bucket): the draft ingests
    the same prompt rows, so tokens and per-round acceptance equal the one-pass prefill's."""
    fam = CASES[algo][0]
    target, sd = targets[fam], drafts[algo]
    kw = dict(max_new_tokens=NEW, eos_token_ids=[], packed_len=None, prompt_bucket=32)
    one = speculative_generate_ids(target, sd, PROMPTS, **kw)
    chunked = speculative_generate_ids(target, sd, PROMPTS, prefill_chunk=4, **kw)
    assert chunked.tokens == one.tokens == generate_ids(target, PROMPTS, max_new_tokens=NEW, eos_token_ids=[]).tokens
    np.testing.assert_array_equal(chunked.stats.hist, one.stats.hist)


def test_ragged_batch_equals_one_by_one_with_eos(targets):
    target = targets["llama"]
    sd = load_spec_draft("self:2", target)  # partial acceptance
    free = generate_ids(target, PROMPTS, max_new_tokens=NEW, eos_token_ids=[]).tokens
    eos = next(t for t in free[0][1:6] if any(t not in f for f in free[1:]))
    batch = speculative_generate_ids(target, sd, PROMPTS, k=3, max_new_tokens=NEW, eos_token_ids=[eos])
    assert 1.0 < batch.stats.tau < 4.0
    ref = generate_ids(target, PROMPTS, max_new_tokens=NEW, eos_token_ids=[eos])
    assert batch.tokens == ref.tokens and batch.stop_reasons == ref.stop_reasons
    assert "eos" in batch.stop_reasons and "length" in batch.stop_reasons
    n = spec.TRACE_COUNT["speculative"]
    for i, p in enumerate(PROMPTS):
        one = speculative_generate_ids(target, sd, [p], k=3, max_new_tokens=NEW, eos_token_ids=[eos])
        assert one.tokens[0] == batch.tokens[i] and one.stop_reasons[0] == batch.stop_reasons[i]
        np.testing.assert_array_equal(one.stats.hist[0], batch.stats.hist[i])  # same acceptance round by round
    assert spec.TRACE_COUNT["speculative"] == n + 1  # four batch-1 runs, one compile


def test_checkpoint_acceptance_settings_and_sampled_pruned_draft(targets, drafts):
    target, sd = targets["llama"], drafts["eagle3"]
    cfg = sd.config.model_copy(deep=True)
    cfg.speculators_config.proposal_methods[0].verifier_accept_k = 40
    cfg.speculators_config.proposal_methods[0].accept_tolerance = 1.0
    relaxed = spec.SpecDraft(sd.module, cfg, "relaxed")
    kw = dict(max_new_tokens=NEW, eos_token_ids=[])
    # (trace=True: the program the parametrised test above already compiled)
    got = speculative_generate_ids(target, relaxed, PROMPTS, trace=True, **kw)  # honoured by default, lossy
    assert got.stats.lossy and got.stats.tau > 1.0
    exact = speculative_generate_ids(target, relaxed, PROMPTS, lossless=True, trace=True, **kw)
    assert not exact.stats.lossy and exact.tokens == generate_ids(target, PROMPTS, **kw).tokens
    # temperature > 0 with sampled proposals over the pruned draft vocabulary (d2t scatter of q)
    from specjax.decode.sampling import SamplingParams

    s = speculative_generate_ids(target, sd, PROMPTS, sampling=SamplingParams(temperature=1.0, top_p=0.9),
                                 draft_sampling="sample", seed=4, **kw)
    assert all(len(t) == NEW and all(0 <= x < 96 for x in t) for t in s.tokens) and s.stats.rounds > 0


def test_k_override_one_program_per_shape_no_host_callbacks(targets, drafts):
    target, sd = targets["llama"], drafts["eagle3"]
    assert resolve_k(sd, None) == sd.config.speculative_tokens  # k from the checkpoint
    a = speculative_generate_ids(target, sd, [[1, 2, 3], [4, 5]], k=2, max_new_tokens=6, eos_token_ids=[2])
    n = spec.TRACE_COUNT["speculative"]
    b = speculative_generate_ids(target, sd, [[7, 8, 9, 10], [11]], k=2, max_new_tokens=6, eos_token_ids=[2])
    assert spec.TRACE_COUNT["speculative"] == n and a.stats.k == 2 and a.tokens != b.tokens
    g, state = spec.split_pair(target, sd.module)
    text = spec._spec_jit.lower(g, state, jnp.zeros((2, 32), jnp.int32), jnp.asarray([3, 2]), jnp.asarray([6, 6]),
                                jax.random.key(0), jnp.asarray([2]), jnp.asarray([1.0, 0.0]),
                                params=spec.SpecParams(k=2), max_new_tokens=6, max_len=38, draft_len=44, pad_id=0,
                                cache_dtype=jnp.dtype("float32"), draft_dtype=jnp.dtype("float32"),
                                trace=False).as_text()
    assert "stablehlo.while" in text and "callback" not in text


def test_bad_pairs_refused_naming_both_sides(targets, drafts, verifiers):
    sd = drafts["eagle3"]
    tc = targets["llama"].config
    for over, words in [(dict(hidden_size=64), ["hidden size", "32", "64"]),
                        (dict(vocab_size=128), ["vocabulary", "96", "128"]),
                        (dict(num_hidden_layers=3), ["aux hidden-state layer ids", "[1, 3, 4]", "3"]),
                        (dict(family="qwen3"), ["architecture", "LlamaForCausalLM", "Qwen3ForCausalLM"])]:
        with pytest.raises(DraftTargetMismatchError) as e:
            check_pair(sd.config, tc.replace(**over), draft_src="D", target_src="T")
        msg = str(e.value)
        assert "draft D does not fit target T" in msg and all(w in msg for w in words), msg
    # through the loader: the eagle3 draft (llama verifier) against the qwen3 target
    with pytest.raises(DraftTargetMismatchError, match="architecture"):
        load_spec_draft(sd.source, targets["qwen3"])
    with pytest.warns(UserWarning, match="larger than the 3 speculative tokens"):
        assert resolve_k(sd, 5) == 5
    with pytest.raises(DraftTargetMismatchError, match="proposes 3 tokens"):
        resolve_k(drafts["dflash"], 4)
    with pytest.raises(ValueError, match="self:M"):
        load_spec_draft("self:x", targets["llama"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_k(drafts["self"], 7)  # a self draft has no trained k


def test_stats_and_formula():
    st = SpecStats(3, np.asarray([[2, 1, 0, 1], [0, 0, 1, 3]]))
    assert st.rounds == 8 and st.tokens_per_step() == {1: 2, 2: 1, 3: 1, 4: 4}
    assert st.tau == pytest.approx((2 * 1 + 1 * 2 + 1 * 3 + 4 * 4) / 8)
    assert st.per_position == pytest.approx([6 / 8, 5 / 8, 4 / 8])
    assert st.conditional == pytest.approx([6 / 8, 5 / 6, 4 / 5])
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)  # the seed's example
    assert expected_tokens(st.alpha, 3) == pytest.approx(st.tau, rel=1e-6)
    assert predicted_speedup(3.36, 4, 0.05) == pytest.approx(3.36 / 1.2)
