"""Philox4x32-10 against the Random123 known-answer vectors."""

from __future__ import annotations

import numpy as np
import pytest
from flashgen.verify.philox import philox4x32

KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("ctr", "key", "want"), KNOWN_ANSWERS)
def test_random123_known_answers(ctr, key, want):
    got = philox4x32(ctr, key)
    assert all(w.dtype == np.uint32 for w in got)
    assert tuple(int(w) for w in got) == want


def test_vectorised_evaluation_equals_one_counter_at_a_time():
    ctrs = np.array([c for c, _, _ in KNOWN_ANSWERS], dtype=np.uint64).T  # (4, 3)
    keys = np.array([k for _, k, _ in KNOWN_ANSWERS], dtype=np.uint64).T  # (2, 3)
    got = np.stack(philox4x32(tuple(ctrs), tuple(keys)), axis=-1)
    want = np.array([w for _, _, w in KNOWN_ANSWERS], dtype=np.uint32)
    np.testing.assert_array_equal(got, want)


def test_counter_words_broadcast_against_each_other():
    got = philox4x32((np.arange(3)[:, None], np.arange(2)[None, :], 5, 7), (11, 13))
    assert got[0].shape == (3, 2)
    one = philox4x32((2, 1, 5, 7), (11, 13))
    assert tuple(int(w[2, 1]) for w in got) == tuple(int(w) for w in one)


def test_words_outside_uint32_are_rejected():
    with pytest.raises(ValueError, match="uint32"):
        philox4x32((2**32, 0, 0, 0), (0, 0))
