"""The tiled model (the kernel's algorithm in NumPy) equals the reference, and the closed-form
IO model equals the bytes the tiled model counts, for Hypothesis-drawn problems."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from flashgen.generator.features import FEATURES
from flashgen.verify import reference as R
from flashgen.verify.blocksparse import compact_layout, dense_from_compact
from flashgen.verify.dropout import keep_mask, keep_mask_varlen
from flashgen.verify.io_model import forward_bytes
from flashgen.verify.score_mods import ScoreArgs
from flashgen.verify.strategies import (
    attention_inputs,
    block_layouts,
    cases_for_spec,
    cu_seqlens,
    dropout_params,
    score_args,
    shapes,
    valid_specs,
    windows,
)
from flashgen.verify.tiled_model import dense_tile_range, tiled_forward
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def stand_in_spec(
    *,
    block_m,
    block_n,
    head_dim,
    causal="none",
    window=False,
    varlen=False,
    dropout=False,
    debug_keep_mask=False,
    sparse=False,
    gqa=True,
    features=frozenset(),
):
    """A duck-typed spec: only the attributes the models read."""
    ns = types.SimpleNamespace
    return ns(
        head_dim=head_dim,
        dtype=ns(yaml="fp16", nbytes=2, numpy_name="float16"),
        tile=ns(block_m=block_m, block_n=block_n, warps=4, stages=2),
        mask=ns(causal=ns(yaml=causal), window=window, varlen=varlen),
        dropout=dropout,
        debug_keep_mask=debug_keep_mask,
        sparsity=ns(yaml="block" if sparse else "none"),
        gqa=gqa,
        instrument_io=True,
        features=frozenset(features),
    )


@dataclass
class ModelCase:
    spec: Any
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int  # dense: the length; varlen: the maximum
    seqlen_k: int
    window: tuple[int, int]
    cu_q: np.ndarray | None
    cu_k: np.ndarray | None
    block_mask: np.ndarray | None
    keep: np.ndarray | None
    p: float
    score: ScoreArgs = ScoreArgs()  # softcap, ALiBi slopes, sinks (the spec's features)

    def layout(self):
        if self.block_mask is None:
            return None
        return compact_layout(
            self.block_mask,
            block_m=self.spec.tile.block_m,
            block_n=self.spec.tile.block_n,
            seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k,
            causal=self.spec.mask.causal,
            window=self.window,
        )

    def run_tiled(self):
        return tiled_forward(
            self.spec,
            self.q,
            self.k,
            self.v,
            window=self.window,
            cu_seqlens_q=self.cu_q,
            cu_seqlens_k=self.cu_k,
            layout=self.layout(),
            keep_mask=self.keep,
            dropout_p=self.p,
            **self.score.kwargs(),
        )

    def run_reference(self):
        kw = {}
        if self.block_mask is not None:
            kw = dict(
                block_mask=self.block_mask,
                block_m=self.spec.tile.block_m,
                block_n=self.spec.tile.block_n,
            )
        return R.attention_forward(
            self.q,
            self.k,
            self.v,
            causal=self.spec.mask.causal,
            window=self.window,
            cu_seqlens_q=self.cu_q,
            cu_seqlens_k=self.cu_k,
            keep_mask=self.keep,
            dropout_p=self.p,
            **kw,
            **self.score.kwargs(),
        )

    def predicted_bytes(self):
        return forward_bytes(
            self.spec,
            batch=self.batch,
            heads=self.heads,
            kv_heads=self.kv_heads,
            seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k,
            window=self.window,
            cu_seqlens_q=self.cu_q,
            cu_seqlens_k=self.cu_k,
            layout=self.layout(),
        )


def _draw_case(draw, spec, max_seqlen, head_dims=(4, 8)):
    shape = draw(
        shapes(max_batch=3, max_heads=4, max_seqlen=max_seqlen, head_dims=head_dims, gqa=spec.gqa)
    )
    batch, heads, d = shape.batch, shape.heads, shape.head_dim
    sq, sk = shape.seqlen_q, shape.seqlen_k
    sparse = spec.sparsity.yaml == "block"
    cu_q = cu_k = None
    if spec.mask.varlen:
        if sparse:  # one compact layout serves one (Sq, Sk): equal lengths (zero allowed)
            cu_q, cu_k = (np.arange(batch + 1, dtype=np.int32) * x for x in (sq, sk))
        else:
            cu_q, cu_k = draw(cu_seqlens(batch, max_seqlen=max_seqlen, allow_empty=True))
            sq, sk = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
        q_shape, k_shape = (int(cu_q[-1]), heads, d), (int(cu_k[-1]), shape.kv_heads, d)
    else:
        q_shape, k_shape = (batch, sq, heads, d), (batch, sk, shape.kv_heads, d)
    q, k, v = draw(attention_inputs(q_shape, k_shape))
    window = draw(windows(sk)) if spec.mask.window else (-1, -1)
    block_mask = None
    if sparse:
        lh = draw(st.sampled_from(sorted({1, heads})))
        block_mask = draw(
            block_layouts(lh, -(-sq // spec.tile.block_m), -(-sk // spec.tile.block_n))
        )
    keep, p = None, 0.0
    if spec.dropout:
        dp = draw(dropout_params())
        p = dp.p
        if spec.mask.varlen:
            keep = keep_mask_varlen(dp.seed, dp.offset, heads, np.diff(cu_q), np.diff(cu_k), p)
        else:
            keep = keep_mask(dp.seed, dp.offset, batch, heads, sq, sk, p)
    score = draw(score_args(spec, batch, heads))
    return ModelCase(
        spec,
        q,
        k,
        v,
        batch,
        heads,
        shape.kv_heads,
        sq,
        sk,
        window,
        cu_q,
        cu_k,
        block_mask,
        keep,
        p,
        score,
    )


@st.composite
def model_cases(draw, max_seqlen=24):
    dropout = draw(st.booleans())
    spec = stand_in_spec(
        block_m=draw(st.integers(1, 9)),
        block_n=draw(st.integers(1, 9)),
        head_dim=0,  # set below from the drawn shape
        causal=draw(st.sampled_from(("none", "top_left", "bottom_right"))),
        window=draw(st.booleans()),
        varlen=draw(st.booleans()),
        dropout=dropout,
        debug_keep_mask=dropout and draw(st.booleans()),
        sparse=draw(st.booleans()),
        gqa=draw(st.booleans()),
        features=draw(st.frozensets(st.sampled_from([f.name for f in FEATURES]))),
    )
    case = _draw_case(draw, spec, max_seqlen)
    spec.head_dim = case.q.shape[-1]
    return case


def assert_model_equals_reference(case, result):
    o, lse = case.run_reference()
    fin = np.isfinite(lse)
    assert np.array_equal(np.isfinite(result.lse), fin)
    assert np.array_equal(result.lse[~fin], lse[~fin])  # -inf exactly
    # float64 rounding: the exponent's error grows with the score magnitude
    smax = float(np.abs(lse[fin]).max(initial=0.0))
    vmax = float(np.abs(case.v).max(initial=0.0)) / (1.0 - case.p)
    tol = 1e-12 * max(1.0, smax / 100.0)
    np.testing.assert_allclose(result.lse[fin], lse[fin], rtol=tol, atol=tol)
    np.testing.assert_allclose(result.o, o, rtol=0, atol=tol * max(vmax, 1e-300))


@settings(max_examples=300, deadline=None)
@given(model_cases())
def test_tiled_model_equals_the_reference(case):
    assert_model_equals_reference(case, case.run_tiled())


@settings(max_examples=300, deadline=None)
@given(model_cases())
def test_io_model_equals_the_bytes_the_tiled_model_counts(case):
    counted = case.run_tiled().io
    predicted = case.predicted_bytes()
    assert predicted == counted
    assert predicted["total"] == sum(v for key, v in predicted.items() if key != "total")


@settings(max_examples=80, deadline=None)
@given(model_cases())
def test_debug_keep_mask_is_written_on_every_visited_tile_and_nowhere_else(case):
    if not case.spec.debug_keep_mask:
        case.spec.dropout = case.spec.debug_keep_mask = True
    res = case.run_tiled()
    dbg = res.debug_keep_mask
    assert dbg.dtype == np.uint8
    assert dbg.shape == (case.batch, case.heads, case.seqlen_q, case.seqlen_k)
    written = dbg != 2
    assert int(written.sum()) == res.io["KEEP_MASK"]  # one byte per written element
    keep = case.keep if case.keep is not None else np.ones(dbg.shape, bool)
    np.testing.assert_array_equal(dbg[written], keep[written].astype(np.uint8))
    kw = {}
    if case.block_mask is not None:
        kw = dict(
            block_mask=case.block_mask,
            block_m=case.spec.tile.block_m,
            block_n=case.spec.tile.block_n,
        )
    vis = R.visible_mask(
        case.batch,
        case.heads,
        case.seqlen_q,
        case.seqlen_k,
        causal=case.spec.mask.causal,
        window=case.window,
        cu_seqlens_q=case.cu_q,
        cu_seqlens_k=case.cu_k,
        **kw,
    )
    assert np.all(written[vis])  # every visible element lies in a visited tile


@settings(max_examples=200, deadline=None)
@given(
    sq=st.integers(1, 40),
    sk=st.integers(0, 40),
    bm=st.integers(1, 9),
    bn=st.integers(1, 9),
    causal=st.sampled_from(("none", "top_left", "bottom_right")),
    data=st.data(),
)
def test_dense_schedule_holds_every_tile_with_a_visible_key(sq, sk, bm, bn, causal, data):
    window = data.draw(st.one_of(st.just((-1, -1)), windows(sk)))
    vis = R.sequence_visible(sq, sk, causal=causal, window=window)[0]
    for qt in range(-(-sq // bm)):
        r0, r1 = qt * bm, min((qt + 1) * bm, sq) - 1
        n_lo, n_hi = dense_tile_range(
            r0, r1, block_n=bn, seqlen_q=sq, seqlen_k=sk, causal=causal, window=window
        )
        cols = np.flatnonzero(vis[r0 : r1 + 1].any(axis=0))
        needed = set((cols // bn).tolist())
        assert needed <= set(range(n_lo, n_hi))
        if window == (-1, -1):  # causal or no mask: the schedule is also tight
            assert needed == set(range(max(n_lo, 0), n_hi))


@settings(max_examples=40, deadline=None)
@given(sk=st.integers(0, 30), empty_tiles=st.integers(1, 4), tail=st.integers(0, 3))
def test_query_tiles_with_no_visible_key_read_nothing_but_write_o_and_lse(sk, empty_tiles, tail):
    # bottom_right with Sq = Sk + 4 * empty_tiles (+ tail rows): the first `empty_tiles` query
    # tiles of 4 rows lie entirely above the diagonal
    sq = sk + 4 * empty_tiles + tail
    spec = stand_in_spec(block_m=4, block_n=4, head_dim=8, causal="bottom_right")
    rng = np.random.default_rng(sk)
    q, k = rng.standard_normal((1, sq, 1, 8)), rng.standard_normal((1, sk, 1, 8))
    res = tiled_forward(spec, q, k, k)
    _, lse = R.attention_forward(q, k, k, causal="bottom_right")
    np.testing.assert_array_equal(np.isinf(res.lse), np.isinf(lse))
    assert np.all(res.o[0, : 4 * empty_tiles] == 0.0)
    # a tile of rows r0..r1 has a visible key iff its last row reaches the diagonal
    tiles = [(r0, min(r0 + 4, sq) - 1) for r0 in range(0, sq, 4)]
    rows_read = sum(r1 - r0 + 1 for r0, r1 in tiles if sk > 0 and r1 >= sq - sk)
    assert res.io["Q"] == rows_read * 8 * 2
    assert res.io["O"] == sq * 8 * 2 and res.io["LSE"] == sq * 4


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_real_specs_run_through_the_models(data):
    spec = data.draw(valid_specs(head_dims=(16, 32)))
    case = data.draw(cases_for_spec(spec, max_seqlen=40))
    inputs = ModelCase(
        spec,
        *_inputs_for(data, case, spec.head_dim, spec.head_dim_vo),
        case.batch,
        case.heads,
        case.kv_heads,
        case.seqlen_q,
        case.seqlen_k,
        case.window,
        case.cu_seqlens_q,
        case.cu_seqlens_k,
        case.block_mask,
        *_keep_for(case),
        case.score,
    )
    result = inputs.run_tiled()
    assert_model_equals_reference(inputs, result)
    assert inputs.predicted_bytes() == result.io


def _inputs_for(data, case, d, d_v=None):
    if case.cu_seqlens_q is not None:
        shapes_ = (
            (int(case.cu_seqlens_q[-1]), case.heads, d),
            (int(case.cu_seqlens_k[-1]), case.kv_heads, d),
        )
    else:
        shapes_ = (
            (case.batch, case.seqlen_q, case.heads, d),
            (case.batch, case.seqlen_k, case.kv_heads, d),
        )
    v_shape = shapes_[1][:-1] + (d if d_v is None else d_v,)
    return data.draw(attention_inputs(*shapes_, kind="normal", v_shape=v_shape))


def _keep_for(case):
    if case.dropout is None:
        return None, 0.0
    dp = case.dropout
    if case.cu_seqlens_q is not None:
        keep = keep_mask_varlen(
            dp.seed,
            dp.offset,
            case.heads,
            np.diff(case.cu_seqlens_q),
            np.diff(case.cu_seqlens_k),
            dp.p,
        )
    else:
        keep = keep_mask(
            dp.seed, dp.offset, case.batch, case.heads, case.seqlen_q, case.seqlen_k, dp.p
        )
    return keep, dp.p


def test_sparse_full_tiles_skip_the_element_mask_so_a_misclassified_tile_shows():
    """If the layout called a diagonal tile full, the model (like the kernel) would not mask
    it and would differ from the reference: the check is sensitive to classification."""
    spec = stand_in_spec(block_m=4, block_n=4, head_dim=8, causal="top_left", sparse=True)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 8, 1, 8)) for _ in range(3))
    good = compact_layout(
        np.ones((1, 2, 2), bool), block_m=4, block_n=4, seqlen_q=8, seqlen_k=8, causal="top_left"
    )
    o, _ = R.attention_forward(q, k, v, causal="top_left")
    np.testing.assert_allclose(tiled_forward(spec, q, k, v, layout=good).o, o, atol=1e-12)
    bad = compact_layout(
        np.ones((1, 2, 2), bool), block_m=4, block_n=4, seqlen_q=8, seqlen_k=8
    )  # built without the causal mask: every tile "full"
    assert not np.allclose(tiled_forward(spec, q, k, v, layout=bad).o, o)
    assert dense_from_compact(good).tolist() == [[[True, False], [True, True]]]


def test_spec_features_must_match_the_arguments():
    spec = stand_in_spec(block_m=2, block_n=2, head_dim=4)
    q = np.zeros((1, 2, 2, 4))
    k = np.zeros((1, 2, 1, 4))
    with pytest.raises(ValueError, match="gqa"):
        tiled_forward(stand_in_spec(block_m=2, block_n=2, head_dim=4, gqa=False), q, k, k)
    with pytest.raises(ValueError, match="window"):
        tiled_forward(spec, q, k, k, window=(1, 1))
    with pytest.raises(ValueError, match="dropout"):
        tiled_forward(spec, q, k, k, keep_mask=np.ones((1, 2, 2, 2), bool), dropout_p=0.5)
    with pytest.raises(ValueError, match="layout"):
        tiled_forward(
            spec,
            q,
            k,
            k,
            layout=compact_layout(
                np.ones((1, 1, 1), bool), block_m=2, block_n=2, seqlen_q=2, seqlen_k=2
            ),
        )


def test_score_values_must_match_the_specs_features():
    q = np.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="sinks given but this spec has sink: false"):
        tiled_forward(stand_in_spec(block_m=2, block_n=2, head_dim=4), q, q, q, sinks=np.zeros(2))
    alibi = stand_in_spec(block_m=2, block_n=2, head_dim=4, features={"alibi"})
    with pytest.raises(ValueError, match="this spec has alibi: true: pass alibi_slopes"):
        tiled_forward(alibi, q, q, q)


def test_a_sink_joins_after_the_last_tile_so_empty_rows_get_the_sink_as_lse():
    spec = stand_in_spec(block_m=4, block_n=4, head_dim=8, causal="bottom_right", features={"sink"})
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 13, 1, 8)), *rng.standard_normal((2, 1, 5, 1, 8))
    sinks = np.array([2.5])
    res = tiled_forward(spec, q, k, v, sinks=sinks)
    o, lse = R.attention_forward(q, k, v, causal="bottom_right", sinks=sinks)
    assert np.all(res.lse[0, 0, :8] == 2.5) and np.all(res.o[0, :8] == 0.0)
    np.testing.assert_allclose(res.lse, lse, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(res.o, o, rtol=0, atol=1e-13)
    # 4 bytes of META per CTA: ceil(13 / 4) = 4 query tiles, two of which read no K/V tile
    assert res.io["META"] == 4 * 4
