"""The same-precision baseline: dtype rounding and standard attention in fp16 / bf16."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from flashgen.verify import baseline as B
from flashgen.verify import reference as R
from flashgen.verify.strategies import attention_inputs, shapes
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_by_hand(x: float) -> float:
    """Nearest bf16 of a float32 by comparing its two bf16 neighbours exactly, ties to even."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    lo = bits & 0xFFFF0000
    hi = lo + 0x10000  # next bf16 away from zero (may be inf, exponent 0xff with mantissa 0)
    flo, fhi = _f32(lo), _f32(hi)
    xv = _f32(bits)
    # Past the largest bf16 the next value is inf, at distance as if it were 2**128.
    fhi_at = math.copysign(2.0**128, xv) if math.isinf(fhi) else fhi
    dlo, dhi = abs(xv - flo), abs(fhi_at - xv)
    if dlo < dhi:
        return flo
    if dhi < dlo:
        return fhi
    return flo if (lo >> 16) % 2 == 0 else fhi


@settings(max_examples=400, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_bf16_rounding_is_round_to_nearest_even(x):
    got = float(B.round_to_dtype(np.float32(x), "bf16"))
    want = bf16_by_hand(x)
    assert got == want
    assert int(np.float32(got).view(np.uint32)) & 0xFFFF == 0


def test_bf16_rounding_worked_examples():
    x = np.array(
        [
            1.0,
            1 + 2**-8,
            1 + 3 * 2**-8,
            -(1 + 2**-8),
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.finfo(np.float32).max,
        ],
        dtype=np.float32,
    )
    got = B.round_to_dtype(x, "bf16")
    want = [1.0, 1.0, 1 + 2**-6, -1.0, 0.0, -0.0, np.inf, -np.inf, np.inf]
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))
    assert np.signbit(got[5])
    assert np.isnan(B.round_to_dtype(np.float32(np.nan), "bf16"))


def test_fp16_rounding_matches_numpy_float16_and_overflows_to_inf():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65520.0, -1e6], dtype=np.float32)
    got = B.round_to_dtype(x, "fp16")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [1.0, 1 + 2**-9, np.inf, -np.inf])


def test_round_to_dtype_accepts_an_enum_with_a_yaml_spelling_and_rejects_others():
    class Bf16:
        yaml = "bf16"

    assert B.round_to_dtype(1.3, Bf16()) == B.round_to_dtype(1.3, "bf16")
    with pytest.raises(ValueError, match="fp16"):
        B.round_to_dtype(1.0, "fp8")


@st.composite
def problems(draw):
    shape = draw(shapes(max_batch=2, max_heads=4, max_seqlen=20, head_dims=(16, 32)))
    dtype = draw(st.sampled_from(("fp16", "bf16")))
    q, k, v = draw(
        attention_inputs(
            (shape.batch, shape.seqlen_q, shape.heads, shape.head_dim),
            (shape.batch, shape.seqlen_k, shape.kv_heads, shape.head_dim),
            kind="normal",
            dtype=dtype,
        )
    )
    causal = draw(st.sampled_from(("none", "top_left", "bottom_right")))
    return q, k, v, dtype, causal


# Unit roundoff of the dtype: the baseline is a few roundings away from the reference.
EPS = {"fp16": 2.0**-11, "bf16": 2.0**-8}


@settings(max_examples=40, deadline=None)
@given(problems())
def test_baseline_forward_is_close_to_the_reference_and_holds_dtype_values(problem):
    q, k, v, dtype, causal = problem
    o, lse = B.attention_forward(q, k, v, dtype=dtype, causal=causal)
    o64, lse64 = R.attention_forward(q, k, v, causal=causal)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_array_equal(B.round_to_dtype(o, dtype), o)
    assert np.array_equal(np.isinf(lse), np.isinf(lse64))
    vmax = max(1.0, float(np.abs(v).max(initial=0.0)))
    assert np.abs(o - o64).max(initial=0.0) <= 8 * EPS[dtype] * vmax
    fin = np.isfinite(lse64)
    assert np.abs(lse[fin] - lse64[fin]).max(initial=0.0) <= 1e-4 * (1 + np.abs(lse64).max())


@settings(max_examples=25, deadline=None)
@given(problems())
def test_baseline_backward_is_close_to_the_reference(problem):
    q, k, v, dtype, causal = problem
    do = B.round_to_dtype(np.random.default_rng(0).standard_normal(q.shape), dtype)
    o, lse = B.attention_forward(q, k, v, dtype=dtype, causal=causal)
    grads = B.attention_backward(q, k, v, o, lse, do, dtype=dtype, causal=causal)
    o64, lse64 = R.attention_forward(q, k, v, causal=causal)
    grads64 = R.attention_backward(q, k, v, o64, lse64, do, causal=causal)
    for g, g64 in zip(grads, grads64, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(B.round_to_dtype(g, dtype), g)
        scale = max(1.0, float(np.abs(g64).max(initial=0.0)))
        assert np.abs(g - g64).max(initial=0.0) <= 64 * EPS[dtype] * scale


def test_baseline_rounds_p_before_pv():
    """With two keys of weights 1/3 and 2/3, O is P rounded to the dtype times V."""
    q = np.zeros((1, 1, 1, 2))
    k = np.zeros((1, 2, 1, 2))
    q[..., 0] = 1.0
    k[0, 1, 0, 0] = np.log(2.0)  # scores 0 and log 2 (scale 1): P = (1/3, 2/3)
    v = np.zeros((1, 2, 1, 2))
    v[0, 0, 0, 0] = 1.0
    o, _ = B.attention_forward(q, k, v, dtype="bf16", scale=1.0)
    k_bf = B.round_to_dtype(k, "bf16")
    s = np.float32(k_bf[0, :, 0, 0])
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert o[0, 0, 0, 0] == B.round_to_dtype(p[0], "bf16")


def test_baseline_empty_rows_give_zero_and_minus_inf():
    q, k, v = (np.ones((1, 4, 1, 8)), np.ones((1, 2, 1, 8)), np.ones((1, 2, 1, 8)))
    o, lse = B.attention_forward(q, k, v, dtype="fp16", causal="bottom_right")
    assert np.all(o[0, :2] == 0) and np.all(lse[0, 0, :2] == -np.inf)
    assert np.all(np.isfinite(lse[0, 0, 2:]))


def test_baseline_takes_the_same_feature_arguments_as_the_reference():
    rng = np.random.default_rng(5)
    cu = np.array([0, 3, 7])
    q, k, v = (rng.standard_normal((7, 2, 16)) for _ in range(3))
    keep = rng.random((2, 2, 4, 4)) < 0.8
    kw = dict(
        causal="top_left",
        window=(2, 1),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        keep_mask=keep,
        dropout_p=0.2,
        block_mask=np.ones((1, 2, 2), bool),
        block_m=2,
        block_n=2,
    )
    o, lse = B.attention_forward(q, k, v, dtype="bf16", **kw)
    o64, lse64 = R.attention_forward(q, k, v, **kw)
    assert o.shape == o64.shape and lse.shape == lse64.shape == (2, 7)
    assert np.abs(o - o64).max() < 0.05
