"""The float64 reference against independent formulations: loops, closed forms, finite
differences, and the layout equivalences (GQA = repeated heads, varlen = per-sequence dense)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from flashgen.verify import reference as R
from flashgen.verify.dropout import keep_mask as draw_keep_mask
from flashgen.verify.strategies import block_layouts, shapes, windows
from hypothesis import given, settings
from hypothesis import strategies as st

# "no NaN, no warnings" is part of the contract: NumPy RuntimeWarnings fail these tests
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CAUSALS = ("none", "top_left", "bottom_right")


# ---------------------------------------------------------------------------------------------
# An independent, per-element formulation written from docs/conventions.md
# ---------------------------------------------------------------------------------------------


def loop_visible(i, j, sq, sk, causal, window, block=None):
    """Rules 1-4 of conventions.md, one element at a time."""
    left, right = window
    shift = 0 if causal == "top_left" else sk - sq
    if not (i < sq and j < sk):
        return False
    if causal != "none" and not j <= i + shift:
        return False
    if left >= 0 and not j >= i + shift - left:
        return False
    if right >= 0 and not j <= i + shift + right:
        return False
    if block is not None:
        layout, bm, bn = block
        if not layout[i // bm, j // bn]:
            return False
    return True


def loop_attention(q, k, v, scale, causal, window, keep=None, p=0.0, block=None):
    """Dense forward by explicit loops over (b, h, i): lists of visible keys, math.exp."""
    batch, sq, heads, d = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    o = np.zeros(q.shape)
    lse = np.full((batch, heads, sq), -math.inf)
    for b in range(batch):
        for h in range(heads):
            hk = h // group
            lay = None
            if block is not None:
                layout, bm, bn = block
                lay = (layout[0 if layout.shape[0] == 1 else h], bm, bn)
            for i in range(sq):
                js = [j for j in range(sk) if loop_visible(i, j, sq, sk, causal, window, lay)]
                if not js:
                    continue
                s = {j: scale * sum(q[b, i, h, x] * k[b, j, hk, x] for x in range(d)) for j in js}
                m = max(s.values())
                w = {j: math.exp(s[j] - m) for j in js}
                total = sum(w.values())
                lse[b, h, i] = m + math.log(total)
                for j in js:
                    factor = 1.0 if keep is None else keep[b, h, i, j] / (1.0 - p)
                    o[b, i, h] += w[j] / total * factor * v[b, j, hk]
    return o, lse


def assert_same(a, b, rtol=1e-12, atol=1e-12):
    """Equal to float64 rounding, with -inf entries equal exactly."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin)
    assert np.array_equal(a[~fin], b[~fin])
    np.testing.assert_allclose(a[fin], b[fin], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# Forward against loops
# ---------------------------------------------------------------------------------------------


@st.composite
def small_problems(draw):
    shape = draw(shapes(max_batch=2, max_heads=3, max_seqlen=9, head_dims=(3,)))
    causal = draw(st.sampled_from(CAUSALS))
    window = draw(st.one_of(st.just((-1, -1)), windows(shape.seqlen_k)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((shape.batch, shape.seqlen_q, shape.heads, 3))
    k = rng.standard_normal((shape.batch, shape.seqlen_k, shape.kv_heads, 3))
    v = rng.standard_normal((shape.batch, shape.seqlen_k, shape.kv_heads, 3))
    block = None
    if draw(st.booleans()):
        bm, bn = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        lh = draw(st.sampled_from(sorted({1, shape.heads})))
        layout = draw(block_layouts(lh, -(-shape.seqlen_q // bm), -(-shape.seqlen_k // bn)))
        block = (layout, bm, bn)
    keep, p = None, 0.0
    if draw(st.booleans()):
        p = draw(st.sampled_from((0.0, 0.1, 0.5, 0.9)))
        keep = draw_keep_mask(
            draw(st.integers(0, 2**64 - 1)),
            7,
            shape.batch,
            shape.heads,
            shape.seqlen_q,
            shape.seqlen_k,
            p,
        )
    scale = draw(st.sampled_from((None, 0.3, 2.0)))
    return q, k, v, scale, causal, window, keep, p, block


def _forward(q, k, v, scale, causal, window, keep, p, block):
    kw = {}
    if block is not None:
        kw = dict(block_mask=block[0], block_m=block[1], block_n=block[2])
    return R.attention_forward(
        q, k, v, scale=scale, causal=causal, window=window, keep_mask=keep, dropout_p=p, **kw
    )


@settings(max_examples=120, deadline=None)
@given(small_problems())
def test_forward_equals_per_element_loops(problem):
    q, k, v, scale, causal, window, keep, p, block = problem
    o, lse = _forward(*problem)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    o_loop, lse_loop = loop_attention(q, k, v, s, causal, window, keep, p, block)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert_same(o, o_loop)
    assert_same(lse, lse_loop)


@settings(max_examples=40, deadline=None)
@given(small_problems())
def test_visible_mask_equals_per_element_rules(problem):
    q, k, _, _, causal, window, _, _, block = problem
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]
    kw = {} if block is None else dict(block_mask=block[0], block_m=block[1], block_n=block[2])
    vis = R.visible_mask(batch, heads, sq, sk, causal=causal, window=window, **kw)
    assert vis.shape == (batch, heads, sq, sk) and vis.dtype == np.bool_
    for h in range(heads):
        lay = None
        if block is not None:
            lay = (block[0][0 if block[0].shape[0] == 1 else h], block[1], block[2])
        want = [
            [loop_visible(i, j, sq, sk, causal, window, lay) for j in range(sk)] for i in range(sq)
        ]
        assert np.array_equal(vis[:, h], np.broadcast_to(np.array(want, bool), (batch, sq, sk)))


# ---------------------------------------------------------------------------------------------
# Masks: the conventions' worked cases
# ---------------------------------------------------------------------------------------------


def test_causal_alignments_coincide_when_lengths_are_equal():
    a = R.visible_mask(1, 1, 5, 5, causal="top_left")
    b = R.visible_mask(1, 1, 5, 5, causal="bottom_right")
    assert np.array_equal(a, b)
    assert np.array_equal(a[0, 0], np.tril(np.ones((5, 5), bool)))


def test_top_left_causal_sees_keys_up_to_its_own_index():
    vis = R.visible_mask(1, 1, 2, 4, causal="top_left")[0, 0]
    assert vis.tolist() == [[True, False, False, False], [True, True, False, False]]


def test_bottom_right_causal_aligns_the_last_query_with_the_last_key():
    vis = R.visible_mask(1, 1, 2, 4, causal="bottom_right")[0, 0]
    assert vis.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_bottom_right_with_more_queries_than_keys_leaves_leading_rows_empty():
    o, lse = R.attention_forward(*_qkv(1, 5, 2, 1, 1), causal="bottom_right")
    assert np.all(lse[0, 0, :3] == -np.inf) and np.all(np.isfinite(lse[0, 0, 3:]))
    assert np.all(o[0, :3] == 0.0)


def test_window_without_causal_is_bottom_right_aligned():
    vis = R.visible_mask(1, 1, 2, 5, window=(1, 0))[0, 0]
    # shift = Sk - Sq = 3: row 0 sees keys 2..3, row 1 sees 3..4
    assert vis.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]


def test_window_with_top_left_causal_uses_top_left_shift():
    vis = R.visible_mask(1, 1, 3, 5, causal="top_left", window=(1, -1))[0, 0]
    assert vis.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, True, True, False, False],
    ]


def test_causal_accepts_an_enum_with_a_yaml_spelling():
    enum_like = types.SimpleNamespace(yaml="bottom_right")
    assert np.array_equal(
        R.visible_mask(1, 1, 3, 4, causal=enum_like),
        R.visible_mask(1, 1, 3, 4, causal="bottom_right"),
    )


def test_unknown_causal_spelling_is_an_error_naming_the_allowed_values():
    with pytest.raises(ValueError, match="top_left"):
        R.visible_mask(1, 1, 3, 3, causal="lower")


# ---------------------------------------------------------------------------------------------
# Closed forms
# ---------------------------------------------------------------------------------------------


def _qkv(batch, sq, sk, heads, kv_heads, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((batch, sq, heads, d)),
        rng.standard_normal((batch, sk, kv_heads, d)),
        rng.standard_normal((batch, sk, kv_heads, d)),
    )


def test_a_row_whose_scores_are_one_hot_returns_that_value_row():
    d, sk = 4, 6
    k = np.zeros((1, sk, 1, d))
    k[0, :, 0, 0] = np.arange(sk)  # key j scores j * q0 * scale
    v = np.random.default_rng(1).standard_normal((1, sk, 1, d))
    q = np.zeros((1, 1, 1, d))
    q[0, 0, 0, 0] = 1e4  # score gaps of 1e4 * scale: every weight but the last is exp(-5000)
    o, lse = R.attention_forward(q, k, v)
    np.testing.assert_array_equal(o[0, 0, 0], v[0, sk - 1, 0])
    assert lse[0, 0, 0] == pytest.approx(1e4 * (sk - 1) / 2.0)


def test_equal_scores_return_the_mean_of_the_visible_values():
    q, k, v = _qkv(1, 3, 7, 1, 1)
    q[:] = 0.0  # every score is 0
    o, lse = R.attention_forward(q, k, v, causal="top_left")
    for i in range(3):
        np.testing.assert_allclose(o[0, i, 0], v[0, : i + 1, 0].mean(axis=0), rtol=1e-13)
        assert lse[0, 0, i] == pytest.approx(math.log(i + 1))


def test_a_single_visible_key_gives_its_value_and_its_score_as_lse():
    q, k, v = _qkv(1, 1, 5, 1, 1)
    o, lse = R.attention_forward(q, k, v, scale=0.7, window=(0, 0))  # bottom_right: key 4
    np.testing.assert_array_equal(o[0, 0, 0], v[0, 4, 0])
    assert lse[0, 0, 0] == pytest.approx(0.7 * q[0, 0, 0] @ k[0, 4, 0], rel=1e-14)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse_without_nan():
    q, k, v = _qkv(2, 4, 6, 2, 2)
    layout = np.zeros((1, 2, 3), dtype=bool)
    layout[0, 1, 1] = True  # only query tile 1 sees anything
    o, lse = R.attention_forward(q, k, v, block_mask=layout, block_m=2, block_n=2)
    assert np.all(o[:, :2] == 0.0) and np.all(lse[:, :, :2] == -np.inf)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[:, :, 2:]))


