"""The forward family (`kernel: forward`): mma.sync FlashAttention-2 loop order, sm_80..sm_90.

Tile rules: each of `warps` warps owns 16 or 32 query rows (`block_m = 16 * warps * mt`,
`mt` in {1, 2}); `block_n` is a multiple of 16 in 16..256; `stages` (1..3) K/V tiles are in
flight. Shared memory: the Q tile plus `stages` K and V tiles, rows padded by SMEM_ROW_PAD
elements (bank conflicts of ldmatrix).
"""

from __future__ import annotations

from typing import Any

from flashgen.generator.families import (
    SCORE_PARAM_FIELDS,
    SHAPE_PARAM_FIELDS,
    Family,
    params_table,
)
from flashgen.generator.spec import Dtype, KernelKind, KernelSpec, Target, Tile

# The tile geometry lives beside the tile rule (generator/tiles.py), which imports nothing of
# this module: no import cycle between the family and its `tile: auto` table.
from flashgen.generator.tiles import (  # noqa: F401 - re-exported, part of this family's API
    SMEM_ROW_PAD,
    TILE_MT,
    TILE_STAGES,
    TILE_WARPS,
    auto_tile,
    smem_bytes,
    tile_problems,
)

# Every multiple of 8 (a 16-byte row chunk) up to 256: 8 * odd runs on the next multiple of
# 16 in shared memory (tiles.mma_head_dim), zero-filled there, never padded in HBM.
HEAD_DIMS = tuple(range(8, 257, 8))

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
    ptr philox_seed_ptr
    ptr philox_offset_ptr
    u64 philox_offset_add
    ptr philox_seed_out
    ptr philox_offset_out
    ptr keep_mask
    ptr blk_full_count
    ptr blk_full_idx
    ptr blk_part_count
    ptr blk_part_idx
    i64 blk_layout_heads
    i64 blk_max_blocks
    ptr io_counters
    """
) + SCORE_PARAM_FIELDS + SHAPE_PARAM_FIELDS
IO_KEYS = ("Q", "K", "V", "O", "LSE", "META", "KEEP_MASK")
GRID_FORMULA = "ceil(max_seqlen_q/block_m) * heads * batch"


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
                    f"{spec.head_dim} is not allowed (allowed: multiples of 8 in 8..256)",
                )
            )
        tile = tile_problems(spec.tile)
        out.extend(tile)
        if not tile and not out:
            out.extend(
                self.smem_problem(
                    spec,
                    f"(block_m + 2*stages*block_n) * (ceil(head_dim/16)*16 + {SMEM_ROW_PAD}) * "
                    f"{spec.dtype.nbytes}",
                )
            )
        return out

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(spec.tile, spec.head_dim, spec.dtype)

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        return auto_tile(target, dtype, head_dim, features=values)

    def config(self, spec: KernelSpec) -> dict[str, Any]:
        return self.spec_config(spec)

    def launch_info(self, spec: KernelSpec) -> dict[str, Any]:
        return {"threads": spec.threads, "block_m": spec.tile.block_m, "grid": GRID_FORMULA}


FAMILY = Forward()
