"""The Hopper backward (`kernel: backward`, `target: sm_90a`): TMA + wgmma, same C ABI.

A sibling of the mma.sync backward that serves the same kernel kind on the architecture-
specific target: it keeps the backward's parameter struct (`fg_bwd_params`), workspace,
preprocess and dQ conversion kernels, runner, tests and benchmarks, and replaces the main
kernel (include/flashgen/bwd_sm90_kernel.cuh): a producer warpgroup loads K and V once and
streams Q, dO (TMA) and LSE, D into a ring; two consumer warpgroups of 64 keys each compute
S^T = K Q^T and dP^T = V dO^T (SS-wgmma), then dV += P^T dO and dK += dS^T Q from registers
(RS-wgmma), and dQ = dS K through shared memory, added to the fp32 workspace: through an
fp32 dQ tile in shared memory that the producer warpgroup's second warp adds by TMA
reduce-add (`dq_by_tma`), or by each thread's red.add (the workspace is the mma.sync
backward's either way, but for varlen dq_accum's rows: dense here, packed there).

Tile rules: `warps` 8 (two consumer warpgroups), `block_n` 128 (64 keys each), `block_m` 64
or 128 query rows a step (dQ of a step is cut into one 64-row piece per warpgroup: 64 x Dp/2
at block_m 64, 64 x Dp at 128); `stages` 1..4 Q/dO tiles in the ring. Head dims are
multiples of 8 up to 128 (dK and dV of 64 keys x 128 columns fill half a warpgroup's
registers; larger head dims need the head dim split across warpgroups, not built).
Shared memory: K, V; `stages` Q and dO tiles; two dS^T buffers (block_n x block_m); `stages`
LSE and D rows; the fp32 dQ tile (block_m x Dp) where `dq_by_tma`; 1024 bytes of alignment
slack.
`deterministic`: the dQ adds of each query tile are made in one key-tile order, one K/V tile
at a time (a dq_sem counter per (batch, head, query tile) in the workspace's third part, as
the mma.sync backward's): by the dQ writer after its turn, or by the consumers when they add
dQ themselves, so dQ, dK and dV are bitwise repeatable. The order ascends, except with causal
and no window, where it descends and the CTAs take their key tiles in that order (the last
key tile that sees a query tile adds first; ascending, the causal CTAs ran as a wavefront).
Varlen (`mask.varlen`): the maps of Q, K, V and dO span the packed tensors (`total_q`,
`total_k` in `fg_bwd_params`, as the forward's), a sequence's tiles start at its packed row,
and dq_accum keeps its dense rows (batch x longest sequence), so a tile's reduce-adds past
its sequence's end stay in that sequence's own rows; a key tile past a shorter sequence's
keys leaves at once, and deterministic turns count the sequence's own key tiles.
A spec's `score_mod` sees a sequence's own positions and lengths (i, j, seqlen_q, seqlen_k)
and its index b, varlen or not. Not on this path (rejected by name; `target: sm_90` has
them): dropout, block sparsity, instrument_io.
"""

from __future__ import annotations

from typing import Any

from flashgen.generator.families.backward import Backward
from flashgen.generator.families.forward_sm90 import head_dim_pad
from flashgen.generator.spec import Causal, Dtype, KernelSpec, Target, Tile

HEAD_DIMS = tuple(range(8, 129, 8))  # shared memory holds them as 64 or 128 columns
TILE_WARPS = (8,)
TILE_BLOCK_N = (128,)
TILE_BLOCK_M = (64, 128)
TILE_STAGES = (1, 2, 3, 4)


def dq_by_tma(head_dim: int, block_m: int, user_score_mod: bool) -> bool:
    """Whether the kernel adds dQ through an fp32 tile in shared memory and TMA reduce-adds
    (BwdSm90Config::kDqTma; else each thread's red.add): without a user score_mod, at 128
    padded columns or 128 query rows a step, where it compiles spill-free (ptxas 13.0) and
    measured faster (docs/benchmarks.md, eleventh session)."""
    return not user_score_mod and (head_dim_pad(head_dim) == 128 or block_m == 128)


def smem_bytes(tile: Tile, head_dim: int, dtype: Dtype, user_score_mod: bool = False) -> int:
    """K, V, `stages` x (Q, dO) tiles of Dp columns, two dS^T buffers, the fp32 dQ tile
    (block_m x Dp, `dq_by_tma` kernels), `stages` x (LSE, D) fp32 rows, + 1024 alignment."""
    pad, e = head_dim_pad(head_dim), dtype.nbytes
    tiles = (2 * tile.block_n + 2 * tile.stages * tile.block_m) * pad * e
    dq = tile.block_m * pad * 4 if dq_by_tma(head_dim, tile.block_m, user_score_mod) else 0
    return (
        tiles + 2 * tile.block_n * tile.block_m * e + 2 * tile.stages * tile.block_m * 4 + dq + 1024
    )


