"""Exact HBM bytes of one decode call (what `instrument_io` decode builds count), per counter.

Rules (templates/include/flashgen/decode_kernel.cuh; docs/decode.md), with `group = heads /
kv_heads`, `rows = seqlen_q * group`, `bm`, `bn` the tile's block_m / block_n, `elt` 2:

Main kernel, per CTA (row tile mt, split s, KV head, sequence b) of the grid
`ceil(rows / bm) x splits x kv_heads x batch`:
- SEQLENS: 4 (its sequence's cache_seqlens entry).
- rows of the CTA: `valid = min(bm, rows - mt*bm)`, queries `q_lo = mt*bm // group` ..
  `q_hi = (mt*bm + valid - 1) // group`; `sk` = cache_seqlens[b] (clamped to the capacity).
- key tiles: the mask's range for queries [q_lo, q_hi] (docs/conventions.md, "Tile
  schedule", with `shift = sk - seqlen_q`), cut into `splits` runs of `per = ceil(count /
  splits)`; the CTA takes run s, tiles [a, b); `used = ceil(count / per)` runs hold a tile.
- a CTA with s >= max(used, 1) reads its SEQLENS entry and nothing else.
- when it has a tile: Q `valid * d * elt`; K and V `(min(b*bn, sk) - a*bn) * d * elt` each;
  paged: BLOCK_TABLE 4 bytes per page of each tile that holds a key below sk.
- used <= 1 (split 0 holds every tile, or there is none): O `valid * d * elt` and, when an
  LSE is asked for, LSE `valid * 4`.
- used > 1, each of the used CTAs: O_PARTS `valid * d * 4` and LSE_PARTS `valid * 4`
  written, COUNTER 8 (its arrival: an atomic, 4 bytes read and 4 written); the last to arrive
  then reads every used split's parts, LSE_PARTS `used * valid * 4` and O_PARTS
  `used * valid * d * 4` (the fused combine), and writes O `valid * d * elt` and LSE
  `valid * 4` when asked for.

There is no combine kernel in a decode call (merge_states is its own op).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flashgen.generator.families.decode import IO_KEYS, split_tiles, used_splits
from flashgen.verify.io_model import standard_attention_bytes

__all__ = ["IO_KEYS", "decode_bytes", "key_tile_range", "standard_attention_bytes"]


def _mask_bounds(causal: str, window: Sequence[int], sq: int, sk: int) -> tuple[int, int, int]:
    """(shift, left, right) as the kernel's MaskPolicy holds them (-1: unbounded)."""
    shift = sk - sq  # decode: bottom_right (a window without causal is bottom_right too)
    left, right = (int(x) for x in window)
    left = min(left, sq + sk) if left >= 0 else -1
    right = min(right, sq + sk) if right >= 0 else -1
    return shift, left, right


def key_tile_range(
    causal: str, window: Sequence[int], sq: int, sk: int, r0: int, r1: int, bn: int
) -> tuple[int, int]:
    """The K/V tiles [n_lo, n_hi) that can hold a key visible from queries [r0, r1]."""
    shift, left, right = _mask_bounds(causal, window, sq, sk)
    n_lo, n_hi = 0, -(-sk // bn)
    if causal != "none":
        n_hi = min(n_hi, (r1 + shift) // bn + 1)
    if right >= 0:
        n_hi = min(n_hi, (r1 + shift + right) // bn + 1)
    if left >= 0:
        n_lo = max(n_lo, (r0 + shift - left) // bn)
    return n_lo, n_hi


def decode_bytes(
    spec: Any,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    cache_seqlens: Sequence[int] | None = None,
    window: Sequence[int] = (-1, -1),
    page_size: int | None = None,
    num_splits: int = 1,
    lse: bool = True,
) -> dict[str, int]:
    """Predicted bytes per counter (IO_KEYS order) and 'total'.

    `seqlen_k` is the cache length used when `cache_seqlens` (one per sequence) is not given
    (`flashgen show`); lengths are clamped to the capacity as the kernel does only when
    `cache_seqlens` is given, so pass valid ones. Paged specs need `page_size`
    (default 16).
    """
    d, elt = spec.head_dim, spec.dtype.nbytes
    bm, bn = spec.tile.block_m, spec.tile.block_n
    causal = spec.mask.causal.yaml
    if not spec.mask.window:
        window = (-1, -1)
    lens = [int(seqlen_k)] * batch if cache_seqlens is None else [int(x) for x in cache_seqlens]
    group = heads // kv_heads
    rows = seqlen_q * group
    num_mt = -(-rows // bm)
    ps = int(page_size or 16)
    splits = int(num_splits)
    out = dict.fromkeys(IO_KEYS, 0)
    for b in range(batch):
        sk = max(lens[b], 0)
        for mt in range(num_mt):
            m0 = mt * bm
            valid = min(bm, rows - m0)
            q_lo, q_hi = m0 // group, (m0 + valid - 1) // group
            n_lo, n_hi = key_tile_range(causal, window, seqlen_q, sk, q_lo, q_hi, bn)
            used = used_splits(n_lo, n_hi, splits)
            per_head = dict.fromkeys(IO_KEYS, 0)
            for s in range(splits):
                per_head["SEQLENS"] += 4
                if s >= max(used, 1):
                    continue  # no tile: the CTA exits after reading its length
                a, e = split_tiles(n_lo, n_hi, splits, s)
                if e > a:
                    keys = min(e * bn, sk) - a * bn
                    per_head["Q"] += valid * d * elt
                    per_head["K"] += keys * d * elt
                    per_head["V"] += keys * d * elt
                    if spec.paged:
                        if ps >= bn:
                            per_head["BLOCK_TABLE"] += 4 * (e - a)
                        else:
                            ppt = bn // ps
                            pages = min(e * ppt, -(-sk // ps)) - a * ppt
                            per_head["BLOCK_TABLE"] += 4 * max(pages, 0)
                if used > 1:
                    per_head["O_PARTS"] += valid * d * 4
                    per_head["LSE_PARTS"] += valid * 4
                    per_head["COUNTER"] += 8
            if used > 1:  # the fused combine of the last CTA to arrive
                per_head["O_PARTS"] += used * valid * d * 4
                per_head["LSE_PARTS"] += used * valid * 4
            per_head["O"] += valid * d * elt
            per_head["LSE"] += valid * 4 if lse else 0
            for key, n in per_head.items():
                out[key] += n * kv_heads
    out = {k: int(v) for k, v in out.items()}
    out["total"] = int(np.sum(list(out.values())))
    return out
