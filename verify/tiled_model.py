"""A NumPy model of the forward kernel's algorithm, tile by tile, counting HBM bytes.

Notation (docs/conventions.md): per CTA `(qt, h, b)` of the grid `ceil(max Sq / block_m) x
heads x batch`, rows `r0 .. r1` of query tile `qt`, K/V tiles `n` from the tile schedule
(dense range `[n_lo, n_hi)` or the sparse full-then-partial lists), `m_i` the running row max
and `l_i` the running row sum.

The online softmax runs in the **log2 domain, as the kernel does**: scores are multiplied by
`scale * log2(e)`, `m_i` is a log2-domain max, probabilities are `2^(s - m_i)` and the
accumulator is rescaled by `alpha = 2^(m_old - m_new)` per tile; a row that has seen no
visible key yet uses base 0 (the kernel's -inf guard). The final LSE is `(m_i + log2 l_i) *
ln 2`. Everything is float64, so the model equals `verify.reference` to float64 rounding.

Tiles of a dense schedule get the element-wise mask (rules 1-3); sparse *full* tiles get none,
as in the kernel, so a misclassified tile shows up as a difference from the reference.
Bytes are counted from the slices the model actually reads and writes, per the conventions'
counters Q, K, V, O, LSE, META, KEEP_MASK (`verify.io_model` predicts them in closed form).

Score-stage features (`verify.score_mods`) run where the kernel runs them: softcap and ALiBi
turn each tile's raw dot products into logits before the log2 scaling and the mask; a sink
joins the row sum once, after the last tile (`m = max(m, sink * log2 e)`, `l = l * 2^(m_old -
m) + 2^(sink log2 e - m)`, the accumulator rescaled alike). A CTA with rows of a spec with
alibi (sink) reads its head's slope (sink) once: 4 bytes of META each, even when it visits
no tile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flashgen.verify import score_mods
from flashgen.verify.blocksparse import CompactLayout
from flashgen.verify.io_model import IO_KEYS
from flashgen.verify.reference import causal_name, element_visible, shift_for, spec_window

__all__ = ["IO_KEYS", "TiledResult", "dense_tile_range", "tiled_forward"]

LOG2E = 1.0 / math.log(2.0)


@dataclass
class TiledResult:
    """o float64 in q's layout; lse float64 `(batch, heads, Sq)` (varlen `(heads, total_q)`);
    io bytes per counter plus 'total'; debug_keep_mask uint8 `(batch, heads, max Sq, max Sk)`
    (2 where the kernel writes nothing, else 0/1) when the spec has `debug_keep_mask`."""

    o: np.ndarray
    lse: np.ndarray
    io: dict[str, int]
    debug_keep_mask: np.ndarray | None


def dense_tile_range(
    r0: int,
    r1: int,
    *,
    block_n: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: Any,
    window: Sequence[int],
) -> tuple[int, int]:
    """`(n_lo, n_hi)` of the dense tile schedule for rows `r0 .. r1` (conventions.md)."""
    shift = shift_for(causal, seqlen_q, seqlen_k)
    left, right = window
    n_lo, n_hi = 0, -(-seqlen_k // block_n)
    if causal_name(causal) != "none":
        n_hi = min(n_hi, (r1 + shift) // block_n + 1)  # Python // floors toward -inf
    if right >= 0:
        n_hi = min(n_hi, (r1 + shift + right) // block_n + 1)
    if left >= 0:
        n_lo = max(0, (r0 + shift - left) // block_n)
    return n_lo, n_hi


def _check_spec_args(
    spec: Any, varlen: bool, kv_heads: int, heads: int, layout: Any, keep_mask: Any, p: float
) -> None:
    if bool(spec.mask.varlen) != varlen:
        raise ValueError(f"spec has mask.varlen: {spec.mask.varlen}; cu_seqlens must match")
    if kv_heads != heads and not spec.gqa:
        raise ValueError(f"kv_heads={kv_heads} != heads={heads} needs a spec with gqa: true")
    sparse = getattr(spec.sparsity, "yaml", spec.sparsity) == "block"
    if sparse != (layout is not None):
        raise ValueError("a layout is needed iff the spec has sparsity: block")
    if (keep_mask is not None or p > 0) and not spec.dropout:
        raise ValueError("keep_mask / dropout_p given, but the spec has dropout: false")


def tiled_forward(
    spec: Any,
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float | None = None,
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    layout: CompactLayout | None = None,
    keep_mask: Any = None,
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
) -> TiledResult:
    """Run the kernel's algorithm for `spec` (block sizes, causal alignment, features).

    `softcap`, `alibi_slopes`, `sinks` as `verify.reference.attention_forward`; each must be
    given iff the spec has the feature (`score_mods.score_args_problems`).

    Reads `spec.tile.block_m`, `spec.tile.block_n`, `spec.mask.{causal, window, varlen}`,
    `spec.dropout`, `spec.debug_keep_mask`, `spec.sparsity`, `spec.gqa`, `spec.dtype.nbytes`.
    Layouts as `verify.reference`; `keep_mask` bool `(batch, heads, Sq, Sk)` (varlen
    `(batch, heads, max Sq, max Sk)`, local positions); `layout` the compact block layout,
    built for this `(Sq, Sk)` (varlen with block sparsity needs equal lengths throughout).
    """
    bm, bn = int(spec.tile.block_m), int(spec.tile.block_n)
    elt = int(spec.dtype.nbytes)
    causal = causal_name(spec.mask.causal)
    win = spec_window(spec, window)
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if p > 0 and keep_mask is None:
        raise ValueError("dropout_p > 0 needs a keep_mask")
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    varlen = cu_seqlens_q is not None
    heads, d = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    _check_spec_args(spec, varlen, kv_heads, heads, layout, keep_mask, p)
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    n_seqs = (np.asarray(cu_seqlens_q).size - 1) if varlen else q.shape[0]
    score = score_mods.check_score_args(softcap, alibi_slopes, sinks, batch=n_seqs, heads=heads)
    problems = score_mods.score_args_problems(spec, score)
    if problems:
        raise ValueError("; ".join(problems))
    meta_per_cta = 4 * (score.alibi_slopes is not None) + 4 * (score.sinks is not None)

    if varlen:
        cq = np.asarray(cu_seqlens_q, dtype=np.int64)
        ck = np.asarray(cu_seqlens_k, dtype=np.int64)
        batch = cq.size - 1
        seqs = [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(batch)]
        lse = np.full((heads, q.shape[0]), -np.inf)
    else:
        batch = q.shape[0]
        seqs = [(b, b) for b in range(batch)]
        lse = np.full((batch, heads, q.shape[1]), -np.inf)
    o = np.zeros(q.shape[:-1] + v.shape[-1:])  # v's head dim d_v
    lens = [(q[qs].shape[0], k[ks].shape[0]) for qs, ks in seqs]
    max_sq = max((a for a, _ in lens), default=0)
    max_sk = max((b for _, b in lens), default=0)
    grid_tr = -(-max_sq // bm)
    debug = None
    if spec.debug_keep_mask:
        debug = np.full((batch, heads, max_sq, max_sk), 2, dtype=np.uint8)
    if layout is not None:
        bad = [(a, b) for a, b in lens if (a, b) != (layout.seqlen_q, layout.seqlen_k)]
        if bad or (layout.block_m, layout.block_n) != (bm, bn):
            raise ValueError(
                f"layout built for Sq={layout.seqlen_q}, Sk={layout.seqlen_k} at "
                f"{layout.block_m} x {layout.block_n}; the problem has lengths {sorted(set(lens))}"
                f" at {bm} x {bn}"
            )
    io = dict.fromkeys(IO_KEYS, 0)
    for b, (qs, ks) in enumerate(seqs):
        qb, kb, vb = q[qs], k[ks], v[ks]
        sq, sk = qb.shape[0], kb.shape[0]
        for h in range(heads):
            for qt in range(grid_tr):
                r0 = qt * bm
                if varlen:
                    io["META"] += 4 * 4  # cu_seqlens_q[b], [b+1], cu_seqlens_k[b], [b+1]
                if r0 >= sq:
                    continue  # varlen only: this CTA has no rows of sequence b
                r1 = min(r0 + bm, sq) - 1
                io["META"] += meta_per_cta  # the head's slope and sink, once per CTA
                slopes = score.slopes_for(b, slice(h, h + 1))
                sinks_h = score.sinks_for(slice(h, h + 1))
                if layout is not None:
                    schedule = layout.tiles(h, qt)
                    io["META"] += 8 + 4 * len(schedule)
                else:
                    n_lo, n_hi = dense_tile_range(
                        r0, r1, block_n=bn, seqlen_q=sq, seqlen_k=sk, causal=causal, window=win
                    )
                    schedule = [(n, True) for n in range(n_lo, n_hi)]
                keep = None if keep_mask is None else keep_mask[b, h]
                dbg = None if debug is None else debug[b, h]
                o_rows, lse_rows = _cta(
                    qb[:, h],
                    kb[:, h // group],
                    vb[:, h // group],
                    r0,
                    r1,
                    schedule,
                    block_n=bn,
                    scale=scale,
                    causal=causal,
                    window=win,
                    keep=keep,
                    p=p,
                    debug=dbg,
                    elt=elt,
                    io=io,
                    softcap=score.softcap,
                    slope=None if slopes is None else float(slopes[0]),
                    sink=None if sinks_h is None else float(sinks_h[0]),
                )
                if varlen:
                    o[qs.start + r0 : qs.start + r1 + 1, h] = o_rows
                    lse[h, qs.start + r0 : qs.start + r1 + 1] = lse_rows
                else:
                    o[b, r0 : r1 + 1, h] = o_rows
                    lse[b, h, r0 : r1 + 1] = lse_rows
    io["total"] = sum(io[key] for key in IO_KEYS)
    return TiledResult(o, lse, io, debug)


def _cta(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    r0: int,
    r1: int,
    schedule: list[tuple[int, bool]],
    *,
    block_n: int,
    scale: float,
    causal: str,
    window: tuple[int, int],
    keep: np.ndarray | None,
    p: float,
    debug: np.ndarray | None,
    elt: int,
    io: dict[str, int],
    softcap: float = 0.0,
    slope: float | None = None,
    sink: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One CTA: rows `r0 .. r1` of one (sequence, head) against its K/V tile schedule.

    q `(Sq, d)`, k `(Sk, d)`, v `(Sk, d_v)` of that head; keep / debug `(Sq', Sk')` slices of the
    keep-mask and the debug buffer (or None). Returns (o rows, lse rows), adds bytes to `io`.
    """
    sq, sk = q.shape[0], k.shape[0]
    rows = np.arange(r0, r1 + 1)
    m = np.full(rows.size, -np.inf)  # running max, log2 domain
    l_sum = np.zeros(rows.size)
    acc = np.zeros((rows.size, v.shape[1]))
    if schedule:
        q_tile = q[r0 : r1 + 1]
        io["Q"] += q_tile.size * elt
    for n, needs_mask in schedule:
        c0, c1 = n * block_n, min((n + 1) * block_n, sk)
        k_tile, v_tile = k[c0:c1], v[c0:c1]
        io["K"] += k_tile.size * elt
        io["V"] += v_tile.size * elt
        z = (q_tile @ k_tile.T) * scale
        if softcap:
            z = softcap * np.tanh(z / softcap)
        if slope is not None:
            shift = shift_for(causal, sq, sk)
            z = z - slope * np.abs(rows[:, None] + shift - np.arange(c0, c1)[None, :])
        s = z * LOG2E
        if needs_mask:
            vis = element_visible(
                rows[:, None], np.arange(c0, c1)[None, :], sq, sk, causal=causal, window=window
            )
            s = np.where(vis, s, -np.inf)
        m_new = np.maximum(m, s.max(axis=1, initial=-np.inf))
        base = np.where(m_new == -np.inf, 0.0, m_new)  # the -inf guard
        alpha = np.exp2(m - base)
        pt = np.exp2(s - base[:, None])
        l_sum = l_sum * alpha + pt.sum(axis=1)
        tile_keep = None
        if keep is not None:
            tile_keep = np.asarray(keep[r0 : r1 + 1, c0:c1], dtype=bool)
            pt = pt * tile_keep
        if debug is not None:
            if tile_keep is None:
                tile_keep = np.ones(pt.shape, dtype=bool)  # p = 0 keeps everything
            debug[r0 : r1 + 1, c0:c1] = tile_keep
            io["KEEP_MASK"] += tile_keep.size
        acc = acc * alpha[:, None] + pt @ v_tile
        m = m_new
    if sink is not None:  # the sink joins the row sum once, after the last tile
        m_new = np.maximum(m, sink * LOG2E)
        alpha = np.exp2(m - m_new)
        l_sum = l_sum * alpha + np.exp2(sink * LOG2E - m_new)
        acc = acc * alpha[:, None]
        m = m_new
    empty = ~(l_sum > 0)
    safe = np.where(empty, 1.0, l_sum)
    o_rows = np.where(empty[:, None], 0.0, acc / safe[:, None] / (1.0 - p))
    lse_rows = np.where(empty, -np.inf, (np.where(empty, 0.0, m) + np.log2(safe)) / LOG2E)
    io["O"] += o_rows.size * elt
    io["LSE"] += lse_rows.size * 4
    return o_rows, lse_rows
