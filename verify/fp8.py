"""FP8 e4m3 (OCP E4M3, torch.float8_e4m3fn) in numpy: exact decode, round-to-nearest-even encode.

Format: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinities; codes 0x7F and 0xFF are
NaN, so the largest finite value is 448 (0x7E). Subnormals (exponent 0) are m * 2^-9, the
smallest 2^-9. Every e4m3 value is exact in float16 (whose normals reach 2^-14 and carry 10
mantissa bits) and in bfloat16 (normals to 2^-126, 7 mantissa bits): the kernels' e4m3 -> q
dtype conversion loses nothing, and neither does `decode` here in float64.

`encode` rounds to nearest, ties to an even code. Out of range, casts differ, so both are
here: `saturate=False` (the OCP rule, c10's scalar `fp8e4m3fn_from_fp32`): a magnitude above
464 (halfway from 448 to the 480 the format lacks) and an infinity give NaN; `saturate=True`
(torch 2.13's CPU `tensor.to(torch.float8_e4m3fn)`, and scaling quantisers that clamp, as
vLLM's): they give +-448. A NaN gives NaN (0x7F, sign kept) either way. So an inf cannot sit
in an FP8 cache: it arrives as NaN or as +-448; a NaN code propagates to the output as a
NaN in a 16-bit cache does, and rows past a sequence's length are never read
(docs/decode.md, "FP8 KV caches").

Descales follow FlashAttention-3's `flash_attn_with_kvcache`: the cache holds `K8` and the
attention is computed with `k_descale[b, hk] * K8` (and `v_descale * V8`), float32 descales
of shape (batch, kv_heads); `quantize` gives codes and the descale for a float cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["E4M3_MAX", "decode", "encode", "quantize", "round_trip", "values"]

E4M3_MAX = 448.0
_NAN_CODE = 0x7F


def _table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    out = sign * mag
    out[(codes & 0x7F) == _NAN_CODE] = np.nan
    return out


_VALUES = _table()
# positive finite codes 0x00..0x7E in increasing value order (the encoding is monotone)
_POS = _VALUES[:_NAN_CODE]


def values() -> np.ndarray:
    """The float64 value of each of the 256 codes (NaN for 0x7F and 0xFF)."""
    return _VALUES.copy()


def decode(codes: Any) -> np.ndarray:
    """float64 values of uint8 e4m3 codes (exact)."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise TypeError(f"e4m3 codes are uint8, got {c.dtype}")
    return _VALUES[c.astype(np.int64)]


def encode(x: Any, saturate: bool = False) -> np.ndarray:
    """uint8 e4m3 codes of float values (see the module doc for rounding, range and NaN)."""
    a = np.asarray(x, dtype=np.float64)
    mag = np.abs(a)
    neg = np.signbit(a)
    # index of the first positive value >= mag, then pick the nearer neighbour
    hi = np.clip(np.searchsorted(_POS, np.where(np.isfinite(mag), mag, 0.0)), 0, len(_POS) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_hi = np.abs(_POS[hi] - mag)
    d_lo = np.abs(mag - _POS[lo])
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0) & (lo != hi))
    code = np.where(pick_lo, lo, hi).astype(np.int64)
    big = (mag > 464.0) | np.isinf(mag)  # past halfway to the 480 the format lacks
    code = np.where(big, _NAN_CODE - 1 if saturate else _NAN_CODE, code)
    code = np.where(np.isnan(mag), _NAN_CODE, code)
    return (code | np.where(neg, 0x80, 0)).astype(np.uint8)


def round_trip(x: Any, saturate: bool = False) -> np.ndarray:
    """`decode(encode(x))`: x rounded to the nearest e4m3 value (float64)."""
    return decode(encode(x, saturate))


def quantize(cache: Any, amax_to: float = E4M3_MAX) -> tuple[np.ndarray, np.ndarray]:
    """Codes and per-(batch, kv head) float32 descales of a float cache `(batch, seqlen,
    kv_heads, d)`: `descale = amax / amax_to` over each (b, hk) slice of the finite values (1
    where the slice is all zeros), codes = encode(cache / descale, saturate=True). Dequantised:
    `decode(codes) * descale`."""
    c = np.asarray(cache, dtype=np.float64)
    amax = np.nanmax(np.abs(np.where(np.isfinite(c), c, 0.0)), axis=(1, 3))
    descale = np.where(amax > 0, amax / amax_to, 1.0).astype(np.float32)
    codes = encode(c / descale.astype(np.float64)[:, None, :, None], saturate=True)
    return codes, descale
