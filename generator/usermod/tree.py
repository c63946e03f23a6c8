"""The expression tree of user-defined modifiers: types, parameter kinds, nodes, typing rules
and the canonical text form.

Every tree is well typed by construction: a node's `__post_init__` infers its type from its
children (which are already typed) and raises `UserModError` when the rule refuses them, so
no ill-typed tree can exist. Nodes are frozen dataclasses; equality and hashing follow the
structure only (a node's source column, type and depth are not compared).

Two invariants keep the canonical text unique (docs/usermod.md, "Canonical text"):
a numeric literal is never the operand of unary minus (`-2` is the literal -2, built with
`negate`), and literals stay in range (ints in int32, floats finite in float32).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "Binary",
    "Call",
    "Const",
    "Expr",
    "FUNCTIONS",
    "INT_LITERAL_MAX",
    "KIND_INFO",
    "KindInfo",
    "MAX_DEPTH",
    "MAX_LENGTH",
    "Param",
    "ParamKind",
    "Type",
    "Unary",
    "UserModError",
    "VARIABLES",
    "Var",
    "canonical",
    "negate",
    "walk",
]

MAX_LENGTH = 2000  # characters of one expression
MAX_DEPTH = 48  # levels of the tree, and of nesting while parsing
INT_LITERAL_MAX = 2**31 - 1  # |int literal| <= this
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")


class UserModError(ValueError):
    """A user modifier that is refused: `message` says what is wrong and what is allowed;
    `column` (1-based, counted from the start of the expression text) is where, or None.
    The caller prefixes its own location (file:line:field)."""

    def __init__(self, message: str, column: int | None = None) -> None:
        super().__init__(message, column)
        self.message = message
        self.column = column

    def __str__(self) -> str:
        return self.message if self.column is None else f"column {self.column}: {self.message}"


class Type(enum.Enum):
    """The type of a node: int (int64 arithmetic), float (fp32 in kernels) or bool."""

    INT = "int"
    FLOAT = "float"
    BOOL = "bool"

    @property
    def numeric(self) -> bool:
        return self is not Type.BOOL


# the built-in variables and their types
VARIABLES: dict[str, Type] = {
    "s": Type.FLOAT,  # the scaled score (score_mod only)
    "b": Type.INT,  # batch index
    "h": Type.INT,  # query head
    "i": Type.INT,  # query index
    "j": Type.INT,  # key index
    "seqlen_q": Type.INT,
    "seqlen_k": Type.INT,
}

# function name -> number of arguments
FUNCTIONS: dict[str, int] = {
    "where": 3,
    "min": 2,
    "max": 2,
    "abs": 1,
    "exp": 1,
    "log": 1,
    "tanh": 1,
    "floor": 1,
}

ARITHMETIC = ("+", "-", "*", "/", "//", "%")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
LOGICAL = ("and", "or")

# binding strength, loosest first; unary minus is 7, atoms 8
PRECEDENCE: dict[str, int] = {
    "or": 1,
    "and": 2,
    "not": 3,
    **{op: 4 for op in COMPARISONS},
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "//": 6,
    "%": 6,
}
NEG_PRECEDENCE = 7
ATOM_PRECEDENCE = 8


class ParamKind(enum.Enum):
    """The kinds of named runtime parameters a modifier may declare (`params: {name: kind}`)."""

    SCALAR = "scalar"
    SCALAR_INT = "scalar_int"
    PER_HEAD = "per_head"
    PER_BATCH = "per_batch"
    PER_BATCH_INT = "per_batch_int"
    PER_TOKEN_Q = "per_token_q"
    PER_TOKEN_K = "per_token_k"
    PER_TOKEN = "per_token"
    TABLE = "table"


@dataclass(frozen=True)
class KindInfo:
    """How a parameter kind is read: its value type, the variable its (first) index must be,
    whether it takes a second, free int index (tables), and its syntax."""

    type: Type
    index: tuple[str, ...]  # variables allowed as the first index; () = no index
    column: bool  # a second index: any int expression, clamped to the table's columns
    syntax: str
    doc: str


KIND_INFO: dict[ParamKind, KindInfo] = {
    ParamKind.SCALAR: KindInfo(Type.FLOAT, (), False, "name", "one float"),
    ParamKind.SCALAR_INT: KindInfo(Type.INT, (), False, "name", "one int"),
    ParamKind.PER_HEAD: KindInfo(Type.FLOAT, ("h",), False, "name[h]", "float per query head"),
    ParamKind.PER_BATCH: KindInfo(Type.FLOAT, ("b",), False, "name[b]", "float per batch"),
    ParamKind.PER_BATCH_INT: KindInfo(Type.INT, ("b",), False, "name[b]", "int per batch"),
    ParamKind.PER_TOKEN_Q: KindInfo(Type.INT, ("i",), False, "name[i]", "int per query"),
    ParamKind.PER_TOKEN_K: KindInfo(Type.INT, ("j",), False, "name[j]", "int per key"),
    ParamKind.PER_TOKEN: KindInfo(
        Type.INT, ("i", "j"), False, "name[i] or name[j]", "int per token, queries and keys"
    ),
    ParamKind.TABLE: KindInfo(
        Type.FLOAT, ("h",), True, "name[h, k]", "float per head and column k (clamped)"
    ),
}


def _short(node: Expr) -> str:
    text = canonical(node)
    return text if len(text) <= 40 else text[:37] + "..."


def _promote(a: Type, b: Type) -> Type:
    return Type.INT if a is Type.INT and b is Type.INT else Type.FLOAT


# ---------------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expr:
    """A node. `type`, `depth` and `has_s` (whether the score `s` occurs below) are derived at
    construction; `col` is the source column (1-based) or None for built trees."""

    col: int | None = field(default=None, compare=False, repr=False, kw_only=True)
    type: Type = field(init=False, compare=False, repr=False)
    depth: int = field(init=False, compare=False, repr=False)
    has_s: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        kids = self.children()
        object.__setattr__(self, "depth", 1 + max((k.depth for k in kids), default=0))
        own_s = isinstance(self, Var) and self.name == "s"
        object.__setattr__(self, "has_s", own_s or any(k.has_s for k in kids))
        object.__setattr__(self, "type", self._infer())

    def children(self) -> tuple[Expr, ...]:
        return ()

    def _infer(self) -> Type:
        raise NotImplementedError

    def _fail(self, message: str) -> UserModError:
        return UserModError(message, self.col)


@dataclass(frozen=True, eq=False)
class Const(Expr):
    """A literal: int (|v| <= 2^31 - 1), float (finite, within float32's range) or bool.
    Equal only to a literal of the same type (True is not 1)."""

    value: int | float | bool

    def _infer(self) -> Type:
        v = self.value
        if type(v) is bool:
            return Type.BOOL
        if type(v) is int:
            if abs(v) > INT_LITERAL_MAX:
                raise self._fail(
                    f"the int literal {v} is out of range: literals are within +-{INT_LITERAL_MAX}"
                )
            return Type.INT
        if type(v) is float:
            if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
                raise self._fail(
                    f"the float literal {v!r} is out of float32's range (|x| <= {FLOAT32_MAX:.7g})"
                )
            return Type.FLOAT
        raise TypeError(f"Const takes a Python int, float or bool, got {type(v).__name__}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Const):
            return NotImplemented
        return self.type is other.type and self.value == other.value

    def __hash__(self) -> int:
        return hash((Const, self.type, self.value))


@dataclass(frozen=True)
class Var(Expr):
    """A built-in variable (`VARIABLES`)."""

    name: str

    def _infer(self) -> Type:
        if self.name not in VARIABLES:
            raise self._fail(f"unknown variable {self.name!r} (variables: {', '.join(VARIABLES)})")
        return VARIABLES[self.name]


@dataclass(frozen=True)
class Param(Expr):
    """A named runtime parameter of `kind`, read at `index` (see `KIND_INFO`)."""

    name: str
    kind: ParamKind
    index: tuple[Expr, ...] = ()

    def children(self) -> tuple[Expr, ...]:
        return self.index

    def _infer(self) -> Type:
        info = KIND_INFO[self.kind]
        want = (1 if info.index else 0) + (1 if info.column else 0)
        usage = info.syntax.replace("name", self.name)
        if len(self.index) != want:
            raise self._fail(
                f"{self.kind.value} parameter {self.name!r} takes {want} index(es): write {usage}"
            )
        if info.index:
            first = self.index[0]
            if not (isinstance(first, Var) and first.name in info.index):
                raise self._fail(
                    f"{self.kind.value} parameter {self.name!r} is read as {usage} "
                    f"(got {self.name}[{', '.join(canonical(x) for x in self.index)}])"
                )
        if info.column and self.index[-1].type is not Type.INT:
            raise self._fail(
                f"the column of table {self.name!r} must be an int expression, got "
                f"{self.index[-1].type.value} `{_short(self.index[-1])}` (floor(x) makes an int)"
            )
        return info.type


@dataclass(frozen=True)
class Unary(Expr):
    """`-x` (numeric; never of a literal, see `negate`) or `not x` (bool)."""

    op: str
    arg: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.arg,)

    def _infer(self) -> Type:
        t = self.arg.type
        if self.op == "-":
            if isinstance(self.arg, Const) and t.numeric:
                raise ValueError("build a negative literal with negate(), not Unary('-', Const)")
            if not t.numeric:
                raise self._fail(
                    f"unary `-` takes a number, got bool `{_short(self.arg)}` "
                    "(negate a condition with `not`)"
                )
            return t
        if self.op == "not":
            if t is not Type.BOOL:
                raise self._fail(
                    f"`not` takes a bool, got {t.value} `{_short(self.arg)}` "
                    "(compare it first, e.g. `x != 0`)"
                )
            return Type.BOOL
        raise self._fail(f"unknown unary operator {self.op!r} (allowed: -, not)")


@dataclass(frozen=True)
class Binary(Expr):
    """`left op right`: arithmetic, a comparison, or `and` / `or`."""

    op: str
    left: Expr
    right: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.left, self.right)

    def _infer(self) -> Type:
        op, lt, rt = self.op, self.left.type, self.right.type
        if op in LOGICAL:
            for side, t, node in (("left", lt, self.left), ("right", rt, self.right)):
                if t is not Type.BOOL:
                    raise self._fail(
                        f"`{op}` takes bools, but its {side} operand `{_short(node)}` is "
                        f"{t.value} (compare it first, e.g. `x != 0`)"
                    )
            return Type.BOOL
        if op not in ARITHMETIC and op not in COMPARISONS:
            raise self._fail(f"unknown operator {op!r}")
        for side, t, node in (("left", lt, self.left), ("right", rt, self.right)):
            if not t.numeric:
                hint = (
                    "combine conditions with and / or / not"
                    if op in COMPARISONS
                    else "turn a condition into a number with where(c, 1, 0)"
                )
                raise self._fail(
                    f"`{op}` takes numbers, but its {side} operand `{_short(node)}` is bool "
                    f"({hint})"
                )
        if op in ("//", "%"):
            for side, t, node in (("left", lt, self.left), ("right", rt, self.right)):
                if t is not Type.INT:
                    raise self._fail(
                        f"`{op}` is integer floor division / modulo and takes ints, but its "
                        f"{side} operand `{_short(node)}` is float (use `/` for float "
                        "division, floor(x) to make an int)"
                    )
            if isinstance(self.right, Const) and self.right.value == 0:
                raise self._fail(f"`{op}` by the literal 0")
            return Type.INT
        if op in COMPARISONS:
            return Type.BOOL
        if op == "/":
            return Type.FLOAT
        return _promote(lt, rt)


@dataclass(frozen=True)
class Call(Expr):
    """A call of one of `FUNCTIONS`."""

    func: str
    args: tuple[Expr, ...]

    def children(self) -> tuple[Expr, ...]:
        return self.args

    def _infer(self) -> Type:
        f, args = self.func, self.args
        if f not in FUNCTIONS:
            raise self._fail(f"unknown function {f!r} (functions: {', '.join(FUNCTIONS)})")
        if len(args) != FUNCTIONS[f]:
            hint = f" (nest them: {f}(a, {f}(b, c)))" if f in ("min", "max") else ""
            raise self._fail(f"{f}() takes {FUNCTIONS[f]} argument(s), got {len(args)}{hint}")
        types = [a.type for a in args]
        if f == "where":
            c, a, b = args
            if c.type is not Type.BOOL:
                raise self._fail(
                    f"where() needs a bool condition, got {c.type.value} `{_short(c)}` "
                    "(compare it, e.g. where(x != 0, a, b))"
                )
            if a.type is Type.BOOL and b.type is Type.BOOL:
                return Type.BOOL
            if a.type is Type.BOOL or b.type is Type.BOOL:
                raise self._fail(
                    "where()'s branches must both be numbers or both be bools, got "
                    f"{a.type.value} `{_short(a)}` and {b.type.value} `{_short(b)}`"
                )
            return _promote(a.type, b.type)
        for a, t in zip(args, types):
            if not t.numeric:
                raise self._fail(
                    f"{f}() takes numbers, got bool `{_short(a)}` (where(c, a, b) picks by a "
                    "condition)"
                )
        if f in ("min", "max"):
            return _promote(types[0], types[1])
        if f == "abs":
            return types[0]
        if f == "floor":
            return Type.INT
        return Type.FLOAT  # exp, log, tanh


def negate(x: Expr, *, col: int | None = None) -> Expr:
    """`-x`, folding a literal into a negative literal (the parser's rule: `-2`, `-(2)` and
    `--(-2)` are all literals)."""
    if isinstance(x, Const) and x.type.numeric:
        return Const(-x.value, col=col if col is not None else x.col)
    return Unary("-", x, col=col)


def walk(node: Expr) -> Iterator[Expr]:
    """Every node of the tree, parents before children."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children()))


# ---------------------------------------------------------------------------------------------
# canonical text
# ---------------------------------------------------------------------------------------------


def _literal(value: int | float | bool) -> str:
    if type(value) is bool:
        return "True" if value else "False"
    return repr(value)  # ints as digits; floats: the shortest text that reads back exactly


def _text(node: Expr) -> tuple[str, int]:
    """The canonical text of `node` and the precedence of its outermost operator."""
    if isinstance(node, Const):
        text = _literal(node.value)
        return text, NEG_PRECEDENCE if text.startswith("-") else ATOM_PRECEDENCE
    if isinstance(node, Var):
        return node.name, ATOM_PRECEDENCE
    if isinstance(node, Param):
        if not node.index:
            return node.name, ATOM_PRECEDENCE
        return f"{node.name}[{', '.join(canonical(x) for x in node.index)}]", ATOM_PRECEDENCE
    if isinstance(node, Call):
        return f"{node.func}({', '.join(canonical(a) for a in node.args)})", ATOM_PRECEDENCE
    if isinstance(node, Unary):
        arg, p = _text(node.arg)
        if node.op == "-":
            return "-" + (arg if p >= NEG_PRECEDENCE else f"({arg})"), NEG_PRECEDENCE
        return "not " + (arg if p >= PRECEDENCE["not"] else f"({arg})"), PRECEDENCE["not"]
    if isinstance(node, Binary):
        p = PRECEDENCE[node.op]
        left, lp = _text(node.left)
        right, rp = _text(node.right)
        # left-associative; comparisons do not chain, so an operand at their level is wrapped
        if lp < p or (lp == p and node.op in COMPARISONS):
            left = f"({left})"
        if rp <= p:
            right = f"({right})"
        return f"{left} {node.op} {right}", p
    raise TypeError(f"not an expression node: {node!r}")


def canonical(node: Expr) -> str:
    """The canonical text of a tree: single spaces around binary operators, `, ` between
    arguments, parentheses only where the grammar needs them, literals in their shortest exact
    form. Spellings of one tree (whitespace, redundant parentheses, `-(2)` for `-2`) have one
    canonical text, and parsing it gives the tree back."""
    return _text(node)[0]
