"""The score-stage modifiers (softcap, ALiBi, attention sinks) in the float64 reference and the
baseline, against independent formulations: per-element loops, an explicit ALiBi bias
matrix, the sink as an extra key every row sees with a zero value row, closed forms, and
central finite differences of a scalar loss; plus the strategies' values and the argument
checks (verify/score_mods.py states the semantics)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from flashgen.generator.families import SCORE_PARAM_FIELDS, families
from flashgen.generator.features import FEATURES
from flashgen.verify import baseline as B
from flashgen.verify import reference as R
from flashgen.verify import score_mods as M
from flashgen.verify.strategies import (
    alibi_geometric,
    alibi_slopes,
    cu_seqlens,
    score_args,
    shapes,
    sink_values,
    softcaps,
)
from hypothesis import Phase, given, settings
from hypothesis import find as _find
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CAUSALS = ("none", "top_left", "bottom_right")
ALL = frozenset(f.name for f in FEATURES)


def stand_in(features=ALL):
    """A duck-typed spec with these score-stage features (all the strategies read)."""
    return types.SimpleNamespace(features=frozenset(features))


def exists(strategy, condition, tries=2000):
    _find(
        strategy,
        condition,
        settings=settings(max_examples=tries, database=None, phases=[Phase.generate]),
    )


def assert_same(a, b, rtol=1e-11, atol=1e-11):
    """Equal to float64 rounding, with non-finite entries equal exactly."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    fin = np.isfinite(b)
    assert np.array_equal(a[~fin], b[~fin])
    np.testing.assert_allclose(a[fin], b[fin], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# An independent per-element formulation, written from verify/score_mods.py's definition
# ---------------------------------------------------------------------------------------------


def loop_sequence(q, k, v, *, scale, causal, softcap, slopes, sinks):
    """One dense sequence: q `(Sq, H, d)`, k, v `(Sk, Hk, d)`; slopes, sinks `(H,)` or None.
    Every (h, i) row is a list of visible keys plus, with a sink, one term of value zero."""
    sq, heads, d = q.shape
    sk, kv = k.shape[0], k.shape[1]
    group = heads // kv
    shift = 0 if causal == "top_left" else sk - sq
    o = np.zeros(q.shape)
    lse = np.full((heads, sq), -math.inf)
    for h in range(heads):
        for i in range(sq):
            terms = []  # (logit, value row)
            for j in range(sk):
                if causal != "none" and j > i + shift:
                    continue
                z = scale * sum(q[i, h, x] * k[j, h // group, x] for x in range(d))
                if softcap:
                    z = softcap * math.tanh(z / softcap)
                if slopes is not None:
                    z = z - slopes[h] * abs(i + shift - j)
                terms.append((z, v[j, h // group]))
            if sinks is not None:
                terms.append((float(sinks[h]), np.zeros(v.shape[-1])))
            if not terms:
                continue
            m = max(z for z, _ in terms)
            total = sum(math.exp(z - m) for z, _ in terms)
            lse[h, i] = m + math.log(total)
            for z, row in terms:
                o[i, h] += math.exp(z - m) / total * row
    return o, lse


def loop_forward(q, k, v, *, scale, causal, score, cu_q=None, cu_k=None):
    """`loop_sequence` over a dense or varlen batch (slopes of sequence b from score)."""
    if cu_q is None:
        outs = [
            loop_sequence(
                q[b],
                k[b],
                v[b],
                scale=scale,
                causal=causal,
                softcap=score.softcap,
                slopes=score.slopes_for(b, slice(None)),
                sinks=score.sinks,
            )
            for b in range(q.shape[0])
        ]
        return np.stack([o for o, _ in outs]), np.stack([lse for _, lse in outs])
    o = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -math.inf)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o[qs], lse[:, qs] = loop_sequence(
            q[qs],
            k[ks],
            v[ks],
            scale=scale,
            causal=causal,
            softcap=score.softcap,
            slopes=score.slopes_for(b, slice(None)),
            sinks=score.sinks,
        )
    return o, lse


@st.composite
def feature_problems(draw, max_seqlen=6, allow_varlen=True, causals=CAUSALS):
    """q, k, v (dense or varlen, GQA), causal, and ScoreArgs for a random subset of features;
    q is sometimes scaled up so that small softcaps saturate."""
    shape = draw(shapes(max_batch=2, max_heads=3, max_seqlen=max_seqlen, head_dims=(3, 4)))
    batch, h, hk, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    varlen = allow_varlen and draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cu_q = cu_k = None
    if varlen:
        cu_q, cu_k = draw(cu_seqlens(batch, max_seqlen=max_seqlen, allow_empty=True))
        q_shape, k_shape = (int(cu_q[-1]), h, d), (int(cu_k[-1]), hk, d)
    else:
        q_shape = (batch, shape.seqlen_q, h, d)
        k_shape = (batch, shape.seqlen_k, hk, d)
    amp = draw(st.sampled_from((1.0, 1.0, 4.0)))
    q = rng.standard_normal(q_shape) * amp
    k, v = rng.standard_normal(k_shape), rng.standard_normal(k_shape)
    features = draw(st.frozensets(st.sampled_from(sorted(ALL)), min_size=1))
    score = draw(score_args(stand_in(features), batch, h))
    causal = draw(st.sampled_from(causals))
    return dict(q=q, k=k, v=v, causal=causal, score=score, cu_q=cu_q, cu_k=cu_k)


def _ref_kw(pb):
    kw = dict(causal=pb["causal"], **pb["score"].kwargs())
    if pb["cu_q"] is not None:
        kw.update(cu_seqlens_q=pb["cu_q"], cu_seqlens_k=pb["cu_k"])
    return kw


@settings(max_examples=150, deadline=None)
@given(feature_problems())
def test_forward_with_modifiers_equals_per_element_loops(pb):
    o, lse = R.attention_forward(pb["q"], pb["k"], pb["v"], **_ref_kw(pb))
    d = pb["q"].shape[-1]
    want_o, want_lse = loop_forward(
        pb["q"],
        pb["k"],
        pb["v"],
        scale=1 / math.sqrt(d),
        causal=pb["causal"],
        score=pb["score"],
        cu_q=pb["cu_q"],
        cu_k=pb["cu_k"],
    )
    tol = 1e-11 * max(1.0, float(np.abs(want_lse[np.isfinite(want_lse)]).max(initial=0.0)))
    assert_same(lse, want_lse, rtol=tol, atol=tol)
    assert_same(o, want_o, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# The sink as an extra key with a zero value row (the reference without sinks computes it)
# ---------------------------------------------------------------------------------------------


def _with_sink_key(q, k, v, sinks, scale, cu_q=None, cu_k=None):
    """q' = [q, 1], k' = [k, 0] plus one key per sequence and head with k'_d = sink_h / scale
    and a zero value row: its scaled score is sink_h for every query. Returns (q', k', v',
    cu_k', index of each sequence's sink key in k')."""
    heads = q.shape[-2]
    q2 = np.concatenate([q, np.ones(q.shape[:-1] + (1,))], axis=-1)
    pad = np.zeros(k.shape[:-1] + (1,))
    k2, v2 = np.concatenate([k, pad], axis=-1), np.concatenate([v, pad], axis=-1)
    sink_k = np.zeros((1, heads, k2.shape[-1]))
    sink_k[0, :, -1] = np.asarray(sinks) / scale
    sink_v = np.zeros((1, heads, k2.shape[-1]))
    if cu_q is None:
        b = q.shape[0]
        k2 = np.concatenate([k2, np.broadcast_to(sink_k, (b, 1) + sink_k.shape[1:])], axis=1)
        v2 = np.concatenate([v2, np.broadcast_to(sink_v, (b, 1) + sink_v.shape[1:])], axis=1)
        return q2, k2, v2, None, [(bi, k.shape[1]) for bi in range(b)]
    ks, vs, cu, where = [], [], [0], []
    for b in range(len(cu_k) - 1):
        ks += [k2[cu_k[b] : cu_k[b + 1]], sink_k]
        vs += [v2[cu_k[b] : cu_k[b + 1]], sink_v]
        cu.append(cu[-1] + (cu_k[b + 1] - cu_k[b]) + 1)
        where.append(cu[-1] - 1)
    return q2, np.concatenate(ks), np.concatenate(vs), np.array(cu), where


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_sinks_equal_an_extra_zero_value_key_every_row_sees(data):
    pb = data.draw(feature_problems(causals=("none",)))
    q, k, v, cu_q, cu_k = pb["q"], pb["k"], pb["v"], pb["cu_q"], pb["cu_k"]
    heads = q.shape[-2]
    sinks = data.draw(sink_values(heads))
    k, v = (np.repeat(x, heads // k.shape[-2], axis=-2) for x in (k, v))  # one sink key a head
    scale = 1 / math.sqrt(q.shape[-1])
    lens = {} if cu_q is None else dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o, lse = R.attention_forward(q, k, v, sinks=sinks, **lens)
    q2, k2, v2, cu2, where = _with_sink_key(q, k, v, sinks, scale, cu_q, cu_k)
    lens2 = {} if cu_q is None else dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu2)
    o2, lse2 = R.attention_forward(q2, k2, v2, scale=scale, **lens2)
    assert_same(o, o2[..., :-1])
    assert_same(lse, lse2)
    # backward: dq, dk, dv of the real keys, and dsink = d(loss)/d(k'_d) / scale, summed
    do = np.random.default_rng(1).standard_normal(q.shape)
    dq, dk, dv, dsinks = R.attention_backward(q, k, v, o, lse, do, sinks=sinks, **lens)
    do2 = np.concatenate([do, np.zeros(do.shape[:-1] + (1,))], axis=-1)
    dq2, dk2, dv2 = R.attention_backward(q2, k2, v2, o2, lse2, do2, scale=scale, **lens2)
    assert_same(dq, dq2[..., :-1])
    if cu_q is None:
        assert_same(dk, dk2[:, :-1, :, :-1])
        assert_same(dv, dv2[:, :-1, :, :-1])
        want = sum(dk2[b, j, :, -1] for b, j in where) / scale
    else:
        real = np.setdiff1d(np.arange(k2.shape[0]), where)
        assert_same(dk, dk2[real][..., :-1])
        assert_same(dv, dv2[real][..., :-1])
        want = sum(dk2[j, :, -1] for j in where) / scale
    assert dsinks.shape == (heads,)
    assert_same(dsinks, want, rtol=1e-10, atol=1e-10)


def test_a_row_with_no_visible_key_gets_zero_output_and_the_sink_as_lse():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 5, 2, 4)), *rng.standard_normal((2, 1, 2, 2, 4))
    sinks = np.array([0.75, -3.5])
    o, lse = R.attention_forward(q, k, v, causal="bottom_right", sinks=sinks)
    assert np.all(o[0, :3] == 0.0)  # rows 0..2 of bottom_right with Sq 5 > Sk 2 see no key
    np.testing.assert_array_equal(lse[0, :, :3], np.broadcast_to(sinks[:, None], (2, 3)))
    assert np.all(lse[0, :, 3:] > sinks[:, None])
    dq, dk, dv, dsinks = R.attention_backward(
        q, k, v, o, lse, rng.standard_normal(q.shape), causal="bottom_right", sinks=sinks
    )
    assert np.all(dq[0, :3] == 0.0) and np.all(np.isfinite(dsinks))


def test_a_sink_far_below_the_scores_changes_nothing_and_one_far_above_takes_the_weight():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 4, 1, 8)) for _ in range(3))
    o, lse = R.attention_forward(q, k, v)
    o_low, lse_low = R.attention_forward(q, k, v, sinks=np.array([-200.0]))
    assert_same(o_low, o)
    assert_same(lse_low, lse)
    o_high, lse_high = R.attention_forward(q, k, v, sinks=np.array([60.0]))
    assert np.abs(o_high).max() < 1e-20
    np.testing.assert_allclose(lse_high, 60.0, rtol=0, atol=1e-20)


def test_dsink_is_minus_the_sum_of_exp_sink_minus_lse_times_d_and_skips_minus_inf_rows():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 3, 2, 4)), *rng.standard_normal((2, 2, 5, 2, 4))
    sinks = np.array([1.5, -0.5])
    o, lse = R.attention_forward(q, k, v, sinks=sinks)
    do = rng.standard_normal(q.shape)
    lse = lse.copy()
    lse[1, 0, 2] = -np.inf  # a row the forward left empty: contributes nothing, no NaN
    *_, dsinks = R.attention_backward(q, k, v, o, lse, do, sinks=sinks)
    d = np.sum(do * o, axis=-1).transpose(0, 2, 1)  # (batch, heads, Sq)
    fin = np.isfinite(lse)
    w = np.where(fin, np.exp(sinks[None, :, None] - np.where(fin, lse, 0.0)), 0.0)
    np.testing.assert_allclose(dsinks, -(w * d).sum(axis=(0, 2)), rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# ALiBi against an explicit bias matrix
# ---------------------------------------------------------------------------------------------


def bias_matrix(slopes, lens, heads, causal):
    """`-slope[b, h] * |i + shift - j|` per sequence, `(batch, heads, max Sq, max Sk)`, by
    loops; shift 0 for top_left, Sk - Sq otherwise."""
    slopes = np.asarray(slopes)
    out = np.zeros((len(lens), heads, max(a for a, _ in lens), max(b for _, b in lens)))
    for b, (sq, sk) in enumerate(lens):
        shift = 0 if causal == "top_left" else sk - sq
        for h in range(heads):
            s = slopes[h] if slopes.ndim == 1 else slopes[b, h]
            for i in range(sq):
                for j in range(sk):
                    out[b, h, i, j] = -s * abs(i + shift - j)
    return out


def biased_attention(q, k, v, bias, vis):
    """Dense attention of explicit logits `scale q k^T + bias` over `vis` (no GQA)."""
    scale = 1 / math.sqrt(q.shape[-1])
    z = np.einsum("bihd,bjhd->bhij", q, k) * scale + bias
    z = np.where(vis, z, -np.inf)
    m = z.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    total = e.sum(axis=-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    o = np.einsum("bhij,bjhd->bihd", e / safe, v)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(safe[..., 0]), -np.inf)
    return o, lse


@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize(("sq", "sk"), [(3, 8), (8, 3), (5, 5), (1, 6)])
@pytest.mark.parametrize("two_d", [False, True])
def test_alibi_equals_an_explicit_bias_matrix(causal, sq, sk, two_d):
    rng = np.random.default_rng(sq * 100 + sk)
    b, h, d = 2, 3, 4
    q, k, v = rng.standard_normal((b, sq, h, d)), *rng.standard_normal((2, b, sk, h, d))
    slopes = rng.uniform(-1, 1, size=(b, h) if two_d else (h,))
    o, lse = R.attention_forward(q, k, v, causal=causal, alibi_slopes=slopes)
    vis = R.visible_mask(b, h, sq, sk, causal=causal)
    want_o, want_lse = biased_attention(
        q, k, v, bias_matrix(slopes, [(sq, sk)] * b, h, causal), vis
    )
    assert_same(o, want_o)
    assert_same(lse, want_lse)


@pytest.mark.parametrize("causal", CAUSALS)
@pytest.mark.parametrize("two_d", [False, True])
def test_varlen_alibi_uses_each_sequences_own_lengths(causal, two_d):
    rng = np.random.default_rng(7)
    lens = [(2, 7), (6, 3), (4, 4)]
    h, d = 2, 4
    cu_q = np.cumsum([0] + [a for a, _ in lens])
    cu_k = np.cumsum([0] + [b for _, b in lens])
    q = rng.standard_normal((cu_q[-1], h, d))
    k, v = rng.standard_normal((2, cu_k[-1], h, d))
    slopes = rng.uniform(0.1, 1, size=(3, h) if two_d else (h,))
    o, lse = R.attention_forward(
        q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes
    )
    bias = bias_matrix(slopes, lens, h, causal)
    for b, (sq, sk) in enumerate(lens):
        vis = R.visible_mask(1, h, sq, sk, causal=causal)
        want_o, want_lse = biased_attention(
            q[None, cu_q[b] : cu_q[b + 1]],
            k[None, cu_k[b] : cu_k[b + 1]],
            v[None, cu_k[b] : cu_k[b + 1]],
            bias[b : b + 1, :, :sq, :sk],
            vis,
        )
        assert_same(o[cu_q[b] : cu_q[b + 1]], want_o[0])
        assert_same(lse[:, cu_q[b] : cu_q[b + 1]], want_lse[0])


def test_alibi_distance_is_bottom_right_aligned_without_causal_and_top_left_with_it():
    # one query, two keys of equal score: weights exp(-slope |shift - j|) with shift 0 or 1
    q, k = np.zeros((1, 1, 1, 2)), np.zeros((1, 2, 1, 2))
    v = np.zeros((1, 2, 1, 2))
    v[0, :, 0, 0] = (1.0, 0.0)
    slope = np.array([0.5])
    o_none, _ = R.attention_forward(q, k, v, alibi_slopes=slope)  # shift Sk - Sq = 1
    w = np.exp(-0.5 * np.array([1.0, 0.0]))
    assert o_none[0, 0, 0, 0] == pytest.approx(w[0] / w.sum(), rel=1e-14)
    o_tl, _ = R.attention_forward(q, k, v, causal="top_left", alibi_slopes=slope)
    assert o_tl[0, 0, 0, 0] == 1.0  # top_left: the query sees key 0 only


def test_zero_slopes_zero_softcap_and_no_sinks_equal_plain_attention():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 5, 2, 4)) for _ in range(3))
    o, lse = R.attention_forward(q, k, v, causal="bottom_right")
    o2, lse2 = R.attention_forward(
        q, k, v, causal="bottom_right", softcap=0.0, alibi_slopes=np.zeros(2)
    )
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)


