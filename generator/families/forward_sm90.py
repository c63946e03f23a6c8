"""The Hopper forward (`kernel: forward`, `target: sm_90a`): TMA + wgmma, same C ABI.

A sibling of the mma.sync forward that serves the same kernel kind on the architecture-
specific target: it keeps the forward's parameter struct (`fg_fwd_params`), IO keys, runner,
tests and benchmarks, and replaces the mainloop (include/flashgen/fwd_sm90_kernel.cuh).

Tile rules: `warps` is 4, 8 or 12 consumer warps (1 to 3 warpgroups of 64 query rows each,
so `block_m = 16 * warps`), plus one producer warpgroup that issues the TMA loads;
`block_n` is 64 or 128 (the wgmma N of Q K^T); `stages` (1..4) K/V tiles in the TMA ring;
three or more stages turn on the pipelined, ping-pong loop. Head dims are multiples of 8
in 8..256; shared memory holds them rounded up to 64 columns (the TMA box, which zero-fills
the columns past head_dim without reading them), so head_dim 96 computes on 128 columns.
Shared memory: Q tile plus `stages` K and V tiles of `Dp = ceil(head_dim / 64) * 64` columns,
plus 1024 bytes of alignment slack (SW128 tiles start on 1024-byte boundaries).

Every forward feature is served: causal (both alignments), window, GQA, dropout with the
debug keep-mask, varlen, block sparsity (the forward's layout arrays and full/partial
semantics; the producer and the consumers walk the same schedule) and instrument_io (bytes
per TMA box, equal to verify/io_model.py). Varlen needs `total_q` and `total_k` in
`fg_fwd_params`: the tensor maps span the packed tensors, and their rows are not known on the
host otherwise (the cu_seqlens are on the device).
"""

from __future__ import annotations

from typing import Any

from flashgen.generator.families.forward import HEAD_DIMS, Forward
from flashgen.generator.spec import Dtype, KernelSpec, Target, Tile

TILE_WARPS = (4, 8, 12)
TILE_BLOCK_N = (64, 128)
TILE_STAGES = (1, 2, 3, 4)


def head_dim_pad(head_dim: int) -> int:
    return -(-head_dim // 64) * 64


def smem_bytes(tile: Tile, head_dim: int, dtype: Dtype, head_dim_v: int | None = None) -> int:
    """Q tile and `stages` K tiles of ceil(head_dim/64)*64 columns, `stages` V tiles of
    ceil(head_dim_v/64)*64 (head_dim_v: d_v, default head_dim), + 1024 alignment."""
    d_v = head_dim if head_dim_v is None else head_dim_v
    qk_rows = tile.block_m + tile.stages * tile.block_n
    v_rows = tile.stages * tile.block_n
    return (qk_rows * head_dim_pad(head_dim) + v_rows * head_dim_pad(d_v)) * dtype.nbytes + 1024


def tile_problems(tile: Tile) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = tile.type_problems()
    if out:
        return out
    if tile.warps not in TILE_WARPS:
        out.append(
            (
                "tile.warps",
                f"{tile.warps} is not allowed on sm_90a (allowed: 4, 8, 12: 1 to 3 warpgroups)",
            )  # fmt: skip
        )
    elif tile.block_m != 16 * tile.warps:
        out.append(
            (
                "tile.block_m",
                f"{tile.block_m} does not fit {tile.warps} warps: each warpgroup "
                f"owns 64 query rows, so block_m must be {16 * tile.warps}",
            )  # fmt: skip
        )
    if tile.block_n not in TILE_BLOCK_N:
        out.append(("tile.block_n", f"{tile.block_n} is not allowed on sm_90a (allowed: 64, 128)"))
    if tile.stages not in TILE_STAGES:
        out.append(("tile.stages", f"{tile.stages} is not allowed on sm_90a (allowed: 1..4)"))
    return out


class ForwardSm90(Forward):
    templates = "forward_sm90"

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if spec.target is not Target.SM90A:
            out.append(("target", f"{spec.target.yaml}: this family serves sm_90a only"))
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
                    f"((block_m + stages*block_n) * ceil(head_dim/64)*64 + stages*block_n * "
                    f"ceil(head_dim_v/64)*64) * {spec.dtype.nbytes} + 1024",
                )
            )
        return out

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(spec.tile, spec.head_dim, spec.dtype, spec.head_dim_vo)

    def threads(self, spec: KernelSpec) -> int:
        """The consumer warps plus one producer warpgroup (TMA)."""
        return (spec.tile.warps + 4) * 32

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        """Measured on an H200 (bf16, side by side, docs/benchmarks.md "Hopper forward"):
        three stages, so Q K^T of the next tile and P V of this one overlap the softmax and
        the consumer warpgroups ping-pong (+6-9% at d=128 and d=64 over two stages); three
        consumer warpgroups (block_m 192) for 33..64 columns, two elsewhere; 128-key tiles
        up to 128 padded columns, 64-key tiles above; two stages where three do not fit in
        shared memory (d > 192) or with dropout (registers)."""
        pad = head_dim_pad(head_dim)
        # At 160 consumer registers, d <= 32 and dropout spill (ptxas): two warpgroups there.
        warps = 12 if 32 < head_dim <= 64 and not values.get("dropout") else 8
        block_n = 128 if pad <= 128 else 64
        # dropout's Philox state beside the pipelined loop spills at d <= 64 (ptxas): two stages
        for stages in (2,) if values.get("dropout") else (3, 2):
            tile = Tile(block_m=16 * warps, block_n=block_n, warps=warps, stages=stages)
            if smem_bytes(tile, head_dim, dtype) + 64 <= target.info.max_smem_per_block:
                return tile
        return tile

    def head_dim_ok(self, head_dim: Any) -> bool:
        return head_dim in HEAD_DIMS

    def chip_head_dim(self, head_dim: int) -> int:
        return head_dim_pad(head_dim)

    def config(self, spec: KernelSpec) -> dict[str, Any]:
        return super().config(spec)


FAMILY = ForwardSm90()
