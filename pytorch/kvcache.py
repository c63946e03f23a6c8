"""flash-attn 2's `flash_attn_with_kvcache` over flashgen's decode kernels, and `merge_states`.

    from flashgen.torch import flash_attn_with_kvcache, merge_states
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos,
                                  rotary_sin=sin, cache_seqlens=lens, causal=True)
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
contiguous layout. A cache copy costs a copy of the whole cache per call.

The composite path (docs/torch.md, "Appending, rotary, batch indices, left padding"): a call
with `k`, `v`, `rotary_cos`/`rotary_sin`, `cache_batch_idx`, `cache_leftpad` or more than 16
queries runs torch operations around the kernels (`flashgen.torch.kvcache_prep`): rotary on q
and k, the new rows written in place into the caller's caches (before the decode kernel reads
them there, or after the kernel ran on a copy), a copy of the used cache rows for
`cache_batch_idx`/`cache_leftpad` (the decode kernels index neither), and for more than 16
queries the varlen forward (`interface._attention`) over a packed copy of each sequence's keys.
Everything that can refuse the call runs before the first write to a cache. A call without
those arguments (the plain decode step) takes the decode kernel directly, as before: no copy.

Bad cache metadata (docs/decode.md, "Bad input"): a block-table entry outside `[0,
num_pages)` for a used page, or a `cache_seqlens` entry outside `[0, capacity]`, is never
dereferenced, and by default the kernel stops with a device-side assert, as flash-attn's guard
does (no sync; the CUDA context is lost, and the next synchronising call raises
`RuntimeError: CUDA error: device-side assert triggered`); an appended row whose destination
is out of range is dropped, and the kernel then traps on the length. Instead of the assert, a
call can read the kernel's error word back (a device-to-host copy and a sync per call, not
possible under CUDA graph capture): `check_inputs=True` (a keyword-only argument flash-attn
does not have), or the environment variable FLASHGEN_KVCACHE_CHECK=1 for callers that cannot
pass it; a flagged call then raises `kvcache_select.CacheInputError` and the context
survives. On the composite path the same flag first checks the device values before anything
is written (`kvcache_prep.check_values`, raising `UnsupportedCall`); calls with more than 16
queries always do (they sync anyway).
"""

import operator
import os
from typing import Optional, Union

import torch
import torch.nn.functional as F
from flashgen.generator.families.decode import WORKSPACE_HEADER
from flashgen.generator.spec import Dtype, KernelKind
from flashgen.runtime import DecodeLibrary
from flashgen.torch import cache, interface, selection
from flashgen.torch import kvcache_fp8 as _fp8
from flashgen.torch import kvcache_prep as prep
from flashgen.torch import kvcache_select as ks
from flashgen.torch import ops as _ops
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
from flashgen.torch.selection import TensorMeta, UnsupportedCall
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
_FP8 = torch.float8_e4m3fn
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


def _decode_params(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, window,
                   softmax_scale, max_seqlen_k, num_splits, feats, softcap, alibi_slopes,
                   learnable_sink, trap: bool = True) -> dict:  # fmt: skip
    """The decode kernel's launch fields (the workspace's are added at the launch). `trap`: a
    bad device value stops the kernel with a device-side assert (flash-attn's behaviour, no
    sync); off when the caller reads the error word instead (check_inputs)."""
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
        "window_left": window[0],
        "window_right": window[1],
        "num_splits": num_splits,
        "trap_on_error": int(trap),
    }
    if feats:
        params.update(_score_params(feats, softcap, alibi_slopes, learnable_sink))
    return params


def _decode_select(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
    window_right, num_splits, softcap, alibi_slopes, learnable_sink,
):  # fmt: skip
    """Every check of a decode call and its kernel: (problem, features, spec, runtime window).
    The Python implementation and the binding's planner both start here."""
    pb = _problem(q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale)
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    spec, window = _spec(q, pb, causal, window_left, window_right, feats)
    return pb, feats, spec, window