# ---------------------------------------------------------------------------------------------
# Softcap closed forms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [0.5, 5.0, 50.0])
def test_softcap_of_a_single_key_row_is_c_tanh_of_its_scaled_score(c):
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((1, 3, 1, 4)) * 10, *rng.standard_normal((2, 1, 1, 1, 4))
    _, lse = R.attention_forward(q, k, v, softcap=c, scale=0.7)
    s = 0.7 * np.einsum("bihd,bjhd->bhi", q, k)
    np.testing.assert_allclose(lse, c * np.tanh(s / c), rtol=1e-14, atol=0)
    assert np.all(np.abs(lse) <= c)


def test_softcap_saturates_so_huge_scores_give_a_softmax_of_the_caps():
    # scores of +-1e4 capped at 1: two keys of logits ~ +1 and ~ -1
    q = np.zeros((1, 1, 1, 1))
    q[...] = 100.0
    k = np.array([100.0, -100.0]).reshape(1, 2, 1, 1)
    v = np.array([1.0, 0.0]).reshape(1, 2, 1, 1)
    o, lse = R.attention_forward(q, k, v, softcap=1.0, scale=1.0)
    assert o[0, 0, 0, 0] == pytest.approx(math.e / (math.e + 1 / math.e), rel=1e-14)
    assert lse[0, 0, 0] == pytest.approx(math.log(math.e + 1 / math.e), rel=1e-14)


