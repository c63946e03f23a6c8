"""Simplification and the symbolic derivative d(score_mod)/ds of user-modifier trees.

`simplify` folds constants (in float64, with the evaluator's semantics; a fold whose result
is not a valid literal, e.g. inf, is left undone) and applies type-preserving identities:
`x + 0`, `x - 0`, `0 - x`, `x * 1`, `x * 0`, `x / 1`, `0 / x`, `--x`, `a + -b`, `a - -b`,
`not not c`, `where` with a literal or `not` condition or equal branches, `and` / `or` with a
literal. `x * 0 -> 0` and `0 / x -> 0` are symbolic (they drop a NaN an infinite or zero `x`
would give): right for derivatives, whose zero terms are exact.

`derivative` differentiates in the score `s`. Differentiable: `+ - * /`, unary `-`, `exp`,
`log`, `tanh`, `where` whose branches (not condition) depend on s, and the continuous kinks
`abs`, `min`, `max`, which take a subgradient: `abs'(0) = +1` and, at a tie, the first
argument's side (`min(a, b)' = where(a <= b, a', b')`, `max(a, b)' = where(a >= b, a', b')`).
Refused, with UserModError: a `where` condition, a comparison or a `floor` that depends on s
(step functions: the derivative is not defined at the steps), and so an int or bool
subexpression of s anywhere (`//`, `%`, table columns).
"""

from __future__ import annotations

from .numeric import evaluate
from .tree import (
    COMPARISONS,
    Binary,
    Call,
    Const,
    Expr,
    Param,
    Type,
    Unary,
    UserModError,
    Var,
    canonical,
    negate,
    walk,
)

__all__ = ["derivative", "simplify"]

ZERO = Const(0.0)
ONE = Const(1.0)


def _is(node: Expr, value: float) -> bool:
    return isinstance(node, Const) and node.type.numeric and node.value == value


def _as(node: Expr, t: Type) -> Expr | None:
    """`node` as a node of type `t` without changing its value, or None (an int literal becomes
    a float one; other int nodes would need a conversion the grammar spells `* 1.0`)."""
    if node.type is t:
        return node
    if t is Type.FLOAT and isinstance(node, Const) and node.type is Type.INT:
        return Const(float(node.value), col=node.col)
    return None


def _zero(t: Type) -> Const:
    return Const(0.0) if t is Type.FLOAT else Const(0)


def _fold(node: Expr) -> Expr | None:
    kids = node.children()
    if not kids or isinstance(node, Param) or not all(isinstance(k, Const) for k in kids):
        return None
    value = evaluate(node).item()
    try:
        return Const(value, col=node.col)
    except UserModError:  # e.g. an int beyond the literal range, an infinite float
        return None


def simplify(node: Expr) -> Expr:
    """An equal-valued tree with constants folded and the identities of the module doc
    applied, bottom-up. The result has the same type."""
    if isinstance(node, (Const, Var)):
        return node
    if isinstance(node, Param):
        if not node.index:
            return node
        return Param(node.name, node.kind, tuple(simplify(x) for x in node.index), col=node.col)
    if isinstance(node, Unary):
        return _unary(node.op, simplify(node.arg), node.col)
    if isinstance(node, Binary):
        return _binary(node.op, simplify(node.left), simplify(node.right), node.col)
    if isinstance(node, Call):
        return _call(node.func, tuple(simplify(a) for a in node.args), node.col)
    raise TypeError(f"not an expression node: {node!r}")


def _unary(op: str, arg: Expr, col: int | None = None) -> Expr:
    if op == "-":
        if isinstance(arg, Unary) and arg.op == "-":
            return arg.arg
        return negate(arg, col=col)
    if isinstance(arg, Const):
        return Const(not arg.value, col=col)
    if isinstance(arg, Unary) and arg.op == "not":
        return arg.arg
    return Unary("not", arg, col=col)


def _negative(node: Expr) -> bool:
    return isinstance(node, Const) and node.type.numeric and node.value < 0


def _binary(op: str, left: Expr, right: Expr, col: int | None = None) -> Expr:
    if op in ("//", "%") and isinstance(right, Const) and right.value == 0:
        # a divisor that folds to 0 (`0 // abs(0)`): the value is 0, as at run time (a
        # literal 0 divisor, which the tree refuses, is only refused as written)
        return Const(0, col=col)
    node = Binary(op, left, right, col=col)
    folded = _fold(node)
    if folded is not None:
        return folded
    t = node.type
    if op in ("and", "or"):
        for a, b in ((left, right), (right, left)):
            if isinstance(a, Const):
                # True and b = b, False and b = False; False or b = b, True or b = True
                return b if a.value == (op == "and") else a
        return node
    candidates: list[Expr | None] = []
    if op == "+":
        if _is(right, 0):
            candidates.append(_as(left, t))
        if _is(left, 0):
            candidates.append(_as(right, t))
        if isinstance(right, Unary) and right.op == "-":
            return _binary("-", left, right.arg, col)
        if _negative(right):
            return _binary("-", left, negate(right), col)
    elif op == "-":
        if _is(right, 0):
            candidates.append(_as(left, t))
        if _is(left, 0):
            r = _as(right, t)
            candidates.append(None if r is None else _unary("-", r, col))
        if isinstance(right, Unary) and right.op == "-":
            return _binary("+", left, right.arg, col)
        if _negative(right):
            return _binary("+", left, negate(right), col)
    elif op == "*":
        if _is(left, 0) or _is(right, 0):
            return _zero(t)
        if _is(right, 1):
            candidates.append(_as(left, t))
        if _is(left, 1):
            candidates.append(_as(right, t))
        if _is(right, -1):
            a = _as(left, t)
            candidates.append(None if a is None else _unary("-", a, col))
        if _is(left, -1):
            b = _as(right, t)
            candidates.append(None if b is None else _unary("-", b, col))
    elif op == "/":
        if _is(left, 0):
            return ZERO
        if _is(right, 1):
            candidates.append(_as(left, Type.FLOAT))
    for c in candidates:
        if c is not None:
            return c
    return node


