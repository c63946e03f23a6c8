"""flashgen as PyTorch's FlashAttention implementation, through torch's registry of them.

    from flashgen.torch import sdpa_backend
    sdpa_backend.activate()                    # register "flashgen" and activate it
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # flashgen's kernels
    sdpa_backend.deactivate()                  # PyTorch's built-in FlashAttention-2 again

PyTorch 2.10 added a registry of FlashAttention implementations to `torch.nn.attention`
(`register_flash_attention_impl`, `activate_flash_attention_impl`,
`list_flash_attention_impls`, `current_flash_attention_impl`; 2.11 adds
`restore_flash_attention_impl`). Its FA3 and FA4 entries and this one work alike: activation
calls a function that overrides the CUDA kernels of the aten operators behind SDPA's FLASH
backend with a `torch.library.Library("aten", "IMPL", "CUDA")`, and returns a handle whose
`remove()` drops that library, which brings back the built-in kernels. Nothing else changes:
SDPA still chooses its backend with its own rules (fp16/bf16, head dim <= 256, no
`attn_mask`, `is_causal` only with seqlen_q == seqlen_k, a GPU of compute capability >= 8.0)
and pads the head dim to a multiple of 8 before calling the operator; autograd, the meta
functions that torch.compile traces with, and the operators' schemas are the built-in ones.

The operators replaced, and how flashgen serves each (`torch.ops.flashgen.fwd` / `bwd`):

    _scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False,
        return_debug_mask=False, *, scale=None)
        -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused,
            debug_attn_mask)
    _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out,
        logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
        philox_offset, *, scale=None) -> (grad_query, grad_key, grad_value)
        SDPA's (batch, heads, seqlen, head_dim) tensors, read as the (batch, seqlen, heads,
        head_dim) views `x.transpose(1, 2)` (no copy for the usual layouts); logsumexp
        float32 (batch, heads, seqlen_q); cum_seq_q / cum_seq_k None.
    _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
        dropout_p, is_causal, return_debug_mask, *, scale=None, window_size_left=None,
        window_size_right=None, seqused_k=None, alibi_slopes=None[, block_table=None,
        num_splits=None]) -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)
    _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q,
        cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
        window_size_left=None, window_size_right=None) -> (dq, dk, dv)
        flash-attn's (batch, seqlen, heads, head_dim) layout, or packed varlen
        (total, heads, head_dim) with int32 cumulative lengths (what
        `torch.nn.attention.varlen.varlen_attn` calls); logsumexp (heads, total_q) then.
    Outputs and gradients have the strides of `torch.empty_like(query)` (`key`, `value`), as
    aten's meta functions say (torch.compile checks them) and the built-in kernels return:
    flashgen's contiguous (batch, seqlen, heads, head_dim) results are returned as they are
    when the inputs are views of such buffers (q, k, v of a projection), else copied once.
    _flash_attention_forward_no_dropout_inplace(out, ...) -> softmax_logsumexp
        (where the running torch has it): the forward above, copied into `out`.

Argument by argument (`forward_arguments`, `backward_arguments`):

- `scale` -> `softmax_scale` (None: 1 / sqrt(head_dim) of the tensors given; SDPA always
  passes the scale of the caller's head dim, before its padding to a multiple of 8);
- `is_causal` -> `causal`, bottom-right aligned like the built-in FlashAttention-2 (SDPA
  sends it only with seqlen_q == seqlen_k, where both alignments coincide);
- `window_size_left/right` (None or -1: unbounded) -> `window_left/right`;
- `dropout_p` -> `dropout_p`, Philox seed and offset from the default CUDA generator. The
  forward returns them in `rng_state` as a (2,) uint64 CPU tensor [seed, offset] (the
  built-in: a device tensor) so that the backward reads them without a sync; without dropout
  `rng_state` and `unused` are zeros on the device, as FA3's and FA4's. Dropout under CUDA
  graph capture is refused here (rng_state is packed on the host; flash_attn_func and the
  ops serve it);
- head dims: a head dim the kernels do not serve is zero-padded to the next served one for
  the forward and, independently, for the backward (zero columns change neither the scores
  nor the LSE), and the outputs and gradients sliced back; a layout the kernels cannot read
  is copied once (flash-attn's Python layer makes both copies alike);
- `deterministic` of the backward -> `torch.are_deterministic_algorithms_enabled()`;
- `num_splits` (a split-KV performance hint) is ignored.

What the registry can hand flashgen that it cannot serve, and what then happens: the call
raises `flashgen.torch.UnsupportedCall` (a ValueError) saying so, before any kernel runs; it
does not fall back. (An overriding kernel cannot call the built-in kernel it shadows, and an
exception does not make SDPA try its next backend: its choice is made before the call.)

- `return_debug_mask=True` (flashgen never materialises the attention matrix or the dropout
  mask; SDPA itself always passes False);
- `alibi_slopes` (aten's backward has no slopes argument, so the gradients would be wrong:
  call `flashgen.torch.flash_attn_func(..., alibi_slopes=...)` instead), `seqused_k`,
  `block_table` (paged K/V), or a keyword argument of a newer torch that is not None;
- what flashgen's operators refuse: a dtype other than float16/bfloat16 (SDPA's FLASH
  backend takes no other), a head dim above 256, a GPU other than compute capability 8.0,
  8.6, 8.9 or 9.0 (e.g. Blackwell, which SDPA's FA2 runs), dropout under graph capture.

Activate flashgen only where those do not occur, e.g. not on a Blackwell GPU; `deactivate()`
(or `torch.nn.attention.restore_flash_attention_impl()`) restores the built-in
implementation. The `.quantized` (fp8) overloads and nested tensors keep the built-in kernels.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from flashgen.generator.spec import KernelKind
from flashgen.torch import selection
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = [
    "NAME",
    "FlashgenArgs",
    "activate",
    "backward_arguments",
    "deactivate",
    "forward_arguments",
    "is_active",
    "pack_philox",
    "register_sdpa_impl",
    "unpack_philox",
]

NAME = "flashgen"  # the registry's name for this implementation (FA3, FA4 are torch's)
REGISTRY_SINCE = "2.10"  # the PyTorch release that added torch.nn.attention's registry

# The aten operators replaced: those every torch with the registry has, then the optional ones
# (added by later releases; replaced where present).
REQUIRED_OPS = (
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
)
OPTIONAL_OPS = ("_flash_attention_forward_no_dropout_inplace",)

_PREFIX = "flashgen's FlashAttention implementation (torch.nn.attention) cannot serve this call: "
_RESTORE = (
    "; flashgen.torch.sdpa_backend.deactivate() (or torch.nn.attention."
    "restore_flash_attention_impl()) brings back PyTorch's FlashAttention-2"
)
_HALF = (torch.float16, torch.bfloat16)
_U64 = 2**64


def _refuse(what: str) -> UnsupportedCall:
    return UnsupportedCall(_PREFIX + what + _RESTORE)


# --------------------------------------------------------------------------------------------
# Argument mapping: aten's flash operators -> flashgen's (pure functions, no tensors read)
# --------------------------------------------------------------------------------------------


class FlashgenArgs(NamedTuple):
    """The arguments of `torch.ops.flashgen.fwd` / `bwd` that a registry call sets, in the
    order of their schemas (between max_seqlen_k and deterministic)."""

    dropout_p: float
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int


def _window(value: Optional[int]) -> int:
    """aten's window bound (None or negative: unbounded) as flashgen's (-1: unbounded)."""
    if value is None:
        return -1
    value = int(value)
    return -1 if value < 0 else value


def _scale(scale: Optional[float], head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return float(scale)


def _check_unknown(op: str, other: dict) -> None:
    for name, value in other.items():
        if value is not None:
            raise _refuse(
                f"{op} got {name}={value!r}, an argument flashgen does not know (allowed: None)"
            )


def forward_arguments(
    head_dim: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    seqused_k: Any = None,
    alibi_slopes: Any = None,
    block_table: Any = None,
    num_splits: Optional[int] = None,
    **other: Any,
) -> FlashgenArgs:
    """flashgen's forward arguments for a call of aten's flash forward operators (their
    arguments after the tensors, by aten's names; `head_dim` that of the tensors given).
    Raises UnsupportedCall for what flashgen does not serve (see the module's docstring)."""
    del num_splits  # a split-KV performance hint: flashgen's kernels choose their own
    if return_debug_mask:
        raise _refuse(
            "return_debug_mask=True: flashgen never materialises the attention matrix or the "
            "dropout mask (allowed: False, which is what scaled_dot_product_attention passes)"
        )
    if alibi_slopes is not None:
        raise _refuse(
            "alibi_slopes: aten's flash backward takes no slopes, so its gradients would be "
            "wrong; call flashgen.torch.flash_attn_func(..., alibi_slopes=...) instead"
        )
    if seqused_k is not None:
        raise _refuse("seqused_k: per-sequence key counts are not implemented (allowed: None)")
    if block_table is not None:
        raise _refuse("block_table: paged K/V is not implemented here (allowed: None)")
    _check_unknown("the flash forward", other)
    return FlashgenArgs(
        float(dropout_p),
        _scale(scale, head_dim),
        bool(is_causal),
        _window(window_size_left),
        _window(window_size_right),
    )


def backward_arguments(
    head_dim: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    **other: Any,
) -> FlashgenArgs:
    """flashgen's backward arguments for a call of aten's flash backward operators."""
    _check_unknown("the flash backward", other)
    return FlashgenArgs(
        float(dropout_p),
        _scale(scale, head_dim),
        bool(is_causal),
        _window(window_size_left),
        _window(window_size_right),
    )


def pack_philox(seed: int, offset: int) -> Tensor:
    """flashgen's Philox (seed, offset) as the forward's `rng_state`: a (2,) uint64 CPU
    tensor (each stored two's-complement through an int64 view)."""
    words = [v - _U64 if v >= 2**63 else v for v in (seed % _U64, offset % _U64)]
    return torch.tensor(words, dtype=torch.int64).view(torch.uint64)


def unpack_philox(rng_state: Tensor) -> tuple[int, int]:
    """(seed, offset), as unsigned ints, from a `pack_philox` tensor (on any device)."""
    t = rng_state.detach()
    if t.dtype == torch.uint64:
        t = t.view(torch.int64)
    if t.numel() != 2 or t.dtype != torch.int64:
        raise _refuse(
            f"rng_state must be the (2,) uint64 tensor of flashgen's forward, got "
            f"{str(t.dtype).removeprefix('torch.')} {tuple(rng_state.shape)} (a forward run "
            "by another implementation cannot be differentiated with dropout here)"
        )
    seed, offset = t.cpu().tolist()
    return seed % _U64, offset % _U64


def registry_missing(version: str, has_registry: bool) -> Optional[str]:
    """The error message when the running torch has no FlashAttention registry, else None."""
    if has_registry:
        return None
    return (
        "flashgen.torch.sdpa_backend needs torch.nn.attention.register_flash_attention_impl, "
        f"added in PyTorch {REGISTRY_SINCE}; this is torch {version}: install torch>="
        f"{REGISTRY_SINCE}, or call flashgen.torch.flash_attn_func directly"
    )


# --------------------------------------------------------------------------------------------
# Running flashgen's operators on what the registry hands over
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _kernel_head_dim(t: Tensor, kind: KernelKind) -> int:
    """The head dim the kernels of `kind` run t's at (`selection.padded_head_dim`); t's own
    where the operator will refuse anyway (not CUDA, not float16/bfloat16), so that its
    message names the problem."""
    d = int(t.shape[-1])
    if t.device.type != "cuda" or t.dtype not in _HALF:
        return d
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return selection.padded_head_dim(d, _capability(index), (kind,))


def kernel_readable(shape, stride, storage_offset: int, itemsize: int) -> bool:
    """Whether the kernels read a tensor as it is: `selection.layout_ok` (unit last stride,
    the others multiples of 8 elements) and a first element on a 16-byte boundary."""
    return selection.layout_ok(tuple(stride)) and not selection.misaligned(
        tuple(shape), storage_offset, itemsize
    )


def _ready(t: Tensor, head_dim: int) -> Tensor:
    """t zero-padded to `head_dim` columns, and copied once into the contiguous layout when
    the kernels cannot read it."""
    if t.shape[-1] != head_dim:
        t = F.pad(t, (0, head_dim - t.shape[-1]))
    if not kernel_readable(t.shape, t.stride(), t.storage_offset(), t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _cpu_i64(value: int) -> Tensor:
    """A 0-dim int64 CPU tensor holding a uint64 (two's complement), as flashgen's ops take
    the Philox seed and offset."""
    value %= _U64
    return torch.tensor(value - _U64 if value >= 2**63 else value, dtype=torch.int64)


def _flashgen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, args: FlashgenArgs):
    """`torch.ops.flashgen.fwd` (the CPU tests replace this with a reference)."""
    from flashgen.torch import ops  # noqa: F401  (registers torch.ops.flashgen)

    return torch.ops.flashgen.fwd.default(q, k, v, cu_q, cu_k, max_q, max_k, *args, False)


def _flashgen_bwd(dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, args,
                  deterministic):  # fmt: skip
    """`torch.ops.flashgen.bwd` (the CPU tests replace this with a reference)."""
    from flashgen.torch import ops  # noqa: F401

    dq, dk, dv, _ = torch.ops.flashgen.bwd.default(
        dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, *args, deterministic
    )
    return dq, dk, dv


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, args: FlashgenArgs):
    """(out, lse, rng_state, unused) of flash-attn-layout q, k, v (dense or packed)."""
    if (
        args.dropout_p > 0.0
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    ):
        # rng_state is a host tensor here; flash_attn_func serves dropout under capture
        raise _refuse(
            "dropout_p > 0 under CUDA graph capture (rng_state is packed on the host; "
            "flashgen.torch.flash_attn_func serves dropout under capture)"
        )
    d = int(q.shape[-1])
    try:
        padded = _kernel_head_dim(q, KernelKind.FORWARD)
        qk, kk, vk = (_ready(t, padded) for t in (q, k, v))
        out, lse, seed, offset = _flashgen_fwd(qk, kk, vk, cu_q, cu_k, int(max_q), int(max_k), args)
    except UnsupportedCall as e:
        if str(e).startswith(_PREFIX):
            raise
        raise _refuse(str(e)) from e
    if out.shape[-1] != d:
        out = out[..., :d].contiguous()
    if args.dropout_p > 0.0:
        rng_state = pack_philox(int(seed), int(offset))
    else:
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    return out, lse, rng_state, unused


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, args: FlashgenArgs, rng_state):
    """(dq, dk, dv) in the caller's head dim."""
    d = int(q.shape[-1])
    seed, offset = unpack_philox(rng_state) if args.dropout_p > 0.0 else (0, 0)
    try:
        padded = _kernel_head_dim(q, KernelKind.BACKWARD)
        ready = [_ready(t, padded) for t in (dout, q, k, v, out)]
        dq, dk, dv = _flashgen_bwd(
            *ready,
            lse,
            _cpu_i64(seed),
            _cpu_i64(offset),
            cu_q,
            cu_k,
            int(max_q),
            int(max_k),
            args,
            torch.are_deterministic_algorithms_enabled(),
        )
    except UnsupportedCall as e:
        if str(e).startswith(_PREFIX):
            raise
        raise _refuse(str(e)) from e
    if padded != d:
        dq, dk, dv = (g[..., :d].contiguous() for g in (dq, dk, dv))
    return dq, dk, dv


