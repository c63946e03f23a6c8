"""The float64 reference: the one definition of what every flashgen kernel computes.

Notation (docs/conventions.md): `Sq`, `Sk` query and key lengths of one sequence, `d` head dim,
`h` query head, `hk = h // (heads // kv_heads)` its key/value head, `i`, `j` local query row and
key column, `shift` the causal alignment offset (0 for `top_left`, `Sk - Sq` for
`bottom_right`).

Layouts:
- dense: q `(batch, Sq, heads, d)`, o `(batch, Sq, heads, d_v)`; k `(batch, Sk, kv_heads, d)`,
  v `(batch, Sk, kv_heads, d_v)`; LSE `(batch, heads, Sq)`. d_v (V and O) may differ from d.
- varlen: q, o packed `(total_q, heads, d | d_v)`; k, v `(total_k, kv_heads, d | d_v)`; LSE
  `(heads, total_q)`; `cu_seqlens_q`, `cu_seqlens_k` cumulative lengths of `batch + 1` entries
  starting at 0. Positions are local to each sequence (masks, dropout keep-mask, block layout).

LSE is the natural-log log-sum-exp of the *scaled* scores over the visible keys of a row. A
row with no visible key has O = 0 and LSE = -inf (never NaN, and no floating-point warnings).

Dropout is given as a keep-mask (`verify.dropout.keep_mask` draws the kernels' one): kept
probabilities are multiplied by `1 / (1 - p)` before `P V`; the LSE is that of the undropped
softmax. Dense keep-masks are `(batch, heads, Sq, Sk)`; varlen keep-masks are
`(batch, heads, max_Sq, max_Sk)` indexed by local positions (the kernels' debug layout).

Block sparsity is given as a boolean layout `(layout_heads, Tr, Tc)` at `block_m x block_n`
granularity, `layout_heads` 1 (shared by all heads) or `heads`; tile `(i // block_m,
j // block_n)` of head `h` is visible iff the layout holds it. Larger layouts are allowed (the
extra tiles are ignored), so that one layout can serve every sequence of a varlen batch.

Score-stage features (`verify.score_mods` states them exactly): `softcap` (c > 0: the scaled
score becomes `c * tanh(z / c)`; 0 = off), `alibi_slopes` (float `(heads,)` or `(batch,
heads)`: `- slope * |i + shift - j|` is added, `shift` as the causal alignment's, per
sequence) and `sinks` (float `(heads,)`: one logit per head in the softmax denominator; the
LSE includes it, a row with no visible key gets LSE = sink). The LSE is then that of the
modified logits. The backward returns `dsinks` `(heads,)` as a fourth output when sinks are
given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from flashgen.verify import score_mods
from flashgen.verify.score_mods import ScoreArgs, check_score_args

__all__ = [
    "CAUSAL_ALIGNMENTS",
    "attention_backward",
    "attention_forward",
    "causal_name",
    "element_visible",
    "score_grad",
    "score_logits",
    "sequence_visible",
    "shift_for",
    "spec_window",
    "through_score_grad",
    "visible_mask",
]

CAUSAL_ALIGNMENTS = ("none", "top_left", "bottom_right")

Window = tuple[int, int]


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def causal_name(causal: Any) -> str:
    """The causal alignment's YAML spelling, from a string or an enum with a `.yaml` attribute."""
    name = getattr(causal, "yaml", causal)
    if name not in CAUSAL_ALIGNMENTS:
        allowed = ", ".join(CAUSAL_ALIGNMENTS)
        raise ValueError(f"causal={causal!r} is not allowed (allowed: {allowed})")
    return name


def _check_window(window: Sequence[int]) -> Window:
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window={tuple(window)!r}: each side is -1 (unbounded) or >= 0")
    return left, right