# ---------------------------------------------------------------------------------------------
# The backward against central finite differences of sum(O * dO)
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


@settings(max_examples=40, deadline=None)
@given(feature_problems(max_seqlen=4), st.booleans())
def test_backward_with_modifiers_equals_central_finite_differences(pb, dropout):
    q, k, v = pb["q"], pb["k"], pb["v"]
    score = pb["score"]
    kw = _ref_kw(pb)
    if dropout and pb["cu_q"] is None:
        rng = np.random.default_rng(5)
        kw.update(keep_mask=rng.random(q.shape[:1] + (q.shape[2], q.shape[1], k.shape[1])) < 0.7)
        kw["dropout_p"] = 0.3
    do = np.random.default_rng(6).standard_normal(q.shape)
    o, lse = R.attention_forward(q, k, v, **kw)
    grads = R.attention_backward(q, k, v, o, lse, do, **kw)
    assert len(grads) == (4 if score.sinks is not None else 3)

    def loss():
        return float(np.sum(R.attention_forward(q, k, v, **kw)[0] * do))

    for x, g in zip((q, k, v), grads[:3], strict=True):
        np.testing.assert_allclose(g, _finite_difference(loss, x), rtol=1e-5, atol=1e-7)
    if score.sinks is not None:
        sinks = kw["sinks"] = score.sinks.copy()
        np.testing.assert_allclose(grads[3], _finite_difference(loss, sinks), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# The baseline: the same modifiers in float32, the capped score rounded to the dtype
# ---------------------------------------------------------------------------------------------

EPS = {"fp16": 2.0**-11, "bf16": 2.0**-8}


@settings(max_examples=40, deadline=None)
@given(feature_problems(max_seqlen=12), st.sampled_from(("fp16", "bf16")))
def test_baseline_with_modifiers_is_close_to_the_reference(pb, dtype):
    q, k, v = (B.round_to_dtype(pb[x], dtype).astype(np.float64) for x in ("q", "k", "v"))
    kw = _ref_kw(pb)
    o, lse = B.attention_forward(q, k, v, dtype=dtype, **kw)
    o64, lse64 = R.attention_forward(q, k, v, **kw)
    np.testing.assert_array_equal(B.round_to_dtype(o, dtype), o)
    assert np.array_equal(np.isfinite(lse), np.isfinite(lse64))
    vmax = max(1.0, float(np.abs(v).max(initial=0.0)))
    # the capped score is rounded to the dtype: an error of up to c * eps in every logit
    zerr = 1.0 + pb["score"].softcap
    assert np.abs(o - o64).max(initial=0.0) <= 16 * zerr * EPS[dtype] * vmax
    fin = np.isfinite(lse64)
    lmax = 1.0 + float(np.abs(lse64[fin]).max(initial=0.0))
    assert np.abs(lse[fin] - lse64[fin]).max(initial=0.0) <= 4 * zerr * EPS[dtype] + 1e-5 * lmax
    do = B.round_to_dtype(np.random.default_rng(0).standard_normal(q.shape), dtype)
    grads = B.attention_backward(q, k, v, o, lse, do, dtype=dtype, **kw)
    grads64 = R.attention_backward(q, k, v, o64, lse64, do, **kw)
    assert len(grads) == len(grads64)
    for g, g64 in zip(grads, grads64, strict=True):
        assert g.dtype == np.float32
        scale = max(1.0, float(np.abs(g64).max(initial=0.0)))
        assert np.abs(g - g64).max(initial=0.0) <= 64 * zerr * EPS[dtype] * scale


def test_baseline_rounds_tanh_and_the_capped_score_to_the_dtype():
    """One key: P = 1 and LSE is the logit itself, so the baseline's LSE is
    round(c * round(tanh(s / c))) in bf16 (values the reference's float64 LSE is not)."""
    rng = np.random.default_rng(10)
    q = B.round_to_dtype(rng.standard_normal((1, 64, 1, 8)), "bf16")
    k, v = (B.round_to_dtype(rng.standard_normal((1, 1, 1, 8)), "bf16") for _ in range(2))
    _, lse = B.attention_forward(q, k, v, dtype="bf16", softcap=3.0)
    _, lse64 = R.attention_forward(q, k, v, softcap=3.0)
    np.testing.assert_array_equal(B.round_to_dtype(lse, "bf16"), lse)
    assert not np.array_equal(B.round_to_dtype(lse64, "bf16"), lse64)
    s = np.einsum("bihd,bjhd->bhi", q, k) / math.sqrt(8)  # exact in float64
    t = B.round_to_dtype(np.tanh(s / 3.0), "bf16")
    want = B.round_to_dtype(3.0 * t.astype(np.float64), "bf16")
    # the float32 score may differ from the exact one by an ulp, moving a rounding: rarely
    assert np.mean(lse == want) > 0.9
    assert np.abs(lse - want).max() <= 2.0**-6 * 3.0


def test_baseline_dsinks_are_float32_and_close_to_the_reference():
    rng = np.random.default_rng(11)
    q, k, v, do = (B.round_to_dtype(rng.standard_normal((2, 9, 2, 16)), "fp16") for _ in range(4))
    sinks = np.array([2.0, -1.0])
    o64, lse64 = R.attention_forward(q, k, v, sinks=sinks)
    o = B.round_to_dtype(o64, "fp16")
    *_, ds = B.attention_backward(q, k, v, o, lse64, do, dtype="fp16", sinks=sinks)
    *_, ds64 = R.attention_backward(q, k, v, o, lse64, do, sinks=sinks)
    assert ds.dtype == np.float32 and ds.shape == (2,)
    np.testing.assert_allclose(ds, ds64, rtol=1e-5, atol=1e-6)


def test_decode_reference_and_baseline_take_the_modifiers():
    from flashgen.verify import reference_decode as D

    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 2, 4, 8))
    kc, vc = rng.standard_normal((2, 2, 9, 2, 8))
    lens = [9, 3]
    kw = dict(softcap=4.0, alibi_slopes=rng.uniform(0, 1, (2, 4)), sinks=np.array([1.0, 0, -2, 3]))
    o, lse = D.decode_reference(q, kc, vc, lens, causal="bottom_right", **kw)
    ob, lseb = D.decode_baseline(q, kc, vc, lens, dtype="bf16", causal="bottom_right", **kw)
    for b, n in enumerate(lens):  # each sequence: dense bottom_right attention over its cache
        want_o, want_lse = R.attention_forward(
            q[b : b + 1],
            np.repeat(kc[b : b + 1, :n], 2, axis=2),
            np.repeat(vc[b : b + 1, :n], 2, axis=2),
            causal="bottom_right",
            softcap=4.0,
            alibi_slopes=kw["alibi_slopes"][b],
            sinks=kw["sinks"],
        )
        assert_same(o[b : b + 1], want_o)
        assert_same(lse[b : b + 1], want_lse)
    assert np.abs(ob - o).max() < 0.1 and np.abs(lseb - lse).max() < 0.1


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


