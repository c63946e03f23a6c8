"""The Hopper building blocks (include/flashgen/sm90.cuh, sm90_host.h) on an sm_90 GPU.

`sm90/blocks.cu` loads A, B, V (64 x d) by TMA into 128-byte-swizzled tiles, computes
S = A B^T with SS-wgmma (K-major operands) and O = P V with RS-wgmma (P = S rounded to the
dtype, from S's accumulator registers; V MN-major). So one run checks the mbarrier/TMA
pipeline, both descriptor kinds (including the k16 slice offsets and the leading byte offset
between 64-column boxes at d = 128), the accumulator layout and its reuse as an A operand.

- One-hot operands make both products exact: S must equal the permuted rows of B bit for bit,
  and O the permuted columns of P.
- Drawn values: S within fp32-accumulation tolerance of the float64 product, O likewise.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from flashgen.verify.numerics import from_dtype_bits, to_dtype_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from .conftest import REPO
from .sm90_build import sm90_gpu, sm90_library

SOURCE = REPO / "tests" / "gpu" / "sm90" / "blocks.cu"
ROWS = 64
CASES = [(dt, d) for dt in ("bf16", "fp16") for d in (64, 128)]


def _gpu():
    return sm90_gpu("the sm_90a building blocks")


@pytest.fixture(scope="module")
def lib():
    _gpu()
    so = sm90_library(
        SOURCE, "sm90_blocks", REPO / "templates" / "include" / "flashgen" / "sm90.cuh"
    )
    so.fg_sm90_blocks_run.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_uint64] * 5
    so.fg_sm90_blocks_run.restype = ctypes.c_int
    return so


def run(lib, dtype: str, d: int, a, b, v):
    """(S, O) from the kernel for float32 inputs already on the dtype's grid."""
    from flashgen.verify.runner import DeviceBuffer

    gpu = _gpu()
    bufs = []
    for x in (a, b, v):
        buf = DeviceBuffer(gpu, x.size * 2)
        buf.upload(to_dtype_bits(x, dtype))
        bufs.append(buf)
    s_buf, o_buf = DeviceBuffer(gpu, ROWS * ROWS * 4), DeviceBuffer(gpu, ROWS * d * 4)
    rc = lib.fg_sm90_blocks_run(
        0 if dtype == "bf16" else 1, d, *(x.ptr for x in bufs), s_buf.ptr, o_buf.ptr
    )
    assert rc == 0, f"fg_sm90_blocks_run returned {rc}"
    s = s_buf.download(np.float32, (ROWS, ROWS))
    o = o_buf.download(np.float32, (ROWS, d))
    assert s_buf.margins_intact() and o_buf.margins_intact()
    for x in (*bufs, s_buf, o_buf):
        x.free()
    return s, o


@pytest.mark.parametrize("dtype,d", CASES)
def test_one_hot_products_are_exact(lib, dtype, d):
    rng = np.random.default_rng(d)
    perm_a = rng.permutation(d)[:ROWS]  # row i of A picks column perm_a[i]
    a = np.zeros((ROWS, d), np.float32)
    a[np.arange(ROWS), perm_a] = 1.0
    b = from_dtype_bits(to_dtype_bits(rng.standard_normal((ROWS, d)), dtype), dtype)
    perm_v = rng.permutation(d)[:ROWS]  # row k of V is one-hot at column perm_v[k]
    v = np.zeros((ROWS, d), np.float32)
    v[np.arange(ROWS), perm_v] = 1.0
    s, o = run(lib, dtype, d, a, b, v)
    np.testing.assert_array_equal(s, b[:, perm_a].T)  # S[i, j] = B[j, perm_a[i]]
    want = np.zeros((ROWS, d), np.float32)
    want[:, perm_v] = s  # O[i, perm_v[k]] = P[i, k], and S is already on the dtype's grid
    np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("dtype,d", CASES)
@settings(max_examples=5, deadline=None, database=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.01, 1.0, 30.0]))
def test_drawn_products_match_float64(lib, dtype, d, seed, scale):
    rng = np.random.default_rng(seed)
    a, b, v = (
        from_dtype_bits(to_dtype_bits(scale * rng.standard_normal((ROWS, d)), dtype), dtype)
        for _ in range(3)
    )
    s, o = run(lib, dtype, d, a, b, v)
    s_ref = a.astype(np.float64) @ b.astype(np.float64).T
    # fp32 accumulation of d products: a few ulps of the sum of |products|
    bound = 4 * d * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b).T) + 1e-30
    assert np.all(np.abs(s - s_ref) <= bound), f"S off by {np.max(np.abs(s - s_ref))}"
    p = from_dtype_bits(to_dtype_bits(s, dtype), dtype).astype(np.float64)
    o_ref = p @ v.astype(np.float64)
    bound = 4 * ROWS * np.finfo(np.float32).eps * (np.abs(p) @ np.abs(v)) + 1e-30
    assert np.all(np.abs(o - o_ref) <= bound), f"O off by {np.max(np.abs(o - o_ref))}"