def spec_window(spec: Any, window: Sequence[int] = (-1, -1)) -> Window:
    """The runtime window of a kernel spec: `window` if `spec.mask.window`, else (-1, -1).

    A spec without a window mask ignores the runtime window, so a bounded one is an error here
    rather than a silent difference between what was asked and what ran.
    """
    left, right = _check_window(window)
    if not spec.mask.window and (left, right) != (-1, -1):
        raise ValueError(f"window={tuple(window)} given, but the spec has mask.window: false")
    return left, right


def spec_head_dims(spec: Any) -> tuple[int, int]:
    """(d, d_v) of a kernel spec: the head dim of Q and K, and that of V and O
    (`spec.head_dim_vo`; a spec-like object without it has d_v = d)."""
    d = int(spec.head_dim)
    return d, int(getattr(spec, "head_dim_vo", d))


def shift_for(causal: Any, seqlen_q: int, seqlen_k: int) -> int:
    """The diagonal's offset: 0 for `top_left`, `Sk - Sq` otherwise.

    With `causal='none'` this is the sliding window's alignment (bottom_right, as in
    FlashAttention-2).
    """
    return 0 if causal_name(causal) == "top_left" else seqlen_k - seqlen_q


def element_visible(
    i: Any,
    j: Any,
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
) -> np.ndarray:
    """Rules 1-3 of conventions.md ("Masks") for broadcastable integer arrays `i`, `j`."""
    i = np.asarray(i, dtype=np.int64)
    j = np.asarray(j, dtype=np.int64)
    left, right = _check_window(window)
    shift = shift_for(causal, seqlen_q, seqlen_k)
    ok = (i >= 0) & (i < seqlen_q) & (j >= 0) & (j < seqlen_k)
    if causal_name(causal) != "none":
        ok = ok & (j <= i + shift)
    if left >= 0:
        ok = ok & (j >= i + shift - left)
    if right >= 0:
        ok = ok & (j <= i + shift + right)
    return ok


def _check_block_mask(
    block_mask: Any, heads: int, block_m: int | None, block_n: int | None
) -> np.ndarray:
    bm = np.asarray(block_mask)
    if bm.dtype != np.bool_ or bm.ndim != 3:
        raise ValueError(
            f"block_mask must be a bool array (layout_heads, Tr, Tc), got {bm.dtype} {bm.shape}"
        )
    if bm.shape[0] not in (1, heads):
        raise ValueError(f"block_mask has {bm.shape[0]} layout heads (allowed: 1 or {heads})")
    if not block_m or not block_n or block_m <= 0 or block_n <= 0:
        raise ValueError("block_mask needs positive block_m and block_n")
    return bm


