"""C++ emission of user-modifier trees: one fully parenthesised expression for a device
functor, plus the helpers it calls (`CPP_HELPERS`).

Types: ints are `int64_t` (every int variable and parameter is converted on read, so `i * j`
cannot overflow 32 bits), floats are `float` (fp32), bools `bool`; an int operand of a float
operation is converted with `static_cast<float>`. Literals: ints as `5ll`, floats rounded to
float32 and written with 9 significant digits and an `f` suffix, negative ones parenthesised.

Calls: `//` and `%` are `fg_floordiv` / `fg_mod` (floor semantics, 0 for a zero divisor);
`exp`, `log`, `tanh` are `fg_exp` / `fg_log` / `fg_tanh` (`__expf`, `__logf`, `tanhf` in
device code, the C library's `expf`, `logf`, `tanhf` in host code, so the same functor runs
on either side); `min` / `max` of floats are `fminf` / `fmaxf`, of ints `fg_imin` /
`fg_imax`; `abs` is `fabsf` / `fg_iabs`; `floor` is `fg_floor_int`; `where` is `?:`.

Names: a variable becomes the C++ text the caller maps it to; a parameter `name` becomes a
read of the parameter object (`p` unless told) through a template of its kind
(`DEFAULT_ACCESS`). A parameter's name is a checked identifier (`parse.check_params`);
no other text of the expression reaches the output.

Float positions (`float_positions`, the kernels' score stage): an int expression that a float
reads and that is linear in the positions i and j with constant coefficients, or the `abs` of
one (`abs(i + seqlen_k - seqlen_q - j)`, `i - j`, `2 * j + 1`), is evaluated in fp32 from the
caller's float i, j and i - j (which the kernels keep as a per-lane base plus a compile-time
offset) plus the rest (lengths, b, h, the constant) converted once. So no score pays an int64
add or an int-to-float conversion, which run at the MUFU's quarter rate beside its exp2 and
halved the Hopper forward's throughput (bench/usermod_bench.py). The value is the int
expression's exactly while every term is below 2^24 in magnitude (at coefficient 1: sequences
of 16M tokens, as the built-in ALiBi's float distance); beyond, within a few fp32 ulps.
Coefficients or constants of 2^24 or more keep the int path. Int contexts (comparisons of
ints, `//`, `%`, table columns, `min`/`max` of ints) always keep exact int64 arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping

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

__all__ = [
    "CPP_HELPERS",
    "DEFAULT_ACCESS",
    "FLOAT_EXACT",
    "cpp_float_literal",
    "emit_cpp",
    "linear_form",
]

# How a parameter is read, per kind: `{p}` the parameter object, `{name}` the parameter's name,
# `{index}` the first index (an int64_t expression), `{var}` that index's variable name, `{k}`
# a table's column (clamped by the template). A table `name` is a row-major (heads, name_cols)
# array with its column count in `name_cols`. The read is then converted to float or int64_t.
DEFAULT_ACCESS: dict[ParamKind, str] = {
    ParamKind.SCALAR: "{p}.{name}",
    ParamKind.SCALAR_INT: "{p}.{name}",
    ParamKind.PER_HEAD: "{p}.{name}[{index}]",
    ParamKind.PER_BATCH: "{p}.{name}[{index}]",
    ParamKind.PER_BATCH_INT: "{p}.{name}[{index}]",
    ParamKind.PER_TOKEN_Q: "{p}.{name}[{index}]",
    ParamKind.PER_TOKEN_K: "{p}.{name}[{index}]",
    ParamKind.PER_TOKEN: "{p}.{name}[{index}]",
    ParamKind.TABLE: (
        "{p}.{name}[({index}) * {p}.{name}_cols + fg_clamp_index({k}, {p}.{name}_cols)]"
    ),
}

CPP_HELPERS = r"""// flashgen: helpers of user-defined score_mod / mask_mod expressions
// (generator.usermod). Integer semantics are Python's, as in the float64 reference:
// floor division, a remainder with the divisor's sign, and 0 for a zero divisor.
#ifndef FLASHGEN_USERMOD_HELPERS
#define FLASHGEN_USERMOD_HELPERS
#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define FG_USERMOD_FN __host__ __device__ __forceinline__
#else
#define FG_USERMOD_FN inline
#endif

