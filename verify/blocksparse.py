"""The compact block-sparse layout the kernels read (docs/conventions.md, "Block sparsity").

Notation: `Lh` layout heads (1 = one layout shared by all heads, else `heads`), `Tr`, `Tc`
query and key tiles (`ceil(Sq / block_m)`, `ceil(Sk / block_n)`), `qt`, `kt` a query / key
tile index. A listed tile `(qt, kt)` is *full* iff every `(i, j)` in it with `i < Sq` passes
mask rules 1-3 (in range, causal, window), so the kernel skips its element-wise mask; it is
*partial* iff some but not all do. Tiles that rules 1-3 mask entirely are dropped. Index lists
are ascending, padded with -1 to `max_blocks` (at least 1) entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flashgen.verify.reference import element_visible, spec_window

__all__ = [
    "CompactLayout",
    "compact_layout",
    "compact_layout_for_spec",
    "dense_from_compact",
    "tile_classes",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class CompactLayout:
    """int32 arrays as the kernel reads them, plus the shape they were built for.

    full_count, part_count `(Lh, Tr)`; full_idx, part_idx `(Lh, Tr, max_blocks)` padded with -1.
    """

    full_count: np.ndarray
    full_idx: np.ndarray
    part_count: np.ndarray
    part_idx: np.ndarray
    max_blocks: int
    block_m: int
    block_n: int
    seqlen_q: int
    seqlen_k: int

    @property
    def layout_heads(self) -> int:
        return int(self.full_count.shape[0])

    @property
    def num_q_tiles(self) -> int:
        return int(self.full_count.shape[1])

    @property
    def num_k_tiles(self) -> int:
        return -(-self.seqlen_k // self.block_n)

    def head(self, h: int) -> int:
        """The layout head `hl` of query head `h`."""
        return 0 if self.layout_heads == 1 else h

    def tiles(self, h: int, qt: int) -> list[tuple[int, bool]]:
        """`(kt, needs_mask)` of the tiles query tile `qt` of head `h` visits, full then partial."""
        hl = self.head(h)
        full = self.full_idx[hl, qt, : self.full_count[hl, qt]]
        part = self.part_idx[hl, qt, : self.part_count[hl, qt]]
        return [(int(n), False) for n in full] + [(int(n), True) for n in part]


def tile_classes(
    *,
    block_m: int,
    block_n: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
) -> np.ndarray:
    """int8 `(Tr, Tc)`: EMPTY (0), PARTIAL (1) or FULL (2) under mask rules 1-3 alone."""
    tr, tc = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    i = np.arange(tr * block_m)[:, None]
    j = np.arange(tc * block_n)[None, :]
    vis = element_visible(i, j, seqlen_q, seqlen_k, causal=causal, window=window)
    vis = vis.reshape(tr, block_m, tc, block_n)
    # Rows past Sq do not count (they are never computed); columns past Sk do.
    rows_ok = (np.arange(tr * block_m) < seqlen_q).reshape(tr, block_m)[:, :, None, None]
    any_vis = vis.any(axis=(1, 3))
    all_vis = (vis | ~rows_ok).all(axis=(1, 3))
    return np.where(all_vis & any_vis, FULL, np.where(any_vis, PARTIAL, EMPTY)).astype(np.int8)


def _pack(lists: list[list[list[int]]], max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    lh, tr = len(lists), len(lists[0]) if lists else 0
    count = np.zeros((lh, tr), dtype=np.int32)
    idx = np.full((lh, tr, max_blocks), -1, dtype=np.int32)
    for hl in range(lh):
        for qt in range(tr):
            row = lists[hl][qt]
            count[hl, qt] = len(row)
            idx[hl, qt, : len(row)] = row
    return count, idx


def compact_layout(
    block_mask: Any,
    *,
    block_m: int,
    block_n: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
) -> CompactLayout:
    """The compact form of a bool block layout `(Lh, Tr, Tc)` for one `(Sq, Sk)`.

    `causal` ('none' / 'top_left' / 'bottom_right' or an enum with that `.yaml`) and `window`
    `(left, right)` are those the kernel runs with; they decide full vs partial and which tiles
    are dropped. `Tr`, `Tc` must be exactly `ceil(Sq / block_m)`, `ceil(Sk / block_n)`.
    """
    bm = np.asarray(block_mask)
    tr, tc = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    if bm.dtype != np.bool_ or bm.ndim != 3 or bm.shape[1:] != (tr, tc):
        raise ValueError(
            f"block_mask must be bool (layout_heads, {tr}, {tc}) for Sq={seqlen_q}, "
            f"Sk={seqlen_k} at {block_m} x {block_n}; got {bm.dtype} {bm.shape}"
        )
    cls = tile_classes(
        block_m=block_m,
        block_n=block_n,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        causal=causal,
        window=window,
    )
    full = [
        [np.flatnonzero(bm[hl, qt] & (cls[qt] == FULL)).tolist() for qt in range(tr)]
        for hl in range(bm.shape[0])
    ]
    part = [
        [np.flatnonzero(bm[hl, qt] & (cls[qt] == PARTIAL)).tolist() for qt in range(tr)]
        for hl in range(bm.shape[0])
    ]
    longest = max((len(r) for rows in full + part for r in rows), default=0)
    max_blocks = max(1, longest)
    full_count, full_idx = _pack(full, max_blocks)
    part_count, part_idx = _pack(part, max_blocks)
    return CompactLayout(
        full_count,
        full_idx,
        part_count,
        part_idx,
        max_blocks,
        int(block_m),
        int(block_n),
        int(seqlen_q),
        int(seqlen_k),
    )


def compact_layout_for_spec(
    block_mask: Any,
    spec: Any,
    *,
    seqlen_q: int,
    seqlen_k: int,
    window: Sequence[int] = (-1, -1),
) -> CompactLayout:
    """`compact_layout` with block sizes and causal alignment read from a kernel spec.

    A bounded `window` with a spec that has no window mask is a `ValueError`.
    """
    return compact_layout(
        block_mask,
        block_m=spec.tile.block_m,
        block_n=spec.tile.block_n,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        causal=spec.mask.causal,
        window=spec_window(spec, window),
    )


def dense_from_compact(layout: CompactLayout) -> np.ndarray:
    """Bool `(Lh, Tr, Tc)` of the listed tiles (full or partial)."""
    out = np.zeros((layout.layout_heads, layout.num_q_tiles, layout.num_k_tiles), dtype=bool)
    for hl in range(layout.layout_heads):
        for qt in range(layout.num_q_tiles):
            for kt, _ in layout.tiles(hl, qt):
                out[hl, qt, kt] = True
    return out
