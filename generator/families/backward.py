"""The backward family (`kernel: backward`): FlashAttention-2's backward on mma.sync.

One launch runs three kernels (`<name>_launch`): a preprocess computing D = rowsum(dO * O)
into the workspace, the main kernel, in which each CTA owns one K/V tile of `block_n` keys
of one (batch, KV head) and walks the query tiles of `block_m` rows (of every query head of
its GQA group, so dK and dV are summed in registers, with no expanded copy) recomputing
P = exp(scale * Q K^T - LSE), accumulating dV += P^T dO and dK += dS^T Q and adding
dQ += dS K into an fp32 workspace with atomics; and a kernel converting that workspace to
dQ in the output dtype. Extra memory is O(N): dq_accum and D.

Tile rules (each measured against ptxas for spills, generator/families/backward.py tests):
`warps` in {4, 8}; `block_m` and `block_n` multiples of 16 in 16..128; `stages` in {1, 2}
(query-side buffers in flight); the three warp layouts below must tile their blocks.
Shared memory: K and V tiles, `stages` Q and dO tiles, P and dS tiles, LSE and D rows.
"""

from __future__ import annotations

import math
from typing import Any

from flashgen.generator.families import (
    SCORE_PARAM_FIELDS,
    SHAPE_PARAM_FIELDS,
    Family,
    params_table,
)
from flashgen.generator.features import FEATURES
from flashgen.generator.spec import Dtype, KernelKind, KernelSpec, Sparsity, Target, Tile
from flashgen.generator.tiles import mma_head_dim

# Every multiple of 8 up to 256, run on chip as `chip_head_dim`: the warp layouts, registers
# and shared memory are that dim's.
HEAD_DIMS = tuple(range(8, 257, 8))
TILE_WARPS = (4, 8)
TILE_STAGES = (1, 2)
SMEM_ROW_PAD = 8
PEAK_ACC_REGS = 128
SQUARE_WARP_TILES_MAX_D = 128

PARAMS = (
    params_table(
        """
    ptr q
    ptr k
    ptr v
    ptr o
    ptr dout
    ptr lse
    ptr dq
    ptr dk
    ptr dv
    ptr dq_accum
    ptr dsum
    ptr dq_sem
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
    i64 do_batch_stride
    i64 do_row_stride
    i64 do_head_stride
    i64 dq_batch_stride
    i64 dq_row_stride
    i64 dq_head_stride
    i64 dk_batch_stride
    i64 dk_row_stride
    i64 dk_head_stride
    i64 dv_batch_stride
    i64 dv_row_stride
    i64 dv_head_stride
    i64 lse_batch_stride
    i64 lse_head_stride
    i64 batch
    i64 heads
    i64 kv_heads
    i64 seqlen_q
    i64 seqlen_k
    ptr cu_seqlens_q
    ptr cu_seqlens_k
    f64 softmax_scale
    i64 window_left
    i64 window_right
    f64 dropout_p
    u64 seed
    u64 offset
    ptr philox_seed_ptr
    ptr philox_offset_ptr
    u64 philox_offset_add
    ptr keep_mask
    ptr blk_full_count
    ptr blk_full_idx
    ptr blk_part_count
    ptr blk_part_idx
    i64 blk_layout_heads
    i64 blk_max_blocks
    ptr io_counters
    """
    )
    + SCORE_PARAM_FIELDS
    + SHAPE_PARAM_FIELDS
    # varlen on the sm_90a backward: the packed tensors' rows its tensor maps span
    + params_table(
        """
    i64 total_q
    i64 total_k
    """
    )
)
IO_KEYS = (
    "Q",
    "K",
    "V",
    "O",
    "DO",
    "LSE",
    "DSUM",
    "DQ_ACCUM",
    "DQ",
    "DK",
    "DV",
    "META",
    "KEEP_MASK",
)
GRID_FORMULA = "ceil(max_seqlen_k/block_n) * kv_heads * batch (main kernel)"