def _like(t: Tensor, template: Tensor) -> Tensor:
    """t laid out as `torch.empty_like(template)` is: what aten's meta functions promise for
    these outputs and gradients (torch.compile checks it), and what the built-in kernels
    return. t itself when it is (e.g. q, k, v from a `(batch, seqlen, heads * d)`
    projection), else one copy."""
    want = torch.empty_like(template)
    if want.stride() == t.stride():
        return t
    return want.copy_(t)


def _empty_debug_mask(q: Tensor) -> Tensor:
    return torch.empty(0, dtype=q.dtype, device=q.device)


# The kernels registered for aten's operators. The dispatcher passes the arguments a caller
# gave (kwarg-only ones by name, those left at their defaults not at all), hence the defaults.
# Outputs and gradients are laid out as aten's meta functions say (`_like`).


# fmt: off
def _flash_forward(query, key, value, cum_seq_q=None, cum_seq_k=None, max_q=0, max_k=0,
                   dropout_p=0.0, is_causal=False, return_debug_mask=False, **kwargs):
    args = forward_arguments(query.shape[-1], dropout_p, is_causal, return_debug_mask, **kwargs)
    out, lse, rng_state, unused = _forward(query, key, value, cum_seq_q, cum_seq_k, max_q,
                                           max_k, args)
    return _like(out, query), lse, rng_state, unused, _empty_debug_mask(query)