def test_zero_key_length_gives_empty_rows():
    q, k, v = _qkv(1, 3, 0, 2, 1)
    o, lse = R.attention_forward(q, k, v)
    assert np.all(o == 0.0) and np.all(lse == -np.inf)


def test_huge_scores_stay_finite():
    q, k, v = _qkv(1, 8, 8, 2, 2, d=16, seed=3)
    o, lse = R.attention_forward(q * 300.0, k * 300.0, v, causal="top_left")
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    assert np.abs(lse).max() > 1e4


def test_dropout_with_all_kept_scales_the_output_by_one_over_one_minus_p():
    q, k, v = _qkv(1, 3, 4, 2, 2)
    keep = np.ones((1, 2, 3, 4), dtype=bool)
    o, lse = R.attention_forward(q, k, v, keep_mask=keep, dropout_p=0.75)
    o0, lse0 = R.attention_forward(q, k, v)
    np.testing.assert_allclose(o, 4.0 * o0, rtol=1e-14)
    np.testing.assert_array_equal(lse, lse0)  # LSE is that of the undropped softmax


def test_dropout_without_a_keep_mask_is_an_error():
    with pytest.raises(ValueError, match="keep_mask"):
        R.attention_forward(*_qkv(1, 2, 2, 1, 1), dropout_p=0.1)


