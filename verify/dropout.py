"""The dropout keep-mask every flashgen kernel draws (docs/conventions.md, "Dropout").

For element `(b, h, i, j)` (h the query head; varlen: b the sequence, i, j local positions)
the Philox4x32-10 counter is `(j >> 2, i, b * heads + h, offset & 0xffffffff)`, the key
`(seed & 0xffffffff, seed >> 32)`, the random word is output word `j & 3`, and the element is
kept iff `word >= floor(p * 2**32)` (computed in float64). With p = 0 every element is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from flashgen.verify.philox import philox4x32

__all__ = ["keep_mask", "keep_mask_varlen", "keep_threshold"]

_U32 = 0xFFFFFFFF


def keep_threshold(p: float) -> int:
    """`floor(p * 2**32)` in float64, for `p` in [0, 1)."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p={p} must be in [0, 1)")
    return int(math.floor(p * 2.0**32))


def _check_seed_offset(seed: int, offset: int) -> None:
    if not 0 <= int(seed) < 2**64 or not 0 <= int(offset) < 2**64:
        raise ValueError(f"seed={seed} and offset={offset} must be uint64 values")


def _words(seed: int, offset: int, bh: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """The uint32 random words `(Sq, Sk)` of one `b * heads + h` row block."""
    groups = -(-seqlen_k // 4)
    ctr = (
        np.arange(groups, dtype=np.uint64)[None, :],
        np.arange(seqlen_q, dtype=np.uint64)[:, None],
        np.uint64(bh & _U32),
        np.uint64(int(offset) & _U32),
    )
    key = (np.uint64(int(seed) & _U32), np.uint64(int(seed) >> 32))
    w = philox4x32(ctr, key)
    # (Sq, groups, 4) -> column j = 4 * group + word
    return np.stack(w, axis=-1).reshape(seqlen_q, 4 * groups)[:, :seqlen_k]


def keep_mask(
    seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, p: float
) -> np.ndarray:
    """Bool `(batch, heads, Sq, Sk)`: True where the kernels keep the element."""
    _check_seed_offset(seed, offset)
    threshold = keep_threshold(p)
    out = np.ones((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    if threshold == 0 or seqlen_q == 0 or seqlen_k == 0:
        return out
    for b in range(batch):
        for h in range(heads):
            out[b, h] = _words(seed, offset, b * heads + h, seqlen_q, seqlen_k) >= threshold
    return out


def keep_mask_varlen(
    seed: int,
    offset: int,
    heads: int,
    seqlens_q: Sequence[int],
    seqlens_k: Sequence[int],
    p: float,
) -> np.ndarray:
    """Bool `(batch, heads, max Sq, max Sk)` for sequences of the given lengths.

    Entry `[b, h, i, j]` with `i < Sq_b` and `j < Sk_b` is the keep decision of sequence b at
    local position `(i, j)` (the counter does not depend on the lengths, so it equals
    `keep_mask` there); entries outside a sequence are False. This is the layout of the
    kernels' debug keep-mask and what `verify.reference` takes for varlen dropout.
    """
    sq = [int(x) for x in seqlens_q]
    sk = [int(x) for x in seqlens_k]
    if len(sq) != len(sk) or min(sq + sk, default=0) < 0:
        raise ValueError("seqlens_q and seqlens_k must be equally long lists of lengths >= 0")
    batch = len(sq)
    max_q, max_k = max(sq, default=0), max(sk, default=0)
    _check_seed_offset(seed, offset)
    threshold = keep_threshold(p)
    out = np.zeros((batch, heads, max_q, max_k), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            if threshold == 0:
                out[b, h, : sq[b], : sk[b]] = True
            elif sq[b] and sk[b]:
                out[b, h, : sq[b], : sk[b]] = (
                    _words(seed, offset, b * heads + h, sq[b], sk[b]) >= threshold
                )
    return out
