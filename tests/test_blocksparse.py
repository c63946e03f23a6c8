"""The compact block-sparse layout: full vs partial tiles, dropped tiles, padding, round trip."""

from __future__ import annotations

import types

import numpy as np
import pytest
from flashgen.verify import reference as R
from flashgen.verify.blocksparse import (
    compact_layout,
    compact_layout_for_spec,
    dense_from_compact,
    tile_classes,
)
from flashgen.verify.strategies import block_layouts, seqlens, windows
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def sparse_problems(draw):
    sq, sk = draw(seqlens(40)), draw(seqlens(40))
    bm, bn = draw(st.sampled_from((1, 2, 3, 8, 16))), draw(st.sampled_from((1, 2, 5, 16)))
    causal = draw(st.sampled_from(("none", "top_left", "bottom_right")))
    window = draw(st.one_of(st.just((-1, -1)), windows(sk)))
    lh = draw(st.sampled_from((1, 3)))
    layout = draw(block_layouts(lh, -(-sq // bm), -(-sk // bn)))
    return layout, dict(
        block_m=bm, block_n=bn, seqlen_q=sq, seqlen_k=sk, causal=causal, window=window
    )


@settings(max_examples=80, deadline=None)
@given(sparse_problems())
def test_tiles_are_classified_by_brute_force_over_their_elements(problem):
    layout, kw = problem
    c = compact_layout(layout, **kw)
    bm, bn, sq, sk = kw["block_m"], kw["block_n"], kw["seqlen_q"], kw["seqlen_k"]
    vis = R.sequence_visible(sq, sk, causal=kw["causal"], window=kw["window"])[0]
    for hl in range(layout.shape[0]):
        for qt in range(layout.shape[1]):
            full = set(c.full_idx[hl, qt, : c.full_count[hl, qt]].tolist())
            part = set(c.part_idx[hl, qt, : c.part_count[hl, qt]].tolist())
            for kt in range(layout.shape[2]):
                rows = slice(qt * bm, min((qt + 1) * bm, sq))
                # columns past Sk fail rule 1: pad the tile with invisible columns
                tile = np.zeros((rows.stop - rows.start, bn), bool)
                cols = vis[rows, kt * bn : (kt + 1) * bn]
                tile[:, : cols.shape[1]] = cols
                if not layout[hl, qt, kt] or not tile.any():
                    assert kt not in full and kt not in part
                elif tile.all():
                    assert kt in full and kt not in part
                else:
                    assert kt in part and kt not in full


@settings(max_examples=80, deadline=None)
@given(sparse_problems())
def test_compact_arrays_are_int32_ascending_and_padded_with_minus_one(problem):
    layout, kw = problem
    c = compact_layout(layout, **kw)
    lh, tr, _ = layout.shape
    assert c.max_blocks >= 1
    for arr in (c.full_count, c.full_idx, c.part_count, c.part_idx):
        assert arr.dtype == np.int32
    assert c.full_count.shape == c.part_count.shape == (lh, tr)
    assert c.full_idx.shape == c.part_idx.shape == (lh, tr, c.max_blocks)
    for count, idx in ((c.full_count, c.full_idx), (c.part_count, c.part_idx)):
        for hl in range(lh):
            for qt in range(tr):
                n = count[hl, qt]
                assert np.all(np.diff(idx[hl, qt, :n]) > 0)
                assert np.all(idx[hl, qt, n:] == -1)
    longest = max(int(c.full_count.max(initial=0)), int(c.part_count.max(initial=0)))
    assert c.max_blocks == max(1, longest)


@settings(max_examples=60, deadline=None)
@given(sparse_problems())
def test_dense_from_compact_returns_the_layout_minus_the_dropped_tiles(problem):
    layout, kw = problem
    cls = tile_classes(**kw)
    np.testing.assert_array_equal(
        dense_from_compact(compact_layout(layout, **kw)), layout & (cls != 0)[None]
    )


@settings(max_examples=40, deadline=None)
@given(sparse_problems())
def test_dropping_masked_tiles_does_not_change_the_reference(problem):
    layout, kw = problem
    sq, sk = kw["seqlen_q"], kw["seqlen_k"]
    rng = np.random.default_rng(0)
    heads = layout.shape[0]
    q, k, v = (rng.standard_normal((1, s, heads, 4)) for s in (sq, sk, sk))
    common = dict(
        causal=kw["causal"], window=kw["window"], block_m=kw["block_m"], block_n=kw["block_n"]
    )
    a = R.attention_forward(q, k, v, block_mask=layout, **common)
    b = R.attention_forward(
        q, k, v, block_mask=dense_from_compact(compact_layout(layout, **kw)), **common
    )
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_an_all_empty_layout_has_one_padding_slot():
    c = compact_layout(np.zeros((1, 2, 3), bool), block_m=4, block_n=4, seqlen_q=8, seqlen_k=12)
    assert c.max_blocks == 1
    assert np.all(c.full_count == 0) and np.all(c.full_idx == -1)


def test_causal_diagonal_tiles_are_partial_and_those_below_full():
    c = compact_layout(
        np.ones((1, 3, 3), bool), block_m=4, block_n=4, seqlen_q=12, seqlen_k=12, causal="top_left"
    )
    assert c.tiles(0, 2) == [(0, False), (1, False), (2, True)]
    assert c.tiles(0, 0) == [(0, True)]


def test_a_tail_tile_is_partial():
    c = compact_layout(np.ones((1, 1, 2), bool), block_m=4, block_n=4, seqlen_q=3, seqlen_k=6)
    assert c.tiles(0, 0) == [(0, False), (1, True)]  # rows past Sq do not count, columns do


def test_a_layout_of_the_wrong_tile_grid_is_an_error():
    with pytest.raises(ValueError, match=r"\(layout_heads, 2, 2\)"):
        compact_layout(np.ones((1, 3, 2), bool), block_m=4, block_n=4, seqlen_q=8, seqlen_k=8)


def _spec(causal="bottom_right", window=True):
    ns = types.SimpleNamespace
    return ns(tile=ns(block_m=2, block_n=3), mask=ns(causal=ns(yaml=causal), window=window))


def test_compact_layout_for_spec_reads_block_sizes_and_alignment_from_the_spec():
    layout = np.ones((1, 3, 2), bool)
    got = compact_layout_for_spec(layout, _spec(), seqlen_q=5, seqlen_k=6, window=(1, 0))
    want = compact_layout(
        layout, block_m=2, block_n=3, seqlen_q=5, seqlen_k=6, causal="bottom_right", window=(1, 0)
    )
    for name in ("full_count", "full_idx", "part_count", "part_idx"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_compact_layout_for_spec_rejects_a_window_the_spec_cannot_apply():
    with pytest.raises(ValueError, match="mask.window"):
        compact_layout_for_spec(
            np.ones((1, 3, 2), bool), _spec(window=False), seqlen_q=5, seqlen_k=6, window=(1, 0)
        )