def sequence_visible(
    seqlen_q: int,
    seqlen_k: int,
    *,
    heads: int = 1,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    block_mask: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> np.ndarray:
    """Visibility of one sequence, bool `(heads, Sq, Sk)` (rules 1-4 of conventions.md)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    vis = element_visible(i, j, seqlen_q, seqlen_k, causal=causal, window=window)
    vis = np.broadcast_to(vis, (heads, seqlen_q, seqlen_k))
    if block_mask is None:
        return vis.copy()
    bm = _check_block_mask(block_mask, heads, block_m, block_n)
    tr, tc = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    if bm.shape[1] < tr or bm.shape[2] < tc:
        raise ValueError(
            f"block_mask {bm.shape} is smaller than the {tr} x {tc} tiles of "
            f"Sq={seqlen_q}, Sk={seqlen_k} at {block_m} x {block_n}"
        )
    tiles = bm[:, (np.arange(seqlen_q) // block_m)][:, :, (np.arange(seqlen_k) // block_n)]
    return vis & tiles


def visible_mask(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    block_mask: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> np.ndarray:
    """Bool `(batch, heads, Sq, Sk)`: whether key `j` is visible from query `i`.

    Varlen: `seqlen_q`, `seqlen_k` are the padded sizes (at least the longest sequence); each
    sequence's `(Sq_b, Sk_b)` corner is filled and the rest is False.
    """
    out = np.zeros((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    lengths = _lengths(batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k)
    for b, (sq, sk) in enumerate(lengths):
        if sq > seqlen_q or sk > seqlen_k:
            raise ValueError(f"sequence {b} ({sq} x {sk}) exceeds {seqlen_q} x {seqlen_k}")
        out[b, :, :sq, :sk] = sequence_visible(
            sq,
            sk,
            heads=heads,
            causal=causal,
            window=window,
            block_mask=block_mask,
            block_m=block_m,
            block_n=block_n,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Layout plumbing shared with verify.baseline
# ---------------------------------------------------------------------------------------------


def _check_cu(cu: Any, name: str, total: int) -> np.ndarray:
    cu = np.asarray(cu, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > total:
        raise ValueError(
            f"{name} must be non-decreasing, start at 0 and end at most at {total}; got {cu}"
        )
    return cu


def _lengths(
    batch: int, seqlen_q: int, seqlen_k: int, cu_q: Any, cu_k: Any
) -> list[tuple[int, int]]:
    if (cu_q is None) != (cu_k is None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_q is None:
        return [(seqlen_q, seqlen_k)] * batch
    cq = np.diff(np.asarray(cu_q, dtype=np.int64))
    ck = np.diff(np.asarray(cu_k, dtype=np.int64))
    if len(cq) != batch or len(ck) != batch:
        raise ValueError(f"cu_seqlens must have batch + 1 = {batch + 1} entries")
    return [(int(a), int(b)) for a, b in zip(cq, ck, strict=True)]


class _Seq(NamedTuple):
    """One sequence of a batch: where its rows live in q/o, k/v and LSE."""

    b: int
    q_rows: Any  # index into the leading axis (axes) of q / o: an int (dense) or a slice
    k_rows: Any
    lse_index: tuple  # index of the `(heads, Sq_b)` LSE block


class _Problem(NamedTuple):
    batch: int
    heads: int
    kv_heads: int
    d: int
    varlen: bool
    seqs: list[_Seq]
    lse_shape: tuple[int, ...]
    max_sq: int
    max_sk: int


def _problem(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_q: Any, cu_k: Any) -> _Problem:
    if (cu_q is None) != (cu_k is None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    varlen = cu_q is not None
    want = 3 if varlen else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != want:
            layout = "(total, heads, d)" if varlen else "(batch, seqlen, heads, d)"
            raise ValueError(f"{name} must be {layout}, got shape {x.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k {k.shape} and v {v.shape} must have the same shape but for the last dim "
            "(v's head dim d_v may differ from q's and k's d)"
        )
    heads, d = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q head_dim {d} != k head_dim {k.shape[-1]}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if not varlen:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        if k.shape[0] != batch:
            raise ValueError(f"q batch {batch} != k batch {k.shape[0]}")
        seqs = [_Seq(b, b, b, (b,)) for b in range(batch)]
        return _Problem(batch, heads, kv_heads, d, False, seqs, (batch, heads, sq), sq, sk)
    cq = _check_cu(cu_q, "cu_seqlens_q", q.shape[0])
    ck = _check_cu(cu_k, "cu_seqlens_k", k.shape[0])
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q has {cq.size} entries, cu_seqlens_k {ck.size}")
    batch = cq.size - 1
    seqs = [
        _Seq(
            b,
            slice(int(cq[b]), int(cq[b + 1])),
            slice(int(ck[b]), int(ck[b + 1])),
            (slice(None), slice(int(cq[b]), int(cq[b + 1]))),
        )
        for b in range(batch)
    ]
    max_sq = int(np.diff(cq).max(initial=0))
    max_sk = int(np.diff(ck).max(initial=0))
    return _Problem(batch, heads, kv_heads, d, True, seqs, (heads, q.shape[0]), max_sq, max_sk)


def _keep_for(keep_mask: Any, pb: _Problem, seq: _Seq, sq: int, sk: int) -> np.ndarray | None:
    if keep_mask is None:
        return None
    km = np.asarray(keep_mask)
    if km.dtype != np.bool_ or km.ndim != 4 or km.shape[:2] != (pb.batch, pb.heads):
        raise ValueError(
            f"keep_mask must be bool (batch={pb.batch}, heads={pb.heads}, Sq, Sk), "
            f"got {km.dtype} {km.shape}"
        )
    if km.shape[2] < sq or km.shape[3] < sk or (not pb.varlen and km.shape[2:] != (sq, sk)):
        raise ValueError(f"keep_mask {km.shape} does not cover sequence {seq.b} ({sq} x {sk})")
    return km[seq.b, :, :sq, :sk]


def _check_p(dropout_p: float, keep_mask: Any) -> float:
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if p > 0.0 and keep_mask is None:
        raise ValueError("dropout_p > 0 needs a keep_mask (see verify.dropout.keep_mask)")
    return p


class SeqInputs(NamedTuple):
    """What a numeric core sees: one sequence, a chunk of `h` of its query heads."""

    q: np.ndarray  # (Sq, h, d)
    k: np.ndarray  # (Sk, h, d): already expanded from kv_heads (GQA)
    v: np.ndarray  # (Sk, h, d)
    visible: np.ndarray  # bool (h, Sq, Sk)
    keep: np.ndarray | None  # bool (h, Sq, Sk)
    dropout_p: float
    scale: float
    # score-stage features of the chunk (verify.score_mods), in the working dtype
    softcap: float = 0.0  # 0: off
    alibi_slopes: np.ndarray | None = None  # (h,): the chunk's heads' slopes for this sequence
    alibi_shift: int = 0  # the distance's offset: shift_for(causal, Sq, Sk) of this sequence
    sinks: np.ndarray | None = None  # (h,)
    user: UserChunk | None = None  # the spec's score_mod, where this chunk lies


class UserChunk(NamedTuple):
    """A score_mod (generator.usermod.UserMod) and its parameter values, and where a chunk lies:
    sequence b, its query heads (h,) and the sequence's own lengths (varlen: per sequence)."""

    mod: Any
    params: dict[str, Any]
    b: int
    heads: np.ndarray
    seqlen_q: int
    seqlen_k: int

    def where(self) -> dict[str, Any]:
        return {
            "b": self.b,
            "heads": self.heads,
            "seqlen_q": self.seqlen_q,
            "seqlen_k": self.seqlen_k,
        }


_NO_SCORE = ScoreArgs()  # no score-stage feature in use

# Score-sized temporaries per head chunk: about 2**24 elements (128 MiB in float64), at least
# one head, so long sequences run in bounded memory.
_CHUNK_ELEMENTS = 2**24


class _Block(NamedTuple):
    """One unit of work: a sequence and a chunk of its query heads."""

    seq: _Seq
    heads: slice  # query heads of the chunk
    kv_index: np.ndarray  # the key/value head of each of them


def _iter_blocks(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    pb: _Problem,
    *,
    scale: float,
    causal: Any,
    window: Sequence[int],
    keep_mask: Any,
    dropout_p: float,
    block_mask: Any,
    block_m: int | None,
    block_n: int | None,
    score: ScoreArgs = _NO_SCORE,
) -> Iterator[tuple[_Block, SeqInputs]]:
    group = pb.heads // pb.kv_heads
    dt = q.dtype.type
    if block_mask is not None:
        block_mask = _check_block_mask(block_mask, pb.heads, block_m, block_n)
    for seq in pb.seqs:
        qs, ks, vs = q[seq.q_rows], k[seq.k_rows], v[seq.k_rows]
        sq, sk = qs.shape[0], ks.shape[0]
        keep = _keep_for(keep_mask, pb, seq, sq, sk)
        shift = shift_for(causal, sq, sk) if score.alibi_slopes is not None else 0
        chunk = max(1, _CHUNK_ELEMENTS // max(1, sq * sk))
        for h0 in range(0, pb.heads, chunk):
            hs = slice(h0, min(h0 + chunk, pb.heads))
            kv_index = np.arange(hs.start, hs.stop) // group
            layout = block_mask
            if layout is not None and layout.shape[0] != 1:
                layout = layout[hs]
            vis = sequence_visible(
                sq,
                sk,
                heads=hs.stop - hs.start,
                causal=causal,
                window=window,
                block_mask=layout,
                block_m=block_m,
                block_n=block_n,
            )
            if score.mask_mod is not None:  # ANDed with the built-in masks
                vis = vis & score_mods.mask_visible(
                    score.mask_mod,
                    score.score_params,
                    b=seq.b,
                    heads=np.arange(hs.start, hs.stop),
                    seqlen_q=sq,
                    seqlen_k=sk,
                    q_tok0=_first_token(seq.q_rows, seq.b, sq),
                    k_tok0=_first_token(seq.k_rows, seq.b, sk),
                )
            slopes, sinks = score.slopes_for(seq.b, hs), score.sinks_for(hs)
            user = None
            if score.score_mod is not None:
                user = UserChunk(
                    score.score_mod, score.score_params, seq.b, np.arange(hs.start, hs.stop), sq, sk
                )
            yield (
                _Block(seq, hs, kv_index),
                SeqInputs(
                    qs[:, hs],
                    ks[:, kv_index],
                    vs[:, kv_index],
                    vis,
                    None if keep is None else keep[hs],
                    dropout_p,
                    scale,
                    score.softcap,
                    None if slopes is None else slopes.astype(dt),
                    shift,
                    None if sinks is None else sinks.astype(dt),
                    user,
                ),
            )


def _first_token(rows: Any, b: int, n: int) -> int:
    """The token index of a sequence's first row in the per-token vectors: its packed row
    (varlen: `rows` is a slice) or b * seqlen (dense: `rows` is the batch index)."""
    return rows.start if isinstance(rows, slice) else b * n


def _default_scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


ForwardCore = Callable[[SeqInputs], tuple[np.ndarray, np.ndarray]]
# (dq, dk, dv) or (dq, dk, dv, dsink): dsink `(h,)` the chunk's heads' sink gradient terms
BackwardCore = Callable[[SeqInputs, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, ...]]


def _score_args(
    pb: _Problem,
    softcap: Any,
    alibi_slopes: Any,
    sinks: Any,
    score_mod: Any,
    score_params: Any,
    mask_mod: Any = None,
) -> ScoreArgs:
    return check_score_args(
        softcap,
        alibi_slopes,
        sinks,
        batch=pb.batch,
        heads=pb.heads,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )


def run_forward(
    core: ForwardCore,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    work_dtype: Any,
    scale: float | None,
    causal: Any,
    window: Sequence[int],
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    keep_mask: Any,
    dropout_p: float,
    block_mask: Any,
    block_m: int | None,
    block_n: int | None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Splits a batch into sequences, runs `core` on each and reassembles O and LSE.

    Shared by the float64 reference and `verify.baseline` so both read the same layouts. The
    score-stage arguments are validated here (`score_mods.check_score_args`) and reach the
    core through `SeqInputs` (each chunk's slopes, sinks and ALiBi shift).
    """
    q, k, v = (np.asarray(x, dtype=work_dtype) for x in (q, k, v))
    pb = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k)
    p = _check_p(dropout_p, keep_mask)
    score = _score_args(pb, softcap, alibi_slopes, sinks, score_mod, score_params, mask_mod)
    o = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=work_dtype)  # (..., heads, d_v)
    lse = np.full(pb.lse_shape, -np.inf, dtype=work_dtype)
    for blk, inp in _iter_blocks(
        q,
        k,
        v,
        pb,
        scale=_default_scale(scale, pb.d),
        causal=causal,
        window=window,
        keep_mask=keep_mask,
        dropout_p=p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        score=score,
    ):
        o_s, lse_s = core(inp)
        o[blk.seq.q_rows][:, blk.heads] = o_s  # views: o[b] (dense) or o[start:stop] (varlen)
        lse[blk.seq.lse_index][blk.heads] = lse_s
    return o, lse


def run_backward(
    core: BackwardCore,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    do: np.ndarray,
    *,
    work_dtype: Any,
    scale: float | None,
    causal: Any,
    window: Sequence[int],
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    keep_mask: Any,
    dropout_p: float,
    block_mask: Any,
    block_m: int | None,
    block_n: int | None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray, ...]:
    """Like `run_forward` for the backward pass; dk, dv are summed over each GQA group
    (in head order, in the working dtype). With `sinks`, returns `(dq, dk, dv, dsinks)`:
    dsinks `(heads,)` sums the cores' per-chunk terms (the core's fourth output) over the
    sequences; without, `(dq, dk, dv)`."""
    q, k, v, o, lse, do = (np.asarray(x, dtype=work_dtype) for x in (q, k, v, o, lse, do))
    pb = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k)
    o_shape = q.shape[:-1] + v.shape[-1:]
    if o.shape != o_shape or do.shape != o_shape:
        raise ValueError(
            f"o {o.shape} and do {do.shape} must have q's shape with v's head dim: {o_shape}"
        )
    if lse.shape != pb.lse_shape:
        raise ValueError(f"lse must have shape {pb.lse_shape}, got {lse.shape}")
    p = _check_p(dropout_p, keep_mask)
    score = _score_args(pb, softcap, alibi_slopes, sinks, score_mod, score_params, mask_mod)
    dq = np.zeros(q.shape, dtype=work_dtype)
    dk = np.zeros(k.shape, dtype=work_dtype)
    dv = np.zeros(v.shape, dtype=work_dtype)
    dsinks = np.zeros(pb.heads, dtype=work_dtype) if score.sinks is not None else None
    for blk, inp in _iter_blocks(
        q,
        k,
        v,
        pb,
        scale=_default_scale(scale, pb.d),
        causal=causal,
        window=window,
        keep_mask=keep_mask,
        dropout_p=p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        score=score,
    ):
        seq, hs, kv_index = blk
        out = core(inp, o[seq.q_rows][:, hs], lse[seq.lse_index][hs], do[seq.q_rows][:, hs])
        dq_s, dk_s, dv_s = out[:3]
        dq[seq.q_rows][:, hs] = dq_s
        np.add.at(dk[seq.k_rows], (slice(None), kv_index), dk_s)  # views of dk, dv
        np.add.at(dv[seq.k_rows], (slice(None), kv_index), dv_s)
        if dsinks is not None:
            if len(out) < 4 or out[3] is None:
                raise ValueError("sinks given, but the backward core returned no dsink terms")
            dsinks[hs] += out[3]
    if dsinks is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The float64 numeric core
# ---------------------------------------------------------------------------------------------


def _dropout_factor(inp: SeqInputs, dtype: Any) -> np.ndarray | None:
    """`keep / (1 - p)` per element, or None without a keep-mask."""
    if inp.keep is None:
        return None
    return inp.keep.astype(dtype) * dtype(1.0 / (1.0 - inp.dropout_p))


def masked_softmax(
    s: np.ndarray, visible: np.ndarray, sinks: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax of logits over visible keys: (P, natural-log LSE), empty rows 0/-inf.

    With `sinks` `(h,)` (for `s` of shape `(h, Sq, Sk)`) each head's sink joins the
    denominator and the LSE, so an empty row gets P = 0 and LSE = sink.
    Works in the dtype of `s` (float64 for the reference, float32 for the baseline).
    """
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    sink = None
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, dtype=s.dtype)[:, None], m.shape)
        m = np.maximum(m, sink)
    # The -inf guard: an empty row uses 0 as its base, so no (-inf) - (-inf) is ever formed.
    base = np.where(np.isfinite(m), m, 0).astype(s.dtype)
    e = np.exp(s - base[..., None])
    total = e.sum(axis=-1)
    if sink is not None:
        total = total + np.exp(sink - base)
    empty = ~(total > 0)
    safe = np.where(empty, 1, total).astype(s.dtype)
    lse = np.where(empty, -np.inf, base + np.log(safe)).astype(s.dtype)
    return e / safe[..., None], lse


def scaled_scores(inp: SeqInputs) -> np.ndarray:
    """Scaled scores `scale * q.k`, `(heads, Sq, Sk)` in the working dtype (no modifier)."""
    dt = inp.q.dtype.type
    return (inp.q.transpose(1, 0, 2) @ inp.k.transpose(1, 2, 0)) * dt(inp.scale)


def score_logits(
    inp: SeqInputs, s: np.ndarray | None = None, *, capped_dtype: str | None = None
) -> np.ndarray:
    """The logits `(heads, Sq, Sk)`: `scaled_scores` (or the given `s`) with the chunk's
    softcap and ALiBi applied (`score_mods.logits`; `capped_dtype` rounds tanh's output and
    the capped score, as the baseline does). Equal to `scaled_scores` when neither is on."""
    s = scaled_scores(inp) if s is None else s
    if inp.user is not None:  # the whole logit (a spec refuses softcap and ALiBi beside it)
        return score_mods.user_logits(s, inp.user.mod, inp.user.params, **inp.user.where())
    return score_mods.logits(
        s,
        softcap=inp.softcap,
        alibi_slopes=inp.alibi_slopes,
        shift=inp.alibi_shift,
        capped_dtype=capped_dtype,
    )


def score_grad(inp: SeqInputs, s: np.ndarray) -> np.ndarray | None:
    """d(score_mod)/ds over the scaled scores `s` in their dtype, or None without one."""
    if inp.user is None:
        return None
    return score_mods.user_grad(s, inp.user.mod, inp.user.params, **inp.user.where())


def through_score_grad(ds: np.ndarray, p: np.ndarray, grad: np.ndarray | None) -> np.ndarray:
    """dL/ds from dL/dz = `ds` through a score_mod's derivative `grad` (None: unchanged): `ds *
    grad` where P != 0, and 0 where P = 0 (masked scores, rows without a visible key), where
    the derivative is never used and may be inf or NaN (`log(i - j + 1)` above a causal
    diagonal), as in the kernels. A NaN P (a NaN logit) stays NaN."""
    if grad is None:
        return ds
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(p != 0, ds * grad, 0).astype(ds.dtype)


def _forward64(inp: SeqInputs) -> tuple[np.ndarray, np.ndarray]:
    p, lse = masked_softmax(score_logits(inp), inp.visible, inp.sinks)
    z = _dropout_factor(inp, np.float64)
    if z is not None:
        p = p * z
    o = p @ inp.v.transpose(1, 0, 2)  # (heads, Sq, d)
    return o.transpose(1, 0, 2), lse


def probabilities_from_lse(s: np.ndarray, visible: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """`exp(s - lse)` on visible keys of rows with a finite LSE, else 0 (s: the logits)."""
    ok = visible & np.isfinite(lse)[..., None]
    base = np.where(np.isfinite(lse), lse, 0).astype(s.dtype)
    return np.where(ok, np.exp(np.where(ok, s, 0) - base[..., None]), 0).astype(s.dtype)


def _backward64(
    inp: SeqInputs, o: np.ndarray, lse: np.ndarray, do: np.ndarray
) -> tuple[np.ndarray, ...]:
    s = scaled_scores(inp)
    p = probabilities_from_lse(score_logits(inp, s), inp.visible, lse)  # (h, Sq, Sk)
    z = _dropout_factor(inp, np.float64)
    pz = p if z is None else p * z
    do_h = do.transpose(1, 0, 2)  # (h, Sq, d)
    dv = pz.transpose(0, 2, 1) @ do_h  # (h, Sk, d)
    dp = do_h @ inp.v.transpose(1, 2, 0)  # (h, Sq, Sk)
    if z is not None:
        dp = dp * z
    delta = np.sum(do_h * o.transpose(1, 0, 2), axis=-1)  # (h, Sq) = rowsum(P * dP)
    ds = p * (dp - delta[..., None])  # dL/dz
    cap = score_mods.softcap_factor(s, inp.softcap)
    if cap is not None:
        ds = ds * cap  # dL/ds, s = scale * q.k
    ds = through_score_grad(ds, p, score_grad(inp, s))  # dL/ds through a score_mod
    dq = (ds @ inp.k.transpose(1, 0, 2)) * inp.scale
    dk = (ds.transpose(0, 2, 1) @ inp.q.transpose(1, 0, 2)) * inp.scale
    dsink = None if inp.sinks is None else score_mods.dsink_terms(inp.sinks, lse, delta)
    return dq.transpose(1, 0, 2), dk.transpose(1, 0, 2), dv.transpose(1, 0, 2), dsink


def attention_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: float | None = None,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    keep_mask: Any = None,
    dropout_p: float = 0.0,
    block_mask: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 attention forward: `(o, lse)`.

    q `(batch, Sq, heads, d)`, k, v `(batch, Sk, kv_heads, d)` (varlen: packed `(total, heads,
    d)` with `cu_seqlens_q`, `cu_seqlens_k`); inputs of any float dtype are converted to
    float64. `scale` defaults to `1 / sqrt(d)`. `causal` is 'none', 'top_left' or
    'bottom_right' (or an enum with that `.yaml`); `window = (left, right)`, -1 unbounded, is
    aligned like `causal` and bottom_right when `causal='none'`. `keep_mask` bool
    `(batch, heads, Sq, Sk)` and `dropout_p` apply dropout; `block_mask` bool
    `(layout_heads, Tr, Tc)` at `block_m x block_n` tiles applies block sparsity.

    Score-stage features (`verify.score_mods` has the exact order): `softcap` c > 0 caps the
    scaled score `z = c tanh(z / c)` (0: off); `alibi_slopes` float `(heads,)` or `(batch,
    heads)` subtracts `slope * |i + shift - j|` (shift 0 for top_left, `Sk - Sq` otherwise,
    per sequence); `sinks` float `(heads,)` adds `exp(sink_h)` to every row's softmax
    denominator (and LSE).

    Returns o float64 with q's shape but v's head dim d_v, and the natural-log LSE float64
    `(batch, heads, Sq)` (varlen `(heads, total_q)`); rows with no visible key give o = 0 and
    LSE = -inf (LSE = sink_h with sinks).
    """
    return run_forward(
        _forward64,
        q,
        k,
        v,
        work_dtype=np.float64,
        scale=scale,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        keep_mask=keep_mask,
        dropout_p=dropout_p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )


def attention_backward(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    do: Any,
    *,
    scale: float | None = None,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    keep_mask: Any = None,
    dropout_p: float = 0.0,
    block_mask: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray, ...]:
    """Float64 attention backward: `(dq, dk, dv)` with the shapes of q, k, v, and with
    `sinks` `(dq, dk, dv, dsinks)`, dsinks float64 `(heads,)`.

    Takes the forward's `o` and `lse` as FlashAttention does: P is recomputed as
    `exp(z - lse)` on visible keys (z the logits: scaled scores with softcap / ALiBi) and
    `D_i = rowsum(dO * O)`; `dZ = P (dP - D)`, times `1 - tanh(s / c)^2` with softcap, gives
    dQ and dK (times the scale). `dsinks_h = -sum_{b,i} exp(sink_h - LSE_bhi) D_bhi` (rows
    with LSE -inf give 0). Same arguments and layouts as `attention_forward`; with GQA, dk and
    dv are summed over each group of query heads sharing a key/value head.
    """
    return run_backward(
        _backward64,
        q,
        k,
        v,
        o,
        lse,
        do,
        work_dtype=np.float64,
        scale=scale,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        keep_mask=keep_mask,
        dropout_p=dropout_p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )
