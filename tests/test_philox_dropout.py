"""The dropout keep-mask: the conventions' counter layout, the threshold and the keep rate."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flashgen.verify.dropout import keep_mask, keep_mask_varlen, keep_threshold
from flashgen.verify.philox import philox4x32
from hypothesis import given, settings
from hypothesis import strategies as st


def keep_by_hand(seed, offset, batch, heads, sq, sk, p):
    """One Philox call per element, straight from docs/conventions.md."""
    threshold = math.floor(p * 2**32)
    out = np.zeros((batch, heads, sq, sk), dtype=bool)
    key = (seed & 0xFFFFFFFF, seed >> 32)
    for b in range(batch):
        for h in range(heads):
            for i in range(sq):
                for j in range(sk):
                    words = philox4x32((j >> 2, i, b * heads + h, offset & 0xFFFFFFFF), key)
                    out[b, h, i, j] = int(words[j & 3]) >= threshold
    return out


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    sq=st.integers(1, 5),
    sk=st.integers(1, 9),
    p=st.sampled_from((0.0, 0.1, 0.5, 0.9)),
)
def test_keep_mask_follows_the_counter_layout_element_by_element(
    seed, offset, batch, heads, sq, sk, p
):
    got = keep_mask(seed, offset, batch, heads, sq, sk, p)
    assert got.shape == (batch, heads, sq, sk) and got.dtype == np.bool_
    np.testing.assert_array_equal(got, keep_by_hand(seed, offset, batch, heads, sq, sk, p))


def test_threshold_is_floor_of_p_times_two_to_the_32():
    assert keep_threshold(0.0) == 0
    assert keep_threshold(0.5) == 2**31
    assert keep_threshold(0.1) == 429496729
    assert keep_threshold(1 - 2**-32) == 2**32 - 1
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            keep_threshold(bad)


def test_p_zero_keeps_everything():
    assert keep_mask(123, 4, 2, 3, 17, 19, 0.0).all()


def test_only_the_low_32_bits_of_the_offset_matter():
    a = keep_mask(99, 5, 1, 2, 8, 8, 0.5)
    assert np.array_equal(a, keep_mask(99, 5 + (7 << 32), 1, 2, 8, 8, 0.5))
    assert not np.array_equal(a, keep_mask(99, 6, 1, 2, 8, 8, 0.5))


def test_both_seed_words_matter():
    a = keep_mask(1, 0, 1, 1, 16, 16, 0.5)
    assert not np.array_equal(a, keep_mask(1 + (1 << 32), 0, 1, 1, 16, 16, 0.5))
    assert not np.array_equal(a, keep_mask(2, 0, 1, 1, 16, 16, 0.5))


def test_the_mask_of_a_longer_sequence_extends_that_of_a_shorter_one():
    small = keep_mask(7, 3, 2, 2, 5, 6, 0.3)
    large = keep_mask(7, 3, 2, 2, 9, 11, 0.3)
    np.testing.assert_array_equal(large[:, :, :5, :6], small)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_keep_rate_is_within_binomial_bounds_in_every_word_slot(p):
    mask = keep_mask(0x0123456789ABCDEF, 17, 2, 4, 64, 64, p)
    # 6 standard deviations: a false alarm has probability ~2e-9 per check.
    for sub in [mask] + [mask[..., s::4] for s in range(4)]:
        n = sub.size
        kept = int(sub.sum())
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(kept - n * (1 - p)) <= 6 * sigma, (p, n, kept)


def test_varlen_mask_equals_the_dense_mask_inside_each_sequence_and_is_false_outside():
    lq, lk = [3, 0, 7], [5, 4, 2]
    got = keep_mask_varlen(42, 9, 2, lq, lk, 0.4)
    assert got.shape == (3, 2, 7, 5)
    dense = keep_mask(42, 9, 3, 2, 7, 5, 0.4)
    for b in range(3):
        np.testing.assert_array_equal(got[b, :, : lq[b], : lk[b]], dense[b, :, : lq[b], : lk[b]])
        outside = np.ones((2, 7, 5), bool)
        outside[:, : lq[b], : lk[b]] = False
        assert not got[b][outside].any()


def test_varlen_mask_with_p_zero_keeps_every_element_inside_the_sequences():
    got = keep_mask_varlen(1, 2, 1, [2, 4], [3, 1], 0.0)
    assert got[0, 0, :2, :3].all() and got[1, 0, :4, :1].all()
    assert got.sum() == 2 * 3 + 4 * 1
