"""The PyTorch operators `flashgen::fwd` and `flashgen::bwd` and their autograd formula.

Both are `torch.library.custom_op`s with fake (meta) implementations, so they work under
`torch.compile(fullgraph=True)`, `torch.export` and CUDA graph capture. The real
implementations allocate their outputs (and the backward's workspace) with `torch.empty` on
the caller's device, launch the kernel through its C launcher (`generator.launch.
KernelLibrary`) on `torch.cuda.current_stream()` and return: no host synchronisation, no copy
of any input. The kernel comes from `flashgen.torch.cache` (shipped build, else the per-user
cache, else compiled on first use) for the spec `flashgen.torch.selection` derives.

Schemas (all sizes in elements; see `flashgen.torch.flash_attn_func` for the layouts):

    fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_left, window_right, deterministic, softcap=0.0,
        alibi_slopes?=None, learnable_sink?=None)
        -> (out, softmax_lse, philox_seed, philox_offset)
    bwd(dout, q, k, v, out, softmax_lse, philox_seed, philox_offset, cu_seqlens_q?,
        cu_seqlens_k?, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_left, window_right, deterministic, softcap=0.0, alibi_slopes?=None,
        learnable_sink?=None) -> (dq, dk, dv, dsink)
    fwd_variant(<fwd's arguments>, score_mod="", user_t0..3?=None, user_s0..3=0.0)
    bwd_variant(<bwd's arguments>, score_mod="", user_t0..3?=None, user_s0..3=0.0)

`philox_seed` and `philox_offset` are 0-dim int64 CPU tensors (as torch's own fused attention
returns them): the seed's 64 bits are stored two's-complement. A dropout forward under CUDA
graph capture returns them as 0-dim int64 tensors on q's device instead, written by the kernel
at each replay (again as torch's fused attention does), and the backward reads them there.
Dense calls pass `None` cu_seqlens and ignore the max_seqlen arguments.

The score-stage features (`generator.features`) take the last three arguments, flash-attn's
and FlashAttention-4's: `softcap` (0.0 off), `alibi_slopes` (float32 `(heads,)` or `(batch,
heads)`) and `learnable_sink` (float32 `(heads,)`); `selection.score_features` checks them and
derives the spec's features. `dsink` is dL/dlearnable_sink, float32 `(heads,)`, when the call
has a sink, else an empty float32 `(0,)` tensor (a custom op cannot return None). softcap and
the slopes get no gradient (as in flash-attn).

`fwd_variant` / `bwd_variant` are the ops of a user-defined score modifier
(`flashgen.torch.compile_variant`): fwd's and bwd's arguments, then nine more: `score_mod` is
the variant's key (`variant_key`), `user_t<k>` / `user_s<k>` the tensor / number of the
modifier's parameter slot k (`user_mod` checks them, `user_params` packs them as verify.runner
does). The selected kernels are the spec's expression compiled into the family the call gets
(`AttentionCall.score_mod`); nothing else changes. They share fwd's and bwd's implementation,
fake and autograd functions (`_fwd_impl`, `_bwd_impl`, `*user`); fwd and bwd themselves pass
no user arguments and keep their schemas, so a plain call pays nothing for variants. The
compiled binding defines fwd and bwd only: the variant ops take the ctypes path on both.
"""

import inspect
import json
import math
import os
import struct
import sys
from functools import lru_cache
from typing import Optional

import torch
from flashgen.generator.features import FEATURES, SCORE_PARAMS, USER_SLOTS
from flashgen.generator.usermod import ParamKind, UserMod, UserModError, parse_score_mod
from flashgen.runtime import workspace_layout
from flashgen.runtime.library import launch_error
from flashgen.torch import cache, selection
from flashgen.torch.selection import (
    NO_FEATURES,
    SCORE_ARGS,
    AttentionCall,
    Problem,
    TensorMeta,
    UnsupportedCall,
)
from torch import Tensor

__all__ = [
    "BINDING",
    "NO_USER",
    "PHILOX_OFFSET_STEP",
    "USER_ARGS",
    "bwd",
    "bwd_variant",
    "capturing",
    "fwd",
    "fwd_variant",
    "philox_state",
    "score_features",
    "user_mod",
    "variant_key",
]

# How far one forward advances the CUDA generator's Philox offset. The kernels' counter is
# (key group j >> 2, row i, b * heads + h, offset) (docs/conventions.md, "Dropout"): every
# counter of one call shares the fourth word `offset`, so a call consumes exactly one offset
# value, whatever its shape. torch requires increments that are multiples of 4, hence 4.
PHILOX_OFFSET_STEP = 4

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _meta(t: Tensor, device: Optional[torch.device] = None) -> TensorMeta:
    """`device`: t.device, when the caller has it already."""
    return TensorMeta(
        tuple(t.shape),
        tuple(t.stride()),
        str(t.dtype).removeprefix("torch."),
        (t.device if device is None else device).type,
    )


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _device_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# Dense problems `_problem` accepted, by the layouts of their tensors: shape, strides, dtype
# and device of each (all that check_problem and the device check read of a dense call; its
# max_seqlen arguments are unused). Bounded like _CALLS (below).
_PROBLEMS: dict[tuple, Problem] = {}


def _problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    extra: tuple = (),
) -> Problem:
    """The checked Problem of a call (see selection.check_problem), all tensors on one
    device. Dense calls of plain torch.Tensors are memoised (only accepted ones: a refused
    call is refused anew each time); varlen calls, whose max_seqlen change from batch to
    batch, and fake or other subclassed tensors take the full check every time."""
    key = None
    if cu_seqlens_q is None and cu_seqlens_k is None:
        key = _layouts(q, k, v, extra)
        pb = _PROBLEMS.get(key) if key is not None else None
        if pb is not None:
            return pb
    pb = _check_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, extra)
    if key is not None:
        if len(_PROBLEMS) >= _CACHE_LIMIT:
            _PROBLEMS.clear()
        _PROBLEMS[key] = pb
    return pb


def _layouts(q: Tensor, k: Tensor, v: Tensor, extra: tuple) -> Optional[tuple]:
    """`_PROBLEMS`' key of a dense call; None unless every tensor is a plain torch.Tensor."""
    T = Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    key = (
        q.shape, q.stride(), q.dtype, q.device,
        k.shape, k.stride(), k.dtype, k.device,
        v.shape, v.stride(), v.dtype, v.device,
    )  # fmt: skip
    for name, t, like in extra:
        if type(t) is not T:
            return None
        key += (name, like, t.shape, t.stride(), t.dtype, t.device)
    return key


