"""From a flash-attn style call to the one `KernelSpec` that serves it. Imports no torch.

The PyTorch op (`flashgen.torch.ops`) describes each call by plain values (dtype name, shapes,
strides, the device's compute capability, the mask arguments) and asks this module for the
forward and backward specs. Everything here is pure Python so it is tested without torch or a
GPU (tests/test_torch_select.py), and every refusal is an `UnsupportedCall` naming what is
wrong and what is supported: a call flashgen cannot serve never falls back to another kernel.

Mask arguments follow flash-attn 2.1+ (docs/conventions.md, "Masks"):

- `causal=True` is bottom-right aligned (key j visible from query i iff j <= i + Sk - Sq),
  which equals top-left when Sq == Sk;
- `window_size=(left, right)`, -1 unbounded, is bottom-right aligned as well; `causal=True`
  forces `right = 0` (flash-attn does the same);
- `(-1, -1)` is no window; `(-1, 0)` is exactly causal and uses the causal kernel; any other
  window uses a `mask.window` kernel with `mask.causal: none` (its runtime window then
  carries the causal bound).

Score-stage features (`generator.features`, one row each) come from the flash-attn argument
each row names (`Feature.torch_arg`): `softcap > 0` switches on `softcap`, `alibi_slopes` given
switches on `alibi`, `learnable_sink` given switches on `sink`. `score_features` validates
those arguments (described by plain values, as the tensors are) and returns the set of names
that goes into `AttentionCall.features` (and `kvcache_select.DecodeCall.features`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from flashgen.generator.families import family
from flashgen.generator.families.backward import HEAD_DIMS as BWD_HEAD_DIMS
from flashgen.generator.families.forward import HEAD_DIMS as FWD_HEAD_DIMS
from flashgen.generator.features import FEATURES
from flashgen.generator.spec import (
    FIELDS,
    Causal,
    Dtype,
    KernelKind,
    KernelSpec,
    SpecError,
    Target,
    build_spec,
)

__all__ = [
    "CAPABILITIES",
    "PREFERRED",
    "DTYPES",
    "MAX_HEAD_DIM",
    "NO_FEATURES",
    "SCORE_ARGS",
    "AttentionCall",
    "Problem",
    "TensorMeta",
    "UnsupportedCall",
    "backward_spec",
    "check_problem",
    "forward_spec",
    "head_dim_served",
    "layout_ok",
    "misaligned",
    "padded_head_dim",
    "resolve_mask",
    "score_features",
    "served_head_dims",
    "target_for",
]

SOURCE = "flashgen.torch"  # what a derived spec's `source` (and its banner) says

# Compute capability -> the target whose kernels run on it. Only exact matches: a GPU of
# another capability is refused, never served by a neighbour's PTX.
CAPABILITIES: dict[tuple[int, int], Target] = {
    (t.cc // 10, t.cc % 10): t for t in Target if not t.value.suffix
}
# torch dtype names (str(torch.float16) without "torch.") -> spec dtype.
DTYPES: dict[str, Dtype] = {"float16": Dtype.FP16, "bfloat16": Dtype.BF16}


class UnsupportedCall(ValueError):
    """flashgen cannot serve this call; the message says what is wrong and what is allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(f"flashgen.torch: {message}")


# --------------------------------------------------------------------------------------------
# Tensors, described without torch.
# --------------------------------------------------------------------------------------------


