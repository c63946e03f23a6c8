"""The decode family (`kernel: decode`): FlashDecoding over a contiguous or paged KV cache.

Each of `batch` sequences brings `seqlen_q` (runtime, 1..16) new queries and a KV cache of
`cache_seqlens[b]` keys that already includes them. A CTA packs the queries of every query
head of one KV head's GQA group into the rows of the MMA (`block_m` rows: 16 per warp row),
so each K/V byte is read once per KV head; the key tiles are split across CTAs (split-KV),
whose normalised fp32 outputs and LSEs a combine kernel merges (also exported as
`<name>_merge_states`). docs/decode.md has the layouts, the split heuristic and the bad-input
policy.

Tile rules: `block_m` = 16 * (warps along the rows), a power of two dividing `warps`;
the other warps split each K/V tile's `block_n` keys, 16 or more each; `stages` (2..4) K/V
tiles in flight; a tile's rows load in whole passes of the CTA (`block_n * d / 8` a multiple
of the threads), which lets the page ids of a paged tile travel by warp shuffles, and each
thread copies whole K/V rows (`2 * block_n` a multiple of the threads: the bulk row copies). Shared
memory: the Q rows (padded by SMEM_ROW_PAD elements) plus `stages` K and V tiles, or the
end-of-loop merge buffer of the key warps when that is larger; K/V rows of contiguous caches
are unpadded and XOR-swizzled when head_dim is a multiple of 64 (`swizzled`), padded like Q
otherwise (paged caches: bulk row copies; smaller head dims).
"""

from __future__ import annotations

from typing import Any

from flashgen.generator.families import (
    SCORE_PARAM_FIELDS,
    SHAPE_PARAM_FIELDS,
    Family,
    params_table,
)
from flashgen.generator.spec import (
    Causal,
    Dtype,
    KernelKind,
    KernelSpec,
    KvDtype,
    Target,
    Tile,
)
from flashgen.generator.tiles import mma_head_dim

# Every multiple of 8 up to 192; 8 * odd runs on the next multiple of 16 on chip
# (tiles.mma_head_dim), zero-filled there and never padded in HBM. Not yet beyond 192: a warp
# holds its 16 rows' whole O accumulator (d / 2 floats a thread), and with the load addresses
# ptxas 13.0 spills from d = 200 (sm_80, paged with the score modifiers: 152 bytes) and at
# 248 / 256 (144 bytes); that needs the head dim split across the warps of P V.
HEAD_DIMS = tuple(range(8, 193, 8))
TILE_WARPS = (2, 4, 8)
TILE_STAGES = (2, 3, 4)
SMEM_ROW_PAD = 8
MERGE_ROW_PAD = 4  # floats
MAX_QUERIES = 16
MAX_SPLITS = 128
PAGE_SIZES = (16, 32, 64, 128, 256)
WORKSPACE_HEADER = 256  # bytes: the error word, padded
ERR_PAGE_ID = 1
ERR_SEQLEN = 2

# fg_decode_params (include/flashgen/decode_params.h), in declaration order.
PARAMS = (
    params_table(
        """
    ptr q
    ptr k
    ptr v
    ptr o
    ptr lse
    ptr cache_seqlens
    ptr block_table
    ptr workspace
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
    i64 max_seqlen_k
    i64 page_size
    i64 num_pages
    i64 max_pages
    i64 block_table_stride
    f64 softmax_scale
    i64 window_left
    i64 window_right
    i64 num_splits
    i64 workspace_size
    ptr o_parts
    ptr lse_parts
    i64 num_parts
    i64 parts_dtype
    i64 o_parts_part_stride
    i64 o_parts_batch_stride
    i64 o_parts_row_stride
    i64 o_parts_head_stride
    i64 lse_parts_part_stride
    i64 lse_parts_batch_stride
    i64 lse_parts_head_stride
    ptr io_counters
    # FP8 caches (kv_dtype): fp32 descales (batch, kv_heads), strides in elements (0 for a
    # per-tensor scalar broadcast); NULL without kv_dtype
    ptr k_descale
    ptr v_descale
    i64 k_descale_batch_stride
    i64 k_descale_head_stride
    i64 v_descale_batch_stride
    i64 v_descale_head_stride
    """
    )
    + SCORE_PARAM_FIELDS
    + SHAPE_PARAM_FIELDS
    # 1: a bad device value also traps (a device-side assert); flashgen.torch's default
    + params_table("i64 trap_on_error")
)
IO_KEYS = ("Q", "K", "V", "O", "LSE", "O_PARTS", "LSE_PARTS", "SEQLENS", "BLOCK_TABLE")
GRID_FORMULA = "ceil(seqlen_q*heads/kv_heads/block_m) * splits * kv_heads * batch (+ combine)"


