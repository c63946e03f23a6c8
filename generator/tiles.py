"""Automatic tile choice of the forward family (`tile: auto`).

Rule (documented in docs/spec.md; the measurements behind it are in docs/tiles.md):

1. The spec's features put it in a *register class* (`register_class`): `dense` (only
   `mask.causal`), `masked` (also `mask.window`, `mask.varlen` or `gqa`), `heavy` (also
   `dropout`, `sparsity: block` or `instrument_io`) or `debug` (`debug_keep_mask`); a
   `score_mod` or a `mask_mod` is `masked`. Each
   class keeps more values live per thread than the one before it.
2. A `dense` spec takes `MEASURED_DEFAULTS[(target, head_dim)]` when present: the fastest
   non-spilling tile measured on a GPU.
3. Otherwise the tile is the class's row of `REGISTER_SAFE` for the target's register group
   (`REGISTER_GROUP`): the largest tile that nvcc compiled without a spill for every feature
   combination of the class, per head dim. The rows read "8 warps x 16 query rows,
   block_n <= Y(d)": two 16-row tiles per warp (`block_m = 128` on 4 warps) spill from d = 96
   without features, from d = 64 with GQA or varlen alone, and at every d with the debug
   keep-mask; 64-key tiles stop being safe at d = 224 (dense, masked), 112 (heavy) or 80
   (debug); the largest head dims take 16 keys, and the debug class a single-stage K/V ring
   from d = 224.
4. The tile is then shrunk until it fits the target's shared memory: a `REGISTER_SAFE` tile
   loses `block_n`, then stages, which never adds registers; others go through `fit_tile`.

Why a table and not a formula: ptxas under `__launch_bounds__(threads, 1)` schedules up to 255
registers, and whether it then spills is not monotone in the tile or in the features (a
smaller block_n, or one feature fewer, can spill where the larger one does not). So each row
was chosen by compiling every feature combination with nvcc and reading the spill counts of
the ptxas report; `tests/test_auto_tiles_nvcc.py` recompiles a covering subset.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flashgen.generator.spec import Dtype, Target, Tile

# ---- the forward's tile geometry (the family, generator/families/forward.py, re-exports it) --
TILE_WARPS = (1, 2, 4, 8)
TILE_STAGES = (1, 2, 3)
TILE_MT = (1, 2)  # 16-row MMA tiles per warp along the query dimension
SMEM_ROW_PAD = 8  # the kernel pads each shared-memory row by 8 elements (bank conflicts)


def tile_problems(tile: Tile) -> list[tuple[str, str]]:
    """Shape constraints independent of head_dim/target, as (field, message) pairs."""
    out: list[tuple[str, str]] = tile.type_problems()
    if out:
        return out
    if tile.warps not in TILE_WARPS:
        out.append(("tile.warps", f"{tile.warps} is not allowed (allowed: 1, 2, 4, 8)"))
    if tile.block_m <= 0 or tile.block_m % 16:
        out.append(("tile.block_m", f"{tile.block_m} is not a positive multiple of 16"))
    elif tile.warps in TILE_WARPS and tile.block_m not in [16 * tile.warps * mt for mt in TILE_MT]:
        allowed = ", ".join(str(16 * tile.warps * mt) for mt in TILE_MT)
        out.append(
            (
                "tile.block_m",
                f"{tile.block_m} does not fit {tile.warps} warps: each warp owns 16 or 32 "
                f"query rows, so block_m must be 16 * warps * (1 or 2) "
                f"(allowed with warps={tile.warps}: {allowed})",
            )
        )
    if not (16 <= tile.block_n <= 256 and tile.block_n % 16 == 0):
        out.append(
            ("tile.block_n", f"{tile.block_n} is not allowed (allowed: multiples of 16 in 16..256)")
        )
    if tile.stages not in TILE_STAGES:
        out.append(("tile.stages", f"{tile.stages} is not allowed (allowed: 1, 2, 3)"))
    return out


def mma_head_dim(head_dim: int) -> int:
    """The head dim the mma.sync kernels hold on chip: rounded up to the k16 steps of their
    products (a head dim of 8 * odd is zero-padded in shared memory, never in HBM)."""
    return -(-head_dim // 16) * 16


def smem_bytes(tile: Tile, head_dim: int, dtype: Dtype, head_dim_v: int | None = None) -> int:
    """Dynamic shared memory in bytes: Q tile and `stages` K tiles of `head_dim` (d) columns,
    `stages` V tiles of `head_dim_v` (d_v, default d) columns, padded rows."""
    d_v = head_dim if head_dim_v is None else head_dim_v
    qk_rows = tile.block_m + tile.stages * tile.block_n
    v_rows = tile.stages * tile.block_n
    return (
        qk_rows * (mma_head_dim(head_dim) + SMEM_ROW_PAD)
        + v_rows * (mma_head_dim(d_v) + SMEM_ROW_PAD)
    ) * dtype.nbytes


__all__ = [
    "MEASURED_DEFAULTS",
    "REGISTER_CLASSES",
    "REGISTER_GROUP",
    "REGISTER_SAFE",
    "auto_tile",
    "fit_tile",
    "mma_head_dim",
    "paper_tile",
    "register_class",
    "register_safe_tile",
    "tile_fits",
]

_T = Tile  # short alias for the tables below

MEASURED_DEFAULTS: dict[tuple[Target, int], Tile] = {
    # sm_90, measured on an H200 side by side with SDPA FLASH (bench/results/v2_tiles.json,
    # docs/benchmarks.md): the fastest tile per head dim among those that do not spill.
    # Used for the `dense` register class only (the benchmark's kernels had no other feature).
    **{(Target.SM90, d): _T(128, 64, 4, 2) for d in (16, 32, 48, 64)},
    (Target.SM90, 80): _T(128, 64, 8, 2),
    (Target.SM90, 96): _T(128, 64, 8, 2),
    (Target.SM90, 112): _T(128, 64, 8, 2),
    (Target.SM90, 128): _T(128, 64, 8, 2),
    (Target.SM90, 192): _T(128, 64, 8, 2),
    (Target.SM90, 256): _T(128, 32, 8, 2),
}

REGISTER_CLASSES = ("dense", "masked", "heavy", "debug")

# Targets whose ptxas makes the same register decisions share a row set. Measured: sm_86 and
# sm_89 gave identical registers and spills on every kernel compiled for both; sm_80 and sm_90
# each differ (docs/tiles.md). fp16 and bf16 gave identical results everywhere, so the dtype
# is not a key.
REGISTER_GROUP: dict[Target, str] = {
    Target.SM80: "sm_80",
    Target.SM86: "sm_86",
    Target.SM89: "sm_86",
    Target.SM90: "sm_90",
    Target.SM90A: "sm_90",
}

_SM90_ROWS: dict[str, tuple[tuple[int, Tile], ...]] = {
    # class: ((largest head_dim of the band, tile), ...), head dims ascending
    "dense": ((64, _T(128, 64, 4, 2)), (208, _T(128, 64, 8, 2)), (224, _T(128, 32, 8, 2)),
              (240, _T(128, 16, 8, 2)), (256, _T(128, 32, 8, 2))),
    "masked": ((48, _T(128, 64, 4, 2)), (208, _T(128, 64, 8, 2)), (240, _T(128, 16, 8, 2)),
               (256, _T(128, 32, 8, 2))),
    "heavy": ((96, _T(128, 64, 8, 2)), (192, _T(128, 32, 8, 2)), (256, _T(128, 16, 8, 2))),
    # d = 240: no tile is spill-free for every debug combination (docs/tiles.md, "Known
    # spills"); 64 rows on 4 warps, one stage spills on the fewest (14 of 96, <= 40 bytes).
    "debug": ((64, _T(128, 64, 8, 2)), (192, _T(128, 32, 8, 2)), (208, _T(128, 16, 8, 2)),
              (224, _T(128, 16, 8, 1)), (240, _T(64, 16, 4, 1)), (256, _T(128, 16, 8, 1))),
}  # fmt: skip

# Measured with nvcc 13.0 (V13.0.88) on the forward kernel of templates/ (docs/tiles.md).
# sm_80 and sm_86 start from the sm_90 rows and differ where they were measured to spill:
# sm_80 spills 8-12 bytes at d = 256 with 32 keys (dense, masked); on sm_86 the d = 240 debug
# row of sm_90 spills and 128x16 with one stage does not.
REGISTER_SAFE: dict[str, dict[str, tuple[tuple[int, Tile], ...]]] = {
    "sm_90": _SM90_ROWS,
    "sm_80": {
        **_SM90_ROWS,
        "dense": ((64, _T(128, 64, 4, 2)), (208, _T(128, 64, 8, 2)), (224, _T(128, 32, 8, 2)),
                  (256, _T(128, 16, 8, 2))),
        "masked": ((48, _T(128, 64, 4, 2)), (208, _T(128, 64, 8, 2)), (256, _T(128, 16, 8, 2))),
    },
    "sm_86": {
        **_SM90_ROWS,
        "debug": ((64, _T(128, 64, 8, 2)), (192, _T(128, 32, 8, 2)), (208, _T(128, 16, 8, 2)),
                  (256, _T(128, 16, 8, 1))),
    },
}  # fmt: skip


def register_class(features: Mapping[str, Any] | None = None) -> str:
    """The register class of a spec's features, keyed by field path as the loader parses them
    (`"dropout"`, `"mask.window"`, `"sparsity"`, ...); None or {} is a plain dense kernel."""
    f = features or {}
    if f.get("debug_keep_mask"):
        return "debug"
    if f.get("dropout") or f.get("instrument_io") or str(f.get("sparsity", "none")) != "none":
        return "heavy"
    # a score_mod keeps its positions and parameters beside the scores: with two 16-row tiles
    # per warp (the dense d <= 64 tile) the shipped examples spilled 56-140 bytes at d 64, with
    # one (the masked rows) none (ptxas 13.0, specs/usermod.yaml)
    # (likewise a mask_mod's per-element test and its parameters)
    user = f.get("score_mod") or f.get("mask_mod")
    if f.get("mask.window") or f.get("mask.varlen") or f.get("gqa") or user:
        return "masked"
    return "dense"


def register_safe_tile(target: Target, reg_class: str, head_dim: int) -> Tile | None:
    """The `REGISTER_SAFE` tile of this target, class and head dim (None: no row for it)."""
    rows = REGISTER_SAFE.get(REGISTER_GROUP.get(target, ""), {}).get(reg_class, ())
    return next((tile for max_d, tile in rows if head_dim <= max_d), None)


def paper_tile(target: Target, dtype: Dtype, head_dim: int) -> Tile:
    """FlashAttention's B_c = ceil(M / 4d), B_r = min(B_c, d), at tensor-core granularity.
    The fallback for a target without `REGISTER_SAFE` rows."""
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


def _fit_keeping_rows(tile: Tile, target: Target, dtype: Dtype, head_dim: int) -> Tile:
    """Shrink a `REGISTER_SAFE` tile to the target's shared memory without adding registers:
    block_n down by 16 to 16, then fewer stages (block_m and warps stay)."""
    while not tile_fits(tile, target, dtype, head_dim):
        bm, bn, w, s = tile.block_m, tile.block_n, tile.warps, tile.stages
        if bn > 16:
            tile = Tile(bm, bn - 16, w, s)
        elif s > 1:
            tile = Tile(bm, bn, w, s - 1)
        else:
            return fit_tile(tile, target, dtype, head_dim)
    return tile


def auto_tile(
    target: Target, dtype: Dtype, head_dim: int, *, features: Mapping[str, Any] | None = None
) -> Tile:
    """The tile `tile: auto` resolves to (see module docstring). `features` are the spec's
    parsed fields keyed by path (the loader's values); None means no feature is on. A head
    dim of 8 * odd takes the tile of the multiple of 16 it is padded to on chip, for the next
    heavier register class (at 256 on chip, at least the heavy class's): the padded column's
    predicate and store guards cost registers, and with their own class's tiles d 56 (dense),
    184 and 200 (masked), 72 (heavy) and 248 (dense, masked) spilled 4-20 bytes (ptxas 13.0,
    the sweep of tests/test_auto_tiles_nvcc.py over every odd multiple of 8)."""
    padded, head_dim = head_dim != mma_head_dim(head_dim), mma_head_dim(head_dim)
    reg_class = register_class(features)
    if padded and reg_class != REGISTER_CLASSES[-1]:
        reg_class = REGISTER_CLASSES[REGISTER_CLASSES.index(reg_class) + 1]
        if head_dim == 256 and reg_class == "masked":
            reg_class = "heavy"
    measured = MEASURED_DEFAULTS.get((target, head_dim))
    if measured is not None and reg_class == "dense":
        return fit_tile(measured, target, dtype, head_dim)
    safe = register_safe_tile(target, reg_class, head_dim)
    if safe is not None:
        return _fit_keeping_rows(safe, target, dtype, head_dim)
    return fit_tile(paper_tile(target, dtype, head_dim), target, dtype, head_dim)
