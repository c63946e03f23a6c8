"""What `flash_attn_with_kvcache` and `flash_attn_varlen_func(block_table=...)` do around the
kernels, in torch operations (no kernel of flashgen's; device-agnostic, so the CPU tests run
them on CPU tensors): rotary embedding, appending new keys and values to a contiguous or
paged cache in place, and the copies of cache rows a kernel cannot read where they lie.
flash-attn 2.8 does the same inside its kernels; the definitions here are its (docs/torch.md,
"Appending, rotary, batch indices, left padding").

Layouts: q `(batch, seqlen_q, heads, d)`; new keys and values k, v `(batch, seqlen_new,
kv_heads, d)`; a contiguous cache `(cache_rows, capacity, kv_heads, d)` (sequence b lives in
row b, or in row `cache_batch_idx[b]`), a paged one `(num_pages, page_size, kv_heads, d)` with
an int32 `block_table (batch, max_pages)` (key j of sequence b is row `j % page_size` of page
`block_table[b, j // page_size]`); `cache_seqlens` int32 `(batch,)`: the keys each sequence
holds before the call, as absolute cache positions (with `cache_leftpad`, its keys are the
positions `cache_leftpad[b] .. cache_seqlens[b] - 1`). Positions and lengths are in keys.

Nothing here reads or writes outside a tensor: every index is clamped into its tensor, and an
appended row whose destination is out of range (a bad `cache_seqlens`, `cache_batch_idx` or
page id) is dropped, not written (`append`). Only `check_values` and `paged_total` copy values
to the host (one small device-to-host copy each, i.e. a sync).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = [
    "Checked",
    "append",
    "cache_rows",
    "check_values",
    "cumulative",
    "pack",
    "paged_total",
    "positions",
    "rotate",
]

_I64 = torch.int64


def positions(start: Tensor, n: int, advance: bool = True) -> Tensor:
    """int64 `(batch, n)` rotary positions of n rows per sequence: `start[b] + i` for row i
    (`advance`), or `start[b]` for every row. flash-attn's: appended key i of sequence b sits at
    `cache_seqlens[b] + i`; query i at `cache_seqlens[b] + i` when the call is causal or local
    (a window remains), else every query at `cache_seqlens[b]`."""
    base = start.to(_I64).reshape(-1, 1)
    if not advance:
        return base.expand(base.shape[0], n)
    return base + torch.arange(n, dtype=_I64, device=start.device)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, *, interleaved: bool) -> Tensor:
    """x `(batch, s, heads, d)` with rotary embedding at positions `pos` `(batch, s)`.

    `cos`, `sin` are `(rows, r / 2)` tables (rotary_dim r = 2 * cos.shape[1] <= d): with
    c = cos[p], s = sin[p] at a row's position p, each pair (x1, x2) of its first r columns
    becomes `(x1 c - x2 s, x2 c + x1 s)`; the pairs are columns (2i, 2i + 1) when
    `interleaved` (GPT-J) and (i, i + r / 2) otherwise (GPT-NeoX), i in 0..r/2 - 1, with
    c = cos[p, i]. Columns r..d - 1 pass through unchanged. Computed in float32 from x, cos
    and sin as given and rounded once to x's dtype, as flash-attn's kernels do. Positions are
    clamped to the table (flash-attn reads past its end there; `check_values` refuses such
    calls when it runs). Returns a new tensor, or x itself when r == 0 or the table is empty."""
    half = cos.shape[-1]
    rows = cos.shape[0]
    if half == 0 or rows == 0:
        return x
    r = 2 * half
    at = pos.clamp(0, rows - 1)
    c = cos[at].to(torch.float32).unsqueeze(2)  # (batch, s, 1, r / 2): one per head
    s = sin[at].to(torch.float32).unsqueeze(2)
    xr = x[..., :r].to(torch.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if interleaved:
        rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((o1, o2), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., r:]), dim=-1)


# --------------------------------------------------------------------------------------------
# Appending in place
# --------------------------------------------------------------------------------------------


def _destinations(
    cache: Tensor,
    cache_seqlens: Tensor,
    n: int,
    cache_batch_idx: Optional[Tensor],
    block_table: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """Flat `(batch * n,)` (first index, second index, valid) of the cache rows that appended
    row i of sequence b goes to: (row, position) of a contiguous cache, (page, row in page) of
    a paged one. Invalid destinations hold arbitrary in-range-or-not values (`_write` replaces
    them)."""
    pos = positions(cache_seqlens, n)
    batch = pos.shape[0]
    if block_table is None:
        rows, cap = cache.shape[0], cache.shape[1]
        if cache_batch_idx is None:
            row = torch.arange(batch, dtype=_I64, device=cache.device)
        else:
            row = cache_batch_idx.to(_I64)
        row = row.reshape(-1, 1).expand(batch, n)
        valid = (pos >= 0) & (pos < cap) & (row >= 0) & (row < rows)
        return row.reshape(-1), pos.reshape(-1), valid.reshape(-1)
    pages, size = cache.shape[0], cache.shape[1]
    cols = block_table.shape[1]
    col = torch.div(pos, size, rounding_mode="floor")
    page = block_table.to(_I64).gather(1, col.clamp(0, cols - 1))
    valid = (pos >= 0) & (col < cols) & (page >= 0) & (page < pages)
    return page.reshape(-1), pos.remainder(size).reshape(-1), valid.reshape(-1)


def _write(cache: Tensor, first: Tensor, second: Tensor, valid: Tensor, values: Tensor) -> None:
    """cache[first[i], second[i]] = values[i] where valid[i], in place, without a sync: each
    invalid row is redirected to repeat the first valid row's write (same destination, same
    value), or, when no row is valid, to rewrite cache[0, 0] with its own value. Rows that
    collide then write equal values, so the outcome does not depend on the order of writes;
    no invalid index reaches the cache."""
    vals = values.reshape(-1, *cache.shape[2:])
    keep = valid.to(torch.int32)
    at = keep.argmax().reshape(1)  # the first valid row (0 when there is none); no sync:
    some = keep.amax() > 0  # index_select, not a 0-dim index (which would read it)
    to_first = torch.where(some, first.index_select(0, at), 0)
    to_second = torch.where(some, second.index_select(0, at), 0)
    fill = torch.where(some, vals.index_select(0, at), cache[0, 0].unsqueeze(0))
    first = torch.where(valid, first, to_first)
    second = torch.where(valid, second, to_second)
    vals = torch.where(valid.reshape(-1, *([1] * (vals.dim() - 1))), vals, fill)
    cache.index_put_((first, second), vals)


def append(
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    cache_seqlens: Tensor,
    *,
    cache_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
) -> None:
    """Write k, v `(batch, n, kv_heads, d)` into the caches, in place: row i of sequence b
    goes to position `cache_seqlens[b] + i` of cache row b (`cache_batch_idx[b]` when given),
    or, paged, to row `p % page_size` of page `block_table[b, p // page_size]` for that
    position p (flash-attn's `flash_attn_with_kvcache` with k, v). The caches must have k's
    dtype. A row whose position is outside `[0, capacity)`, whose cache row is outside the
    cache or whose page id is outside `[0, num_pages)` is dropped (nothing is written for it);
    the other rows are written. Duplicate destinations (repeated `cache_batch_idx` entries, or
    pages shared by two sequences) keep one of the rows written there, as in flash-attn. No
    sync: the write is a handful of small kernels, `batch * n * kv_heads * d` elements each
    for k and v."""
    batch, n = k.shape[0], k.shape[1]
    if batch == 0 or n == 0 or k_cache.numel() == 0:
        return
    first, second, valid = _destinations(k_cache, cache_seqlens, n, cache_batch_idx, block_table)
    _write(k_cache, first, second, valid, k)
    _write(v_cache, first, second, valid, v)


# --------------------------------------------------------------------------------------------
# Copies for the kernels
# --------------------------------------------------------------------------------------------


def cache_rows(
    cache: Tensor,
    batch: int,
    *,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
) -> Tensor:
    """A copy `(batch, capacity, kv_heads, d)` of a contiguous cache in which sequence b's keys
    start at position 0: row b holds positions `cache_leftpad[b] ..` (0 without it) of cache row
    `cache_batch_idx[b]` (b without it). The decode kernels have neither a batch indirection
    nor a key-start offset; they read this copy with lengths `cache_seqlens - cache_leftpad`.
    Its size is fixed by the shapes (no sync): every sequence's whole capacity, i.e. per call a
    read and a write of `batch * capacity * kv_heads * d` elements of each cache, whatever the
    lengths. Rows past a sequence's length hold clamped copies of its last position (never
    read: the kernel stops at the length)."""
    rows, cap = cache.shape[0], cache.shape[1]
    if rows == 0 or cap == 0 or batch == 0:
        return cache.new_zeros((batch, *cache.shape[1:]))
    device = cache.device
    if cache_batch_idx is None:
        row = torch.arange(batch, dtype=_I64, device=device)
    else:
        row = cache_batch_idx.to(_I64).clamp(0, rows - 1)
    pos = torch.arange(cap, dtype=_I64, device=device).expand(batch, cap)
    if cache_leftpad is not None:
        pos = (pos + cache_leftpad.to(_I64).reshape(-1, 1)).clamp(0, cap - 1)
    return cache[row.reshape(-1, 1), pos]


def cumulative(lengths: Tensor) -> Tensor:
    """int32 `(batch + 1,)` cumulative lengths `[0, l0, l0 + l1, ...]` (varlen's cu_seqlens)."""
    zero = torch.zeros(1, dtype=_I64, device=lengths.device)
    return torch.cat((zero, torch.cumsum(lengths.to(_I64), 0))).to(torch.int32)


def pack(
    cache: Tensor,
    cu_seqlens: Tensor,
    total: int,
    *,
    lengths: Optional[Tensor] = None,
    starts: Optional[Tensor] = None,
    cache_batch_idx: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    new: Optional[Tensor] = None,
) -> Tensor:
    """A packed `(total, kv_heads, d)` copy for the varlen forward: rows `cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1` hold sequence b's keys, first `lengths[b]` of them read from the
    cache at positions `starts[b] ..` (0 without starts; lengths default to the whole span) of
    row `cache_batch_idx[b]` (b) or of its pages (`block_table`), then, with `new` `(batch,
    n, kv_heads, d)`, its n new rows (`lengths[b] + n == cu_seqlens[b + 1] - cu_seqlens[b]`).
    Rows before `cu_seqlens[0]` hold arbitrary cache rows. `total` (>= cu_seqlens[-1]) is a
    host int, so the copy is exactly the used rows: a read and a write of `total * kv_heads
    * d` elements (the caller paid a sync to learn `total`: `check_values`, `paged_total`)."""
    batch = cu_seqlens.shape[0] - 1
    tail = cache.shape[2:]
    if total <= 0 or batch <= 0:
        return cache.new_zeros((max(total, 0), *tail))
    cu = cu_seqlens.to(_I64)
    device = cache.device
    if cache.shape[0] == 0 or cache.shape[1] == 0:  # a cache of capacity 0: only new rows
        packed = cache.new_zeros((total, *tail))
    else:
        t = torch.arange(total, dtype=_I64, device=device)
        b = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=batch - 1)
        pos = t - cu[b]
        if starts is not None:
            pos = pos + starts.to(_I64)[b]
        pos = pos.clamp(min=0)
        if block_table is None:
            rows, cap = cache.shape[0], cache.shape[1]
            row = b if cache_batch_idx is None else cache_batch_idx.to(_I64)[b]
            packed = cache[row.clamp(0, rows - 1), pos.clamp(max=cap - 1)]
        else:
            pages, size = cache.shape[0], cache.shape[1]
            cols = block_table.shape[1]
            col = torch.div(pos, size, rounding_mode="floor").clamp(max=cols - 1)
            page = block_table.to(_I64)[b, col].clamp(0, pages - 1)
            packed = cache[page, pos.remainder(size)]
    if new is not None and new.shape[1] > 0:
        n = new.shape[1]
        first = cu[:-1] if lengths is None else cu[:-1] + lengths.to(_I64)
        dest = first.reshape(-1, 1) + torch.arange(n, dtype=_I64, device=device)
        packed.index_copy_(0, dest.reshape(-1).clamp(0, total - 1), new.reshape(-1, *tail))
    return packed


