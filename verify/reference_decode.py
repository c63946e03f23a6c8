"""What a decode kernel computes, stated with the one float64 reference (`verify.reference`).

A decode call is varlen attention: sequence b has `seqlen_q` queries and the first
`cache_seqlens[b]` keys of its cache, bottom_right aligned (the queries are the cache's last
`seqlen_q` positions). So the reference packs the queries and each sequence's used cache rows
and calls `reference.attention_forward` (or the same-precision baseline) with cu_seqlens; it
adds no attention maths of its own.

Layouts: q `(batch, seqlen_q, heads, d)`; contiguous caches `(batch, capacity, kv_heads, d)`;
paged caches `(num_pages, page_size, kv_heads, d)` with `block_table (batch, max_pages)`
(`gather_pages` turns them into the contiguous layout). Returns o like q and the natural-log
LSE `(batch, heads, seqlen_q)`; rows with no visible key give 0 and -inf.

The score-stage features pass through unchanged (`softcap`, `alibi_slopes` `(heads,)` or
`(batch, heads)`, `sinks` `(heads,)`; `verify.score_mods`): sequence b of the packed call is
decode sequence b, and its ALiBi distance `|i + cache_seqlens[b] - seqlen_q - j|` is the
bottom_right shift of that sequence, as the kernels define it. A spec's score_mod
(`score_mod`, `score_params`) likewise: i is the new query (0 .. seqlen_q - 1), j the cache row
(0 .. cache_seqlens[b] - 1), seqlen_k = cache_seqlens[b].

FP8 caches (`kv_dtype: e4m3`): pass the caches as uint8 e4m3 codes (or their exact float
values, `verify.fp8.decode`) with `k_descale` / `v_descale` (float32 `(batch, kv_heads)`, or
a scalar: a per-tensor scale). The caches are dequantised in float64, `descale[b, hk] *
value`, exactly (the product of an e4m3 value and a float32 is exact in float64), and the
call proceeds as for a 16-bit cache; the baseline rounds the dequantised values to its dtype
as it rounds every input (FlashAttention-3's FP8 tests: the reference and the baseline both
run on the dequantised inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from flashgen.verify import baseline, reference

__all__ = [
    "decode_baseline",
    "decode_reference",
    "dequantize",
    "gather_pages",
    "merge_reference",
    "to_paged",
]


def dequantize(cache: Any, descale: Any) -> np.ndarray:
    """float64 `descale[b, hk] * cache[b, :, hk, :]` of a contiguous `(batch, seqlen, kv_heads,
    d)` FP8 cache given as uint8 e4m3 codes or their float values; `descale` float32
    `(batch, kv_heads)` or a scalar (broadcast)."""
    from flashgen.verify import fp8

    c = np.asarray(cache)
    vals = fp8.decode(c) if c.dtype == np.uint8 else c.astype(np.float64)
    ds = np.asarray(descale, dtype=np.float32).astype(np.float64)
    if ds.ndim == 0:
        return vals * ds
    if ds.shape != (vals.shape[0], vals.shape[2]):
        raise ValueError(
            f"descale has shape {ds.shape}; expected (batch, kv_heads) = "
            f"{(vals.shape[0], vals.shape[2])} or a scalar"
        )
    return vals * ds[:, None, :, None]


def _dequantized(k_cache: Any, v_cache: Any, k_descale: Any, v_descale: Any) -> tuple:
    if (k_descale is None) != (v_descale is None):
        raise ValueError("give both k_descale and v_descale (an FP8 cache), or neither")
    if k_descale is None:
        return np.asarray(k_cache), np.asarray(v_cache)
    return dequantize(k_cache, k_descale), dequantize(v_cache, v_descale)


def gather_pages(
    pages: np.ndarray, block_table: np.ndarray, cache_seqlens: Sequence[int]
) -> np.ndarray:
    """Contiguous `(batch, max_len, kv_heads, d)` caches from a paged one (rows past a
    sequence's length are zeros and unused)."""
    ps = pages.shape[1]
    lens = [int(x) for x in cache_seqlens]
    out = np.zeros((len(lens), max(lens + [0]), *pages.shape[2:]), dtype=pages.dtype)
    for b, n in enumerate(lens):
        for j0 in range(0, n, ps):
            rows = min(ps, n - j0)
            out[b, j0 : j0 + rows] = pages[int(block_table[b, j0 // ps]), :rows]
    return out


def to_paged(
    cache: np.ndarray,
    cache_seqlens: Sequence[int],
    page_size: int,
    rng: np.random.Generator,
    *,
    spare_pages: int = 2,
    spare_columns: int = 1,
    unused_fill: int = -7,
) -> tuple[np.ndarray, np.ndarray]:
    """A paged copy of a contiguous cache: the used pages of every sequence in random order
    among `spare_pages` unused ones (filled with NaN-like noise), and a block table whose
    columns past a sequence's pages (`spare_columns` extra) hold `unused_fill`, an id the
    kernel must never read. Returns (pages, block_table int32)."""
    lens = [int(x) for x in cache_seqlens]
    used = [-(-n // page_size) for n in lens]
    total = sum(used) + spare_pages
    pages = np.full((total, page_size, *cache.shape[2:]), np.nan, dtype=np.float32)
    order = rng.permutation(total)
    max_pages = max(used + [0]) + spare_columns
    table = np.full((len(lens), max(max_pages, 1)), unused_fill, dtype=np.int32)
    k = 0
    for b, n in enumerate(lens):
        for p in range(used[b]):
            pid = int(order[k])
            k += 1
            rows = min(page_size, n - p * page_size)
            pages[pid, :rows] = cache[b, p * page_size : p * page_size + rows]
            table[b, p] = pid
    return pages, table


def _varlen_call(
    fn: Callable[..., tuple[np.ndarray, np.ndarray]],
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    cache_seqlens: Sequence[int],
    **kwargs: Any,
) -> tuple[np.ndarray, np.ndarray]:
    batch, sq, heads, d = q.shape
    lens = [int(x) for x in cache_seqlens]
    cu_q = (np.arange(batch + 1) * sq).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kp = np.concatenate([k_cache[b, :n] for b, n in enumerate(lens)], axis=0)
    vp = np.concatenate([v_cache[b, :n] for b, n in enumerate(lens)], axis=0)
    o, lse = fn(
        q.reshape(batch * sq, heads, d), kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs
    )
    return o.reshape(batch, sq, heads, d), lse.reshape(heads, batch, sq).transpose(1, 0, 2)


def _mask_kwargs(
    causal: Any,
    window: Sequence[int],
    scale: float | None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
) -> dict[str, Any]:
    name = reference.causal_name(causal)
    if name == "top_left":
        raise ValueError("decode aligns causal masks bottom_right")
    return {
        "causal": name,
        "window": tuple(window),
        "scale": scale,
        "softcap": softcap,
        "alibi_slopes": alibi_slopes,
        "sinks": sinks,
        "score_mod": score_mod,
        "score_params": score_params,
    }


def decode_reference(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Sequence[int],
    *,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 `(o, lse)` of a decode call over contiguous caches (see the module doc);
    `softcap`, `alibi_slopes`, `sinks` as `verify.reference.attention_forward`; FP8 caches
    with `k_descale`, `v_descale`."""
    k_cache, v_cache = _dequantized(k_cache, v_cache, k_descale, v_descale)
    return _varlen_call(
        reference.attention_forward,
        np.asarray(q),
        k_cache,
        v_cache,
        cache_seqlens,
        **_mask_kwargs(
            causal, window, scale, softcap, alibi_slopes, sinks, score_mod, score_params
        ),
    )


def decode_baseline(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Sequence[int],
    *,
    dtype: Any,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Standard attention in `dtype` for the same call (the pass rule's baseline), with the
    same score-stage arguments (`verify.baseline` says where they round); FP8 caches with
    `k_descale`, `v_descale`, dequantised in float64 and then rounded to `dtype`."""
    k_cache, v_cache = _dequantized(k_cache, v_cache, k_descale, v_descale)
    return _varlen_call(
        baseline.attention_forward,
        np.asarray(q),
        k_cache,
        v_cache,
        cache_seqlens,
        dtype=dtype,
        **_mask_kwargs(
            causal, window, scale, softcap, alibi_slopes, sinks, score_mod, score_params
        ),
    )


def merge_reference(o_parts: Any, lse_parts: Any) -> tuple[np.ndarray, np.ndarray]:
    """Float64 merge_states: o_parts `(P, batch, S, heads, d)`, lse_parts `(P, batch, heads,
    S)` -> (o `(batch, S, heads, d)`, lse `(batch, heads, S)`); parts with LSE -inf count for
    nothing, and no part at all gives 0 and -inf."""
    o = np.asarray(o_parts, dtype=np.float64)
    lse = np.asarray(lse_parts, dtype=np.float64)
    m = lse.max(axis=0)
    base = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isfinite(lse), np.exp(lse - base[None]), 0.0)  # (P, b, h, s)
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out_lse = np.where(total > 0, base + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        wn = np.where(total[None] > 0, w / np.where(total > 0, total, 1.0)[None], 0.0)
    safe = np.where(np.isfinite(lse)[:, :, None, :, :].transpose(0, 1, 4, 3, 2), o, 0.0)
    out = np.einsum("pbhs,pbshd->bshd", wn, safe)
    return out, out_lse
