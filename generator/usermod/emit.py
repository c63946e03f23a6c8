"""C++ emission of user-modifier trees: one fully parenthesised expression for a device
functor, plus the helpers it calls (`CPP_HELPERS`).

Types: ints are `int64_t` (every int variable and parameter is converted on read, so `i * j`
cannot overflow 32 bits) except where bounds prove int32 exact (int32 arithmetic, below),
floats are `float` (fp32), bools `bool`; an int operand of a float operation is converted
with `static_cast<float>`. Literals: ints as `5ll`, floats rounded to
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
ints, `//`, `%`, table columns, `min`/`max` of ints) keep exact integer arithmetic.

Int32 arithmetic (`int32_bounds`, the kernels' score stage: generator/features/user.py): given
bounds on the variables and int parameter kinds, blocks.py's interval analysis bounds every
node (`node_bounds`; a `where` whose condition compares its branch, `where(abs(j - i) < 8,
abs(j - i), ..)`, is narrowed by it), and an int node whose value and whose int operands'
values all provably fit int32 is computed in `int32_t` (`int32_nodes`): literals without the
`ll`, reads cast to `int32_t`, the `fg_*32` helpers (`cpp_helpers_int32`: the same floor `//`,
`%`, clamps and NaN rule as the int64 ones, so the value is the int64 one), and a plain C `/`
or `%` where the dividend is provably >= 0 and the divisor >= 1. A float reads such an int
through a conversion from s32, and an int64 context widens it. The GPU emulates 64-bit
integer division, min, compares and conversions with several instructions each; a T5 bucket
(`abs(j - i)`, `min`, `floor(log(..))`, a table column) then costs no 64-bit operation but
its table address.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .blocks import Interval, node_bounds
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
    "CPP_HELPERS_INT32",
    "DEFAULT_ACCESS",
    "FLOAT_EXACT",
    "cpp_float_literal",
    "cpp_helpers_int32",
    "emit_cpp",
    "int32_nodes",
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

# The integer helpers, written once and rendered for int64 (CPP_HELPERS) and int32
# (_HELPERS_INT32): the same code at each width, so the int32 form returns what the int64 one
# does wherever its operands fit.
_INT_HELPERS = """FG_USERMOD_FN {T} fg_floordiv{S}({T} a, {T} b) {{
  if (b == 0) return 0;
  if (b == -1) return static_cast<{T}>({Z} - static_cast<{UT}>(a));
  const {T} q = a / b;  // truncates toward zero
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}}
FG_USERMOD_FN {T} fg_mod{S}({T} a, {T} b) {{
  if (b == 0 || b == -1) return 0;
  const {T} r = a % b;  // takes a's sign
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}}
FG_USERMOD_FN {T} fg_imin{S}({T} a, {T} b) {{ return a < b ? a : b; }}
FG_USERMOD_FN {T} fg_imax{S}({T} a, {T} b) {{ return a < b ? b : a; }}
FG_USERMOD_FN {T} fg_iabs{S}({T} a) {{ return a < 0 ? -a : a; }}
"""
# floor(x) as an int, clamped to [-2^31, 2^31 - 1], 0 for NaN. Both widths use floorf: on
# the device, __float2int_rd (one cvt.rmi.s32.f32) made ptxas spill in the Hopper backward of
# T5's buckets.
_FLOOR_HELPER = """FG_USERMOD_FN {T} fg_floor_int{S}(float x) {{
  if (!(x == x)) return 0;
  const float f = floorf(x);
  if (f >= 2147483648.0f) return {MAX};
  if (f < -2147483648.0f) return {MIN};
  return static_cast<{T}>(f);
}}
"""
_WIDTHS = {
    64: dict(T="int64_t", UT="uint64_t", Z="0ull", S="", MAX="INT64_C(2147483647)",
             MIN="-INT64_C(2147483648)"),
    32: dict(T="int32_t", UT="uint32_t", Z="0u", S="32", MAX="INT32_MAX", MIN="INT32_MIN"),
}  # fmt: skip


CPP_HELPERS = (
    r"""// flashgen: helpers of user-defined score_mod / mask_mod expressions
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
"""
    + _INT_HELPERS.format(**_WIDTHS[64])
    + r"""// floor(x) as an int: clamped to [-2^31, 2^31 - 1], 0 for NaN