// (b == -1 is taken apart: INT64_MIN / -1 traps on x86; -a wraps, as numpy's does)
FG_USERMOD_FN int64_t fg_floordiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  if (b == -1) return static_cast<int64_t>(0ull - static_cast<uint64_t>(a));
  const int64_t q = a / b;  // truncates toward zero
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
FG_USERMOD_FN int64_t fg_mod(int64_t a, int64_t b) {
  if (b == 0 || b == -1) return 0;
  const int64_t r = a % b;  // takes a's sign
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
FG_USERMOD_FN int64_t fg_imin(int64_t a, int64_t b) { return a < b ? a : b; }
FG_USERMOD_FN int64_t fg_imax(int64_t a, int64_t b) { return a < b ? b : a; }
FG_USERMOD_FN int64_t fg_iabs(int64_t a) { return a < 0 ? -a : a; }
// floor(x) as an int: clamped to [-2^31, 2^31 - 1], 0 for NaN
FG_USERMOD_FN int64_t fg_floor_int(float x) {
  if (!(x == x)) return 0;
  const float f = floorf(x);
  if (f >= 2147483648.0f) return INT64_C(2147483647);
  if (f < -2147483648.0f) return -INT64_C(2147483648);
  return static_cast<int64_t>(f);
}
// a table column clamped to [0, n - 1]
FG_USERMOD_FN int64_t fg_clamp_index(int64_t k, int64_t n) {
  return k < 0 ? 0 : (k >= n ? n - 1 : k);
}
FG_USERMOD_FN float fg_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return expf(x);
#endif
}
FG_USERMOD_FN float fg_log(float x) {
#if defined(__CUDA_ARCH__)
  return __logf(x);
#else
  return logf(x);
#endif
}
FG_USERMOD_FN float fg_tanh(float x) { return tanhf(x); }
#endif  // FLASHGEN_USERMOD_HELPERS
"""


def cpp_float_literal(value: float) -> str:
    """`value` rounded to float32, as a C++ float literal (9 significant digits: the float32
    reads back exactly); negative literals are parenthesised."""
    v = float(np.float32(value))
    text = format(v, ".9g")
    if not any(c in text for c in ".e"):
        text += ".0"
    text += "f"
    return f"({text})" if text.startswith("-") else text


def _int_literal(value: int) -> str:
    return f"({value}ll)" if value < 0 else f"{value}ll"


FLOAT_EXACT = 1 << 24  # integers below this magnitude are exact in fp32
# the keys of `float_positions`: float i, float j, and float (i - j)
FLOAT_POSITION_KEYS = ("i", "j", "i-j")


def linear_form(node: Expr) -> tuple[dict[str, int], int] | None:
    """An int tree as (coefficient per variable, constant): sum(c_v * v) + c, or None where it
    is not linear with constant coefficients (parameters, products of variables, calls)."""
    if node.type is not Type.INT:
        return None
    if isinstance(node, Const):
        return {}, int(node.value)
    if isinstance(node, Var):
        return {node.name: 1}, 0
    if isinstance(node, Unary) and node.op == "-":
        inner = linear_form(node.arg)
        if inner is None:
            return None
        return {v: -k for v, k in inner[0].items()}, -inner[1]
    if isinstance(node, Binary) and node.op in ("+", "-", "*"):
        a, b = linear_form(node.left), linear_form(node.right)
        if a is None or b is None:
            return None
        if node.op == "*":
            if a[0] and b[0]:
                return None  # a product of variables
            (coefs, c), k = (a, b[1]) if a[0] else (b, a[1])
            return {v: x * k for v, x in coefs.items()}, c * k
        sign = 1 if node.op == "+" else -1
        coefs = dict(a[0])
        for v, x in b[0].items():
            coefs[v] = coefs.get(v, 0) + sign * x
        return {v: x for v, x in coefs.items() if x}, a[1] + sign * b[1]
    return None


def _times(k: int, text: str) -> str:
    if k == 1:
        return text
    if k == -1:
        return f"(-{text})"
    return f"({cpp_float_literal(float(k))} * {text})"


class _Emitter:
    def __init__(
        self,
        names: Mapping[str, str],
        params: str,
        access: Mapping[ParamKind, str],
        float_positions: Mapping[str, str] | None = None,
    ):
        self.names = names
        self.p = params
        self.access = access
        self.fpos = float_positions

    def flt(self, node: Expr) -> str:
        if node.type is Type.INT and self.fpos is not None:
            text = self.float_linear(node)
            if text is not None:
                return text
        text = self(node)
        return f"static_cast<float>({text})" if node.type is Type.INT else text

    def float_linear(self, node: Expr) -> str | None:
        """The fp32 text of an int tree linear in i and j, or of its abs (module doc: float
        positions); None where the int path applies."""
        absolute = isinstance(node, Call) and node.func == "abs"
        form = linear_form(node.args[0] if absolute else node)
        if form is None:
            return None
        coefs, const = form
        a, b = coefs.get("i", 0), coefs.get("j", 0)
        if (not a and not b) or any(abs(x) >= FLOAT_EXACT for x in (*coefs.values(), const)):
            return None  # invariant per tile (converted once), or too large to be exact
        terms = (
            [_times(a, self.fpos["i-j"])]
            if a == -b
            else [_times(k, self.fpos[v]) for v, k in (("i", a), ("j", b)) if k]
        )
        rest = [
            f"{_int_literal(k)} * static_cast<int64_t>({self.names[v]})"
            if k not in (1, -1)
            else f"{'-' if k < 0 else ''}static_cast<int64_t>({self.names[v]})"
            for v, k in sorted(coefs.items())
            if v not in ("i", "j")
        ]
        if const:
            rest.append(_int_literal(const))
        if rest:
            terms.append(f"static_cast<float>({' + '.join(rest)})")
        text = terms[0] if len(terms) == 1 else f"({' + '.join(terms)})"
        return f"fabsf({text})" if absolute else text

    def __call__(self, node: Expr) -> str:
        if isinstance(node, Const):
            if node.type is Type.BOOL:
                return "true" if node.value else "false"
            if node.type is Type.INT:
                return _int_literal(node.value)
            return cpp_float_literal(node.value)
        if isinstance(node, Var):
            name = self.names[node.name]
            cast = "float" if node.type is Type.FLOAT else "int64_t"
            return f"static_cast<{cast}>({name})"
        if isinstance(node, Param):
            return self.param(node)
        if isinstance(node, Unary):
            return f"(-{self(node.arg)})" if node.op == "-" else f"(!{self(node.arg)})"
        if isinstance(node, Binary):
            return self.binary(node)
        if isinstance(node, Call):
            return self.call(node)
        raise TypeError(f"not an expression node: {node!r}")

    def param(self, node: Param) -> str:
        info = KIND_INFO[node.kind]
        fields = {"p": self.p, "name": node.name}
        if info.index:
            fields["index"] = self(node.index[0])
            fields["var"] = node.index[0].name  # the index variable (i, j, h or b)
        if info.column:
            fields["k"] = self(node.index[1])
        read = self.access[node.kind].format(**fields)
        cast = "float" if info.type is Type.FLOAT else "int64_t"
        return f"static_cast<{cast}>({read})"

    def binary(self, node: Binary) -> str:
        op, a, b = node.op, node.left, node.right
        if op in ("and", "or"):
            return f"({self(a)} {'&&' if op == 'and' else '||'} {self(b)})"
        if op in ("//", "%"):
            return f"{'fg_floordiv' if op == '//' else 'fg_mod'}({self(a)}, {self(b)})"
        ints = a.type is Type.INT and b.type is Type.INT and op != "/"
        left, right = (self(a), self(b)) if ints else (self.flt(a), self.flt(b))
        assert op in COMPARISONS or op in ("+", "-", "*", "/")
        return f"({left} {op} {right})"

    def call(self, node: Call) -> str:
        f, args = node.func, node.args
        if f == "where":
            c, a, b = args
            if node.type is Type.FLOAT:
                return f"({self(c)} ? {self.flt(a)} : {self.flt(b)})"
            return f"({self(c)} ? {self(a)} : {self(b)})"
        if f in ("min", "max"):
            a, b = args
            if node.type is Type.INT:
                return f"fg_i{f}({self(a)}, {self(b)})"
            return f"f{f}f({self.flt(a)}, {self.flt(b)})"
        (x,) = args
        if f == "abs":
            return f"fg_iabs({self(x)})" if x.type is Type.INT else f"fabsf({self(x)})"
        if f == "floor":
            return self(x) if x.type is Type.INT else f"fg_floor_int({self(x)})"
        return f"fg_{f}({self.flt(x)})"  # exp, log, tanh


def emit_cpp(
    tree: Expr,
    names: Mapping[str, str],
    *,
    params: str = "p",
    access: Mapping[ParamKind | str, str] | None = None,
    float_positions: Mapping[str, str] | None = None,
) -> str:
    """The C++ expression of `tree` (module doc), fully parenthesised.

    `names` maps each variable the tree reads to C++ text (e.g. `{'s': 'x', 'i': 'qi', 'j':
    'kj', 'h': 'head'}`); `params` is the C++ name of the parameter object; `access` overrides
    `DEFAULT_ACCESS` for some kinds (keys `ParamKind` or their YAML spelling);
    `float_positions` maps "i", "j" and "i-j" to float C++ text of those values (module doc),
    None for exact int arithmetic everywhere."""
    if float_positions is not None:
        missing = [k for k in FLOAT_POSITION_KEYS if not float_positions.get(k)]
        if missing:
            raise ValueError(f"emit_cpp: float_positions lacks {', '.join(missing)}")
    used = sorted({n.name for n in walk(tree) if isinstance(n, Var)})
    missing = [v for v in used if not names.get(v)]
    if missing:
        raise ValueError(f"emit_cpp: no C++ name for variable(s) {', '.join(missing)}")
    table = dict(DEFAULT_ACCESS)
    for kind, template in (access or {}).items():
        table[ParamKind(kind)] = template
    return _Emitter(names, params, table, float_positions)(tree)
