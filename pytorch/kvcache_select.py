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
"""

from __future__ import annotations

import math
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
    "cache_copy",
    "cache_layout_ok",
    "check_features",
    "check_kvcache",
    "check_merge",
    "decode_mask",
    "decode_spec",
    "describe_errors",
    "merge_layout_ok",
    "merge_spec",
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


def check_features(
    *,
    k: bool = False,
    v: bool = False,
    rotary_cos: bool = False,
    rotary_sin: bool = False,
    cache_batch_idx: bool = False,
    cache_leftpad: bool = False,
) -> None:
    """Refuse flash-attn features flashgen does not implement (booleans: "was given"). The
    score-stage ones (softcap, alibi_slopes, learnable_sink) are served:
    `selection.score_features` checks them."""
    if k or v:
        names = " and ".join(n for n, on in (("k", k), ("v", v)) if on)
        raise UnsupportedCall(
            f"{names}: appending new tokens to the cache is not implemented (allowed: None); "
            "write them into k_cache/v_cache first (e.g. k_cache[b, n:n + s] = k[b]) and pass "
            "cache_seqlens that include them"
        )
    if rotary_cos or rotary_sin:
        raise UnsupportedCall(
            "rotary_cos/rotary_sin: rotary embedding is not implemented (allowed: None); "
            "apply it to q, and to the keys before writing them into the cache, yourself"
        )
    if cache_batch_idx:
        raise UnsupportedCall(
            "cache_batch_idx: indexing the cache's batch is not implemented (allowed: None); "
            "use a block_table (paged cache) or pass k_cache[cache_batch_idx]"
        )
    if cache_leftpad:
        raise UnsupportedCall(
            "cache_leftpad: left-padded caches are not implemented (allowed: None); every "
            "sequence's keys start at row 0"
        )


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
    head dim and the served ones, or with the layout's own message. (flashgen does not
    append yet: `check_features` refuses `k`, `v` first, so today every cache is read-only
    here; this rule is what an appending call will meet.)"""
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
    if k_cache.shape != v_cache.shape:
        raise UnsupportedCall(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the "
            "same shape"
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
    if sq > MAX_QUERIES:
        raise UnsupportedCall(
            f"q has seqlen_q {sq}; decode kernels take 1..{MAX_QUERIES} new queries per "
            "sequence (for longer chunks, e.g. a prefill, use flash_attn_func or "
            "flash_attn_varlen_func)"
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
                "is (batch, max_seqlen, kv_heads, head_dim) (cache_batch_idx is not "
                "implemented)"
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
