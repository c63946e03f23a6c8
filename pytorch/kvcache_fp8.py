"""FP8 (e4m3) KV caches for `flash_attn_with_kvcache`: argument checks and the decode call.

Convention (FlashAttention-3's `flash_attn_with_kvcache`; vLLM's FP8 caches): `k_cache` and
`v_cache` are `torch.float8_e4m3fn` (contiguous `(batch, max_seqlen, kv_heads, d)` or paged
`(num_pages, page_size, kv_heads, d)` with a block table), q and the output float16 or
bfloat16, and the attention is computed over `k_descale[b, hk] * k_cache` and `v_descale[b,
hk] * v_cache`:

- `k_descale`, `v_descale`: float32 `(batch, kv_heads)` (FA3), or a per-tensor scale as
  vLLM's `k_scale` / `v_scale` are: a float32 tensor of one element (shape `()` or `(1,)`) or
  a Python float, broadcast to every (b, hk) (a stride-0 view, no copy).
- The kernel (`kv_dtype: e4m3` specs, docs/decode.md "FP8 KV caches") folds k_descale into
  the softmax scale and multiplies O by v_descale in fp32, so the result is that of the
  dequantised cache, to the q dtype's rounding.

Appending (`k`, `v` `(batch, seqlen_new, kv_heads, d)` in q's dtype, with a tensor or int
`cache_seqlens` of the keys before the call): each new row is quantised with its (b, hk)'s
descale, `(x / descale)` clamped to +-448 (the saturating rule vLLM's quantisers use; a NaN
stays NaN) and rounded to nearest-even e4m3, and written in place at positions
`cache_seqlens[b] + i` (contiguous row b, or through the block table), before the kernel
reads the caches with `cache_seqlens + seqlen_new` keys; rows whose destination lies outside
the cache are dropped, as on the 16-bit path (`kvcache_prep.append` writes the bytes).

Rotary, `cache_batch_idx`, `cache_leftpad`, more than 16 queries and the score modifiers
(softcap, ALiBi, sinks) take `flash_attn_with_kvcache`'s composite path with FP8 caches as
with 16-bit ones (docs/torch.md, "Appending, rotary, batch indices, left padding"): the
descales are the call's, indexed by the sequence b (not by its cache row under
`cache_batch_idx`), and the caches' bytes are copied and written as e4m3 codes:

- `cache_batch_idx` / `cache_leftpad` with at most 16 queries: the FP8 decode kernel reads a
  copy of the selected rows' codes (`cache_rows` on the bytes), with the new rows quantised
  into it, then into the caller's rows;
- more than 16 queries, a head dim or page size the FP8 decode kernels do not take, or a
  score modifier (the FP8 decode kernels have no score stage yet): the varlen forward in q's
  dtype over a packed copy of the used keys, dequantised (`descale * code`, rounded once to
  q's dtype; the new rows quantised first, so the attention sees what the cache stores).
  This is a copy of every used key per call, as for 16-bit caches there, and a slower path
  than the FP8 decode kernel's in-place read.

Refused (`UnsupportedCall`, naming what is wrong and what is allowed): an FP8 cache without
both descales, descales with either cache not FP8, descales of another shape, dtype or device,
one cache FP8 and the other not, an FP8 q, new k or v of another shape or dtype.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional

from flashgen.generator.spec import KvDtype
from flashgen.torch.selection import TensorMeta, UnsupportedCall

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "Fp8Scales",
    "append_fp8",
    "cache_rows_fp8",
    "check_fp8_append",
    "check_fp8_call",
    "descale_layout",
    "dequantize_rows",
    "fp8_scales",
    "pack_dequantized",
    "quantize_rows",
]

FP8_DTYPE = KvDtype.E4M3.torch_name  # "float8_e4m3fn"
_HALF = ("float16", "bfloat16")
E4M3_MAX = 448.0


def descale_layout(
    name: str, d: TensorMeta | float | None, batch: int, kv_heads: int, device: str
) -> tuple[int, int]:
    """The (batch, head) strides a descale is read with: its own for `(batch, kv_heads)`, 0
    and 0 for a per-tensor scalar (one element, or a Python float). Refuses anything else."""
    allowed = (
        f"allowed: float32 ({batch}, {kv_heads}) = (batch, kv_heads) as FA3's "
        "flash_attn_with_kvcache, or a per-tensor scale (a float32 tensor of one element, or "
        "a float) as vLLM's k_scale / v_scale"
    )
    if d is None:
        raise UnsupportedCall(
            f"an FP8 cache ({FP8_DTYPE}) needs {name}: the cache holds K8 and the attention "
            f"uses {name} * K8 ({allowed})"
        )
    if isinstance(d, (float, int)) and not isinstance(d, bool):
        return 0, 0
    if not isinstance(d, TensorMeta):
        raise UnsupportedCall(f"{name} is a {type(d).__name__} ({allowed})")
    if d.dtype != "float32":
        raise UnsupportedCall(f"{name} has dtype {d.dtype} ({allowed})")
    if d.device != device:
        raise UnsupportedCall(f"{name} is on {d.device}, the caches on {device}")
    n = 1
    for x in d.shape:
        n *= x
    if len(d.shape) <= 1 and n == 1:
        return 0, 0
    if tuple(d.shape) != (batch, kv_heads):
        raise UnsupportedCall(f"{name} has shape {tuple(d.shape)} ({allowed})")
    return int(d.stride[0]), int(d.stride[1])


def check_fp8_call(
    q: TensorMeta,
    k_cache: TensorMeta,
    v_cache: TensorMeta,
    k_descale: TensorMeta | float | None,
    v_descale: TensorMeta | float | None,
    *,
    batch: int,
    kv_heads: int,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The FP8-specific checks of one call (module doc); returns the (batch, head) strides
    of k_descale and v_descale. The shapes, layouts and lengths are checked by
    `kvcache_select.check_kvcache` as for a 16-bit cache."""
    if q.dtype == FP8_DTYPE:
        raise UnsupportedCall(
            f"q has dtype {FP8_DTYPE}: FP8 caches take q in float16 or bfloat16 (an FP8 q is "
            "the FP8 forward's, not the decode kernels')"
        )
    if q.dtype not in _HALF:
        raise UnsupportedCall(f"q has dtype {q.dtype}; allowed with FP8 caches: float16, bfloat16")
    kinds = {name: t.dtype for name, t in (("k_cache", k_cache), ("v_cache", v_cache))}
    if FP8_DTYPE not in kinds.values():
        raise UnsupportedCall(
            f"k_descale / v_descale are for FP8 caches ({FP8_DTYPE}); k_cache is "
            f"{kinds['k_cache']} and v_cache {kinds['v_cache']} (drop the descales, or pass "
            f"{FP8_DTYPE} caches)"
        )
    if kinds["k_cache"] != kinds["v_cache"]:
        raise UnsupportedCall(
            f"k_cache is {kinds['k_cache']} and v_cache {kinds['v_cache']}: mixed caches are "
            f"not served (allowed: both {FP8_DTYPE} with descales, or both q's {q.dtype})"
        )
    ks = descale_layout("k_descale", k_descale, batch, kv_heads, k_cache.device)
    vs = descale_layout("v_descale", v_descale, batch, kv_heads, v_cache.device)
    return ks, vs