# ---------------------------------------------------------------------------------------------
# Layout equivalences
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(shapes(max_heads=6, max_seqlen=12), st.sampled_from(CAUSALS), st.integers(0, 2**32 - 1))
def test_gqa_equals_multi_head_attention_with_repeated_kv_heads(shape, causal, seed):
    q, k, v = _qkv(
        shape.batch,
        shape.seqlen_q,
        shape.seqlen_k,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        seed,
    )
    group = shape.heads // shape.kv_heads
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    o, lse = R.attention_forward(q, k, v, causal=causal)
    o_r, lse_r = R.attention_forward(q, kr, vr, causal=causal)
    assert_same(o, o_r)
    assert_same(lse, lse_r)
    do = np.random.default_rng(seed + 1).standard_normal(q.shape)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, do, causal=causal)
    dq_r, dk_r, dv_r = R.attention_backward(q, kr, vr, o_r, lse_r, do, causal=causal)
    assert_same(dq, dq_r)
    sum_groups = lambda x: x.reshape(*x.shape[:2], shape.kv_heads, group, -1).sum(3)  # noqa: E731
    assert_same(dk, sum_groups(dk_r))
    assert_same(dv, sum_groups(dv_r))


@st.composite
def varlen_problems(draw):
    batch = draw(st.integers(1, 3))
    heads = draw(st.sampled_from((1, 2, 4)))
    kv_heads = draw(st.sampled_from([x for x in (1, 2, 4) if heads % x == 0]))
    lq = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    lk = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    causal = draw(st.sampled_from(CAUSALS))
    window = draw(st.one_of(st.just((-1, -1)), windows(9)))
    return batch, heads, kv_heads, lq, lk, causal, window, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=30, deadline=None)