def _flash_forward_inplace(out, query, key, value, cum_seq_q=None, cum_seq_k=None, max_q=0,
                           max_k=0, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                           **kwargs):
    result, lse, _, _, _ = _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q,
                                          max_k, dropout_p, is_causal, return_debug_mask,
                                          **kwargs)
    out.copy_(result)
    return lse


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q=None,
                    cum_seq_k=None, max_q=0, max_k=0, dropout_p=0.0, is_causal=False,
                    rng_state=None, unused=None, **kwargs):
    args = backward_arguments(query.shape[-1], dropout_p, is_causal, **kwargs)
    dq, dk, dv = _backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                           max_q, max_k, args, rng_state)
    return _like(dq, query), _like(dk, key), _like(dv, value)


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                  **kwargs):
    args = forward_arguments(query.shape[-1], dropout_p, is_causal, return_debug_mask, **kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, lse, rng_state, unused = _forward(q, k, v, None, None, q.shape[1], k.shape[1], args)
    return (_like(out.transpose(1, 2), query), lse, None, None, int(query.shape[2]),
            int(key.shape[2]), rng_state, unused, _empty_debug_mask(query))


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q=None,
                   cum_seq_k=None, max_q=0, max_k=0, dropout_p=0.0, is_causal=False,
                   philox_seed=None, philox_offset=None, **kwargs):
    args = backward_arguments(query.shape[-1], dropout_p, is_causal, **kwargs)
    dout, q, k, v, o = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
    dq, dk, dv = _backward(dout, q, k, v, o, logsumexp, None, None, q.shape[1], k.shape[1],
                           args, philox_seed)
    return (_like(dq.transpose(1, 2), query), _like(dk.transpose(1, 2), key),
            _like(dv.transpose(1, 2), value))