def check_fp8_append(
    q: TensorMeta, k_cache: TensorMeta, k: TensorMeta | None, v: TensorMeta | None,
    cache_seqlens: Any,
) -> int:  # fmt: skip
    """The new rows of an appending FP8 call: k and v together, `(batch, seqlen_new,
    kv_heads, d)` like each other, in q's dtype, on the caches' device, and cache_seqlens
    given. Returns seqlen_new (0 without k, v)."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise UnsupportedCall("k and v are appended together: pass both, or neither")
    want = (q.shape[0], None, k_cache.shape[2], k_cache.shape[3])
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise UnsupportedCall(
                f"{name} has dtype {t.dtype}: new rows come in q's {q.dtype} and are quantised "
                f"into the {FP8_DTYPE} cache with the descales"
            )
        if len(t.shape) != 4 or any(w is not None and s != w for s, w in zip(t.shape, want)):
            raise UnsupportedCall(
                f"{name} has shape {tuple(t.shape)}; allowed: (batch, seqlen_new, kv_heads, "
                f"head_dim) = ({want[0]}, n, {want[2]}, {want[3]})"
            )
        if t.device != k_cache.device:
            raise UnsupportedCall(f"{name} is on {t.device}, the caches on {k_cache.device}")
    if tuple(k.shape) != tuple(v.shape):
        raise UnsupportedCall(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if cache_seqlens is None:
        raise UnsupportedCall(
            "appending k, v needs cache_seqlens (the keys each sequence holds before the call)"
        )
    return int(k.shape[1])


def quantize_rows(x: Any, descale: Any) -> Any:
    """x `(batch, n, kv_heads, d)` as float8_e4m3fn codes of `x / descale[b, hk]`, clamped to
    +-448 (a NaN stays NaN): `descale` a `(batch, kv_heads)` tensor (any strides), a
    one-element tensor or a float."""
    import torch

    xf = x.float()
    if isinstance(descale, torch.Tensor):
        d = descale.to(device=x.device, dtype=torch.float32)
        d = d.reshape(()) if d.numel() == 1 else d[:, None, :, None]
    else:
        d = float(descale)
    return (xf / d).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def append_fp8(
    k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any,
    k_descale: Any, v_descale: Any, *, cache_batch_idx: Any = None,
) -> None:  # fmt: skip
    """Quantise k, v (`quantize_rows`, row b with sequence b's descales) and write them into
    the FP8 caches in place at `cache_seqlens[b] + i` of cache row b (`cache_batch_idx[b]`)
    or of its pages (`kvcache_prep.append` on the bytes: out-of-range rows dropped)."""
    import torch
    from flashgen.torch import kvcache_prep as prep

    k8, v8 = quantize_rows(k, k_descale), quantize_rows(v, v_descale)
    as_bytes = [t.view(torch.uint8) for t in (k_cache, v_cache, k8, v8)]
    prep.append(*as_bytes, cache_seqlens, cache_batch_idx=cache_batch_idx,
                block_table=block_table)  # fmt: skip


class Fp8Scales(NamedTuple):
    """The descales of an FP8-cache call that takes the composite path, as the caller gave
    them (checked by `fp8_scales`)."""

    k_descale: Any
    v_descale: Any


def fp8_scales(q: Any, k_cache: Any, v_cache: Any, k_descale: Any, v_descale: Any) -> Fp8Scales:
    """`check_fp8_call` on a composite call's tensors (before anything is copied or written)."""
    from flashgen.torch.ops import _meta

    batch = q.shape[0] if q.dim() == 4 else 0
    kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 0
    check_fp8_call(
        _meta(q), _meta(k_cache), _meta(v_cache), as_meta(k_descale), as_meta(v_descale),
        batch=batch, kv_heads=kv_heads,
    )  # fmt: skip
    return Fp8Scales(k_descale, v_descale)


def cache_rows_fp8(cache: Any, batch: int, *, cache_batch_idx: Any, cache_leftpad: Any) -> Any:
    """`kvcache_prep.cache_rows` of an FP8 cache: the same copy, of the codes (as bytes)."""
    import torch
    from flashgen.torch import kvcache_prep as prep

    rows = prep.cache_rows(cache.view(torch.uint8), batch, cache_batch_idx=cache_batch_idx,
                           cache_leftpad=cache_leftpad)  # fmt: skip
    return rows.view(torch.float8_e4m3fn)


def dequantize_rows(codes: Any, descale: Any, seq: Any, dtype: Any) -> Any:
    """`(descale[seq[t], hk] * codes[t, hk, :])` in `dtype` (computed in float32, rounded once)
    for packed rows `codes (total, kv_heads, d)` of sequences `seq (total,)`; a per-tensor
    descale (one element, or a float) for every row. NaN codes stay NaN."""
    import torch

    x = codes.to(torch.float32)
    if isinstance(descale, torch.Tensor):
        d = descale.to(device=x.device, dtype=torch.float32)
        d = d.reshape(()) if d.numel() == 1 else d[seq][:, :, None]
    else:
        d = float(descale)
    return (x * d).to(dtype)


def pack_dequantized(
    cache: Any, descale: Any, cu_seqlens: Any, total: int, dtype: Any, *, lengths: Any = None,
    starts: Any = None, cache_batch_idx: Any = None, block_table: Any = None, new: Any = None,
) -> Any:  # fmt: skip
    """`kvcache_prep.pack` of an FP8 cache, dequantised to `dtype`: each sequence's used codes
    then its new rows (`new`, in q's dtype, quantised with the sequence's descale first, as
    `append_fp8` stores them), times the sequence's descale (`dequantize_rows`)."""
    import torch
    from flashgen.torch import kvcache_prep as prep

    new8 = None if new is None else quantize_rows(new, descale).view(torch.uint8)
    codes = prep.pack(cache.view(torch.uint8), cu_seqlens, total, lengths=lengths,
                      starts=starts, cache_batch_idx=cache_batch_idx,
                      block_table=block_table, new=new8).view(torch.float8_e4m3fn)  # fmt: skip
    batch = cu_seqlens.shape[0] - 1
    rows = torch.arange(codes.shape[0], dtype=torch.int64, device=codes.device)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), rows, right=True)
    return dequantize_rows(codes, descale, seq.clamp(max=max(batch - 1, 0)), dtype)