def chip_head_dim(head_dim: int) -> int:
    """The head dim on chip (BwdConfig's kHeadDimPad): the next multiple of 16 up to 64, of 32
    up to 192, then 256. Measured with ptxas 13.0 (sm_90): dK/dV and dQ of 80, 112 or 16 * odd
    columns beyond 128 split over one warp column only, and those tiles spilled (80 columns
    with the score modifiers: 16-48 bytes with every tile the layouts allow; d 104 on 112
    columns: 16-36 bytes); 224 columns spilled 778 bytes with the 32 x 64 x 4 tile its layouts
    allow and 12-56 with 64 x 64 x 8, while 256 columns compile clean with 32 x 64 x 8. So d 72
    runs on 96 columns, d 104 on 128, d 136 on 160 and d 200 on 256 (their TFLOP/s count the
    real d: docs/benchmarks.md, "Shapes")."""
    d = mma_head_dim(head_dim)
    if d <= 64:
        return d
    return -(-head_dim // 32) * 32 if head_dim <= 192 else 256


def _split(warps: int, rows: int, cols: int) -> tuple[int, int]:
    """Warps along (rows, cols) of a rows x cols output: warp tiles of whole 16 x 16 blocks
    (an even number of n8 columns, the ldmatrix.x4 pairs), as square as possible. A warp
    reads its rows' and columns' operands once per k-step, so (rows/r + cols/c) is its shared
    memory read per FLOP; a tie goes to more warps along rows (fewer A fragments held per
    warp, the register-lighter side). No split covers the block: the warps along rows that the
    block's rows allow, which tile_problems reports."""
    best: tuple[int, int] | None = None
    for r in (1, 2, 4, 8):
        c = warps // r
        if r * c != warps or rows % (16 * r) or cols % (16 * c):
            continue
        if (
            best is None
            or rows // r + cols // c < rows // best[0] + cols // best[1]
            or (rows // r + cols // c == rows // best[0] + cols // best[1] and r > best[0])
        ):
            best = (r, c)
    if best is None:
        r = max(1, min(warps, rows // 16))
        return r, warps // r
    return best


def warp_layouts(
    tile: Tile, head_dim: int, head_dim_v: int | None = None
) -> dict[str, tuple[int, int]]:
    """How the warps tile each stage: (warps along rows, warps along columns).

    S/dP: query rows x keys of the (block_m x block_n) score tile; dKV: keys x head dim of
    dK and dV; dQ: query rows x head dim. The kernel takes the row counts as constants
    (kSRows, kKvRows, kQRows) and static_asserts that each layout covers its output.
    Beyond d = 128 the square tiles' extra A fragments spill next to the wide dK/dV
    accumulators (measured on sm_90): there every stage keeps v1's layout, as many warps along
    rows as the rows allow (16-row warp tiles). With d_v != d (`head_dim_v`), dK has d
    columns and dV d_v in one (keys, head dim) layout: the threshold is the larger dim's, and
    the dK/dV split is that of their greatest common divisor, whose warp columns divide both
    (tile_problems checks each).
    """
    d_v = head_dim if head_dim_v is None else head_dim_v
    w, d_qk, d_vo = tile.warps, chip_head_dim(head_dim), chip_head_dim(d_v)
    if max(d_qk, d_vo) > SQUARE_WARP_TILES_MAX_D:
        rows = {"s": tile.block_m, "kv": tile.block_n, "q": tile.block_m}
        return {k: (r, w // r) for k, r in ((k, max(1, min(w, v // 16))) for k, v in rows.items())}
    return {
        "s": _split(w, tile.block_m, tile.block_n),
        "kv": _split(w, tile.block_n, math.gcd(d_qk, d_vo)),
        "q": _split(w, tile.block_m, d_qk),
    }


def tile_problems(
    tile: Tile, head_dim: int, head_dim_v: int | None = None
) -> list[tuple[str, str]]:
    out = tile.type_problems()
    if out:
        return out
    if tile.warps not in TILE_WARPS:
        out.append(("tile.warps", f"{tile.warps} is not allowed (allowed: 4, 8)"))
    for fld, v in (("block_m", tile.block_m), ("block_n", tile.block_n)):
        if not (16 <= v <= 128 and v % 16 == 0):
            out.append((f"tile.{fld}", f"{v} is not allowed (allowed: multiples of 16 in 16..128)"))
    if tile.stages not in TILE_STAGES:
        out.append(("tile.stages", f"{tile.stages} is not allowed (allowed: 1, 2)"))
    if out:
        return out
    d_v = head_dim if head_dim_v is None else head_dim_v
    lay = warp_layouts(tile, head_dim, d_v)
    s_rows, s_cols = lay["s"]
    if (
        s_rows * s_cols != tile.warps
        or tile.block_m % (16 * s_rows)
        or tile.block_n % (16 * s_cols)
    ):
        out.append(
            (
                "tile",
                f"{tile.short}: the {tile.block_m} x {tile.block_n} score tile does not split "
                f"into {s_rows} x {s_cols} warp tiles of whole 16 x 16 blocks",
            )
        )
    kv_what = "dK/dV" if d_v == head_dim else "dK"
    stages = [
        ("kv", kv_what, tile.block_n, "head_dim", head_dim),
        ("q", "dQ", tile.block_m, "head_dim", head_dim),
    ]
    if d_v != head_dim:
        stages.insert(1, ("kv", "dV", tile.block_n, "head_dim_v", d_v))
    for stage, what, rows_of, dim_name, dim in stages:
        rows, cols = lay[stage]
        d_chip = chip_head_dim(dim)
        if rows * cols != tile.warps or rows_of % (16 * rows) or d_chip % (16 * cols):
            on_chip = f" ({d_chip} on chip)" if d_chip != dim else ""
            cols_of = f"{dim_name} {dim}{on_chip}"
            out.append(
                (
                    "tile",
                    f"{tile.short}: {what} ({rows_of} rows x {cols_of}) does not split "
                    f"into {rows} x {cols} warp tiles of whole 16-row, 16-column blocks; use "
                    "block sizes of 16 * (a multiple of the warp rows), warps: 4, or another "
                    "head_dim",
                )
            )
    return out


def p_scratch(tile: Tile, head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether P waits in an fp32 shared-memory scratch while dP is computed, instead of in
    registers. The step's register peak is the dK/dV accumulators (2 * block_n * head_dim
    per CTA, kept over the whole walk) plus S and dP (block_m * block_n each); per thread
    beyond PEAK_ACC_REGS accumulators, ptxas spills (measured on sm_90, docs/benchmarks.md
    "Backward v2"). The scratch costs block_m * block_n * 8 bytes of shared traffic a step."""
    threads = 32 * tile.warps
    d_v = head_dim if head_dim_v is None else head_dim_v
    kv_acc = tile.block_n * (chip_head_dim(head_dim) + chip_head_dim(d_v)) // threads
    s_acc = tile.block_m * tile.block_n // threads
    return kv_acc + 2 * s_acc > PEAK_ACC_REGS


def smem_bytes(tile: Tile, head_dim: int, dtype: Dtype, head_dim_v: int | None = None) -> int:
    """K and `stages` Q tiles of d (`head_dim`) columns, V and `stages` dO tiles of d_v
    (`head_dim_v`, default d), rows padded; P and dS (block_m x block_n, padded); `stages` x
    (LSE, D) fp32 rows; the fp32 P scratch (block_m x block_n) when p_scratch."""
    d_v = head_dim if head_dim_v is None else head_dim_v
    rows = tile.block_n + tile.stages * tile.block_m  # of each of (K, Q) and (V, dO)
    stride_qk = chip_head_dim(head_dim) + SMEM_ROW_PAD
    stride_vo = chip_head_dim(d_v) + SMEM_ROW_PAD
    tiles = rows * (stride_qk + stride_vo) * dtype.nbytes
    p_ds = 2 * tile.block_m * (tile.block_n + SMEM_ROW_PAD) * dtype.nbytes
    scratch = tile.block_m * tile.block_n * 4 if p_scratch(tile, head_dim, d_v) else 0
    return tiles + p_ds + 2 * tile.stages * tile.block_m * 4 + scratch


def default_tile(
    head_dim: int,
    dropout: bool = False,
    heavy: bool = False,
    masked: bool = False,
    deterministic: bool = False,
    scoremod: bool = False,
    split_v: bool = False,
) -> Tile:
    """The fastest predicted tiles that compile without spills on sm_90, measured with ptxas
    (docs/benchmarks.md, "Backward v1" and "Backward v2"). 128 keys per CTA halve the Q/dO
    reloads and dQ atomics per FLOP against 64; the dK/dV accumulators for 128 keys x d take
    2 * 128 * d / threads registers a thread, so from d = 96 the 128-key tile pairs with 32
    query rows a step (S/dP and dQ shrink instead) at d = 128, and the register-heavy
    features (`heavy`: dropout's Philox state, deterministic ordering, block sparsity, IO
    counters, the score modifiers; they spill there) keep 64 x 64. At d = 192 the heavy and
    the masked (window, varlen, GQA) features spilled 12-88 bytes with 64 x 64 and compile
    clean with 64 x 32 (both measured with ptxas 13.0 on sm_90). d = 256 keeps 64 keys and
    32 query rows, but for `deterministic` (24 bytes of spill there; 64 x 32 is clean). A head
    dim runs on `chip_head_dim` columns and takes that dim's tile. `head_dim` is max(d, d_v);
    with d_v != d (`split_v`) at 192 columns every spec takes 64 x 32 (d 192 / d_v 128 with a
    causal mask spilled 4 bytes at 64 x 64 x 8 s2 with ptxas 13.0, sm_90, and is clean at
    64 x 32; d 192 / d_v 128 is the only pair measured)."""
    head_dim = chip_head_dim(head_dim)
    if head_dim % 32:
        return Tile(64, 64, 4, 2)
    if head_dim <= 64 and not (dropout or scoremod):
        return Tile(64, 128, 8, 2)
    if head_dim == 128 and not (dropout or heavy):
        return Tile(32, 128, 8, 2)
    if head_dim == 192 and (dropout or heavy or masked or split_v):
        return Tile(64, 32, 8, 2)
    if head_dim <= 192:
        return Tile(64, 64, 8, 2)
    if deterministic and not dropout:
        return Tile(64, 32, 8, 2)
    return Tile(32, 64, 8, 2)


def fit(
    tile: Tile, target: Target, dtype: Dtype, head_dim: int, head_dim_v: int | None = None
) -> Tile:
    """Shrink until the tile fits the target: one stage, then block_n 64, then block_m 32."""
    candidates = [
        tile,
        Tile(tile.block_m, tile.block_n, tile.warps, 1),
        Tile(tile.block_m, min(tile.block_n, 64), tile.warps, 1),
        Tile(min(tile.block_m, 32), min(tile.block_n, 64), 4, 1),
        Tile(32, 32, 4, 1),
    ]
    for t in candidates:
        if (
            not tile_problems(t, head_dim, head_dim_v)
            and smem_bytes(t, head_dim, dtype, head_dim_v) <= target.info.max_smem_per_block
        ):
            return t
    return candidates[-1]  # reported by validation


class Backward(Family):
    kind = KernelKind.BACKWARD
    templates = "backward"
    params_struct = "fg_bwd_params"
    params_header = "bwd_params.h"
    params = PARAMS
    io_keys = IO_KEYS
    io_header = "bwd_kernel.cuh"
    io_enum = "IoTensor"
    io_model = "flashgen.verify.io_model_bwd:backward_bytes"
    serves_head_dim_v = True

    def head_dim_ok(self, head_dim: Any) -> bool:
        return head_dim in HEAD_DIMS

    def chip_head_dim(self, head_dim: int) -> int:
        return chip_head_dim(head_dim)

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if spec.target.value.suffix:
            out.append(
                (
                    "target",
                    f"{spec.target.yaml} has no backward yet (allowed: sm_80, sm_86, sm_89, sm_90)",
                )
            )
        if not self.head_dim_ok(spec.head_dim):
            out.append(
                (
                    "head_dim",
                    f"{spec.head_dim} is not allowed (allowed: multiples of 8 in 8..256)",
                )
            )
            return out
        if spec.deterministic and spec.sparse:
            out.append(
                (
                    "deterministic",
                    "true is not implemented with sparsity: block yet (the ordered dQ adds "
                    "follow the dense schedule); allowed: false, or sparsity: none",
                )
            )
        tile = tile_problems(spec.tile, spec.head_dim, spec.head_dim_vo)
        out.extend(tile)
        if not out:
            out.extend(
                self.smem_problem(
                    spec,
                    f"(block_n + stages*block_m) * (chip(head_dim) + chip(head_dim_v) + "
                    f"{2 * SMEM_ROW_PAD}) * {spec.dtype.nbytes} + 2*block_m*(block_n + "
                    f"{SMEM_ROW_PAD})*{spec.dtype.nbytes} + 8*stages*block_m"
                    + (
                        " + 4*block_m*block_n (P scratch)"
                        if p_scratch(spec.tile, spec.head_dim, spec.head_dim_vo)
                        else ""
                    ),
                )
            )
        return out

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(spec.tile, spec.head_dim, spec.dtype, spec.head_dim_vo)

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        # the score stage's registers: a built-in modifier, or a score_mod (its positions,
        # parameters and derivative beside the scores)
        # (or a mask_mod's per-element test)
        scoremod = (
            any(values.get(f.name) for f in FEATURES)
            or values.get("score_mod") is not None
            or values.get("mask_mod") is not None
        )
        heavy = bool(
            values.get("dropout")
            or values.get("deterministic")
            or values.get("instrument_io")
            or values.get("sparsity", Sparsity.NONE) != Sparsity.NONE
            or scoremod
        )
        masked = bool(values.get("mask.window") or values.get("mask.varlen") or values.get("gqa"))
        tile = default_tile(
            head_dim,
            bool(values.get("dropout")),
            heavy,
            masked,
            deterministic=bool(values.get("deterministic")),
            scoremod=scoremod,
            split_v=values.get("head_dim_v") not in (None, values.get("head_dim")),
        )
        # `head_dim` is max(d, d_v) (the loader's); the fit checks the spec's own two
        d = values.get("head_dim", head_dim)
        d_v = values.get("head_dim_v")
        return fit(tile, target, dtype, d, d_v)

    def config(self, spec: KernelSpec) -> dict[str, Any]:
        t = spec.tile
        lay = warp_layouts(t, spec.head_dim, spec.head_dim_vo)
        return {
            **self.spec_config(spec),
            "deterministic": spec.deterministic,
            "s_rows": lay["s"][0],
            "kv_rows": lay["kv"][0],
            "q_rows": lay["q"][0],
            "p_scratch": p_scratch(t, spec.head_dim, spec.head_dim_vo),
            # CTAs per SM the register allocation aims for: two when two fit in shared memory
            # and the tile is small enough (<= 64 x 64, d <= 64, no dropout: measured to fit
            # 128 registers; with dropout's Philox state it spills) for 128 per thread.
            "min_blocks": 2
            if 2 * spec.smem_bytes <= spec.target.info.max_smem_per_block
            and t.block_m * t.block_n <= 64 * 64
            and spec.head_dim_max <= 64
            and not spec.dropout
            and not spec.features  # the score stage spilled at 128 registers (d 64)
            and spec.score_mod is None
            and spec.mask_mod is None
            else 1,
        }

    def entry_points(self, name: str) -> dict[str, str]:
        return {
            "kernel": f"{name}_kernel",
            "preprocess": f"{name}_preprocess",
            "convert": f"{name}_convert_dq",
            "workspace": f"{name}_workspace_bytes",
            "check": f"{name}_check",
            "launch": f"{name}_launch",
        }

    def launch_info(self, spec: KernelSpec) -> dict[str, Any]:
        return {"threads": spec.threads, "block_n": spec.tile.block_n, "grid": GRID_FORMULA}


FAMILY = Backward()
