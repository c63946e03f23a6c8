"""HBM bytes in closed form: a flashgen forward kernel, standard attention, the paper's bound.

`forward_bytes` predicts the `instrument_io` counters exactly (docs/conventions.md, "HBM
bytes") from the tile schedule alone, without data: per CTA `(qt, h, b)` with rows `r0 .. r1`,

- K, V: `d * elt` times the key rows the visited tiles cover; a dense schedule `[n_lo, n_hi)`
  covers `min(n_hi * block_n, Sk) - n_lo * block_n` rows, a sparse one the sum of
  `min(block_n, Sk - n * block_n)` over the listed tiles;
- Q: `valid_rows * d * elt` when the schedule is non-empty; O: `valid_rows * d * elt`;
  LSE: `4 * valid_rows` (written even by an empty schedule: O = 0, LSE = -inf);
- META: 16 bytes per CTA for varlen, `8 + 4 * listed tiles` per CTA with rows for sparse;
  4 bytes per CTA with rows (`r0 < Sq` of its sequence) for a spec with alibi (its head's
  slope) and 4 more for one with sink (its head's sink), once per CTA even when its schedule
  is empty;
- KEEP_MASK (debug builds): `valid_rows` times the covered key rows.

Sums run vectorised over query tiles; heads multiply when the schedule does not depend on the
head (dense, or one shared sparse layout). `verify.tiled_model` counts the same bytes by
emulating the loads; the two are tested equal.

Both forward families follow this one model. The mma.sync forward counts its cp.async chunks
(rows past the sequence are zero-filled, not read). The sm_90a forward counts per TMA box the
rows inside the sequence times the columns below `d`: TMA zero-fills rows past the tensor
map's extent and the padded columns of a head dim that is not a multiple of 64 without reading
them, so for dense calls the count is what the hardware reads. Its varlen maps span the packed
tensors, so a box that runs past its sequence's end also fetches rows of the next sequence
(up to `block_n - 1` per K or V box, `block_m - 1` for Q; the mask excludes them). Those are
not counted: the counters, like this model, are the bytes a CTA requests for its own
sequence, and for varlen calls the sm_90a kernel's DRAM traffic can exceed them by that much.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flashgen.generator.families.forward import IO_KEYS as FWD_IO_KEYS
from flashgen.verify.blocksparse import CompactLayout
from flashgen.verify.reference import causal_name, shift_for, spec_head_dims, spec_window
from flashgen.verify.score_mods import spec_has

__all__ = [
    "IO_KEYS",
    "forward_bytes",
    "paper_fwd_bound",
    "standard_attention_bytes",
]

# The kernel's counter order: the forward family's one list (families/forward.py).
IO_KEYS = FWD_IO_KEYS


def _dense_key_rows(
    sq: int,
    sk: int,
    block_m: int,
    block_n: int,
    grid_tr: int,
    causal: str,
    window: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Per query tile `(grid_tr,)`: valid rows, key rows covered by the dense schedule."""
    r0 = np.arange(grid_tr, dtype=np.int64) * block_m
    r1 = np.minimum(r0 + block_m, sq) - 1
    rows = np.maximum(r1 - r0 + 1, 0)
    shift = shift_for(causal, sq, sk)
    left, right = window
    tc = -(-sk // block_n)
    n_lo = np.zeros(grid_tr, dtype=np.int64)
    n_hi = np.full(grid_tr, tc, dtype=np.int64)
    if causal != "none":
        n_hi = np.minimum(n_hi, (r1 + shift) // block_n + 1)  # numpy // floors toward -inf
    if right >= 0:
        n_hi = np.minimum(n_hi, (r1 + shift + right) // block_n + 1)
    if left >= 0:
        n_lo = np.maximum(0, (r0 + shift - left) // block_n)
    covered = np.where(n_hi > n_lo, np.minimum(n_hi * block_n, sk) - n_lo * block_n, 0)
    return rows, np.where(rows > 0, covered, 0)


def _sparse_key_rows(layout: CompactLayout, sk: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (layout head, query tile): key rows covered and tiles listed."""
    covered = np.zeros(layout.full_count.shape, dtype=np.int64)
    listed = (layout.full_count + layout.part_count).astype(np.int64)
    for idx, count in ((layout.full_idx, layout.full_count), (layout.part_idx, layout.part_count)):
        slot = np.arange(idx.shape[-1])
        used = slot[None, None, :] < count[..., None]
        size = np.minimum(block_n, sk - idx.astype(np.int64) * block_n)
        covered += np.where(used, size, 0).sum(axis=-1)
    return covered, listed


def forward_bytes(
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
    layout: CompactLayout | None = None,
    debug_keep_mask: bool | None = None,
) -> dict[str, int]:
    """Exact bytes per counter ('Q', 'K', 'V', 'O', 'LSE', 'META', 'KEEP_MASK', 'total').

    Reads `spec.tile.block_m`, `spec.tile.block_n`, `spec.head_dim` (Q, K: d) and
    `spec.head_dim_vo` (V, O: d_v, when present), `spec.dtype.nbytes`,
    `spec.mask.{causal, window}`, `spec.sparsity`, `spec.debug_keep_mask`. Varlen: give
    `cu_seqlens_q`, `cu_seqlens_k` (`batch + 1` entries); `seqlen_q`, `seqlen_k` are then
    ignored (the grid uses the longest sequence). `debug_keep_mask` overrides the spec's flag
    (None: use the spec's). `kv_heads` does not change the bytes: every CTA reads its own K/V.
    Score-stage features count by the spec (`spec.has('alibi')`, `spec.has('sink')`).
    """
    del kv_heads  # each (qt, h, b) CTA reads K/V itself; GQA shares no loads across CTAs
    bm, bn = int(spec.tile.block_m), int(spec.tile.block_n)
    (d, d_v), elt = spec_head_dims(spec), int(spec.dtype.nbytes)
    causal = causal_name(spec.mask.causal)
    win = spec_window(spec, window)
    sparse = getattr(spec.sparsity, "yaml", spec.sparsity) == "block"
    if sparse != (layout is not None):
        raise ValueError("a layout is needed iff the spec has sparsity: block")
    debug = spec.debug_keep_mask if debug_keep_mask is None else debug_keep_mask
    varlen = cu_seqlens_q is not None
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
    grid_tr = -(-max((a for a, _ in lens), default=0) // bm)

    out = dict.fromkeys(IO_KEYS, 0)
    if varlen:
        out["META"] += 16 * grid_tr * heads * batch
    # per CTA with rows: the head's ALiBi slope and its sink, 4 bytes each
    score_meta = 4 * spec_has(spec, "alibi") + 4 * spec_has(spec, "sink")
    for sq, sk in sorted(set(lens)):
        mult = lens.count((sq, sk))  # sequences of equal lengths cost the same
        rows, dense_covered = _dense_key_rows(sq, sk, bm, bn, grid_tr, causal, win)
        out["META"] += mult * heads * score_meta * int((rows > 0).sum())
        if layout is None:
            covered, per_head = dense_covered[None, :], heads
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
            covered, listed = _sparse_key_rows(layout, sk, bn)
            per_head = heads if layout.layout_heads == 1 else 1
            meta = (8 + 4 * listed) * (rows > 0)
            out["META"] += mult * per_head * int(meta.sum())
        # covered: (L, grid_tr) key rows per CTA, each row of it standing for `per_head` heads
        n = mult * per_head
        rows_l = np.broadcast_to(rows, covered.shape)
        out["Q"] += n * int((rows_l * (covered > 0)).sum()) * d * elt
        out["K"] += n * int(covered.sum()) * d * elt
        out["V"] += n * int(covered.sum()) * d_v * elt
        out["O"] += n * int(rows_l.sum()) * d_v * elt
        out["LSE"] += n * int(rows_l.sum()) * 4
        if debug:
            out["KEEP_MASK"] += n * int((rows_l * covered).sum())
    out["total"] = sum(out[key] for key in IO_KEYS)
    return out


def standard_attention_bytes(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, d: int, elt: int = 2
) -> dict[str, int]:
    """HBM bytes of the FlashAttention paper's standard implementation (Algorithm 0).

    Per (batch, head), counting each tensor once per pass over it, `elt` bytes per element:
    read Q and K (`Sq d + Sk d`), write S = Q K^T (`Sq Sk`), read S and write P = softmax(S)
    (`2 Sq Sk`), read P and V (`Sq Sk + Sk d`), write O = P V (`Sq d`). Total
    `elt * batch * heads * (2 Sq d + 2 Sk d + 4 Sq Sk)`: Theta(N d + N^2) for N = Sq = Sk.
    Keys: 'Q', 'K', 'V', 'O' (bytes of each), 'S' (write + read), 'P' (write + read), 'total'.
    """
    n = batch * heads * elt
    out = {
        "Q": n * seqlen_q * d,
        "K": n * seqlen_k * d,
        "V": n * seqlen_k * d,
        "O": n * seqlen_q * d,
        "S": n * 2 * seqlen_q * seqlen_k,
        "P": n * 2 * seqlen_q * seqlen_k,
    }
    out["total"] = sum(out.values())
    return out


def paper_fwd_bound(n: int, d: int, m: float) -> float:
    """`N^2 d^2 / M`: the FlashAttention paper's HBM accesses (elements) for SRAM of M elements.

    Theorem 2 of the paper: the forward needs Theta(N^2 d^2 / M) accesses for d <= M <= N d.
    The kernel's SRAM holds a Q tile and K, V tiles, so M ~ (block_m + 2 block_n) d.
    """
    if not (n > 0 and d > 0 and m > 0):
        raise ValueError(f"N={n}, d={d}, M={m} must be positive")
    return float(n) * n * d * d / float(m)
