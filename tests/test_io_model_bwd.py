"""The backward IO model and the transposed block-sparse layout, without a GPU.

`backward_bytes` (vectorised) equals a plain per-CTA loop written from the counting rules of
verify/io_model_bwd.py for Hypothesis-drawn shapes, masks, windows, varlen batches (empty
sequences too), GQA groups and block layouts; closed forms and worked counts pin it down; the
dense backward schedule covers every visible element. The transposed layout round-trips and
keeps the forward's full / partial split."""

from __future__ import annotations

import types

import numpy as np
import pytest
from flashgen.generator.families import backward as bwd_family
from flashgen.verify import reference as R
from flashgen.verify.blocksparse import compact_layout, dense_from_compact, tile_classes
from flashgen.verify.blocksparse_bwd import (
    BwdLayout,
    dense_from_bwd,
    forward_layout,
    transpose_layout,
)
from flashgen.verify.io_model_bwd import (
    IO_KEYS,
    backward_bytes,
    q_tile_range,
    standard_attention_bytes,
)
from flashgen.verify.strategies import block_layouts, cu_seqlens, seqlens, windows
from hypothesis import given, settings
from hypothesis import strategies as st

ns = types.SimpleNamespace


def spec(
    block_m=64,
    block_n=64,
    d=64,
    causal="none",
    window=False,
    varlen=False,
    sparse=False,
    debug=False,
    gqa=True,
    features=(),
):
    """A duck-typed spec: only the attributes the model reads."""
    return ns(
        features=frozenset(features),
        head_dim=d,
        dtype=ns(nbytes=2),
        tile=ns(block_m=block_m, block_n=block_n),
        mask=ns(causal=ns(yaml=causal), window=window, varlen=varlen),
        sparsity=ns(yaml="block" if sparse else "none"),
        debug_keep_mask=debug,
        dropout=debug,
        gqa=gqa,
    )


# -- a plain emulation of the counting rules ------------------------------------------------------


