"""The e4m3 wgmma rows (include/flashgen/sm90_fp8.cuh, rendered from generator/wgmma.py) on an
sm_90 GPU, before any kernel uses them.

`sm90/fp8_wgmma.cu` computes S = A B^T (A 64 x 128, B N x 128, e4m3, both K-major in SW128
tiles) with SS-wgmma and again with RS-wgmma, the A fragment read from global memory in the
layout it documents. So one run checks the instruction strings, the k32 slice offsets of the
K-major descriptor and the register fragment of A.

- Small integers make the product exact (sums of at most 2048 stay integers well inside any
  accumulator): S equals NumPy's integer product, from both sources.
- Drawn e4m3 values: S near the float64 product (FP8 wgmma accumulates in reduced precision,
  so the bound is loose), and the RS result equals the SS one bit for bit.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from flashgen.verify import fp8
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import REPO
from .sm90_build import sm90_gpu, sm90_library

SOURCE = REPO / "tests" / "gpu" / "sm90" / "fp8_wgmma.cu"
HEADER = REPO / "templates" / "include" / "flashgen" / "sm90_fp8.cuh"
M, K = 64, 128
NS = (64, 128, 256)


def _gpu():
    return sm90_gpu("the sm_90a wgmma rows")


@pytest.fixture(scope="module")
def lib():
    _gpu()
    so = sm90_library(SOURCE, "sm90_fp8_wgmma", HEADER)
    so.fg_sm90_fp8_wgmma_run.argtypes = [ctypes.c_int] + [ctypes.c_uint64] * 4
    so.fg_sm90_fp8_wgmma_run.restype = ctypes.c_int
    return so


def run(lib, a_codes: np.ndarray, b_codes: np.ndarray):
    """(S from SS, S from RS) for uint8 e4m3 codes A (64 x 128) and B (N x 128)."""
    from flashgen.verify.runner import DeviceBuffer

    gpu = _gpu()
    n = b_codes.shape[0]
    bufs = []
    for x in (a_codes, b_codes):
        buf = DeviceBuffer(gpu, x.size)
        buf.upload(np.ascontiguousarray(x, dtype=np.uint8))
        bufs.append(buf)
    out = [DeviceBuffer(gpu, M * n * 4) for _ in range(2)]
    rc = lib.fg_sm90_fp8_wgmma_run(n, *(x.ptr for x in bufs), *(x.ptr for x in out))
    assert rc == 0, f"fg_sm90_fp8_wgmma_run returned {rc}"
    s_ss, s_rs = (x.download(np.float32, (M, n)) for x in out)
    assert all(x.margins_intact() for x in out)
    for x in (*bufs, *out):
        x.free()
    return s_ss, s_rs


@pytest.mark.parametrize("n", NS)
def test_small_integer_products_are_exact_from_both_sources(lib, n):
    rng = np.random.default_rng(n)
    a = rng.integers(-4, 5, (M, K)).astype(np.float64)
    b = rng.integers(-4, 5, (n, K)).astype(np.float64)
    s_ss, s_rs = run(lib, fp8.encode(a), fp8.encode(b))
    want = (a @ b.T).astype(np.float32)
    np.testing.assert_array_equal(s_ss, want)
    np.testing.assert_array_equal(s_rs, want)


@pytest.mark.parametrize("n", NS)
def test_one_hot_a_picks_columns_of_b(lib, n):
    """Row i of A one-hot at column perm[i]: S[i, j] = B[j, perm[i]] exactly, so each
    fragment register and each k32 slice lands where the layout says."""
    rng = np.random.default_rng(n + 1)
    perm = rng.permutation(K)[:M]
    a = np.zeros((M, K))
    a[np.arange(M), perm] = 1.0
    b_codes = fp8.encode(rng.standard_normal((n, K)), saturate=True)
    b = fp8.decode(b_codes)
    s_ss, s_rs = run(lib, fp8.encode(a), b_codes)
    np.testing.assert_array_equal(s_ss, b[:, perm].T.astype(np.float32))
    np.testing.assert_array_equal(s_rs, s_ss)


@pytest.mark.parametrize("n", NS)
@settings(max_examples=5, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.05, 1.0, 30.0]))
def test_drawn_products_match_float64(lib, n, seed, scale):
    rng = np.random.default_rng(seed)
    a_codes, b_codes = (
        fp8.encode(scale * rng.standard_normal(shape), saturate=True) for shape in ((M, K), (n, K))
    )
    a, b = fp8.decode(a_codes), fp8.decode(b_codes)
    s_ss, s_rs = run(lib, a_codes, b_codes)
    ref = a @ b.T
    bound = 2.0**-9 * (np.abs(a) @ np.abs(b).T) + 1e-30
    assert np.all(np.abs(s_ss - ref) <= bound), f"S off by {np.max(np.abs(s_ss - ref))}"
    np.testing.assert_array_equal(s_rs, s_ss)