# --------------------------------------------------------------------------------------------
# Values on the device, checked on the host
# --------------------------------------------------------------------------------------------


class Checked(NamedTuple):
    """What `check_values` learnt (host ints): the total and the longest number of keys the
    sequences hold after the append (from `cache_leftpad` on)."""

    total: int
    longest: int


def _first_bad(mask: Tensor, values: Tensor) -> list[Tensor]:
    """[how many entries are bad, the first bad index, its value] (int64 scalars)."""
    at = mask.to(torch.int32).argmax().reshape(1)
    first = values.reshape(-1).index_select(0, at).reshape(())
    return [mask.sum().to(_I64), at.reshape(()).to(_I64), first.to(_I64)]


def _used_pages(keys: Tensor, block_table: Tensor, page_size: int, num_pages: int) -> Tensor:
    """(bad rows mask (batch,), the first bad page id of each row (batch,)): entries of the
    pages that hold one of a sequence's `keys` keys, outside `[0, num_pages)`."""
    cols = block_table.shape[1]
    used = torch.div(keys.clamp(min=0) + page_size - 1, page_size, rounding_mode="floor")
    ids = block_table.to(_I64)
    col = torch.arange(cols, dtype=_I64, device=ids.device)
    bad = (col < used.reshape(-1, 1)) & ((ids < 0) | (ids >= num_pages))
    return bad.any(1), ids.gather(1, bad.to(torch.int32).argmax(1, keepdim=True)).reshape(-1)