def _decode_impl(
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
    pb, feats, spec, window = _decode_select(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
        window_right, num_splits, softcap, alibi_slopes, learnable_sink,
    )  # fmt: skip
    out, lse = _outputs(q, pb)
    if _served_without_kernel(out, lse, k_cache, cache_seqlens, check_inputs, learnable_sink):
        return out, lse
    _check_aligned(q=q, k_cache=k_cache, v_cache=v_cache)
    params = _decode_params(
        q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, window, softmax_scale,
        max_seqlen_k, num_splits, feats, softcap, alibi_slopes, learnable_sink,
        trap=not check_inputs,
    )  # fmt: skip
    _launch(_library(spec), params, pb, q.device, check_inputs)
    return out, lse


def _served_without_kernel(out, lse, k_cache, cache_seqlens, check_inputs, learnable_sink):
    """Fill (out, lse) of a call no kernel need run, and say so: no sequence or no query (empty
    outputs), or a contiguous cache of capacity 0 (no key anywhere: O is 0, the LSE -inf or
    the head's sink; with check_inputs, a non-zero length is the caller's error)."""
    if out.numel() == 0:
        return True
    if k_cache.numel() != 0:
        return False
    if check_inputs and bool((cache_seqlens != 0).any()):
        raise CacheInputError(ks.describe_errors(ks.ERR_SEQLEN, 0, None))
    out.zero_()
    _empty_lse(lse, learnable_sink)
    return True


def _launch(lib, params: dict, pb, device, check_inputs: bool) -> None:
    """One decode launch on the current stream of `device`, with its workspace; with
    check_inputs, the error word is read back (a sync) and raised as CacheInputError."""
    with torch.cuda.device(device):
        size = max(lib.workspace_bytes(params), WORKSPACE_HEADER)
        workspace = torch.empty(size, dtype=torch.uint8, device=device)
        if check_inputs:  # the error word, read below: the kernels only OR into it
            workspace[:WORKSPACE_HEADER].zero_()
        params["workspace"] = workspace.data_ptr()
        params["workspace_size"] = size
        lib.launch(params, torch.cuda.current_stream(device).cuda_stream)
        if check_inputs:
            word = int(workspace[:4].view(torch.int32).item())  # syncs with the stream
            if word:
                pages = pb.num_pages if pb.paged else None
                raise CacheInputError(ks.describe_errors(word, pb.capacity, pages))


# The compiled binding's decode plan (flashgen.torch.binding, csrc/binding.cpp): the struct of
# the planning call as 8-byte words, and the words that change per call. Argument positions
# follow the op's schema; the patch kinds are binding.cpp's PatchKind.
_DECODE_ARG = {"q": 0, "k": 1, "v": 2, "cache_seqlens": 3, "block_table": 4}
_DECODE_TORCH_ARG = {"alibi_slopes": 13, "learnable_sink": 14}
_ARG_PTR, _OUT_PTR, _WORKSPACE, _WORKSPACE_SIZE, _ARG_F64, _ARG_CLAMPED = range(6)


def _decode_plan(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
    window_right, num_splits, max_seqlen_k, check_inputs, softcap=0.0, alibi_slopes=None,
    learnable_sink=None,
):  # fmt: skip
    """The binding's plan for this call's key, or None when the Python implementation serves
    it (check_inputs reads the error word; empty outputs or caches). Raises what the Python
    path raises."""
    import struct

    from flashgen.generator.features import FEATURES

    pb, feats, spec, window = _decode_select(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
        window_right, num_splits, softcap, alibi_slopes, learnable_sink,
    )  # fmt: skip
    out, lse = _outputs(q, pb)
    if check_inputs or out.numel() == 0 or k_cache.numel() == 0:
        return None
    lib = _library(spec)
    params = _decode_params(
        q, k_cache, v_cache, cache_seqlens, block_table, out, lse, pb, window, softmax_scale,
        max_seqlen_k, num_splits, feats, softcap, alibi_slopes, learnable_sink,
    )  # fmt: skip
    raw = bytes(lib.pack(params))
    words = list(struct.unpack(f"={len(raw) // 8}q", raw))
    arg_of = {r.name: _DECODE_TORCH_ARG[f.torch_arg] for f in FEATURES for r in f.params
              if r.ctype == "ptr" and f.torch_arg in _DECODE_TORCH_ARG}  # fmt: skip
    patches = []
    for index, row in enumerate(lib.family.params):
        name = row.name
        if name in _DECODE_ARG:
            patches.append((index, _ARG_PTR, _DECODE_ARG[name], 0))
        elif name in ("o", "lse"):
            patches.append((index, _OUT_PTR, 0 if name == "o" else 1, 0))
        elif name == "workspace":
            patches.append((index, _WORKSPACE, 0, 0))
        elif name == "workspace_size":
            patches.append((index, _WORKSPACE_SIZE, 0, 0))
        elif name == "softmax_scale":
            patches.append((index, _ARG_F64, 5, 0))
        elif name == "max_seqlen_k":
            patches.append((index, _ARG_CLAMPED, 10, pb.capacity))
        elif name in arg_of and name in params:
            patches.append((index, _ARG_PTR, arg_of[name], 0))
    return {
        "name": lib.name,
        **lib.entry_addresses(),
        "template_words": words,
        "patches": patches,
        "out_shape": list(out.shape),
        "lse_shape": list(lse.shape),
        "workspace_header": WORKSPACE_HEADER,
    }


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


def _register_decode():
    """flashgen::decode: the compiled binding's C++ kernel when the binding is on (see
    flashgen.torch.binding), else the Python custom op."""
    binding = _ops.BINDING
    if binding is not None:
        from flashgen.torch.binding import CPU_TESTS_ENV

        schema = "decode" + torch.library.infer_schema(_decode_impl, mutates_args=())
        binding.install_decode(
            _decode_plan, _decode_impl, schema, os.environ.get(CPU_TESTS_ENV) == "1"
        )
        torch.library.register_fake("flashgen::decode")(_decode_fake)
        return torch.ops.flashgen.decode
    op = torch.library.custom_op("flashgen::decode", mutates_args=())(_decode_impl)
    op.register_fake(_decode_fake)
    return op


decode = _register_decode()

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
    window_size: Union[tuple[int, int], list, Tensor] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    check_inputs: Optional[bool] = None,
    learnable_sink: Optional[Tensor] = None,
    k_descale: Union[Tensor, float, None] = None,
    v_descale: Union[Tensor, float, None] = None,
) -> Result:
    """Attention of new queries over a KV cache, appending new keys first, as flash-attn 2.8's.

    Arguments (positions are in keys; docs/torch.md, "Decode with a KV cache" and "Appending,
    rotary, batch indices, left padding"):
        q: `(batch, seqlen_q, heads, head_dim)`, float16 or bfloat16, on a CUDA device. Any
            seqlen_q: 1..16 run on the decode kernels, longer chunks (chunked prefill) on the
            varlen forward over a packed copy of the keys (0 gives empty outputs).
        k_cache, v_cache: contiguous `(cache_rows, max_seqlen, kv_heads, head_dim)`
            (cache_rows = batch without `cache_batch_idx`), or, with `block_table`, paged
            `(num_pages, page_size, kv_heads, head_dim)` (the decode kernels take page sizes
            that are powers of two in 16..256; the varlen path any). `kv_heads` divides
            `heads` (GQA/MQA). head_dim in 1..256: one the kernels do not serve is read
            through zero-padded copies (the whole caches, every call). Layouts the kernels
            cannot read are read through one contiguous copy.
        k, v: None, or the new tokens `(batch, seqlen_new, kv_heads, head_dim)` in q's dtype:
            written **in place** into the caller's caches at positions `cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1` of sequence b (its cache row, or its pages
            through `block_table`), k after rotary, then attended with the cache. A row whose
            destination lies outside the cache (bad `cache_seqlens`, `cache_batch_idx` or page
            id, found only on the device) is dropped, never written out of bounds.
        rotary_cos, rotary_sin: None, or `(rotary_rows, rotary_dim / 2)` tables in q's dtype
            (or float32), only with k and v, rotary_rows >= the capacity, rotary_dim <=
            head_dim (the columns past it pass through). Appended key i of sequence b is
            rotated at position `cache_seqlens[b] + i`; query i at `cache_seqlens[b] + i` when
            causal or local (a window remains after the normalisation of `window_size`), else
            every query at `cache_seqlens[b]`. In float32, rounded once to q's dtype.
        cache_seqlens: int32 `(batch,)` CUDA tensor; an int (every sequence, checked on the
            host); or None (the full capacity: max_seqlen, or max_pages * page_size). Without
            k, v: the keys of each sequence, including the seqlen_q new ones. With k, v
            (required then): the keys before the call; they become `cache_seqlens +
            seqlen_new`. With `cache_leftpad` the keys are positions `cache_leftpad[b] ..
            cache_seqlens[b] + seqlen_new - 1` (absolute positions; rotary uses them too).
        cache_batch_idx: None, or int32 `(batch,)`: sequence b reads (and appends to) cache
            row `cache_batch_idx[b]` (contiguous caches only, as in flash-attn).
        cache_leftpad: None, or int32 `(batch,)`: where each sequence's keys start
            (contiguous caches only). With either of the two, the decode kernels read a copy
            of the selected rows: `batch * max_seqlen * kv_heads * head_dim` elements of each
            cache, every call.
        block_table: int32 `(batch, max_pages)` page ids: key j of sequence b is row
            `j % page_size` of page `block_table[b, j // page_size]`. Entries past a
            sequence's last page are never read.
        softmax_scale: default `1 / sqrt(head_dim)`.
        causal: bottom-right aligned over each sequence's keys (query i of n sees keys
            `j <= keys - n + i`, j counted from `cache_leftpad`).
        window_size: `(left, right)`, -1 unbounded, bottom-right aligned; a tuple or list of
            two ints, or an integer tensor of 2 elements (its values are read on the host: a
            sync for a CUDA tensor). `causal=True` sets `right = 0`; a side >= the capacity
            counts as -1, as flash-attn's binding makes it (it matters when seqlen_q exceeds
            the capacity, and for the rotary positions).
        softcap: 0.0 (off) or c > 0: scores s become `c * tanh(s / c)`, as in flash_attn_func.
        rotary_interleaved: pairs (2i, 2i + 1) when True (GPT-J), (i, i + rotary_dim / 2) when
            False (GPT-NeoX); only with rotary_cos/sin.
        alibi_slopes: None, or float32 `(heads,)` or `(batch, heads)` on q's device: the bias
            `-slope[b, h] * |i + keys - seqlen_q - j|` (flash-attn's).
        num_splits: 0 lets the heuristic choose the decode split-KV factor (docs/decode.md);
            1..128 forces it (the varlen path ignores it, as flash-attn's).
        return_softmax_lse: also return the float32 `(batch, heads, seqlen_q)` natural-log LSE
            (-inf on rows that see no key, whose output is 0).
        check_inputs: before anything is written, copy the device values of cache_seqlens,
            cache_leftpad, cache_batch_idx, the used block-table entries and the rotary
            positions to the host and refuse bad ones (one sync), and read the decode
            kernel's error word after the call (`CacheInputError`; a second sync). Default:
            the environment variable FLASHGEN_KVCACHE_CHECK == "1". Calls with seqlen_q > 16
            always check the values (they sync anyway, to size the packed copy).
        learnable_sink: None, or float32 `(heads,)` on q's device: attention sinks, as in
            flash_attn_func (`exp(sink_h)` joins each row's softmax denominator and its LSE; a
            row that sees no key gives O = 0 and LSE = sink_h). No gradient here.
        k_descale, v_descale: FP8 caches (k_cache, v_cache `torch.float8_e4m3fn`, FA3's
            `flash_attn_with_kvcache`): float32 `(batch, kv_heads)`, or a per-tensor scale (a
            one-element float32 tensor or a float, as vLLM's k_scale / v_scale); the
            attention uses `k_descale * k_cache` and `v_descale * v_cache`. Required with FP8
            caches, refused otherwise; appended k, v are quantised with them (clamped to
            +-448); `flashgen.torch.kvcache_fp8` says which path each FP8 call takes.

    Returns `out` `(batch, seqlen_q, heads, head_dim)` in q's dtype, or `(out, softmax_lse)`.
    No gradient: inputs are detached (inference only).

    Raises `UnsupportedCall` (a ValueError), before anything is written to a cache, for
    arguments no path serves (shapes, dtypes, devices, an int cache_seqlens beyond the
    capacity, tables shorter than the capacity, batch indices or left padding with a paged
    cache, the kernels' own rules), and, when the values are checked, for bad device values.
    """
    if check_inputs is None:
        check_inputs = os.environ.get(CHECK_ENV, "") == "1"
    fp8 = None
    if (  # FP8 caches (docs/decode.md): identity tests, cheap on the plain path's host time
        k_descale is not None
        or v_descale is not None
        or getattr(k_cache, "dtype", None) is _FP8
        or getattr(v_cache, "dtype", None) is _FP8
    ):
        if (
            rotary_cos is None
            and rotary_sin is None
            and cache_batch_idx is None
            and cache_leftpad is None
            and not softcap
            and alibi_slopes is None
            and learnable_sink is None
            and not (q.dim() == 4 and q.shape[1] > ks.MAX_QUERIES)
            and _fp8_decode_serves(q, k_cache, block_table)
        ):  # the FP8 decode kernel, on the caller's caches
            out, lse = _fp8.fp8_decode(
                q, k_cache, v_cache, k_descale, v_descale, cache_seqlens=cache_seqlens,
                block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                window_size=window_size, num_splits=num_splits,
                check_inputs=bool(check_inputs), k=k, v=v,
            )  # fmt: skip
            return (out, lse) if return_softmax_lse else out
        fp8 = _fp8.fp8_scales(q, k_cache, v_cache, k_descale, v_descale)  # the composite path
    if type(num_splits) is not int:  # (not int(): 1.7 would run as 1)
        if isinstance(num_splits, bool) or not hasattr(num_splits, "__index__"):
            raise UnsupportedCall(
                f"num_splits must be an int (0: the heuristic, 1..128: forced), got {num_splits!r}"
            )
        num_splits = operator.index(num_splits)
    plain = (
        fp8 is None
        and k is None
        and v is None
        and rotary_cos is None
        and rotary_sin is None
        and cache_batch_idx is None
        and cache_leftpad is None
        and alibi_slopes is None
        and learnable_sink is None
        and type(softcap) is float
        and softcap == 0.0
        and type(causal) is bool  # strict types: the key compares 1 == True == 1.0, and
        and type(num_splits) is int  # tensors by identity; anything else takes the full
        and type(window_size) is tuple  # path, whose checks refuse what they refuse
        and len(window_size) == 2
        and type(window_size[0]) is int
        and type(window_size[1]) is int
        and type(cache_seqlens) is Tensor
        and type(q) is Tensor
        and type(k_cache) is Tensor
        and type(v_cache) is Tensor
        and not check_inputs
        and not torch.compiler.is_compiling()
    )
    if plain:  # a layout served before with no copy: straight to the op (docs/torch.md)
        key = _plain_key(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                         causal, window_size, num_splits)  # fmt: skip
        plan = _PLAIN_PLANS.get(key)
        if plan is not None:
            scale, window_left, window_right = plan
            out, lse = torch.ops.flashgen.decode.default(
                q.detach() if q.requires_grad else q,
                k_cache.detach() if k_cache.requires_grad else k_cache,
                v_cache.detach() if v_cache.requires_grad else v_cache,
                cache_seqlens,
                block_table,
                scale if softmax_scale is None else float(softmax_scale),
                bool(causal),
                window_left,
                window_right,
                int(num_splits),
                0,
                False,
                0.0,
                None,
                None,
            )
            return (out, lse) if return_softmax_lse else out
    if type(softcap) is not float:
        softcap = as_softcap(softcap)
    if alibi_slopes is not None or learnable_sink is not None:
        check_score_tensors(alibi_slopes, learnable_sink)
    head_dim = q.shape[-1]
    if softmax_scale is None:  # the caller's head dim, padded or not (0: refused below)
        softmax_scale = head_dim**-0.5 if head_dim > 0 else 1.0
    window_left, window_right = ks.window_pair(window_size)
    capacity = _capacity(k_cache, block_table)
    if capacity is not None:  # flash-attn's binding: a side >= the capacity is unbounded
        window_left, window_right, _ = ks.kvcache_window(
            causal, (window_left, window_right), capacity
        )
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
    if (
        fp8 is not None
        or k is not None
        or v is not None
        or rotary_cos is not None
        or rotary_sin is not None
        or cache_batch_idx is not None
        or cache_leftpad is not None
        or (q.dim() == 4 and q.shape[1] > ks.MAX_QUERIES)
        or not _decode_serves(q, k_cache, block_table)
    ):
        out, lse = _composite(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, float(softmax_scale), causal,
            (window_left, window_right), softcap, rotary_interleaved, alibi_slopes,
            num_splits, bool(check_inputs), learnable_sink, fp8,
        )  # fmt: skip
        return (out, lse) if return_softmax_lse else out
    out, lse = _run_decode(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
        window_right, num_splits, check_inputs, softcap, alibi_slopes, learnable_sink,
    )  # fmt: skip
    if plain and _plain_served(q, k_cache, v_cache, block_table):
        if len(_PLAIN_PLANS) >= _PLAIN_PLANS_MAX:
            _PLAIN_PLANS.clear()
        _PLAIN_PLANS[key] = (float(softmax_scale), window_left, window_right)
    return (out, lse) if return_softmax_lse else out