def tile_problems(tile: Tile, head_dim: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = tile.type_problems()
    if out:
        return out
    if tile.warps not in TILE_WARPS:
        out.append(
            ("tile.warps", f"{tile.warps} is not allowed on the sm_90a backward (allowed: 8)")
        )
    if tile.block_n not in TILE_BLOCK_N:
        out.append(
            ("tile.block_n", f"{tile.block_n} is not allowed on the sm_90a backward (allowed: 128)")
        )
    if tile.block_m not in TILE_BLOCK_M:
        out.append(
            (
                "tile.block_m",
                f"{tile.block_m} is not allowed on the sm_90a backward (allowed: 64, 128)",
            )
        )
    if tile.stages not in TILE_STAGES:
        out.append(("tile.stages", f"{tile.stages} is not allowed on sm_90a (allowed: 1..4)"))
    return out


class BackwardSm90(Backward):
    templates = "backward_sm90"
    # Not built: its head dims stop at 128 (so d_qk 192 is out of reach whatever d_v), and its
    # mainloop holds one head dim for K, V, Q and dO (the boxes, the wgmma N of dK and dV).
    serves_head_dim_v = False
    head_dim_v_refusal = (
        "head_dim_v = head_dim only; the mma.sync backward (target: sm_80..sm_90) serves "
        "head_dim_v != head_dim, e.g. 192 / 128"
    )

    def head_dim_ok(self, head_dim: Any) -> bool:
        return head_dim in HEAD_DIMS

    def chip_head_dim(self, head_dim: int) -> int:
        return head_dim_pad(head_dim)

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if spec.target is not Target.SM90A:
            out.append(("target", f"{spec.target.yaml}: this family serves sm_90a only"))
        if not self.head_dim_ok(spec.head_dim):
            out.append(
                (
                    "head_dim",
                    f"{spec.head_dim} is not allowed on the sm_90a backward (allowed: multiples "
                    "of 8 in 8..128; target: sm_90 has the rest)",
                )
            )
            return out
        for flag, name in (
            (spec.dropout, "dropout"),
            (spec.sparse, "sparsity"),
            (spec.instrument_io, "instrument_io"),
        ):
            if flag:
                out.append(
                    (name, "not on the sm_90a (wgmma) backward yet: use target: sm_90 for it")
                )
        tile = tile_problems(spec.tile, spec.head_dim)
        out.extend(tile)
        if not tile and not out:
            out.extend(
                self.smem_problem(
                    spec,
                    f"(2*block_n + 2*stages*block_m) * ceil(head_dim/64)*64 * {spec.dtype.nbytes}"
                    f" + 2*block_n*block_m*{spec.dtype.nbytes} + 8*stages*block_m"
                    + (
                        " + 4*block_m*ceil(head_dim/64)*64 (the fp32 dQ tile)"
                        if dq_by_tma(spec.head_dim, spec.tile.block_m, spec.score_mod is not None)
                        else ""
                    )
                    + " + 1024",
                )
            )
        return out

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(spec.tile, spec.head_dim, spec.dtype, spec.score_mod is not None)

    def threads(self, spec: KernelSpec) -> int:
        """The consumer warps plus one producer warpgroup (TMA)."""
        return (spec.tile.warps + 4) * 32

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        """Measured on an H200 (bf16, side by side, docs/benchmarks.md "Backward v3"): 128 keys
        per CTA (two consumer warpgroups); at 64 padded columns 128 query rows a step and three
        stages (1.13-1.18x FlashAttention-2, against 0.93-1.04x with 64 rows), at 128 columns
        64 rows and two stages (three measured within noise of two). With the dQ tile in
        shared memory (`dq_by_tma`), 128 rows at 64 columns take two stages: three need
        233,472 bytes, past the 227 KiB a CTA may have (two with the tile measured 1.06-1.14x
        three with the adds, ab_bench on an H200). `values` are the spec's parsed fields
        (feature flags by field path)."""
        # softcap keeps its derivative beside the scores: 128 query rows a step then spill
        # (92 bytes at d 64, ptxas), 64 do not; a score_mod (positions, parameters and maybe a
        # derivative) takes 64 rows likewise, and so do ALiBi without a mask (its distances
        # beside P^T formed while dP^T runs: 16 bytes at 128 rows, d 64, ptxas 13.0; with
        # causal none, and 64 rows cost it 15-20%, H200, scoremod_bench) and a
        # deterministic window (its turn is a search over the key tiles: 4 bytes at 128 rows)
        masked = values.get("mask.causal") not in (None, Causal.NONE) or values.get("mask.window")
        light = (
            not values.get("softcap")
            and not (values.get("alibi") and not masked)
            and values.get("score_mod") is None
            and not (values.get("deterministic") and values.get("mask.window"))
        )
        if head_dim_pad(head_dim) <= 64 and light:
            return Tile(block_m=128, block_n=128, warps=8, stages=2)
        return Tile(block_m=64, block_n=128, warps=8, stages=2)

    def config(self, spec: KernelSpec) -> dict[str, Any]:
        return {**self.spec_config(spec), "deterministic": spec.deterministic}


FAMILY = BackwardSm90()