"""
    + _FLOOR_HELPER.format(**_WIDTHS[64])
    + r"""// a table column clamped to [0, n - 1]
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
)


def _split_helpers(text: str) -> dict[str, str]:
    """{name: its definition} of rendered helpers, one `FG_USERMOD_FN` definition each."""
    out = {}
    for chunk in text.split("FG_USERMOD_FN ")[1:]:
        name = chunk.split("(", 1)[0].split()[-1]
        out[name] = ("FG_USERMOD_FN " + chunk).rstrip("\n")
    return out


# The int32 forms of the helpers (module doc: int32 arithmetic), called only where every value
# fits int32, so each returns what its int64 form does. Not part of CPP_HELPERS (a header every
# kernel includes): `cpp_helpers_int32` gives the ones an expression calls, which its caller
# renders beside it (generator/features/user.py: static members of the functor).
_HELPERS_INT32: dict[str, str] = {
    **_split_helpers(_INT_HELPERS.format(**_WIDTHS[32]) + _FLOOR_HELPER.format(**_WIDTHS[32])),
    # a table column clamped to [0, last] (last: the last column, at most INT32_MAX)
    "fg_clamp_last32": """FG_USERMOD_FN int32_t fg_clamp_last32(int32_t k, int32_t last) {
  return k < 0 ? 0 : (k > last ? last : k);
}""",
    # the last column of n >= 1 as int32 (columns past INT32_MAX are never read by an int32 k)
    "fg_last32": """FG_USERMOD_FN int32_t fg_last32(int64_t n) {
  return static_cast<int32_t>(n - 1 < INT32_MAX ? n - 1 : INT32_MAX);
}""",
}


def cpp_helpers_int32(text: str | None = None, *, member: bool = False) -> str:
    """The int32 helpers that the C++ `text` calls (all of them for None), one per line group;
    `member` makes them static members of a struct (no include guard)."""
    names = [n for n in _HELPERS_INT32 if text is None or f"{n}(" in text]
    if not names:
        return ""
    body = "\n".join(_HELPERS_INT32[n] for n in names)
    if member:
        return body.replace("FG_USERMOD_FN ", "static FG_USERMOD_FN ")
    return (
        "#ifndef FLASHGEN_USERMOD_HELPERS_INT32\n#define FLASHGEN_USERMOD_HELPERS_INT32\n"
        f"{body}\n#endif  // FLASHGEN_USERMOD_HELPERS_INT32\n"
    )


CPP_HELPERS_INT32 = cpp_helpers_int32()

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _fits_int32(iv: object) -> bool:
    return isinstance(iv, Interval) and _INT32_MIN <= iv.lo and iv.hi <= _INT32_MAX


def int32_nodes(
    tree: Expr, bounds: Mapping[str | ParamKind, tuple[int, int]]
) -> tuple[set[int], dict[int, object]]:
    """The ids of the int nodes of `tree` that int32 arithmetic evaluates exactly (the node's
    and every int operand's value below it provably in int32), and every node's bounds, given
    `bounds`: an inclusive (lo, hi) per variable (i, j, b, h, seqlen_q, seqlen_k) and per int
    parameter kind; absent ones are unbounded."""
    variables = {k: v for k, v in bounds.items() if isinstance(k, str)}
    kinds = {ParamKind(k): v for k, v in bounds.items() if not isinstance(k, str)}
    params = {
        n.name: Interval(*kinds[n.kind])
        for n in walk(tree)
        if isinstance(n, Param) and n.kind in kinds and KIND_INFO[n.kind].type is Type.INT
    }
    ivs = node_bounds(tree, variables, params)
    out: set[int] = set()
    memo: dict[int, bool] = {}

    def visit(node: Expr) -> bool:
        if id(node) not in memo:
            kids = {id(c): visit(c) for c in list(node.children())}
            ok = (
                node.type is Type.INT
                and _fits_int32(ivs.get(id(node)))
                and all(kids[id(c)] for c in _operands(node))
            )
            memo[id(node)] = ok
            if ok:
                out.add(id(node))
        return memo[id(node)]

    visit(tree)
    return out, ivs


