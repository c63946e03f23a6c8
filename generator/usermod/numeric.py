"""A numpy evaluator of user-modifier trees: float64 (the reference) or float32 (the
low-precision baseline), vectorised over broadcast arrays of the variables.

Semantics, shared with the emitted C++ (`emit.CPP_HELPERS`) and docs/usermod.md:

- ints are int64; `//` and `%` are floor division and modulo with Python's signs (the
  remainder takes the divisor's sign), and a zero divisor gives 0 for both;
- floats are `dtype`; an int operand of a float operation is converted to `dtype` first
  (round to nearest), `/` always divides floats;
- `min` / `max` of floats return the other operand when one is NaN (C's fminf / fmaxf);
- `floor(x)` is the largest int <= x, clamped to [-2^31, 2^31 - 1], and 0 for NaN;
- a table's column index is clamped to [0, columns - 1]; every other index must be in range
  (an out-of-range read raises ValueError, where a kernel would read out of bounds).

Both branches of `where` are evaluated (the result takes one); floating-point warnings are
silenced, since an unselected branch may overflow or take log of a negative.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .tree import (
    COMPARISONS,
    KIND_INFO,
    Binary,
    Call,
    Const,
    Expr,
    Param,
    ParamKind,
    Type,
    Unary,
    Var,
    walk,
)

__all__ = ["evaluate", "floor_int", "floordiv", "modulo"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def floordiv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Floor division of int64 arrays, 0 where `b == 0`."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    zero = b == 0
    with np.errstate(all="ignore"):  # INT64_MIN // -1 wraps
        q = np.floor_divide(a, np.where(zero, np.int64(1), b))
    return np.where(zero, np.int64(0), q)


def modulo(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Python's modulo of int64 arrays (the sign of `b`), 0 where `b == 0`."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    zero = b == 0
    with np.errstate(all="ignore"):
        r = np.mod(a, np.where(zero, np.int64(1), b))
    return np.where(zero, np.int64(0), r)


def floor_int(x: np.ndarray) -> np.ndarray:
    """`floor(x)` as int64, clamped to [-2^31, 2^31 - 1], 0 for NaN."""
    f = np.floor(np.asarray(x)).astype(np.float64)  # exact: floor of a float is an integer
    nan = np.isnan(f)
    return np.where(nan, 0.0, np.clip(f, _INT32_MIN, _INT32_MAX)).astype(np.int64)


def _check_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    return dt


def _param_value(name: str, kind: ParamKind, value: Any, dt: np.dtype) -> np.ndarray:
    info = KIND_INFO[kind]
    ndim = (1 if info.index else 0) + (1 if info.column else 0)
    arr = np.asarray(value)
    if arr.ndim != ndim:
        shape = {0: "a number", 1: "a 1-D array", 2: "a 2-D array (heads, columns)"}[ndim]
        raise ValueError(
            f"parameter {name!r} ({kind.value}) must be {shape}, got shape {arr.shape}"
        )
    if info.type is Type.INT:
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"parameter {name!r} ({kind.value}) must hold ints, got {arr.dtype}")
        return arr.astype(np.int64)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"parameter {name!r} ({kind.value}) must hold floats, got {arr.dtype}")
    return arr.astype(dt)


class _Evaluator:
    def __init__(self, env: Mapping[str, Any], params: Mapping[str, Any], dt: np.dtype) -> None:
        self.env = env
        self.params = params
        self.dt = dt

    def var(self, name: str) -> np.ndarray:
        if name not in self.env:
            raise ValueError(
                f"evaluate: no value for variable {name!r} (given: {sorted(self.env)})"
            )
        arr = np.asarray(self.env[name])
        if name == "s":
            return arr.astype(self.dt)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"evaluate: variable {name!r} must be an int array, got {arr.dtype}")
        return arr.astype(np.int64)

    def param(self, node: Param) -> np.ndarray:
        if node.name not in self.params:
            raise ValueError(
                f"evaluate: no value for parameter {node.name!r} (given: {sorted(self.params)})"
            )
        value = _param_value(node.name, node.kind, self.params[node.name], self.dt)
        if not node.index:
            return value
        first = self(node.index[0])
        if first.size and (first.min() < 0 or first.max() >= value.shape[0]):
            raise ValueError(
                f"evaluate: parameter {node.name!r} has {value.shape[0]} rows, read at "
                f"{node.index[0].name} in [{first.min()}, {first.max()}]"
            )
        if len(node.index) == 1:
            return value[first]
        column = np.clip(self(node.index[1]), 0, value.shape[1] - 1)
        return value[first, column]

    def flt(self, node: Expr) -> np.ndarray:
        """`node`'s value as a float array (ints converted)."""
        v = self(node)
        return v.astype(self.dt) if node.type is Type.INT else v

    def __call__(self, node: Expr) -> np.ndarray:
        return np.asarray(self._eval(node))

    def _eval(self, node: Expr) -> Any:
        if isinstance(node, Const):
            if node.type is Type.FLOAT:
                return np.asarray(node.value, dtype=self.dt)
            return np.asarray(node.value, dtype=np.int64 if node.type is Type.INT else np.bool_)
        if isinstance(node, Var):
            return self.var(node.name)
        if isinstance(node, Param):
            return self.param(node)
        if isinstance(node, Unary):
            return np.negative(self(node.arg)) if node.op == "-" else np.logical_not(self(node.arg))
        if isinstance(node, Binary):
            return self._binary(node)
        if isinstance(node, Call):
            return self._call(node)
        raise TypeError(f"not an expression node: {node!r}")

    def _binary(self, node: Binary) -> Any:
        op, left, right = node.op, node.left, node.right
        if op == "and":
            return np.logical_and(self(left), self(right))
        if op == "or":
            return np.logical_or(self(left), self(right))
        if op == "//":
            return floordiv(self(left), self(right))
        if op == "%":
            return modulo(self(left), self(right))
        both_int = left.type is Type.INT and right.type is Type.INT
        a, b = (self(left), self(right)) if both_int else (self.flt(left), self.flt(right))
        if op in COMPARISONS:
            return {
                "<": np.less,
                "<=": np.less_equal,
                ">": np.greater,
                ">=": np.greater_equal,
                "==": np.equal,
                "!=": np.not_equal,
            }[op](a, b)
        if op == "/":
            return np.divide(self.flt(left), self.flt(right))
        return {"+": np.add, "-": np.subtract, "*": np.multiply}[op](a, b)

    def _call(self, node: Call) -> Any:
        f, args = node.func, node.args
        if f == "where":
            c, a, b = args
            if node.type is Type.FLOAT:
                return np.where(self(c), self.flt(a), self.flt(b))
            return np.where(self(c), self(a), self(b))
        if f in ("min", "max"):
            a, b = args
            if node.type is Type.INT:
                return (np.minimum if f == "min" else np.maximum)(self(a), self(b))
            return (np.fmin if f == "min" else np.fmax)(self.flt(a), self.flt(b))
        (x,) = args
        if f == "abs":
            return np.abs(self(x))
        if f == "floor":
            return self(x) if x.type is Type.INT else floor_int(self(x))
        return {"exp": np.exp, "log": np.log, "tanh": np.tanh}[f](self.flt(x))


def evaluate(
    tree: Expr,
    env: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    *,
    dtype: Any = np.float64,
) -> np.ndarray:
    """The value of `tree` over broadcast arrays, in `dtype` (float64 or float32) for floats,
    int64 for ints, bool for bools.

    `env` maps the variables the tree reads (s, b, h, i, j, seqlen_q, seqlen_k) to numbers or
    broadcastable arrays (ints for all but s); `params` maps parameters to values: a number
    (scalar, scalar_int), a 1-D array (per_head, per_batch, per_batch_int, per_token*), a 2-D
    `(heads, columns)` array (table). The result has the broadcast shape of every `env` value
    and of the tree's own value."""
    dt = _check_dtype(dtype)
    env = dict(env or {})
    ev = _Evaluator(env, dict(params or {}), dt)
    missing = sorted({n.name for n in walk(tree) if isinstance(n, Var)} - set(env))
    if missing:
        raise ValueError(f"evaluate: no value for variable(s) {', '.join(missing)}")
    with np.errstate(all="ignore"):
        out = ev(tree)
    shape = np.broadcast_shapes(out.shape, *(np.shape(v) for v in env.values()))
    return np.array(np.broadcast_to(out, shape))