def as_meta(t: Any) -> TensorMeta | float | None:
    """A descale argument as the checks take it: None, a float, or a tensor's TensorMeta."""
    if t is None:
        return None
    if isinstance(t, float) or (isinstance(t, int) and not isinstance(t, bool)):
        return float(t)
    if hasattr(t, "shape") and hasattr(t, "stride"):
        return TensorMeta(
            tuple(t.shape),
            tuple(t.stride()),
            str(t.dtype).removeprefix("torch."),
            t.device.type,
        )
    return t  # refused by descale_layout with its type's name


def fp8_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k_descale: Any,
    v_descale: Any,
    *,
    cache_seqlens: Any,
    block_table: Optional[Any],
    softmax_scale: Optional[float],
    causal: bool,
    window_size: Any,
    num_splits: int,
    check_inputs: bool,
    k: Any = None,
    v: Any = None,
) -> tuple[Any, Any]:
    """The decode kernel of an FP8-cache call: checks (this module's, then check_kvcache's on
    the caches as if they had q's dtype: strides and shapes are the same in elements), the
    `kv_dtype: e4m3` spec of the device, the new rows appended (quantised), and one launch
    (`_decode_kernel`). Returns (out, lse)."""
    import torch
    from flashgen.torch import kvcache as kc
    from flashgen.torch import kvcache_select as sel
    from flashgen.torch.ops import _meta

    qm, km, vm = _meta(q), _meta(k_cache), _meta(v_cache)
    batch = q.shape[0] if q.dim() == 4 else 0
    kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 0
    (kbs, khs), (vbs, vhs) = check_fp8_call(
        qm, km, vm, as_meta(k_descale), as_meta(v_descale), batch=batch, kv_heads=kv_heads
    )
    n_new = check_fp8_append(
        qm, km, None if k is None else _meta(k), None if v is None else _meta(v), cache_seqlens
    )
    if type(num_splits) is not int:
        num_splits = operator.index(num_splits)
    d = q.shape[-1]
    scale = float(softmax_scale) if softmax_scale is not None else d**-0.5
    if isinstance(cache_seqlens, int) or cache_seqlens is None:
        cap = kc._capacity(k_cache, block_table)
        n = cap if cache_seqlens is None else int(cache_seqlens)
        cache_seqlens = torch.full((batch,), n, dtype=torch.int32, device=q.device)
    as_q = {"k_cache": km._replace(dtype=qm.dtype), "v_cache": vm._replace(dtype=qm.dtype)}
    pb = sel.check_kvcache(
        qm, as_q["k_cache"], as_q["v_cache"], cache_seqlens=_meta(cache_seqlens),
        block_table=None if block_table is None else _meta(block_table),
        num_splits=num_splits, softmax_scale=scale,
    )  # fmt: skip
    for name, m in (("k_cache", km), ("v_cache", vm)):
        if any(s % 16 for s in m.stride[:3]):
            raise UnsupportedCall(
                f"{name} has strides {m.stride}: FP8 caches need the first three strides in "
                "multiples of 16 elements (16-byte rows chunks; a contiguous cache of head_dim "
                "a multiple of 16 has them)"
            )
    left, right = sel.window_pair(window_size)
    cap = kc._capacity(k_cache, block_table)
    if cap is not None:
        left, right, _ = sel.kvcache_window(causal, (left, right), cap)
    mask, window, runtime = sel.decode_mask(causal, (left, right), pb.seqlen_q)
    call = sel.DecodeCall(
        pb.dtype, int(d), kc._capability(q.device), pb.paged, mask, window,
        kv_dtype=KvDtype.E4M3,
    )  # fmt: skip
    spec = sel.decode_spec(call)
    out, lse = kc._outputs(q, pb)
    if n_new:  # every check passed: the new rows go in before the kernel reads the caches
        lens_before = cache_seqlens
        append_fp8(k_cache, v_cache, k.detach(), v.detach(), lens_before, block_table,
                   k_descale, v_descale)  # fmt: skip
        cache_seqlens = (lens_before + n_new).to(torch.int32)
    if kc._served_without_kernel(out, lse, k_cache, cache_seqlens, check_inputs, None):
        return out, lse
    _decode_kernel(
        spec, q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, runtime, scale,
        num_splits, (k_descale, v_descale), ((kbs, khs), (vbs, vhs)), check_inputs,
        (bool(causal), left, right),
    )  # fmt: skip
    return out, lse