def check_values(
    cache_seqlens: Tensor,
    *,
    capacity: int,
    seqlen_new: int = 0,
    cache_leftpad: Optional[Tensor] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_rows: int = 0,
    block_table: Optional[Tensor] = None,
    page_size: int = 0,
    num_pages: int = 0,
    rotary_rows: int = 0,
    rotary_last: Optional[int] = None,
) -> Checked:
    """The device values of a `flash_attn_with_kvcache` call, checked before anything is
    written, with one device-to-host copy (a sync): `cache_seqlens` in `0..capacity -
    seqlen_new`; `cache_leftpad` in `0..cache_seqlens[b]`; `cache_batch_idx` in
    `0..cache_rows - 1`; the block-table entries of the pages that hold a key (after the
    append) in `[0, num_pages)`; with `rotary_last` (the last query's offset past
    `cache_seqlens`; None without rotary) the positions `cache_seqlens[b] + rotary_last` below
    `rotary_rows`. Raises `UnsupportedCall` naming the first bad argument, the first bad
    entry and its value, and the allowed range; returns the key counts the copies need."""
    batch = cache_seqlens.shape[0]
    if batch == 0:
        return Checked(0, 0)
    lens = cache_seqlens.to(_I64)
    start = torch.zeros_like(lens) if cache_leftpad is None else cache_leftpad.to(_I64)
    keys = lens + seqlen_new - start
    stats = [keys.clamp(min=0).sum(), keys.max()]
    checks = []
    limit = capacity - seqlen_new
    checks.append(("cache_seqlens", (lens < 0) | (lens > limit), lens))
    if cache_leftpad is not None:
        checks.append(("cache_leftpad", (start < 0) | (start > lens), start))
    if cache_batch_idx is not None:
        idx = cache_batch_idx.to(_I64)
        checks.append(("cache_batch_idx", (idx < 0) | (idx >= cache_rows), idx))
    if block_table is not None:
        bad, ids = _used_pages(lens + seqlen_new, block_table, page_size, num_pages)
        checks.append(("block_table", bad, ids))
    if rotary_last is not None:
        last = lens + rotary_last
        checks.append(("rotary_cos", (last < 0) | (last >= rotary_rows), last))
    for _, mask, values in checks:
        stats += _first_bad(mask, values)
    got = torch.stack(stats).tolist()  # the one device-to-host copy
    total, longest = int(got[0]), int(got[1])
    for i, (name, _, _) in enumerate(checks):
        count, b, value = got[2 + 3 * i : 5 + 3 * i]
        if count:
            raise UnsupportedCall(
                _value_message(
                    name, int(count), int(b), int(value), capacity, seqlen_new, cache_rows,
                    num_pages, rotary_rows, rotary_last,
                )
            )  # fmt: skip
    return Checked(total, longest)