@given(varlen_problems(), st.booleans(), st.booleans())
def test_varlen_equals_dense_per_sequence(problem, use_dropout, use_blocks):
    batch, heads, kv_heads, lq, lk, causal, window, seed = problem
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    q = rng.standard_normal((cu_q[-1], heads, 3))
    k = rng.standard_normal((cu_k[-1], kv_heads, 3))
    v = rng.standard_normal((cu_k[-1], kv_heads, 3))
    do = rng.standard_normal(q.shape)
    keep, p = None, 0.0
    if use_dropout:
        keep, p = rng.random((batch, heads, max(lq), max(lk))) < 0.7, 0.3
    kw = {}
    if use_blocks:
        kw = dict(block_mask=rng.random((heads, 5, 5)) < 0.6, block_m=2, block_n=2)
    common = dict(causal=causal, window=window, dropout_p=p, **kw)
    o, lse = R.attention_forward(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, keep_mask=keep, **common
    )
    dq, dk, dv = R.attention_backward(
        q, k, v, o, lse, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, keep_mask=keep, **common
    )
    assert o.shape == q.shape and lse.shape == (heads, cu_q[-1])
    for b in range(batch):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        kb = None if keep is None else keep[b : b + 1, :, : lq[b], : lk[b]]
        ob, lseb = R.attention_forward(
            q[None, sq_], k[None, sk_], v[None, sk_], keep_mask=kb, **common
        )
        grads = R.attention_backward(
            q[None, sq_],
            k[None, sk_],
            v[None, sk_],
            ob,
            lseb,
            do[None, sq_],
            keep_mask=kb,
            **common,
        )
        assert_same(o[sq_], ob[0])
        assert_same(lse[:, sq_], lseb[0])
        for got, want in zip((dq[sq_], dk[sk_], dv[sk_]), grads, strict=True):
            assert_same(got, want[0])


# ---------------------------------------------------------------------------------------------
# Backward against central finite differences of the forward
# ---------------------------------------------------------------------------------------------


def _finite_difference(f, x, eps=1e-6):
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for n in range(flat.size):
        keep = flat[n]
        flat[n] = keep + eps
        up = f()
        flat[n] = keep - eps
        down = f()
        flat[n] = keep
        gf[n] = (up - down) / (2 * eps)
    return g


