"""What `flash_attn_with_kvcache` and `merge_states` accept, and the decode `KernelSpec` that
serves a call. Imports no torch (tests/test_torch_kvcache_cpu.py runs it without torch or a
GPU); `flashgen.torch.kvcache` describes its tensors with `selection.TensorMeta`.

Every refusal is a `selection.UnsupportedCall` naming the argument and what is allowed.
Kernel choice (docs/torch.md, "Decode with a KV cache"): one decode spec per (dtype, head
dim, paged, mask, target), `gqa: true` (it serves kv_heads == heads as well) and `tile: auto`;
the mask is normalised so that the shipped specs of specs/decode.yaml serve the common calls:

- one query per sequence (`seqlen_q == 1`): `causal` and a window's `right` cannot hide a key
  from the last query, so they are dropped (flash-attn does the same); only `left` remains;
- a left window with `right == 0` (causal sliding window) uses `causal: bottom_right` plus
  `window` (the shipped `causalbr_win` kernels), the same mask as `causal: none` + window.

The score-stage features (`softcap`, `alibi_slopes`, `learnable_sink`) are checked and turned
into the spec's `features` by `selection.score_features`, as for `flash_attn_func`.

Calls that append `k`, `v`, rotate with `rotary_cos`/`rotary_sin`, index the cache with
`cache_batch_idx`, start keys at `cache_leftpad`, bring more than MAX_QUERIES queries, or have a
head dim or page size no decode kernel serves (`decode_serves`) take the composite path
(`flashgen.torch.kvcache_prep`, torch operations around the kernels): `check_prep` checks their
host-side arguments and `kvcache_window` normalises their window as flash-attn's binding does;
`window_pair` reads a window given as a tuple, a list or a tensor.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from flashgen.generator.families import family
from flashgen.generator.families.decode import (
    ERR_PAGE_ID,
    ERR_SEQLEN,
    HEAD_DIMS,
    MAX_QUERIES,
    MAX_SPLITS,
    PAGE_SIZES,
)
from flashgen.generator.features import FEATURES
from flashgen.generator.spec import (
    Causal,
    Dtype,
    KernelKind,
    KernelSpec,
    KvDtype,
)
from flashgen.torch.selection import (
    DTYPES,
    NO_FEATURES,
    TensorMeta,
    UnsupportedCall,
    auto_spec,
    misaligned,
    resolve_mask,
    target_for,
)

__all__ = [
    "CacheInputError",
    "DecodeCall",
    "KvProblem",
    "PrepCall",
    "cache_copy",
    "cache_layout_ok",
    "check_kvcache",
    "check_merge",
    "check_paged_kv",
    "check_prep",
    "decode_mask",
    "decode_spec",
    "describe_errors",
    "kvcache_window",
    "merge_layout_ok",
    "merge_spec",
    "window_pair",
]

INT32_MAX = 2**31 - 1


class CacheInputError(ValueError):
    """The kernel flagged bad cache metadata on the device (only raised when the call asked
    for the check: `check_inputs=True` or FLASHGEN_KVCACHE_CHECK=1)."""


def describe_errors(word: int, capacity: int, num_pages: int | None) -> str:
    """The message of a non-zero error word (bits of `FG_DECODE_ERR_*`, decode_params.h)."""
    parts = []
    if word & ERR_PAGE_ID:
        parts.append(
            f"block_table holds a page id outside [0, {num_pages}) for a page below a "
            "sequence's cache_seqlens (its rows were read as zeros)"
        )
    if word & ERR_SEQLEN:
        parts.append(
            f"cache_seqlens holds an entry below 0 or above the cache's capacity {capacity} "
            "(it was clamped)"
        )
    if word & ~(ERR_PAGE_ID | ERR_SEQLEN):
        parts.append(f"unknown error bits {word:#x}")
    found = "; ".join(parts)
    return f"flashgen.torch: the decode kernel flagged bad input: {found}. Outputs are meaningless."


# --------------------------------------------------------------------------------------------
# The call -> its spec.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeCall:
    """Everything about a decode call that selects a kernel (`features`: the score-stage
    features that are on, `selection.score_features`)."""

    dtype: Dtype
    head_dim: int
    capability: tuple[int, int]
    paged: bool = False
    causal: Causal = Causal.NONE
    window: bool = False
    features: frozenset[str] = NO_FEATURES
    kv_dtype: KvDtype | None = None  # an FP8 cache (flashgen.torch.kvcache_fp8)


def decode_mask(
    causal: bool, window_size: Any, seqlen_q: int
) -> tuple[Causal, bool, tuple[int, int]]:
    """flash-attn's `(causal, window_size)` for `seqlen_q` new queries as `(spec causal, spec
    window, runtime window)` (see the module docstring)."""
    mask, window, (left, right) = resolve_mask(causal, window_size)
    if seqlen_q == 1:  # the one query is the cache's last position: no key lies to its right
        if left < 0:
            return Causal.NONE, False, (-1, -1)
        return Causal.BOTTOM_RIGHT, True, (left, 0)
    if window and right == 0 and left >= 0:
        return Causal.BOTTOM_RIGHT, True, (left, 0)
    return mask, window, (left, right)


@lru_cache(maxsize=None)
def decode_spec(call: DecodeCall) -> KernelSpec:
    """The decode kernel of this call (auto tile for the capability's target)."""
    target = target_for(call.capability)
    fam = family(KernelKind.DECODE, target)
    if not fam.head_dim_ok(call.head_dim):
        raise UnsupportedCall(
            f"head_dim {call.head_dim} has no decode kernel (supported head dims: "
            f"{', '.join(map(str, HEAD_DIMS))})"
        )
    return auto_spec(
        KernelKind.DECODE,
        target,
        {
            "head_dim": call.head_dim,
            "dtype": call.dtype,
            "mask.causal": call.causal,
            "mask.window": call.window,
            "gqa": True,
            "paged": call.paged,
            "kv_dtype": call.kv_dtype,
            **{f.name: f.name in call.features for f in FEATURES},
        },
    )


def merge_spec(dtype: Dtype, head_dim: int, capability: tuple[int, int]) -> KernelSpec:
    """The kernel whose `<name>_merge_states` merges parts of this dtype and head dim: the
    contiguous, unmasked decode kernel (the shipped serving one at d = 128)."""
    return decode_spec(DecodeCall(dtype, head_dim, tuple(capability)))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Argument checks.
# --------------------------------------------------------------------------------------------


def _is_bool(x: Any) -> bool:
    """A Python bool or a bool tensor (which `operator.index` would read as 0 or 1)."""
    return isinstance(x, bool) or str(getattr(x, "dtype", "")) == "torch.bool"


def window_pair(window_size: Any) -> tuple[int, int]:
    """flash-attn's `window_size` as two ints `(left, right)`: a tuple or list of two ints, or
    of two 0-dim integer tensors, or an integer tensor of shape (2,) (flash-attn's own tests
    pass `torch.randint(0, seqlen_k, (2,))`; its C++ binding takes each element through
    `__index__`). Each element is read with `operator.index`, so a tensor's values are copied
    to the host (a sync for a CUDA tensor). bool and floating-point elements are refused."""
    pair = None
    try:
        if len(window_size) == 2:
            left, right = window_size
            if not (_is_bool(left) or _is_bool(right)):
                pair = (operator.index(left), operator.index(right))
    except (TypeError, ValueError, RuntimeError):
        pass
    if pair is None:
        raise UnsupportedCall(
            "window_size must be (left, right): a tuple or list of two ints, or an integer "
            f"tensor of 2 elements; got {window_size!r}"
        )
    return pair


def kvcache_window(causal: bool, window: tuple[int, int], capacity: int) -> tuple[int, int, bool]:
    """`(left, right, advance)` of a `flash_attn_with_kvcache` call that appends, rotates,
    gathers or takes more than 16 queries (the composite path): the window as flash-attn's
    binding normalises it (a side >= the cache's capacity is unbounded, -1) and whether the
    rotary position of query i is `cache_seqlens + i` (`advance`: causal or a window remains
    after that normalisation) or `cache_seqlens` for every query. Refuses what
    `selection.resolve_mask` refuses (sides below -1, a causal flag that is not a bool)."""
    resolve_mask(causal, window)
    left, right = window
    if left >= capacity:
        left = -1
    if right >= capacity:
        right = -1
    return left, right, bool(causal or left >= 0 or right >= 0)


class PrepCall(NamedTuple):
    """The sizes of a `flash_attn_with_kvcache` call on the composite path (appended `k`, `v`,
    rotary, `cache_batch_idx`, `cache_leftpad` or more than MAX_QUERIES queries).
    `capacity`: keys a sequence can hold (contiguous: the cache's rows; paged: max_pages *
    page_size); `cache_rows`: the contiguous cache's first dimension (0 when paged);
    `seqlen_new`: rows of k, v (0 without them); `rotary_dim`: 2 * rotary_cos.shape[1] (0
    without rotary); `rotary_rows`: rotary_cos.shape[0]; `decode`: seqlen_q <= MAX_QUERIES
    and the decode kernels serve the head dim and page size (`decode_serves`); otherwise the
    varlen forward serves the call."""

    batch: int
    seqlen_q: int
    heads: int
    kv_heads: int
    head_dim: int
    paged: bool
    capacity: int
    cache_rows: int
    page_size: int
    num_pages: int
    max_pages: int
    seqlen_new: int
    rotary_dim: int
    rotary_rows: int
    decode: bool


def _check_on_cuda(name: str, t: TensorMeta) -> None:
    if t.device != "cuda":
        raise UnsupportedCall(
            f"{name} is on device {t.device!r}; flashgen kernels run on CUDA devices only "
            "(move the tensors with .cuda())"
        )


def _cache_shapes(q: TensorMeta, k_cache: TensorMeta, v_cache: TensorMeta) -> tuple:
    """(batch, seqlen_q, heads, head_dim, kv_heads) of 4-D q and caches that agree: the caches
    alike, one head dim, kv_heads dividing heads (GQA/MQA); else UnsupportedCall."""
    if k_cache.shape != v_cache.shape:
        raise UnsupportedCall(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the "
            "same shape (the decode kernels take one head dim for k and v: no head_dim_v)"
        )
    batch, sq, heads, d = q.shape
    if k_cache.shape[-1] != d:
        raise UnsupportedCall(
            f"q's head_dim {d} differs from k_cache's {k_cache.shape[-1]}; they must match"
        )
    kv_heads = k_cache.shape[2]
    if kv_heads < 1 or heads < 1 or heads % kv_heads:
        raise UnsupportedCall(
            f"q has {heads} heads and k_cache, v_cache have {kv_heads}: the number of k/v "
            "heads must divide the number of query heads (GQA/MQA)"
        )
    return batch, sq, heads, d, kv_heads


def check_prep(
    q: TensorMeta,
    k_cache: TensorMeta,
    v_cache: TensorMeta,
    *,
    k: TensorMeta | None = None,
    v: TensorMeta | None = None,
    rotary_cos: TensorMeta | None = None,
    rotary_sin: TensorMeta | None = None,
    cache_seqlens: TensorMeta | int | None = None,
    cache_batch_idx: TensorMeta | None = None,
    cache_leftpad: TensorMeta | None = None,
    block_table: TensorMeta | None = None,
    num_splits: int = 0,
    softmax_scale: float = 1.0,
) -> PrepCall:
    """The host-side checks of a composite `flash_attn_with_kvcache` call (shapes, dtypes,
    device types, an int cache_seqlens against the capacity; no tensor values, no strides:
    every tensor is read through torch indexing or a copy) and its sizes. Layouts and rules
    as flash-attn 2.8's (docs/torch.md, "Appending, rotary, batch indices, left padding"):

    - q `(batch, seqlen_q, heads, d)`, float16/bfloat16; caches `(cache_rows, capacity,
      kv_heads, d)` (contiguous) or `(num_pages, page_size, kv_heads, d)` with an int32
      `block_table (batch, max_pages)`;
    - k, v (together) `(batch, seqlen_new, kv_heads, d)` in q's dtype, and cache_seqlens
      given (the keys each sequence holds before the call);
    - rotary_cos, rotary_sin (together, only with k and v) `(rotary_rows, rotary_dim / 2)`
      in q's dtype or float32, rotary_dim <= d, rotary_rows >= capacity;
    - cache_batch_idx, cache_leftpad: int32 `(batch,)`, contiguous caches only.

    The decode kernels' own rules (page sizes, head dims, strides) are checked by
    `check_kvcache` on what they will read, also before anything is written."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_on_cuda(name, t)
    if q.dtype not in DTYPES:
        raise UnsupportedCall(
            f"q has dtype {q.dtype}; flashgen kernels take float16 or bfloat16 "
            "(cast the cache and q with .half() or .bfloat16())"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise UnsupportedCall(f"{name} has dtype {t.dtype} but q has {q.dtype}; all must match")
    paged = block_table is not None
    cache_layout = (
        "(num_pages, page_size, kv_heads, head_dim) with a block_table"
        if paged
        else "(batch, max_seqlen, kv_heads, head_dim)"
    )
    for name, t, layout in (
        ("q", q, "(batch, seqlen_q, heads, head_dim)"),
        ("k_cache", k_cache, cache_layout),
        ("v_cache", v_cache, cache_layout),
    ):
        if len(t.shape) != 4:
            raise UnsupportedCall(
                f"{name} has {len(t.shape)} dimensions {tuple(t.shape)}; it must be {layout}"
            )
    batch, sq, heads, d, kv_heads = _cache_shapes(q, k_cache, v_cache)
    if paged:
        assert block_table is not None
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise UnsupportedCall(
                    f"{name} with a block_table: not served (flash-attn refuses the pair "
                    f"too); allowed: {name}=None with a paged cache (index pages through "
                    "block_table), or a contiguous cache"
                )
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if num_pages < 1 or page_size < 1:
            raise UnsupportedCall(
                f"k_cache {tuple(k_cache.shape)} has no pages or no rows per page; a paged "
                "cache needs num_pages >= 1 and page_size >= 1"
            )
        if len(block_table.shape) != 2:
            raise UnsupportedCall(
                f"block_table must be int32 (batch, max_pages); got {len(block_table.shape)} "
                f"dimensions {tuple(block_table.shape)}"
            )
        max_pages = block_table.shape[1]
        _check_int_vector(
            "block_table", block_table, (batch, max_pages), "page ids, one row per sequence"
        )
        if max_pages < 1:
            raise UnsupportedCall("block_table has no columns; it needs max_pages >= 1")
        capacity, cache_rows = max_pages * page_size, 0
    else:
        num_pages = page_size = max_pages = 0
        cache_rows, capacity = k_cache.shape[0], k_cache.shape[1]
        if cache_batch_idx is None and cache_rows != batch:
            raise UnsupportedCall(
                f"q has batch {batch} but k_cache has {cache_rows}; a contiguous cache is "
                "(batch, max_seqlen, kv_heads, head_dim), or any number of rows with "
                "cache_batch_idx (sequence b reads row cache_batch_idx[b])"
            )
        if cache_batch_idx is not None:
            _check_int_vector("cache_batch_idx", cache_batch_idx, (batch,), "k_cache rows")
            if cache_rows < 1 and batch > 0:
                raise UnsupportedCall(
                    "k_cache has no rows; cache_batch_idx needs a cache of at least one row"
                )
        if cache_leftpad is not None:
            _check_int_vector(
                "cache_leftpad", cache_leftpad, (batch,), "the row where each sequence's keys start"
            )
    if capacity > INT32_MAX:
        raise UnsupportedCall("the cache's capacity must stay below 2^31 keys per sequence")
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise UnsupportedCall(
            f"{given} without {missing}: k and v append new tokens together (allowed: both "
            "or neither)"
        )
    seqlen_new = 0
    if k is not None and v is not None:
        want = (batch, k.shape[1] if len(k.shape) == 4 else "seqlen_new", kv_heads, d)
        for name, t in (("k", k), ("v", v)):
            _check_on_cuda(name, t)
            if t.dtype != q.dtype:
                raise UnsupportedCall(
                    f"{name} has dtype {t.dtype} but q has {q.dtype}; all must match"
                )
            if len(t.shape) != 4 or tuple(t.shape) != want:
                raise UnsupportedCall(
                    f"{name} has shape {tuple(t.shape)}; it must be (batch, seqlen_new, "
                    f"kv_heads, head_dim) = {want} (q's batch and head_dim, the caches' "
                    "kv_heads; k and v alike)"
                )
        seqlen_new = k.shape[1]
        if seqlen_new > capacity:
            raise UnsupportedCall(
                f"k has seqlen_new {seqlen_new}, more than the cache's capacity {capacity} "
                "keys per sequence"
            )
        if cache_seqlens is None:
            raise UnsupportedCall(
                "cache_seqlens is required with k, v (allowed: an int32 (batch,) tensor or an "
                "int): the keys each sequence holds before the call, where k, v are appended"
            )
    if (rotary_cos is None) != (rotary_sin is None):
        raise UnsupportedCall(
            "rotary_cos and rotary_sin: both or neither (allowed: two (rotary_rows, "
            "rotary_dim / 2) tables, or None)"
        )
    rotary_dim = rotary_rows = 0
    if rotary_cos is not None and rotary_sin is not None:
        if k is None:
            raise UnsupportedCall(
                "rotary_cos/rotary_sin need k and v (flash-attn rotates q and the appended "
                "keys, at their positions in the cache): pass the new tokens as k, v"
            )
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check_on_cuda(name, t)
            if len(t.shape) != 2:
                raise UnsupportedCall(
                    f"{name} has {len(t.shape)} dimensions {tuple(t.shape)}; it must be "
                    "(rotary_rows, rotary_dim / 2)"
                )
            if t.dtype not in (q.dtype, "float32"):
                raise UnsupportedCall(
                    f"{name} has dtype {t.dtype}; allowed: q's {q.dtype} (as flash-attn) or float32"
                )
        if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
            raise UnsupportedCall(
                f"rotary_sin {tuple(rotary_sin.shape)} and rotary_cos "
                f"{tuple(rotary_cos.shape)} must have the same shape"
            )
        rotary_rows, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
        if rotary_dim > d:
            raise UnsupportedCall(
                f"rotary_cos has shape {tuple(rotary_cos.shape)}: rotary_dim = 2 * "
                f"{rotary_cos.shape[1]} = {rotary_dim} exceeds head_dim {d} (allowed: "
                f"rotary_dim <= head_dim; the columns past it pass through)"
            )
        if rotary_dim and rotary_rows < capacity:
            raise UnsupportedCall(
                f"rotary_cos has {rotary_rows} rows; it needs at least the cache's capacity "
                f"{capacity} (one row per position the cache holds, as flash-attn requires)"
            )
    if isinstance(cache_seqlens, TensorMeta):
        _check_int_vector("cache_seqlens", cache_seqlens, (batch,), "keys per sequence")
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
            raise UnsupportedCall(
                f"cache_seqlens must be an int32 tensor (batch,), an int or None; got "
                f"{type(cache_seqlens).__name__}"
            )
        if not 0 <= cache_seqlens <= capacity - seqlen_new:
            raise UnsupportedCall(
                f"cache_seqlens={cache_seqlens} is outside 0..{capacity - seqlen_new} (the "
                f"cache's capacity {capacity}, less the {seqlen_new} appended keys)"
            )
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise UnsupportedCall(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise UnsupportedCall(
            f"num_splits={num_splits}: allowed 0 (the heuristic, docs/decode.md) or 1..{MAX_SPLITS}"
        )
    if not (softmax_scale > 0.0) or math.isinf(softmax_scale):
        raise UnsupportedCall(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return PrepCall(
        batch, sq, heads, kv_heads, d, paged, capacity, cache_rows, page_size, num_pages,
        max_pages, seqlen_new, rotary_dim, rotary_rows,
        sq <= MAX_QUERIES and decode_serves(d, page_size if paged else None),
    )  # fmt: skip


def decode_serves(head_dim: int, page_size: int | None) -> bool:
    """Whether the decode kernels serve this head dim (up to the largest of HEAD_DIMS: smaller
    ones are zero-padded to the next of them) and page size (`None`: a contiguous cache).
    Beyond, flash_attn_with_kvcache runs the varlen forward over a packed copy of the used
    keys (`kvcache._packed_attention`), which takes every head dim the forward takes and any
    page size."""
    return head_dim <= HEAD_DIMS[-1] and (page_size is None or page_size in PAGE_SIZES)


def check_paged_kv(
    k: TensorMeta, v: TensorMeta, block_table: TensorMeta, cu_seqlens_k: TensorMeta
) -> tuple[int, int]:
    """The host-side checks of `flash_attn_varlen_func(..., block_table=...)` (paged prefill):
    k, v `(num_pages, page_size, kv_heads, d)` of one shape, an int32 `block_table (batch,
    max_pages)` with batch = `cu_seqlens_k.shape[0] - 1`, all on CUDA. Returns `(page_size,
    num_pages)`. What the varlen forward itself refuses (dtypes, q's shape, head dims) it
    refuses on the packed copy, with its own messages."""
    for name, t in (("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        _check_on_cuda(name, t)
    for name, t in (("k", k), ("v", v)):
        if len(t.shape) != 4:
            raise UnsupportedCall(
                f"{name} has {len(t.shape)} dimensions {tuple(t.shape)}; with a block_table it "
                "must be a paged cache (num_pages, page_size, kv_heads, head_dim)"
            )
    if k.shape != v.shape:
        raise UnsupportedCall(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    num_pages, page_size = k.shape[0], k.shape[1]
    if num_pages < 1 or page_size < 1:
        raise UnsupportedCall(
            f"k {tuple(k.shape)} has no pages or no rows per page; a paged cache needs "
            "num_pages >= 1 and page_size >= 1"
        )
    if cu_seqlens_k.dtype != "int32" or len(cu_seqlens_k.shape) != 1 or cu_seqlens_k.shape[0] < 1:
        raise UnsupportedCall(
            "cu_seqlens_k must be a 1-D int32 CUDA tensor of batch + 1 cumulative lengths; got "
            f"{cu_seqlens_k.dtype} {tuple(cu_seqlens_k.shape)}"
        )
    batch = cu_seqlens_k.shape[0] - 1
    if len(block_table.shape) != 2:
        raise UnsupportedCall(
            f"block_table must be int32 (batch, max_pages); got {len(block_table.shape)} "
            f"dimensions {tuple(block_table.shape)}"
        )
    _check_int_vector(
        "block_table", block_table, (batch, block_table.shape[1]), "page ids, one row per sequence"
    )
    if block_table.shape[1] < 1:
        raise UnsupportedCall("block_table has no columns; it needs max_pages >= 1")
    if block_table.shape[1] * page_size > INT32_MAX:
        raise UnsupportedCall("block_table's max_pages * page_size must stay below 2^31 keys")
    return page_size, num_pages


class KvProblem(NamedTuple):
    """One decode call's sizes. `capacity`: keys a sequence can hold (contiguous: the cache's
    rows; paged: max_pages * page_size). Paged-only fields are 0 for contiguous caches."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    head_dim: int
    dtype: Dtype
    paged: bool
    capacity: int
    page_size: int = 0
    num_pages: int = 0
    max_pages: int = 0
    block_table_stride: int = 0


def used_strides(t: TensorMeta) -> tuple[int, ...]:
    """t's strides with those of size-1 dimensions set to 0 (never multiplied by a non-zero
    index, so any value is as good, and 0 passes the kernels' multiple-of-8 rule); all 0 for
    a tensor without elements (nothing is read; torch gives such views arbitrary strides)."""
    if 0 in t.shape:
        return (0,) * len(t.shape)
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride))


def _layout_message(name: str, t: TensorMeta) -> str | None:
    """Why the decode kernels cannot read the strides of `name`, or None."""
    if t.stride[-1] != 1 and 0 not in t.shape:
        return (
            f"{name}'s last dimension (head_dim) has stride {t.stride[-1]}; it must be "
            "contiguous (stride 1): pass .contiguous()"
        )
    if any(s % 8 for s in used_strides(t)[:-1]):
        return (
            f"{name} has strides {tuple(t.stride)}; every stride but the last must be a "
            "multiple of 8 elements (16 bytes): pass .contiguous()"
        )
    return None


def _check_layout(name: str, t: TensorMeta, layout: str) -> None:
    if len(t.shape) != 4:
        raise UnsupportedCall(
            f"{name} has {len(t.shape)} dimensions {tuple(t.shape)}; it must be {layout}"
        )
    message = _layout_message(name, t)
    if message is not None:
        raise UnsupportedCall(message)


def cache_layout_ok(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """check_kvcache's stride rule (q, k_cache, v_cache) as a predicate: the last dimension
    has stride 1 and every other used stride (`used_strides`) is a multiple of 8 elements;
    a tensor without elements passes. Plain loops, no strings: torch.compile traces it."""
    for n in shape:
        if n == 0:
            return True
    if len(stride) == 0 or stride[-1] != 1:
        return False
    for n, s in zip(shape[:-1], stride[:-1]):
        if n != 1 and s % 8 != 0:
            return False
    return True


def merge_layout_ok(shape: tuple[int, ...], stride: tuple[int, ...], vec: int) -> bool:
    """check_merge's stride rule for o_parts (vec: 8 elements of 16 bits, 4 of float32)."""
    if len(stride) == 0 or stride[-1] != 1:
        return False
    for n in shape:
        if n == 0:
            return True
    for n, s in zip(shape[:-1], stride[:-1]):
        if n != 1 and s % vec != 0:
            return False
    return True


ALIGNED_MESSAGE = (
    "{name} starts at an address that is not 16-byte aligned (a view that begins "
    "mid-vector?): pass .contiguous()"
)  # the decode op's (ops._check_aligned)


def cache_copy(
    name: str,
    t: TensorMeta,
    storage_offset: int,
    head_dim: int,
    padded: int,
    *,
    written: bool,
) -> bool:
    """Whether flash_attn_with_kvcache reads the cache `name` (k_cache or v_cache, described
    by `t` and its storage offset) through a copy: when the call runs at a zero-padded head
    dim (`padded` != `head_dim`, `selection.padded_head_dim`), or when the decode kernels
    cannot read its layout (`cache_layout_ok`, or a first element off a 16-byte boundary).
    A read-only cache may be copied (the whole tensor, per call: docs/torch.md says what it
    costs). A cache the call writes in place (appended `k`, `v`) must not be: the new rows
    would land in the copy, not in the caller's cache. Such a call is refused, naming the
    head dim and the served ones, or with the layout's own message. (`flash_attn_with_kvcache`
    appends `k`, `v` with torch operations on the caller's caches before the kernel reads
    them (`kvcache_prep.append`), so the kernel may then read them through a copy: it passes
    `written=False`; the rule stays for a kernel that would write the caches itself.)"""
    layout = _layout_message(name, t) if len(t.shape) else None
    aligned = not misaligned(t.shape, storage_offset)
    if padded == head_dim and layout is None and aligned:
        return False
    if written:
        if padded != head_dim:
            dims = ", ".join(map(str, HEAD_DIMS))
            raise UnsupportedCall(
                f"{name} has head_dim {head_dim}, which has no decode kernel (decode kernels "
                f"serve head dims {dims}); such a cache is read through a copy zero-padded "
                f"to {padded}, but this call writes k, v into {name} in place, which a copy "
                f"cannot do: allocate the caches with head_dim {padded} (zero columns past "
                f"{head_dim}) and pad q, k, v to it"
            )
        raise UnsupportedCall(layout or ALIGNED_MESSAGE.format(name=name))
    return True


def _check_int_vector(name: str, t: TensorMeta, shape: tuple[int, ...], what: str) -> None:
    if t.device != "cuda":
        raise UnsupportedCall(
            f"{name} is on device {t.device!r}; it must be on the CUDA device of q"
        )
    if t.dtype != "int32" or tuple(t.shape) != shape:
        raise UnsupportedCall(
            f"{name} must be an int32 tensor of shape {shape} ({what}); got {t.dtype} "
            f"{tuple(t.shape)}"
        )
    if shape and shape[-1] > 1 and t.stride[-1] != 1:
        raise UnsupportedCall(
            f"{name}'s last dimension has stride {t.stride[-1]}; it must be 1: pass .contiguous()"
        )


def check_kvcache(
    q: TensorMeta,
    k_cache: TensorMeta,
    v_cache: TensorMeta,
    *,
    cache_seqlens: TensorMeta | int | None = None,
    block_table: TensorMeta | None = None,
    num_splits: int = 0,
    softmax_scale: float = 1.0,
) -> KvProblem:
    """Validate one call's tensors (not their devices' identity nor pointers: the caller's)
    and return its sizes. Layouts as flash-attn's `flash_attn_with_kvcache` (docs/torch.md)."""
    paged = block_table is not None
    cache_layout = (
        "(num_pages, page_size, kv_heads, head_dim) with a block_table"
        if paged
        else "(batch, max_seqlen, kv_heads, head_dim)"
    )
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    for name, t in named:
        if t.device != "cuda":
            raise UnsupportedCall(
                f"{name} is on device {t.device!r}; flashgen kernels run on CUDA devices only "
                "(move the tensors with .cuda())"
            )
    if q.dtype not in DTYPES:
        raise UnsupportedCall(
            f"q has dtype {q.dtype}; flashgen decode kernels take float16 or bfloat16 "
            "(cast the cache and q with .half() or .bfloat16())"
        )
    dtype = DTYPES[q.dtype]
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            raise UnsupportedCall(f"{name} has dtype {t.dtype} but q has {q.dtype}; all must match")
    _check_layout("q", q, "(batch, seqlen_q, heads, head_dim)")
    _check_layout("k_cache", k_cache, cache_layout)
    _check_layout("v_cache", v_cache, cache_layout)
    batch, sq, heads, d, kv_heads = _cache_shapes(q, k_cache, v_cache)
    if sq > MAX_QUERIES:
        raise UnsupportedCall(
            f"q has seqlen_q {sq}; decode kernels take 1..{MAX_QUERIES} new queries per "
            "sequence (flash_attn_with_kvcache serves longer chunks with the varlen forward)"
        )
    if paged:
        assert block_table is not None
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if page_size not in PAGE_SIZES:
            raise UnsupportedCall(
                f"k_cache has page_size {page_size} (its second dimension); paged caches take "
                f"a power of two in {PAGE_SIZES[0]}..{PAGE_SIZES[-1]}"
            )
        if num_pages < 1:
            raise UnsupportedCall("k_cache has no pages; a paged cache needs num_pages >= 1")
        if len(block_table.shape) != 2:
            raise UnsupportedCall(
                f"block_table must be int32 (batch, max_pages); got {len(block_table.shape)} "
                f"dimensions {tuple(block_table.shape)}"
            )
        max_pages = block_table.shape[1]
        _check_int_vector(
            "block_table", block_table, (batch, max_pages), "page ids, one row per sequence"
        )
        if max_pages < 1:
            raise UnsupportedCall("block_table has no columns; it needs max_pages >= 1")
        row_stride = block_table.stride[0] if batch > 1 else max_pages
        if row_stride < max_pages:
            raise UnsupportedCall(
                f"block_table's row stride {row_stride} is below its {max_pages} columns: pass "
                ".contiguous()"
            )
        if max_pages * page_size > INT32_MAX:
            raise UnsupportedCall("block_table's max_pages * page_size must stay below 2^31 keys")
        capacity = max_pages * page_size
        extra = (page_size, num_pages, max_pages, row_stride)
    else:
        if k_cache.shape[0] != batch:
            raise UnsupportedCall(
                f"q has batch {batch} but k_cache has {k_cache.shape[0]}; a contiguous cache "
                "is (batch, max_seqlen, kv_heads, head_dim), or any number of rows with "
                "cache_batch_idx (flash_attn_with_kvcache)"
            )
        capacity = k_cache.shape[1]
        if capacity > INT32_MAX:
            raise UnsupportedCall("k_cache's max_seqlen must stay below 2^31 keys")
        extra = (0, 0, 0, 0)
    if isinstance(cache_seqlens, TensorMeta):
        _check_int_vector("cache_seqlens", cache_seqlens, (batch,), "keys per sequence")
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
            raise UnsupportedCall(
                f"cache_seqlens must be an int32 tensor (batch,), an int or None; got "
                f"{type(cache_seqlens).__name__}"
            )
        if not 0 <= cache_seqlens <= capacity:
            raise UnsupportedCall(
                f"cache_seqlens={cache_seqlens} is outside 0..{capacity} (the cache's capacity)"
            )
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise UnsupportedCall(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise UnsupportedCall(
            f"num_splits={num_splits}: allowed 0 (the heuristic, docs/decode.md) or 1..{MAX_SPLITS}"
        )
    if not (softmax_scale > 0.0) or math.isinf(softmax_scale):
        raise UnsupportedCall(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return KvProblem(batch, heads, kv_heads, sq, d, dtype, paged, capacity, *extra)


def check_merge(
    o_parts: TensorMeta, lse_parts: TensorMeta, out_dtype: str | None
) -> tuple[Dtype, bool]:
    """Validate merge_states' inputs; returns (the output's dtype, whether o_parts has it)."""
    for name, t in (("o_parts", o_parts), ("lse_parts", lse_parts)):
        if t.device != "cuda":
            raise UnsupportedCall(
                f"{name} is on device {t.device!r}; flashgen kernels run on CUDA devices only"
            )
    if len(o_parts.shape) != 5:
        raise UnsupportedCall(
            f"o_parts has {len(o_parts.shape)} dimensions {tuple(o_parts.shape)}; it must be "
            "(parts, batch, seqlen_q, heads, head_dim)"
        )
    parts, batch, sq, heads, d = o_parts.shape
    if lse_parts.dtype != "float32" or tuple(lse_parts.shape) != (parts, batch, heads, sq):
        raise UnsupportedCall(
            f"lse_parts must be float32 {(parts, batch, heads, sq)} (parts, batch, heads, "
            f"seqlen_q); got {lse_parts.dtype} {tuple(lse_parts.shape)}"
        )
    if sq > 1 and lse_parts.stride[-1] != 1:
        raise UnsupportedCall(
            f"lse_parts' last dimension has stride {lse_parts.stride[-1]}; it must be 1"
        )
    if parts < 1:
        raise UnsupportedCall("o_parts has no parts; merge_states needs at least one")
    if o_parts.dtype in DTYPES:
        if out_dtype is not None and out_dtype != o_parts.dtype:
            raise UnsupportedCall(
                f"out_dtype {out_dtype} differs from o_parts' {o_parts.dtype}: parts in "
                "float16/bfloat16 merge into their own dtype (pass float32 parts to choose)"
            )
        dtype, in_dtype, vec = DTYPES[o_parts.dtype], True, 8
    elif o_parts.dtype == "float32":
        if out_dtype not in DTYPES:
            raise UnsupportedCall(
                f"out_dtype={out_dtype}: float32 o_parts need out_dtype torch.float16 or "
                "torch.bfloat16 (the merged output's dtype)"
            )
        dtype, in_dtype, vec = DTYPES[out_dtype], False, 4
    else:
        raise UnsupportedCall(
            f"o_parts has dtype {o_parts.dtype}; merge_states takes float32, float16 or bfloat16"
        )
    if d not in HEAD_DIMS:
        raise UnsupportedCall(
            f"head_dim {d} has no merge_states kernel (supported head dims: "
            f"{', '.join(map(str, HEAD_DIMS))})"
        )
    if o_parts.stride[-1] != 1:
        raise UnsupportedCall(
            f"o_parts' last dimension (head_dim) has stride {o_parts.stride[-1]}; it must be 1"
        )
    if any(s % vec for s in used_strides(o_parts)[:-1]):
        raise UnsupportedCall(
            f"o_parts has strides {tuple(o_parts.stride)}; every stride but the last must be a "
            f"multiple of 16 bytes ({vec} elements): pass .contiguous()"
        )
    return dtype, in_dtype