# The host fast path of the plain decode call (no append, rotary, batch indices, left
# padding, score modifiers or checks; a tensor cache_seqlens; a tuple window_size): once a
# call of one layout has run through every check above with no copy and no padding, later
# calls of the same layout (`_plain_key`: every shape, stride, dtype, device and alignment the
# checks read, and the arguments that are not per-call values) go straight to the op, whose
# own checks (once per layout in the binding) still run. Only calls that succeeded are
# remembered, so refusals keep their messages.
_PLAIN_PLANS: dict = {}
_PLAIN_PLANS_MAX = 4096


def _layout(t: Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.storage_offset() % 8)


def _plain_key(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
               window_size, num_splits) -> tuple:  # fmt: skip
    return (
        _layout(q),
        _layout(k_cache),
        v_cache is k_cache or _layout(v_cache),
        (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device),
        None if block_table is None else _layout(block_table),
        softmax_scale is None,
        causal,
        window_size,
        num_splits,
    )


def _plain_served(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table) -> bool:
    """Whether the plain call just made read the caller's tensors as they are: the decode
    kernels serve its head dim and page size (no padding, no varlen route) and read its
    layouts (no copy)."""
    if q.dim() != 4 or q.shape[1] > ks.MAX_QUERIES or not _decode_serves(q, k_cache, block_table):
        return False
    if _decode_head_dim(operator.index(q.shape[-1]), q.device.index, "decode") != q.shape[-1]:
        return False
    return all(_cache_readable(t) for t in (q, k_cache, v_cache))