def dense_schedule(sq, sk, c0, c1, bm, causal, window):
    """Query tiles of the dense schedule, from the rules in plain integers (no clamping of the
    window: it must not change anything)."""
    shift = 0 if causal == "top_left" else sk - sq
    left, right = window
    reach = 0 if causal != "none" else -1
    if right >= 0:
        reach = right if reach < 0 else min(reach, right)
    m_lo = max(0, (c0 - shift - reach) // bm) if reach >= 0 else 0
    m_hi = -(-sq // bm)
    if left >= 0:
        m_hi = min(m_hi, (c1 - shift + left) // bm + 1)
    return list(range(m_lo, m_hi))


def emulate(sp, *, batch, heads, kv_heads, lens, window, layout=None, varlen=False):
    """Bytes per counter, CTA by CTA, head by head, tile by tile."""
    bm, bn, d, e = sp.tile.block_m, sp.tile.block_n, sp.head_dim, sp.dtype.nbytes
    causal = sp.mask.causal.yaml
    bwd = None if layout is None else transpose_layout(layout)
    group = heads // kv_heads
    alibi, sink = "alibi" in sp.features, "sink" in sp.features
    out = dict.fromkeys(IO_KEYS, 0)
    grid = -(-max((sk for _, sk in lens), default=0) // bn)
    if sink:  # the dsink kernel: one CTA per head
        for _h in range(heads):
            out["META"] += 4  # sinks[h]
            for b in range(batch):
                for _r in range(lens[b][0]):
                    out["LSE"] += 4
                    out["DSUM"] += 4
            out["META"] += 4  # dsinks[h]
    for b in range(batch):
        sq, sk = lens[b]
        for _h in range(heads):  # preprocess, then convert
            for _r in range(sq):
                out["O"] += d * e
                out["DO"] += d * e
                out["DSUM"] += 4
                out["DQ_ACCUM"] += 4 * d
                out["DQ"] += d * e
        for hk in range(kv_heads):
            for n in range(grid):
                if varlen:
                    out["META"] += 16
                c0 = n * bn
                if c0 >= sk:
                    continue
                kr = min(bn, sk - c0)
                visited = False
                for h in range(hk * group, (hk + 1) * group):
                    if bwd is None:
                        tiles = dense_schedule(sq, sk, c0, c0 + kr - 1, bm, causal, window)
                    else:
                        tiles = [m for m, _ in bwd.tiles(h, n)]
                        out["META"] += 8 + 4 * len(tiles)
                    for m in tiles:
                        if alibi:
                            out["META"] += 4  # the head's slope, per step
                        qr = min(bm, sq - m * bm)
                        out["Q"] += qr * d * e
                        out["DO"] += qr * d * e
                        out["LSE"] += 4 * qr
                        out["DSUM"] += 4 * qr
                        out["DQ_ACCUM"] += 8 * qr * d
                        if sp.debug_keep_mask:
                            out["KEEP_MASK"] += qr * kr
                        visited = True
                if visited:
                    out["K"] += kr * d * e
                    out["V"] += kr * d * e
                out["DK"] += kr * d * e
                out["DV"] += kr * d * e
    out["total"] = sum(out[k] for k in IO_KEYS)
    return out


@st.composite
def problems(draw):
    bm = draw(st.sampled_from((16, 32, 64, 128, 3, 8)))
    bn = draw(st.sampled_from((16, 32, 64, 128, 5, 8)))
    causal = draw(st.sampled_from(("none", "top_left", "bottom_right")))
    has_window = draw(st.booleans())
    varlen = draw(st.booleans())
    sparse = draw(st.booleans())
    gqa = draw(st.booleans())
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * (draw(st.integers(1, 3)) if gqa else 1)
    batch = draw(st.integers(1, 3))
    if varlen and not sparse:
        cu_q, cu_k = draw(cu_seqlens(batch, max_seqlen=150, allow_empty=True))
        lens = list(zip(np.diff(cu_q).tolist(), np.diff(cu_k).tolist()))
    else:
        sq, sk = draw(seqlens(150)), draw(seqlens(150))
        lens = [(sq, sk)] * batch
        cu_q = np.arange(batch + 1) * sq if varlen else None
        cu_k = np.arange(batch + 1) * sk if varlen else None
    max_sq = max(a for a, _ in lens)
    max_sk = max(b for _, b in lens)
    window = draw(windows(max(max_sq, max_sk) + 3)) if has_window else (-1, -1)
    sp = spec(
        bm,
        bn,
        d=draw(st.sampled_from((16, 64, 128))),
        causal=causal,
        window=has_window,
        varlen=varlen,
        sparse=sparse,
        debug=draw(st.booleans()),
        gqa=gqa,
        features=draw(st.frozensets(st.sampled_from(("softcap", "alibi", "sink")))),
    )
    layout = None
    if sparse:
        sq, sk = lens[0]
        lh = draw(st.sampled_from((1, heads)))
        mask = draw(block_layouts(lh, -(-sq // bm), -(-sk // bn)))
        layout = compact_layout(
            mask, block_m=bm, block_n=bn, seqlen_q=sq, seqlen_k=sk, causal=causal, window=window
        )
    return dict(
        spec=sp,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        lens=lens,
        window=window,
        layout=layout,
        cu_q=cu_q,
        cu_k=cu_k,
        varlen=varlen,
    )


def model(pb, **over):
    kw = dict(
        batch=pb["batch"],
        heads=pb["heads"],
        kv_heads=pb["kv_heads"],
        seqlen_q=max(a for a, _ in pb["lens"]),
        seqlen_k=max(b for _, b in pb["lens"]),
        window=pb["window"],
        cu_seqlens_q=pb["cu_q"],
        cu_seqlens_k=pb["cu_k"],
        layout=pb["layout"],
    )
    kw.update(over)
    return backward_bytes(pb["spec"], **kw)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_backward_bytes_equal_a_per_cta_emulation_of_the_rules(pb):
    want = emulate(
        pb["spec"],
        batch=pb["batch"],
        heads=pb["heads"],
        kv_heads=pb["kv_heads"],
        lens=pb["lens"],
        window=pb["window"],
        layout=pb["layout"],
        varlen=pb["varlen"],
    )
    assert model(pb) == want


@settings(max_examples=100, deadline=None)
@given(problems())
def test_a_forward_layout_and_its_transpose_give_the_same_bytes(pb):
    if pb["layout"] is None:
        return
    assert model(pb) == model(pb, layout=transpose_layout(pb["layout"]))


@settings(max_examples=200, deadline=None)
@given(
    sq=seqlens(90),
    sk=seqlens(90),
    bm=st.sampled_from((1, 3, 16, 32, 64)),
    bn=st.sampled_from((1, 5, 16, 64)),
    causal=st.sampled_from(("none", "top_left", "bottom_right")),
    window=st.one_of(st.just((-1, -1)), windows(100)),
)
def test_the_dense_schedule_visits_every_tile_holding_a_visible_element(
    sq, sk, bm, bn, causal, window
):
    vis = R.sequence_visible(sq, sk, causal=causal, window=window)[0]
    for n in range(-(-sk // bn)):
        c0, c1 = n * bn, min((n + 1) * bn, sk) - 1
        lo, hi = q_tile_range(
            c0, c1, seqlen_q=sq, seqlen_k=sk, block_m=bm, causal=causal, window=window
        )
        rows = np.flatnonzero(vis[:, c0 : c1 + 1].any(axis=1))
        for m in set((rows // bm).tolist()):
            assert lo <= m < hi, (n, m, int(lo), int(hi))
    # window sizes beyond Sq + Sk mean the same as Sq + Sk
    at = tuple(w if w < 0 else sq + sk for w in window)
    big = tuple(w if w < 0 else 11 * (sq + sk) + 7 for w in window)
    c0 = np.arange(0, sk, bn)
    c1 = np.minimum(c0 + bn, sk) - 1
    kw = dict(seqlen_q=sq, seqlen_k=sk, block_m=bm, causal=causal)
    for got, want in zip(
        q_tile_range(c0, c1, window=big, **kw), q_tile_range(c0, c1, window=at, **kw)
    ):
        np.testing.assert_array_equal(got, want)


def test_dense_non_causal_counts_in_closed_form():
    b, h, hk, sq, sk, d, bm, bn = 2, 6, 2, 300, 200, 64, 64, 128
    got = backward_bytes(spec(bm, bn, d), batch=b, heads=h, kv_heads=hk, seqlen_q=sq, seqlen_k=sk)
    tc, row = -(-sk // bn), d * 2
    # every CTA visits every query tile of every head of its group
    assert got["K"] == got["V"] == got["DK"] == got["DV"] == b * hk * sk * row
    assert got["Q"] == b * h * tc * sq * row
    assert got["DO"] == b * h * (tc + 1) * sq * row
    assert got["O"] == got["DQ"] == b * h * sq * row
    assert got["LSE"] == 4 * b * h * tc * sq
    assert got["DSUM"] == 4 * b * h * (tc + 1) * sq
    assert got["DQ_ACCUM"] == b * h * sq * d * (8 * tc + 4)
    assert got["META"] == got["KEEP_MASK"] == 0
    assert got["total"] == sum(got[k] for k in IO_KEYS)


def test_causal_ctas_visit_the_query_tiles_below_the_diagonal():
    got = backward_bytes(
        spec(64, 64, causal="top_left", debug=True),
        batch=1,
        heads=1,
        kv_heads=1,
        seqlen_q=256,
        seqlen_k=256,
    )
    # K/V tile n sees query tiles n..3
    assert got["Q"] == (4 + 3 + 2 + 1) * 64 * 64 * 2
    assert got["KEEP_MASK"] == (4 + 3 + 2 + 1) * 64 * 64
    assert got["K"] == 256 * 64 * 2


def test_a_cta_that_visits_nothing_reads_no_k_v_but_writes_zero_dk_dv():
    # top_left, Sq = 10 < Sk = 100: only keys 0..9 are visible, all in K/V tile 0 of 16 keys
    got = backward_bytes(
        spec(16, 16, d=16, causal="top_left"),
        batch=1,
        heads=2,
        kv_heads=1,
        seqlen_q=10,
        seqlen_k=100,
    )
    assert got["K"] == got["V"] == 16 * 16 * 2
    assert got["DK"] == got["DV"] == 100 * 16 * 2
    assert got["Q"] == 2 * 10 * 16 * 2  # both heads of the group, one query tile each


def test_varlen_meta_counts_every_cta_of_the_grid():
    got = backward_bytes(
        spec(64, 64, varlen=True),
        batch=3,
        heads=4,
        kv_heads=2,
        seqlen_q=0,
        seqlen_k=0,
        cu_seqlens_q=[0, 0, 50, 50],
        cu_seqlens_k=[0, 130, 130, 140],
    )
    assert got["META"] == 16 * 3 * 2 * 3  # ceil(130 / 64) tiles x kv_heads x batch
    # sequence 0 has keys but no queries: dK, dV written, nothing read
    # sequence 1 has queries but no keys: dQ written (zeros) by the convert kernel
    assert got["DK"] == 2 * (130 + 10) * 64 * 2
    assert got["K"] == 0
    assert got["DQ"] == 4 * 50 * 64 * 2


def test_sparse_meta_is_read_per_head_of_the_group():
    lay = np.zeros((1, 2, 2), bool)
    lay[0, 0, 0] = lay[0, 1, :] = True
    c = compact_layout(lay, block_m=16, block_n=16, seqlen_q=32, seqlen_k=32)
    got = backward_bytes(
        spec(16, 16, d=16, sparse=True),
        batch=1,
        heads=2,
        kv_heads=1,
        seqlen_q=32,
        seqlen_k=32,
        layout=c,
    )
    # tile 0 is listed by query tiles 0 and 1, tile 1 by query tile 1; two heads each
    assert got["META"] == 2 * ((8 + 8) + (8 + 4))
    assert got["Q"] == 2 * 3 * 16 * 16 * 2
    assert got["K"] == 32 * 16 * 2


def test_per_head_layouts_sum_over_heads_without_gqa():
    rng = np.random.default_rng(3)
    sq, sk, bm, bn, heads = 100, 70, 16, 32, 3
    mask = rng.random((heads, -(-sq // bm), -(-sk // bn))) < 0.5
    sp = spec(bm, bn, d=32, causal="bottom_right", sparse=True)

    def bytes_for(m, h):
        lay = compact_layout(
            m, block_m=bm, block_n=bn, seqlen_q=sq, seqlen_k=sk, causal="bottom_right"
        )
        return backward_bytes(
            sp, batch=2, heads=h, kv_heads=h, seqlen_q=sq, seqlen_k=sk, layout=lay
        )

    whole = bytes_for(mask, heads)
    parts = [bytes_for(mask[h : h + 1], 1) for h in range(heads)]
    assert whole == {k: sum(p[k] for p in parts) for k in whole}


def test_dense_bytes_scale_with_batch_and_heads():
    sp = spec(32, 64, causal="bottom_right", window=True)
    kw = dict(seqlen_q=177, seqlen_k=91, window=(20, 3))
    one = backward_bytes(sp, batch=1, heads=1, kv_heads=1, **kw)
    many = backward_bytes(sp, batch=3, heads=4, kv_heads=2, **kw)
    for key in IO_KEYS:
        per = 2 if key in ("K", "V", "DK", "DV") else 4  # kv_heads or heads
        assert many[key] == 3 * per * one[key], key


def test_alibi_reads_one_slope_per_visited_query_tile_step():
    kw = dict(batch=2, heads=4, kv_heads=2, seqlen_q=256, seqlen_k=256)
    plain = backward_bytes(spec(64, 64, causal="top_left"), **kw)
    got = backward_bytes(spec(64, 64, causal="top_left", features=("alibi", "softcap")), **kw)
    # K/V tile n sees query tiles n..3 of each of the 4 heads: 4 + 3 + 2 + 1 steps a head
    assert got["META"] == plain["META"] + 4 * 2 * 4 * (4 + 3 + 2 + 1)
    assert {k: v for k, v in got.items() if k not in ("META", "total")} == {
        k: v for k, v in plain.items() if k not in ("META", "total")
    }


def test_sink_adds_a_dsink_kernel_reading_lse_and_d_of_every_row_per_head():
    kw = dict(
        batch=3,
        heads=4,
        kv_heads=2,
        seqlen_q=0,
        seqlen_k=0,
        cu_seqlens_q=[0, 0, 50, 57],
        cu_seqlens_k=[0, 130, 130, 140],
    )
    plain = backward_bytes(spec(64, 64, varlen=True), **kw)
    got = backward_bytes(spec(64, 64, varlen=True, features=("sink",)), **kw)
    diff = {k: got[k] - plain[k] for k in IO_KEYS if got[k] != plain[k]}
    # 57 valid query rows of 4 heads: LSE and D read once each; sinks[h] and dsinks[h]
    assert diff == {"LSE": 4 * 4 * 57, "DSUM": 4 * 4 * 57, "META": 8 * 4}


def test_io_keys_are_the_familys_counters():
    assert IO_KEYS == bwd_family.IO_KEYS


def test_the_model_refuses_what_no_kernel_runs():
    with pytest.raises(ValueError, match="divide"):
        backward_bytes(spec(), batch=1, heads=3, kv_heads=2, seqlen_q=8, seqlen_k=8)
    with pytest.raises(ValueError, match="gqa: true"):
        backward_bytes(spec(gqa=False), batch=1, heads=2, kv_heads=1, seqlen_q=8, seqlen_k=8)
    with pytest.raises(ValueError, match="layout is needed"):
        backward_bytes(spec(sparse=True), batch=1, heads=1, kv_heads=1, seqlen_q=8, seqlen_k=8)
    lay = compact_layout(np.ones((1, 1, 1), bool), block_m=64, block_n=64, seqlen_q=8, seqlen_k=8)
    with pytest.raises(ValueError, match="layout built for"):
        backward_bytes(
            spec(sparse=True), batch=1, heads=1, kv_heads=1, seqlen_q=9, seqlen_k=8, layout=lay
        )
    with pytest.raises(ValueError, match="mask.window: false"):
        backward_bytes(spec(), batch=1, heads=1, kv_heads=1, seqlen_q=8, seqlen_k=8, window=(1, 1))


def test_standard_backward_grows_like_n_d_plus_n_squared():
    got = standard_attention_bytes(1, 1, 1024, 1024, 64)
    n, d = 1024, 64
    assert got["total"] == 2 * (4 * n * d + 4 * n * d + 7 * n * n)


# -- the transposed layout ------------------------------------------------------------------------


@st.composite
def forward_layouts(draw):
    sq, sk = draw(seqlens(60)), draw(seqlens(60))
    bm, bn = draw(st.sampled_from((1, 3, 8, 16))), draw(st.sampled_from((1, 2, 5, 16)))
    causal = draw(st.sampled_from(("none", "top_left", "bottom_right")))
    window = draw(st.one_of(st.just((-1, -1)), windows(sk)))
    lh = draw(st.sampled_from((1, 3)))
    mask = draw(block_layouts(lh, -(-sq // bm), -(-sk // bn)))
    return compact_layout(
        mask, block_m=bm, block_n=bn, seqlen_q=sq, seqlen_k=sk, causal=causal, window=window
    )


def _sets(count, idx):
    return [
        [frozenset(idx[hl, r, : count[hl, r]].tolist()) for r in range(count.shape[1])]
        for hl in range(count.shape[0])
    ]


@settings(max_examples=150, deadline=None)
@given(forward_layouts())
def test_transposing_twice_gives_back_the_full_and_partial_sets(fwd):
    back = forward_layout(transpose_layout(fwd))
    assert _sets(back.full_count, back.full_idx) == _sets(fwd.full_count, fwd.full_idx)
    assert _sets(back.part_count, back.part_idx) == _sets(fwd.part_count, fwd.part_idx)
    assert (back.block_m, back.block_n, back.seqlen_q, back.seqlen_k) == (
        fwd.block_m,
        fwd.block_n,
        fwd.seqlen_q,
        fwd.seqlen_k,
    )


@settings(max_examples=150, deadline=None)
@given(forward_layouts())
def test_the_transpose_lists_query_tile_m_for_tile_n_iff_the_forward_row_m_lists_n(fwd):
    bwd = transpose_layout(fwd)
    assert isinstance(bwd, BwdLayout)
    tc, tr = -(-fwd.seqlen_k // fwd.block_n), -(-fwd.seqlen_q // fwd.block_m)
    assert bwd.full_count.shape == (fwd.layout_heads, tc) == bwd.part_count.shape
    assert bwd.full_idx.shape == (fwd.layout_heads, tc, bwd.max_blocks) == bwd.part_idx.shape
    assert bwd.full_count.dtype == bwd.full_idx.dtype == np.int32
    assert bwd.num_q_tiles == tr and bwd.num_k_tiles == tc
    np.testing.assert_array_equal(dense_from_bwd(bwd), dense_from_compact(fwd))
    for hl in range(fwd.layout_heads):
        fwd_tiles = {(m, n): mask for m in range(tr) for n, mask in fwd.tiles(hl, m)}
        bwd_tiles = {(m, n): mask for n in range(tc) for m, mask in bwd.tiles(hl, n)}
        assert fwd_tiles == bwd_tiles
        for n in range(tc):
            for idx, cnt in ((bwd.full_idx, bwd.full_count), (bwd.part_idx, bwd.part_count)):
                row = idx[hl, n]
                listed = row[: cnt[hl, n]]
                assert np.all(np.diff(listed) > 0)  # ascending, no repeats
                assert np.all(row[cnt[hl, n] :] == -1)
    longest = max(int(bwd.full_count.max(initial=0)), int(bwd.part_count.max(initial=0)))
    assert bwd.max_blocks == max(1, longest)


def test_a_dense_layout_transposes_to_a_dense_layout():
    sq, sk, bm, bn = 100, 70, 16, 32
    tr, tc = -(-sq // bm), -(-sk // bn)
    fwd = compact_layout(
        np.ones((1, tr, tc), bool), block_m=bm, block_n=bn, seqlen_q=sq, seqlen_k=sk
    )
    bwd = transpose_layout(fwd)
    assert np.all(bwd.full_count + bwd.part_count == tr)
    cls = tile_classes(block_m=bm, block_n=bn, seqlen_q=sq, seqlen_k=sk)
    # the last K/V tile has columns past Sk: partial; the rest full (rows past Sq don't count)
    assert np.array_equal(bwd.full_count[0], (cls == 2).sum(axis=0))
    assert bwd.full_count[0].tolist() == [tr, tr, 0]
    assert bwd.part_idx[0, 2].tolist() == list(range(tr))


def test_the_transpose_refuses_malformed_layouts():
    fwd = compact_layout(np.ones((1, 2, 2), bool), block_m=16, block_n=16, seqlen_q=32, seqlen_k=32)
    bad = compact_layout(np.ones((1, 2, 2), bool), block_m=16, block_n=16, seqlen_q=32, seqlen_k=32)
    bad.full_idx[0, 0, 0] = 5
    with pytest.raises(ValueError, match=r"tiles in \[0, 2\)"):
        transpose_layout(bad)
    bad = compact_layout(np.ones((1, 2, 2), bool), block_m=16, block_n=16, seqlen_q=32, seqlen_k=32)
    bad.part_count[0, 0] = 1
    bad.part_idx[0, 0, 0] = int(fwd.full_idx[0, 0, 0])
    with pytest.raises(ValueError, match="both full and partial"):
        transpose_layout(bad)
    with pytest.raises(TypeError):
        transpose_layout(transpose_layout(fwd))