def _operands(node: Expr) -> list[Expr]:
    """The int operands whose values an int node's arithmetic takes (not a `where`'s
    condition, a parameter's indices or a float `floor` argument)."""
    if node.type is not Type.INT:
        return []
    if isinstance(node, Call) and node.func == "where":
        return list(node.args[1:])
    if isinstance(node, Call) and node.func == "floor" and node.args[0].type is Type.FLOAT:
        return []
    if isinstance(node, Param):
        return []
    return list(node.children())


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


def _int32_literal(value: int) -> str:
    if value == _INT32_MIN:
        return "(-2147483647 - 1)"
    return f"({value})" if value < 0 else str(value)


class _Emitter:
    def __init__(
        self,
        names: Mapping[str, str],
        params: str,
        access: Mapping[ParamKind, str],
        float_positions: Mapping[str, str] | None = None,
        narrow: set[int] | None = None,
        ivs: Mapping[int, object] | None = None,
        table_int32: str | None = None,
    ):
        self.names = names
        self.p = params
        self.access = access
        self.fpos = float_positions
        self.narrow = narrow or set()
        self.ivs = ivs or {}
        self.table_int32 = table_int32

    def is32(self, node: Expr) -> bool:
        """Whether `node` is an int evaluated in int32 (module doc: int32 arithmetic)."""
        return id(node) in self.narrow

    def i64(self, node: Expr) -> str:
        """An int node's text as int64_t (an int32 node widened)."""
        if not self.is32(node):
            return self(node)
        if isinstance(node, (Const, Var, Param)):  # read as int64_t directly
            return _Emitter(self.names, self.p, self.access, self.fpos, ivs=self.ivs)(node)
        return f"static_cast<int64_t>({self(node)})"

    def ints(self, node: Expr, *operands: Expr) -> list[str]:
        """The operands of int node `node` (or of a comparison, `node` None) at one width:
        int32 where `node` is (or, for a comparison, where every operand is), else int64."""
        narrow = self.is32(node) if node is not None else all(self.is32(x) for x in operands)
        return [self(x) if narrow else self.i64(x) for x in operands]

    def nonneg(self, node: Expr, least: int) -> bool:
        iv = self.ivs.get(id(node))
        return isinstance(iv, Interval) and iv.lo >= least

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
                return _int32_literal(node.value) if self.is32(node) else _int_literal(node.value)
            return cpp_float_literal(node.value)
        if isinstance(node, Var):
            name = self.names[node.name]
            cast = self.ctype(node)
            return f"static_cast<{cast}>({name})"
        if isinstance(node, Param):
            return self.param(node)
        if isinstance(node, Unary):
            if node.op == "not":
                return f"(!{self(node.arg)})"
            arg = self.ints(node, node.arg)[0] if node.type is Type.INT else self(node.arg)
            return f"(-{arg})"
        if isinstance(node, Binary):
            return self.binary(node)
        if isinstance(node, Call):
            return self.call(node)
        raise TypeError(f"not an expression node: {node!r}")

    def ctype(self, node: Expr) -> str:
        if node.type is Type.FLOAT:
            return "float"
        return "int32_t" if self.is32(node) else "int64_t"

    def param(self, node: Param) -> str:
        info = KIND_INFO[node.kind]
        fields = {"p": self.p, "name": node.name}
        if info.index:
            fields["index"] = self(node.index[0])
            fields["var"] = node.index[0].name  # the index variable (i, j, h or b)
        template = self.access[node.kind]
        if info.column:
            column = node.index[1]
            if self.is32(column) and self.table_int32 is not None:
                template, fields["k"] = self.table_int32, self(column)
            else:
                fields["k"] = self.i64(column)
        read = template.format(**fields)
        return f"static_cast<{self.ctype(node)}>({read})"

    def binary(self, node: Binary) -> str:
        op, a, b = node.op, node.left, node.right
        if op in ("and", "or"):
            return f"({self(a)} {'&&' if op == 'and' else '||'} {self(b)})"
        if op in ("//", "%"):
            left, right = self.ints(node, a, b)
            if not self.is32(node):
                return f"{'fg_floordiv' if op == '//' else 'fg_mod'}({left}, {right})"
            if self.nonneg(a, 0) and self.nonneg(b, 1):  # floor is truncation here
                return f"({left} {'/' if op == '//' else '%'} {right})"
            return f"{'fg_floordiv32' if op == '//' else 'fg_mod32'}({left}, {right})"
        ints = a.type is Type.INT and b.type is Type.INT and op != "/"
        if ints:
            left, right = self.ints(node if node.type is Type.INT else None, a, b)
        else:
            left, right = self.flt(a), self.flt(b)
        assert op in COMPARISONS or op in ("+", "-", "*", "/")
        return f"({left} {op} {right})"

    def call(self, node: Call) -> str:
        f, args = node.func, node.args
        if f == "where":
            c, a, b = args
            if node.type is Type.FLOAT:
                return f"({self(c)} ? {self.flt(a)} : {self.flt(b)})"
            if node.type is Type.INT:
                a_text, b_text = self.ints(node, a, b)
                return f"({self(c)} ? {a_text} : {b_text})"
            return f"({self(c)} ? {self(a)} : {self(b)})"
        w = "32" if self.is32(node) else ""
        if f in ("min", "max"):
            a, b = args
            if node.type is Type.INT:
                return f"fg_i{f}{w}({', '.join(self.ints(node, a, b))})"
            return f"f{f}f({self.flt(a)}, {self.flt(b)})"
        (x,) = args
        if f == "abs":
            if x.type is Type.INT:
                return f"fg_iabs{w}({self.ints(node, x)[0]})"
            return f"fabsf({self(x)})"
        if f == "floor":
            if x.type is Type.INT:
                return self.ints(node, x)[0]
            return f"fg_floor_int{w}({self(x)})"
        return f"fg_{f}({self.flt(x)})"  # exp, log, tanh


