"""Bit-exact conversions between float32 and the kernels' 16-bit dtypes.

NumPy has no bfloat16, so 16-bit values travel as uint16 bit patterns: `to_dtype_bits`
rounds float32 to nearest even (fp16 through NumPy's float16; bf16 by keeping the top 16
bits after adding the rounding bias) and `from_dtype_bits` widens them back exactly.
"""

from __future__ import annotations

import numpy as np


def to_dtype_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array -> uint16 bit patterns of fp16 or bf16 (round to nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    if dtype == "bf16":
        u = np.array(x, order="C").view(np.uint32).astype(np.uint64)  # 0-d stays 0-d
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        # NaN keeps its sign and becomes a quiet NaN (the increment could carry it to inf).
        rounded = np.where(np.isnan(x), (u >> 16) | 0x0040, rounded)
        return rounded.astype(np.uint16)
    raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")


def from_dtype_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    """uint16 bit patterns of fp16 or bf16 -> float32 (exact)."""
    bits = np.asarray(bits, dtype=np.uint16)
    if dtype == "fp16":
        return bits.view(np.float16).astype(np.float32)
    if dtype == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"dtype must be 'fp16' or 'bf16', got {dtype!r}")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the dtype's grid (still float32)."""
    return from_dtype_bits(to_dtype_bits(x, dtype), dtype)