def _decode_serves(q: Tensor, k_cache: Tensor, block_table: Optional[Tensor]) -> bool:
    """`kvcache_select.decode_serves` for these tensors (True for shapes no path serves, such
    as head dims above 256, so their refusals keep the decode path's messages)."""
    if q.dim() != 4 or k_cache.dim() != 4 or q.shape[-1] > selection.MAX_HEAD_DIM:
        return True
    page_size = None if block_table is None else int(k_cache.shape[1])
    return ks.decode_serves(int(q.shape[-1]), page_size)


def _capacity(k_cache: Tensor, block_table: Optional[Tensor]) -> Optional[int]:
    """Keys a sequence can hold (flash-attn's seqlen_k of the cache), or None for shapes the
    checks will refuse anyway."""
    if not isinstance(k_cache, Tensor) or k_cache.dim() != 4:
        return None
    if block_table is None:
        return k_cache.shape[1]
    if not isinstance(block_table, Tensor) or block_table.dim() != 2:
        return None
    return block_table.shape[1] * k_cache.shape[1]


def _run_decode(
    q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, window_left,
    window_right, num_splits, check_inputs, softcap, alibi_slopes, learnable_sink,
    max_seqlen_k: int = 0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The decode kernel over the caches as they are (the plain call, and the composite path
    once its caches hold the appended rows): head-dim padding and layout copies
    (`_decode_inputs`), an int or None cache_seqlens made a tensor, flashgen::decode, the
    output sliced back to the caller's head dim. `max_seqlen_k` bounds a tensor
    cache_seqlens (0: unknown)."""
    head_dim = q.shape[-1]
    q, k_cache, v_cache, kernel_head_dim = _decode_inputs(
        q, k_cache, v_cache, cache_seqlens, block_table, num_splits, softmax_scale, False,
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
    return out, lse


# --------------------------------------------------------------------------------------------
# The composite path: append, rotary, copies (kvcache_prep) around the kernels
# --------------------------------------------------------------------------------------------


def _maybe_meta(t: Optional[Tensor]):
    return None if t is None else _meta(t)


def _decode_precheck(q, k_cache, v_cache, block_table, num_splits, scale, causal, window,
                     softcap, alibi_slopes, learnable_sink) -> None:  # fmt: skip
    """Every refusal of the decode op (and of `_decode_inputs`) for these tensors, before the
    composite path writes a cache: `check_kvcache` on the shapes as the kernel will read them
    (readable strides: a layout copy fixes the caller's), the head dim the kernel runs at, the
    score arguments and the decode spec of the device."""
    lens = TensorMeta((q.shape[0],), (1,), "int32", "cuda")
    pb = ks.check_kvcache(
        _padded_meta(q), _padded_meta(k_cache), _padded_meta(v_cache), cache_seqlens=lens,
        block_table=_maybe_meta(block_table), num_splits=num_splits, softmax_scale=scale,
    )  # fmt: skip
    padded = _decode_head_dim(operator.index(pb.head_dim), q.device.index, "decode")
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    _spec(q, pb._replace(head_dim=padded), causal, window[0], window[1], feats)


def _composite(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, scale, causal, window, softcap, rotary_interleaved,
    alibi_slopes, num_splits, check_inputs, learnable_sink, fp8=None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """flash_attn_with_kvcache with k, v, rotary, cache_batch_idx, cache_leftpad or more than
    16 queries (docs/torch.md, "Appending, rotary, batch indices, left padding"), and every
    FP8-cache call the FP8 decode kernel does not take as it is (`fp8`: the checked descales,
    `flashgen.torch.kvcache_fp8`). Everything that can refuse the call runs before the first
    write to a caller's cache: the host checks, the device values when checked, and the
    kernel itself where it reads a copy."""
    lens_arg = cache_seqlens if isinstance(cache_seqlens, Tensor) else None
    kc_meta, vc_meta = _meta(k_cache), _meta(v_cache)
    if fp8 is not None:  # the caches' shapes and strides, checked as if in q's dtype
        as_q = str(q.dtype).removeprefix("torch.")
        kc_meta, vc_meta = kc_meta._replace(dtype=as_q), vc_meta._replace(dtype=as_q)
    pc = ks.check_prep(
        _meta(q), kc_meta, vc_meta, k=_maybe_meta(k), v=_maybe_meta(v),
        rotary_cos=_maybe_meta(rotary_cos), rotary_sin=_maybe_meta(rotary_sin),
        cache_seqlens=cache_seqlens if lens_arg is None else _meta(lens_arg),
        cache_batch_idx=_maybe_meta(cache_batch_idx), cache_leftpad=_maybe_meta(cache_leftpad),
        block_table=_maybe_meta(block_table), num_splits=num_splits, softmax_scale=scale,
    )  # fmt: skip
    _one_device(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, cache_seqlens=lens_arg, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table,
    )  # fmt: skip
    rotary = pc.rotary_dim > 0
    if rotary and not isinstance(rotary_interleaved, bool):
        raise UnsupportedCall(
            f"rotary_interleaved must be True or False, got {rotary_interleaved!r}"
        )
    left, right, advance = ks.kvcache_window(causal, window, pc.capacity)
    q, k_cache, v_cache = q.detach(), k_cache.detach(), v_cache.detach()
    k, v = (None if t is None else t.detach() for t in (k, v))
    device = q.device
    if lens_arg is not None:
        lens = lens_arg.detach()
    else:
        known = pc.capacity if cache_seqlens is None else cache_seqlens
        lens = torch.full((pc.batch,), known, dtype=torch.int32, device=device)
    score = (softcap, alibi_slopes, learnable_sink)
    # The varlen forward over a packed copy: past 16 queries (no decode kernel), and for FP8
    # caches the decode kernels do not serve (a score modifier: they have no score stage yet;
    # a head dim or layout they lack), over a dequantised copy
    fp8_packed = fp8 is not None and (
        bool(softcap) or alibi_slopes is not None or learnable_sink is not None
        or not _fp8_decode_serves(q, k_cache, block_table)
    )  # fmt: skip
    packed = not pc.decode or fp8_packed
    checked = None
    if packed or check_inputs:
        checked = prep.check_values(
            lens, capacity=pc.capacity, seqlen_new=pc.seqlen_new, cache_leftpad=cache_leftpad,
            cache_batch_idx=cache_batch_idx, cache_rows=pc.cache_rows, block_table=block_table,
            page_size=pc.page_size, num_pages=pc.num_pages, rotary_rows=pc.rotary_rows,
            rotary_last=(pc.seqlen_q - 1 if advance else 0) if rotary and pc.seqlen_q else None,
        )  # fmt: skip
    if rotary:
        q = prep.rotate(q, rotary_cos, rotary_sin, prep.positions(lens, pc.seqlen_q, advance),
                        interleaved=rotary_interleaved)  # fmt: skip
        k = prep.rotate(k, rotary_cos, rotary_sin, prep.positions(lens, pc.seqlen_new),
                        interleaved=rotary_interleaved)  # fmt: skip
    start = cache_leftpad
    old = lens if start is None else lens - start  # keys before the append, from the start
    keys = old + pc.seqlen_new  # int32 (batch,): what the kernels attend to
    if packed:  # the varlen forward over a packed copy; the caches are written last
        assert checked is not None
        out, lse = _packed_attention(q, k_cache, v_cache, k, v, pc, checked, old, keys, start,
                                     cache_batch_idx, block_table, scale, causal, (left, right),
                                     score, fp8)  # fmt: skip
    elif cache_batch_idx is not None or start is not None:  # a copy of the rows, written last
        if fp8 is not None:
            k_run, v_run = (
                _fp8.cache_rows_fp8(
                    c, pc.batch, cache_batch_idx=cache_batch_idx, cache_leftpad=start
                )
                for c in (k_cache, v_cache)
            )
            out, lse = _fp8.fp8_decode(
                q, k_run, v_run, *fp8, cache_seqlens=old, block_table=None,
                softmax_scale=scale, causal=causal, window_size=(left, right),
                num_splits=num_splits, check_inputs=check_inputs, k=k, v=v,
            )  # fmt: skip
        else:
            k_run = prep.cache_rows(k_cache, pc.batch, cache_batch_idx=cache_batch_idx,
                                    cache_leftpad=start)  # fmt: skip
            v_run = prep.cache_rows(v_cache, pc.batch, cache_batch_idx=cache_batch_idx,
                                    cache_leftpad=start)  # fmt: skip
            if k is not None:
                prep.append(k_run, v_run, k, v, old)
            out, lse = _run_decode(q, k_run, v_run, keys, None, scale, causal, left, right,
                                   num_splits, check_inputs, *score)  # fmt: skip
    elif fp8 is not None:  # the FP8 decode kernel on the caller's caches (it appends first)
        return _fp8.fp8_decode(
            q, k_cache, v_cache, *fp8, cache_seqlens=lens if lens_arg is not None else
            cache_seqlens, block_table=block_table, softmax_scale=scale, causal=causal,
            window_size=(left, right), num_splits=num_splits, check_inputs=check_inputs, k=k,
            v=v,
        )  # fmt: skip
    else:  # the decode kernel reads the caller's caches: append first, after every check
        _decode_precheck(q, k_cache, v_cache, block_table, num_splits, scale, causal,
                         (left, right), *score)  # fmt: skip
        if k is not None:
            prep.append(k_cache, v_cache, k, v, lens, block_table=block_table)
        bound = 0 if lens_arg is not None else _keys_after(pc, cache_seqlens)
        return _run_decode(q, k_cache, v_cache, keys, block_table, scale, causal, left, right,
                           num_splits, check_inputs, *score, max_seqlen_k=bound)  # fmt: skip
    if k is not None:
        if fp8 is not None:
            _fp8.append_fp8(k_cache, v_cache, k, v, lens, block_table, *fp8,
                            cache_batch_idx=cache_batch_idx)  # fmt: skip
        else:
            prep.append(k_cache, v_cache, k, v, lens, cache_batch_idx=cache_batch_idx,
                        block_table=block_table)  # fmt: skip
    return out, lse


def _fp8_decode_serves(q: Tensor, k_cache: Tensor, block_table: Optional[Tensor]) -> bool:
    """Whether the FP8 decode kernels take this head dim and page size (specs/decode_fp8.yaml's
    rules: a head dim the 16-bit decode takes and a multiple of 16); otherwise the packed
    path serves the call. True for shapes no path serves, so that their refusals keep the
    FP8 decode path's messages."""
    if q.dim() != 4 or k_cache.dim() != 4:
        return True
    return q.shape[-1] % 16 == 0 and _decode_serves(q, k_cache, block_table)


def _keys_after(pc: ks.PrepCall, cache_seqlens: Optional[int]) -> int:
    """The keys per sequence after the append when cache_seqlens is an int or None."""
    return (pc.capacity if cache_seqlens is None else cache_seqlens) + pc.seqlen_new


def _packed_attention(q, k_cache, v_cache, k, v, pc, checked, old, keys, start,
                      cache_batch_idx, block_table, scale, causal, window,
                      score, fp8=None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """More than 16 queries: the varlen forward (`interface._attention`, bottom-right causal
    and windows per sequence) over a packed copy of each sequence's keys, its cached rows
    from `start` (or 0) followed by the new (rotated) k, v; q as `(batch * seqlen_q, heads,
    d)`. The copy holds exactly the used keys (`checked.total` rows, learnt with the value
    check's sync). FP8 caches (`fp8`): the copy is dequantised to q's dtype
    (`kvcache_fp8.pack_dequantized`)."""
    batch, sq, heads, d = pc.batch, pc.seqlen_q, pc.heads, pc.head_dim
    cu_k = prep.cumulative(keys)
    where = dict(lengths=old, starts=start, cache_batch_idx=cache_batch_idx,
                 block_table=block_table)  # fmt: skip
    if fp8 is None:
        kp, vp = (
            prep.pack(cache, cu_k, checked.total, new=new, **where)
            for cache, new in ((k_cache, k), (v_cache, v))
        )
    else:
        kp, vp = (
            _fp8.pack_dequantized(cache, descale, cu_k, checked.total, q.dtype, new=new, **where)
            for cache, new, descale in ((k_cache, k, fp8.k_descale), (v_cache, v, fp8.v_descale))
        )
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * sq
    softcap, alibi_slopes, learnable_sink = score
    out, lse, _ = interface._attention(
        q.reshape(batch * sq, heads, d), kp, vp, cu_q, cu_k, sq, checked.longest, 0.0, scale,
        causal, window, softcap, alibi_slopes, False, True, learnable_sink,
    )  # fmt: skip
    out = out.reshape(batch, sq, heads, d)
    lse = lse.reshape(heads, batch, sq).transpose(0, 1).contiguous()
    return out, lse


# --------------------------------------------------------------------------------------------
# flashgen::merge_states
# --------------------------------------------------------------------------------------------


def _merge_outputs(o_parts: Tensor, dtype: Dtype) -> tuple[Tensor, Tensor]:
    _, batch, sq, heads, d = o_parts.shape
    out = torch.empty((batch, sq, heads, d), dtype=_TORCH_DTYPES[dtype], device=o_parts.device)
    lse = torch.empty((batch, heads, sq), dtype=torch.float32, device=o_parts.device)
    return out, lse


def _merge_select(o_parts: Tensor, lse_parts: Tensor, out_dtype: str):
    """Every check of a merge_states op call, and its outputs: (dtype, whether o_parts has it,
    out, lse). The Python implementation and the binding's planner both start here."""
    dtype, in_dtype = ks.check_merge(_meta(o_parts), _meta(lse_parts), out_dtype)
    _one_device(o_parts=o_parts, lse_parts=lse_parts)
    out, lse = _merge_outputs(o_parts, dtype)
    return dtype, in_dtype, out, lse


def _merge_params(o_parts: Tensor, lse_parts: Tensor, out: Tensor, lse: Tensor,
                  in_dtype: bool) -> dict:  # fmt: skip
    """The merge kernel's launch fields (fg_decode_params' merge_states fields)."""
    parts, batch, sq, heads, d = o_parts.shape
    po = ks.used_strides(_meta(o_parts))
    pl = lse_parts.stride()
    return {
        "o": out.data_ptr(),
        "lse": lse.data_ptr(),
        **_strides("o", out),
        "lse_batch_stride": heads * sq,
        "lse_head_stride": sq,
        "batch": batch,
        "heads": heads,
        "kv_heads": 1,
        "seqlen_q": sq,
        "head_dim": d,  # merge_check compares them with the kernel's
        "head_dim_v": d,
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


def _merge_library(o_parts: Tensor, dtype: Dtype) -> DecodeLibrary:
    return _library(ks.merge_spec(dtype, int(o_parts.shape[-1]), _capability(o_parts.device)))


def _merge_impl(o_parts: Tensor, lse_parts: Tensor, out_dtype: str) -> tuple[Tensor, Tensor]:
    dtype, in_dtype, out, lse = _merge_select(o_parts, lse_parts, out_dtype)
    if out.numel() == 0:
        return out, lse
    _check_aligned(o_parts=o_parts)
    lib = _merge_library(o_parts, dtype)
    values = _merge_params(o_parts, lse_parts, out, lse, in_dtype)
    device = o_parts.device
    with torch.cuda.device(device):
        lib.merge_states(values, torch.cuda.current_stream(device).cuda_stream)
    return out, lse


# The binding's merge plan (a words plan, as _decode_plan's): the pointers are patched per call.
_MERGE_ARG = {"o_parts": 0, "lse_parts": 1}


def _merge_plan(o_parts: Tensor, lse_parts: Tensor, out_dtype: str):
    """The binding's plan for this call's key, or None when the Python implementation serves
    it (empty outputs). Raises what the Python path raises."""
    import struct

    dtype, in_dtype, out, lse = _merge_select(o_parts, lse_parts, out_dtype)
    if out.numel() == 0:
        return None
    lib = _merge_library(o_parts, dtype)
    raw = bytes(lib.pack(_merge_params(o_parts, lse_parts, out, lse, in_dtype)))
    patches = []
    for index, row in enumerate(lib.family.params):
        if row.name in _MERGE_ARG:
            patches.append((index, _ARG_PTR, _MERGE_ARG[row.name], 0))
        elif row.name in ("o", "lse"):
            patches.append((index, _OUT_PTR, 0 if row.name == "o" else 1, 0))
    return {
        "name": lib.name,
        **lib.merge_entry_addresses(),
        "template_words": list(struct.unpack(f"={len(raw) // 8}q", raw)),
        "patches": patches,
        "out_shape": list(out.shape),
        "lse_shape": list(lse.shape),
        "out_dtype": out.dtype,
    }


def _merge_fake(o_parts, lse_parts, out_dtype):
    dtype, _ = ks.check_merge(_meta(o_parts), _meta(lse_parts), out_dtype)
    _one_device(o_parts=o_parts, lse_parts=lse_parts)
    return _merge_outputs(o_parts, dtype)


def _register_merge():
    """flashgen::merge_states: the compiled binding's C++ kernel when the binding is on (see
    flashgen.torch.binding), else the Python custom op."""
    binding = _ops.BINDING
    if binding is not None:
        from flashgen.torch.binding import CPU_TESTS_ENV

        schema = "merge_states" + torch.library.infer_schema(_merge_impl, mutates_args=())
        binding.install_merge(
            _merge_plan, _merge_impl, schema, os.environ.get(CPU_TESTS_ENV) == "1"
        )
        torch.library.register_fake("flashgen::merge_states")(_merge_fake)
        return torch.ops.flashgen.merge_states
    op = torch.library.custom_op("flashgen::merge_states", mutates_args=())(_merge_impl)
    op.register_fake(_merge_fake)
    return op


merge_states_op = _register_merge()


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
    plain = (
        type(o_parts) is Tensor
        and type(lse_parts) is Tensor
        and (out_dtype is None or type(out_dtype) in (str, torch.dtype))
        and not torch.compiler.is_compiling()
    )
    if plain:  # a layout served before with no padding and no copy: straight to the op
        key = (_layout(o_parts), _layout(lse_parts), out_dtype)
        out_name = _PLAIN_MERGES.get(key)
        if out_name is not None:
            return torch.ops.flashgen.merge_states.default(
                o_parts.detach() if o_parts.requires_grad else o_parts,
                lse_parts.detach() if lse_parts.requires_grad else lse_parts,
                out_name,
            )
    name = None
    if out_dtype is not None:
        name = out_dtype if isinstance(out_dtype, str) else str(out_dtype).removeprefix("torch.")
    given = o_parts.detach()
    o_parts, head_dim, kernel_head_dim = _merge_inputs(given)
    dtype, _ = ks.check_merge(_meta(o_parts), _meta(lse_parts), name)
    out_name = "float16" if dtype is Dtype.FP16 else "bfloat16"
    out, lse = torch.ops.flashgen.merge_states.default(o_parts, lse_parts.detach(), out_name)
    if kernel_head_dim != head_dim:  # zero-padded: the output's first head_dim columns
        out = out[..., :head_dim].contiguous()
    elif plain and o_parts is given:  # read as given: remembered (refusals raised above)
        if len(_PLAIN_MERGES) >= _PLAIN_PLANS_MAX:
            _PLAIN_MERGES.clear()
        _PLAIN_MERGES[key] = out_name
    return out, lse


# merge_states' host fast path, as flash_attn_with_kvcache's `_PLAIN_PLANS`: the op's dtype
# argument of a call whose o_parts the kernel read as given (no head-dim padding, no layout
# copy), by the layouts of both tensors (`_layout`: everything `_merge_inputs` and
# `check_merge` read) and out_dtype. Only calls that succeeded are remembered; the op's own
# checks still run (once per layout in the binding).
_PLAIN_MERGES: dict = {}


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
