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

Refused (`UnsupportedCall`, naming what is wrong and what is allowed): an FP8 cache without
both descales, descales with either cache not FP8, descales of another shape, dtype or device,
one cache FP8 and the other not, an FP8 q, new k or v of another shape or dtype, and what
the FP8 decode kernels do not serve yet: rotary, `cache_batch_idx`, `cache_leftpad`, more
than 16 queries, softcap, ALiBi and sinks.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from flashgen.generator.spec import KvDtype
from flashgen.torch.selection import TensorMeta, UnsupportedCall

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "append_fp8",
    "check_fp8_append",
    "check_fp8_call",
    "descale_layout",
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
    unsupported: dict[str, bool] | None = None,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The FP8-specific checks of one call (module doc); returns the (batch, head) strides
    of k_descale and v_descale. `unsupported` names arguments given that the FP8 decode
    kernels do not serve (True: given). The shapes, layouts and lengths are checked by
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
    for name, given in (unsupported or {}).items():
        if given:
            raise UnsupportedCall(
                f"{name} is not served with FP8 caches yet (allowed with {FP8_DTYPE} caches: "
                "q of 1..16 queries, k and v to append, cache_seqlens, block_table, causal, "
                "window_size, softmax_scale, num_splits, return_softmax_lse)"
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
    k_descale: Any, v_descale: Any,
) -> None:  # fmt: skip
    """Quantise k, v (`quantize_rows`) and write them into the FP8 caches in place at
    `cache_seqlens[b] + i` (`kvcache_prep.append` on the bytes: out-of-range rows dropped)."""
    import torch
    from flashgen.torch import kvcache_prep as prep

    k8, v8 = quantize_rows(k, k_descale), quantize_rows(v, v_descale)
    as_bytes = [t.view(torch.uint8) for t in (k_cache, v_cache, k8, v8)]
    prep.append(*as_bytes, cache_seqlens, block_table=block_table)


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
    unsupported: dict[str, bool],
    k: Any = None,
    v: Any = None,
) -> tuple[Any, Any]:
    """The decode kernel of an FP8-cache call: checks (this module's, then check_kvcache's on
    the caches as if they had q's dtype: strides and shapes are the same in elements), the
    `kv_dtype: e4m3` spec of the device, and one launch. Returns (out, lse)."""
    import torch
    from flashgen.torch import kvcache as kc
    from flashgen.torch import kvcache_select as sel
    from flashgen.torch.ops import _meta

    qm, km, vm = _meta(q), _meta(k_cache), _meta(v_cache)
    batch = q.shape[0] if q.dim() == 4 else 0
    kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else 0
    (kbs, khs), (vbs, vhs) = check_fp8_call(
        qm, km, vm, as_meta(k_descale), as_meta(v_descale), batch=batch, kv_heads=kv_heads,
        unsupported=unsupported,
    )  # fmt: skip
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
    kd = _descale_tensor(k_descale, q.device)
    vd = _descale_tensor(v_descale, q.device)
    params = kc._decode_params(
        q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, runtime, scale, 0,
        num_splits, frozenset(), 0.0, None, None,
    )  # fmt: skip
    params.update(
        k_descale=kd.data_ptr(), v_descale=vd.data_ptr(),
        k_descale_batch_stride=kbs, k_descale_head_stride=khs,
        v_descale_batch_stride=vbs, v_descale_head_stride=vhs,
    )  # fmt: skip
    kc._launch(kc._library(spec), params, pb, q.device, check_inputs)
    # (kd, vd live until the launch is queued; the stream orders their later reuse)
    return out, lse


def _descale_tensor(d: Any, device: Any) -> Any:
    """A float32 tensor the kernel reads a descale from: the caller's, or one element
    holding a Python float."""
    import torch

    if isinstance(d, torch.Tensor):
        return d.detach()
    return torch.full((1,), float(d), dtype=torch.float32, device=device)
