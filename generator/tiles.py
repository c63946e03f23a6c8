"""Automatic tile choice of the forward family (`tile: auto`).

Rule (documented in docs/spec.md):
1. `MEASURED_DEFAULTS[(target, head_dim)]`, when present, wins (filled from GPU measurements).
2. Otherwise FlashAttention's rule: with `M` the target's shared memory per block in elements
   (`max_smem_per_block // dtype.nbytes`), `B_c = ceil(M / (4 d))`, `B_r = min(B_c, d)`;
   `block_n = B_c` rounded down to a multiple of 16 and clamped to 16..128; `block_m = 128`
   if `B_r >= 128` else 64; `warps = 4` (so each warp owns 32 or 16 query rows); `stages = 2`.
3. Either way the tile is then shrunk until it satisfies every constraint of `KernelSpec`
   (see `fit_tile`).
"""

from __future__ import annotations

import math

from flashgen.generator.families.forward import smem_bytes, tile_problems
from flashgen.generator.spec import Dtype, Target, Tile

__all__ = ["MEASURED_DEFAULTS", "auto_tile", "fit_tile", "paper_tile", "tile_fits"]

_T = Tile  # short alias for the table below

MEASURED_DEFAULTS: dict[tuple[Target, int], Tile] = {
    # sm_90, measured on an H200 side by side with SDPA FLASH (bench/results/v2_tiles.json,
    # docs/benchmarks.md): the fastest tile per head dim among those that do not spill.
    **{(Target.SM90, d): _T(128, 64, 4, 2) for d in (16, 32, 48, 64)},
    (Target.SM90, 80): _T(128, 64, 8, 2),
    (Target.SM90, 96): _T(128, 64, 8, 2),
    (Target.SM90, 112): _T(128, 64, 8, 2),
    (Target.SM90, 128): _T(128, 64, 8, 2),
    (Target.SM90, 192): _T(128, 64, 8, 2),
    (Target.SM90, 256): _T(128, 32, 8, 2),
}


def paper_tile(target: Target, dtype: Dtype, head_dim: int) -> Tile:
    """FlashAttention's B_c = ceil(M / 4d), B_r = min(B_c, d), at tensor-core granularity."""
    m_elems = target.info.max_smem_per_block // dtype.nbytes
    b_c = math.ceil(m_elems / (4 * head_dim))
    b_r = min(b_c, head_dim)
    block_n = max(16, min(128, (b_c // 16) * 16))
    block_m = 128 if b_r >= 128 else 64
    return Tile(block_m=block_m, block_n=block_n, warps=4, stages=2)


def tile_fits(tile: Tile, target: Target, dtype: Dtype, head_dim: int) -> bool:
    """Whether `tile` satisfies every tile constraint for this target, dtype and head dim."""
    if tile_problems(tile):
        return False
    info = target.info
    return (
        tile.threads <= info.max_threads_per_block
        and smem_bytes(tile, head_dim, dtype) <= info.max_smem_per_block
    )


def fit_tile(tile: Tile, target: Target, dtype: Dtype, head_dim: int) -> Tile:
    """Shrink `tile` until it fits: block_n down to 32 in steps of 16, then block_m to 64
    (warps 4, 16 rows each), then fewer stages, then block_n 16."""
    while not tile_fits(tile, target, dtype, head_dim):
        bm, bn, w, s = tile.block_m, tile.block_n, tile.warps, tile.stages
        if tile_problems(tile):  # not a legal shape at all: restart from the smallest legal one
            tile = Tile(64, 64, 4, 2)
        elif bn > 32:
            tile = Tile(bm, bn - 16, w, s)
        elif bm > 64:
            tile = Tile(64, bn, 4, s)
        elif s > 1:
            tile = Tile(bm, bn, w, s - 1)
        elif bn > 16:
            tile = Tile(bm, 16, w, s)
        else:
            raise ValueError(f"no tile fits {target.yaml} with d={head_dim} {dtype.yaml}")
    return tile


def auto_tile(target: Target, dtype: Dtype, head_dim: int) -> Tile:
    """The tile `tile: auto` resolves to (see module docstring)."""
    tile = MEASURED_DEFAULTS.get((target, head_dim)) or paper_tile(target, dtype, head_dim)
    return fit_tile(tile, target, dtype, head_dim)