def _f32(a):
    return np.array_equal(np.asarray(a, np.float32).astype(np.float64), a)


@settings(max_examples=200, deadline=None)
@given(
    st.frozensets(st.sampled_from(sorted(ALL))),
    st.integers(1, 3),
    st.integers(1, 5),
    st.data(),
)
def test_score_args_draw_valid_values_for_the_specs_features_only(features, batch, heads, data):
    score = data.draw(score_args(stand_in(features), batch, heads))
    assert score.features <= features
    assert ("softcap" in features) == (score.softcap > 0)
    assert ("alibi" in features) == (score.alibi_slopes is not None)
    assert ("sink" in features) == (score.sinks is not None)
    if score.softcap:
        assert 0.5 <= score.softcap <= 50 and _f32(score.softcap)
    if score.alibi_slopes is not None:
        assert score.alibi_slopes.shape in ((heads,), (batch, heads))
        assert np.all(np.isfinite(score.alibi_slopes)) and _f32(score.alibi_slopes)
    if score.sinks is not None:
        assert score.sinks.shape == (heads,) and _f32(score.sinks)
        assert np.all((-5 <= score.sinks) & (score.sinks <= 10))
    M.check_score_args(**score.kwargs(), batch=batch, heads=heads)  # valid as drawn


def test_score_args_reach_the_corner_cases():
    exists(softcaps(), lambda c: c <= 1.0)
    exists(softcaps(), lambda c: c >= 30.0)
    exists(alibi_slopes(2, 4), lambda s: s.shape == (2, 4))
    exists(alibi_slopes(2, 4), lambda s: np.allclose(s, alibi_geometric(4)))
    exists(alibi_slopes(2, 4), lambda s: (s < 0).any() and (s > 0).any() and (s == 0).any())
    exists(alibi_slopes(1, 3), lambda s: np.all(s == 0))
    exists(sink_values(4), lambda s: np.all(s >= 6.0))  # dominant sinks
    exists(sink_values(4), lambda s: (s < -1).any())


