"""The backward family's tile rules against its kernel's warp layouts (bwd_kernel.cuh's
BwdConfig), without a GPU: every tile validation accepts must be covered exactly by the
three warp layouts, and every auto tile must be accepted."""

from __future__ import annotations

import itertools

import pytest
from flashgen.generator.families import backward
from flashgen.generator.spec import Dtype, Target, Tile

SIZES = tuple(range(16, 129, 16))


def covered(tile: Tile, d: int) -> bool:
    """BwdConfig's integer arithmetic on the generator's warp rows (kSRows, kKvRows, kQRows)
    and its on-chip head dim (kHeadDimPad):
    each layout's warp tiles times its warps must give the whole block (the C code rounds
    down, so a mismatch leaves rows unwritten)."""
    w, bm, bn = tile.warps, tile.block_m, tile.block_n
    lay = backward.warp_layouts(tile, d)
    d = backward.chip_head_dim(d)  # kHeadDimPad: the head dim on chip
    s_rows, kv_rows, q_rows = lay["s"][0], lay["kv"][0], lay["q"][0]
    if w % s_rows or w % kv_rows or w % q_rows:
        return False
    s_cols, kv_cols, q_cols = w // s_rows, w // kv_rows, w // q_rows
    smt, snt = bm // 16 // s_rows, bn // s_cols // 8
    kvmt, kvdt = bn // 16 // kv_rows, d // kv_cols // 8
    qmt, qdt = bm // 16 // q_rows, d // q_cols // 8
    return (
        smt * s_rows * 16 == bm
        and snt * s_cols * 8 == bn
        and snt % 2 == 0
        and snt > 0
        and kvmt * kv_rows * 16 == bn
        and kvdt * kv_cols * 8 == d
        and kvdt % 2 == 0
        and qmt * q_rows * 16 == bm
        and qdt * q_cols * 8 == d
        and qdt % 2 == 0
    )


@pytest.mark.parametrize("d", backward.HEAD_DIMS)
def test_every_accepted_tile_is_covered_by_the_warp_layouts(d):
    for bm, bn, w, st in itertools.product(SIZES, SIZES, backward.TILE_WARPS, (1, 2)):
        tile = Tile(bm, bn, w, st)
        if not backward.tile_problems(tile, d):
            assert covered(tile, d), (tile, d)


def test_a_tile_the_layouts_cover_only_in_part_is_refused_by_name():
    problems = dict(backward.tile_problems(Tile(80, 64, 8, 2), 64))
    assert "does not split" in problems["tile"]


@pytest.mark.parametrize("target", [t for t in Target if t is not Target.SM90A])
@pytest.mark.parametrize("dropout", [False, True])
def test_auto_tiles_are_accepted_for_every_head_dim(target, dropout):
    for d in backward.HEAD_DIMS:
        tile = backward.FAMILY.auto_tile(target, Dtype.BF16, d, {"dropout": dropout})
        assert not backward.tile_problems(tile, d), (target, d, tile)
        assert backward.smem_bytes(tile, d, Dtype.BF16) <= target.info.max_smem_per_block


def test_square_warp_tiles_up_to_d128_as_flashattention2_hdim128():
    # FlashAttention-2's hdim128 sm80 traits: AtomLayoutMSdP 2, AtomLayoutNdKV 4, AtomLayoutMdQ 2
    lay = backward.warp_layouts(Tile(64, 128, 8, 2), 128)
    assert lay == {"s": (2, 4), "kv": (4, 2), "q": (2, 4)}
    # beyond d = 128, v1's 16-row warp tiles (register-lighter)
    assert backward.warp_layouts(Tile(64, 64, 8, 2), 192)["kv"] == (4, 2)


@pytest.mark.parametrize(
    ("values", "tile"),
    [
        ({}, Tile(32, 128, 8, 2)),
        ({"dropout": True}, Tile(64, 64, 8, 2)),
        ({"deterministic": True}, Tile(64, 64, 8, 2)),
        ({"instrument_io": True}, Tile(64, 64, 8, 2)),
    ],
)
def test_d128_auto_tile_has_128_keys_unless_a_register_heavy_feature(values, tile):
    assert backward.FAMILY.auto_tile(Target.SM90, Dtype.BF16, 128, values) == tile


def test_p_scratch_only_where_accumulators_exceed_the_budget():
    assert backward.p_scratch(Tile(32, 128, 8, 2), 128)
    assert not backward.p_scratch(Tile(64, 128, 8, 2), 64)
    assert not backward.p_scratch(Tile(64, 64, 8, 2), 128)
