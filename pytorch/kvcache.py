"""flash-attn 2's `flash_attn_with_kvcache` over flashgen's decode kernels, and `merge_states`.

    from flashgen.torch import flash_attn_with_kvcache, merge_states
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    out, lse = flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=lens,
                                       block_table=table, return_softmax_lse=True)
    o, lse = merge_states(o_parts, lse_parts)       # context parallelism: merge partial results

Operators (`torch.library.custom_op`, with fake implementations for torch.compile):

    flashgen::decode(q, k_cache, v_cache, cache_seqlens, block_table?, softmax_scale, causal,
                     window_left, window_right, num_splits, max_seqlen_k, check_inputs,
                     softcap=0.0, alibi_slopes?=None, learnable_sink?=None)
        -> (out, softmax_lse)
    flashgen::merge_states(o_parts, lse_parts, out_dtype) -> (out, lse)

Both allocate their outputs and the workspace with `torch.empty` on the caller's device and
launch on `torch.cuda.current_stream()`; neither synchronises with the host unless the call
asks for the device-side input check (`check_inputs`, below). Neither has a gradient: they
serve inference. `flash_attn_with_kvcache` and `merge_states` detach their inputs, so calling
them on tensors that require grad works and returns outputs that do not (as flash-attn's
`flash_attn_with_kvcache`, which has no backward either); calling the raw operators on such
tensors fails at `backward()` (no autograd formula is registered).

Head dims and layouts (docs/torch.md, "Head dims and layouts"): a head dim d in 1..256 the
decode kernels do not serve is zero-padded to the next one they serve (`_decode_inputs`: q and
both caches are read through padded copies, the output is sliced back; `merge_states` pads
o_parts alike), and a q or cache whose layout the kernels cannot read is copied once into the
contiguous layout. A cache copy costs a copy of the whole cache per call. flashgen does not
append to caches (k=, v= are refused), so every cache is read-only here and may be copied; a
call that writes a cache in place would be refused instead (`kvcache_select.cache_copy`).

Bad cache metadata (docs/decode.md, "Bad input"): a block-table entry outside `[0,
num_pages)` for a used page, or a `cache_seqlens` entry outside `[0, capacity]`, is never
dereferenced: the kernel sets a bit of the workspace's error word and the outputs are
meaningless. Reading that word costs a device-to-host copy and a sync per call (and is not
possible under CUDA graph capture), so it is opt-in: `check_inputs=True` (a keyword-only
argument flash-attn does not have), or the environment variable FLASHGEN_KVCACHE_CHECK=1 for
callers that cannot pass it; a flagged call then raises `kvcache_select.CacheInputError`.
"""

import operator
import os
from typing import Optional, Union

import torch
import torch.nn.functional as F
from flashgen.generator.families.decode import WORKSPACE_HEADER
from flashgen.generator.spec import Dtype, KernelKind
from flashgen.runtime import DecodeLibrary
from flashgen.torch import cache, selection
from flashgen.torch import kvcache_select as ks
from flashgen.torch.kvcache_select import CacheInputError, DecodeCall, KvProblem
from flashgen.torch.ops import _capability as _device_capability
from flashgen.torch.ops import (
    _check_aligned,
    _empty_lse,
    _meta,
    as_softcap,
    check_score_tensors,
    score_features,
)
from flashgen.torch.ops import score_params as _score_params
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = [
    "CHECK_ENV",
    "CacheInputError",
    "decode",
    "flash_attn_with_kvcache",
    "merge_states",
    "merge_states_op",
]

CHECK_ENV = "FLASHGEN_KVCACHE_CHECK"  # "1": check_inputs=True by default
_TORCH_DTYPES = {Dtype.FP16: torch.float16, Dtype.BF16: torch.bfloat16}
_HALF = (torch.float16, torch.bfloat16)
_DECODE = (KernelKind.DECODE,)


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability (ops._capability's per-index cache)."""
    return _device_capability(
        device.index if device.index is not None else torch.cuda.current_device()
    )


_LIBRARIES: dict = {}


def _library(spec) -> DecodeLibrary:
    """The decode library of a spec: found (or compiled on first use) by
    `flashgen.torch.cache.kernel_library`, opened with the decode entry points."""
    lib = _LIBRARIES.get(spec)
    if lib is None:
        lib = _LIBRARIES[spec] = DecodeLibrary(spec, cache.kernel_library(spec).path.parent)
    return lib


def _one_device(**tensors: Optional[Tensor]) -> None:
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        named = ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if t is not None)
        raise UnsupportedCall(f"all tensors must be on one device, got {named}")