def _decode_kernel(
    spec, q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, runtime, scale,
    num_splits, descales, descale_strides, check_inputs, mask,
) -> None:  # fmt: skip
    """The launch of the FP8 decode kernel `spec`, writing out and lse. `mask` (causal,
    left, right) is what `runtime` encodes (the CPU tests' emulation reads it)."""
    from flashgen.torch import kvcache as kc

    (kbs, khs), (vbs, vhs) = descale_strides
    kd = _descale_tensor(descales[0], q.device)
    vd = _descale_tensor(descales[1], q.device)
    params = kc._decode_params(
        q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, runtime, scale, 0,
        num_splits, frozenset(), 0.0, None, None, trap=not check_inputs,
    )  # fmt: skip
    params.update(
        k_descale=kd.data_ptr(), v_descale=vd.data_ptr(),
        k_descale_batch_stride=kbs, k_descale_head_stride=khs,
        v_descale_batch_stride=vbs, v_descale_head_stride=vhs,
    )  # fmt: skip
    kc._launch(kc._library(spec), params, pb, q.device, check_inputs)
    # (kd, vd live until the launch is queued; the stream orders their later reuse)


def _descale_tensor(d: Any, device: Any) -> Any:
    """A float32 tensor the kernel reads a descale from: the caller's, or one element
    holding a Python float."""
    import torch

    if isinstance(d, torch.Tensor):
        return d.detach()
    return torch.full((1,), float(d), dtype=torch.float32, device=device)
