"""Block classification of mask_mod trees (FlexAttention's BlockMask idea): is a mask true on
every element of a tile (FULL: the kernel skips the mask), false on every one (EMPTY: the
kernel skips the tile) or neither (PARTIAL: the kernel evaluates the mask per element)?

The answer comes from interval arithmetic over the tree: ints as intervals (exact integer
bounds, unbounded ends as +-inf), floats as intervals with a "may be NaN" flag, bools as
three-valued logic (may be true, may be false). It is sound: every node's interval holds
every value the node takes on the tile, in float64 (the reference) and in float32 (the
kernel), so FULL and EMPTY are never wrong; PARTIAL may be said of a tile that is really full
or empty, because intervals forget correlations (`i - i` is [i0 - i1, i1 - i0]).

Float intervals are widened after each operation (relative 2^-20 for arithmetic and
conversions, 2^-12 with an absolute 2^-18 for exp, log and tanh, whose fast device versions
are approximate), turn infinite beyond float32's range, and hold 0 wherever a float32
subnormal could be flushed. Int intervals that leave int64 become unbounded (numpy wraps).

The examples of `examples.py` (causal, sliding window, chunked, prefix-LM, document masks)
are classified exactly on every tile when their parameters are given: intervals of
differences of independent indices are exact, and a conjunction (disjunction) of exact
conditions is exactly full or empty when one of its sides is.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .tree import (
    FLOAT32_MAX,
    KIND_INFO,
    Binary,
    Call,
    Const,
    Expr,
    Param,
    Type,
    Unary,
    UserModError,
    Var,
)

__all__ = ["Block", "Interval", "block_map", "bounds", "classify_block", "node_bounds"]

INF = math.inf
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_FLT_MIN = 2.0**-126  # the smallest normal float32
_ARITH = (2.0**-20, 2.0**-120)  # (relative, absolute) widening of arithmetic
_TRANS = (2.0**-12, 2.0**-18)  # ... of exp, log, tanh


class Block(enum.IntEnum):
    """A tile's class under a mask: EMPTY (false everywhere), PARTIAL, FULL (true
    everywhere)."""

    EMPTY = 0
    PARTIAL = 1
    FULL = 2


@dataclass(frozen=True)
class Interval:
    """Inclusive bounds `[lo, hi]` (ints or floats; +-inf for unbounded ends) and, for
    floats, whether the value may also be NaN."""

    lo: float
    hi: float
    nan: bool = False

    def __post_init__(self) -> None:
        if not self.lo <= self.hi:
            raise ValueError(f"an interval needs lo <= hi, got [{self.lo}, {self.hi}]")


@dataclass(frozen=True)
class _Tri:
    """A bool's possible values."""

    true: bool
    false: bool


_TOP = Interval(-INF, INF)
_TOP_NAN = Interval(-INF, INF, True)
_UNKNOWN = _Tri(True, True)


def _hull(parts: Sequence[Interval]) -> Interval:
    return Interval(min(p.lo for p in parts), max(p.hi for p in parts), any(p.nan for p in parts))


# ---------------------------------------------------------------------------------------------
# ints
# ---------------------------------------------------------------------------------------------


def _ints(lo: float, hi: float) -> Interval:
    """An int interval; bounds beyond int64 (where numpy wraps) make it unbounded."""
    if lo < _INT64_MIN or hi > _INT64_MAX:
        return _TOP
    return Interval(lo, hi)


def _finite(a: Interval) -> bool:
    return math.isfinite(a.lo) and math.isfinite(a.hi)


def _mul_bound(x: float, y: float) -> float:
    return 0 if x == 0 or y == 0 else x * y  # 0 * inf = 0: a bound, not a value