def test_alibi_geometric_is_the_papers_sequence():
    np.testing.assert_allclose(alibi_geometric(8), [2.0 ** -(k + 1) for k in range(8)])


# ---------------------------------------------------------------------------------------------
# Argument checks and the registry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"softcap": -1.0}, "softcap=-1.0 must be finite and >= 0"),
        ({"softcap": float("inf")}, "softcap=inf must be finite"),
        ({"softcap": float("nan")}, "softcap=nan must be finite"),
        ({"softcap": True}, "softcap must be a number"),
        ({"alibi_slopes": np.ones(3)}, r"alibi_slopes must have shape \(heads,\) = \(2,\)"),
        ({"alibi_slopes": np.ones((3, 2))}, r"or \(batch, heads\) = \(2, 2\), got \(3, 2\)"),
        ({"alibi_slopes": np.ones((2, 2, 1))}, "alibi_slopes must have shape"),
        ({"alibi_slopes": np.array([1, 2])}, "alibi_slopes must be a float array"),
        ({"alibi_slopes": np.array([np.nan, 1.0])}, "alibi_slopes must be finite"),
        ({"sinks": np.ones((2, 1))}, r"sinks must have shape \(heads,\) = \(2,\)"),
        ({"sinks": np.array([0.0, np.inf])}, "sinks must be finite"),
        ({"sinks": "a"}, "sinks must be a float array"),
    ],
)
def test_bad_score_arguments_are_named_with_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        M.check_score_args(**kwargs, batch=2, heads=2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 2, 4)) for _ in range(3))
    with pytest.raises(ValueError, match=message):
        R.attention_forward(q, k, v, **kwargs)