def _value_message(
    name: str, count: int, b: int, value: int, capacity: int, seqlen_new: int, rows: int,
    num_pages: int, rotary_rows: int, rotary_last: Optional[int],
) -> str:  # fmt: skip
    many = f" ({count} entries are)" if count > 1 else ""
    if name == "cache_seqlens":
        return (
            f"cache_seqlens[{b}] = {value} is outside 0..{capacity - seqlen_new}{many}: "
            f"allowed 0..capacity - seqlen_new (the cache holds {capacity} keys per sequence "
            f"and the call appends {seqlen_new}); nothing was written"
        )
    if name == "cache_leftpad":
        return (
            f"cache_leftpad[{b}] = {value} is outside 0..cache_seqlens[{b}]{many}: a sequence's "
            "keys start at cache_leftpad and end before cache_seqlens; nothing was written"
        )
    if name == "cache_batch_idx":
        return (
            f"cache_batch_idx[{b}] = {value} is outside 0..{rows - 1} (the rows of k_cache)"
            f"{many}; nothing was written"
        )
    if name == "block_table":
        return (
            f"block_table row {b} holds page id {value}, outside [0, {num_pages}), for a page "
            f"that holds one of the sequence's keys{many.replace('entries', 'rows')}; nothing "
            "was written"
        )
    return (
        f"rotary_cos has {rotary_rows} rows but sequence {b}'s last query sits at position "
        f"{value} (cache_seqlens + {rotary_last}){many}: allowed positions 0..{rotary_rows - 1}; "
        "nothing was written"
    )