def warp_layout(tile: Tile) -> tuple[int, int]:
    """(warps along the rows, warps along the keys of a K/V tile)."""
    wm = max(tile.block_m // 16, 1)
    return wm, max(tile.warps // wm, 1)


def tile_problems(tile: Tile, head_dim: int) -> list[tuple[str, str]]:
    out = tile.type_problems()
    if out:
        return out
    if tile.warps not in TILE_WARPS:
        out.append(("tile.warps", f"{tile.warps} is not allowed (allowed: 2, 4, 8)"))
    if tile.stages not in TILE_STAGES:
        out.append(("tile.stages", f"{tile.stages} is not allowed (allowed: 2, 3, 4)"))
    rows_ok = [16 * w for w in (1, 2, 4, 8) if tile.warps in TILE_WARPS and tile.warps % w == 0]
    if tile.block_m not in rows_ok:
        out.append(
            (
                "tile.block_m",
                f"{tile.block_m} does not fit {tile.warps} warps: 16 rows per warp row, and the "
                f"warp rows must divide the warps (allowed: {', '.join(map(str, rows_ok))})",
            )
        )
    if not (16 <= tile.block_n <= 256 and tile.block_n & (tile.block_n - 1) == 0):
        out.append(("tile.block_n", f"{tile.block_n} is not allowed (allowed: 16, 32, ..., 256)"))
    if out:
        return out
    _, wn = warp_layout(tile)
    if tile.block_n % (16 * wn):
        out.append(
            (
                "tile",
                f"{tile.short}: {wn} warps along the keys need block_n a multiple of {16 * wn} "
                "(16 keys or more each)",
            )
        )
    elif (tile.block_n * mma_head_dim(head_dim) // 8) % tile.threads:
        out.append(
            (
                "tile",
                f"{tile.short}: a {tile.block_n}-key tile of head_dim {head_dim} is "
                f"{tile.block_n * mma_head_dim(head_dim) // 8} 16-byte chunks in shared "
                "memory, not a multiple of "
                f"{tile.threads} threads (whole load passes keep the page shuffles converged)",
            )
        )
    elif (2 * tile.block_n) % tile.threads:
        # DecConfig's static_assert: the bulk row copies (paged caches on sm_90) give each
        # thread whole K/V rows; the kernel asserts it for every decode build.
        out.append(
            (
                "tile",
                f"{tile.short}: the {2 * tile.block_n} K and V rows of a tile must be a multiple "
                f"of {tile.threads} threads (whole rows per thread for the bulk row copies)",
            )
        )
    return out


def kv_dtype_problems(spec: KernelSpec) -> list[tuple[str, str]]:
    """What an FP8 cache (`kv_dtype: e4m3`) needs: a target with the e4m3 conversions
    (`cvt.rn.f16x2.e4m3x2`, PTX on sm_89 and later) and rows of whole 16-byte chunks."""
    kv = spec.kv_dtype
    if kv is None:
        return []
    out = []
    if spec.target.cc < kv.min_cc:
        allowed = ", ".join(t.yaml for t in Target if t.cc >= kv.min_cc and not t.value.suffix)
        out.append(
            (
                "kv_dtype",
                f"{kv.yaml} needs the FP8 conversions of sm_{kv.min_cc} and later; target "
                f"{spec.target.yaml} has none (allowed targets for kv_dtype {kv.yaml}: {allowed}; "
                f"or omit kv_dtype for a {spec.dtype.yaml} cache)",
            )
        )
    if spec.head_dim % 16:
        out.append(
            (
                "head_dim",
                f"{spec.head_dim} is not allowed with kv_dtype {kv.yaml}: FP8 rows load in "
                "16-byte chunks (allowed: multiples of 16 in 16..192)",
            )
        )
    elif (spec.tile.block_n * spec.head_dim // 16) % spec.tile.threads:
        # DecConfig's static_assert: whole load passes keep the page shuffles converged
        out.append(
            (
                "tile",
                f"{spec.tile.short}: a {spec.tile.block_n}-key FP8 tile of head_dim "
                f"{spec.head_dim} is {spec.tile.block_n * spec.head_dim // 16} 16-byte chunks, "
                f"not a multiple of {spec.tile.threads} threads (take more keys or fewer warps)",
            )
        )
    return out


def swizzled(head_dim: int, paged: bool) -> bool:
    """K/V rows unpadded with XOR-swizzled 16-byte chunks (DecConfig::kSwizzle)."""
    return not paged and head_dim % 64 == 0


def smem_bytes(tile: Tile, head_dim: int, dtype: Dtype, paged: bool, kv_fp8: bool = False) -> int:
    """Q rows plus `stages` K and V tiles, or the key warps' merge buffer. FP8 caches
    (`kv_fp8`): the tiles are e4m3 bytes in unpadded rows, read into registers
    (DecConfig::kTileBytes)."""
    d = mma_head_dim(head_dim)
    kv_row = d if swizzled(head_dim, paged) else d + SMEM_ROW_PAD
    kv_row_bytes = head_dim if kv_fp8 else kv_row * dtype.nbytes
    tiles = tile.block_m * (d + SMEM_ROW_PAD) * dtype.nbytes
    tiles += 2 * tile.stages * tile.block_n * kv_row_bytes
    _, wn = warp_layout(tile)
    merge = wn * tile.block_m * (d + MERGE_ROW_PAD + 2) * 4
    return max(tiles, merge)


def default_tile(head_dim: int) -> Tile:
    """16 rows (one query of a group of up to 16 heads), four warps splitting each tile's keys,
    32 KB of K and V per tile and three stages: about 100 KB of shared memory, two CTAs per
    H100/H200 SM and up to four tiles (128 KB) in flight per SM, which a memory-bound loop
    needs to cover HBM latency. So block_n is the power of two nearest 8192 / d (d on chip),
    in 32..256: d = 32 -> 256 keys, 64 -> 128, 128 -> 64, 192 -> 32. The warps split the
    keys 16 or more each: two warps below 64 keys."""
    d = mma_head_dim(head_dim)
    block_n = 256
    while block_n > 32 and block_n * d > 8192 * 1.5:
        block_n //= 2
    return Tile(16, block_n, min(4, block_n // 16), 3)


def fit(
    tile: Tile, target: Target, dtype: Dtype, head_dim: int, paged: bool, kv_fp8: bool = False
) -> Tile:
    """Fewer stages until the tile fits the target's shared memory, then half the keys (and
    two warps below 64 keys), down to 32 keys."""
    block_n = tile.block_n
    while True:
        warps = tile.warps if block_n >= 16 * tile.warps else min(tile.warps, block_n // 16)
        for stages in range(tile.stages, 1, -1):
            t = Tile(tile.block_m, block_n, warps, stages)
            if smem_bytes(t, head_dim, dtype, paged, kv_fp8) <= target.info.max_smem_per_block:
                return t
        if block_n <= 32:
            return Tile(tile.block_m, block_n, warps, 2)  # reported by validation
        block_n //= 2


def num_splits(ctas: int, key_tiles: int, sms: int, slots: int, ctas_per_sm: int = 1) -> int:
    """The split heuristic (mirror of `fg::decode_num_splits`, decode_launch.cuh).

    `ctas` = row tiles x kv_heads x batch, `key_tiles` = ceil(max cache length / block_n),
    `sms` the device's SMs, `slots` the CTAs of the kernel it holds at once, `ctas_per_sm`
    the target per SM (0: every slot; `split_ctas_per_sm` gives a kernel's). No split when
    the CTAs already fill 80% of the target; else as many splits as reach it, at most 128 and
    the key tiles (docs/benchmarks.md, Decode v3 and FP8 decode v3)."""
    if ctas <= 0 or key_tiles <= 1 or sms <= 0 or slots <= 0 or ctas_per_sm < 0:
        return 1
    target = slots if ctas_per_sm == 0 or slots < ctas_per_sm * sms else ctas_per_sm * sms
    if ctas * 5 >= target * 4:
        return 1
    return max(1, min(target // ctas, key_tiles, MAX_SPLITS))


def split_ctas_per_sm(paged: bool, kv_fp8: bool) -> int:
    """The heuristic's CTAs per SM (mirror of `fg::decode_split_ctas_per_sm`): every slot
    for paged caches (0), two for contiguous FP8 caches, one for contiguous 16-bit ones."""
    return 0 if paged else 2 if kv_fp8 else 1


def split_tiles(lo: int, hi: int, splits: int, split: int) -> tuple[int, int]:
    """The key tiles [a, b) split `split` of `splits` takes of a schedule [lo, hi)."""
    per = -(-max(hi - lo, 0) // splits)
    a = lo + split * per
    return a, max(a, min(a + per, hi))


def workspace_bytes(batch: int, heads: int, seqlen_q: int, head_dim: int, splits: int) -> int:
    """Mirror of `fg::decode_workspace_bytes`: the error word's 256 bytes, then (splits > 1)
    the fp32 O and LSE parts, each rounded up to 256 bytes."""

    def r256(n: int) -> int:
        return -(-n // 256) * 256

    if splits <= 1:
        return WORKSPACE_HEADER
    return (
        WORKSPACE_HEADER
        + r256(splits * batch * seqlen_q * heads * head_dim * 4)
        + r256(splits * batch * heads * seqlen_q * 4)
    )


class Decode(Family):
    kind = KernelKind.DECODE
    templates = "decode"
    # Not built: a warp holds its rows' whole O accumulator and the split-KV combine, the
    # paged cache and flashgen.torch's KV-cache path all take one head dim (docs/decode.md).
    head_dim_v_refusal = "head_dim_v = head_dim only; decode has one head dim for K, V and O"
    params_struct = "fg_decode_params"
    params_header = "decode_params.h"
    params = PARAMS
    io_keys = IO_KEYS
    io_header = "decode_kernel.cuh"
    io_enum = "IoTensor"
    io_model = "flashgen.verify.io_model_decode:decode_bytes"

    def head_dim_ok(self, head_dim: Any) -> bool:
        return head_dim in HEAD_DIMS

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if spec.target.value.suffix:
            out.append(
                (
                    "target",
                    f"{spec.target.yaml} has no decode (its wgmma families serve the forward and "
                    "the backward); the mma.sync decode serves sm_80, sm_86, sm_89, sm_90",
                )
            )
        if not self.head_dim_ok(spec.head_dim):
            out.append(
                (
                    "head_dim",
                    f"{spec.head_dim} is not allowed (allowed: multiples of 8 in 8..192)",
                )
            )
            return out
        if spec.mask.causal is Causal.TOP_LEFT:
            out.append(
                (
                    "mask.causal",
                    "top_left is not allowed: the new queries are the last ones of the cache "
                    "(allowed: none, bottom_right)",
                )
            )
        if spec.mask.varlen:
            out.append(
                (
                    "mask.varlen",
                    "true is not allowed: decode takes per-sequence lengths (cache_seqlens) "
                    "always (allowed: false)",
                )
            )
        for fld, on in (("dropout", spec.dropout), ("sparsity", spec.sparse)):
            if on:
                out.append((fld, "is not supported by decode kernels (allowed: off)"))
        out.extend(kv_dtype_problems(spec))
        tile = tile_problems(spec.tile, spec.head_dim)
        out.extend(tile)
        if not out:
            kv_pad = "" if swizzled(spec.head_dim, spec.paged) else f" + {SMEM_ROW_PAD}"
            fp8 = spec.kv_dtype is KvDtype.E4M3
            slots = "1" if fp8 else "stages"
            ring = " + 2*stages*block_n*head_dim" if fp8 else ""
            out.extend(
                self.smem_problem(
                    spec,
                    f"max((block_m * (head_dim + {SMEM_ROW_PAD}) + 2*{slots}*block_n * "
                    f"(head_dim{kv_pad})) * {spec.dtype.nbytes}{ring}, key warps * block_m * "
                    f"(head_dim + {MERGE_ROW_PAD + 2}) * 4)",
                )
            )
        return out

    def smem_bytes(self, spec: KernelSpec) -> int:
        return smem_bytes(
            spec.tile, spec.head_dim, spec.dtype, spec.paged, spec.kv_dtype is KvDtype.E4M3
        )

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        fp8 = values.get("kv_dtype") is KvDtype.E4M3
        tile = default_tile(head_dim)
        if fp8:  # an e4m3 tile is half the bytes: one stage more keeps more of them in flight
            tile = Tile(tile.block_m, tile.block_n, tile.warps, tile.stages + 1)
            while tile.warps > 2 and (tile.block_n * head_dim // 16) % (32 * tile.warps):
                tile = Tile(tile.block_m, tile.block_n, tile.warps // 2, tile.stages)
        return fit(tile, target, dtype, head_dim, bool(values.get("paged")), fp8)

    def config(self, spec: KernelSpec) -> dict[str, Any]:
        return {
            **self.spec_config(spec),
            "varlen": False,  # decode's lengths are cache_seqlens, not cu_seqlens
            "dropout": False,
            "debug_keep_mask": False,
            "sparse": False,
            "paged": spec.paged,
            "kv_fp8": spec.kv_dtype is KvDtype.E4M3,
            "reference_sms": spec.target.info.sm_count,
        }

    def entry_points(self, name: str) -> dict[str, str]:
        return {
            "kernel": f"{name}_kernel",
            "combine": f"{name}_combine",
            "combine_elem": f"{name}_combine_elem",
            "check": f"{name}_check",
            "workspace": f"{name}_workspace_bytes",
            "num_splits": f"{name}_num_splits",
            "launch": f"{name}_launch",
            "merge_check": f"{name}_merge_check",
            "merge_states": f"{name}_merge_states",
        }

    def launch_info(self, spec: KernelSpec) -> dict[str, Any]:
        return {
            "threads": spec.threads,
            "block_m": spec.tile.block_m,
            "block_n": spec.tile.block_n,
            "grid": GRID_FORMULA,
        }


FAMILY = Decode()