# fmt: on


_KERNELS = {
    "_flash_attention_forward": _flash_forward,
    "_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_flash_attention": _sdpa_forward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
    "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
}


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


@dataclass
class Handle:
    """What activation returns to torch's registry: the library holding the overrides.
    `remove()` drops it (the built-in kernels serve again)."""

    library: Any
    dispatch_key: str
    ops: tuple[str, ...] = field(default_factory=tuple)

    @property
    def live(self) -> bool:
        return self.library is not None

    def remove(self) -> None:
        global _ACTIVE
        lib, self.library = self.library, None
        if lib is not None:
            destroy = getattr(lib, "_destroy", None)
            if destroy is not None:
                destroy()
        if _ACTIVE is self:
            _ACTIVE = None


_ACTIVE: Optional[Handle] = None


def _present_ops() -> tuple[str, ...]:
    missing = [name for name in REQUIRED_OPS if not hasattr(torch.ops.aten, name)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no aten::{', aten::'.join(missing)}: "
            "flashgen.torch.sdpa_backend cannot override its FlashAttention operators"
        )
    return REQUIRED_OPS + tuple(n for n in OPTIONAL_OPS if hasattr(torch.ops.aten, n))


def _install(dispatch_key: str = "CUDA") -> Handle:
    """Override aten's flash operators for `dispatch_key` (the registry's register_fn; the
    CPU tests install on "CPU"). Idempotent while a handle is live."""
    global _ACTIVE
    if _ACTIVE is not None and _ACTIVE.live:
        if _ACTIVE.dispatch_key == dispatch_key:
            return _ACTIVE
        _ACTIVE.remove()
    ops = _present_ops()
    lib = torch.library.Library("aten", "IMPL", dispatch_key)
    with warnings.catch_warnings():  # torch says it overrides the built-in kernels: intended
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for name in ops:
            lib.impl(name, _KERNELS[name], dispatch_key)
    _ACTIVE = Handle(lib, dispatch_key, ops)
    return _ACTIVE