def emit_cpp(
    tree: Expr,
    names: Mapping[str, str],
    *,
    params: str = "p",
    access: Mapping[ParamKind | str, str] | None = None,
    float_positions: Mapping[str, str] | None = None,
    int32_bounds: Mapping[str | ParamKind, tuple[int, int]] | None = None,
    table_int32_access: str | None = None,
) -> str:
    """The C++ expression of `tree` (module doc), fully parenthesised.

    `names` maps each variable the tree reads to C++ text (e.g. `{'s': 'x', 'i': 'qi', 'j':
    'kj', 'h': 'head'}`); `params` is the C++ name of the parameter object; `access` overrides
    `DEFAULT_ACCESS` for some kinds (keys `ParamKind` or their YAML spelling);
    `float_positions` maps "i", "j" and "i-j" to float C++ text of those values (module doc),
    None for exact int arithmetic everywhere.

    `int32_bounds` gives what the caller guarantees of the ints (an inclusive (lo, hi) per
    variable and per int parameter kind, see `int32_nodes`): the int subexpressions proven to
    stay in int32 are then evaluated in int32 (module doc), all in int64 for None.
    `table_int32_access` reads a table at an int32 column `{k}` (default: the table's
    `access` with the column widened)."""
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
    narrow, ivs = int32_nodes(tree, int32_bounds) if int32_bounds is not None else (set(), {})
    return _Emitter(names, params, table, float_positions, narrow, ivs, table_int32_access)(tree)
