"""t2d/d2t and token frequencies equal speculators 0.9.0's (ties, too few distinct tokens), the
token_freq.pt interop, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.train.errors import VocabMappingError
from specjax.train.vocab import (
    build_vocab_mapping, load_token_freq, load_vocab_mapping, save_token_freq, save_vocab_mapping, token_frequencies,
)


def ref_mapping(freq, vd, v):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), vd, v)
    return d2t.numpy(), t2d.numpy()


def check(freq, vd, v):
    d2t, t2d = build_vocab_mapping(freq, vd, v)
    rd, rt = ref_mapping(freq, vd, v)
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    np.testing.assert_array_equal(d2t, rd)
    np.testing.assert_array_equal(t2d, rt)


def test_ties_prefer_lower_id():
    freq = {7: 5, 3: 5, 9: 5, 1: 2, 20: 9, 4: 2}
    check(freq, 3, 32)
    d2t, _ = build_vocab_mapping(freq, 3, 32)
    assert (np.arange(3) + d2t).tolist() == [3, 7, 20]


def test_too_few_distinct_tokens_pads_with_smallest_unused():
    check({10: 4, 2: 1}, 6, 16)
    d2t, t2d = build_vocab_mapping({10: 4, 2: 1}, 6, 16)
    assert np.nonzero(t2d)[0].tolist() == [0, 1, 2, 3, 4, 10]
    check({}, 5, 8)
    check({3: 1}, 8, 8)  # Vd == V


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 63), st.integers(1, 4), max_size=64), st.integers(1, 64))
def test_random_counts_match_speculators(freq, vd):
    check(freq, vd, 64)


def test_frequencies_count_supervised_only():
    rows = [(np.array([1, 2, 2, 3]), np.array([0, 1, 1, 0])), (np.array([3, 3, 5]), np.array([1, 1, 1]))]
    assert token_frequencies(rows) == {2: 2, 3: 2, 5: 1}


def test_speculators_counting_agrees(tmp_path):
    import torch
    from datasets import Dataset

    from speculators.train.vocab_mapping import save_token_frequency_distribution

    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 50, n), (rng.random(n) < 0.6).astype(np.int64)) for n in (5, 17, 30)]
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]}).with_format("torch")
    save_token_frequency_distribution(ds, tmp_path / "ref.pt")
    assert token_frequencies(rows) == torch.load(tmp_path / "ref.pt", weights_only=True)


def test_token_freq_pt_roundtrip_with_torch(tmp_path):
    import torch

    freq = {5: 3, 1: 7, 40000: 1}
    p = save_token_freq(tmp_path / "token_freq.pt", freq)
    assert torch.load(p, weights_only=True) == freq
    torch.save({9: 2, 4: 4}, tmp_path / "ref.pt")
    assert load_token_freq(tmp_path / "ref.pt") == {9: 2, 4: 4}
    assert load_token_freq(p) == freq


def test_mapping_files_roundtrip(tmp_path):
    d2t, t2d = build_vocab_mapping({4: 3, 9: 2, 2: 2}, 4, 12)
    pd, pt = save_vocab_mapping(tmp_path, d2t, t2d)
    assert pd.name == "d2t-4.npy" and pt.name == "t2d-4.npy"
    d, t = load_vocab_mapping(tmp_path, 4, 12)
    np.testing.assert_array_equal(d, d2t)
    np.testing.assert_array_equal(t, t2d)
    assert load_vocab_mapping(tmp_path, 5, 12) is None
    with pytest.raises(VocabMappingError, match=r"expected \[13\]"):
        load_vocab_mapping(tmp_path, 4, 13)


def test_errors():
    with pytest.raises(VocabMappingError, match="larger than the target vocabulary"):
        build_vocab_mapping({1: 1}, 17, 16)
    with pytest.raises(VocabMappingError, match="outside the target vocabulary"):
        build_vocab_mapping({99: 1}, 4, 16)