class TensorMeta(NamedTuple):
    """What the checks need of one tensor: shape, strides (elements), dtype name as torch
    spells it without the `torch.` prefix, and device type ('cuda', 'cpu', ...)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str


class Problem(NamedTuple):
    """One call's sizes. Dense: `seqlen_q`, `seqlen_k` are the tensors' lengths; varlen: the
    caller's `max_seqlen_q`, `max_seqlen_k` and `batch` is the number of sequences."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    varlen: bool
    dtype: Dtype
    head_dim_v: int | None = None  # v's (and out's) head dim when it is not q's and k's

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads

    @property
    def d_v(self) -> int:
        """v's head dim (`head_dim_v`, else `head_dim`)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def _dtype(name: str, what: str) -> Dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedCall(
            f"{what} has dtype {name}; flashgen kernels take float16 or bfloat16 "
            "(cast with .half() or .bfloat16(), e.g. under torch.autocast)"
        ) from None


def check_problem(
    q: TensorMeta,
    k: TensorMeta,
    v: TensorMeta,
    *,
    cu_seqlens_q: TensorMeta | None = None,
    cu_seqlens_k: TensorMeta | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    extra: Sequence[tuple[str, TensorMeta, str]] = (),
) -> Problem:
    """Validate the tensors of one call and return its sizes.

    Dense: q `(batch, seqlen_q, heads, d)`, k `(batch, seqlen_k, kv_heads, d)`, v the same
    with its own head dim d_v (`Problem.head_dim_v`; d_v = d in most calls).
    Varlen (cu_seqlens given): q `(total_q, heads, d)`, k `(total_k, kv_heads, d)`, v likewise,
    int32 `cu_seqlens_q/k` of `batch + 1` entries on the same device. The last dimension must
    have stride 1 and every other stride must be a multiple of 8 elements (16 bytes: the
    kernels load 8-element vectors). `extra` adds `(name, meta, like)` tensors that must
    have the shape of `like` ('q', 'k', or 'o': q's with v's head dim, the backward's out
    and dout) under the same rules.
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise UnsupportedCall("varlen needs both cu_seqlens_q and cu_seqlens_k")
    named = [("q", q), ("k", k), ("v", v)] + [(n, m) for n, m, _ in extra]
    for name, t in named:
        if t.device != "cuda":
            raise UnsupportedCall(
                f"{name} is on device {t.device!r}; flashgen kernels run on CUDA devices only "
                "(move the tensors with .cuda())"
            )
    dt = _dtype(q.dtype, "q")
    for name, t in named[1:]:
        if t.dtype != q.dtype:
            raise UnsupportedCall(f"{name} has dtype {t.dtype} but q has {q.dtype}; all must match")
    ndim = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in named:
        if len(t.shape) != ndim:
            raise UnsupportedCall(
                f"{name} has {len(t.shape)} dimensions {tuple(t.shape)}; "
                f"{'varlen' if varlen else 'flash_attn_func'} takes {layout}"
            )
        if t.stride[-1] != 1:
            raise UnsupportedCall(
                f"{name}'s last dimension (head_dim) has stride {t.stride[-1]}; it must be "
                "contiguous (stride 1): pass .contiguous()"
            )
        if any(s % 8 for s in t.stride[:-1]):
            raise UnsupportedCall(
                f"{name} has strides {tuple(t.stride)}; every stride but the last must be a "
                "multiple of 8 elements (16 bytes): pass .contiguous()"
            )
    d = q.shape[-1]
    if k.shape[:-1] != v.shape[:-1]:
        raise UnsupportedCall(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape but for the "
            "last dimension (v's head_dim may differ from q's and k's)"
        )
    d_v = v.shape[-1]
    if k.shape[-1] != d:
        raise UnsupportedCall(f"q's head_dim {d} differs from k's {k.shape[-1]}; they must match")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads < 1 or heads < 1 or heads % kv_heads:
        raise UnsupportedCall(
            f"q has {heads} heads and k, v have {kv_heads}: the number of k/v heads must "
            "divide the number of query heads (GQA/MQA)"
        )
    o_shape = tuple(q.shape[:-1]) + (d_v,)
    for name, t, like in extra:
        want = {"q": tuple(q.shape), "k": tuple(k.shape), "o": o_shape}[like]
        if tuple(t.shape) != want:
            what = "q's shape with v's head_dim" if like == "o" else f"{like}'s shape"
            raise UnsupportedCall(f"{name} has shape {tuple(t.shape)}; it must have {what} {want}")
    dv = None if d_v == d else d_v
    if varlen:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if t.device != "cuda" or t.dtype != "int32" or len(t.shape) != 1 or t.stride != (1,):
                raise UnsupportedCall(
                    f"{name} must be a contiguous 1-D int32 CUDA tensor of batch + 1 "
                    f"cumulative lengths; got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
            raise UnsupportedCall(
                f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                f"{tuple(cu_seqlens_k.shape)} must both hold batch + 1 >= 1 entries"
            )
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is None or m < 0:
                raise UnsupportedCall(f"{name} must be an int >= 0 (the longest sequence), got {m}")
        return Problem(
            cu_seqlens_q.shape[0] - 1, heads, kv_heads, max_seqlen_q, max_seqlen_k, d, True, dt, dv
        )
    if k.shape[0] != q.shape[0]:
        raise UnsupportedCall(f"q has batch {q.shape[0]} but k, v have {k.shape[0]}")
    return Problem(q.shape[0], heads, kv_heads, q.shape[1], k.shape[1], d, False, dt, dv)


# --------------------------------------------------------------------------------------------
# Score-stage features: the flash-attn arguments -> the spec's `features`.
# --------------------------------------------------------------------------------------------

# The flash-attn arguments of the score-stage features, in registry order (generator.features:
# the order of their parameter rows and kernel-name parts).
SCORE_ARGS: tuple[str, ...] = tuple(f.torch_arg for f in FEATURES)
NO_FEATURES: frozenset[str] = frozenset()


def _softcap_on(value: Any, batch: int, heads: int) -> bool:  # noqa: ARG001
    """flash-attn's `softcap`: 0.0 (the default) is off, c > 0 caps scores to c * tanh(s / c)."""
    if value is None:
        return False
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise UnsupportedCall(
            f"softcap must be a float (0.0: off, c > 0: scores become c * tanh(s / c)), got "
            f"{type(value).__name__}"
        )
    if not (0.0 <= value < math.inf):  # also refuses NaN
        raise UnsupportedCall(
            f"softcap={value}: allowed 0.0 (off) or a finite c > 0 (scores become c * tanh(s / c))"
        )
    return bool(value > 0.0)


def _check_fp32_vector(
    name: str, t: Any, shapes: Sequence[tuple[str, tuple[int, ...]]], what: str
) -> None:
    """`name` is a float32 CUDA tensor of one of `shapes` ((spelling, shape) pairs) with a
    contiguous last dimension; `what` says what it holds."""
    if not isinstance(t, TensorMeta):
        raise UnsupportedCall(f"{name} must be a float32 tensor ({what}) or None, got "
                              f"{type(t).__name__}")  # fmt: skip
    if t.device != "cuda":
        raise UnsupportedCall(
            f"{name} is on device {t.device!r}; it must be a float32 tensor on q's CUDA device"
        )
    if t.dtype != "float32":
        raise UnsupportedCall(f"{name} has dtype {t.dtype}; it must be float32 ({what})")
    if tuple(t.shape) not in [shape for _, shape in shapes]:
        allowed = " or ".join(f"{spelled} = {shape}" for spelled, shape in shapes)
        raise UnsupportedCall(f"{name} has shape {tuple(t.shape)}; it must be {allowed} ({what})")
    if t.shape[-1] > 1 and t.stride[-1] != 1:
        raise UnsupportedCall(
            f"{name}'s last dimension has stride {t.stride[-1]}; it must be contiguous "
            "(stride 1): pass .contiguous()"
        )


def _alibi_on(t: TensorMeta | None, batch: int, heads: int) -> bool:
    """flash-attn's `alibi_slopes`: float32 `(nheads,)` or `(batch, nheads)`, on q's device."""
    if t is None:
        return False
    shapes = [("(nheads,)", (heads,)), ("(batch, nheads)", (batch, heads))]
    _check_fp32_vector("alibi_slopes", t, shapes, "the slopes of the ALiBi bias")
    return True


def _sink_on(t: TensorMeta | None, batch: int, heads: int) -> bool:  # noqa: ARG001
    """FlashAttention-4's `learnable_sink`: float32 `(nheads,)`, one logit per query head."""
    if t is None:
        return False
    shapes = [("(nheads,)", (heads,))]
    _check_fp32_vector("learnable_sink", t, shapes, "one natural-log sink logit per query head")
    return True


# torch_arg -> (value, batch, heads) -> whether the feature is on; raises UnsupportedCall on a
# value flashgen cannot serve. One entry per feature of generator.features.
_SCORE_CHECKS: dict[str, Callable[[Any, int, int], bool]] = {
    "softcap": _softcap_on,
    "alibi_slopes": _alibi_on,
    "learnable_sink": _sink_on,
}
if set(_SCORE_CHECKS) != set(SCORE_ARGS):  # a new feature row needs its argument check here
    raise ImportError(
        f"flashgen.torch.selection checks the arguments {sorted(_SCORE_CHECKS)} but the "
        f"score-stage features take {sorted(SCORE_ARGS)}"
    )


@lru_cache(maxsize=None)
def _feature_set(names: tuple[str, ...]) -> frozenset[str]:
    """One frozenset object per combination (its hash is computed once)."""
    return frozenset(names) if names else NO_FEATURES


def score_features(args: Mapping[str, Any], *, batch: int, heads: int) -> frozenset[str]:
    """The score-stage features (generator.features names) a call's flash-attn arguments switch
    on. `args`: torch_arg -> value (`softcap` a float; `alibi_slopes`, `learnable_sink` a
    TensorMeta or None); a missing argument is off. `batch` is the number of sequences and
    `heads` the number of query heads (the slopes' and sinks' shapes). A value no kernel takes
    is an UnsupportedCall naming the argument and what is allowed."""
    on = tuple(
        f.name for f in FEATURES if _SCORE_CHECKS[f.torch_arg](args.get(f.torch_arg), batch, heads)
    )
    return _feature_set(on)


# --------------------------------------------------------------------------------------------
# The call -> spec.
# --------------------------------------------------------------------------------------------


def resolve_mask(causal: bool, window_size: Sequence[int]) -> tuple[Causal, bool, tuple[int, int]]:
    """flash-attn's `(causal, window_size)` as `(spec causal, spec window, runtime window)`
    (see the module docstring)."""
    if not isinstance(causal, bool):
        raise UnsupportedCall(f"causal must be True or False, got {causal!r}")
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise UnsupportedCall(
            f"window_size must be a pair of ints (left, right), got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise UnsupportedCall(
            f"window_size {(left, right)}: each side must be >= 0, or -1 for unbounded"
        )
    if causal:
        right = 0
    if left < 0 and right < 0:
        return Causal.NONE, False, (-1, -1)
    if left < 0 and right == 0:
        return Causal.BOTTOM_RIGHT, False, (-1, -1)
    return Causal.NONE, True, (left, right)


def target_for(capability: Sequence[int]) -> Target:
    """The target of a GPU of this compute capability (major, minor)."""
    cap = tuple(int(x) for x in capability)
    target = CAPABILITIES.get(cap)  # type: ignore[arg-type]
    if target is None:
        have = ", ".join(f"{a}.{b} ({t.yaml})" for (a, b), t in CAPABILITIES.items())
        raise UnsupportedCall(
            f"no flashgen target for a GPU of compute capability {cap[0]}.{cap[1]} "
            f"(supported: {have})"
        )
    return target


# Kinds with a faster architecture-specific family on some capability: tried first there,
# and used when that family serves the call (generator/families/forward_sm90.py and
# backward_sm90.py name what they do not take, e.g. the backward's varlen, dropout and
# head dims above 128); otherwise the portable family of `target_for` serves it.
PREFERRED: dict[tuple[KernelKind, tuple[int, int]], Target] = {
    (KernelKind.FORWARD, (9, 0)): Target.SM90A,
    (KernelKind.BACKWARD, (9, 0)): Target.SM90A,
}


@dataclass(frozen=True)
class AttentionCall:
    """Everything about a call that selects a kernel (sizes and pointers do not).

    `deterministic` only concerns the backward (bitwise repeatable dQ, dK, dV). `features`:
    the score-stage features that are on (`score_features`). `score_mod`: the UserMod of a
    `compile_variant` call (its kernels are the spec's expression compiled into the family
    this selection picks), None for every other call.
    """

    dtype: Dtype
    head_dim: int
    capability: tuple[int, int]
    causal: Causal = Causal.NONE
    window: bool = False
    varlen: bool = False
    gqa: bool = False
    dropout: bool = False
    deterministic: bool = False
    features: frozenset[str] = NO_FEATURES
    # a user-defined score modifier (generator.usermod.UserMod; `compile_variant`), or None
    score_mod: Any = None
    # v's head dim when it is not `head_dim` (the spec's head_dim_v), else None
    head_dim_v: int | None = None


def _head_dims(dims: Sequence[int]) -> str:
    """`16, 32, ..., 256` style list."""
    return ", ".join(map(str, dims))


@lru_cache(maxsize=None)
def _spec(kind: KernelKind, call: AttentionCall) -> KernelSpec:
    preferred = PREFERRED.get((kind, tuple(call.capability)))
    if preferred is not None:
        try:
            return _spec_for(kind, call, preferred)
        except UnsupportedCall:
            pass  # e.g. a dropout backward on sm_90a: the portable family of this GPU serves it
    return _spec_for(kind, call, target_for(call.capability))


def _spec_for(kind: KernelKind, call: AttentionCall, target: Target) -> KernelSpec:
    fam = family(kind, target)
    if call.head_dim_v is not None and not fam.head_dim_ok(call.head_dim_v):
        raise UnsupportedCall(
            f"v's head_dim {call.head_dim_v} has no {kind.yaml} kernel (allowed: multiples of "
            f"8 in 8..256 for v's head_dim when it differs from q's {call.head_dim})"
        )
    if not fam.head_dim_ok(call.head_dim):
        dims = FWD_HEAD_DIMS if kind is KernelKind.FORWARD else BWD_HEAD_DIMS
        hint = ""
        if kind is KernelKind.BACKWARD:
            hint = (
                " (flash_attn_func and flash_attn_varlen_func zero-pad such a head dim to "
                "the next one both kinds serve; for inference only, call the operator under "
                f"torch.no_grad(): the forward serves head dims {_head_dims(FWD_HEAD_DIMS)})"
            )
        raise UnsupportedCall(
            f"head_dim {call.head_dim} has no {kind.yaml} kernel (supported head dims: "
            f"{_head_dims(dims)}){hint}"
        )
    return auto_spec(
        kind,
        target,
        {
            "head_dim": call.head_dim,
            **({"head_dim_v": call.head_dim_v} if call.head_dim_v is not None else {}),
            "dtype": call.dtype,
            "mask.causal": call.causal,
            "mask.window": call.window,
            "mask.varlen": call.varlen,
            "gqa": call.gqa,
            "dropout": call.dropout,
            "deterministic": call.deterministic and kind is KernelKind.BACKWARD,
            **{f.name: f.name in call.features for f in FEATURES},
            **({"score_mod": call.score_mod} if call.score_mod is not None else {}),
        },
    )


def auto_spec(kind: KernelKind, target: Target, fields: dict[str, Any]) -> KernelSpec:
    """The validated spec of `kind` for `target` with `fields` (spec paths) over the field
    defaults and the family's auto tile; a spec the rules refuse is an UnsupportedCall that
    says why. (The decode entry point, kvcache_select, builds its specs here too.)"""
    fam = family(kind, target)
    values: dict[str, Any] = {f.path: f.default for f in FIELDS}
    values.update(fields)
    values.update({"kernel": kind, "target": target})
    try:
        values["tile"] = fam.auto_tile_of(values)
        return build_spec(values, tile_auto=True, source=SOURCE)
    except SpecError as e:
        raise UnsupportedCall(f"no {kind.yaml} kernel can be built for this call: {e}") from None


def forward_spec(call: AttentionCall) -> KernelSpec:
    """The forward kernel of this call (auto tile for the call's target)."""
    return _spec(KernelKind.FORWARD, call)


def backward_spec(call: AttentionCall) -> KernelSpec:
    """The backward kernel of this call (auto tile for the call's target)."""
    return _spec(KernelKind.BACKWARD, call)


# --------------------------------------------------------------------------------------------
# Head dims without a kernel: zero-padded to the next served one (flash-attn's approach).
# --------------------------------------------------------------------------------------------

MAX_HEAD_DIM = 256  # the largest head dim flashgen.torch takes (flash-attn's bound too)


def head_dim_served(kind: KernelKind, capability: Sequence[int], head_dim: int) -> bool:
    """Whether a family the selection consults for `kind` on a GPU of this capability (the
    PREFERRED one, then the portable one of `target_for`, as `_spec` tries them) serves
    `head_dim`. An unsupported capability is the UnsupportedCall of `target_for`."""
    cap = tuple(int(x) for x in capability)
    portable = target_for(cap)
    preferred = PREFERRED.get((kind, cap))  # type: ignore[call-overload]
    if preferred is not None and family(kind, preferred).head_dim_ok(head_dim):
        return True
    return family(kind, portable).head_dim_ok(head_dim)


def served_head_dims(capability: Sequence[int], kinds: Sequence[KernelKind]) -> tuple[int, ...]:
    """The head dims in 1..MAX_HEAD_DIM that every kind of `kinds` serves on this GPU."""
    return tuple(
        d
        for d in range(1, MAX_HEAD_DIM + 1)
        if all(head_dim_served(kind, capability, d) for kind in kinds)
    )


def _kinds_text(kinds: Sequence[KernelKind]) -> str:
    return " and ".join(kind.yaml for kind in kinds)


@lru_cache(maxsize=None)
def padded_head_dim(
    head_dim: int,
    capability: tuple[int, int],
    kinds: tuple[KernelKind, ...],
    what: str | None = None,
) -> int:
    """The head dim the kernels of `kinds` run a call at whose q (and k, v, caches) have
    `head_dim`: `head_dim` itself when every kind serves it on this GPU, else the smallest
    larger one they all serve, searched upward in steps of 1 up to MAX_HEAD_DIM (so the
    answer follows the families when they serve more head dims). The caller zero-pads the
    last dimension to it and slices outputs and gradients back: zeros add nothing to q . k
    and give zero output columns, and the softmax scale stays the caller's (default
    1 / sqrt(head_dim) of the unpadded head dim).

    `kinds`: (FORWARD,) for a call without gradients, (FORWARD, BACKWARD) when the backward
    will run (both must run at one head dim: the backward reads the forward's output), or
    (DECODE,). `what` names the kernels in messages (default: the kinds). Raises
    UnsupportedCall for a head dim outside 1..MAX_HEAD_DIM, or one that no served head dim
    >= it covers, naming the value and what is allowed."""
    name = what or _kinds_text(kinds)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise UnsupportedCall(f"head_dim must be an int, got {type(head_dim).__name__}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        dims = _head_dims(served_head_dims(capability, kinds))
        raise UnsupportedCall(
            f"head_dim {head_dim}: allowed 1..{MAX_HEAD_DIM} (the last dimension of q, k and "
            f"v; {name} kernels serve head dims {dims}, and any other head dim up to "
            f"{MAX_HEAD_DIM} is zero-padded to the next of those)"
        )
    for d in range(head_dim, MAX_HEAD_DIM + 1):
        if all(head_dim_served(kind, capability, d) for kind in kinds):
            return d
    dims = _head_dims(served_head_dims(capability, kinds))
    raise UnsupportedCall(
        f"head_dim {head_dim} has no {name} kernel, nor has any head dim from {head_dim} to "
        f"{MAX_HEAD_DIM} it could be zero-padded to ({name} kernels serve head dims "
        f"{dims or 'none'})"
    )


# --------------------------------------------------------------------------------------------
# Layouts the kernels cannot read: the Python layer copies such tensors once.
# --------------------------------------------------------------------------------------------

VECTOR_BYTES = 16  # the kernels load 16-byte vectors: 8 float16/bfloat16 elements


def layout_ok(stride: Sequence[int]) -> bool:
    """check_problem's layout rule as a predicate: the last dimension has stride 1 and every
    other stride is a multiple of 8 elements. (Plain loops, no strings: torch.compile traces
    it with symbolic sizes.)"""
    if len(stride) == 0 or stride[-1] != 1:
        return False
    for s in stride[:-1]:
        if s % 8 != 0:
            return False
    return True


def misaligned(shape: Sequence[int], storage_offset: int, itemsize: int = 2) -> bool:
    """Whether a tensor with elements starts off a 16-byte boundary of its storage (a view
    that begins mid-vector, e.g. `x[..., 3:67]`): the ops refuse such a data pointer. The
    storage itself is taken as aligned (torch's allocators align far more)."""
    for n in shape:
        if n == 0:
            return False
    return (storage_offset * itemsize) % VECTOR_BYTES != 0
