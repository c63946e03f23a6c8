"""`flashgen.torch.kvcache_prep` and the composite path of `flash_attn_with_kvcache` without a
GPU (skips without torch), against float64 references written here from flash-attn 2.8's
definitions (its `flash_attn_with_kvcache` docstring, `apply_rotary_emb` and the reference of
its `test_flash_attn_kvcache`):

- rotary embedding (both pair layouts, rotary_dim < head_dim, tables in the input dtype or
  float32) within one rounding of the float64 rotation, the columns past rotary_dim bitwise
  unchanged; the positions of appended keys and of queries (causal or local: advancing, else
  all at cache_seqlens);
- appending in place into contiguous caches (with cache_batch_idx) and paged ones (pages in
  random order, odd page sizes, rows across page boundaries): the caller's tensors hold the
  reference cache afterwards and nothing else changed; rows with an out-of-range destination
  are dropped, never written;
- the copies for the kernels (rows of cache_batch_idx / cache_leftpad, packed varlen K/V) and
  the value checks (`check_values`, `paged_total`) with their messages;
- `flash_attn_with_kvcache` end to end with the two kernel entry points (`torch.ops.flashgen.
  decode`, `torch.ops.flashgen.fwd`) replaced by float64 emulations: out, LSE and the caches
  after the call against the reference of the whole call (append, rotary, left padding, batch
  indices, paged caches, any seqlen_q, windows, softcap, ALiBi), which entry point ran on
  which buffers (the caller's caches in place, or a copy), and every refusal leaving the
  caches as they were;
- `flash_attn_varlen_func(block_table=...)` against the dense reference, gradients reaching
  the pages, and its refusals.

The GPU side is tests/gpu/test_torch_kvcache.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from flashgen.torch import (  # noqa: E402
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    interface,
    kvcache,
    ops,
)
from flashgen.torch import kvcache_fp8 as _fp8  # noqa: E402
from flashgen.torch import kvcache_prep as prep  # noqa: E402
from flashgen.torch.kvcache_select import decode_serves  # noqa: E402
from flashgen.torch.selection import UnsupportedCall  # noqa: E402

H200 = (9, 0)
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
DTYPES = [torch.float16, torch.bfloat16]


def _rand(*shape, dtype=torch.float16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ================================================================================================
# float64 references, from flash-attn's definitions
# ================================================================================================


def ref_rotate(x, cos, sin, pos, interleaved):
    """float64 rotary of x (b, s, h, d) at integer positions pos (b, s), pair by pair: pair i
    is columns (2i, 2i + 1) interleaved, (i, i + r/2) otherwise, angle table row pos."""
    x = x.double()
    cos, sin = cos.double(), sin.double()
    half = cos.shape[1]
    out = x.clone()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c = cos[pos, i][:, :, None]  # (b, s, 1): one angle per row, every head
        s = sin[pos, i][:, :, None]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def ref_scores_mask(sq, sk, causal, window):
    """flash-attn's bottom-right mask (sq, sk): query i sits at i + sk - sq."""
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool)
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def ref_attention(q, k, v, scale, causal, window, softcap=0.0, slopes=None):
    """float64 attention of one sequence: q (sq, h, d), k, v (sk, hk, d); slopes (h,) ALiBi.
    Returns (out (sq, h, d), lse (h, sq)); rows that see no key give 0 and -inf."""
    q, k, v = q.double(), k.double(), v.double()
    sq, h = q.shape[0], q.shape[1]
    sk = k.shape[0]
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    z = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    if slopes is not None:
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        z = z - slopes.double()[:, None, None] * (i - j).abs()
    z = z.masked_fill(~ref_scores_mask(sq, sk, causal, window), -math.inf)
    seen = torch.isfinite(z).any(-1, keepdim=True)
    p = torch.softmax(torch.where(seen, z, 0.0), dim=-1) * seen
    return torch.einsum("hqk,khd->qhd", p, v), torch.logsumexp(z, dim=-1)


