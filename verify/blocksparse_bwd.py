"""The block-sparse layout the backward kernels read: the forward's compact layout transposed.

A backward CTA owns one K/V tile `kt` and walks query tiles, so it needs, per layout head `hl`
and K/V tile `kt`, the query tiles `qt` whose forward row lists `kt`: the *full* ones (`kt` in
the forward's full list of row `qt`: no element-wise mask) and the *partial* ones (`kt` in its
partial list). Which tiles are full, partial or dropped is decided once, by the forward layout
(`verify.blocksparse.compact_layout`), so forward and backward visit exactly the same tiles.

Arrays have the forward's shapes with the roles of the tile axes swapped: counts
`(Lh, Tc)`, index lists `(Lh, Tc, max_blocks)`, ascending, padded with -1 to `max_blocks`
(at least 1) entries; `Tc = ceil(Sk / block_n)` and `Tr = ceil(Sq / block_m)` as in the
forward. `transpose_layout` builds it, `forward_layout` goes back, and the two are inverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flashgen.verify.blocksparse import CompactLayout

__all__ = ["BwdLayout", "dense_from_bwd", "forward_layout", "transpose_layout"]

_NONE, _PART, _FULL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class BwdLayout:
    """int32 arrays as the backward kernel reads them, plus the shape they were built for.

    full_count, part_count `(Lh, Tc)`; full_idx, part_idx `(Lh, Tc, max_blocks)` of query
    tiles, ascending, padded with -1.
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
    def num_k_tiles(self) -> int:
        return int(self.full_count.shape[1])

    @property
    def num_q_tiles(self) -> int:
        return -(-self.seqlen_q // self.block_m)

    def head(self, h: int) -> int:
        """The layout head `hl` of query head `h`."""
        return 0 if self.layout_heads == 1 else h

    def tiles(self, h: int, kt: int) -> list[tuple[int, bool]]:
        """`(qt, needs_mask)` of the query tiles K/V tile `kt` visits for query head `h`, full
        then partial."""
        hl = self.head(h)
        full = self.full_idx[hl, kt, : self.full_count[hl, kt]]
        part = self.part_idx[hl, kt, : self.part_count[hl, kt]]
        return [(int(m), False) for m in full] + [(int(m), True) for m in part]


def _classes(count: np.ndarray, idx: np.ndarray, n_other: int, what: str) -> np.ndarray:
    """Bool `(Lh, rows, n_other)`: which tiles each row's list names."""
    count = np.asarray(count, dtype=np.int64)
    idx = np.asarray(idx, dtype=np.int64)
    if idx.ndim != 3 or idx.shape[:2] != count.shape:
        raise ValueError(f"{what}: index array {idx.shape} does not match counts {count.shape}")
    width = idx.shape[2]
    if np.any(count < 0) or np.any(count > width):
        raise ValueError(f"{what}: counts must lie in [0, {width}]")
    used = np.arange(width)[None, None, :] < count[..., None]
    if np.any(used & ((idx < 0) | (idx >= n_other))):
        raise ValueError(f"{what}: indices must name tiles in [0, {n_other})")
    out = np.zeros(count.shape + (n_other,), dtype=bool)
    hl, row, slot = np.nonzero(used)
    out[hl, row, idx[hl, row, slot]] = True
    if int(out.sum()) != int(count.sum()):
        raise ValueError(f"{what}: a row lists the same tile twice")
    return out


def _pack(listed: np.ndarray, max_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Bool `(Lh, rows, cols)` -> int32 counts `(Lh, rows)` and ascending column lists
    `(Lh, rows, max_blocks)` padded with -1."""
    count = listed.sum(axis=-1).astype(np.int32)
    lh, rows, cols = listed.shape
    idx = np.full((lh, rows, max_blocks), -1, dtype=np.int32)
    if cols:
        # a stable sort of "not listed" puts the listed columns first, in ascending order
        order = np.argsort(~listed, axis=-1, kind="stable")[..., :max_blocks].astype(np.int32)
        width = order.shape[-1]
        used = np.arange(width)[None, None, :] < count[..., None]
        idx[..., :width] = np.where(used, order, -1)
    return count, idx


def _swap(
    full_count, full_idx, part_count, part_idx, n_other: int, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    full = _classes(full_count, full_idx, n_other, f"{what} full lists")
    part = _classes(part_count, part_idx, n_other, f"{what} partial lists")
    if np.any(full & part):
        raise ValueError(f"{what}: a tile is listed as both full and partial")
    full_t, part_t = full.transpose(0, 2, 1), part.transpose(0, 2, 1)
    longest = int(max(full_t.sum(axis=-1).max(initial=0), part_t.sum(axis=-1).max(initial=0)))
    max_blocks = max(1, longest)
    fc, fi = _pack(full_t, max_blocks)
    pc, pi = _pack(part_t, max_blocks)
    return fc, fi, pc, pi, max_blocks


def transpose_layout(layout: CompactLayout) -> BwdLayout:
    """The backward's layout: per (layout head, K/V tile), the query tiles of the forward
    `layout` that list it, full then partial as the forward classified them."""
    if isinstance(layout, BwdLayout):
        raise TypeError("already a backward layout (forward_layout goes the other way)")
    tr = -(-int(layout.seqlen_q) // int(layout.block_m))
    tc = -(-int(layout.seqlen_k) // int(layout.block_n))
    if np.shape(layout.full_count)[1:] != (tr,):
        raise ValueError(
            f"layout counts {np.shape(layout.full_count)} do not have the {tr} query tiles of "
            f"Sq={layout.seqlen_q} at block_m={layout.block_m}"
        )
    fc, fi, pc, pi, mb = _swap(
        layout.full_count, layout.full_idx, layout.part_count, layout.part_idx, tc, "layout"
    )
    return BwdLayout(
        fc,
        fi,
        pc,
        pi,
        mb,
        int(layout.block_m),
        int(layout.block_n),
        int(layout.seqlen_q),
        int(layout.seqlen_k),
    )


def forward_layout(bwd: BwdLayout) -> CompactLayout:
    """The inverse of `transpose_layout`: the forward's compact layout of a backward one."""
    tc = -(-bwd.seqlen_k // bwd.block_n)
    if np.shape(bwd.full_count)[1:] != (tc,):
        raise ValueError(
            f"backward layout counts {np.shape(bwd.full_count)} do not have the {tc} K/V tiles "
            f"of Sk={bwd.seqlen_k} at block_n={bwd.block_n}"
        )
    fc, fi, pc, pi, mb = _swap(
        bwd.full_count, bwd.full_idx, bwd.part_count, bwd.part_idx, bwd.num_q_tiles, "bwd"
    )
    return CompactLayout(fc, fi, pc, pi, mb, bwd.block_m, bwd.block_n, bwd.seqlen_q, bwd.seqlen_k)


def dense_from_bwd(bwd: BwdLayout) -> np.ndarray:
    """Bool `(Lh, Tr, Tc)` of the listed tiles (full or partial), in the forward's orientation
    (compare with `verify.blocksparse.dense_from_compact`)."""
    tr = bwd.num_q_tiles
    full = _classes(bwd.full_count, bwd.full_idx, tr, "bwd full lists")
    part = _classes(bwd.part_count, bwd.part_idx, tr, "bwd partial lists")
    return (full | part).transpose(0, 2, 1).copy()
