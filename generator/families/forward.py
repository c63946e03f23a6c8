"""The forward family (`kernel: forward`): mma.sync FlashAttention-2 loop order, sm_80..sm_90.

Tile rules: each of `warps` warps owns 16 or 32 query rows (`block_m = 16 * warps * mt`,
`mt` in {1, 2}); `block_n` is a multiple of 16 in 16..256; `stages` (1..3) K/V tiles are in
flight. Shared memory: the Q tile plus `stages` K and V tiles, rows padded by SMEM_ROW_PAD
elements (bank conflicts of ldmatrix).
"""

from __future__ import annotations

from typing import Any

from flashgen.generator.families import SCORE_PARAM_FIELDS, Family, params_table
from flashgen.generator.spec import Dtype, KernelKind, KernelSpec, Target, Tile

HEAD_DIMS = tuple(range(16, 257, 16))
TILE_WARPS = (1, 2, 4, 8)
TILE_STAGES = (1, 2, 3)
TILE_MT = (1, 2)  # 16-row MMA tiles per warp along the query dimension
SMEM_ROW_PAD = 8  # the kernel pads each shared-memory row by 8 elements (bank conflicts)

# fg_fwd_params (include/flashgen/params.h), in declaration order.
PARAMS = params_table(
    """
    ptr q
    ptr k
    ptr v
    ptr o
    ptr lse
    i64 q_batch_stride
    i64 q_row_stride
    i64 q_head_stride
    i64 k_batch_stride
    i64 k_row_stride
    i64 k_head_stride
    i64 v_batch_stride
    i64 v_row_stride
    i64 v_head_stride
    i64 o_batch_stride
    i64 o_row_stride
    i64 o_head_stride
    i64 lse_batch_stride
    i64 lse_head_stride
    i64 batch
    i64 heads
    i64 kv_heads
    i64 seqlen_q
    i64 seqlen_k
    ptr cu_seqlens_q
    ptr cu_seqlens_k
    i64 total_q
    i64 total_k
    f64 softmax_scale
    i64 window_left
    i64 window_right
    f64 dropout_p
    u64 seed
    u64 offset
    ptr keep_mask
    ptr blk_full_count
    ptr blk_full_idx
    ptr blk_part_count
    ptr blk_part_idx
    i64 blk_layout_heads
    i64 blk_max_blocks
    ptr io_counters
    """
) + SCORE_PARAM_FIELDS
IO_KEYS = ("Q", "K", "V", "O", "LSE", "META", "KEEP_MASK")
GRID_FORMULA = "ceil(max_seqlen_q/block_m) * heads * batch"


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


def smem_bytes(tile: Tile, head_dim: int, dtype: Dtype) -> int:
    """Dynamic shared memory in bytes: Q tile plus `stages` K and V tiles, padded rows."""
    rows = tile.block_m + 2 * tile.stages * tile.block_n
    return rows * (head_dim + SMEM_ROW_PAD) * dtype.nbytes


class Forward(Family):
    kind = KernelKind.FORWARD
    templates = "forward"
    params_struct = "fg_fwd_params"
    params_header = "params.h"
    params = PARAMS
    io_keys = IO_KEYS
    io_model = "flashgen.verify.io_model:forward_bytes"

    def head_dim_ok(self, head_dim: Any) -> bool:
        return head_dim in HEAD_DIMS

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if spec.target.value.suffix:
            out.append(
                (
                    "target",
                    f"{spec.target.yaml} is not served by the mma.sync forward (allowed: "
                    "sm_80, sm_86, sm_89, sm_90)",
                )
            )
        if not self.head_dim_ok(spec.head_dim):
            out.append(
                (
                    "head_dim",
                    f"{spec.head_dim} is not allowed (allowed: multiples of 16 in 16..256)",
                )
            )
        tile = tile_problems(spec.tile)
        out.extend(tile)
        if not tile and not out:
            out.extend(
                self.smem_problem(
                    spec,
                    f"(block_m + 2*stages*block_n) * (head_dim + {SMEM_ROW_PAD}) * "
                    f"{spec.dtype.nbytes}",
                )
            )
        return out

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(spec.tile, spec.head_dim, spec.dtype)

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        from flashgen.generator.tiles import auto_tile

        return auto_tile(target, dtype, head_dim, features=values)

    def config(self, spec: KernelSpec) -> dict[str, Any]:
        return self.spec_config(spec)

    def launch_info(self, spec: KernelSpec) -> dict[str, Any]:
        return {"threads": spec.threads, "block_m": spec.tile.block_m, "grid": GRID_FORMULA}


FAMILY = Forward()
