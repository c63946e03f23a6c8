"""HBM bytes of a flashgen backward kernel in closed form: what `instrument_io` counts.

One `<name>_launch` runs three kernels (four with sink); their counters add up (IO_KEYS
order: Q, K, V, O, DO, LSE, DSUM, DQ_ACCUM, DQ, DK, DV, META, KEEP_MASK). `d` head dim,
`elt` bytes per element, `G = heads / kv_heads` (1 without GQA), `sq`, `sk` one sequence's
lengths (varlen: per sequence), `Tr = ceil(sq / block_m)`.

Main kernel, one CTA per (K/V tile `n`, KV head `hk`, batch `b`) of the grid
`ceil(max sk / block_n) x kv_heads x batch`. Its key rows are `kr = min(block_n, sk - c0)`,
`c0 = n * block_n`, `c1 = c0 + kr - 1`; a CTA with `c0 >= sk` (varlen) counts only its META.
For each query head `h` of its group (`hk * G .. hk * G + G - 1`) it visits query tiles:

- dense: `[m_lo, m_hi)` with `shift` 0 (top_left) or `sk - sq` (bottom_right, and a window
  without causal), window sizes clamped to `sq + sk` as in mask.cuh, `reach` 0 if causal
  else none, lowered to `right` by a window's right side; `m_lo = max(0, floor((c0 - shift -
  reach) / block_m))` when there is a reach, else 0; `m_hi = Tr`, lowered to
  `floor((c1 - shift + left) / block_m) + 1` by a window's left side;
- sparse: the transposed row (`verify.blocksparse_bwd`) of layout head `0` (shared layout) or
  `h`, tile `n`: full then partial query tiles.

Per visited `(h, m)` with `qr = min(block_m, sq - m * block_m)` rows: Q and DO `qr * d * elt`
each, LSE and DSUM `4 * qr` each, DQ_ACCUM `8 * qr * d` (an fp32 atomic add counts 4 bytes
read and 4 written), KEEP_MASK `qr * kr` (debug builds). Per CTA: K and V `kr * d * elt` each
once if it visits at least one `(h, m)` over its heads, else nothing; DK and DV `kr * d * elt`
each always (zeros when nothing is visited). META: varlen 16 bytes per CTA of the grid
(`cu_seqlens_q/k[b]`, `[b + 1]`); sparse `8 + 4 * listed tiles` per head of the group, in
CTAs with `c0 < sk` (the layout's lengths are every sequence's, so that is all of them).

Score-stage features: with alibi, META 4 bytes per visited `(h, m)` step (the head's slope,
read per step); softcap reads nothing. With sink, a fourth kernel `dsink`, one CTA per query
head h: for every sequence and every valid query row of h, LSE 4 and DSUM 4; META 4 for
`sinks[h]` read and 4 for `dsinks[h]` written.

Preprocess, every valid query row of every head: O and DO `d * elt` each, DSUM 4 (it reads
cu_seqlens without counting). Convert, same rows: DQ_ACCUM `4 * d`, DQ `d * elt`. The
launcher's memset of dq_accum is not counted.

Readings chosen where the brief left room (the kernel must agree): `kr` in KEEP_MASK is the
tile's valid key rows (columns past `sk` are never written); the sparse META is counted once
per head of the group even with a shared layout (each head re-reads its row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flashgen.generator.families.backward import IO_KEYS as BWD_IO_KEYS
from flashgen.verify.blocksparse import CompactLayout
from flashgen.verify.blocksparse_bwd import BwdLayout, transpose_layout
from flashgen.verify.reference import causal_name, shift_for, spec_head_dims, spec_window
from flashgen.verify.score_mods import spec_has

__all__ = ["IO_KEYS", "backward_bytes", "q_tile_range", "standard_attention_bytes"]

# The kernel's counter order: the backward family's one list (families/backward.py).
IO_KEYS = BWD_IO_KEYS


def q_tile_range(
    c0: Any,
    c1: Any,
    *,
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    causal: Any,
    window: Sequence[int] = (-1, -1),
) -> tuple[np.ndarray, np.ndarray]:
    """`(m_lo, m_hi)` of the dense backward schedule for key columns `c0 .. c1` (arrays
    broadcast), as mask.cuh's `q_tile_range`: the query tiles `m_lo .. m_hi - 1` are visited
    (none when `m_hi <= m_lo`). Window sizes are clamped to `Sq + Sk` first."""
    c0 = np.asarray(c0, dtype=np.int64)
    c1 = np.asarray(c1, dtype=np.int64)
    sq, sk = int(seqlen_q), int(seqlen_k)
    shift = shift_for(causal, sq, sk)
    left, right = (int(w) for w in window)
    left = min(left, sq + sk) if left >= 0 else -1
    right = min(right, sq + sk) if right >= 0 else -1
    reach = 0 if causal_name(causal) != "none" else -1
    if right >= 0:
        reach = right if reach < 0 else min(reach, right)
    m_lo = np.zeros(np.broadcast(c0, c1).shape, dtype=np.int64)
    m_hi = np.full(m_lo.shape, -(-sq // block_m), dtype=np.int64)
    if reach >= 0:
        m_lo = np.maximum(m_lo, (c0 - shift - reach) // block_m)  # floors toward -inf
    if left >= 0:
        m_hi = np.minimum(m_hi, (c1 - shift + left) // block_m + 1)
    return m_lo, m_hi


def _rows_of_tiles(sq: int, block_m: int, tiles: np.ndarray) -> np.ndarray:
    """Valid rows `min(block_m, sq - m * block_m)` of query tiles `m` (0 past the end)."""
    return np.clip(sq - tiles.astype(np.int64) * block_m, 0, block_m)


def _dense_visits(
    sq: int, sk: int, bm: int, c0: np.ndarray, kr: np.ndarray, causal: str, window
) -> tuple[np.ndarray, np.ndarray]:
    """Per K/V tile: query tiles visited, and the query rows they hold (one head)."""
    m_lo, m_hi = q_tile_range(
        c0, c0 + kr - 1, seqlen_q=sq, seqlen_k=sk, block_m=bm, causal=causal, window=window
    )
    visits = np.maximum(m_hi - m_lo, 0)
    rows = np.where(visits > 0, np.minimum(m_hi * bm, sq) - m_lo * bm, 0)
    return visits, rows


def _sparse_visits(
    layout: BwdLayout, sq: int, bm: int, grid_tc: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per (layout head, K/V tile): query tiles listed, and the query rows they hold."""
    visits = np.zeros((layout.layout_heads, grid_tc), dtype=np.int64)
    rows = np.zeros_like(visits)
    tc = min(grid_tc, layout.num_k_tiles)
    for idx, count in ((layout.full_idx, layout.full_count), (layout.part_idx, layout.part_count)):
        idx = np.asarray(idx, dtype=np.int64)[:, :tc]
        count = np.asarray(count, dtype=np.int64)[:, :tc]
        used = np.arange(idx.shape[-1])[None, None, :] < count[..., None]
        visits[:, :tc] += count
        rows[:, :tc] += np.where(used, _rows_of_tiles(sq, bm, idx), 0).sum(axis=-1)
    return visits, rows