def ref_kvcache(q, k_cache, v_cache, *, k=None, v=None, cos=None, sin=None, cache_seqlens,
                cache_batch_idx=None, cache_leftpad=None, block_table=None, scale=None,
                causal=False, window=(-1, -1), interleaved=True, softcap=0.0,
                alibi=None):  # fmt: skip
    """flash-attn 2.8's flash_attn_with_kvcache in float64, element by element where it
    matters: (out, lse, k_cache after, v_cache after), the caches in their dtype.

    - the capacity is the cache's rows (paged: max_pages * page_size); window sides >= it
      are unbounded;
    - appended row i of sequence b (k rotated at position cache_seqlens[b] + i) lands at that
      position of its cache row (cache_batch_idx[b], else b) or page;
    - q row i is rotated at cache_seqlens[b] + i when causal or local, else cache_seqlens[b];
    - sequence b attends to positions cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1
      of its row, as keys 0.. (the mask and ALiBi count from cache_leftpad), bottom-right."""
    batch, sq, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    paged = block_table is not None
    cap = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    left, right = window
    left = -1 if left >= cap else left
    right = -1 if right >= cap else right
    advance = causal or left >= 0 or right >= 0
    lens = [int(x) for x in cache_seqlens]
    starts = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad]
    rows = list(range(batch)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    n_new = 0 if k is None else k.shape[1]
    q64 = q.double()
    if cos is not None:
        qpos = torch.tensor([[n + (i if advance else 0) for i in range(sq)] for n in lens])
        q64 = ref_rotate(q, cos, sin, qpos, interleaved)
        kpos = torch.tensor([[n + i for i in range(n_new)] for n in lens]).reshape(batch, n_new)
        k_new = ref_rotate(k, cos, sin, kpos, interleaved).to(k.dtype)
    else:
        k_new = k
    kc, vc = k_cache.clone(), v_cache.clone()

    def where(b, p):  # the cache slot of position p of sequence b
        if paged:
            page = int(block_table[b, p // k_cache.shape[1]])
            return page, p % k_cache.shape[1]
        return rows[b], p

    for b in range(batch):
        for i in range(n_new):
            kc[where(b, lens[b] + i)] = k_new[b, i]
            vc[where(b, lens[b] + i)] = v[b, i]
    outs, lses = [], []
    for b in range(batch):
        span = range(starts[b], lens[b] + n_new)
        kb = (
            torch.stack([kc[where(b, p)] for p in span]) if span else kc.new_zeros(0, *kc.shape[2:])
        )
        vb = (
            torch.stack([vc[where(b, p)] for p in span]) if span else vc.new_zeros(0, *vc.shape[2:])
        )
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        o, lse = ref_attention(q64[b], kb, vb, scale, causal, (left, right), softcap, slopes)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), kc, vc


# ================================================================================================
# The kernels, emulated in float64 from what they are given
# ================================================================================================


def seq_keys(cache, b, n, block_table):
    """The first n keys `(n, kv_heads, d)` of sequence b: row b of a contiguous cache, or its
    pages through the block table."""
    if block_table is None:
        return cache[b, :n]
    pages = block_table[b, : -(-n // cache.shape[1])].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


class FakeKernels:
    """torch.ops.flashgen.decode / .fwd replaced: float64 attention of what each receives,
    every call recorded as (name, {argument: value})."""

    def __init__(self):
        self.calls = []

    def decode(self, q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, wl, wr,
               num_splits, max_seqlen_k, check_inputs, softcap=0.0, alibi=None,
               sink=None):  # fmt: skip
        self.calls.append(("decode", dict(q=q, k_cache=k_cache, v_cache=v_cache,
                                          cache_seqlens=cache_seqlens.clone(),
                                          block_table=block_table, causal=causal,
                                          window=(wl, wr), max_seqlen_k=max_seqlen_k,
                                          num_splits=num_splits)))  # fmt: skip
        batch, sq, h, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(batch, h, sq, dtype=torch.float32)
        for b in range(batch):
            n = int(cache_seqlens[b])
            kb, vb = (seq_keys(c, b, n, block_table) for c in (k_cache, v_cache))
            slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
            o, lb = ref_attention(q[b], kb, vb, scale, causal, (wl, wr), softcap, slopes)
            out[b], lse[b] = o.to(q.dtype), lb.float()
        return out, lse

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, wl, wr,
            deterministic, softcap=0.0, alibi=None, sink=None):  # fmt: skip
        self.calls.append(("fwd", dict(q=q, k=k, v=v, cu_q=cu_q.clone(), cu_k=cu_k.clone(),
                                       max_q=max_q, max_k=max_k, causal=causal,
                                       window=(wl, wr))))  # fmt: skip
        outs, lses = [], []
        for b in range(cu_q.shape[0] - 1):
            qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
            kv = slice(int(cu_k[b]), int(cu_k[b + 1]))
            slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
            o, lb = ref_attention(q[qs], k[kv], v[kv], scale, causal, (wl, wr), softcap, slopes)
            outs.append(o)
            lses.append(lb)
        out = torch.cat(outs).to(q.dtype)
        lse = torch.cat(lses, dim=-1).float()
        zero = torch.zeros((), dtype=torch.int64)
        return out, lse, zero, zero


@pytest.fixture
def kernels(monkeypatch):
    """CPU tensors taken for CUDA ones on a (9, 0) device; the two kernel entry points
    emulated (FakeKernels)."""
    real_meta = ops._meta

    def as_cuda(t, device=None):
        m = real_meta(t, device)
        return m._replace(device="cuda") if m.device == "cpu" else m

    for name in ("_CALLS", "_SCORES", "_PROBLEMS"):
        monkeypatch.setattr(ops, name, {})
    monkeypatch.setattr(kvcache, "_PLAIN_PLANS", {})
    monkeypatch.setattr(ops, "_meta", as_cuda)
    monkeypatch.setattr(kvcache, "_meta", as_cuda)
    monkeypatch.setattr(kvcache, "_on_cuda", lambda t: True)
    monkeypatch.setattr(kvcache, "_capability", lambda device: H200)
    monkeypatch.setattr(ops, "_capability", lambda index: H200)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake = FakeKernels()
    monkeypatch.setattr(torch.ops.flashgen, "decode", SimpleNamespace(default=fake.decode))
    monkeypatch.setattr(torch.ops.flashgen, "fwd", SimpleNamespace(default=fake.fwd))
    return fake


# ================================================================================================
# Rotary
# ================================================================================================


def _within_one_rounding(got, want, dtype, what):
    """got (dtype) is want (float64) rounded once, give or take the float32 arithmetic: at
    most one unit in the last place away, and almost always the correctly rounded value."""
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).tiny
    err = (got.double() - want).abs()
    assert bool((err <= eps * want.abs() + tiny).all()), f"{what}: max error {err.max():.3g}"
    exact = (got == want.to(dtype)).double().mean().item()
    assert exact >= 0.97, f"{what}: only {exact:.3f} of the elements are correctly rounded"


@SETTINGS
@given(
    batch=st.integers(1, 3),
    s=st.integers(1, 9),
    heads=st.integers(1, 3),
    d=st.sampled_from([8, 16, 24, 64, 72]),
    frac=st.sampled_from([0.25, 0.5, 1.0, None]),
    interleaved=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    table_f32=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rotate_is_flash_attns_rotary_within_one_rounding(batch, s, heads, d, frac,
                                                          interleaved, dtype, table_f32,
                                                          seed):  # fmt: skip
    """Both layouts, rotary_dim from 2 to d (None: 2, the smallest), positions anywhere in
    the table; the columns past rotary_dim are the input's, bitwise."""
    r = 2 if frac is None else max(2, int(d * frac) // 2 * 2)
    rows = 40
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, s, heads, d, generator=g) * 3).to(dtype)
    angle = torch.rand(rows, r // 2, generator=g) * 2 * math.pi
    table = torch.float32 if table_f32 else dtype
    cos, sin = torch.cos(angle).to(table), torch.sin(angle).to(table)
    pos = torch.randint(0, rows, (batch, s), generator=g)
    got = prep.rotate(x, cos, sin, pos, interleaved=interleaved)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got[..., r:], x[..., r:])
    _within_one_rounding(got, ref_rotate(x, cos, sin, pos, interleaved), dtype, "rotated x")


def test_rotate_layouts_pair_the_columns_flash_attn_pairs():
    """A quarter turn at position 1 maps (x1, x2) to (-x2, x1): interleaved pairs columns
    (0, 1), (2, 3); GPT-NeoX pairs (0, 2), (1, 3); position 0 (angle 0) changes nothing."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).reshape(1, 1, 1, 5)
    cos = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    sin = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    at = torch.ones(1, 1, dtype=torch.int64)
    inter = prep.rotate(x, cos, sin, at, interleaved=True).flatten().tolist()
    neox = prep.rotate(x, cos, sin, at, interleaved=False).flatten().tolist()
    assert inter == [-2.0, 1.0, -4.0, 3.0, 5.0]
    assert neox == [-3.0, -4.0, 1.0, 2.0, 5.0]
    assert torch.equal(prep.rotate(x, cos, sin, at * 0, interleaved=True), x)


def test_positions_advance_for_keys_and_causal_or_local_queries_only():
    lens = torch.tensor([0, 7, 3], dtype=torch.int32)
    assert prep.positions(lens, 3).tolist() == [[0, 1, 2], [7, 8, 9], [3, 4, 5]]
    assert prep.positions(lens, 3, advance=False).tolist() == [[0, 0, 0], [7, 7, 7], [3, 3, 3]]
    assert prep.positions(lens, 0).shape == (3, 0)


def test_rotate_clamps_positions_to_the_table():
    x = _rand(1, 2, 1, 4, seed=1)
    cos, sin = torch.rand(3, 2), torch.rand(3, 2)
    far = torch.tensor([[2, 50]])
    got = prep.rotate(x, cos, sin, far, interleaved=False)
    want = prep.rotate(x, cos, sin, torch.tensor([[2, 2]]), interleaved=False)
    assert torch.equal(got, want)
    assert prep.rotate(x, cos[:, :0], sin[:, :0], far, interleaved=True) is x  # rotary_dim 0


# ================================================================================================
# Appending in place
# ================================================================================================


def ref_append(k_cache, k, lens, *, rows=None, block_table=None):
    """The reference scatter, one row at a time, dropping destinations out of range."""
    out = k_cache.clone()
    for b in range(k.shape[0]):
        for i in range(k.shape[1]):
            p = int(lens[b]) + i
            if block_table is None:
                r = b if rows is None else int(rows[b])
                if 0 <= p < out.shape[1] and 0 <= r < out.shape[0]:
                    out[r, p] = k[b, i]
            else:
                size = out.shape[1]
                if p < 0 or p // size >= block_table.shape[1]:
                    continue
                page = int(block_table[b, p // size])
                if 0 <= page < out.shape[0]:
                    out[page, p % size] = k[b, i]
    return out


@SETTINGS
@given(
    batch=st.integers(1, 4),
    extra_rows=st.integers(0, 3),
    cap=st.integers(1, 23),
    n=st.integers(1, 6),
    kv=st.integers(1, 2),
    use_idx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_append_to_a_contiguous_cache_in_place(batch, extra_rows, cap, n, kv, use_idx, seed):
    """Rows land at cache_seqlens[b] + i of row cache_batch_idx[b] (distinct rows, as a cache
    manager hands out), in the caller's tensor; every other element is unchanged."""
    n = min(n, cap)
    g = torch.Generator().manual_seed(seed)
    rows = batch + extra_rows if use_idx else batch
    k_cache = _rand(rows, cap, kv, 8, seed=seed)
    v_cache = _rand(rows, cap, kv, 8, seed=seed + 1)
    k, v = _rand(batch, n, kv, 8, seed=seed + 2), _rand(batch, n, kv, 8, seed=seed + 3)
    lens = torch.randint(0, cap - n + 1, (batch,), generator=g, dtype=torch.int32)
    idx = torch.randperm(rows, generator=g)[:batch].int() if use_idx else None
    want_k = ref_append(k_cache, k, lens, rows=idx)
    want_v = ref_append(v_cache, v, lens, rows=idx)
    ptr = k_cache.data_ptr()
    prep.append(k_cache, v_cache, k, v, lens, cache_batch_idx=idx)
    assert k_cache.data_ptr() == ptr
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@SETTINGS
@given(
    batch=st.integers(1, 3),
    page=st.sampled_from([1, 3, 4, 5, 16]),
    max_pages=st.integers(1, 5),
    spare=st.integers(0, 4),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_append_to_a_paged_cache_across_page_boundaries(batch, page, max_pages, spare, n, seed):
    """Pages in random order (and unused pages), odd page sizes, n rows that cross pages."""
    cap = page * max_pages
    n = min(n, cap)
    g = torch.Generator().manual_seed(seed)
    pages = batch * max_pages + spare
    table = torch.randperm(pages, generator=g)[: batch * max_pages].int().reshape(batch, -1)
    k_cache, v_cache = _rand(pages, page, 2, 8, seed=seed), _rand(pages, page, 2, 8, seed=seed + 1)
    k, v = _rand(batch, n, 2, 8, seed=seed + 2), _rand(batch, n, 2, 8, seed=seed + 3)
    lens = torch.randint(0, cap - n + 1, (batch,), generator=g, dtype=torch.int32)
    want_k = ref_append(k_cache, k, lens, block_table=table)
    want_v = ref_append(v_cache, v, lens, block_table=table)
    prep.append(k_cache, v_cache, k, v, lens, block_table=table)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize(
    ("lens", "rows", "table"),
    [
        ([5, 6], None, None),  # sequence 1's last rows run past the capacity 8
        ([-2, 3], None, None),  # negative positions
        ([1, 2], [0, 7], None),  # a cache row that does not exist
        ([9, 9], None, None),  # every row out of range: nothing is written at all
        ([2, 3], None, [[0, 9], [-1, 1]]),  # bad page ids (9 of 3 pages, -1)
        ([6, 6], None, [[0, 1], [2, 0]]),  # past max_pages * page_size
    ],
)
def test_append_drops_rows_whose_destination_is_out_of_range(lens, rows, table):
    paged = table is not None
    shape = (3, 4, 2, 8) if paged else (2, 8, 2, 8)
    k_cache, v_cache = _rand(*shape, seed=5), _rand(*shape, seed=6)
    k, v = _rand(2, 3, 2, 8, seed=7), _rand(2, 3, 2, 8, seed=8)
    lens = torch.tensor(lens, dtype=torch.int32)
    rows = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    table = None if table is None else torch.tensor(table, dtype=torch.int32)
    want_k = ref_append(k_cache, k, lens, rows=rows, block_table=table)
    want_v = ref_append(v_cache, v, lens, rows=rows, block_table=table)
    prep.append(k_cache, v_cache, k, v, lens, cache_batch_idx=rows, block_table=table)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_append_writes_into_strided_views_of_a_shared_buffer():
    """k_cache, v_cache as kv[:, :, 0], kv[:, :, 1] of one buffer: each gets its rows."""
    kv = _rand(2, 10, 2, 3, 8, seed=9)
    before = kv.clone()
    k, v = _rand(2, 2, 3, 8, seed=10), _rand(2, 2, 3, 8, seed=11)
    lens = torch.tensor([0, 7], dtype=torch.int32)
    prep.append(kv[:, :, 0], kv[:, :, 1], k, v, lens)
    assert torch.equal(kv[:, :, 0], ref_append(before[:, :, 0], k, lens))
    assert torch.equal(kv[:, :, 1], ref_append(before[:, :, 1], v, lens))


# ================================================================================================
# Copies for the kernels, and the value checks
# ================================================================================================


def test_cache_rows_start_each_sequence_at_its_left_padding_of_its_row():
    cache = _rand(4, 9, 2, 8, seed=12)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    pad = torch.tensor([2, 0], dtype=torch.int32)
    got = prep.cache_rows(cache, 2, cache_batch_idx=idx, cache_leftpad=pad)
    assert got.shape == (2, 9, 2, 8)
    assert torch.equal(got[0, :7], cache[3, 2:]) and torch.equal(got[1], cache[0])
    assert torch.equal(prep.cache_rows(cache[:2], 2), cache[:2])
    assert prep.cache_rows(cache[:, :0], 2).shape == (2, 0, 2, 8)


@SETTINGS
@given(
    batch=st.integers(1, 4),
    paged=st.booleans(),
    n=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_pack_lays_out_each_sequences_keys_then_its_new_rows(batch, paged, n, seed):
    g = torch.Generator().manual_seed(seed)
    if paged:
        page, cols = 3, 4
        cache = _rand(batch * cols + 1, page, 2, 8, seed=seed)
        table = torch.randperm(batch * cols + 1, generator=g)[: batch * cols].int()
        table = table.reshape(batch, cols)
        cap, idx, starts = page * cols, None, None
    else:
        cap, table = 11, None
        cache = _rand(batch + 2, cap, 2, 8, seed=seed)
        idx = torch.randperm(batch + 2, generator=g)[:batch].int()
        starts = torch.randint(0, 4, (batch,), generator=g, dtype=torch.int32)
    first = 0 if starts is None else starts
    old = torch.randint(0, cap - n - 3, (batch,), generator=g, dtype=torch.int32)
    new = _rand(batch, n, 2, 8, seed=seed + 1)
    cu = prep.cumulative(old + n)
    total = int(cu[-1])
    got = prep.pack(cache, cu, total, lengths=old, starts=starts, cache_batch_idx=idx,
                    block_table=table, new=new)  # fmt: skip
    parts = []
    for b in range(batch):
        for j in range(int(old[b])):
            p = j + (0 if starts is None else int(first[b]))
            if paged:
                parts.append(cache[int(table[b, p // 3]), p % 3])
            else:
                parts.append(cache[int(idx[b]), p])
        parts.extend(new[b])
    want = torch.stack(parts) if parts else cache.new_zeros(0, 2, 8)
    assert torch.equal(got, want)


def test_check_values_returns_the_key_counts_and_names_each_bad_argument():
    lens = torch.tensor([3, 0, 5], dtype=torch.int32)
    assert prep.check_values(lens, capacity=8, seqlen_new=2) == prep.Checked(14, 7)
    pad = torch.tensor([1, 0, 5], dtype=torch.int32)
    assert prep.check_values(lens, capacity=8, seqlen_new=2, cache_leftpad=pad) == (8, 4)
    assert prep.check_values(lens[:0], capacity=8) == (0, 0)
    cases = [
        (dict(seqlen_new=4), r"cache_seqlens\[2\] = 5 is outside 0\.\.4: allowed 0\.\.capacity"),
        (dict(cache_leftpad=torch.tensor([4, 0, 0], dtype=torch.int32)),
         r"cache_leftpad\[0\] = 4 is outside 0\.\.cache_seqlens\[0\]"),
        (dict(cache_batch_idx=torch.tensor([0, 3, -1], dtype=torch.int32), cache_rows=3),
         r"cache_batch_idx\[1\] = 3 is outside 0\.\.2 \(the rows of k_cache\) \(2 entries"),
        (dict(block_table=torch.tensor([[0, 1], [7, 0], [1, 9]], dtype=torch.int32),
              page_size=4, num_pages=3),
         r"block_table row 2 holds page id 9, outside \[0, 3\)"),
        (dict(rotary_rows=8, rotary_last=3), r"rotary_cos has 8 rows but sequence 2's last query "
         r"sits at position 8 \(cache_seqlens \+ 3\)"),
    ]  # fmt: skip
    for kw, match in cases:
        with pytest.raises(UnsupportedCall, match=match):
            prep.check_values(lens, capacity=8, **kw)
    # a bad page past a sequence's length is never used: not an error
    unused = torch.tensor([[0, 9], [9, 9], [1, 2]], dtype=torch.int32)
    prep.check_values(lens, capacity=8, block_table=unused, page_size=4, num_pages=3)


def test_paged_total_checks_lengths_and_used_pages():
    table = torch.tensor([[2, 0], [1, -5]], dtype=torch.int32)
    assert prep.paged_total(torch.tensor([0, 7, 10], dtype=torch.int32), table, page_size=4,
                            num_pages=3) == 10  # fmt: skip
    for cu, match in [([0, 9, 10], r"sequence 0 the length 9: allowed 0\.\.8"),
                      ([0, 7, 5], r"sequence 1 the length -2"),
                      ([0, 3, 8], r"block_table row 1 holds page id -5"),
                      ([-1, 3, 5], r"cu_seqlens_k\[0\] = -1")]:  # fmt: skip
        with pytest.raises(UnsupportedCall, match=match):
            prep.paged_total(torch.tensor(cu, dtype=torch.int32), table, page_size=4, num_pages=3)


# ================================================================================================
# flash_attn_with_kvcache end to end, kernels emulated
# ================================================================================================


@st.composite
def kvcache_calls(draw):
    """A flash_attn_with_kvcache call as flash-attn's test draws them (and more): returns the
    keyword arguments and what the routing should be."""
    batch = draw(st.integers(1, 3))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([16, 32, 64, 200]))  # 200: no decode kernel (the varlen route)
    sq = draw(st.sampled_from([1, 2, 5, 16, 17, 23]))
    paged = draw(st.booleans())
    new_kv = draw(st.booleans())
    if paged:  # 3, 5: page sizes no decode kernel takes (the varlen route)
        page = draw(st.sampled_from([16, 32, 3]) if sq <= 16 else st.sampled_from([3, 16, 5]))
        max_pages = draw(st.integers(1, 3))
        cap = page * max_pages
    else:
        cap = draw(st.integers(1, 40))
    n_new = draw(st.integers(1, min(cap, 6))) if new_kv else 0
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    kw = {}
    if paged:
        pages = batch * max_pages + draw(st.integers(0, 3))
        kw["block_table"] = torch.randperm(pages, generator=g)[: batch * max_pages].int()
        kw["block_table"] = kw["block_table"].reshape(batch, max_pages)
        k_cache, v_cache = _rand(pages, page, kv, d, seed=seed), _rand(pages, page, kv, d,
                                                                    seed=seed + 1)  # fmt: skip
    else:
        rows = batch + (draw(st.integers(0, 2)) if draw(st.booleans()) else 0)
        if rows != batch or draw(st.booleans()):
            kw["cache_batch_idx"] = torch.randperm(rows, generator=g)[:batch].int()
        k_cache, v_cache = _rand(rows, cap, kv, d, seed=seed), _rand(rows, cap, kv, d,
                                                                   seed=seed + 1)  # fmt: skip
    lens = torch.randint(0, cap - n_new + 1, (batch,), generator=g, dtype=torch.int32)
    if not paged and draw(st.booleans()):  # anywhere in 0..cache_seqlens, often at the end
        kw["cache_leftpad"] = (torch.rand(batch, generator=g) ** 0.5 * (lens + 1)).int()
    kw["cache_seqlens"] = lens
    if draw(st.booleans()) and "cache_leftpad" not in kw:  # an int: one length for all
        kw["cache_seqlens"] = int(lens[0])
    if new_kv:
        kw["k"] = _rand(batch, n_new, kv, d, seed=seed + 2)
        kw["v"] = _rand(batch, n_new, kv, d, seed=seed + 3)
        if draw(st.booleans()):
            half = draw(st.integers(1, d // 2))
            rows = cap + sq  # long enough for every query position
            angle = torch.rand(rows, half, generator=g) * 2 * math.pi
            kw["rotary_cos"], kw["rotary_sin"] = (
                torch.cos(angle).to(dtype),
                torch.sin(angle).to(dtype),
            )
            kw["rotary_interleaved"] = draw(st.booleans())
    kw["causal"] = draw(st.booleans())
    side = st.sampled_from([-1, 0, 1, 3, cap - 1, cap, cap + 5])
    kw["window_size"] = (draw(side), draw(side)) if draw(st.booleans()) else (-1, -1)
    if kw["window_size"] != (-1, -1) and draw(st.booleans()):
        kw["window_size"] = torch.tensor(kw["window_size"])  # as flash-attn's tests pass it
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([2.0, 30.0]))
    if draw(st.booleans()):
        kw["alibi_slopes"] = torch.rand(batch, heads, generator=g) * 0.3
    q = _rand(batch, sq, heads, d, seed=seed + 4)
    return q, k_cache, v_cache, kw


def _reference_of(q, k_cache, v_cache, kw):
    lens = kw["cache_seqlens"]
    if isinstance(lens, int):
        lens = torch.full((q.shape[0],), lens, dtype=torch.int32)
    window = kw.get("window_size", (-1, -1))
    window = tuple(int(x) for x in window)
    return ref_kvcache(
        q, k_cache, v_cache, k=kw.get("k"), v=kw.get("v"), cos=kw.get("rotary_cos"),
        sin=kw.get("rotary_sin"), cache_seqlens=lens, cache_batch_idx=kw.get("cache_batch_idx"),
        cache_leftpad=kw.get("cache_leftpad"), block_table=kw.get("block_table"),
        causal=kw.get("causal", False), window=window,
        interleaved=kw.get("rotary_interleaved", True), softcap=kw.get("softcap", 0.0),
        alibi=kw.get("alibi_slopes"),
    )  # fmt: skip


def _check_caches(got, want, before, rotated, what):
    """Rows the call did not append are bitwise the caller's; appended rows are the
    reference's (k rows after rotary within one rounding of it)."""
    changed = (want != before).any(-1).any(-1)  # rows the reference wrote a new value to
    same = ~changed
    assert torch.equal(got[same], want[same]), f"{what}: a row the call must not touch changed"
    if rotated:
        err = (got[changed].double() - want[changed].double()).abs()
        bound = torch.finfo(got.dtype).eps * 2 * want[changed].double().abs() + 1e-7
        assert bool((err <= bound).all()), f"{what}: appended rows differ"
    else:
        assert torch.equal(got[changed], want[changed]), f"{what}: appended rows differ"


def _close(got, want, tol, what):
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol}"


@settings(SETTINGS, max_examples=150)
@given(call=kvcache_calls())
def test_flash_attn_with_kvcache_is_flash_attns_on_every_route(kernels, call):
    q, k_cache, v_cache, kw = call
    before_k, before_v = k_cache.clone(), v_cache.clone()
    want_o, want_lse, want_k, want_v = _reference_of(q, k_cache, v_cache, kw)
    kernels.calls.clear()
    ptr = (k_cache.data_ptr(), v_cache.data_ptr())
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    _close(out, want_o, 4e-3, "out")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    _close(lse[finite], want_lse[finite], 2e-3, "lse")
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == ptr  # written in place, not replaced
    rotated = "rotary_cos" in kw
    _check_caches(k_cache, want_k, before_k, rotated, "k_cache")
    _check_caches(v_cache, want_v, before_v, False, "v_cache")
    # the route: which kernel ran, on which buffers
    ((name, args),) = kernels.calls
    sq = q.shape[1]
    page = k_cache.shape[1] if "block_table" in kw else None
    packed = sq > 16 or not decode_serves(q.shape[-1], page)
    composite = any(x in kw for x in ("k", "cache_batch_idx", "cache_leftpad")) or packed
    event(f"{name}, {'composite' if composite else 'plain'}, rotary {'rotary_cos' in kw}")
    event(f"packed: {packed}, d {q.shape[-1]}, page {page}")
    if packed:
        assert name == "fwd" and args["max_q"] == sq
        assert args["k"].shape[0] == int(args["cu_k"][-1])  # exactly the used keys
    elif "cache_batch_idx" in kw or "cache_leftpad" in kw:
        assert name == "decode" and args["block_table"] is None
        assert args["k_cache"].shape == (q.shape[0], *k_cache.shape[1:])  # a copy of the rows
    else:
        assert name == "decode"
        assert args["k_cache"].data_ptr() == k_cache.data_ptr()  # the caller's cache itself
        table = kw.get("block_table")
        got = args["block_table"]
        assert got is None if table is None else got.data_ptr() == table.data_ptr()


@pytest.mark.parametrize("sq", [2, 20])
@pytest.mark.parametrize("rotary", [False, True])
def test_left_padding_and_batch_indices_append_to_the_callers_rows(kernels, sq, rotary):
    """Sequence b's keys are positions cache_leftpad[b] .. of cache row cache_batch_idx[b];
    the new rows go to cache_seqlens[b] .. of that row (absolute positions, rotary too), the
    kernel reads a copy whose keys start at 0."""
    cap, d = 20, 32
    q = _rand(2, sq, 4, d, seed=60)
    kc, vc = _rand(3, cap, 2, d, seed=61), _rand(3, cap, 2, d, seed=62)
    kw = dict(k=_rand(2, 3, 2, d, seed=63), v=_rand(2, 3, 2, d, seed=64),
              cache_seqlens=torch.tensor([9, 5], dtype=torch.int32),
              cache_leftpad=torch.tensor([3, 5], dtype=torch.int32),
              cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32), causal=True)  # fmt: skip
    if rotary:
        angle = torch.rand(cap + sq, 6) * 2 * math.pi
        kw.update(rotary_cos=torch.cos(angle).half(), rotary_sin=torch.sin(angle).half(),
                  rotary_interleaved=False)  # fmt: skip
    before = kc.clone(), vc.clone()
    want_o, want_lse, want_k, want_v = _reference_of(q, kc, vc, kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    _close(out, want_o, 4e-3, "out")
    _check_caches(kc, want_k, before[0], rotary, "k_cache")
    _check_caches(vc, want_v, before[1], False, "v_cache")
    assert torch.equal(kc[1], before[0][1])  # the row no sequence uses
    ((name, args),) = kernels.calls
    if sq <= 16:
        assert torch.equal(args["cache_seqlens"], torch.tensor([9, 3]))  # + 3 - leftpad
        assert torch.equal(args["k_cache"][0, 9:12], kc[2, 12:15])  # the copy of row 2 from 3
    else:
        assert torch.equal(args["cu_k"], torch.tensor([0, 9, 12]))


def test_the_plain_decode_call_reads_the_callers_tensors_without_a_copy(kernels):
    q = _rand(2, 3, 4, 64, seed=20)
    k_cache, v_cache = _rand(2, 30, 2, 64, seed=21), _rand(2, 30, 2, 64, seed=22)
    lens = torch.tensor([30, 4], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    ((name, args),) = kernels.calls
    assert name == "decode" and args["q"].data_ptr() == q.data_ptr()
    assert args["k_cache"].data_ptr() == k_cache.data_ptr()
    assert args["cache_seqlens"].data_ptr() != 0 and torch.equal(args["cache_seqlens"], lens)
    for b, n in enumerate([30, 4]):
        o, _ = ref_attention(q[b], k_cache[b, :n], v_cache[b, :n], 64**-0.5, True, (-1, -1))
        _close(out[b], o, 2e-3, f"out[{b}]")


def test_appending_one_token_per_step_equals_the_cache_written_up_front(kernels):
    """A decode loop: append + attend, lengths + 1, step after step; the cache ends as if
    it had been written in one go and each step sees exactly the keys so far."""
    batch, cap, d = 2, 12, 32
    full_k, full_v = _rand(batch, cap, 2, d, seed=30), _rand(batch, cap, 2, d, seed=31)
    k_cache = torch.zeros(batch, cap, 2, d, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    lens = torch.zeros(batch, dtype=torch.int32)
    for step in range(cap):
        q = _rand(batch, 1, 4, d, seed=100 + step)
        k, v = full_k[:, step : step + 1], full_v[:, step : step + 1]
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
        for b in range(batch):
            o, _ = ref_attention(q[b], full_k[b, : step + 1], full_v[b, : step + 1],
                                 d**-0.5, True, (-1, -1))  # fmt: skip
            _close(out[b], o, 2e-3, f"step {step} out[{b}]")
        lens += 1
    assert torch.equal(k_cache, full_k) and torch.equal(v_cache, full_v)


@pytest.mark.parametrize("sq", [3, 20])
def test_window_sides_beyond_the_capacity_are_unbounded_as_in_flash_attn(kernels, sq):
    """flash-attn's binding turns a window side >= the cache's capacity into -1: with rotary
    and causal=False, (capacity, capacity + 5) is then no window at all, so every query is
    rotated at cache_seqlens (not cache_seqlens + i) and nothing is masked; one side below
    the capacity keeps the window, and the queries' positions advance."""
    cap, d = 24, 32
    q = _rand(2, sq, 2, d, seed=43)
    k, v = _rand(2, 2, 2, d, seed=44), _rand(2, 2, 2, d, seed=45)
    angle = torch.rand(cap + sq, d // 2) * 2 * math.pi
    rot = dict(rotary_cos=torch.cos(angle).half(), rotary_sin=torch.sin(angle).half())
    lens = torch.tensor([4, 9], dtype=torch.int32)
    outs = {}
    for window in ((-1, -1), (cap, cap + 5), (cap - 1, -1)):
        caches = _rand(2, cap, 2, d, seed=46), _rand(2, cap, 2, d, seed=47)
        outs[window] = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens,
                                               window_size=window, **rot)  # fmt: skip
    assert torch.equal(outs[(cap, cap + 5)], outs[(-1, -1)])
    assert not torch.equal(outs[(cap - 1, -1)], outs[(-1, -1)])  # advancing positions
    assert kernels.calls[1][1]["window"] == (-1, -1)


def test_window_size_as_a_list_or_a_tensor_is_the_tuple(kernels):
    q = _rand(1, 2, 2, 32, seed=40)
    k_cache, v_cache = _rand(1, 20, 1, 32, seed=41), _rand(1, 20, 1, 32, seed=42)
    outs = [
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=15, window_size=w)
        for w in ((4, 1), [4, 1], torch.tensor([4, 1]), (torch.tensor(4), torch.tensor(1)))
    ]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    assert {args["window"] for _, args in kernels.calls} == {(4, 1)}
    for bad in ((4.0, 1), torch.tensor([4.0, 1.0]), (4, 1, 0), torch.tensor([True, False])):
        with pytest.raises(UnsupportedCall, match=r"window_size must be \(left, right\)"):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=15, window_size=bad)


def _base(batch=2, sq=1, heads=4, kv=2, d=32, cap=16, paged=False):
    q = _rand(batch, sq, heads, d, seed=50)
    shape = (2 * batch, cap // 2, kv, d) if paged else (batch, cap, kv, d)
    k_cache, v_cache = _rand(*shape, seed=51), _rand(*shape, seed=52)
    k, v = _rand(batch, 2, kv, d, seed=53), _rand(batch, 2, kv, d, seed=54)
    lens = torch.tensor([3, 5][:batch], dtype=torch.int32)
    return q, k_cache, v_cache, k, v, lens


def _refused(kernels, match, q, k_cache, v_cache, **kw):
    """The call is refused with `match`, no kernel ran and both caches are bitwise as they
    were."""
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    assert not kernels.calls


def test_host_side_refusals_write_nothing(kernels):
    q, kc, vc, k, v, lens = _base()
    cos, wide = torch.rand(16, 8).half(), torch.rand(16, 17).half()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    qp, pk, pv, _, _, _ = _base(paged=True)
    cases = [
        (r"k without v: k and v append new tokens together", dict(k=k)),
        (r"v without k", dict(v=v)),
        (r"k has shape \(2, 2, 4, 32\); it must be \(batch, seqlen_new, kv_heads, head_dim\) = "
         r"\(2, 2, 2, 32\)", dict(k=q.expand(2, 2, 4, 32), v=v)),
        (r"v has dtype bfloat16 but q has float16", dict(k=k, v=v.bfloat16())),
        (r"cache_seqlens is required with k, v", dict(k=k, v=v, cache_seqlens=None)),
        (r"cache_seqlens=15 is outside 0\.\.14 \(the cache's capacity 16, less the 2 appended",
         dict(k=k, v=v, cache_seqlens=15)),
        (r"k has seqlen_new 17, more than the cache's capacity 16",
         dict(k=_rand(2, 17, 2, 32), v=_rand(2, 17, 2, 32))),
        (r"rotary_cos and rotary_sin: both or neither", dict(k=k, v=v, rotary_cos=cos)),
        (r"rotary_cos/rotary_sin need k and v", dict(rotary_cos=cos, rotary_sin=cos)),
        (r"rotary_cos has 15 rows; it needs at least the cache's capacity 16",
         dict(k=k, v=v, rotary_cos=cos[:15], rotary_sin=cos[:15])),
        (r"rotary_dim = 2 \* 17 = 34 exceeds head_dim 32",
         dict(k=k, v=v, rotary_cos=wide, rotary_sin=wide)),
        (r"rotary_cos has dtype float64; allowed: q's float16 \(as flash-attn\) or float32",
         dict(k=k, v=v, rotary_cos=cos.double(), rotary_sin=cos.double())),
        (r"rotary_sin \(16, 4\) and rotary_cos \(16, 8\) must have the same shape",
         dict(k=k, v=v, rotary_cos=cos, rotary_sin=cos[:, :4])),
        (r"rotary_interleaved must be True or False",
         dict(k=k, v=v, rotary_cos=cos, rotary_sin=cos, rotary_interleaved=1)),
        (r"cache_leftpad must be an int32 tensor of shape \(2,\)",
         dict(cache_leftpad=lens.long())),
        (r"cache_batch_idx must be an int32 tensor of shape \(2,\)",
         dict(cache_batch_idx=lens[:1])),
        (r"q has batch 2 but k_cache has 3; .*or any number of rows with cache_batch_idx",
         dict(k_cache=_rand(3, 16, 2, 32), v_cache=_rand(3, 16, 2, 32), k=k, v=v)),
        (r"cache_seqlens is on device 'meta'", dict(k=k, v=v, cache_seqlens=lens.to("meta"))),
    ]  # fmt: skip
    for match, kw in cases:
        kw.setdefault("cache_seqlens", lens)
        call_kc, call_vc = kw.pop("k_cache", kc), kw.pop("v_cache", vc)
        _refused(kernels, match, q, call_kc, call_vc, **kw)
    for name in ("cache_leftpad", "cache_batch_idx"):
        _refused(kernels, rf"{name} with a block_table: not served \(flash-attn refuses the pair",
                 qp, pk, pv, k=k, v=v, cache_seqlens=lens, block_table=table,
                 **{name: lens})  # fmt: skip
    # the decode kernels' own rules, checked before the append writes the caller's cache (a
    # page size they do not take is no longer one: the varlen route serves it)
    _refused(kernels, r"softcap=-1\.0", q, kc, vc, k=k, v=v, cache_seqlens=lens, softcap=-1.0)
    _refused(kernels, r"alibi_slopes has shape \(3,\)", q, kc, vc, k=k, v=v, cache_seqlens=lens,
             alibi_slopes=torch.rand(3))  # fmt: skip


def test_checked_device_values_refuse_before_anything_is_written(kernels):
    """With check_inputs=True (and always with more than 16 queries) bad device values are
    refused with their argument's name; the caches stay bitwise as they were."""
    q, kc, vc, k, v, lens = _base()
    long_q = _rand(2, 17, 4, 32, seed=55)
    cos = torch.rand(18, 4).half()
    for query, check in ((q, True), (long_q, False)):
        kw = dict(k=k, v=v, check_inputs=check)
        _refused(kernels, r"cache_seqlens\[1\] = 15 is outside 0\.\.14", query, kc, vc,
                 cache_seqlens=torch.tensor([3, 15], dtype=torch.int32), **kw)  # fmt: skip
        _refused(kernels, r"cache_leftpad\[0\] = 4 is outside 0\.\.cache_seqlens\[0\]", query,
                 kc, vc, cache_seqlens=lens, cache_leftpad=torch.tensor([4, 0], dtype=torch.int32),
                 **kw)  # fmt: skip
        _refused(kernels, r"cache_batch_idx\[0\] = 2 is outside 0\.\.1", query, kc, vc,
                 cache_seqlens=lens, cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
                 **kw)  # fmt: skip
        # causal: query i is rotated at cache_seqlens + i, past the table's 18 rows for 17
        _refused(kernels, r"rotary_cos has 18 rows but sequence 0's last query sits at "
                 r"position 19 \(cache_seqlens \+ 16\) \(2 entries are\)",
                 query[:, :1].expand(2, 17, 4, 32), kc, vc, cache_seqlens=lens,
                 rotary_cos=cos, rotary_sin=cos, causal=True, **kw)  # fmt: skip
    qp, pk, pv, _, _, _ = _base(paged=True)
    pk, pv = _rand(4, 16, 2, 32), _rand(4, 16, 2, 32)
    _refused(kernels, r"block_table row 1 holds page id 4, outside \[0, 4\)", qp, pk, pv, k=k,
             v=v, cache_seqlens=lens, block_table=torch.tensor([[0, 1], [4, 2]],
                                                                dtype=torch.int32),
             check_inputs=True)  # fmt: skip


def test_unchecked_bad_values_drop_the_rows_and_never_index_out_of_range(kernels):
    """Without the check, a sequence whose appended rows would run past the capacity writes
    only the rows that fit; the other sequence's rows land as usual."""
    q, kc, vc, k, v, _ = _base()
    lens = torch.tensor([15, 2], dtype=torch.int32)  # 15 + 2 > 16
    want_k = ref_append(kc, k, lens)
    flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens)
    assert torch.equal(kc, want_k)
    assert torch.equal(kernels.calls[0][1]["cache_seqlens"], torch.tensor([17, 4]))


def test_zero_queries_still_append(kernels):
    q, kc, vc, k, v, lens = _base()
    want = ref_append(kc, k, lens)
    out, lse = flash_attn_with_kvcache(q[:, :0], kc, vc, k, v, cache_seqlens=lens,
                                       return_softmax_lse=True)  # fmt: skip
    assert out.shape == (2, 0, 4, 32) and lse.shape == (2, 4, 0)
    assert torch.equal(kc, want)


# ================================================================================================
# flash_attn_varlen_func with a block_table (paged prefill)
# ================================================================================================


def _paged_varlen_case(seed, page=5, batch=3, kv=2, heads=4, d=32):
    g = torch.Generator().manual_seed(seed)
    sk = torch.randint(0, 3 * page, (batch,), generator=g)
    sq = torch.randint(1, 9, (batch,), generator=g)
    cols = 3
    pages = batch * cols + 2
    table = torch.randperm(pages, generator=g)[: batch * cols].int().reshape(batch, cols)
    k_pages, v_pages = (
        _rand(pages, page, kv, d, seed=seed),
        _rand(pages, page, kv, d, seed=seed + 1),
    )
    q = _rand(int(sq.sum()), heads, d, seed=seed + 2)
    cu_q, cu_k = prep.cumulative(sq), prep.cumulative(sk)
    return q, k_pages, v_pages, table, cu_q, cu_k, sq, sk


@pytest.mark.parametrize("page", [1, 5, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_is_the_dense_varlen_call_on_the_gathered_keys(kernels, page, causal):
    q, kp, vp, table, cu_q, cu_k, sq, sk = _paged_varlen_case(60 + page, page=page)
    out, lse, _ = flash_attn_varlen_func(
        q, kp, vp, cu_q, cu_k, int(sq.max()), int(sk.max()), causal=causal,
        window_size=torch.tensor([6, -1]), return_attn_probs=True, block_table=table,
    )  # fmt: skip
    ((name, args),) = kernels.calls
    assert name == "fwd" and args["k"].shape == (int(sk.sum()), 2, 32)
    for b in range(3):
        keys = [(int(table[b, j // page]), j % page) for j in range(int(sk[b]))]
        kb = torch.stack([kp[p, r] for p, r in keys]) if keys else kp.new_zeros(0, 2, 32)
        vb = torch.stack([vp[p, r] for p, r in keys]) if keys else vp.new_zeros(0, 2, 32)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        o, lb = ref_attention(q[rows], kb, vb, 32**-0.5, causal, (6, -1))
        _close(out[rows], o, 2e-3, f"out of sequence {b}")
        seen = torch.isfinite(lb)
        _close(lse[:, rows][seen], lb[seen], 1e-3, f"lse of sequence {b}")


def test_paged_varlen_gradients_reach_the_pages(kernels, monkeypatch):
    """The packed copy is a torch gather: dk, dv scatter back into the pages that were read
    (and only those), as the gradients of the dense call on the gathered keys."""
    monkeypatch.setattr(ops, "check_backward", lambda *a, **k: None)
    monkeypatch.setattr(ops, "_backward_known", lambda *a, **k: True)
    q, kp, vp, table, cu_q, cu_k, sq, sk = _paged_varlen_case(70)
    kp, vp = kp.double().requires_grad_(), vp.double().requires_grad_()
    q = q.double().requires_grad_()
    monkeypatch.setattr(interface, "_kernel_inputs", lambda q, k, v, *a: (q, k, v, q.shape[-1]))
    out = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, 8, 15, block_table=table)
    out.sum().backward()
    used = torch.zeros(kp.shape[:2], dtype=torch.bool)
    for b in range(3):
        for j in range(int(sk[b])):
            used[int(table[b, j // 5]), j % 5] = True
    assert bool((kp.grad[~used] == 0).all()) and bool((vp.grad[~used] == 0).all())
    assert bool((vp.grad[used].abs().sum(-1) > 0).all())  # every key read gets V's gradient
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


def test_paged_varlen_refusals(kernels):
    q, kp, vp, table, cu_q, cu_k, sq, sk = _paged_varlen_case(80)
    bad = table.clone()
    bad[0, 0] = 99
    cases = [
        (r"block_table row 0 holds page id 99, outside \[0, 11\)", dict(block_table=bad)),
        (r"block_table must be an int32 tensor of shape \(3, 3\)",
         dict(block_table=table.long())),
        (r"k has 3 dimensions .*with a block_table it must be a paged cache",
         dict(k=kp[:, 0], v=vp[:, 0])),
        (r"k \(11, 5, 2, 32\) and v \(11, 5, 1, 32\) must have the same shape",
         dict(v=vp[:, :, :1])),
        (r"cu_seqlens_k gives sequence 1 the length 16: allowed 0\.\.15",
         dict(cu_seqlens_k=torch.tensor([0, 2, 18, 20], dtype=torch.int32))),
    ]  # fmt: skip
    for match, kw in cases:
        args = dict(k=kp, v=vp, cu_seqlens_k=cu_k, block_table=table)
        args.update(kw)
        with pytest.raises(UnsupportedCall, match=match):
            flash_attn_varlen_func(q, args["k"], args["v"], cu_q, args["cu_seqlens_k"], 8, 15,
                                   block_table=args["block_table"])  # fmt: skip
    assert not kernels.calls


def test_decode_serves_head_dims_up_to_192_and_the_decode_page_sizes():
    assert decode_serves(192, None) and decode_serves(8, 16) and decode_serves(59, 256)
    assert not decode_serves(200, None) and not decode_serves(256, 64)
    assert not decode_serves(64, 8) and not decode_serves(64, 512) and not decode_serves(64, 3)


# ================================================================================================
# The host fast path of the plain call
# ================================================================================================


def test_a_plain_call_of_a_layout_served_before_goes_straight_to_the_op(kernels, monkeypatch):
    """The second plain call of one layout skips every Python check (no `_run_decode`) and
    launches exactly what the first did; a call that changes anything the checks read (a
    stride, the block table, check_inputs, a score modifier, an int cache_seqlens) takes the
    full path again, and a refused call is never remembered."""
    q, kc, vc = (
        _rand(2, 1, 4, 32, seed=70),
        _rand(2, 40, 2, 32, seed=71),
        _rand(2, 40, 2, 32, seed=72),
    )
    lens = torch.tensor([17, 40], dtype=torch.int32)
    full = []
    real = kvcache._run_decode

    def counted(*a, **kw):
        full.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(kvcache, "_run_decode", counted)

    def call(*args, **kw):
        kernels.calls.clear()
        out = flash_attn_with_kvcache(*args, cache_seqlens=kw.pop("cache_seqlens", lens), **kw)
        ((name, launched),) = kernels.calls
        assert name == "decode"
        return out, launched

    first, args1 = call(q, kc, vc, causal=True)
    assert len(full) == 1 and len(kvcache._PLAIN_PLANS) == 1
    second, args2 = call(q, kc, vc, causal=True)
    assert len(full) == 1  # the fast path
    assert torch.equal(first, second)

    def plain(args):
        return {k: (v.data_ptr(), v.shape) if isinstance(v, torch.Tensor) else v
                for k, v in args.items() if k != "cache_seqlens"}  # fmt: skip

    assert plain(args1) == plain(args2)
    assert torch.equal(args1["cache_seqlens"], args2["cache_seqlens"])
    call(q, kc, vc, causal=True, softmax_scale=0.3)  # a scale given: a new layout key
    assert len(full) == 2
    call(q, kc, vc, causal=True, softmax_scale=0.5)  # ... then fast, with its own value
    assert len(full) == 2
    wide = _rand(2, 40, 2, 64, seed=73)[..., :32]  # another stride
    call(q, wide, wide, causal=True)
    assert len(full) == 3
    call(q, kc, vc, causal=True, check_inputs=True)
    call(q, kc, vc, causal=True, softcap=5.0)
    call(q, kc, vc, causal=True, cache_seqlens=17)
    assert len(full) == 6
    # arguments the full path type-checks never take the fast path (1 == True == 1.0 as keys;
    # 0-dim tensors hash by identity and their values change)
    n_full = len(full)
    call(q, kc, vc, causal=True, window_size=(torch.tensor(-1), torch.tensor(-1)))
    assert len(full) == n_full + 1
    for bad in (dict(causal=1), dict(causal=True, window_size=(-1.0, -1.0)),
                dict(causal=True, num_splits=1.0)):  # fmt: skip
        with pytest.raises(UnsupportedCall):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **bad)
    n = len(kvcache._PLAIN_PLANS)
    with pytest.raises(UnsupportedCall):
        flash_attn_with_kvcache(q, kc, vc[..., :16], cache_seqlens=lens, causal=True)
    assert len(kvcache._PLAIN_PLANS) == n


def test_calls_that_pad_or_copy_are_never_on_the_fast_path(kernels):
    """A head dim the decode kernels do not serve (zero-padded) and a layout they cannot read
    (copied) always take the full path: the fast path reads the caller's tensors as they are."""
    lens = torch.tensor([5, 9], dtype=torch.int32)
    q, kc = _rand(2, 1, 4, 36, seed=74), _rand(2, 12, 2, 36, seed=75)  # padded to 40
    for _ in range(2):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens)
    odd = _rand(2, 12, 2, 33, seed=76)[..., :32]  # a row stride that is not a multiple of 8
    q32 = _rand(2, 1, 4, 32, seed=77)
    for _ in range(2):
        flash_attn_with_kvcache(q32, odd, odd, cache_seqlens=lens)
    assert not kvcache._PLAIN_PLANS


# ================================================================================================
# FP8 caches through the composite path
# ================================================================================================


def _fp8_descales(kind, g, batch, kv):
    """k_descale, v_descale in one of the accepted forms (flashgen.torch.kvcache_fp8)."""
    if kind == "float":
        return tuple(0.1 + 0.9 * torch.rand((), generator=g).item() for _ in "kv")
    if kind == "scalar_tensor":
        return tuple(0.1 + 0.9 * torch.rand(1, generator=g) for _ in "kv")
    return tuple(0.1 + 0.9 * torch.rand(batch, kv, generator=g) for _ in "kv")


def _per_sequence(descale, batch, kv):
    """A descale as float64 (batch, kv_heads)."""
    if isinstance(descale, float):
        return torch.full((batch, kv), descale, dtype=torch.float64)
    return descale.double().reshape(-1).expand(batch * kv).reshape(batch, kv) if (
        descale.numel() == 1
    ) else descale.double()


def ref_kvcache_fp8(q, k8, v8, kd, vd, kw):
    """flash_attn_with_kvcache over FP8 caches in float64: (out, lse, k codes after, v codes
    after), the codes as uint8. Sequence b's keys are its cached codes times its descales
    (`k_descale[b, hk]`, whichever cache row or pages hold them), its new rows are stored as
    `quantize_rows` codes of k (after rotary) and attended as stored. Rotary comes from
    `kvcache_prep.rotate` (tested against float64 above): the subject here is where the
    codes go and how they are read."""
    batch, sq, h, d = q.shape
    kv = k8.shape[2]
    KD, VD = _per_sequence(kd, batch, kv), _per_sequence(vd, batch, kv)
    table = kw.get("block_table")
    page = k8.shape[1]
    cap = table.shape[1] * page if table is not None else k8.shape[1]
    left, right = (int(x) for x in kw.get("window_size", (-1, -1)))
    left = -1 if left >= cap else left
    right = -1 if right >= cap else right
    causal = kw.get("causal", False)
    advance = causal or left >= 0 or right >= 0
    lens = kw["cache_seqlens"]
    if isinstance(lens, int):
        lens = torch.full((batch,), lens, dtype=torch.int32)
    starts = kw.get("cache_leftpad")
    starts = [0] * batch if starts is None else [int(x) for x in starts]
    rows = kw.get("cache_batch_idx")
    rows = list(range(batch)) if rows is None else [int(x) for x in rows]
    k, v = kw.get("k"), kw.get("v")
    n_new = 0 if k is None else k.shape[1]
    qr = q
    if kw.get("rotary_cos") is not None:
        cos, sin, inter = kw["rotary_cos"], kw["rotary_sin"], kw.get("rotary_interleaved", True)
        qr = prep.rotate(q, cos, sin, prep.positions(lens, sq, advance), interleaved=inter)
        k = prep.rotate(k, cos, sin, prep.positions(lens, n_new), interleaved=inter)
    kc, vc = k8.view(torch.uint8).clone(), v8.view(torch.uint8).clone()

    def where(b, p):
        if table is not None:
            return int(table[b, p // page]), p % page
        return rows[b], p

    if n_new:
        k_codes = _fp8.quantize_rows(k, kd).view(torch.uint8)
        v_codes = _fp8.quantize_rows(v, vd).view(torch.uint8)
        for b in range(batch):
            for i in range(n_new):
                if int(lens[b]) + i < cap:
                    kc[where(b, int(lens[b]) + i)] = k_codes[b, i]
                    vc[where(b, int(lens[b]) + i)] = v_codes[b, i]
    fp8 = torch.float8_e4m3fn
    outs, lses = [], []
    for b in range(batch):
        span = range(starts[b], int(lens[b]) + n_new)
        kb = torch.stack([kc[where(b, p)] for p in span]) if span else kc.new_zeros(0, kv, d)
        vb = torch.stack([vc[where(b, p)] for p in span]) if span else vc.new_zeros(0, kv, d)
        kb = kb.view(fp8).double() * KD[b][:, None]
        vb = vb.view(fp8).double() * VD[b][:, None]
        alibi = kw.get("alibi_slopes")
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        scale = d**-0.5
        o, lse = ref_attention(qr[b], kb, vb, scale, causal, (left, right),
                               kw.get("softcap", 0.0), slopes)  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), kc, vc


@pytest.fixture
def fp8_kernels(kernels, monkeypatch):
    """`kernels`, and the FP8 decode kernel's launch emulated in float64 from the codes and
    descales it is given (recorded as "fp8_decode")."""
    real_as_meta = _fp8.as_meta

    def as_meta(t):
        m = real_as_meta(t)
        return m._replace(device="cuda") if getattr(m, "device", None) == "cpu" else m

    def launch(spec, q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, runtime,
               scale, num_splits, descales, strides, check_inputs, mask):  # fmt: skip
        causal, wl, wr = mask
        kernels.calls.append(("fp8_decode", dict(q=q, k_cache=k_cache, v_cache=v_cache,
                                                 cache_seqlens=cache_seqlens.clone(),
                                                 block_table=block_table, spec=spec)))  # fmt: skip
        batch, sq, h, d = q.shape
        kv = k_cache.shape[2]
        KD = _per_sequence(descales[0], batch, kv)
        VD = _per_sequence(descales[1], batch, kv)
        codes_k, codes_v = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        for b in range(batch):
            n = int(cache_seqlens[b])
            kb, vb = (seq_keys(c, b, n, block_table) for c in (codes_k, codes_v))
            kb = kb.view(torch.float8_e4m3fn).double() * KD[b][:, None]
            vb = vb.view(torch.float8_e4m3fn).double() * VD[b][:, None]
            o, lb = ref_attention(q[b], kb, vb, scale, causal, (wl, wr))
            out[b], lse[b] = o.to(q.dtype), lb.float()

    monkeypatch.setattr(_fp8, "as_meta", as_meta)
    monkeypatch.setattr(_fp8, "_decode_kernel", launch)
    return kernels


@settings(SETTINGS, max_examples=120)
@given(
    call=kvcache_calls(),
    kind=st.sampled_from(["per_head", "float", "scalar_tensor"]),
    scores=st.booleans(),
)
def test_fp8_caches_take_every_route_of_the_composite_path(fp8_kernels, call, kind, scores):
    """flash_attn_with_kvcache's calls (appends, rotary, batch indices, left padding, paged
    caches, any seqlen_q, windows, softcap, ALiBi, head dims and page sizes the FP8 decode
    kernels do not take) over float8_e4m3fn caches with descales of each accepted form:
    out and LSE against the float64 attention over `descale * code`, the caches' bytes after
    the call exactly the reference's, and the route (the FP8 decode kernel on the caller's
    caches or on a copy of the rows, or the varlen forward over a dequantised copy)."""
    q, k16, v16, kw = call
    if not scores:  # half the calls without softcap / ALiBi, which take the varlen route
        kw = {n: x for n, x in kw.items() if n not in ("softcap", "alibi_slopes")}
    g = torch.Generator().manual_seed(int(k16.float().abs().sum().item() * 1000) % 2**31)
    batch, kv = q.shape[0], k16.shape[2]
    kd, vd = _fp8_descales(kind, g, batch, kv)
    k8, v8 = k16.float().to(torch.float8_e4m3fn), v16.float().to(torch.float8_e4m3fn)
    want_o, want_lse, want_k, want_v = ref_kvcache_fp8(q, k8, v8, kd, vd, kw)
    fp8_kernels.calls.clear()
    ptr = (k8.data_ptr(), v8.data_ptr())
    out, lse = flash_attn_with_kvcache(q, k8, v8, return_softmax_lse=True, k_descale=kd,
                                       v_descale=vd, **kw)  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    _close(out, want_o, 4e-3 * max(1.0, want_o.abs().max().item()), "out")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    top = want_lse[finite].abs().max().item() if finite.any() else 1.0
    _close(lse[finite], want_lse[finite], 2e-3 * max(1.0, top), "lse")
    assert (k8.data_ptr(), v8.data_ptr()) == ptr  # written in place, not replaced
    assert torch.equal(k8.view(torch.uint8), want_k), "k_cache codes"
    assert torch.equal(v8.view(torch.uint8), want_v), "v_cache codes"
    ((name, args),) = fp8_kernels.calls
    sq, d = q.shape[1], q.shape[-1]
    page = k8.shape[1] if "block_table" in kw else None
    scored = bool(kw.get("softcap")) or "alibi_slopes" in kw
    packed = sq > 16 or not decode_serves(d, page) or d % 16 != 0 or scored
    copied = "cache_batch_idx" in kw or "cache_leftpad" in kw
    event(f"{name}, packed {packed}, scored {scored}, rows copied {copied}, appends {'k' in kw}")
    event(f"d {d}, descales {kind}")
    if packed:
        assert name == "fwd" and args["max_q"] == sq
        assert args["k"].dtype == q.dtype  # the dequantised copy
        assert args["k"].shape[0] == int(args["cu_k"][-1])  # exactly the used keys
    elif "cache_batch_idx" in kw or "cache_leftpad" in kw:
        assert name == "fp8_decode" and args["block_table"] is None
        assert args["k_cache"].shape == (batch, *k8.shape[1:])  # a copy of the rows' codes
        assert args["k_cache"].dtype == torch.float8_e4m3fn
    else:
        assert name == "fp8_decode"
        assert args["k_cache"].data_ptr() == k8.data_ptr()  # the caller's cache itself


def test_fp8_descales_follow_the_sequence_not_its_cache_row(fp8_kernels):
    """With cache_batch_idx, sequence b's keys (cached and appended) are scaled by
    k_descale[b], wherever row cache_batch_idx[b] is: two sequences of very different scales
    swapped between rows."""
    cap, d = 12, 32
    q = _rand(2, 1, 2, d, seed=90)
    k8 = _rand(3, cap, 1, d, seed=91).float().to(torch.float8_e4m3fn)
    v8 = _rand(3, cap, 1, d, seed=92).float().to(torch.float8_e4m3fn)
    kd = torch.tensor([[0.125], [2.0]])
    vd = torch.tensor([[4.0], [0.25]])
    kw = dict(k=_rand(2, 2, 1, d, seed=93), v=_rand(2, 2, 1, d, seed=94),
              cache_seqlens=torch.tensor([5, 7], dtype=torch.int32),
              cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))  # fmt: skip
    want_o, _, want_k, want_v = ref_kvcache_fp8(q, k8, v8, kd, vd, kw)
    out = flash_attn_with_kvcache(q, k8, v8, k_descale=kd, v_descale=vd, **kw)
    _close(out, want_o, 4e-3 * max(1.0, want_o.abs().max().item()), "out")
    assert torch.equal(k8.view(torch.uint8), want_k)
    assert torch.equal(v8.view(torch.uint8), want_v)
    # sequence 0's new key 0 sits in row 2 at 5, as the code of k / 0.125
    code = (kw["k"][0, 0].float() / 0.125).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(k8[2, 5].view(torch.uint8), code.view(torch.uint8))


def test_fp8_composite_refusals_write_nothing(fp8_kernels):
    """A bad descale, a missing one, or new rows of another dtype refuse an FP8 call on the
    composite path (rotary, left padding, more than 16 queries, softcap) before any code is
    written."""
    cap, d = 16, 32
    q = _rand(2, 20, 4, d, seed=95)
    k8 = _rand(2, cap, 2, d, seed=96).float().to(torch.float8_e4m3fn)
    before = k8.view(torch.uint8).clone()
    new = _rand(2, 2, 2, d, seed=97)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    ok = torch.ones(2, 2)
    cases = [
        (dict(k_descale=ok, v_descale=ok[:1]), r"v_descale has shape \(1, 2\)"),
        (dict(k_descale=ok), "needs v_descale"),
        (dict(k_descale=ok, v_descale=ok.half()), "dtype float16"),
        (dict(k_descale=ok, v_descale=ok, k=new.bfloat16(), v=new.bfloat16()), "dtype"),
        (dict(k_descale=ok, v_descale=ok, softcap=5.0, cache_leftpad=lens[:1]), "cache_leftpad"),
    ]
    for extra, message in cases:
        kw = dict(k=new, v=new, cache_seqlens=lens)
        kw.update(extra)
        with pytest.raises(UnsupportedCall, match=message):
            flash_attn_with_kvcache(q, k8, k8, **kw)
        assert torch.equal(k8.view(torch.uint8), before), extra
    assert not fp8_kernels.calls