def _registry():
    import torch.nn.attention as attention

    message = registry_missing(
        torch.__version__, hasattr(attention, "register_flash_attention_impl")
    )
    if message is not None:
        raise RuntimeError(message)
    return attention


def register_sdpa_impl(name: str = NAME) -> str:
    """Register flashgen in torch's FlashAttention registry under `name` (nothing is
    activated: `torch.nn.attention.activate_flash_attention_impl(name)` or `activate()`
    does that). Returns the name. Raises RuntimeError naming the torch version needed when
    the running torch has no registry (before 2.10)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    _registry().register_flash_attention_impl(name, register_fn=_install)
    return name


def activate(name: str = NAME) -> None:
    """Register (as `register_sdpa_impl`) and activate flashgen: from now on, SDPA calls that
    its FLASH backend takes, and direct calls of aten's flash operators on CUDA tensors, run
    flashgen's kernels. Activating another implementation (or `deactivate()`) ends it."""
    attention = _registry()
    register_sdpa_impl(name)
    attention.activate_flash_attention_impl(name)
    # torch 2.10's registry skips the register_fn when it believes `name` is active already
    # (after a deactivate() it cannot record): install directly then.
    if not is_active():
        _install()


def deactivate() -> None:
    """Bring back PyTorch's built-in FlashAttention-2 (a no-op when flashgen is not active)."""
    import torch.nn.attention as attention

    restore = getattr(attention, "restore_flash_attention_impl", None)
    current = getattr(attention, "current_flash_attention_impl", lambda: None)()
    if restore is not None and current is not None and _ACTIVE is not None:
        restore()
    if _ACTIVE is not None:  # torch 2.10 has no restore: drop the overrides ourselves
        _ACTIVE.remove()


def is_active() -> bool:
    """Whether flashgen's overrides of aten's flash operators are installed."""
    return _ACTIVE is not None and _ACTIVE.live
