"""Philox4x32-10 (Salmon et al., Random123) in vectorised NumPy, bit-identical to the kernels.

Notation: a counter is four uint32 words `(c0, c1, c2, c3)`, a key two `(k0, k1)`. Each of
the 10 rounds multiplies `c0` by `M0` and `c2` by `M1` (64-bit products split into hi / lo
words), mixes: `(hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)`, then bumps the key by the Weyl
constants `(W0, W1)`. Products are formed in uint64, so `mulhi` is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["M0", "M1", "W0", "W1", "philox4x32"]

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
_MASK = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32(
    counter: Sequence[Any], key: Sequence[Any], rounds: int = 10
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four uint32 output words of Philox4x32-`rounds` for broadcastable arrays.

    `counter` is four array-likes of uint32 values, `key` two; all are broadcast together and
    each output word has the broadcast shape.
    """
    if len(counter) != 4 or len(key) != 2:
        raise ValueError("philox4x32 takes 4 counter words and 2 key words")
    words = np.broadcast_arrays(*(np.asarray(x, dtype=np.uint64) for x in (*counter, *key)))
    for w in words:
        if np.any(w > _MASK):
            raise ValueError("counter and key words must be uint32 values")
    c0, c1, c2, c3, k0, k1 = (w.copy() for w in words)
    m0, m1 = np.uint64(M0), np.uint64(M1)
    for r in range(rounds):
        if r:
            k0 = (k0 + np.uint64(W0)) & _MASK
            k1 = (k1 + np.uint64(W1)) & _MASK
        p0 = c0 * m0  # < 2**64: exact
        p1 = c2 * m1
        c0, c1, c2, c3 = (
            (p1 >> _SHIFT) ^ c1 ^ k0,
            p1 & _MASK,
            (p0 >> _SHIFT) ^ c3 ^ k1,
            p0 & _MASK,
        )
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))  # type: ignore[return-value]