def _i_mul(a: Interval, b: Interval) -> Interval:
    c = [_mul_bound(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return _ints(min(c), max(c))


def _i_floordiv(a: Interval, b: Interval) -> Interval:
    if not (_finite(a) and _finite(b)):
        return _TOP
    parts = [Interval(0, 0)] if b.lo <= 0 <= b.hi else []
    for lo, hi in ((b.lo, min(b.hi, -1)), (max(b.lo, 1), b.hi)):
        if lo <= hi:  # one sign of divisor: floor(x / y) is monotone in x and in y
            c = [int(x) // int(y) for x in (a.lo, a.hi) for y in (lo, hi)]
            parts.append(Interval(min(c), max(c)))
    out = _hull(parts)
    return _ints(out.lo, out.hi)


def _i_mod(a: Interval, b: Interval) -> Interval:
    parts = [Interval(0, 0)] if b.lo <= 0 <= b.hi else []
    lo, hi = max(b.lo, 1), b.hi  # positive divisors: remainders in [0, c)
    if lo <= hi:
        if lo == hi and _finite(a) and a.lo // lo == a.hi // lo:
            parts.append(Interval(int(a.lo) % int(lo), int(a.hi) % int(lo)))
        elif a.lo >= 0 and a.hi < lo:
            parts.append(a)
        else:
            top = hi - 1 if a.lo < 0 else min(hi - 1, a.hi)
            parts.append(Interval(0, top))
    lo, hi = b.lo, min(b.hi, -1)  # negative divisors: remainders in (c, 0]
    if lo <= hi:
        if lo == hi and _finite(a) and a.lo // lo == a.hi // lo:
            parts.append(Interval(int(a.lo) % int(lo), int(a.hi) % int(lo)))
        elif a.hi <= 0 and a.lo > hi:
            parts.append(a)
        else:
            bottom = lo + 1 if a.hi > 0 else max(lo + 1, a.lo)
            parts.append(Interval(bottom, 0))
    return _hull(parts)


def _clamp_int32(x: float) -> int:
    return int(min(max(x, _INT32_MIN), _INT32_MAX))


# ---------------------------------------------------------------------------------------------
# floats
# ---------------------------------------------------------------------------------------------


def _widen(lo: float, hi: float, nan: bool, how: tuple[float, float] = _ARITH) -> Interval:
    """A float interval holding `[lo, hi]` after rounding: widened by `how` (relative,
    absolute), infinite past float32's range; NaN bounds (inf - inf) give everything."""
    if math.isnan(lo) or math.isnan(hi):
        return _TOP_NAN
    rel, ab = how
    if math.isfinite(lo):
        lo -= abs(lo) * rel + ab
    if math.isfinite(hi):
        hi += abs(hi) * rel + ab
    if lo < -FLOAT32_MAX:
        lo = -INF
    if hi > FLOAT32_MAX:
        hi = INF
    return Interval(lo, hi, nan)


def _exact_float(lo: float, hi: float, nan: bool = False) -> Interval:
    """A float input (a literal, a parameter): its float64 and float32 values, and 0 where
    float32 would hold a subnormal (which the device may flush)."""
    lo32, hi32 = float(np.float32(lo)), float(np.float32(hi))
    lo, hi = min(lo, lo32), max(hi, hi32)
    if -_FLT_MIN < lo < _FLT_MIN:
        lo = min(lo, 0.0)
    if -_FLT_MIN < hi < _FLT_MIN:
        hi = max(hi, 0.0)
    return Interval(lo, hi, nan)


def _to_float(a: Interval) -> Interval:
    return _widen(float(a.lo), float(a.hi), a.nan)


def _f_add(a: Interval, b: Interval) -> Interval:
    nan = a.nan or b.nan or (a.hi == INF and b.lo == -INF) or (a.lo == -INF and b.hi == INF)
    lo, hi = a.lo + b.lo, a.hi + b.hi
    return _widen(-INF if math.isnan(lo) else lo, INF if math.isnan(hi) else hi, nan)


def _neg(a: Interval) -> Interval:
    return Interval(-a.hi, -a.lo, a.nan)


def _has_zero(a: Interval) -> bool:
    return a.lo <= 0 <= a.hi


def _has_inf(a: Interval) -> bool:
    return a.lo == -INF or a.hi == INF


def _f_mul(a: Interval, b: Interval) -> Interval:
    nan = a.nan or b.nan or (_has_zero(a) and _has_inf(b)) or (_has_zero(b) and _has_inf(a))
    c = [_mul_bound(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return _widen(min(c), max(c), nan)


def _f_div(a: Interval, b: Interval) -> Interval:
    if _has_zero(b):
        return _TOP_NAN
    c = [x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    if any(math.isnan(x) for x in c):  # inf / inf
        return _TOP_NAN
    return _widen(min(c), max(c), a.nan or b.nan)


def _exp(x: float) -> float:
    return 0.0 if x == -INF else INF if x > 709.0 else math.exp(x)


def _log(x: float) -> float:
    return -INF if x <= 0 else math.log(x)


def _f_call(f: str, a: Interval) -> Interval:
    if f == "exp":
        out = _widen(_exp(a.lo), _exp(a.hi), a.nan, _TRANS)
        return Interval(max(out.lo, 0.0), out.hi, out.nan)
    if f == "log":
        if a.hi < 0:
            return _TOP_NAN
        return _widen(_log(a.lo), _log(a.hi), a.nan or a.lo < 0, _TRANS)
    out = _widen(math.tanh(a.lo), math.tanh(a.hi), a.nan, _TRANS)
    return Interval(max(out.lo, -1.0), min(out.hi, 1.0), out.nan)


def _abs(a: Interval) -> Interval:
    if a.lo >= 0:
        return a
    if a.hi <= 0:
        return _neg(a)
    return Interval(0, max(-a.lo, a.hi), a.nan)


def _minmax(f: str, a: Interval, b: Interval) -> Interval:
    pick = min if f == "min" else max
    parts = [Interval(pick(a.lo, b.lo), pick(a.hi, b.hi))]
    if a.nan:  # fminf / fmaxf return the other operand
        parts.append(Interval(b.lo, b.hi))
    if b.nan:
        parts.append(Interval(a.lo, a.hi))
    out = _hull(parts)
    return Interval(out.lo, out.hi, a.nan and b.nan)


def _floor_bound(x: float) -> int:
    if x == -INF:
        return _INT32_MIN
    if x == INF:
        return _INT32_MAX
    return _clamp_int32(math.floor(x))


def _floor(a: Interval) -> Interval:
    lo, hi = _floor_bound(a.lo), _floor_bound(a.hi)
    if a.nan:  # floor(NaN) = 0
        lo, hi = min(lo, 0), max(hi, 0)
    return Interval(lo, hi)


# ---------------------------------------------------------------------------------------------
# comparisons and logic
# ---------------------------------------------------------------------------------------------


def _compare(op: str, a: Interval, b: Interval) -> _Tri:
    if op in (">", ">="):
        op, a, b = {">": "<", ">=": "<="}[op], b, a
    if op == "<":
        t, f = not a.lo >= b.hi, not a.hi < b.lo
    elif op == "<=":
        t, f = not a.lo > b.hi, not a.hi <= b.lo
    else:  # == and !=
        same = a.lo == a.hi == b.lo == b.hi
        apart = a.hi < b.lo or b.hi < a.lo
        t, f = not apart, not same
        if op == "!=":
            t, f = f, t
    if a.nan or b.nan:  # NaN compares false, except with !=
        if op == "!=":
            t = True
        else:
            f = True
    return _Tri(t, f)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def _range_input(value: Any, name: str) -> Interval:
    """A variable's bounds from None (unknown), an int, a range, an (lo, hi) pair or an
    Interval (inclusive)."""
    if value is None:
        return _TOP
    if isinstance(value, Interval):
        return value
    if isinstance(value, range):
        if value.step != 1 or len(value) == 0:
            raise ValueError(f"{name}: a range must be non-empty with step 1, got {value}")
        return Interval(value.start, value.stop - 1)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return Interval(int(value), int(value))
    if isinstance(value, tuple) and len(value) == 2:
        return Interval(*value)
    raise ValueError(
        f"{name}: give an int, a range, an inclusive (lo, hi) pair, an Interval or None, "
        f"got {value!r}"
    )


class _Bounder:
    def __init__(self, variables: Mapping[str, Interval], params: Mapping[str, Any]) -> None:
        self.vars = variables
        self.params = params

    def __call__(self, node: Expr) -> Interval | _Tri:
        if isinstance(node, Const):
            if node.type is Type.BOOL:
                return _Tri(node.value, not node.value)
            if node.type is Type.INT:
                return Interval(node.value, node.value)
            return _exact_float(node.value, node.value)
        if isinstance(node, Var):
            if node.name == "s":
                raise UserModError("a mask_mod cannot read the score s", node.col)
            return self.vars.get(node.name, _TOP)
        if isinstance(node, Param):
            return self.param(node)
        if isinstance(node, Unary):
            a = self(node.arg)
            if node.op == "not":
                return _Tri(a.false, a.true)
            return _neg(a) if node.type is Type.FLOAT else _ints(-a.hi, -a.lo)
        if isinstance(node, Binary):
            return self.binary(node)
        if isinstance(node, Call):
            return self.call(node)
        raise TypeError(f"not an expression node: {node!r}")

    def num(self, node: Expr, as_float: bool) -> Interval:
        a = self(node)
        return _to_float(a) if as_float and node.type is Type.INT else a

    def param(self, node: Param) -> Interval:
        info = KIND_INFO[node.kind]
        is_float = info.type is Type.FLOAT
        value = self.params.get(node.name)
        if value is None:  # unknown: any value (a float parameter is assumed not NaN)
            return _TOP
        if isinstance(value, Interval):
            iv = value
        elif isinstance(value, tuple):
            iv = Interval(*value)
        elif np.ndim(value) == 0:
            v = float(value) if is_float else int(value)
            iv = Interval(v, v)
        else:
            return self._array_bounds(node, np.asarray(value), is_float)
        return _exact_float(iv.lo, iv.hi, iv.nan) if is_float else iv

    def _array_bounds(self, node: Param, arr: np.ndarray, is_float: bool) -> Interval:
        block = arr[self._slice(self(node.index[0]), arr.shape[0])]
        if KIND_INFO[node.kind].column:
            block = block[:, self._slice(self(node.index[1]), arr.shape[1])]
        if not is_float:
            return Interval(int(block.min()), int(block.max()))
        block = block.astype(np.float64)
        nan = np.isnan(block)
        if nan.all():
            return _TOP_NAN
        vals = block[~nan]
        return _exact_float(float(vals.min()), float(vals.max()), bool(nan.any()))

    @staticmethod
    def _slice(index: Interval, n: int) -> slice:
        """The rows an index in `index` reads (clamped: tables clamp their columns, and other
        indices are in range on valid inputs)."""
        lo = 0 if index.lo == -INF else int(min(max(index.lo, 0), n - 1))
        hi = n - 1 if index.hi == INF else int(min(max(index.hi, 0), n - 1))
        return slice(lo, hi + 1)

    def binary(self, node: Binary) -> Interval | _Tri:
        op = node.op
        if op in ("and", "or"):
            a, b = self(node.left), self(node.right)
            if op == "and":
                return _Tri(a.true and b.true, a.false or b.false)
            return _Tri(a.true or b.true, a.false and b.false)
        mixed = not (node.left.type is Type.INT and node.right.type is Type.INT) or op == "/"
        a, b = self.num(node.left, mixed), self.num(node.right, mixed)
        if op in ("<", "<=", ">", ">=", "==", "!="):
            return _compare(op, a, b)
        if op == "//":
            return _i_floordiv(a, b)
        if op == "%":
            return _i_mod(a, b)
        if not mixed:
            if op == "+":
                return _ints(a.lo + b.lo, a.hi + b.hi)
            if op == "-":
                return _ints(a.lo - b.hi, a.hi - b.lo)
            return _i_mul(a, b)
        if op == "+":
            return _f_add(a, b)
        if op == "-":
            return _f_add(a, _neg(b))
        if op == "*":
            return _f_mul(a, b)
        return _f_div(a, b)

    def call(self, node: Call) -> Interval | _Tri:
        f, args = node.func, node.args
        if f == "where":
            c = self(args[0])
            as_float = node.type is Type.FLOAT
            branches = []
            if c.true:
                branches.append(self.num(args[1], as_float))
            if c.false:
                branches.append(self.num(args[2], as_float))
            if node.type is Type.BOOL:
                return _Tri(any(x.true for x in branches), any(x.false for x in branches))
            return branches[0] if len(branches) == 1 else _hull(branches)
        if f in ("min", "max"):
            as_float = node.type is Type.FLOAT
            return _minmax(f, self.num(args[0], as_float), self.num(args[1], as_float))
        (x,) = args
        if f == "abs":
            a = _abs(self(x))
            return a if x.type is Type.FLOAT else _ints(a.lo, a.hi)
        if f == "floor":
            return self(x) if x.type is Type.INT else _floor(self(x))
        return _f_call(f, self.num(x, True))


def bounds(
    tree: Expr,
    variables: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> Interval | tuple[bool, bool]:
    """Sound bounds of `tree` when its variables range over `variables` (each an int, a
    range, an inclusive (lo, hi) pair, an Interval, or None / absent: unknown) and its
    parameters are `params` (see `classify_block`): an Interval for a number, `(may be
    true, may be false)` for a bool."""
    ivs = {k: _range_input(v, k) for k, v in (variables or {}).items()}
    out = _Bounder(ivs, dict(params or {}))(tree)
    return (out.true, out.false) if isinstance(out, _Tri) else out


class _Recorder(_Bounder):
    """A `_Bounder` that keeps every node's bounds (by `id`), visits what `_Bounder` may skip
    (a parameter's indices, the branch of a `where` its condition rules out) and takes float
    variables (the score s) as any float."""

    def __init__(self, variables: Mapping[str, Interval], params: Mapping[str, Any]) -> None:
        super().__init__(variables, params)
        self.seen: dict[int, Interval | _Tri] = {}

    def __call__(self, node: Expr) -> Interval | _Tri:
        if id(node) in self.seen:
            return self.seen[id(node)]
        if isinstance(node, Var) and node.type is Type.FLOAT:
            out: Interval | _Tri = _TOP_NAN
        else:
            out = super().__call__(node)
        if isinstance(node, Param):
            for index in node.index:
                self(index)
        elif isinstance(node, Call) and node.func == "where":
            for arg in node.args:
                self(arg)
            if node.type is Type.INT:
                out = self._where_refined(node, out)
        self.seen[id(node)] = out
        return out

    def _where_refined(self, node: Call, out: Interval) -> Interval:
        """An int `where(c, a, b)` whose condition compares a branch itself with something
        (`where(abs(j - i) < 8, abs(j - i), ...)`): that branch is taken only where the
        comparison holds (or fails), so its part of the hull is narrowed to match."""
        c, a, b = node.args
        tri = self(c)
        parts = []
        for branch, truth, take in ((a, True, tri.true), (b, False, tri.false)):
            if take:
                iv = self.seen[id(branch)]
                parts.append(_refine(c, truth, branch, iv, self) or iv)
        if not parts:
            return out
        hull = _hull(parts)
        lo, hi = max(hull.lo, out.lo), min(hull.hi, out.hi)
        return Interval(lo, hi) if lo <= hi else out


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "=="}
_NOT = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def _refine(cond: Expr, truth: bool, expr: Expr, iv: Interval, bound: _Bounder) -> Interval | None:
    """`iv` (expr's bounds) narrowed by the int comparison `cond` having value `truth`, where
    one side of `cond` is `expr` (structurally); None where nothing narrows (an empty result,
    a branch never taken, is left to the hull)."""
    if not (isinstance(cond, Binary) and cond.op in _NOT):
        return None
    if not (cond.left.type is Type.INT and cond.right.type is Type.INT):
        return None
    op = cond.op if truth else _NOT[cond.op]
    if cond.left == expr:
        other = bound(cond.right)
    elif cond.right == expr:
        other, op = bound(cond.left), _FLIP.get(op, op)
    else:
        return None
    lo, hi = iv.lo, iv.hi
    if op == "<":
        hi = min(hi, other.hi - 1)
    elif op == "<=":
        hi = min(hi, other.hi)
    elif op == ">":
        lo = max(lo, other.lo + 1)
    elif op == ">=":
        lo = max(lo, other.lo)
    elif op == "==":
        lo, hi = max(lo, other.lo), min(hi, other.hi)
    return Interval(lo, hi) if lo <= hi else None


def node_bounds(
    tree: Expr,
    variables: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> dict[int, Interval | tuple[bool, bool]]:
    """Sound bounds of every node of `tree` (as `bounds` gives the root's; variables and
    parameters likewise), keyed by the node's `id`; a score_mod's s is any float. Each node's
    bounds hold wherever the tree is evaluated, whatever its context (a `where` branch that
    its condition rules out is bounded too)."""
    ivs = {k: _range_input(v, k) for k, v in (variables or {}).items()}
    rec = _Recorder(ivs, dict(params or {}))
    rec(tree)
    return {k: (v.true, v.false) if isinstance(v, _Tri) else v for k, v in rec.seen.items()}


def classify_block(
    tree: Expr,
    *,
    i: Any,
    j: Any,
    b: Any = None,
    h: Any = None,
    seqlen_q: Any = None,
    seqlen_k: Any = None,
    params: Mapping[str, Any] | None = None,
) -> Block:
    """FULL, EMPTY or PARTIAL for the bool `tree` over the tile of queries `i` and keys `j`
    (each an int, a range, or an inclusive (lo, hi) pair / Interval; b, h, seqlen_q, seqlen_k
    likewise, None for unknown).

    `params` gives what is known of each parameter (absent or None: nothing): a number (its
    value), an inclusive (lo, hi) tuple or an Interval (bounds of the values the tile reads),
    or an array (all its values: per_head / per_batch / per_token vectors, tables of shape
    (heads, columns)); the bounds are then taken over the rows the tile's indices read."""
    if tree.type is not Type.BOOL:
        raise UserModError(f"block classification takes a bool mask, got {tree.type.value}")
    variables = {"i": i, "j": j, "b": b, "h": h, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    may_true, may_false = bounds(tree, variables, params)
    if not may_false:
        return Block.FULL
    if not may_true:
        return Block.EMPTY
    return Block.PARTIAL


def block_map(
    tree: Expr,
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    block_n: int,
    *,
    b: Any = None,
    h: Any = None,
    params: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """The class of every (block_m x block_n) tile of a seqlen_q x seqlen_k problem (the last
    tiles clipped), as an int8 array of `Block` values, shape (ceil(Sq / bm), ceil(Sk / bn))."""
    if min(seqlen_q, seqlen_k, block_m, block_n) < 1:
        raise ValueError("seqlens and block sizes must be >= 1")
    rows, cols = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    out = np.empty((rows, cols), dtype=np.int8)
    for r in range(rows):
        i = (r * block_m, min((r + 1) * block_m, seqlen_q) - 1)
        for c in range(cols):
            j = (c * block_n, min((c + 1) * block_n, seqlen_k) - 1)
            out[r, c] = classify_block(
                tree, i=i, j=j, b=b, h=h, seqlen_q=seqlen_q, seqlen_k=seqlen_k, params=params
            )
    return out