def paged_total(
    cu_seqlens_k: Tensor, block_table: Tensor, *, page_size: int, num_pages: int
) -> int:
    """`cu_seqlens_k[-1]` of a paged varlen call, checked, with one device-to-host copy:
    `cu_seqlens_k[0] >= 0`, every sequence's length `cu_seqlens_k[b + 1] - cu_seqlens_k[b]`
    in `0..max_pages * page_size` and the block-table entries of its pages in
    `[0, num_pages)`. Raises `UnsupportedCall` naming the first bad argument."""
    cu = cu_seqlens_k.to(_I64)
    capacity = block_table.shape[1] * page_size
    if cu.shape[0] < 2:
        return max(int(cu[-1]), 0) if cu.shape[0] else 0
    lens = cu[1:] - cu[:-1]
    bad, ids = _used_pages(lens, block_table, page_size, num_pages)
    stats = [cu[-1], cu[0]] + _first_bad((lens < 0) | (lens > capacity), lens)
    stats += _first_bad(bad, ids)
    got = [int(x) for x in torch.stack(stats).tolist()]
    if got[1] < 0:
        raise UnsupportedCall(f"cu_seqlens_k[0] = {got[1]}: cumulative lengths start at >= 0")
    if got[2]:
        raise UnsupportedCall(
            f"cu_seqlens_k gives sequence {got[3]} the length {got[4]}: allowed 0..{capacity} "
            f"(block_table's {block_table.shape[1]} pages of {page_size} keys)"
        )
    if got[5]:
        raise UnsupportedCall(
            f"block_table row {got[6]} holds page id {got[7]}, outside [0, {num_pages}), for a "
            "page that holds one of the sequence's keys"
        )
    return got[0]