def test_the_spec_decides_which_values_a_kernel_takes():
    none = M.ScoreArgs()
    full = M.check_score_args(2.0, np.ones(2), np.zeros(2))
    assert M.score_args_problems(stand_in(()), none) == []
    assert M.score_args_problems(stand_in(ALL), full) == []
    assert M.score_args_problems(stand_in(()), full) == [
        "softcap given but this spec has softcap: false",
        "alibi_slopes given but this spec has alibi: false",
        "sinks given but this spec has sink: false",
    ]
    missing = M.score_args_problems(stand_in(ALL), none)
    assert [m.split(":")[0] for m in missing] == [f"this spec has {f}" for f in ARGS_ORDER]
    assert "softcap > 0" in missing[0]


ARGS_ORDER = [f.name for f in FEATURES]


def test_the_keyword_of_each_feature_is_its_first_parameter_row():
    assert M.ARGUMENTS == {f.name: f.params[0].name for f in FEATURES}
    assert M.ARGUMENTS == {"softcap": "softcap", "alibi": "alibi_slopes", "sink": "sinks"}
    fields = [p.name for p in SCORE_PARAM_FIELDS]
    from flashgen.generator.features import USER_PARAMS

    # ... then the score_mod's generic slots (generator/features/__init__.py)
    user = [r.name for r in USER_PARAMS]
    assert fields == ["softcap", "alibi_slopes", "alibi_batch_stride", "sinks", "dsinks", *user]
    for fam in families():  # every table has the score fields, then the head dims (then the
        names = [p.name for p in fam.params]  # fields a struct grew after them)
        i = names.index("softcap")
        assert names[i : i + len(fields) + 2] == [*fields, "head_dim", "head_dim_v"]


def test_score_args_kwargs_name_only_the_features_in_use():
    assert M.ScoreArgs().kwargs() == {}
    s = M.check_score_args(0.0, None, np.zeros(3))
    assert list(s.kwargs()) == ["sinks"] and s.features == {"sink"}
    assert "sinks=array([0.0, 0.0, 0.0])" in repr(s)


def test_spec_has_reads_kernel_specs_and_stand_ins():
    from flashgen.generator.load import load_spec_text

    spec = load_spec_text("dtype: bf16\nhead_dim: 64\nalibi: true\n")[0]
    assert M.spec_has(spec, "alibi") and not M.spec_has(spec, "sink")
    assert M.spec_has(stand_in({"sink"}), "sink")
    assert not M.spec_has(types.SimpleNamespace(), "softcap")  # no features attribute
    with pytest.raises(KeyError, match="not a feature"):
        M.spec_has(spec, "bias")
