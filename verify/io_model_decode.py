"""Exact HBM bytes of one decode call (what `instrument_io` decode builds count), per counter.

Rules (templates/include/flashgen/decode_kernel.cuh; docs/decode.md), with `group = heads /
kv_heads`, `rows = seqlen_q * group`, `bm`, `bn` the tile's block_m / block_n, `elt` 2:

Main kernel, per CTA (row tile mt, split s, KV head, sequence b) of the grid
`ceil(rows / bm) x splits x kv_heads x batch`:
- SEQLENS: 4 (its sequence's cache_seqlens entry); FP8 caches: 8 more (its (b, KV head)'s
  k_descale and v_descale, counted in decode's meta counter like the score features' reads).
- rows of the CTA: `valid = min(bm, rows - mt*bm)`, queries `q_lo = mt*bm // group` ..
  `q_hi = (mt*bm + valid - 1) // group`; `sk` = cache_seqlens[b] (clamped to the capacity).
- key tiles: the mask's range for queries [q_lo, q_hi] (docs/conventions.md, "Tile
  schedule", with `shift = sk - seqlen_q`), cut into `splits` runs of `ceil(count / splits)`;
  the CTA takes run s, tiles [a, b).
- when it has a tile: Q `valid * d * elt`; K and V `(min(b*bn, sk) - a*bn) * d * kv_elt` each;
  paged: BLOCK_TABLE 4 bytes per page holding one of the run's keys below sk (each entry is
  read once per CTA, through 32-page windows).
- always: splits == 1: O `valid * d * elt` and, when an LSE is asked for, LSE `valid * 4`;
  splits > 1: O_PARTS `valid * d * 4` and LSE_PARTS `valid * 4`.

Combine (splits > 1), per output row (b, query i, head h): LSE_PARTS `splits * 4` read;
O_PARTS `d * 4` read per part whose LSE is finite (a split holding a key that query i sees);
O `d * elt`; LSE 4 when asked for.

Score-stage features, counted in SEQLENS (decode's meta counter), by the spec: alibi, in the
split kernel, 4 bytes per valid row of every CTA (a row is one (query, head) pair: its
head's slope); sink, 4 bytes per valid row where the final LSE is formed: in the split
kernel's CTAs when the call uses one split, else in the combine kernel, per output row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flashgen.generator.families.decode import IO_KEYS, split_tiles
from flashgen.verify.io_model import standard_attention_bytes
from flashgen.verify.score_mods import spec_has

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


def _visible_keys(causal: str, window: Sequence[int], sq: int, sk: int, i: int) -> tuple[int, int]:
    """[lo, hi] of the keys query i sees (hi < lo: none)."""
    shift, left, right = _mask_bounds(causal, window, sq, sk)
    lo, hi = 0, sk - 1
    if causal != "none":
        hi = min(hi, i + shift)
    if right >= 0:
        hi = min(hi, i + shift + right)
    if left >= 0:
        lo = max(lo, i + shift - left)
    return lo, hi


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
    kv_elt = spec.kv_nbytes  # 1 for an FP8 (e4m3) cache
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
    alibi, sink = spec_has(spec, "alibi"), spec_has(spec, "sink")
    out = dict.fromkeys(IO_KEYS, 0)
    for b in range(batch):
        sk = max(lens[b], 0)
        for mt in range(num_mt):
            m0 = mt * bm
            valid = min(bm, rows - m0)
            q_lo, q_hi = m0 // group, (m0 + valid - 1) // group
            n_lo, n_hi = key_tile_range(causal, window, seqlen_q, sk, q_lo, q_hi, bn)
            for s in range(splits):
                a, e = split_tiles(n_lo, n_hi, splits, s)
                per_head = {"SEQLENS": 4 + (8 if kv_elt == 1 else 0)}
                if alibi:  # each valid row's head slope
                    per_head["SEQLENS"] += 4 * valid
                if sink and splits == 1:  # the final LSE is formed here: each row's sink
                    per_head["SEQLENS"] += 4 * valid
                if e > a:
                    keys = min(e * bn, sk) - a * bn
                    per_head["Q"] = valid * d * elt
                    per_head["K"] = per_head["V"] = keys * d * kv_elt
                    if spec.paged:  # each page of the run's keys below sk, once
                        first, last = (a * bn) // ps, (min(e * bn, sk) - 1) // ps
                        per_head["BLOCK_TABLE"] = 4 * (last - first + 1)
                if splits == 1:
                    per_head["O"] = valid * d * elt
                    per_head["LSE"] = valid * 4 if lse else 0
                else:
                    per_head["O_PARTS"] = valid * d * 4
                    per_head["LSE_PARTS"] = valid * 4
                for key, n in per_head.items():
                    out[key] += n * kv_heads
        if splits > 1:
            # combine: per (query i, head h) row; the part of split s is finite iff the
            # split's keys meet the keys query i sees (same for every head of the row tile)
            for r in range(rows):
                i = r // group
                mt = r // bm
                m0 = mt * bm
                valid = min(bm, rows - m0)
                n_lo, n_hi = key_tile_range(
                    causal, window, seqlen_q, sk, m0 // group, (m0 + valid - 1) // group, bn
                )
                lo, hi = _visible_keys(causal, window, seqlen_q, sk, i)
                finite = 0
                for s in range(splits):
                    a, e = split_tiles(n_lo, n_hi, splits, s)
                    k0, k1 = a * bn, min(e * bn, sk) - 1
                    if e > a and max(k0, lo) <= min(k1, hi):
                        finite += 1
                n = kv_heads  # every KV head's rows alike
                out["LSE_PARTS"] += n * splits * 4
                out["O_PARTS"] += n * finite * d * 4
                out["O"] += n * d * elt
                out["LSE"] += n * 4 if lse else 0
                if sink:  # the final LSE is formed in the combine: the row's sink
                    out["SEQLENS"] += n * 4
    out = {k: int(v) for k, v in out.items()}
    out["total"] = int(np.sum(list(out.values())))
    return out