def _strides(prefix: str, t: Tensor) -> dict[str, int]:
    s = ks.used_strides(_meta(t))
    return {f"{prefix}_batch_stride": s[0], f"{prefix}_row_stride": s[1],
            f"{prefix}_head_stride": s[2]}  # fmt: skip


def _problem(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    block_table: Optional[Tensor],
    num_splits: int,
    softmax_scale: float,
) -> KvProblem:
    pb = ks.check_kvcache(
        _meta(q),
        _meta(k_cache),
        _meta(v_cache),
        cache_seqlens=_meta(cache_seqlens),
        block_table=None if block_table is None else _meta(block_table),
        num_splits=num_splits,
        softmax_scale=softmax_scale,
    )
    _one_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                block_table=block_table)  # fmt: skip
    return pb


def _spec(q: Tensor, pb: KvProblem, causal: bool, window_left: int, window_right: int, features):
    mask, window, runtime = ks.decode_mask(causal, (window_left, window_right), pb.seqlen_q)
    call = DecodeCall(
        pb.dtype, int(pb.head_dim), _capability(q.device), pb.paged, mask, window, features
    )
    return ks.decode_spec(call), runtime


# --------------------------------------------------------------------------------------------
# Head dims without a decode kernel (zero-padded) and layouts it cannot read (copied)
# --------------------------------------------------------------------------------------------


def _on_cuda(t: Tensor) -> bool:
    """Whether t lives on a CUDA device (the mocked-CUDA CPU tests replace this)."""
    return t.device.type == "cuda"


@torch.compiler.assume_constant_result
def _decode_head_dim(head_dim: int, index: Optional[int], what: str) -> int:
    """`selection.padded_head_dim` of the decode kernels on CUDA device `index` (None: the
    current one); torch.compile calls it at trace time and keeps the result."""
    device = torch.device("cuda") if index is None else torch.device("cuda", index)
    return selection.padded_head_dim(head_dim, _capability(device), _DECODE, what)


def _offset_ok(t: Tensor) -> bool:
    """t's first element is on a 16-byte boundary of its storage (not known at trace time
    under torch.compile: the op then refuses a misaligned view at run time, as before)."""
    if torch.compiler.is_compiling():
        return True
    return not selection.misaligned(t.shape, t.storage_offset(), t.element_size())


def _cache_readable(t: Tensor) -> bool:
    return ks.cache_layout_ok(tuple(t.shape), tuple(t.stride())) and _offset_ok(t)


