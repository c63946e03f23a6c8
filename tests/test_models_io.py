"""The IO model's closed forms: worked counts, and the asymptotics of the FlashAttention paper
(flashgen's bytes follow N^2 d^2 / M, standard attention's N d + N^2)."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
from flashgen.verify.blocksparse import compact_layout
from flashgen.verify.io_model import forward_bytes, paper_fwd_bound, standard_attention_bytes


def spec(
    block_m=128,
    block_n=64,
    d=64,
    causal="none",
    window=False,
    sparse=False,
    debug=False,
    features=(),
):
    ns = types.SimpleNamespace
    return ns(
        features=frozenset(features),
        head_dim=d,
        dtype=ns(nbytes=2),
        tile=ns(block_m=block_m, block_n=block_n),
        mask=ns(causal=ns(yaml=causal), window=window, varlen=False),
        sparsity=ns(yaml="block" if sparse else "none"),
        debug_keep_mask=debug,
        dropout=debug,
    )


def test_dense_forward_reads_k_and_v_once_per_query_tile():
    # N = 1000, block_m = 128: 8 query tiles, each reading all of K and V
    got = forward_bytes(spec(), batch=2, heads=3, kv_heads=1, seqlen_q=1000, seqlen_k=1000)
    bh, row = 2 * 3, 64 * 2
    assert got["Q"] == got["O"] == bh * 1000 * row
    assert got["K"] == got["V"] == bh * 8 * 1000 * row
    assert got["LSE"] == bh * 1000 * 4
    assert got["META"] == got["KEEP_MASK"] == 0
    assert got["total"] == sum(got[k] for k in ("Q", "K", "V", "O", "LSE"))


def test_causal_forward_reads_only_the_tiles_up_to_the_diagonal():
    got = forward_bytes(
        spec(block_m=64, block_n=64, causal="top_left"),
        batch=1,
        heads=1,
        kv_heads=1,
        seqlen_q=256,
        seqlen_k=256,
    )
    assert got["K"] == (1 + 2 + 3 + 4) * 64 * 64 * 2


def test_debug_keep_mask_bytes_are_rows_times_columns_of_the_visited_tiles():
    got = forward_bytes(
        spec(block_m=64, block_n=64, causal="top_left", debug=True),
        batch=1,
        heads=2,
        kv_heads=2,
        seqlen_q=100,
        seqlen_k=100,
    )
    # query tile 0 (64 rows) visits key tile 0 (64 keys): 64*64; tile 1 (36 rows) visits both
    assert got["KEEP_MASK"] == 2 * (64 * 64 + 36 * 100)
    assert (
        forward_bytes(
            spec(debug=True),
            batch=1,
            heads=1,
            kv_heads=1,
            seqlen_q=8,
            seqlen_k=8,
            debug_keep_mask=False,
        )["KEEP_MASK"]
        == 0
    )


def test_varlen_meta_is_16_bytes_per_cta_including_ctas_past_the_sequence_end():
    got = forward_bytes(
        spec(block_m=64),
        batch=2,
        heads=3,
        kv_heads=3,
        seqlen_q=0,
        seqlen_k=0,
        cu_seqlens_q=[0, 10, 140],
        cu_seqlens_k=[0, 20, 40],
    )
    grid = 3 * 3 * 2  # ceil(130 / 64) = 3 query tiles x 3 heads x 2 sequences
    assert got["META"] == 16 * grid
    assert got["O"] == 3 * 140 * 64 * 2


def test_sparse_meta_is_8_bytes_plus_4_per_listed_tile():
    lay = np.zeros((1, 2, 2), bool)
    lay[0, 0, 0] = lay[0, 1, :] = True
    c = compact_layout(lay, block_m=16, block_n=16, seqlen_q=32, seqlen_k=32)
    got = forward_bytes(
        spec(block_m=16, block_n=16, d=16, sparse=True),
        batch=1,
        heads=2,
        kv_heads=1,
        seqlen_q=32,
        seqlen_k=32,
        layout=c,
    )
    assert got["META"] == 2 * ((8 + 4) + (8 + 8))
    assert got["K"] == 2 * 3 * 16 * 16 * 2


@pytest.mark.parametrize(
    ("features", "per_cta"),
    [(("alibi",), 4), (("sink",), 4), (("alibi", "sink", "softcap"), 8), (("softcap",), 0)],
)
def test_alibi_and_sink_read_4_bytes_each_per_cta_with_rows(features, per_cta):
    # varlen, block_m 64: sequence 0 has 10 rows (1 of 3 query tiles), sequence 1 130 (3)
    kw = dict(
        batch=2,
        heads=3,
        kv_heads=3,
        seqlen_q=0,
        seqlen_k=0,
        cu_seqlens_q=[0, 10, 140],
        cu_seqlens_k=[0, 0, 40],  # sequence 0 sees no key: its CTA still reads slope and sink
    )
    plain = forward_bytes(spec(block_m=64), **kw)
    got = forward_bytes(spec(block_m=64, features=features), **kw)
    assert got["META"] - plain["META"] == per_cta * 3 * (1 + 3)
    assert {k: v for k, v in got.items() if k not in ("META", "total")} == {
        k: v for k, v in plain.items() if k not in ("META", "total")
    }
    assert got["total"] - plain["total"] == per_cta * 3 * 4


def test_score_meta_counts_once_per_cta_of_a_dense_call_even_with_an_empty_schedule():
    # bottom_right, Sq = 100 > Sk = 10, block_m 16: tiles 0..4 (rows 0..79) see no key
    got = forward_bytes(
        spec(block_m=16, block_n=16, causal="bottom_right", features=("alibi", "sink")),
        batch=2,
        heads=2,
        kv_heads=1,
        seqlen_q=100,
        seqlen_k=10,
    )
    assert got["META"] == 8 * 2 * 2 * 7  # ceil(100 / 16) = 7 CTAs per (b, h)


def test_standard_attention_counts_the_papers_six_passes():
    got = standard_attention_bytes(1, 1, 1024, 1024, 64)
    n, d = 1024, 64
    assert got["S"] == got["P"] == 2 * n * n * 2
    assert got["total"] == 2 * (2 * n * d + 2 * n * d + 4 * n * n)


def test_paper_bound_is_n_squared_d_squared_over_m():
    assert paper_fwd_bound(1024, 64, 16384) == 1024**2 * 64**2 / 16384
    with pytest.raises(ValueError):
        paper_fwd_bound(0, 64, 1)


SWEEP_N = (1024, 2048, 4096, 8192, 16384)
SWEEP_D = (32, 64, 128)
SWEEP_TILES = ((64, 32), (64, 64), (128, 64), (128, 128), (64, 128))


def _flash(n, d, bm, bn):
    return forward_bytes(spec(bm, bn, d), batch=1, heads=1, kv_heads=1, seqlen_q=n, seqlen_k=n)[
        "total"
    ]


def test_flashgen_bytes_stay_within_constant_factors_of_n2_d2_over_m():
    ratios = []
    for n, d, (bm, bn) in itertools.product(SWEEP_N, SWEEP_D, SWEEP_TILES):
        m = (bm + 2 * bn) * d  # elements of on-chip memory: a Q tile plus a K and a V tile
        ratios.append(_flash(n, d, bm, bn) / (2 * paper_fwd_bound(n, d, m)))
    # leading term 2 N^2 d / block_m against N^2 d / (block_m + 2 block_n): 2 (1 + 2 bn / bm)
    assert 1.0 <= min(ratios) and max(ratios) <= 12.0
    assert max(ratios) / min(ratios) <= 4.0


def test_flashgen_bytes_fall_like_one_over_block_m_and_grow_like_n_squared():
    for d in SWEEP_D:
        assert _flash(8192, d, 64, 64) / _flash(8192, d, 128, 64) == pytest.approx(2.0, rel=0.05)
        assert _flash(16384, d, 128, 64) / _flash(8192, d, 128, 64) == pytest.approx(4.0, rel=0.05)


def test_standard_attention_grows_like_n_d_plus_n_squared():
    ratios = [
        standard_attention_bytes(1, 1, n, n, d)["total"] / (n * d + n * n)
        for n, d in itertools.product(SWEEP_N, SWEEP_D)
    ]
    assert 2 * 2 <= min(ratios) and max(ratios) <= 4 * 2


def test_flashgen_moves_fewer_bytes_than_standard_attention_when_block_m_covers_d():
    # leading terms: 2 N^2 d / block_m against 4 N^2, a ratio of d / (2 block_m)
    for n, d, (bm, bn) in itertools.product(SWEEP_N, SWEEP_D, SWEEP_TILES):
        if bm >= d:
            ratio = _flash(n, d, bm, bn) / standard_attention_bytes(1, 1, n, n, d)["total"]
            assert ratio < 1.0
            if n == max(SWEEP_N):
                assert ratio == pytest.approx(d / (2 * bm), rel=0.1)