@st.composite
def gradient_problems(draw):
    shape = draw(shapes(max_batch=1, max_heads=2, max_seqlen=5, head_dims=(3,)))
    causal = draw(st.sampled_from(CAUSALS))
    window = draw(st.one_of(st.just((-1, -1)), windows(shape.seqlen_k)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = _qkv(
        shape.batch,
        shape.seqlen_q,
        shape.seqlen_k,
        shape.heads,
        shape.kv_heads,
        3,
        int(rng.integers(2**31)),
    )
    kw = dict(causal=causal, window=window, scale=draw(st.sampled_from((None, 0.8))))
    if draw(st.booleans()):
        kw.update(
            keep_mask=rng.random((shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k)) < 0.7,
            dropout_p=0.3,
        )
    if draw(st.booleans()):
        kw.update(block_mask=rng.random((1, shape.seqlen_q, 3)) < 0.7, block_m=1, block_n=2)
    return q, k, v, rng.standard_normal(q.shape), kw


@settings(max_examples=50, deadline=None)
@given(gradient_problems())
def test_backward_equals_central_finite_differences(problem):
    q, k, v, do, kw = problem
    o, lse = R.attention_forward(q, k, v, **kw)
    grads = R.attention_backward(q, k, v, o, lse, do, **kw)

    def loss():
        return float(np.sum(R.attention_forward(q, k, v, **kw)[0] * do))

    for x, g in zip((q, k, v), grads, strict=True):
        np.testing.assert_allclose(g, _finite_difference(loss, x), rtol=1e-5, atol=1e-7)


def test_backward_of_fully_masked_rows_is_zero():
    q, k, v = _qkv(1, 5, 2, 1, 1)
    o, lse = R.attention_forward(q, k, v, causal="bottom_right")
    do = np.ones_like(q)
    dq, dk, dv = R.attention_backward(q, k, v, o, lse, do, causal="bottom_right")
    assert np.all(dq[0, :3] == 0.0)
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def test_heads_not_a_multiple_of_kv_heads_is_an_error():
    q, k, v = _qkv(1, 2, 2, 3, 2)
    with pytest.raises(ValueError, match="multiple"):
        R.attention_forward(q, k, v)


def test_a_block_mask_smaller_than_the_tile_grid_is_an_error():
    q, k, v = _qkv(1, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="smaller"):
        R.attention_forward(q, k, v, block_mask=np.ones((1, 1, 2), bool), block_m=2, block_n=2)


def test_spec_window_rejects_a_window_for_a_spec_without_one():
    spec = types.SimpleNamespace(mask=types.SimpleNamespace(window=False))
    assert R.spec_window(spec, (-1, -1)) == (-1, -1)
    with pytest.raises(ValueError, match="mask.window"):
        R.spec_window(spec, (3, 0))


def test_head_chunking_for_long_sequences_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(11)
    cu = np.array([0, 5, 12])
    q = rng.standard_normal((12, 6, 4))
    k, v = rng.standard_normal((2, 12, 3, 4))
    do = rng.standard_normal(q.shape)
    kw = dict(
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        causal="top_left",
        block_mask=rng.random((6, 4, 4)) < 0.7,
        block_m=2,
        block_n=2,
        keep_mask=rng.random((2, 6, 7, 7)) < 0.8,
        dropout_p=0.2,
    )
    o, lse = R.attention_forward(q, k, v, **kw)
    grads = R.attention_backward(q, k, v, o, lse, do, **kw)
    monkeypatch.setattr(R, "_CHUNK_ELEMENTS", 1)  # one head per chunk
    o1, lse1 = R.attention_forward(q, k, v, **kw)
    grads1 = R.attention_backward(q, k, v, o1, lse1, do, **kw)
    assert_same(o1, o)
    assert_same(lse1, lse)
    for a, b in zip(grads1, grads, strict=True):
        assert_same(a, b)