def _check_problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    extra: tuple = (),
) -> Problem:
    dev_q, dev_k, dev_v = q.device, k.device, v.device
    pb = selection.check_problem(
        _meta(q, dev_q),
        _meta(k, dev_k),
        _meta(v, dev_v),
        cu_seqlens_q=None if cu_seqlens_q is None else _meta(cu_seqlens_q),
        cu_seqlens_k=None if cu_seqlens_k is None else _meta(cu_seqlens_k),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        extra=tuple((name, _meta(t), like) for name, t, like in extra),
    )
    if (
        cu_seqlens_q is None
        and cu_seqlens_k is None
        and dev_q == dev_k == dev_v
        and all(t.device == dev_q for _, t, _ in extra)
    ):
        return pb  # a dense call on one device: what the set below finds, without building it
    devices = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k) if t is not None}
    devices |= {t.device for _, t, _ in extra}
    if len(devices) > 1:
        raise UnsupportedCall(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return pb


# `_call`'s results by everything they are derived from (see `_call`); bounded: cleared when
# full (a process sees a handful of distinct calls).
_CALLS: dict[tuple, tuple[AttentionCall, tuple[int, int]]] = {}
_CACHE_LIMIT = 1024


def _call(
    q: Tensor,
    pb: Problem,
    dropout_p: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    features: frozenset = NO_FEATURES,
    score_mod: Optional[UserMod] = None,
) -> tuple[AttentionCall, tuple[int, int]]:
    """The call's kernel-selecting features and its runtime window (`features`: what
    `score_features` returned for the call).

    Memoised on the raw arguments it reads (equal keys give equal results; only successes
    are kept, so a refused call is refused anew each time with the same message). Symbolic
    sizes (torch.compile with dynamic shapes) are unhashable and take the uncached path."""
    if not (0.0 <= dropout_p < 1.0):  # also refuses NaN
        raise UnsupportedCall(f"dropout_p must be in [0, 1), got {dropout_p}")
    args = (q, pb, dropout_p, causal, window_left, window_right, deterministic, features)
    if score_mod is not None:  # a variant call (the variant ops): the modifier joins the key
        args += (score_mod,)
    index = q.device.index
    # Uncached: a device without an index (the capability would be the current device's,
    # which may change) or a symbolic dropout_p (hashing a SymFloat would specialise it).
    if index is None or type(dropout_p) is not float:
        return _make_call(*args)
    key = (pb.dtype, pb.head_dim, pb.heads, pb.kv_heads, pb.varlen, index, dropout_p, causal,
           window_left, window_right, deterministic, features, pb.head_dim_v)  # fmt: skip
    if score_mod is not None:
        key += (score_mod,)
    try:
        hit = _CALLS.get(key)
    except TypeError:  # a SymInt size or an unhashable argument
        return _make_call(*args)
    if hit is None:
        hit = _make_call(*args)
        if len(_CALLS) >= _CACHE_LIMIT:
            _CALLS.clear()
        _CALLS[key] = hit
    return hit


def _make_call(
    q: Tensor,
    pb: Problem,
    dropout_p: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    features: frozenset = NO_FEATURES,
    score_mod: Optional[UserMod] = None,
) -> tuple[AttentionCall, tuple[int, int]]:
    mask_causal, window, runtime_window = selection.resolve_mask(
        bool(causal), (window_left, window_right)
    )
    call = AttentionCall(
        dtype=pb.dtype,
        head_dim=int(pb.head_dim),
        capability=_capability(_device_index(q)),
        causal=mask_causal,
        window=window,
        varlen=pb.varlen,
        gqa=bool(pb.gqa),
        dropout=dropout_p > 0.0,
        deterministic=bool(deterministic),
        features=features,
        score_mod=score_mod,
        head_dim_v=None if pb.head_dim_v is None else int(pb.head_dim_v),
    )
    return call, runtime_window


# --------------------------------------------------------------------------------------------
# Score-stage features (generator.features): softcap, ALiBi, attention sinks.
# --------------------------------------------------------------------------------------------

# The ops take the features' arguments by these names, in this order (their schemas end so).
_OP_SCORE_ARGS = ("softcap", "alibi_slopes", "learnable_sink")
if SCORE_ARGS != _OP_SCORE_ARGS:
    raise ImportError(
        f"flashgen.torch.ops takes the score arguments {_OP_SCORE_ARGS}, the score-stage "
        f"features name {SCORE_ARGS}: the op schemas must follow the registry"
    )

# score_features' accepted results by their raw arguments (bounded like _CALLS).
_SCORES: dict[tuple, frozenset] = {}


def as_softcap(softcap) -> float:
    """flash-attn's `softcap` argument as the ops' float (`score_features` checks its value)."""
    if isinstance(softcap, bool):
        raise UnsupportedCall(f"softcap must be a float (0.0: off), got {softcap!r}")
    if isinstance(softcap, (str, bytes)) or not hasattr(softcap, "__float__"):
        # a number, not text that float() would parse (flash-attn's op takes a float)
        raise UnsupportedCall(
            f"softcap must be a float (0.0: off, c > 0: scores become c * tanh(s / c)), got "
            f"{type(softcap).__name__}"
        )
    try:
        return float(softcap)
    except (TypeError, ValueError):
        raise UnsupportedCall(
            f"softcap must be a float (0.0: off, c > 0: scores become c * tanh(s / c)), got "
            f"{type(softcap).__name__}"
        ) from None


def check_score_tensors(alibi_slopes, learnable_sink) -> None:
    """The tensor arguments of the score-stage features are tensors (or None): refused here,
    with the argument's name, before the op's schema would refuse them less clearly."""
    for name, t in (("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink)):
        if t is not None and not isinstance(t, Tensor):
            raise UnsupportedCall(
                f"{name} must be a float32 tensor on q's device or None, got {type(t).__name__}"
            )


def _tensor_layout(t: Optional[Tensor]) -> Optional[tuple]:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def score_features(
    q: Tensor,
    batch: int,
    heads: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
) -> frozenset:
    """The score-stage features of a call (`selection.score_features`, which checks the
    arguments), its tensors also on q's device. The defaults (0.0, None, None) return at once;
    other accepted calls of a plain float and plain torch.Tensors are memoised on the tensors'
    layouts (only successes: a refused call is refused anew each time, with its message)."""
    if alibi_slopes is None and learnable_sink is None and softcap == 0.0:
        return NO_FEATURES
    values = (softcap, alibi_slopes, learnable_sink)
    key = None
    T = Tensor
    if (
        type(softcap) is float
        and (alibi_slopes is None or type(alibi_slopes) is T)
        and (learnable_sink is None or type(learnable_sink) is T)
    ):
        key = (softcap, batch, heads, q.device,
               _tensor_layout(alibi_slopes), _tensor_layout(learnable_sink))  # fmt: skip
        try:
            hit = _SCORES.get(key)
        except TypeError:  # a SymInt size
            key = hit = None
        if hit is not None:
            return hit
    args = {}
    for name, value in zip(SCORE_ARGS, values):
        if isinstance(value, Tensor):
            if value.device != q.device:
                raise UnsupportedCall(
                    f"{name} is on device {value.device} but q is on {q.device}; it must be a "
                    "float32 tensor on q's device"
                )
            value = _meta(value)
        args[name] = value
    feats = selection.score_features(args, batch=batch, heads=heads)
    if key is not None:
        if len(_SCORES) >= _CACHE_LIMIT:
            _SCORES.clear()
        _SCORES[key] = feats
    return feats


def _alibi_params(t: Tensor) -> dict:
    # (batch, heads) slopes: batch b reads row b; (heads,) ones (or one row): stride 0
    return {
        "alibi_slopes": t.data_ptr(),
        "alibi_batch_stride": t.stride(0) if t.dim() == 2 and t.shape[0] > 1 else 0,
    }


# torch_arg -> the parameter-struct fields (generator.features' ParamRows) of its value; the
# backward adds `dsinks` itself.
_SCORE_PARAMS = {
    "softcap": lambda c: {"softcap": float(c)},
    "alibi_slopes": _alibi_params,
    "learnable_sink": lambda t: {"sinks": t.data_ptr()},
}


def score_params(features: frozenset, softcap, alibi_slopes, learnable_sink) -> dict:
    """The launch fields of the features that are on (none: an empty dict)."""
    out: dict = {}
    if features:
        for f, value in zip(FEATURES, (softcap, alibi_slopes, learnable_sink)):
            if f.name in features:
                out.update(_SCORE_PARAMS[f.torch_arg](value))
    return out


# --------------------------------------------------------------------------------------------
# User-defined score modifiers (flashgen.torch.compile_variant): the variant ops' last nine.
# --------------------------------------------------------------------------------------------

# The variant ops' trailing arguments after the features': `score_mod`, the variant's key
# ("" for none), then slot k's tensor `user_t<k>` (a per_head, per_batch,
# per_batch_int or table parameter) and slot k's number `user_s<k>` (a scalar or scalar_int
# parameter); parameter k of the spec's params, sorted by name, owns slot k
# (docs/usermod.md, "The parameters' C ABI"). Unused slots are None and 0.0.
USER_ARGS = (
    ("score_mod",)
    + tuple(f"user_t{k}" for k in range(USER_SLOTS))
    + tuple(f"user_s{k}" for k in range(USER_SLOTS))
)
NO_USER = ("",) + (None,) * USER_SLOTS + (0.0,) * USER_SLOTS
if USER_SLOTS != 4:  # the op schemas below name four slots
    raise ImportError(f"flashgen.torch.ops names 4 user slots, the score params have {USER_SLOTS}")

_SCALAR_KINDS = (ParamKind.SCALAR, ParamKind.SCALAR_INT)
# kind -> (torch dtype, shape in words) of a tensor parameter
_TENSOR_KINDS = {
    ParamKind.PER_HEAD: (torch.float32, "(heads,)"),
    ParamKind.PER_BATCH: (torch.float32, "(batch,)"),
    ParamKind.PER_BATCH_INT: (torch.int32, "(batch,)"),
    ParamKind.TABLE: (torch.float32, "(heads, columns)"),
}


def variant_key(mod: UserMod) -> str:
    """The `score_mod` argument of the ops for a score modifier: its canonical text and
    declared parameters as compact JSON (one text per modifier, whatever its spelling)."""
    params = {name: kind.value for name, kind in mod.params}
    return json.dumps({"params": params, "score_mod": mod.canonical}, sort_keys=True,
                      separators=(",", ":"))  # fmt: skip


@lru_cache(maxsize=256)
def _parse_variant(key: str) -> UserMod:
    """The UserMod of a `score_mod` argument (`variant_key`); refusals are not cached."""
    try:
        doc = json.loads(key)
        expr, params = doc["score_mod"], doc.get("params") or {}
        if (
            not isinstance(expr, str)
            or not isinstance(params, dict)
            or set(doc)
            - {
                "params",
                "score_mod",
            }
        ):
            raise ValueError
    except (ValueError, TypeError, KeyError):
        raise UnsupportedCall(
            f"score_mod={key[:80]!r} is not a variant key: pass '' (no score_mod) or "
            "ops.variant_key(mod), which flashgen.torch.compile_variant does for you"
        ) from None
    try:
        return parse_score_mod(expr, params)
    except UserModError as e:
        raise UnsupportedCall(f"score_mod {expr!r}: {e} (docs/usermod.md, Grammar)") from None


def _check_user_tensor(what: str, t, kind: ParamKind, q: Tensor, batch: int, heads: int) -> None:
    dtype, shape_text = _TENSOR_KINDS[kind]
    want = f"a {str(dtype).removeprefix('torch.')} tensor {shape_text} on q's device"
    if not isinstance(t, Tensor):
        got = "nothing" if t is None else type(t).__name__
        raise UnsupportedCall(f"{what} must be {want}, got {got}")
    if t.device != q.device:
        raise UnsupportedCall(f"{what} is on device {t.device}; it must be {want} ({q.device})")
    if t.dtype != dtype:
        raise UnsupportedCall(
            f"{what} has dtype {str(t.dtype).removeprefix('torch.')}; it must be {want}"
        )
    if kind is ParamKind.TABLE:
        ok = t.dim() == 2 and t.shape[0] == heads and t.shape[1] >= 1
        shape = f"(heads, columns) = ({heads}, columns >= 1)"
    else:
        n = heads if kind is ParamKind.PER_HEAD else batch
        ok = t.dim() == 1 and t.shape[0] == n
        shape = f"{shape_text} = ({n},)"
    if not ok:
        raise UnsupportedCall(f"{what} has shape {tuple(t.shape)}; it must be {shape}")
    if not t.is_contiguous():
        raise UnsupportedCall(f"{what} must be contiguous (row-major): pass .contiguous()")


def _check_user_number(what: str, s, kind: ParamKind) -> None:
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise UnsupportedCall(f"{what} must be a number, got {type(s).__name__}")
    if not math.isfinite(s):
        raise UnsupportedCall(f"{what} must be finite, got {s}")
    if kind is ParamKind.SCALAR_INT and (s != int(s) or abs(s) >= 2**53):
        raise UnsupportedCall(f"{what} must be an integer (|value| < 2^53), got {s}")


def user_mod(q: Tensor, batch: int, heads: int, score_mod, *slots) -> Optional[UserMod]:
    """The UserMod of a call's `score_mod` argument (None for ""), its slots checked: each
    declared parameter's slot holds what its kind needs (a tensor of the kind's dtype and
    shape on q's device, or a finite number, an integer for scalar_int), every other
    `user_t<k>` is None and every other `user_s<k>` 0.0. `slots`: user_t0..3, user_s0..3.
    Refusals are UnsupportedCalls naming the parameter, its slot and what is allowed."""
    tensors, numbers = slots[:USER_SLOTS], slots[USER_SLOTS:]
    if not score_mod:
        if any(t is not None for t in tensors) or any(s != 0.0 for s in numbers):
            raise UnsupportedCall(
                "user_t<k> / user_s<k> are set but score_mod is '': they carry a variant's "
                "parameters (flashgen.torch.compile_variant); leave them None and 0.0"
            )
        return None
    if not isinstance(score_mod, str):
        raise UnsupportedCall(f"score_mod must be a str (a variant key), got {type(score_mod)}")
    mod = _parse_variant(score_mod)
    declared = {k: (name, kind) for k, (name, kind) in enumerate(mod.params)}
    for k in range(USER_SLOTS):
        t, s = tensors[k], numbers[k]
        if k not in declared:
            if t is not None or s != 0.0:
                names = ", ".join(f"{n} (slot {i})" for i, (n, _) in declared.items())
                raise UnsupportedCall(
                    f"user slot {k} is set but the score_mod declares no parameter there "
                    f"(its parameters, sorted by name: {names or 'none'})"
                )
            continue
        name, kind = declared[k]
        what = f"score_mod parameter {name!r} ({kind.value}, slot {k})"
        if kind in _SCALAR_KINDS:
            if t is not None:
                raise UnsupportedCall(f"{what} is a number (user_s{k}), not a tensor")
            _check_user_number(what, s, kind)
        else:
            if s != 0.0:
                raise UnsupportedCall(f"{what} is a tensor (user_t{k}); user_s{k} must be 0.0")
            _check_user_tensor(what, t, kind, q, batch, heads)
    return mod


def user_params(mod: Optional[UserMod], *slots) -> dict:
    """The launch fields `fg_score_params.user_*` of a checked call (`user_mod`), packed as
    verify.runner's `user_slot_params` packs them: user_ptr<k> the tensor's data, a table's
    columns in user_i<k>, a scalar in user_f<k>, a scalar_int in user_i<k>."""
    if mod is None:
        return {}
    out: dict = {}
    for k, (_, kind) in enumerate(mod.params):
        t, s = slots[k], slots[USER_SLOTS + k]
        if kind is ParamKind.SCALAR:
            out[f"user_f{k}"] = float(s)
        elif kind is ParamKind.SCALAR_INT:
            out[f"user_i{k}"] = int(s)
        else:
            out[f"user_ptr{k}"] = t.data_ptr()
            if kind is ParamKind.TABLE:
                out[f"user_i{k}"] = int(t.shape[1])
    return out


def _empty_lse(lse: Tensor, learnable_sink: Optional[Tensor]) -> Tensor:
    """The LSE of rows that see no key: -inf, or the head's sink (exp(sink) alone is then the
    softmax's denominator; the output stays 0)."""
    if learnable_sink is None:
        return lse.fill_(-math.inf)
    return lse.copy_(learnable_sink[:, None].expand(lse.shape))


def _check_scale(softmax_scale: float) -> None:
    if not (softmax_scale > 0.0) or math.isinf(softmax_scale):
        raise UnsupportedCall(f"softmax_scale must be finite and > 0, got {softmax_scale}")


def _check_aligned(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.numel() and t.data_ptr() % 16:
            raise UnsupportedCall(
                f"{name} starts at an address that is not 16-byte aligned (a view that begins "
                "mid-vector?): pass .contiguous()"
            )


_STRIDE_NAMES = {
    prefix: (f"{prefix}_batch_stride", f"{prefix}_row_stride", f"{prefix}_head_stride")
    for prefix in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
}


def _strides(prefix: str, t: Tensor, varlen: bool) -> dict[str, int]:
    """`<prefix>_batch_stride`, `_row_stride`, `_head_stride` of a (b, s, h, d) or packed
    (total, h, d) tensor (varlen rows are packed positions: no batch stride)."""
    s = t.stride()
    batch, row, head = _STRIDE_NAMES[prefix]
    if varlen:
        return {batch: 0, row: s[0], head: s[1]}
    return {batch: s[0], row: s[1], head: s[2]}


def _out_shape(q: Tensor, pb: Problem) -> tuple[int, ...]:
    """The forward's out: q's shape with v's head dim (d_v, `Problem.d_v`)."""
    return (*q.shape[:-1], pb.d_v)


def _lse_shape(q: Tensor, pb: Problem) -> tuple[int, ...]:
    """`(batch, heads, seqlen_q)`, varlen `(heads, total_q)`: docs/conventions.md."""
    return (pb.heads, q.shape[0]) if pb.varlen else (pb.batch, pb.heads, pb.seqlen_q)


def _lse_strides(lse: Tensor, varlen: bool) -> dict[str, int]:
    s = lse.stride()
    batch, head = (0, s[0]) if varlen else (s[0], s[1])
    return {"lse_batch_stride": batch, "lse_head_stride": head}


def _i64(value: int) -> int:
    """A uint64 (or any int, taken mod 2^64) as the int64 of the same 8 bytes."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def _scalar(value: int) -> Tensor:
    """A 0-dim int64 CPU tensor holding a uint64 (two's complement): a new one per call.
    (`torch.scalar_tensor` makes what `torch.tensor(value, dtype=torch.int64)` does, on the
    default device as well, without parsing Python data; int64 Scalars fill exactly.)"""
    return torch.scalar_tensor(_i64(value), dtype=torch.int64)


def _u64(t: Tensor) -> int:
    return int(t.item()) & (2**64 - 1)


def philox_state(device: torch.device, dropout_p: float) -> tuple[int, int]:
    """(seed, offset) for one forward, taken from the device's default CUDA generator, whose
    offset then advances by PHILOX_OFFSET_STEP (as torch's fused ops advance it). (0, 0) when
    there is no dropout. Not under CUDA graph capture, where host values would be baked into
    the graph (every replay would draw one mask): `_captured_philox` serves that case."""
    if dropout_p == 0.0:
        return 0, 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    seed, offset = int(gen.initial_seed()), int(gen.get_offset())
    gen.set_offset(offset + PHILOX_OFFSET_STEP)
    return seed, offset


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where torch has no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _captured_philox(device: torch.device) -> tuple[dict[str, int], Tensor, Tensor]:
    """The launch fields and the (seed, offset) outputs of a dropout forward under CUDA graph
    capture, on the ctypes path: the seed and offset are drawn on the device by a torch RNG
    op (`random_` of two int64 words from the default CUDA generator, which torch makes
    graph-safe: each replay draws new ones), and the kernel reads them through
    `philox_seed_ptr` / `philox_offset_ptr` and writes what it used to the two 0-dim int64
    device tensors returned, which the backward reads back the same way. The compiled binding
    takes torch's PhiloxCudaState instead (binding.cpp), as torch's fused attention does;
    either way the mask is the one verify.dropout draws from the written (seed, offset)."""
    words = torch.empty((2,), dtype=torch.int64, device=device).random_()
    seed = torch.empty((), dtype=torch.int64, device=device)
    offset = torch.empty((), dtype=torch.int64, device=device)
    fields = {
        "philox_seed_ptr": words.data_ptr(),
        "philox_offset_ptr": words.data_ptr() + words.element_size(),
        "philox_seed_out": seed.data_ptr(),
        "philox_offset_out": offset.data_ptr(),
    }
    return fields, seed, offset


def _philox_pointers(seed: Tensor, offset: Tensor) -> dict[str, int]:
    """The backward's fields for a forward's (seed, offset) outputs: by value from 0-dim CPU
    tensors, or read by the kernel from 0-dim device tensors (a captured forward's)."""
    if seed.device.type == "cpu":
        return {"seed": _u64(seed), "offset": _u64(offset)}
    return {"philox_seed_ptr": seed.data_ptr(), "philox_offset_ptr": offset.data_ptr()}


# The current stream's cudaStream_t of a device index, as an int, without building a
# torch.cuda.Stream (what torch.cuda.current_stream(device).cuda_stream returns); absent
# from torch builds without CUDA, where the public call serves.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    """`torch.cuda.current_stream(device).cuda_stream`."""
    if _raw_stream is not None and device.index is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


class _OnDevice:
    """Makes `device` the current CUDA device for a launch when it is not already."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index

    def __enter__(self) -> None:
        self.prev = torch.cuda.current_device()
        if self.index is not None and self.index != self.prev:
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.index is not None and self.index != self.prev:
            torch.cuda.set_device(self.prev)


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------


def _fwd_outputs(q: Tensor, pb: Problem) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fake implementation's outputs: the metadata of what `fwd` returns."""
    out = torch.empty(_out_shape(q, pb), dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, pb), dtype=torch.float32, device=q.device)
    seed = torch.empty((), dtype=torch.int64, device="cpu")
    return out, lse, seed, torch.empty((), dtype=torch.int64, device="cpu")


def _any_user(user: tuple) -> bool:
    """Whether any user slot is set (a call without a score_mod must leave them all unset)."""
    return any(t is not None for t in user[1 : 1 + USER_SLOTS]) or any(
        x != 0.0 for x in user[1 + USER_SLOTS :]
    )


def _fwd_select(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_left, window_right, deterministic, softcap, alibi_slopes, learnable_sink,
    *user,
):  # fmt: skip
    """Every check of a forward call and its kernel: (problem, features, score_mod, runtime
    window, library). The Python implementation and the binding's planner both start here.
    `user`: a variant call's nine user arguments (none for a plain call)."""
    pb = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    mod = user_mod(q, pb.batch, pb.heads, *user) if user else None
    call, window = _call(
        q, pb, dropout_p, causal, window_left, window_right, deterministic, feats, mod
    )
    _check_scale(softmax_scale)
    return pb, feats, mod, window, cache.kernel_library(selection.forward_spec(call))


def _fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    *user,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flashgen::fwd (`_FWD_SCHEMA`) and, with `user` (the nine user arguments),
    flashgen::fwd_variant: one launch path for both."""
    pb, feats, mod, (win_l, win_r), lib = _fwd_select(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_left, window_right, deterministic, softcap, alibi_slopes,
        learnable_sink, *user,
    )  # fmt: skip
    device = q.device
    if dropout_p > 0.0 and capturing():
        philox, seed_t, offset_t = _captured_philox(device)
        seed = offset = 0
    else:
        philox = {}
        seed, offset = philox_state(device, dropout_p)
        seed_t, offset_t = _scalar(seed), _scalar(offset)
    out = torch.empty(_out_shape(q, pb), dtype=q.dtype, device=device)
    lse = torch.empty(_lse_shape(q, pb), dtype=torch.float32, device=device)
    if q.numel() == 0 or k.numel() == 0:  # no kernel: a captured (seed, offset) reads 0, 0
        if philox:
            seed_t.zero_(), offset_t.zero_()
        if q.numel() == 0:
            return out, lse, seed_t, offset_t
        out.zero_()  # no key anywhere: every row is empty (O = 0, LSE = -inf or the sink)
        _empty_lse(lse, learnable_sink)
        return out, lse, seed_t, offset_t
    q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    if (q_ptr | k_ptr | v_ptr) % 16:  # all aligned: nothing for _check_aligned to refuse
        _check_aligned(q=q, k=k, v=v)
    params = {
        "q": q_ptr,
        "k": k_ptr,
        "v": v_ptr,
        "o": out.data_ptr(),
        "lse": lse.data_ptr(),
        **_strides("q", q, pb.varlen),
        **_strides("k", k, pb.varlen),
        **_strides("v", v, pb.varlen),
        **_strides("o", out, pb.varlen),
        **_lse_strides(lse, pb.varlen),
        "batch": pb.batch,
        "heads": pb.heads,
        "kv_heads": pb.kv_heads,
        "seqlen_q": pb.seqlen_q,
        "seqlen_k": pb.seqlen_k,
        "head_dim": q.shape[-1],  # <name>_check compares them with the kernel's
        "head_dim_v": v.shape[-1],
        "cu_seqlens_q": 0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
        "cu_seqlens_k": 0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
        # varlen: rows of the packed tensors (the sm_90a forward's tensor maps span them)
        "total_q": q.shape[0] if pb.varlen else 0,
        "total_k": k.shape[0] if pb.varlen else 0,
        "softmax_scale": softmax_scale,
        "window_left": win_l,
        "window_right": win_r,
        "dropout_p": dropout_p,
        "seed": seed,
        "offset": offset,
        **philox,
        "blk_layout_heads": 1,
    }
    if feats:
        params.update(score_params(feats, softcap, alibi_slopes, learnable_sink))
    if mod is not None:
        params.update(user_params(mod, *user[1:]))
    with _OnDevice(device):
        lib.launch(params, _stream(device))
    return out, lse, seed_t, offset_t


def _user(user: tuple) -> tuple:
    """The nine user arguments, their defaults filling what a caller left out."""
    return tuple(user) + NO_USER[len(user) :]


def _fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_left, window_right, deterministic, softcap=0.0, alibi_slopes=None,
    learnable_sink=None, *user,
):  # fmt: skip
    pb = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    mod = user_mod(q, pb.batch, pb.heads, *_user(user)) if user else None
    call, _ = _call(q, pb, dropout_p, causal, window_left, window_right, deterministic, feats,
                    mod)  # fmt: skip
    selection.forward_spec(call)  # refuse at trace time what the kernel cannot serve
    return _fwd_outputs(q, pb)


# --------------------------------------------------------------------------------------------
# Backward.
# --------------------------------------------------------------------------------------------


def _bwd_problem(dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k) -> Problem:
    pb = _problem(q, k, v, cu_q, cu_k, max_q, max_k, extra=(("out", out, "o"), ("dout", dout, "o")))
    want = _lse_shape(q, pb)
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(want) or lse.stride(-1) != 1:
        raise UnsupportedCall(
            f"softmax_lse must be the forward's float32 {tuple(want)} with unit row stride; "
            f"got {str(lse.dtype).removeprefix('torch.')} {tuple(lse.shape)}"
        )
    for name, t in (("philox_seed", seed), ("philox_offset", offset)):
        if t.dtype != torch.int64 or t.dim() != 0 or t.device.type not in ("cpu", q.device.type):
            raise UnsupportedCall(
                f"{name} must be the forward's 0-dim int64 tensor (on the CPU, or on q's "
                "device when the forward ran under CUDA graph capture)"
            )
    if seed.device != offset.device:
        raise UnsupportedCall("philox_seed and philox_offset must be on one device")
    return pb


def _bwd_outputs(
    q: Tensor, k: Tensor, v: Tensor, pb: Problem, learnable_sink: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and dsink: float32 (heads,) with a sink, else empty (0,)."""
    grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    n = 0 if learnable_sink is None else pb.heads
    return (*grads, torch.empty((n,), dtype=torch.float32, device=q.device))


def _bwd_select(
    dout, q, k, v, out, softmax_lse, philox_seed, philox_offset, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
    deterministic, softcap, alibi_slopes, learnable_sink, *user,
):  # fmt: skip
    """Every check of a backward call and its kernel: (problem, features, score_mod, runtime
    window, spec, library). The Python implementation and the binding's planner both start
    here."""
    pb = _bwd_problem(
        dout, q, k, v, out, softmax_lse, philox_seed, philox_offset,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    )  # fmt: skip
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    mod = user_mod(q, pb.batch, pb.heads, *user) if user else None
    call, window = _call(
        q, pb, dropout_p, causal, window_left, window_right, deterministic, feats, mod
    )
    _check_scale(softmax_scale)
    spec = selection.backward_spec(call)
    return pb, feats, mod, window, spec, cache.kernel_library(spec)


def _bwd_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    philox_seed: Tensor,
    philox_offset: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    *user,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flashgen::bwd (`_BWD_SCHEMA`) and, with `user`, flashgen::bwd_variant."""
    lse = softmax_lse
    pb, feats, mod, (win_l, win_r), spec, lib = _bwd_select(
        dout, q, k, v, out, lse, philox_seed, philox_offset, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
        deterministic, softcap, alibi_slopes, learnable_sink, *user,
    )  # fmt: skip
    dq, dk, dv, dsink = _bwd_outputs(q, k, v, pb, learnable_sink)
    if q.numel() == 0 or k.numel() == 0:  # nothing visible anywhere: every gradient is 0
        # (a sink's too: its rows have O = 0, so D = rowsum(dO * O) = 0)
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink.zero_()
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr = (t.data_ptr() for t in (q, k, v, out, dout))
    if (q_ptr | k_ptr | v_ptr | o_ptr | do_ptr) % 16:  # else nothing for _check_aligned to refuse
        _check_aligned(q=q, k=k, v=v, out=out, dout=dout)
    params = {
        "q": q_ptr,
        "k": k_ptr,
        "v": v_ptr,
        "o": o_ptr,
        "dout": do_ptr,
        "lse": lse.data_ptr(),
        "dq": dq.data_ptr(),
        "dk": dk.data_ptr(),
        "dv": dv.data_ptr(),
        **_strides("q", q, pb.varlen),
        **_strides("k", k, pb.varlen),
        **_strides("v", v, pb.varlen),
        **_strides("o", out, pb.varlen),
        **_strides("do", dout, pb.varlen),
        **_strides("dq", dq, pb.varlen),
        **_strides("dk", dk, pb.varlen),
        **_strides("dv", dv, pb.varlen),
        **_lse_strides(lse, pb.varlen),
        "batch": pb.batch,
        "heads": pb.heads,
        "kv_heads": pb.kv_heads,
        "seqlen_q": pb.seqlen_q,
        "seqlen_k": pb.seqlen_k,
        "head_dim": q.shape[-1],  # <name>_check compares them with the kernel's
        "head_dim_v": v.shape[-1],
        "cu_seqlens_q": 0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
        "cu_seqlens_k": 0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
        # varlen: rows of the packed tensors (the sm_90a backward's tensor maps span them)
        "total_q": q.shape[0] if pb.varlen else 0,
        "total_k": k.shape[0] if pb.varlen else 0,
        "softmax_scale": softmax_scale,
        "window_left": win_l,
        "window_right": win_r,
        "dropout_p": dropout_p,
        **_philox_pointers(philox_seed, philox_offset),
        "blk_layout_heads": 1,
    }
    if feats:
        params.update(score_params(feats, softcap, alibi_slopes, learnable_sink))
        if learnable_sink is not None:
            params["dsinks"] = dsink.data_ptr()  # written by the kernel, not accumulated
    if mod is not None:
        params.update(user_params(mod, *user[1:]))
    # The workspace, carved exactly as verify.runner_bwd does (the C ABI's layout): fp32
    # dq_accum, fp32 dsum, then the int32 dq_sem of deterministic builds, each 256-byte
    # aligned; the launcher zeroes what must start at zero, so torch.empty suffices.
    carve = workspace_layout(
        pb.batch,
        pb.seqlen_q,
        pb.heads,
        pb.head_dim,
        block_m=spec.tile.block_m,
        deterministic=spec.deterministic,
    )
    asked = lib.workspace_bytes(params)
    if asked < carve["bytes"]:
        raise RuntimeError(
            f"{lib.name}_workspace_bytes returned {asked} bytes, less than the {carve['bytes']} "
            "the dq_accum + dsum (+ dq_sem) carve needs"
        )
    workspace = torch.empty(asked, dtype=torch.uint8, device=q.device)
    base = workspace.data_ptr()
    params["dq_accum"] = base + carve["dq_accum"]
    params["dsum"] = base + carve["dsum"]
    if spec.deterministic:
        params["dq_sem"] = base + carve["dq_sem"]
    with _OnDevice(q.device):
        lib.launch(params, _stream(q.device))
    return dq, dk, dv, dsink


def _bwd_fake(
    dout, q, k, v, out, softmax_lse, philox_seed, philox_offset, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
    deterministic, softcap=0.0, alibi_slopes=None, learnable_sink=None, *user,
):  # fmt: skip
    pb = _bwd_problem(
        dout, q, k, v, out, softmax_lse, philox_seed, philox_offset,
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    )  # fmt: skip
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    mod = user_mod(q, pb.batch, pb.heads, *_user(user)) if user else None
    call, _ = _call(q, pb, dropout_p, causal, window_left, window_right, deterministic, feats,
                    mod)  # fmt: skip
    selection.backward_spec(call)
    return _bwd_outputs(q, k, v, pb, learnable_sink)


# --------------------------------------------------------------------------------------------
# Autograd: the backward family serves loss.backward().
# --------------------------------------------------------------------------------------------


# check_backward's accepted calls, by `_backward_key` (bounded like _CALLS).
_BACKWARD_OK: set[tuple] = set()
_PLAIN = (bool, int, float)


def _backward_key(q, k, v, cu_q, cu_k, dropout_p, causal, window_left, window_right,
                  deterministic, softcap=0.0, alibi_slopes=None,
                  learnable_sink=None, *user) -> Optional[tuple]:  # fmt: skip
    """What decides check_backward's verdict on a call whose tensors `_problem` and whose
    score arguments `score_features` accept: q's dtype, head_dim and heads, k's heads, which
    cu_seqlens are given, q's device, the dropout, mask and deterministic arguments and the
    softcap as given, and which of alibi_slopes and learnable_sink are given (with those,
    `_problem` and `score_features` derive what `_call` reads). None unless all tensors are
    plain torch.Tensors (fake, functional and other subclasses take the full check) and the
    other arguments plain bool, int or float (equal values then convert and check alike).
    May raise TypeError."""
    T = Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    for x in (dropout_p, causal, window_left, window_right, deterministic, softcap):
        if type(x) not in _PLAIN:
            return None
    if (cu_q is not None and type(cu_q) is not T) or (cu_k is not None and type(cu_k) is not T):
        return None
    sq, sk = q.shape, k.shape
    if len(sq) < 2 or len(sk) < 2:
        return None
    key = (q.dtype, sq[-1], sq[-2], sk[-2], cu_q is None, cu_k is None, q.device, dropout_p,
           causal, window_left, window_right, deterministic, softcap, alibi_slopes is None,
           learnable_sink is None)  # fmt: skip
    if user and (user[0] or _any_user(user)):  # a variant: its key and which slots are set
        if type(user[0]) is not str:
            return None
        key += (user[0], *(t is None for t in user[1 : 1 + USER_SLOTS]))
    hash(key)
    return key


def _backward_known(q, k, v, cu_q, cu_k, dropout_p, causal, window_left, window_right,
                    deterministic, softcap=0.0, alibi_slopes=None,
                    learnable_sink=None, *user) -> bool:  # fmt: skip
    """True when check_backward accepted a call of the same `_backward_key` before: then
    check_backward on these arguments either passes or fails in `_problem`, `score_features`
    or `_call`, which the forward runs first on the same arguments, with the same message."""
    try:
        key = _backward_key(q, k, v, cu_q, cu_k, dropout_p, causal, window_left, window_right,
                            deterministic, softcap, alibi_slopes, learnable_sink,
                            *user)  # fmt: skip
    except TypeError:
        return False
    return key is not None and key in _BACKWARD_OK


def check_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    *user,
) -> None:
    """Raise UnsupportedCall now if this call's backward has no kernel (so a training step
    fails at its forward, not after it). `user`: the nine user arguments, if any."""
    pb = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    feats = score_features(q, pb.batch, pb.heads, softcap, alibi_slopes, learnable_sink)
    mod = user_mod(q, pb.batch, pb.heads, *_user(user)) if user else None
    call, _ = _call(q, pb, dropout_p, causal, window_left, window_right, deterministic, feats,
                    mod)  # fmt: skip
    selection.backward_spec(call)
    try:
        key = _backward_key(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, causal,
                            window_left, window_right, deterministic, softcap, alibi_slopes,
                            learnable_sink, *user)  # fmt: skip
    except TypeError:
        return
    if key is not None:
        if len(_BACKWARD_OK) >= _CACHE_LIMIT:
            _BACKWARD_OK.clear()
        _BACKWARD_OK.add(key)


# fwd's inputs: q, k, v, cu_seqlens_q/k, max_seqlen_q/k, dropout_p, softmax_scale, causal,
# window_left/right, deterministic, softcap, alibi_slopes, learnable_sink.
_SINK_INPUT = 15


def _setup_context(ctx, inputs, output, user=()) -> None:
    """fwd's autograd context; `user`: a fwd_variant call's nine user arguments
    (`_setup_variant_context`), saved for bwd_variant."""
    (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, win_l, win_r, det, softcap,
     alibi, sink) = inputs  # fmt: skip
    out, lse, seed, offset = output
    # The forward accepted these tensors (_problem), so a call known to check_backward
    # passes it: only the first call of its kind pays for the check.
    score = (softcap, alibi, sink)
    if not _backward_known(
        q, k, v, cu_q, cu_k, dropout_p, causal, win_l, win_r, det, *score, *user
    ):
        check_backward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, win_l, win_r, det, *score,
            *user,
        )  # fmt: skip
    # a variant's parameter tensors are saved with the others, its key and numbers as values
    ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_q, cu_k, alibi, sink,
                          *user[1 : 1 + USER_SLOTS])  # fmt: skip
    ctx.attrs = (max_q, max_k, dropout_p, scale, causal, win_l, win_r, det, softcap)
    ctx.user = (user[0], user[1 + USER_SLOTS :]) if user else None
    # The LSE is an output for inspection and merging, not a differentiable one (as in
    # flash-attn): the backward kernel has no term for a gradient flowing into it.
    ctx.mark_non_differentiable(lse, seed, offset)


def _usable(dout: Tensor) -> Tensor:
    """dout as the kernel takes it (unit last stride, strides multiples of 8); a gradient
    arriving in another layout (e.g. expanded) is copied once, as flash-attn does."""
    if dout.stride(-1) != 1 or any(s % 8 for s in dout.stride()[:-1]):
        return dout.contiguous()
    return dout


def _backward(ctx, dout, _dlse, _dseed, _doffset):
    """fwd's backward (bwd) and fwd_variant's (bwd_variant, with the saved user arguments)."""
    q, k, v, out, lse, seed, offset, cu_q, cu_k, alibi, sink, *tensors = ctx.saved_tensors
    if ctx.user is None:
        dq, dk, dv, dsink = torch.ops.flashgen.bwd.default(
            _usable(dout), q, k, v, out, lse, seed, offset, cu_q, cu_k, *ctx.attrs, alibi, sink
        )
        rest = ()
    else:
        key, numbers = ctx.user
        dq, dk, dv, dsink = torch.ops.flashgen.bwd_variant.default(
            _usable(dout), q, k, v, out, lse, seed, offset, cu_q, cu_k, *ctx.attrs, alibi, sink,
            key, *tensors, *numbers,
        )  # fmt: skip
        rest = (None,) * len(USER_ARGS)  # a score_mod's parameters get no gradient
    # softcap and alibi_slopes get no gradient (as in flash-attn); the sink's is the kernel's
    want_sink = sink is not None and ctx.needs_input_grad[_SINK_INPUT]
    return (dq, dk, dv) + (None,) * 12 + (dsink if want_sink else None,) + rest


# --------------------------------------------------------------------------------------------
# The variant ops (flashgen.torch.compile_variant): fwd and bwd plus the nine user arguments.
# --------------------------------------------------------------------------------------------

# The plain ops' schemas, spelled out: `_fwd_impl` / `_bwd_impl` also take a variant's user
# arguments (`*user`), which no schema can be inferred from. Every flash_attn_func call goes
# through these two; the user arguments are the variant ops' alone, so a plain call's
# arguments, autograd wrapper and binding fast path are those of a build without variants.
_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, "
    "bool causal, SymInt window_left, SymInt window_right, bool deterministic, "
    "float softcap=0.0, Tensor? alibi_slopes=None, "
    "Tensor? learnable_sink=None) -> (Tensor, Tensor, Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
    "Tensor philox_seed, Tensor philox_offset, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
    "float softmax_scale, bool causal, SymInt window_left, SymInt window_right, "
    "bool deterministic, float softcap=0.0, Tensor? alibi_slopes=None, "
    "Tensor? learnable_sink=None) -> (Tensor, Tensor, Tensor, Tensor)"
)


def _with_user(schema: str) -> str:
    """A plain op's schema with the user arguments (`USER_ARGS`) appended: the variant op's."""
    head, tail = schema.split(") -> ")
    user = (
        ['str score_mod=""']
        + [f"Tensor? user_t{k}=None" for k in range(USER_SLOTS)]
        + [f"float user_s{k}=0.0" for k in range(USER_SLOTS)]
    )
    return f"{head}, {', '.join(user)}) -> {tail}"


def _variant(fn):
    """`fn` (`_fwd_impl`, `_bwd_fake`...: the plain arguments, then `*user`) as a variant op's
    function: the user arguments by name too, and their defaults (`NO_USER`) filled, so that
    `fn` always gets all nine."""
    plain = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_POSITIONAL]
    user = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in zip(USER_ARGS, NO_USER)
    ]
    sig = inspect.Signature(plain + user)

    def variant(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return fn(*bound.args)

    variant.__signature__ = sig
    variant.__name__ = variant.__qualname__ = f"{fn.__name__}_variant"
    return variant


def _setup_variant_context(ctx, inputs, output) -> None:
    """fwd_variant's autograd context: fwd's, with the user arguments (defaults filled)."""
    _setup_context(ctx, tuple(inputs[:16]), output, _user(inputs[16:]))


# --------------------------------------------------------------------------------------------
# The compiled binding's planners (flashgen.torch.binding): one launch plan per call key.
# --------------------------------------------------------------------------------------------

# fg_score_params' 8-byte slots, in struct order (score_params.h is rendered from this table);
# a pointer slot takes the data pointer of its feature's torch argument at every call.
_SLOT_INDEX = {r.name: i for i, r in enumerate(SCORE_PARAMS)}
_SLOT_CTYPE = {r.name: r.ctype for r in SCORE_PARAMS}
_SLOT_ARG = {r.name: f.torch_arg for f in FEATURES for r in f.params}
_SLOT_KINDS = {"alibi_slopes": 1, "learnable_sink": 2}  # binding.cpp's SlotKind; 3: dsinks
_DSINKS_SLOT = "dsinks"


def _score_slots(feats, softcap, alibi_slopes, learnable_sink, dsinks: bool) -> list[tuple]:
    """(slot index, kind, value) of each score field a call sets: kind 0 a constant (its 8
    bytes as an int64), 1/2 the slopes'/sink's data pointer, 3 the backward's dsink output."""
    slots = []
    for name, value in score_params(feats, softcap, alibi_slopes, learnable_sink).items():
        if _SLOT_CTYPE[name] == "ptr":
            slots.append((_SLOT_INDEX[name], _SLOT_KINDS[_SLOT_ARG[name]], 0))
        elif _SLOT_CTYPE[name] == "f64":
            (bits,) = struct.unpack("=q", struct.pack("=d", float(value)))
            slots.append((_SLOT_INDEX[name], 0, bits))
        else:
            slots.append((_SLOT_INDEX[name], 0, _i64(int(value))))
    if dsinks:
        slots.append((_SLOT_INDEX[_DSINKS_SLOT], 3, 0))
    return slots


def _plan(lib, window, slots, spec=None) -> dict:
    return {
        "name": lib.name,
        **lib.entry_addresses(),
        "window_left": int(window[0]),
        "window_right": int(window[1]),
        "score_slots": slots,
        "block_m": spec.tile.block_m if spec is not None else 1,
        "deterministic": bool(spec.deterministic) if spec is not None else False,
        "philox_step": PHILOX_OFFSET_STEP,
    }


def _fwd_plan(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_left, window_right, deterministic, softcap=0.0, alibi_slopes=None,
    learnable_sink=None,
):  # fmt: skip
    """The binding's plan for the key of this forward call. Dropout is served too: the
    binding takes the CUDA generator's state per call (binding.cpp's take_philox; a binding
    built without torch's CUDA generator runs the Python implementation for it). Raises what
    the Python path raises."""
    _, feats, _, window, lib = _fwd_select(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_left, window_right, deterministic, softcap, alibi_slopes,
        learnable_sink,
    )  # fmt: skip
    return _plan(lib, window, _score_slots(feats, softcap, alibi_slopes, learnable_sink, False))


def _bwd_plan(
    dout, q, k, v, out, softmax_lse, philox_seed, philox_offset, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
    deterministic, softcap=0.0, alibi_slopes=None, learnable_sink=None,
):  # fmt: skip
    """The binding's plan for the key of this backward call (see `_fwd_plan`); the seed and
    offset are read per call, so dropout is served."""
    _, feats, _, window, spec, lib = _bwd_select(
        dout, q, k, v, out, softmax_lse, philox_seed, philox_offset, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_left, window_right,
        deterministic, softcap, alibi_slopes, learnable_sink,
    )  # fmt: skip
    slots = _score_slots(feats, softcap, alibi_slopes, learnable_sink, learnable_sink is not None)
    return _plan(lib, window, slots, spec)


def _launch_error(name: str, err: int, msg: Optional[str]) -> None:
    """Raise the Python path's LaunchError for a failed launch of the binding."""
    raise launch_error(name, err, msg)


def _check_backward_args(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_left, window_right, deterministic, softcap=0.0, alibi_slopes=None,
    learnable_sink=None,
) -> None:  # fmt: skip
    """check_backward on fwd's arguments (the binding's autograd kernel calls it once per
    key, before the forward runs)."""
    del softmax_scale
    check_backward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
        window_left, window_right, deterministic, softcap, alibi_slopes, learnable_sink,
    )  # fmt: skip


def _install_binding():
    """The binding's module with flashgen::fwd/bwd defined in C++, or None for the ctypes
    path (FLASHGEN_TORCH_BINDING, flashgen.torch.binding)."""
    from flashgen.torch import binding

    try:
        want = binding.mode()
    except binding.BindingUnavailable as e:  # a bad value: say so, keep the ctypes path
        print(f"flashgen: {e}; using the ctypes path", file=sys.stderr)
        return None
    if want == "0":
        return None
    try:
        module = binding.load()
    except binding.BindingUnavailable as e:
        if want == "1":
            raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"flashgen: torch binding unavailable ({reason}); using the ctypes path",
              file=sys.stderr)  # fmt: skip
        return None
    module.install(
        {
            "fwd_plan": _fwd_plan,
            "fwd_py": _fwd_impl,
            "bwd_plan": _bwd_plan,
            "bwd_py": _bwd_impl,
            "check_backward": _check_backward_args,
            "launch_error": _launch_error,
        },
        "fwd" + _FWD_SCHEMA,
        "bwd" + _BWD_SCHEMA,
        os.environ.get(binding.CPU_TESTS_ENV) == "1",
    )
    return module


BINDING = _install_binding()
if BINDING is not None:
    fwd = torch.ops.flashgen.fwd
    bwd = torch.ops.flashgen.bwd
    torch.library.register_fake("flashgen::fwd")(_fwd_fake)
    torch.library.register_fake("flashgen::bwd")(_bwd_fake)
else:
    fwd = torch.library.custom_op("flashgen::fwd", _fwd_impl, mutates_args=(), schema=_FWD_SCHEMA)
    fwd.register_fake(_fwd_fake)
    bwd = torch.library.custom_op("flashgen::bwd", _bwd_impl, mutates_args=(), schema=_BWD_SCHEMA)
    bwd.register_fake(_bwd_fake)
    fwd.register_autograd(_backward, setup_context=_setup_context)
# The variant ops are Python custom ops on either path (the binding defines fwd and bwd only).
fwd_variant = torch.library.custom_op(
    "flashgen::fwd_variant", _variant(_fwd_impl), mutates_args=(), schema=_with_user(_FWD_SCHEMA)
)
fwd_variant.register_fake(_variant(_fwd_fake))
bwd_variant = torch.library.custom_op(
    "flashgen::bwd_variant", _variant(_bwd_impl), mutates_args=(), schema=_with_user(_BWD_SCHEMA)
)
bwd_variant.register_fake(_variant(_bwd_fake))
fwd_variant.register_autograd(_backward, setup_context=_setup_variant_context)