def _call(func: str, args: tuple[Expr, ...], col: int | None = None) -> Expr:
    node = Call(func, args, col=col)
    folded = _fold(node)
    if folded is not None:
        return folded
    if func == "where":
        c, a, b = args
        pick = (a if c.value else b) if isinstance(c, Const) else a if a == b else None
        if pick is not None:
            typed = _as(pick, node.type)
            if typed is not None:
                return typed
        if isinstance(c, Unary) and c.op == "not":
            return _call("where", (c.arg, b, a), col)
    return node


# ---------------------------------------------------------------------------------------------
# d/ds
# ---------------------------------------------------------------------------------------------


def _refusal(node: Expr) -> UserModError:
    """Why `node`, an int or bool expression of s, has no derivative: the outermost step
    (floor, comparison, where condition) through which s enters it."""
    for n in walk(node):
        if isinstance(n, Call) and n.func == "where" and n.args[0].has_s:
            return _where_refusal(n)
        if isinstance(n, Call) and n.func == "floor" and n.args[0].has_s:
            return UserModError(
                f"not differentiable in s: floor() of an expression of s (`{canonical(n)}`) is a "
                "step function, whose d/ds is undefined at the steps; a score_mod's backward "
                "needs d/ds, so floor() may only take expressions without s",
                n.col,
            )
        if isinstance(n, Binary) and n.op in COMPARISONS and n.has_s:
            return UserModError(
                f"not differentiable in s: the comparison `{canonical(n)}` depends on s and "
                "switches at a point where d/ds is not defined; compare only expressions "
                "without s (min(), max() and abs() are continuous and allowed)",
                n.col,
            )
    return UserModError(
        f"not differentiable in s: `{canonical(node)}` is {node.type.value}-valued and "
        "depends on s",
        node.col,
    )


def _where_refusal(n: Call) -> UserModError:
    return UserModError(
        f"not differentiable in s: the condition of where() (`{canonical(n.args[0])}`) depends "
        "on s, and d/ds is not defined where it switches; only where()'s branches may depend "
        "on s (min(), max() and abs() are continuous and allowed)",
        n.col,
    )


def _d(e: Expr) -> Expr:
    """d e / ds, unsimplified; `e` is float, or free of s."""
    if not e.has_s:
        return ZERO
    if e.type is not Type.FLOAT:
        raise _refusal(e)
    if isinstance(e, Var):  # only s has s
        return ONE
    if isinstance(e, Param):  # a table whose column depends on s
        raise _refusal(e.index[-1])
    if isinstance(e, Unary):
        return negate(_d(e.arg))
    if isinstance(e, Binary):
        a, b = e.left, e.right
        if e.op in ("+", "-"):
            return Binary(e.op, _d(a), _d(b))
        if e.op == "*":
            return Binary("+", Binary("*", _d(a), b), Binary("*", a, _d(b)))
        if e.op == "/":
            if not b.has_s:
                return Binary("/", _d(a), b)
            num = Binary("-", Binary("*", _d(a), b), Binary("*", a, _d(b)))
            return Binary("/", num, Binary("*", b, b))
        raise _refusal(e)  # a float Binary is arithmetic; kept for safety
    if isinstance(e, Call):
        f, args = e.func, e.args
        if f == "where":
            if args[0].has_s:
                raise _where_refusal(e)
            return Call("where", (args[0], _d(args[1]), _d(args[2])))
        if f in ("min", "max"):
            a, b = args
            pick = Binary("<=" if f == "min" else ">=", a, b)
            return Call("where", (pick, _d(a), _d(b)))
        (x,) = args
        dx = _d(x)
        if f == "abs":
            return Call("where", (Binary("<", x, ZERO), negate(dx), dx))
        if f == "exp":
            return Binary("*", e, dx)
        if f == "log":
            return Binary("/", dx, x)
        if f == "tanh":
            return Binary("*", Binary("-", ONE, Binary("*", e, e)), dx)
    raise _refusal(e)


def derivative(tree: Expr) -> Expr:
    """d tree / ds, simplified: a float tree of the same variables and parameters. Raises
    UserModError (with the offending column) for the constructs the module doc refuses."""
    if tree.type is not Type.FLOAT:
        raise UserModError(
            f"d/ds is taken of a float expression (a score_mod), got {tree.type.value}", tree.col
        )
    return simplify(_d(tree))