def backward_bytes(
    spec: Any,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    layout: CompactLayout | BwdLayout | None = None,
    debug_keep_mask: bool | None = None,
) -> dict[str, int]:
    """Exact bytes per counter (IO_KEYS, plus 'total') of one backward launch.

    Reads `spec.tile.block_m`, `spec.tile.block_n`, `spec.head_dim` (Q, K, dQ, dK: d) and
    `spec.head_dim_vo` (V, O, dO, dV: d_v, when present), `spec.dtype.nbytes`,
    `spec.mask.{causal, window}`, `spec.sparsity`, `spec.debug_keep_mask` (and `spec.gqa`
    when present). Varlen: give `cu_seqlens_q`, `cu_seqlens_k` (`batch + 1` entries);
    `seqlen_q`, `seqlen_k` are then ignored (the grid uses the longest key sequence).
    `layout`: the forward's CompactLayout (transposed here) or a BwdLayout, iff the spec has
    sparsity: block. `debug_keep_mask` overrides the spec's flag (None: the spec's).
    Score-stage features count by the spec (`spec.has('alibi')`, `spec.has('sink')`).
    """
    bm, bn = int(spec.tile.block_m), int(spec.tile.block_n)
    (d, d_v), elt = spec_head_dims(spec), int(spec.dtype.nbytes)
    causal = causal_name(spec.mask.causal)
    win = spec_window(spec, window)
    heads, kv_heads, batch = int(heads), int(kv_heads), int(batch)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must be >= 1 and divide heads={heads}")
    if kv_heads != heads and not getattr(spec, "gqa", True):
        raise ValueError(f"kv_heads={kv_heads} != heads={heads} needs a spec with gqa: true")
    group = heads // kv_heads
    sparse = getattr(spec.sparsity, "yaml", spec.sparsity) == "block"
    if sparse != (layout is not None):
        raise ValueError("a layout is needed iff the spec has sparsity: block")
    if isinstance(layout, CompactLayout):
        layout = transpose_layout(layout)
    debug = spec.debug_keep_mask if debug_keep_mask is None else debug_keep_mask
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    if varlen:
        lens = list(
            zip(
                np.diff(np.asarray(cu_seqlens_q, dtype=np.int64)).tolist(),
                np.diff(np.asarray(cu_seqlens_k, dtype=np.int64)).tolist(),
                strict=True,
            )
        )
        if len(lens) != batch:
            raise ValueError(f"cu_seqlens have {len(lens) + 1} entries, batch + 1 = {batch + 1}")
    else:
        lens = [(int(seqlen_q), int(seqlen_k))] * batch
    grid_tc = -(-max((sk for _, sk in lens), default=0) // bn)

    out = dict.fromkeys(IO_KEYS, 0)
    if varlen:
        out["META"] += 16 * grid_tc * kv_heads * batch
    alibi, sink = spec_has(spec, "alibi"), spec_has(spec, "sink")
    if sink:  # the dsink kernel: sinks[h] read, dsinks[h] written, per query head
        out["META"] += 8 * heads
    row_bytes, row_bytes_v = d * elt, d_v * elt  # a row of Q, K, dQ, dK; of V, O, dO, dV
    for sq, sk in sorted(set(lens)):
        mult = lens.count((sq, sk))  # sequences of equal lengths cost the same
        # preprocess and convert: every valid query row of every head
        rows_all = mult * heads * sq
        out["O"] += rows_all * row_bytes_v
        out["DO"] += rows_all * row_bytes_v
        out["DSUM"] += rows_all * 4
        out["DQ_ACCUM"] += rows_all * 4 * d
        out["DQ"] += rows_all * row_bytes
        if sink:  # the dsink kernel: LSE and D of every valid query row of every head
            out["LSE"] += rows_all * 4
            out["DSUM"] += rows_all * 4
        # main kernel: per K/V tile n (axis -1), per query head (axis 0)
        c0 = np.arange(grid_tc, dtype=np.int64) * bn
        kr = np.clip(sk - c0, 0, bn)
        active = kr > 0
        if layout is None:
            visits, rows = _dense_visits(sq, sk, bm, c0, np.maximum(kr, 1), causal, win)
            visits = np.broadcast_to(visits, (heads, grid_tc))
            rows = np.broadcast_to(rows, (heads, grid_tc))
        else:
            if (sq, sk, bm, bn) != (
                layout.seqlen_q,
                layout.seqlen_k,
                layout.block_m,
                layout.block_n,
            ):
                raise ValueError(
                    f"layout built for Sq={layout.seqlen_q}, Sk={layout.seqlen_k} at "
                    f"{layout.block_m} x {layout.block_n}, not {sq} x {sk} at {bm} x {bn}"
                )
            if layout.layout_heads not in (1, heads):
                raise ValueError(f"layout has {layout.layout_heads} heads (allowed: 1, {heads})")
            lv, lr = _sparse_visits(layout, sq, bm, grid_tc)
            pick = np.zeros(heads, dtype=np.int64) if layout.layout_heads == 1 else np.arange(heads)
            visits, rows = lv[pick], lr[pick]
            out["META"] += mult * int(((8 + 4 * visits) * active).sum())
        visits = visits * active
        rows = rows * active
        if alibi:  # the head's slope, once per visited (h, m) step
            out["META"] += mult * 4 * int(visits.sum())
        total_rows = int(rows.sum())
        out["Q"] += mult * total_rows * row_bytes
        out["DO"] += mult * total_rows * row_bytes_v
        out["LSE"] += mult * total_rows * 4
        out["DSUM"] += mult * total_rows * 4
        out["DQ_ACCUM"] += mult * total_rows * 8 * d
        if debug:
            out["KEEP_MASK"] += mult * int((rows * kr).sum())
        # K/V once per CTA (n, hk) that visits anything over the heads of its group
        cta_visits = visits.reshape(kv_heads, group, grid_tc).sum(axis=1)
        kv_read = int(((cta_visits > 0) * kr).sum())
        out["K"] += mult * kv_read * row_bytes
        out["V"] += mult * kv_read * row_bytes_v
        out["DK"] += mult * kv_heads * int(kr.sum()) * row_bytes
        out["DV"] += mult * kv_heads * int(kr.sum()) * row_bytes_v
    out["total"] = sum(out[key] for key in IO_KEYS)
    return out


def standard_attention_bytes(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, d: int, elt: int = 2
) -> dict[str, int]:
    """HBM bytes of the FlashAttention paper's standard attention backward (Algorithm 3).

    Per (batch, head), `elt` bytes per element, P kept from the forward: read P, dO, write
    dV = P^T dO; read dO, V, write dP = dO V^T; read P, dP, write dS = P * (dP - rowsum(P dP));
    read dS, K, write dQ = dS K; read dS, Q, write dK = dS^T Q. Total
    `elt * batch * heads * (4 Sq d + 4 Sk d + 7 Sq Sk)`: Theta(N d + N^2) for N = Sq = Sk.
    Keys: 'Q', 'K', 'V', 'DO', 'DQ', 'DK', 'DV' (bytes of each), 'P' (2 reads), 'DP' (write +
    read), 'DS' (write + 2 reads), 'total'.
    """
    n = batch * heads * elt
    qd, kd, qk = n * seqlen_q * d, n * seqlen_k * d, n * seqlen_q * seqlen_k
    out = {
        "Q": qd,
        "K": kd,
        "V": kd,
        "DO": 2 * qd,
        "DQ": qd,
        "DK": kd,
        "DV": kd,
        "P": 2 * qk,
        "DP": 2 * qk,
        "DS": 3 * qk,
    }
    out["total"] = sum(out.values())
    return out
