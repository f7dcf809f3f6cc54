"""The inference step (draft KV cache, chain / block proposals) agrees with the training forward
on the positions both compute, under jit, with ragged batches and rollback."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.drafts import load_draft
from tests.drafts.conftest import TOL, rel_err
from tests.refs.spec_forward import packed_batch

SWA = {"num_layers": 2, "layer_over": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
                                       "use_sliding_window": True}}


def one_doc(algo, draft, T=20, seed=0):
    """A single-document packed row (no padding) in the layout the training forward takes."""
    H, V = draft.spec.hidden, draft.spec.vocab_size
    A = getattr(draft, "num_aux", 1)
    b = packed_batch(algo, hidden=H, num_aux=A, vocab=V, lengths=(T + 1,), total_len=T, seed=seed,
                     avoid_token=getattr(draft, "mask_token_id", None))
    return {k: jnp.asarray(v.numpy()) for k, v in b.items()}


@nnx.jit(static_argnames=("k",))
def _chain_propose(draft, cache, aux, ids, pos, n_valid, forced, k):
    return draft.propose(cache, aux, ids, pos, k=k, n_valid=n_valid, forced=forced)


@nnx.jit(static_argnames=("ttt_steps",))
def _ttt(draft, b, ttt_steps):
    """The EAGLE-3 training forward (jitted: eager TTT steps dispatch op by op)."""
    return draft(**b, ttt_steps=ttt_steps)


@nnx.jit
def _extend(draft, cache, aux, ids, pos):
    return draft.extend(cache, aux, ids, pos)


# ----------------------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("case", ["llama-nbr", "qwen3-output-swa"])
def test_eagle3_chain_matches_ttt(draft_ckpt, verifiers, case):
    fam, kw = {"llama-nbr": ("llama", {"draft_vocab": 40, "num_layers": 2}),
               "qwen3-output-swa": ("qwen3", {"norm_output": True, "fc_norm": True, **SWA})}[case]
    draft = load_draft(draft_ckpt("eagle3", fam, **kw), verifiers[fam])
    S = 4
    b = one_doc("eagle3", draft)
    train = _ttt(draft, b, S)  # logits [S, 1, T, Vd]
    aux, ids, pos = b["hidden_states"], b["input_ids"], b["position_ids"]
    # two sequences in one batch, different lengths (ragged), context written in two extends
    bases = [9, 13]
    cache = draft.init_cache(2, 32)
    first = 6
    cache = _extend(draft, cache, jnp.concatenate([aux[:, :first]] * 2), jnp.concatenate([ids[:, :first]] * 2),
                    jnp.concatenate([pos[:, :first]] * 2)).cache
    n = max(bases) + 1 - first
    sl = slice(first, first + n)
    forced = jnp.stack([ids[0, j + 1:j + S] for j in bases])  # teacher forcing: step s feeds ids0[j + s]
    prop = _chain_propose(draft, cache, jnp.concatenate([aux[:, sl]] * 2), jnp.concatenate([ids[:, sl]] * 2),
                          jnp.concatenate([pos[:, sl]] * 2), jnp.asarray([j + 1 - first for j in bases]), forced, S)
    for row, j in enumerate(bases):
        ref = train.logits[:, 0, j]  # [S, Vd]
        assert rel_err(prop.logits[row], ref) <= TOL
    assert prop.tokens.shape == (2, S)
    np.testing.assert_array_equal(np.asarray(prop.cache.lengths), [j + 1 for j in bases])
    # rollback + continue: sequence 0 rejected everything (back to 10 rows), sequence 1 keeps its 14;
    # the next context rows (right-padded, ragged) overwrite the scratch rows of the last proposal
    j2 = 16
    c2 = prop.cache.rollback(jnp.asarray([10, 14]))

    def rows(x, start):
        r = x[:, start:j2 + 1]
        return jnp.pad(r, [(0, 0), (0, 7 - r.shape[1])] + [(0, 0)] * (x.ndim - 2))

    prop2 = _chain_propose(draft, c2, jnp.concatenate([rows(aux, 10), rows(aux, 14)]),
                           jnp.concatenate([rows(ids, 10), rows(ids, 14)]),
                           jnp.concatenate([rows(pos, 10), rows(pos, 14)]), jnp.asarray([7, 3]),
                           jnp.stack([ids[0, j2 + 1:j2 + 3]] * 2), 3)
    for row in range(2):
        assert rel_err(prop2.logits[row], train.logits[:3, 0, j2]) <= TOL


def test_eagle3_extend_logits_are_step0(draft_ckpt, verifiers):
    draft = load_draft(draft_ckpt("eagle3", "llama", norm_before_fc=True), verifiers["llama"])
    b = one_doc("eagle3", draft, T=12, seed=3)
    train = _ttt(draft, b, 1)
    out = _extend(draft, draft.init_cache(1, 16), b["hidden_states"], b["input_ids"], b["position_ids"])
    assert rel_err(out.logits, train.logits[0]) <= TOL
    assert rel_err(out.hidden, train.hidden[0]) <= TOL


# ----------------------------------------------------------------------------- P-EAGLE


def test_peagle_parallel_matches_training(draft_ckpt, verifiers):
    draft = load_draft(draft_ckpt("peagle", "qwen3", draft_vocab=40, **SWA), verifiers["qwen3"])
    K = 4
    b = one_doc("peagle", draft, T=18, seed=1)
    T = b["input_ids"].shape[1]
    bases = [7, 12]
    anchor = np.concatenate([np.arange(T)] + [np.asarray(bases)] * (K - 1))
    depth = np.concatenate([np.zeros(T, int)] + [np.full(len(bases), d) for d in range(1, K)])
    train = nnx.jit(lambda draft, b, a, d: draft(**b, anchor_pos=a, depth=d))(draft, b, jnp.asarray(anchor),
                                                                             jnp.asarray(depth))
    pos = jnp.arange(T)[None]  # P-EAGLE RoPE positions are packed-row indices
    propose = nnx.jit(lambda draft, cache, aux, ids, pos: draft.propose(cache, aux, ids, pos, k=K))
    for j in bases:
        cache = draft.init_cache(1, 32)
        prop = propose(draft, cache, b["hidden_states"][:, :j + 1], b["input_ids"][:, :j + 1], pos[:, :j + 1])
        want = [train.logits[0, j]] + [train.logits[0, T + (d - 1) * len(bases) + bases.index(j)] for d in range(1, K)]
        assert rel_err(prop.logits[0], jnp.stack(want)) <= TOL


# ----------------------------------------------------------------------------- DFlash / DSpark


@pytest.mark.parametrize("algo,fam,kw", [
    ("dflash", "qwen3", {"draft_vocab": 40}),
    ("dflash", "llama", {**SWA, "sample_from_anchor": True}),
    ("dflash", "qwen3", {**SWA, "sliding_window_non_causal": True}),
    ("dspark", "qwen3", {"markov_head_type": "rnn", "draft_vocab": 40}),
    ("dspark", "qwen3", {"markov_head_type": "gated", "sample_from_anchor": False, **SWA}),
])
def test_block_matches_training(draft_ckpt, verifiers, algo, fam, kw):
    draft = load_draft(draft_ckpt(algo, fam, **kw), verifiers[fam])
    b = one_doc(algo, draft, T=22, seed=2)
    Bk = draft.block_size
    anchors = jnp.asarray([3, 9, 14])
    train = nnx.jit(lambda draft, b, a: draft(**b, anchor_positions=a))(draft, b, anchors)
    first = 0 if draft.sample_from_anchor else 1

    @nnx.jit
    def run(draft, cache, aux, pos, tok, apos, forced):
        cache = draft.extend(cache, aux, pos)
        if algo == "dspark":
            return draft.propose(cache, tok, apos, forced=forced)
        return draft.propose(cache, tok, apos)

    for j, a in enumerate([3, 9, 14]):
        cache = draft.init_cache(1, 24)
        forced = b["input_ids"][:, a + 1:a + 1 + Bk - first]  # teacher forcing: the tokens each slot predicts
        prop = run(draft, cache, b["hidden_states"][:, :a], b["position_ids"][:, :a], b["input_ids"][:, a],
                   b["position_ids"][:, a], forced)
        ref = train.logits[0, j * Bk + first:(j + 1) * Bk]
        assert rel_err(prop.logits[0], ref) <= TOL
        if algo == "dspark" and train.confidence is not None:
            assert rel_err(prop.confidence[0], train.confidence[0, j * Bk + first:(j + 1) * Bk]) <= TOL


# ----------------------------------------------------------------------------- MTP


def test_mtp_step0_and_chain(draft_ckpt, verifiers):
    draft = load_draft(draft_ckpt("mtp", "qwen3"), verifiers["qwen3"])
    b = one_doc("mtp", draft, T=16, seed=4)
    train = nnx.jit(lambda draft, b: draft(**b))(draft, b)
    y, ids, pos = b["hidden_states"], b["input_ids"], b["position_ids"]
    Tv = train.logits.shape[2]
    # step 0 over the context rows is the training step 0 (row t: token x_{t+1}, hidden y_t, pos(t))
    ext = _extend(draft, draft.init_cache(1, 24), y[:, :Tv], ids[:, 1:Tv + 1], pos[:, :Tv])
    assert rel_err(ext.logits, train.logits[0]) <= TOL
    # chain steps == writing the same rows as context (incremental == batched)
    t = 9
    prop = _chain_propose(draft, draft.init_cache(1, 24), y[:, :t + 1], ids[:, 1:t + 2], pos[:, :t + 1], None,
                          ids[:, t + 2:t + 4], 3)
    assert rel_err(prop.logits[0, 0], train.logits[0, 0, t]) <= TOL
    c = _extend(draft, draft.init_cache(1, 24), y[:, :t + 1], ids[:, 1:t + 2], pos[:, :t + 1])
    h = c.hidden[:, -1]
    c = c.cache
    for s in (1, 2):
        o = draft.step(c, ids[:, t + 1 + s], h, pos[:, t] + s, s)
        assert rel_err(o.logits[0], prop.logits[0, s]) <= TOL
        h, c = o.hidden, o.cache