def _padded_meta(t: Tensor):
    """t's TensorMeta (its shape) with contiguous strides of its last dimension rounded up to
    a multiple of 8: a layout the kernels read, as the (padded) copies have."""
    m = _meta(t)
    if not m.shape:
        return m
    stride, acc = [1], -(-m.shape[-1] // 8) * 8
    for n in reversed(m.shape[:-1]):
        stride.insert(0, acc)
        acc *= max(n, 1)
    return m._replace(stride=tuple(stride))


def _check_unpadded(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, scale) -> None:
    """check_kvcache of the caller's tensors as they will be copied (their shapes, readable
    strides): a refusal names the caller's shapes and their first problem."""
    lens = _meta(cache_seqlens) if isinstance(cache_seqlens, Tensor) else cache_seqlens
    ks.check_kvcache(
        _padded_meta(q),
        _padded_meta(k_cache),
        _padded_meta(v_cache),
        cache_seqlens=lens,
        block_table=None if block_table is None else _meta(block_table),
        num_splits=num_splits,
        softmax_scale=scale,
    )


def _decode_inputs(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens,
    block_table: Optional[Tensor],
    num_splits: int,
    softmax_scale: float,
    written: bool,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """(q, k_cache, v_cache) as the decode kernels read them (detached), and the head dim
    they run at: zero-padded copies when the kernels do not serve q's head dim, one copy in
    the contiguous layout of a tensor they cannot read. A cache the call writes (`written`:
    appended k, v) is never copied: `kvcache_select.cache_copy` refuses the call. Tensors the
    op refuses anyway (not CUDA, not float16/bfloat16, not 4-D, head dims that differ) are
    passed on as they are, to its message."""
    one_cache = v_cache is k_cache  # (before detach() makes two tensor objects of it)
    q, k_cache, v_cache = q.detach(), k_cache.detach(), v_cache.detach()
    d = q.shape[-1] if q.dim() else 0
    if not (_on_cuda(q) and q.dtype in _HALF and q.dim() == 4):
        return q, k_cache, v_cache, d
    compiling = torch.compiler.is_compiling()
    args = (q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale)
    if k_cache.dim() == 0 or v_cache.dim() == 0 or not k_cache.shape[-1] == v_cache.shape[-1] == d:
        if not compiling:  # refused: say the head dims differ (not that a stride is odd)
            _check_unpadded(*args)
        return q, k_cache, v_cache, d
    padded = _decode_head_dim(operator.index(d), q.device.index, "decode")
    if padded != d and not compiling:  # refusals name the caller's shapes, not padded ones
        _check_unpadded(*args)
    if written and not compiling:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            ks.cache_copy(name, _meta(t), t.storage_offset(), d, padded, written=True)
    q_run, k_run = _readable_copy(q, d, padded), _readable_copy(k_cache, d, padded)
    v_run = k_run if one_cache else _readable_copy(v_cache, d, padded)
    return q_run, k_run, v_run, padded


def _readable_copy(t: Tensor, head_dim: int, padded: int) -> Tensor:
    """t zero-padded to `padded` columns, and copied once into the contiguous layout when
    the decode kernels cannot read it (t itself when neither is needed)."""
    if padded != head_dim:
        t = F.pad(t, (0, padded - head_dim))
    if not _cache_readable(t):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _outputs(q: Tensor, pb: KvProblem) -> tuple[Tensor, Tensor]:
    out = torch.empty(
        (pb.batch, pb.seqlen_q, pb.heads, pb.head_dim), dtype=q.dtype, device=q.device
    )
    lse = torch.empty((pb.batch, pb.heads, pb.seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


# --------------------------------------------------------------------------------------------
# flashgen::decode
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("flashgen::decode", mutates_args=())
def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    block_table: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    num_splits: int,
    max_seqlen_k: int,
    check_inputs: bool,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    pb = _problem(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale)
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    spec, (win_l, win_r) = _spec(q, pb, causal, window_left, window_right, feats)
    device = q.device
    out, lse = _outputs(q, pb)
    if out.numel() == 0:  # no sequence or no query
        return out, lse
    if k_cache.numel() == 0:  # a contiguous cache of capacity 0: no key anywhere
        if check_inputs and bool((cache_seqlens != 0).any()):
            raise CacheInputError(ks.describe_errors(ks.ERR_SEQLEN, 0, None))
        out.zero_()
        _empty_lse(lse, learnable_sink)  # -inf, or the head's sink
        return out, lse
    _check_aligned(q=q, k_cache=k_cache, v_cache=v_cache)
    lib = _library(spec)
    params = {
        "q": q.data_ptr(),
        "k": k_cache.data_ptr(),
        "v": v_cache.data_ptr(),
        "o": out.data_ptr(),
        "lse": lse.data_ptr(),
        "cache_seqlens": cache_seqlens.data_ptr(),
        "block_table": 0 if block_table is None else block_table.data_ptr(),
        **_strides("q", q),
        **_strides("k", k_cache),
        **_strides("v", v_cache),
        **_strides("o", out),
        "lse_batch_stride": pb.heads * pb.seqlen_q,
        "lse_head_stride": pb.seqlen_q,
        "batch": pb.batch,
        "heads": pb.heads,
        "kv_heads": pb.kv_heads,
        "seqlen_q": pb.seqlen_q,
        "seqlen_k": 0 if pb.paged else pb.capacity,
        "max_seqlen_k": max(0, min(int(max_seqlen_k), pb.capacity)),
        "head_dim": q.shape[-1],  # <name>_check compares them with the kernel's
        "head_dim_v": v_cache.shape[-1],
        "page_size": pb.page_size,
        "num_pages": pb.num_pages,
        "max_pages": pb.max_pages,
        "block_table_stride": pb.block_table_stride,
        "softmax_scale": softmax_scale,
        "window_left": win_l,
        "window_right": win_r,
        "num_splits": num_splits,
    }
    if feats:
        params.update(_score_params(feats, softcap, alibi_slopes, learnable_sink))
    with torch.cuda.device(device):
        size = max(lib.workspace_bytes(params), WORKSPACE_HEADER)
        workspace = torch.empty(size, dtype=torch.uint8, device=device)
        workspace[:WORKSPACE_HEADER].zero_()  # the error word: the kernels only OR into it
        params["workspace"] = workspace.data_ptr()
        params["workspace_size"] = size
        lib.launch(params, torch.cuda.current_stream(device).cuda_stream)
        if check_inputs:
            word = int(workspace[:4].view(torch.int32).item())  # syncs with the stream
            if word:
                pages = pb.num_pages if pb.paged else None
                raise CacheInputError(ks.describe_errors(word, pb.capacity, pages))
    return out, lse


@decode.register_fake
def _decode_fake(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
    window_right, num_splits, max_seqlen_k, check_inputs, softcap=0.0, alibi_slopes=None,
    learnable_sink=None,
):  # fmt: skip
    pb = _problem(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale)
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    # refuse at trace time what no kernel serves
    _spec(q, pb, causal, window_left, window_right, feats)
    return _outputs(q, pb)


Result = Union[Tensor, tuple[Tensor, Tensor]]


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Union[Tensor, int, None] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    check_inputs: Optional[bool] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Result:
    """Attention of a few new queries over a KV cache, as flash-attn 2's (without appending).

    Arguments:
        q: `(batch, seqlen_q, heads, head_dim)`, float16 or bfloat16, on a CUDA device;
            seqlen_q in 1..16 (0 gives empty outputs).
        k_cache, v_cache: contiguous cache `(batch, max_seqlen, kv_heads, head_dim)`, or, with
            `block_table`, a paged one `(num_pages, page_size, kv_heads, head_dim)` with
            page_size a power of two in 16..256. `kv_heads` divides `heads` (GQA/MQA).
            head_dim in 1..256: one the decode kernels do not serve is zero-padded to the
            next one they serve, which reads q and both caches through padded copies (the
            whole cache, every call). Views with a contiguous last dimension, other strides
            multiples of 8 elements (dimensions of size 1 excepted) and 16-byte aligned data
            are read in place; any other layout is read through one contiguous copy. The
            caches are only read (never written), so a copy changes nothing but the cost.
        k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad: not implemented;
            anything but the defaults raises `UnsupportedCall` (write new tokens into the
            cache before the call; `rotary_interleaved` is then ignored).
        cache_seqlens: int32 `(batch,)` CUDA tensor of keys per sequence, **including** the
            seqlen_q new ones (flash-attn's meaning when k, v are None); an int (every
            sequence that long, checked against the capacity on the host) or None (the full
            capacity: max_seqlen, or max_pages * page_size).
        block_table: int32 `(batch, max_pages)` page ids: key j of sequence b is row
            `j % page_size` of page `block_table[b, j // page_size]`. Entries past a
            sequence's last page are never read.
        softmax_scale: default `1 / sqrt(head_dim)`.
        causal: bottom-right aligned (query i of n sees keys `j <= cache_seqlens - n + i`).
        window_size: `(left, right)`, -1 unbounded, bottom-right aligned; `causal=True` sets
            `right = 0`.
        softcap: 0.0 (off) or c > 0: scores s become `c * tanh(s / c)`, as in flash_attn_func.
        alibi_slopes: None, or float32 `(heads,)` or `(batch, heads)` on q's device: the bias
            `-slope[b, h] * |i + cache_seqlens[b] - seqlen_q - j|` (flash-attn's).
        num_splits: 0 lets the heuristic choose the split-KV factor (docs/decode.md); 1..128
            forces it.
        return_softmax_lse: also return the float32 `(batch, heads, seqlen_q)` natural-log LSE
            (-inf on rows that see no key, whose output is 0).
        check_inputs: read the kernel's error word after the call and raise
            `CacheInputError` on bad page ids or cache_seqlens; costs a sync per call. Default:
            the environment variable FLASHGEN_KVCACHE_CHECK == "1".
        learnable_sink: None, or float32 `(heads,)` on q's device: attention sinks, as in
            flash_attn_func (`exp(sink_h)` joins each row's softmax denominator and its LSE; a
            row that sees no key gives O = 0 and LSE = sink_h). No gradient here.

    Returns `out` `(batch, seqlen_q, heads, head_dim)` in q's dtype, or `(out, softmax_lse)`.
    No gradient: inputs are detached (inference only).
    """
    ks.check_features(
        k=k is not None,
        v=v is not None,
        rotary_cos=rotary_cos is not None,
        rotary_sin=rotary_sin is not None,
        cache_batch_idx=cache_batch_idx is not None,
        cache_leftpad=cache_leftpad is not None,
    )
    del rotary_interleaved  # only meaningful with rotary_cos/sin
    if type(softcap) is not float:
        softcap = as_softcap(softcap)
    if alibi_slopes is not None or learnable_sink is not None:
        check_score_tensors(alibi_slopes, learnable_sink)
    head_dim = q.shape[-1]
    if softmax_scale is None:  # the caller's head dim, padded or not (0: refused below)
        softmax_scale = head_dim**-0.5 if head_dim > 0 else 1.0
    if check_inputs is None:
        check_inputs = os.environ.get(CHECK_ENV, "") == "1"
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise UnsupportedCall(
            f"window_size must be a pair of ints (left, right), got {window_size!r}"
        )
    window_left, window_right = int(window_size[0]), int(window_size[1])
    max_seqlen_k = 0
    if not isinstance(cache_seqlens, Tensor):
        if isinstance(cache_seqlens, bool):
            raise UnsupportedCall("cache_seqlens must be an int32 tensor (batch,), an int or None")
        if cache_seqlens is not None:
            try:
                cache_seqlens = operator.index(cache_seqlens)
            except TypeError:
                raise UnsupportedCall(
                    "cache_seqlens must be an int32 tensor (batch,), an int or None; got "
                    f"{type(cache_seqlens).__name__}"
                ) from None
    written = k is not None or v is not None  # never today: check_features refused k and v
    q, k_cache, v_cache, kernel_head_dim = _decode_inputs(
        q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, written,
    )  # fmt: skip
    if not isinstance(cache_seqlens, Tensor):
        pb = ks.check_kvcache(
            _meta(q),
            _meta(k_cache),
            _meta(v_cache),
            cache_seqlens=cache_seqlens,
            block_table=None if block_table is None else _meta(block_table),
            num_splits=num_splits,
            softmax_scale=float(softmax_scale),
        )
        max_seqlen_k = pb.capacity if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((pb.batch,), max_seqlen_k, dtype=torch.int32, device=q.device)
    out, lse = torch.ops.flashgen.decode.default(
        q,
        k_cache,
        v_cache,
        cache_seqlens.detach(),
        None if block_table is None else block_table.detach(),
        float(softmax_scale),
        bool(causal),
        window_left,
        window_right,
        int(num_splits),
        int(max_seqlen_k),
        bool(check_inputs),
        softcap,
        None if alibi_slopes is None else alibi_slopes.detach(),
        None if learnable_sink is None else learnable_sink.detach(),
    )
    if kernel_head_dim != head_dim:  # zero-padded: the output's first head_dim columns
        out = out[..., :head_dim].contiguous()
    return (out, lse) if return_softmax_lse else out


# --------------------------------------------------------------------------------------------
# flashgen::merge_states
# --------------------------------------------------------------------------------------------


def _merge_outputs(o_parts: Tensor, dtype: Dtype) -> tuple[Tensor, Tensor]:
    _, batch, sq, heads, d = o_parts.shape
    out = torch.empty((batch, sq, heads, d), dtype=_TORCH_DTYPES[dtype], device=o_parts.device)
    lse = torch.empty((batch, heads, sq), dtype=torch.float32, device=o_parts.device)
    return out, lse


@torch.library.custom_op("flashgen::merge_states", mutates_args=())
def merge_states_op(o_parts: Tensor, lse_parts: Tensor, out_dtype: str) -> tuple[Tensor, Tensor]:
    dtype, in_dtype = ks.check_merge(_meta(o_parts), _meta(lse_parts), out_dtype)
    _one_device(o_parts=o_parts, lse_parts=lse_parts)
    parts, batch, sq, heads, d = o_parts.shape
    device = o_parts.device
    out, lse = _merge_outputs(o_parts, dtype)
    if out.numel() == 0:
        return out, lse
    _check_aligned(o_parts=o_parts)
    lib = _library(ks.merge_spec(dtype, int(d), _capability(device)))
    po = ks.used_strides(_meta(o_parts))
    pl = lse_parts.stride()
    values = {
        "o": out.data_ptr(),
        "lse": lse.data_ptr(),
        **_strides("o", out),
        "lse_batch_stride": heads * sq,
        "lse_head_stride": sq,
        "batch": batch,
        "heads": heads,
        "kv_heads": 1,
        "seqlen_q": sq,
        "head_dim": o_parts.shape[-1],  # merge_check compares them with the kernel's
        "head_dim_v": o_parts.shape[-1],
        "o_parts": o_parts.data_ptr(),
        "lse_parts": lse_parts.data_ptr(),
        "num_parts": parts,
        "parts_dtype": 1 if in_dtype else 0,
        "o_parts_part_stride": po[0],
        "o_parts_batch_stride": po[1],
        "o_parts_row_stride": po[2],
        "o_parts_head_stride": po[3],
        "lse_parts_part_stride": pl[0],
        "lse_parts_batch_stride": pl[1],
        "lse_parts_head_stride": pl[2],
    }
    with torch.cuda.device(device):
        lib.merge_states(values, torch.cuda.current_stream(device).cuda_stream)
    return out, lse


@merge_states_op.register_fake
def _merge_fake(o_parts, lse_parts, out_dtype):
    dtype, _ = ks.check_merge(_meta(o_parts), _meta(lse_parts), out_dtype)
    _one_device(o_parts=o_parts, lse_parts=lse_parts)
    return _merge_outputs(o_parts, dtype)


def merge_states(
    o_parts: Tensor, lse_parts: Tensor, out_dtype: Optional[torch.dtype] = None
) -> tuple[Tensor, Tensor]:
    """Merge partial attention results over disjoint key sets (split-KV, context parallelism).

    `o_parts` `(parts, batch, seqlen_q, heads, head_dim)`, float32 or float16/bfloat16 (e.g.
    the outputs of flash_attn_func / flash_attn_with_kvcache on each key range), `lse_parts`
    float32 `(parts, batch, heads, seqlen_q)`, their natural-log LSEs. Returns `(out, lse)`:
    out `(batch, seqlen_q, heads, head_dim)`, `sum_s exp(lse_s - lse) o_s`, in o_parts' dtype
    (float32 parts need `out_dtype=torch.float16` or `torch.bfloat16`), and float32 lse
    `(batch, heads, seqlen_q)`, `log sum_s exp(lse_s)`. Parts with lse -inf are skipped; a row
    no part sees gives 0 and -inf. head_dim in 1..256 (one the decode kernels do not serve is
    zero-padded to the next one they serve, a copy of o_parts; a layout the kernel cannot read
    is copied once); seqlen_q is not limited. No gradient (inputs are detached).
    """
    name = None
    if out_dtype is not None:
        name = out_dtype if isinstance(out_dtype, str) else str(out_dtype).removeprefix("torch.")
    o_parts, head_dim, kernel_head_dim = _merge_inputs(o_parts.detach())
    dtype, _ = ks.check_merge(_meta(o_parts), _meta(lse_parts), name)
    out_name = "float16" if dtype is Dtype.FP16 else "bfloat16"
    out, lse = torch.ops.flashgen.merge_states.default(o_parts, lse_parts.detach(), out_name)
    if kernel_head_dim != head_dim:  # zero-padded: the output's first head_dim columns
        out = out[..., :head_dim].contiguous()
    return out, lse


def _merge_inputs(o_parts: Tensor) -> tuple[Tensor, int, int]:
    """(o_parts as the merge kernel reads it, its head dim, the head dim the kernel runs at):
    zero-padded to the next head dim the decode kernels serve, copied once into the
    contiguous layout when the kernel cannot read its layout. Parts the op refuses anyway
    are passed on as they are."""
    d = o_parts.shape[-1] if o_parts.dim() else 0
    if not (_on_cuda(o_parts) and o_parts.dim() == 5 and o_parts.dtype in _MERGE_DTYPES):
        return o_parts, d, d
    padded = _decode_head_dim(operator.index(d), o_parts.device.index, "merge_states")
    if padded != d:
        o_parts = F.pad(o_parts, (0, padded - d))
    vec = 16 // o_parts.element_size()
    if not (
        ks.merge_layout_ok(tuple(o_parts.shape), tuple(o_parts.stride()), vec)
        and _offset_ok(o_parts)
    ):
        o_parts = o_parts.clone(memory_format=torch.contiguous_format)
    return o_parts, d, padded


_MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
