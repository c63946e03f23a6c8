"""User-defined score_mod / mask_mod expressions (generator.usermod): the parser and its
refusals, the canonical text, the derivative, the C++ emission (compiled and run by nvcc), the
numpy evaluators and the block classification, on hand-written cases, on the shipped examples
against the project's own reference, and on random well-typed trees (Hypothesis)."""

from __future__ import annotations

import math
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from flashgen.generator import usermod as U
from flashgen.generator.features.user import KERNEL_INT_BOUNDS, TOKEN_KINDS
from flashgen.generator.usermod import Binary, Call, Const, Param, ParamKind, Type, Var, negate
from flashgen.verify import reference as R
from flashgen.verify import score_mods as M
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

REPO = Path(__file__).resolve().parent.parent
FLOAT, INT, BOOL = Type.FLOAT, Type.INT, Type.BOOL

# ---------------------------------------------------------------------------------------------
# a fixed set of parameters, their values, and a grid of the variables
# ---------------------------------------------------------------------------------------------

PARAMS = {
    "cap": "scalar",
    "n": "scalar_int",
    "slopes": "per_head",
    "w": "per_batch",
    "pre": "per_batch_int",
    "dq": "per_token_q",
    "dk": "per_token_k",
    "doc": "per_token",
    "bias": "table",
}
B, H, SQ, SK = 2, 3, 6, 7
VALUES = {  # float32-representable floats: the two evaluators read the same values
    "cap": 1.5,
    "n": 3,
    "slopes": np.array([0.5, -0.25, 2.0]),
    "w": np.array([1.25, -0.75]),
    "pre": np.array([2, -3]),
    "dq": np.array([0, 0, 1, -2, 5, 1]),
    "dk": np.array([0, 1, 1, 3, -2, 0, 4]),
    "doc": np.array([0, 0, 1, 1, 1, 2, 2]),
    "bias": np.array(
        [[0.5, -1.0, 2.0, 0.25, -3.0], [1.0, 0.0, -0.5, 4.0, 0.75], [-2.0, 1.5, 0.5, -0.25, 3.0]]
    ),
}
S_VALUES = np.array([-2.5, -0.75, 0.0, 0.5, 3.25])


def grid(s: np.ndarray | None = S_VALUES) -> dict:
    """Every (b, h, i, j[, s]) of the fixed problem, broadcast in that order."""
    env = {
        "b": np.arange(B).reshape(B, 1, 1, 1, 1),
        "h": np.arange(H).reshape(1, H, 1, 1, 1),
        "i": np.arange(SQ).reshape(1, 1, SQ, 1, 1),
        "j": np.arange(SK).reshape(1, 1, 1, SK, 1),
        "seqlen_q": SQ,
        "seqlen_k": SK,
    }
    if s is not None:
        env["s"] = np.asarray(s).reshape(1, 1, 1, 1, -1)
    return env


def parse(text: str) -> U.Expr:
    return U.parse_expr(text, PARAMS)


# ---------------------------------------------------------------------------------------------
# random well-typed trees, from one integer choice (Hypothesis's draw, or random.Random)
# ---------------------------------------------------------------------------------------------

FLOAT_LITERALS = (0.5, 1.0, 2.0, 0.25, 3.0, 1.5, 0.0, -0.5, -2.0, 0.1, 7.0)
INT_VARS = ("b", "h", "i", "j", "seqlen_q", "seqlen_k")


class TreeGen:
    """Random trees of a given type. `s`: the score may occur; `pure_ints`: int and bool
    subtrees hold no float (no floor, no float comparison: no step of s, so the tree is
    differentiable, and the float32 and float64 evaluators agree on every int and bool);
    `transcendental`: exp, log and tanh may occur."""

    def __init__(self, choose, *, s=True, pure_ints=False, transcendental=True):
        self.choose = choose
        self.s = s
        self.pure_ints = pure_ints
        self.transcendental = transcendental

    def pick(self, options):
        return options[self.choose(0, len(options) - 1)]

    def tree(self, ty: Type, depth: int) -> U.Expr:
        if depth <= 0 or self.choose(0, 3) == 0:
            return self.leaf(ty)
        return {INT: self.int_node, FLOAT: self.float_node, BOOL: self.bool_node}[ty](depth - 1)

    def leaf(self, ty: Type) -> U.Expr:
        if ty is BOOL:
            return Const(bool(self.choose(0, 1)))
        if ty is INT:
            k = self.choose(0, 2)
            if k == 0:
                return Const(self.choose(-7, 7))
            if k == 1:
                return Var(self.pick(INT_VARS))
            return self.pick(
                [
                    lambda: Param("n", U.ParamKind.SCALAR_INT),
                    lambda: Param("pre", U.ParamKind.PER_BATCH_INT, (Var("b"),)),
                    lambda: Param("dq", U.ParamKind.PER_TOKEN_Q, (Var("i"),)),
                    lambda: Param("dk", U.ParamKind.PER_TOKEN_K, (Var("j"),)),
                    lambda: Param("doc", U.ParamKind.PER_TOKEN, (Var(self.pick("ij")),)),
                ]
            )()
        k = self.choose(0, 3 if self.s else 2)
        if k == 0:
            return Const(self.pick(FLOAT_LITERALS))
        if k == 1:
            return Param("cap", U.ParamKind.SCALAR)
        if k == 2:
            if self.choose(0, 1):
                return Param("slopes", U.ParamKind.PER_HEAD, (Var("h"),))
            return Param("w", U.ParamKind.PER_BATCH, (Var("b"),))
        return Var("s")

    def number(self, depth: int, float_ok: bool = True) -> U.Expr:
        return self.tree(FLOAT if float_ok and self.choose(0, 1) else INT, depth)

    def int_node(self, depth: int) -> U.Expr:
        k = self.choose(0, 6 if self.pure_ints else 7)
        if k == 0:
            op = self.pick(["+", "-", "*", "//", "%"])
            left, right = self.tree(INT, depth), self.tree(INT, depth)
            if op in ("//", "%") and right == Const(0):
                right = Const(3)
            return Binary(op, left, right)
        if k == 1:
            return negate(self.tree(INT, depth))
        if k == 2:
            return Call("abs", (self.tree(INT, depth),))
        if k in (3, 4):
            return Call(self.pick(["min", "max"]), (self.tree(INT, depth), self.tree(INT, depth)))
        if k in (5, 6):
            return Call(
                "where", (self.tree(BOOL, depth), self.tree(INT, depth), self.tree(INT, depth))
            )
        return Call("floor", (self.tree(FLOAT, depth),))

    def float_node(self, depth: int) -> U.Expr:
        k = self.choose(0, 8 if self.transcendental else 7)
        if k in (0, 1, 2):
            op = self.pick(["+", "-", "*", "/"])
            sides = [(FLOAT, FLOAT), (FLOAT, INT), (INT, FLOAT)] + (
                [(INT, INT)] if op == "/" else []
            )
            lt, rt = self.pick(sides)
            return Binary(op, self.tree(lt, depth), self.tree(rt, depth))
        if k == 3:
            return negate(self.tree(FLOAT, depth))
        if k == 4:
            return Call("abs", (self.tree(FLOAT, depth),))
        if k == 5:
            f = self.pick(["min", "max"])
            return Call(f, (self.tree(FLOAT, depth), self.number(depth)))
        if k == 6:
            c = self.tree(BOOL, depth)
            a, b = self.tree(FLOAT, depth), self.number(depth)
            return Call("where", (c, a, b) if self.choose(0, 1) else (c, b, a))
        if k == 7:
            return Param("bias", U.ParamKind.TABLE, (Var("h"), self.tree(INT, depth)))
        return Call(self.pick(["exp", "log", "tanh"]), (self.number(depth),))

    def bool_node(self, depth: int) -> U.Expr:
        k = self.choose(0, 5)
        if k in (0, 1, 2):
            op = self.pick(["<", "<=", ">", ">=", "==", "!="])
            if self.pure_ints:
                return Binary(op, self.tree(INT, depth), self.tree(INT, depth))
            return Binary(op, self.number(depth), self.number(depth))
        if k == 3:
            op = self.pick(["and", "or"])
            return Binary(op, self.tree(BOOL, depth), self.tree(BOOL, depth))
        if k == 4:
            return U.Unary("not", self.tree(BOOL, depth))
        args = (self.tree(BOOL, depth), self.tree(BOOL, depth), self.tree(BOOL, depth))
        return Call("where", args)


@st.composite
def trees(draw, ty=None, depth=4, **opts):
    gen = TreeGen(lambda lo, hi: draw(st.integers(lo, hi)), **opts)
    if ty is None:
        ty = gen.pick([FLOAT, INT, BOOL])
    return gen.tree(ty, depth)


def random_trees(seed: int, count: int, ty: Type, depth: int = 4, **opts) -> list[U.Expr]:
    rng = random.Random(seed)
    gen = TreeGen(rng.randint, **opts)
    return [gen.tree(ty, depth) for _ in range(count)]


def spell(node: U.Expr, choose) -> str:
    """A noisy spelling of `node`: every compound parenthesised, some atoms too, random
    spaces, negative literals as `- (v)`."""

    def sp() -> str:
        return " " * choose(0, 2)

    def atom(text: str) -> str:
        return f"({sp()}{text}{sp()})" if choose(0, 3) == 0 else text

    if isinstance(node, Const):
        v = node.value
        if type(v) is bool:
            return atom(repr(v))
        if v < 0 or (type(v) is float and math.copysign(1.0, v) < 0):
            return f"-{sp()}({sp()}{repr(-v)}{sp()})"
        return atom(repr(v) if type(v) is int or choose(0, 1) else format(v, ".17e"))
    if isinstance(node, Var):
        return atom(node.name)
    if isinstance(node, Param):
        if not node.index:
            return atom(node.name)
        inner = f"{sp()},{sp()}".join(spell(x, choose) for x in node.index)
        return f"{node.name}{sp()}[{sp()}{inner}{sp()}]"
    if isinstance(node, U.Unary):
        gap = " " + sp() if node.op == "not" else sp()
        return f"({sp()}{node.op}{gap}({spell(node.arg, choose)}){sp()})"
    if isinstance(node, Binary):
        gap = (lambda: " " + sp()) if node.op in ("and", "or") else sp
        return f"({spell(node.left, choose)}{gap()}{node.op}{gap()}{spell(node.right, choose)})"
    args = f"{sp()},{sp()}".join(spell(a, choose) for a in node.args)
    return f"{node.func}{sp()}({sp()}{args}{sp()})"


# ---------------------------------------------------------------------------------------------
# parser, canonical text
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, canon",
    [
        ("s+1", "s + 1"),
        ("((s))", "s"),
        ("- ( 2 )", "-2"),
        ("--2", "2"),
        ("-(-(s))", "--s"),
        ("- 2.5 * s", "-2.5 * s"),
        ("-(2.5 * s)", "-(2.5 * s)"),
        ("i - (j - 1)", "i - (j - 1)"),
        ("(i - j) - 1", "i - j - 1"),
        ("i - -3", "i - -3"),
        ("i // 2 % 3", "i // 2 % 3"),
        ("i // (2 % 3)", "i // (2 % 3)"),
        ("(i + j) * 2", "(i + j) * 2"),
        ("not (j <= i and i < 3)", "not (j <= i and i < 3)"),
        ("(not j <= i) and i < 3", "not j <= i and i < 3"),
        ("j<i or (i<j and True)", "j < i or i < j and True"),
        ("(j < i or i < j) and True", "(j < i or i < j) and True"),
        ("where( j<=i ,s, -1e4 )", "where(j <= i, s, -10000.0)"),
        ("bias[ h , min(abs(i-j)//8, 31) ]", "bias[h, min(abs(i - j) // 8, 31)]"),
        ("1.", "1.0"),
        (".5", "0.5"),
        ("2e3", "2000.0"),
        ("1E-5", "1e-05"),
        ("slopes[h]*abs(i-j)", "slopes[h] * abs(i - j)"),
    ],
)
def test_canonical_text_of_hand_written_spellings(text, canon):
    tree = parse(text)
    assert U.canonical(tree) == canon
    assert parse(canon) == tree


def test_spellings_of_one_modifier_share_canonical_text_and_digest():
    a = U.parse_score_mod("cap*tanh(s/cap)", {"cap": "scalar"})
    b = U.parse_score_mod("  (cap) * tanh( ((s)) / cap )\n", {"cap": "scalar"})
    assert a == b and a.canonical == b.canonical == "cap * tanh(s / cap)"
    assert a.digest() == b.digest() and len(a.digest()) == 8
    c = U.parse_score_mod("cap * tanh(s / cap)", {"cap": "scalar", "x": "per_head"})
    assert c.digest() != a.digest()  # the declared parameters are part of the interface
    d = U.parse_mask_mod("j <= i")
    assert d.digest() != U.parse_mask_mod("i >= j").digest()  # not equivalent spellings


def test_literals_are_typed_and_true_is_not_one():
    assert parse("True").type is BOOL and parse("1").type is INT and parse("1.0").type is FLOAT
    assert parse("1") != parse("1.0") and parse("True") != parse("1")
    assert Const(True) != Const(1) and hash(Const(2)) == hash(parse("2"))


def test_user_mod_reports_its_variables_and_parameters():
    m = U.parse_score_mod("s - slopes[h] * abs(i - j)", PARAMS)
    assert m.variables == {"s", "h", "i", "j"}
    assert m.used_params == (("slopes", U.ParamKind.PER_HEAD),)
    assert [name for name, _ in m.params] == sorted(PARAMS)


@settings(max_examples=300, deadline=None)
@given(trees())
def test_canonical_text_parses_back_to_the_tree(tree):
    text = U.canonical(tree)
    again = parse(text)
    assert again == tree
    assert U.canonical(again) == text


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_noisy_spellings_parse_to_the_tree_and_its_canonical_text(data):
    tree = data.draw(trees())
    text = spell(tree, lambda lo, hi: data.draw(st.integers(lo, hi)))
    assert parse(text) == tree
    assert U.canonical(parse(text)) == U.canonical(tree)


# ---------------------------------------------------------------------------------------------
# refusals: every class, with its message and column
# ---------------------------------------------------------------------------------------------

REFUSED = [
    # (text, kind, words of the message, column)
    ("", "expr", "is empty", 1),
    ("s +", "expr", "ends where an operand is expected", 4),
    ("(s", "expr", "expected `)` to close the `(` at column 1", 3),
    ("s )", "expr", "unexpected `)` after a complete expression", 3),
    ("s s", "expr", "unexpected `s`", 3),
    ("s ** 2", "expr", "`**` (power) is not in the grammar", 3),
    ("s ^ 2", "expr", "neither power nor xor", 3),
    ("s = 1", "expr", "compare with `==`", 3),
    ("i < j and !(i == 0)", "expr", "write `not`", 11),
    ("i && j", "expr", "write `and`", 3),
    ("i | j", "expr", "bitwise `|`", 3),
    ("~i", "expr", "`~` is not in the grammar", 1),
    ("i << 1", "expr", "bit shifts", 3),
    ("s > 0 ? s : 0", "expr", "where(c, a, b)", 7),
    ("s if i else 0", "expr", "where(c, a, b)", 3),
    ("s # note", "expr", "comments", 3),
    ("'s'", "expr", "strings", 1),
    ("s.real", "expr", "attribute access", 2),
    ("2i", "expr", "malformed number '2i'", 1),
    ("1_000", "expr", "without underscores", 1),
    ("+s", "expr", "unary `+`", 1),
    ("1e400", "expr", "out of float32's range", 1),
    ("4294967296", "expr", "out of range", 1),
    ("i < j < 3", "expr", "comparisons do not chain", 7),
    ("slope[h]", "expr", "did you mean 'slopes'?", 1),
    ("tanhh(s)", "expr", "did you mean 'tanh'?", 1),
    ("sqrt(s)", "expr", "unknown name 'sqrt'", 1),
    ("seqlen", "expr", "did you mean 'seqlen_q'?", 1),
    ("lambda", "expr", "not a lambda", 1),
    ("None", "expr", "the Python keyword `None`", 1),
    ("true", "expr", "spelled True and False", 1),
    ("s and True", "expr", "`and` takes bools, but its left operand `s` is float", 3),
    ("i(2)", "expr", "'i' is a variable and cannot be called", 2),
    ("i[2]", "expr", "'i' is a variable and cannot be indexed", 2),
    ("exp", "expr", "exp is a function: call it as exp(...)", 1),
    ("max(s, 1, 2)", "expr", "max() takes 2 argument(s), got 3", 1),
    ("exp()", "expr", "expected an operand", 5),
    ("slopes", "expr", "per_head parameter 'slopes' is read as slopes[h]", 1),
    ("slopes[i]", "expr", "is read as slopes[h] (got slopes[i])", 1),
    ("doc[h]", "expr", "doc[i] or doc[j]", 1),
    ("cap[h]", "expr", "scalar parameter 'cap' takes no index", 4),
    ("bias[h]", "expr", "takes 2 index(es): write bias[h, k]", 1),
    ("bias[h, s]", "expr", "the column of table 'bias' must be an int expression", 1),
    # types
    ("s // 2", "expr", "`//` is integer floor division / modulo and takes ints", 3),
    ("i % 2.0", "expr", "its right operand `2.0` is float", 3),
    ("i // 0", "expr", "by the literal 0", 3),
    ("where(i, s, 0.0)", "expr", "where() needs a bool condition, got int `i`", 1),
    ("where(j < i, s, j < i)", "expr", "both be numbers or both be bools", 1),
    ("(j < i) + 1", "expr", "`+` takes numbers", 9),
    ("(j < i) < (i < j)", "expr", "combine conditions with and / or / not", 9),
    ("not i", "expr", "`not` takes a bool, got int `i`", 1),
    ("-(j < i)", "expr", "unary `-` takes a number", 1),
    ("exp(j < i)", "expr", "exp() takes numbers", 1),
    ("i and j < 3", "expr", "`and` takes bools, but its left operand `i` is int", 3),
    # the kind's rules
    ("i - j", "score", "a score_mod must give a float score, but this expression is int", 3),
    ("j <= i", "score", "this expression is bool (a comparison or mask belongs", 3),
    ("s > 0", "mask", "the score `s` is not available in a mask_mod", 1),
    ("i - j", "mask", "a mask_mod must give a bool", 3),
    # differentiability (score_mod, need_grad)
    ("where(s > 0, s, 0.0)", "score", "the condition of where() (`s > 0`) depends on s", 1),
    ("s * floor(s)", "score", "floor() of an expression of s (`floor(s)`) is a step", 5),
    ("s + where(i // floor(s) > 0, 1.0, 0.0)", "score", "the condition of where()", 5),
    ("bias[h, floor(s * 4.0)]", "score", "floor() of an expression of s", 9),
    # limits
    ("(" * 60 + "s" + ")" * 60, "expr", "nests deeper than 48 levels", 49),
    ("-" * 1500 + "s", "expr", "nests deeper than 48 levels", 49),
    ("not " * 400 + "True", "expr", "nests deeper than 48 levels", 193),
    ("s" + " + s" * 60, "expr", "deeper than 48 levels", 191),
    ("s" + " " * 2000, "expr", "at most 2000 are allowed", None),
]


@pytest.mark.parametrize("text, kind, words, column", REFUSED, ids=[r[0][:24] for r in REFUSED])
def test_refusals_say_what_is_wrong_and_where(text, kind, words, column):
    parse_fn = {
        "expr": lambda t: U.parse_expr(t, PARAMS),
        "score": lambda t: U.parse_score_mod(t, PARAMS),
        "mask": lambda t: U.parse_mask_mod(t, PARAMS),
    }[kind]
    with pytest.raises(U.UserModError) as info:
        parse_fn(text)
    err = info.value
    assert words in err.message, err.message
    assert err.column == column, (err.column, err.message)
    assert str(err) == (err.message if column is None else f"column {column}: {err.message}")


def test_operator_refusals_list_what_is_allowed():
    with pytest.raises(U.UserModError) as info:
        parse("s @ s")
    assert "allowed: operators + - * / // % < <= > >= == != and or not" in info.value.message
    assert "where(), min(), max(), abs(), exp(), log(), tanh(), floor()" in info.value.message


def test_unknown_names_list_variables_parameters_and_functions():
    with pytest.raises(U.UserModError) as info:
        U.parse_mask_mod("slope[h] > 0", {"slopes": "per_head"})
    msg = info.value.message
    assert "did you mean 'slopes'?" in msg and "parameters: slopes" in msg
    assert "variables: b, h, i, j, seqlen_q, seqlen_k;" in msg  # no s in a mask_mod
    with pytest.raises(U.UserModError, match=r"declare runtime values as params"):
        U.parse_score_mod("s * scale")


@pytest.mark.parametrize(
    "params, words",
    [
        ({"i": "scalar"}, "is a variable"),
        ({"exp": "scalar"}, "is a function"),
        ({"and": "scalar"}, "a word of the grammar"),
        ({"lambda": "scalar"}, "a Python keyword"),
        ({"int": "scalar"}, "a C++ keyword"),
        ({"this": "scalar"}, "a C++ keyword"),
        ({"a__b": "scalar"}, "reserved"),
        ({"fg_x": "scalar"}, "reserved"),
        ({"_x": "scalar"}, "a letter, then letters, digits, _"),
        ({"x-y": "scalar"}, "a letter, then"),
        ({"x": "perhead"}, "did you mean 'per_head'?"),
        ({"x": "vector"}, "kinds: scalar, scalar_int, per_head"),
    ],
)
def test_parameter_declarations_are_checked(params, words):
    with pytest.raises(U.UserModError) as info:
        U.check_params(params)
    assert words in info.value.message


def test_pathological_input_is_refused_without_recursion_errors():
    for text in ["(" * 1000 + "s" + ")" * 999, "-" * 1999 + "s", "not " * 499 + "s", "s+" * 999]:
        with pytest.raises(U.UserModError):
            parse(text)
    # just inside the limits: parses, and every stage handles the depth
    deep = "s" + " + s" * 46
    tree = parse(deep)
    assert tree.depth == 47
    mod = U.parse_score_mod(deep)
    assert U.canonical(mod.derivative) == "47.0"
    U.emit_cpp(tree, {"s": "x"})
    nested = "(" * 47 + "s" + ")" * 47
    assert parse(nested) == Var("s")


def test_constructors_refuse_ill_typed_trees_and_keep_the_literal_invariant():
    with pytest.raises(U.UserModError, match="takes ints"):
        Binary("//", Var("s"), Const(2))
    with pytest.raises(ValueError, match="negate"):
        U.Unary("-", Const(2))
    assert negate(Const(2)) == Const(-2) and negate(Var("s")) == U.Unary("-", Var("s"))
    with pytest.raises(TypeError):
        Const(np.int64(2))


# ---------------------------------------------------------------------------------------------
# simplification and the derivative
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, simple",
    [
        ("s + 0", "s"),
        ("0.0 + s", "s"),
        ("s - 0.0", "s"),
        ("0.0 - s", "-s"),
        ("s * 1.0", "s"),
        ("1 * s", "s"),
        ("0 * s", "0.0"),
        ("s * 0", "0.0"),
        ("i * 1", "i"),
        ("i * 1.0", "i * 1.0"),  # the conversion to float stays
        ("i + 0.0", "i + 0.0"),
        ("s / 1", "s"),
        ("0 / s", "0.0"),
        ("s * -1.0", "-s"),
        ("--s", "s"),
        ("s + -s", "s - s"),
        ("s - -s", "s + s"),
        ("s + -2", "s - 2"),
        ("s - -2.0", "s + 2.0"),
        ("2 + 3 * 4", "14"),
        ("7 // -2", "-4"),
        ("7 % -2", "-1"),
        ("-7 // 2 + -7 % 2", "-3"),
        ("exp(0.0) * s", "s"),
        ("min(2, 3.5)", "2.0"),
        ("floor(-2.5)", "-3"),
        ("1.0 / 0.0", "1.0 / 0.0"),  # inf is no literal: left unfolded
        ("100000 * 100000", "100000 * 100000"),  # beyond the int literal range
        ("where(True, s, 2.0)", "s"),
        ("where(False, s, 2)", "2.0"),
        ("where(j < i, s, s)", "s"),
        ("where(not j < i, s, 1.0)", "where(j < i, 1.0, s)"),
        ("not not j < i", "j < i"),
        ("True and j < i", "j < i"),
        ("j < i and False", "False"),
        ("j < i or True", "True"),
        ("False or j < i", "j < i"),
        ("bias[h, 1 + 2]", "bias[h, 3]"),
    ],
)
def test_simplify(text, simple):
    tree = parse(text)
    out = U.simplify(tree)
    assert U.canonical(out) == simple
    assert out.type is tree.type


@pytest.mark.parametrize(
    "text, deriv",
    [
        ("s", "1.0"),
        ("2.0 * s + 1", "2.0"),
        ("s * s", "s + s"),
        ("s / cap", "1.0 / cap"),
        ("cap / s", "-cap / (s * s)"),
        ("exp(s)", "exp(s)"),
        ("log(s)", "1.0 / s"),
        ("tanh(s)", "1.0 - tanh(s) * tanh(s)"),
        ("cap * tanh(s / cap)", "cap * ((1.0 - tanh(s / cap) * tanh(s / cap)) * (1.0 / cap))"),
        ("abs(s)", "where(s < 0.0, -1.0, 1.0)"),
        ("min(s, 2.0)", "where(s <= 2.0, 1.0, 0.0)"),
        ("max(0.5 * s, s)", "where(0.5 * s >= s, 0.5, 1.0)"),
        ("where(j <= i, s, -s)", "where(j <= i, 1.0, -1.0)"),
        ("s - slopes[h] * abs(i - j)", "1.0"),
        ("bias[h, i - j] + i * 2.0", "0.0"),
        ("-s", "-1.0"),
    ],
)
def test_derivative_forms(text, deriv):
    assert U.canonical(U.derivative(parse(text))) == deriv


def test_a_divisor_that_folds_to_zero_folds_to_the_run_time_value():
    # `0 // abs(0)` is no literal zero divisor, so it parses; simplifying it gives 0, the
    # value a kernel computes, instead of building the refused `x // 0`
    mod = U.parse_score_mod("s + bias[h, 7 // abs(0)] + 3 % abs(0)", {"bias": "table"})
    assert U.canonical(U.simplify(mod.tree)) == "s + bias[h, 0]"
    assert U.canonical(U.derivative(mod.tree)) == "1.0"


def test_derivative_refuses_int_and_bool_trees():
    with pytest.raises(U.UserModError, match="d/ds is taken of a float expression"):
        U.derivative(parse("i - j"))
    with pytest.raises(U.UserModError, match="a mask_mod has no derivative"):
        _ = U.parse_mask_mod("j <= i").derivative
    # a score_mod for a forward-only kernel may skip the check
    mod = U.parse_score_mod("where(s > 0, s, 0.0)", need_grad=False)
    with pytest.raises(U.UserModError, match="the condition of where"):
        _ = mod.derivative


def finite_throughout(tree, env) -> np.ndarray:
    """Where every float subexpression of `tree` is finite (an infinite intermediate, as in
    `1.0 / (s / 0)`, makes the symbolic derivative NaN where the float function is flat)."""
    ok = np.ones((), dtype=bool)
    for node in U.walk(tree):
        if node.type is FLOAT:
            ok = ok & np.isfinite(U.evaluate(node, env, VALUES))
    return ok


def central_difference(tree, env, s, step):
    with np.errstate(all="ignore"):
        up = U.evaluate(tree, {**env, "s": s + step}, VALUES)
        down = U.evaluate(tree, {**env, "s": s - step}, VALUES)
        return (up - down) / (2 * step)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(trees(FLOAT, s=True, pure_ints=True))
def test_derivative_matches_central_differences_away_from_kinks(tree):
    deriv = U.derivative(tree)  # pure_ints trees are differentiable
    # s off the grid of the literals' kinks (abs(s + 1.0) has one at -1)
    s = np.linspace(-2.9, 3.1, 41) + 0.0137
    env = grid(None)
    env["s"] = s.reshape(1, 1, 1, 1, -1)
    step = 1e-5 * np.maximum(1.0, np.abs(env["s"]))
    f = U.evaluate(tree, env, VALUES)
    d = U.evaluate(deriv, env, VALUES)
    fd1 = central_difference(tree, env, env["s"], step)
    fd2 = central_difference(tree, env, env["s"], 4 * step)
    with np.errstate(all="ignore"):
        up = U.evaluate(tree, {**env, "s": env["s"] + step}, VALUES)
        down = U.evaluate(tree, {**env, "s": env["s"] - step}, VALUES)
        # one-sided slopes agree (a kink between them, even a symmetric one, does not)
        one_sided = np.abs((up - f) - (f - down)) / step <= 1e-3 * (1 + np.abs(fd1))
        tol = 1e-5 * (1 + np.abs(fd1)) + 1e-13 * (1 + np.abs(f)) / step
        smooth = (
            finite_throughout(tree, env)
            & np.isfinite(fd1)
            & np.isfinite(fd2)
            & (np.abs(f) < 1e8)
            & (np.abs(fd1 - fd2) <= tol)
            & one_sided
        )
    assume(smooth.any())
    bad = smooth & ~(np.abs(d - fd1) <= 10 * tol)
    assert not bad.any(), (U.canonical(tree), U.canonical(deriv), d[bad][:3], fd1[bad][:3])


def test_softcap_example_derivative_is_the_reference_s_factor():
    mod = U.EXAMPLE_BY_NAME["softcap"].parse()
    s = np.linspace(-40, 40, 801)
    for cap in (0.5, 5.0, 30.0):
        got = U.evaluate(mod.derivative, {"s": s}, {"cap": cap})
        np.testing.assert_allclose(got, M.softcap_factor(s, cap), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# numpy evaluators: integer semantics, the examples against the project's reference
# ---------------------------------------------------------------------------------------------


def test_integer_division_and_modulo_are_python_s_with_zero_divisors_zero():
    a = np.arange(-9, 10).reshape(-1, 1)
    b = np.array([-4, -3, -1, 0, 1, 2, 5]).reshape(1, -1)
    got_q = U.evaluate(parse("i // j"), {"i": a, "j": b})
    got_r = U.evaluate(parse("i % j"), {"i": a, "j": b})
    for x in range(-9, 10):
        for y_idx, y in enumerate(b.ravel()):
            q, r = (x // y, x % y) if y else (0, 0)
            assert got_q[x + 9, y_idx] == q and got_r[x + 9, y_idx] == r, (x, y)
    assert U.floordiv(np.array([-(2**63)]), np.array([-1]))[0] == -(2**63)  # wraps, as C++'s


def test_floor_is_an_int_clamped_to_int32_and_zero_for_nan():
    x = np.array([-2.5, -0.0, 0.7, 2.0, 3e9, -3e9, np.inf, -np.inf, np.nan])
    want = [-3, 0, 0, 2, 2**31 - 1, -(2**31), 2**31 - 1, -(2**31), 0]
    assert U.floor_int(x).tolist() == want
    assert U.floor_int(x.astype(np.float32)).tolist() == want


def test_evaluate_checks_its_inputs():
    tree = parse("slopes[h] * s")
    with pytest.raises(ValueError, match="no value for variable"):
        U.evaluate(tree, {"h": 0}, VALUES)
    with pytest.raises(ValueError, match="no value for parameter 'slopes'"):
        U.evaluate(tree, {"h": 0, "s": 1.0})
    with pytest.raises(ValueError, match="has 3 rows, read at h in"):
        U.evaluate(tree, {"h": np.arange(5), "s": 1.0}, VALUES)
    with pytest.raises(ValueError, match="must be an int array"):
        U.evaluate(parse("i * 1.0"), {"i": 0.5})
    with pytest.raises(ValueError, match="must be a 1-D array"):
        U.evaluate(tree, {"h": 0, "s": 1.0}, {"slopes": 2.0})
    with pytest.raises(ValueError, match="float32 or float64"):
        U.evaluate(tree, {"h": 0, "s": 1.0}, VALUES, dtype=np.float16)
    # a table's column is clamped
    out = U.evaluate(parse("bias[h, i]"), {"h": 1, "i": np.array([-5, 0, 4, 99])}, VALUES)
    assert out.tolist() == [1.0, 1.0, 0.75, 0.75]


def test_evaluate_broadcasts_to_every_given_variable():
    out = U.evaluate(parse("j <= i"), grid(None))
    assert out.shape == (B, H, SQ, SK, 1) and out.dtype == np.bool_
    out32 = U.evaluate(parse("s * 2"), {"s": np.ones(3), "i": np.arange(4)[:, None]}, dtype="f4")
    assert out32.shape == (4, 3) and out32.dtype == np.float32


@pytest.mark.parametrize(
    "name, causal", [("alibi", "bottom_right"), ("alibi_top_left", "top_left")]
)
def test_alibi_examples_are_the_built_in_alibi(name, causal):
    mod = U.EXAMPLE_BY_NAME[name].parse()
    rng = np.random.default_rng(0)
    for sq, sk in ((5, 9), (9, 5), (7, 7)):
        s = rng.normal(size=(4, sq, sk))
        slopes = rng.uniform(0, 1, size=4)
        env = {
            "s": s,
            "h": np.arange(4)[:, None, None],
            "i": np.arange(sq)[None, :, None],
            "j": np.arange(sk)[None, None, :],
            "seqlen_q": sq,
            "seqlen_k": sk,
        }
        got = U.evaluate(mod.tree, env, {"slopes": slopes})
        shift = R.shift_for(causal, sq, sk)
        np.testing.assert_allclose(got, M.logits(s, alibi_slopes=slopes, shift=shift), rtol=1e-14)


def test_softcap_example_is_the_built_in_softcap():
    mod = U.EXAMPLE_BY_NAME["softcap"].parse()
    s = np.linspace(-60, 60, 241)
    for cap in (0.5, 5.0, 30.0):
        got = U.evaluate(mod.tree, {"s": s}, {"cap": cap})
        np.testing.assert_allclose(got, M.softcapped(s, cap), rtol=1e-14)


@pytest.mark.parametrize(
    "name, causal, window",
    [
        ("causal", "top_left", (-1, -1)),
        ("causal_bottom_right", "bottom_right", (-1, -1)),
        ("sliding_window", "top_left", (3, 0)),
    ],
)
def test_mask_examples_are_the_reference_s_masks(name, causal, window):
    mod = U.EXAMPLE_BY_NAME[name].parse()
    for sq, sk in ((5, 9), (9, 5), (8, 8)):
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        env = {"i": i, "j": j, "seqlen_q": sq, "seqlen_k": sk}
        got = U.evaluate(mod.tree, env, {"window": window[0]})
        want = R.element_visible(i, j, sq, sk, causal=causal, window=window)
        assert np.array_equal(got, want)


def hf_t5_bucket(rel: np.ndarray, bidirectional: bool, buckets=32, max_distance=128):
    """HF transformers' T5Attention._relative_position_bucket, transcribed in float64."""
    out = np.zeros_like(rel)
    if bidirectional:
        buckets //= 2
        out += (rel > 0).astype(rel.dtype) * buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    max_exact = buckets // 2
    with np.errstate(all="ignore"):  # log(0) = -inf in the unselected branch
        large = max_exact + (
            np.log(rel.astype(np.float64) / max_exact)
            / math.log(max_distance / max_exact)
            * (buckets - max_exact)
        ).astype(np.int64)
    large = np.minimum(large, buckets - 1)
    return out + np.where(rel < max_exact, rel, large)


@pytest.mark.parametrize("name, bidirectional", [("t5_bias", True), ("t5_decoder_bias", False)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_t5_examples_pick_hf_t5_s_buckets(name, bidirectional, dtype):
    mod = U.EXAMPLE_BY_NAME[name].parse()
    i, j = np.arange(0, 700, 3)[:, None], np.arange(0, 700, 1)[None, :]
    table = np.tile(np.arange(32, dtype=np.float64), (2, 1))  # bias[h, k] = k
    got = U.evaluate(mod.tree, {"s": 0.0, "h": 1, "i": i, "j": j}, {"bias": table}, dtype=dtype)
    assert np.array_equal(got, hf_t5_bucket(j - i, bidirectional).astype(dtype))


def test_bucketed_bias_example():
    mod = U.EXAMPLE_BY_NAME["bucketed_bias"].parse()
    table = np.arange(64, dtype=np.float64).reshape(2, 32)
    d = np.arange(0, 400)
    got = U.evaluate(mod.tree, {"s": 0.5, "h": 1, "i": d, "j": 0}, {"bias": table})
    assert np.array_equal(got, 0.5 + 32 + np.minimum(d // 8, 31))


def test_every_example_parses_to_its_own_canonical_text_and_is_documented():
    doc = (REPO / "docs" / "usermod.md").read_text()
    for ex in U.EXAMPLES:
        mod = ex.parse()
        assert mod.canonical == ex.text, ex.name
        assert mod.kind == ex.kind
        assert f"`{ex.text}`" in doc, ex.name
        if ex.kind == "score_mod":
            _ = mod.derivative


# ---------------------------------------------------------------------------------------------
# float32 against float64
# ---------------------------------------------------------------------------------------------

U32 = 2.0**-24
ULPS = 8 * U32  # numpy's float32 exp / log / tanh: a few ulps


def error_bound(node: U.Expr, env: dict) -> tuple[np.ndarray, np.ndarray]:
    """(float64 value, a bound on |float32 value - float64 value|) of a float tree whose ints
    and bools are exact (pure_ints trees); inf where no bound holds."""
    v = U.evaluate(node, env, VALUES)
    if isinstance(node, Const):
        return v, np.full(v.shape, abs(node.value - float(np.float32(node.value))))
    if isinstance(node, (Var, Param)):  # s and the parameters are float32 values
        return v, np.zeros(v.shape)
    x, e = [], []
    for kid in node.children():
        if kid.type is FLOAT:
            kv, ke = error_bound(kid, env)
        else:  # exact, but an int becomes a float32 (rounded beyond 2^24)
            kv = U.evaluate(kid, env, VALUES)
            ke = np.abs(kv - kv.astype(np.float32).astype(np.float64)) if kid.type is INT else 0
        x.append(kv)
        e.append(np.asarray(ke, dtype=np.float64))
    av = np.abs(v)
    with np.errstate(all="ignore"):
        if isinstance(node, U.Unary):
            err = e[0]
        elif isinstance(node, Binary) and node.op in ("+", "-"):
            err = (e[0] + e[1]) * (1 + U32) + U32 * av
        elif isinstance(node, Binary) and node.op == "*":
            err0 = np.abs(x[0]) * e[1] + np.abs(x[1]) * e[0] + e[0] * e[1]
            err = err0 + U32 * (av + err0)
        elif isinstance(node, Binary):  # "/"
            room = np.abs(x[1]) - e[1]
            err0 = np.where(room > 0, (e[0] + av * e[1]) / room, np.inf)
            err = err0 + U32 * (av + err0)
        elif node.func == "where":
            err = np.where(x[0], e[1], e[2])
        elif node.func in ("min", "max"):
            err = np.maximum(e[0], e[1])
        elif node.func == "abs":
            err = e[0]
        elif node.func == "exp":
            err = av * np.expm1(e[0]) + ULPS * av * np.exp(e[0])
        elif node.func == "log":
            a = np.abs(x[0])
            err0 = np.where(e[0] < a, -np.log1p(-e[0] / a), np.inf)
            err = err0 + ULPS * (av + err0)
        else:  # tanh: 1-Lipschitz
            err = e[0] + ULPS * av
        err = err + 2e-44  # float32 subnormal steps
        err = np.where(np.isfinite(v) & (av < 1e30), err, np.inf)
    return v, np.broadcast_to(err, v.shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(trees(FLOAT, s=True, pure_ints=True))
def test_float32_evaluator_agrees_with_float64_within_float32_rounding(tree):
    env = grid()
    v64, bound = error_bound(tree, env)
    v32 = U.evaluate(tree, env, VALUES, dtype=np.float32)
    assert v32.dtype == np.float32
    ok = np.isfinite(bound) & np.isfinite(v64)
    assume(ok.any())
    with np.errstate(all="ignore"):
        diff = np.abs(v32.astype(np.float64) - v64)
    bad = ok & ~(diff <= 2 * bound)
    assert not bad.any(), (U.canonical(tree), v32[bad][:3], v64[bad][:3], bound[bad][:3])


@settings(max_examples=100, deadline=None)
@given(trees(INT, s=True, pure_ints=True))
def test_float32_and_float64_evaluators_agree_exactly_on_int_trees(tree):
    env = grid()
    a = U.evaluate(tree, env, VALUES)
    b = U.evaluate(tree, env, VALUES, dtype=np.float32)
    assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# block classification
# ---------------------------------------------------------------------------------------------


def tiles(sq: int, sk: int, bm: int, bn: int):
    for i0 in range(0, sq, bm):
        for j0 in range(0, sk, bn):
            yield (i0, min(i0 + bm, sq) - 1), (j0, min(j0 + bn, sk) - 1)


def truth(block: np.ndarray) -> U.Block:
    return U.Block.FULL if block.all() else U.Block.EMPTY if not block.any() else U.Block.PARTIAL


def test_causal_tiles_below_the_diagonal_are_full_above_empty():
    causal = U.parse_mask_mod("j <= i").tree
    assert U.classify_block(causal, i=(8, 15), j=(0, 7)) is U.Block.FULL
    assert U.classify_block(causal, i=(0, 7), j=(8, 15)) is U.Block.EMPTY
    assert U.classify_block(causal, i=(0, 7), j=(0, 7)) is U.Block.PARTIAL
    assert U.classify_block(causal, i=range(8, 16), j=7) is U.Block.FULL
    assert U.classify_block(causal, i=U.Interval(0, 7), j=8) is U.Block.EMPTY
    m = U.block_map(causal, 10, 10, 4, 4)
    assert m.tolist() == [[1, 0, 0], [2, 1, 0], [2, 2, 1]]


def test_unknown_parameters_give_partial_tiles():
    chunked = U.EXAMPLE_BY_NAME["chunked"].parse().tree
    assert U.classify_block(chunked, i=(0, 3), j=(0, 3)) is U.Block.PARTIAL
    assert U.classify_block(chunked, i=(0, 3), j=(0, 3), params={"chunk": 4}) is U.Block.FULL
    assert (
        U.classify_block(chunked, i=(0, 3), j=(4, 7), params={"chunk": (4, 8)}) is U.Block.PARTIAL
    )
    assert U.classify_block(chunked, i=(0, 3), j=(8, 9), params={"chunk": (3, 4)}) is U.Block.EMPTY
    doc = U.EXAMPLE_BY_NAME["document"].parse().tree
    assert U.classify_block(doc, i=(0, 3), j=(0, 3)) is U.Block.PARTIAL
    ids = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    assert U.classify_block(doc, i=(0, 3), j=(0, 3), params={"doc": ids}) is U.Block.FULL
    assert U.classify_block(doc, i=(0, 3), j=(4, 7), params={"doc": ids}) is U.Block.EMPTY


def test_block_inputs_are_checked():
    causal = U.parse_mask_mod("j <= i").tree
    with pytest.raises(ValueError, match="lo <= hi"):
        U.classify_block(causal, i=(5, 3), j=0)
    with pytest.raises(ValueError, match="non-empty with step 1"):
        U.classify_block(causal, i=range(0, 8, 2), j=0)
    with pytest.raises(ValueError, match="an inclusive"):
        U.classify_block(causal, i=[0, 1], j=0)
    with pytest.raises(U.UserModError, match="takes a bool mask"):
        U.classify_block(parse("i - j"), i=0, j=0)
    with pytest.raises(ValueError, match=">= 1"):
        U.block_map(causal, 0, 4, 2, 2)


def consecutive_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.cumsum(rng.integers(0, 2, size=n) * (np.arange(n) > 0))


def example_cases():
    rng = np.random.default_rng(1)
    cases = [("causal", {}), ("causal_bottom_right", {})]
    cases += [("sliding_window", {"window": w}) for w in (0, 1, 3, 7, 30)]
    cases += [("chunked", {"chunk": c}) for c in (1, 3, 4, 8, 30)]
    cases += [("prefix_lm", {"prefix": np.array([p, 5])}) for p in (0, 3, 10, 24)]
    cases += [("document", {"doc": consecutive_ids(rng, 24)}) for _ in range(3)]
    return cases


@pytest.mark.parametrize("name, values", example_cases(), ids=lambda x: str(x)[:20])
def test_block_classification_is_exact_for_the_shipped_masks(name, values):
    tree = U.EXAMPLE_BY_NAME[name].parse().tree
    rng = np.random.default_rng(2)
    for sq, sk in ((24, 24), (17, 24), (24, 13)):
        env = {"b": 0, "i": np.arange(sq)[:, None], "j": np.arange(sk)[None, :]}
        env.update(seqlen_q=sq, seqlen_k=sk)
        mask = U.evaluate(tree, env, values)
        for bm in range(1, 9):
            for bn in range(1, 9):
                got = U.block_map(tree, sq, sk, bm, bn, b=0, params=values)
                want = [
                    [truth(mask[i0 : i0 + bm, j0 : j0 + bn]) for j0 in range(0, sk, bn)]
                    for i0 in range(0, sq, bm)
                ]
                assert got.tolist() == want, (name, sq, sk, bm, bn)
        for _ in range(200):  # unaligned tiles
            i0, j0 = int(rng.integers(0, sq)), int(rng.integers(0, sk))
            i1, j1 = int(rng.integers(i0, sq)), int(rng.integers(j0, sk))
            got = U.classify_block(
                tree, i=(i0, i1), j=(j0, j1), b=0, seqlen_q=sq, seqlen_k=sk, params=values
            )
            assert got is truth(mask[i0 : i1 + 1, j0 : j1 + 1]), (name, i0, i1, j0, j1)


FLOAT_VALUES = st.sampled_from(
    [0.0, -0.0, 0.5, -1.5, 2.0, 3.0, -7.0, 1e30, -1e30, 3e38, -3e38, 1e-40, np.inf, -np.inf]
)


@st.composite
def problem(draw):
    """Sequence lengths, parameter values (random, extreme floats included), what the
    classifier is told of each parameter (its values, bounds of them, or nothing)."""
    sq, sk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    ints = st.integers(-4, 6)

    def ivec(n):
        return np.array(draw(st.lists(ints, min_size=n, max_size=n)), dtype=np.int64)

    def fvec(n):
        return np.array(draw(st.lists(FLOAT_VALUES, min_size=n, max_size=n)))

    values = {
        "cap": draw(FLOAT_VALUES),
        "n": draw(ints),
        "slopes": fvec(H),
        "w": fvec(B),
        "pre": ivec(B),
        "dq": ivec(sq),
        "dk": ivec(sk),
        "doc": ivec(max(sq, sk)),
        "bias": fvec(H * 5).reshape(H, 5),
    }
    told = {}
    for name, value in values.items():
        how = draw(st.sampled_from(["value", "bounds", "unknown"]))
        if how == "value":
            told[name] = value
        elif how == "bounds":
            arr = np.asarray(value)
            told[name] = (arr.min().item(), arr.max().item())
    return sq, sk, values, told


def full_grid(sq: int, sk: int) -> dict:
    return {
        "b": np.arange(B).reshape(B, 1, 1, 1),
        "h": np.arange(H).reshape(1, H, 1, 1),
        "i": np.arange(sq).reshape(1, 1, sq, 1),
        "j": np.arange(sk).reshape(1, 1, 1, sk),
        "seqlen_q": sq,
        "seqlen_k": sk,
    }


@settings(max_examples=150, deadline=None)
@given(trees(BOOL, depth=4, s=False), problem(), st.integers(1, 8), st.integers(1, 8))
def test_block_classification_is_sound(tree, prob, bm, bn):
    sq, sk, values, told = prob
    env = full_grid(sq, sk)
    masks = [U.evaluate(tree, env, values, dtype=dt) for dt in (np.float64, np.float32)]
    for (i0, i1), (j0, j1) in tiles(sq, sk, bm, bn):
        got = U.classify_block(
            tree,
            i=(i0, i1),
            j=(j0, j1),
            b=(0, B - 1),
            h=(0, H - 1),
            seqlen_q=sq,
            seqlen_k=sk,
            params=told,
        )
        one = U.classify_block(tree, i=(i0, i1), j=(j0, j1), b=1, h=2, params=told)
        for mask in masks:
            block = mask[:, :, i0 : i1 + 1, j0 : j1 + 1]
            if got is U.Block.FULL:
                assert block.all(), U.canonical(tree)
            if got is U.Block.EMPTY:
                assert not block.any(), U.canonical(tree)
            if one is U.Block.FULL:
                assert block[1, 2].all(), U.canonical(tree)
            if one is U.Block.EMPTY:
                assert not block[1, 2].any(), U.canonical(tree)


@settings(max_examples=200, deadline=None)
@given(st.data(), problem())
def test_bounds_hold_every_value_in_both_precisions(data, prob):
    ty = data.draw(st.sampled_from([INT, FLOAT]))
    tree = data.draw(trees(ty, depth=4, s=False))
    sq, sk, values, told = prob
    env = full_grid(sq, sk)
    i0 = data.draw(st.integers(0, sq - 1))
    j0 = data.draw(st.integers(0, sk - 1))
    i1, j1 = data.draw(st.integers(i0, sq - 1)), data.draw(st.integers(j0, sk - 1))
    box = {"b": (0, B - 1), "h": (0, H - 1), "i": (i0, i1), "j": (j0, j1)}
    box.update(seqlen_q=sq, seqlen_k=sk)
    iv = U.bounds(tree, box, told)
    for dt in (np.float64, np.float32):
        v = U.evaluate(tree, env, values, dtype=dt)[:, :, i0 : i1 + 1, j0 : j1 + 1]
        v = v.astype(np.float64) if ty is FLOAT else v
        nan = np.isnan(v) if ty is FLOAT else np.zeros(v.shape, bool)
        assert iv.nan or not nan.any(), (U.canonical(tree), iv)
        real = v[~nan]
        assert ((real >= iv.lo) & (real <= iv.hi)).all(), (
            U.canonical(tree),
            iv,
            real.min(),
            real.max(),
        )


# ---------------------------------------------------------------------------------------------
# C++ emission
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, text",
    [
        (1.0, "1.0f"),
        (0.1, "0.100000001f"),
        (-2.5, "(-2.5f)"),
        (1e10, "1e+10f"),
        (-0.0, "(-0.0f)"),
        (3.4e38, "3.39999995e+38f"),
    ],
)
def test_float_literals_are_float32_with_an_f_suffix(value, text):
    assert U.cpp_float_literal(value) == text
    assert np.float32(float(text.strip("()").rstrip("f"))) == np.float32(value)


def test_emission_is_fully_parenthesised_typed_and_named_by_the_caller():
    names = {"s": "x", "i": "qi", "j": "kj", "h": "hh", "b": "bb"}
    cpp = U.emit_cpp(parse("s - slopes[h] * abs(i - j)"), names)
    assert cpp == (
        "(static_cast<float>(x) - (static_cast<float>(p.slopes[static_cast<int64_t>(hh)]) * "
        "static_cast<float>(fg_iabs((static_cast<int64_t>(qi) - static_cast<int64_t>(kj))))))"
    )
    assert U.emit_cpp(parse("i // -3 % 2"), names) == (
        "fg_mod(fg_floordiv(static_cast<int64_t>(qi), (-3ll)), 2ll)"
    )
    assert U.emit_cpp(parse("where(not j <= i, -1e4, s)"), names) == (
        "((!(static_cast<int64_t>(kj) <= static_cast<int64_t>(qi))) ? (-10000.0f) : "
        "static_cast<float>(x))"
    )
    assert U.emit_cpp(parse("min(i, 2.0) + max(i, j)"), names) == (
        "(fminf(static_cast<float>(static_cast<int64_t>(qi)), 2.0f) + "
        "static_cast<float>(fg_imax(static_cast<int64_t>(qi), static_cast<int64_t>(kj))))"
    )
    assert U.emit_cpp(parse("exp(i) > log(2) and tanh(s) < 1 or True"), names).startswith(
        "(((fg_exp(static_cast<float>(static_cast<int64_t>(qi))) > fg_log(static_cast<float>(2ll)))"
    )
    assert U.emit_cpp(parse("bias[h, floor(cap)]"), names, params="sp") == (
        "static_cast<float>(sp.bias[(static_cast<int64_t>(hh)) * sp.bias_cols + "
        "fg_clamp_index(fg_floor_int(static_cast<float>(sp.cap)), sp.bias_cols)])"
    )
    custom = {"per_head": "__ldg({p}.{name} + {index})"}
    assert U.emit_cpp(parse("slopes[h]"), names, access=custom) == (
        "static_cast<float>(__ldg(p.slopes + static_cast<int64_t>(hh)))"
    )
    with pytest.raises(ValueError, match="no C\\+\\+ name for variable"):
        U.emit_cpp(parse("i + j"), {"i": "qi"})


def test_float_positions_take_ints_linear_in_i_and_j_that_a_float_reads():
    names = {"s": "x", "i": "qi", "j": "kj", "seqlen_q": "sq", "seqlen_k": "sk", "h": "hh"}
    fpos = {"i": "fi", "j": "fj", "i-j": "fd"}
    emit = lambda text: U.emit_cpp(parse(text), names, float_positions=fpos)  # noqa: E731
    assert emit("s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)") == (
        "(static_cast<float>(x) - (static_cast<float>(p.slopes[static_cast<int64_t>(hh)]) * "
        "fabsf((fd + static_cast<float>(static_cast<int64_t>(sk) + -static_cast<int64_t>(sq))))))"
    )
    assert emit("s + (j - i)") == "(static_cast<float>(x) + (-fd))"
    assert emit("s * (2 * i + 3 * j - 1)") == (
        "(static_cast<float>(x) * ((2.0f * fi) + (3.0f * fj) + static_cast<float>((-1ll))))"
    )
    assert emit("s + j") == "(static_cast<float>(x) + fj)"
    # int contexts keep exact int64: a comparison of ints, a table column, floor division
    assert "fi" not in emit("where(i >= j, s, -1e4)").replace("fg_", "")
    assert emit("s + abs(i - j) // 8") == (
        "(static_cast<float>(x) + static_cast<float>(fg_floordiv(fg_iabs((static_cast<int64_t>(qi)"
        " - static_cast<int64_t>(kj))), 8ll)))"
    )
    # no position, or a coefficient too large to stay exact: the int path
    assert (
        emit("s + seqlen_k")
        == "(static_cast<float>(x) + static_cast<float>(static_cast<int64_t>(sk)))"
    )
    assert "fi" not in emit("s + 16777216 * i")
    # a product of variables is not linear
    assert "fi" not in emit("s + i * j")
    assert U.linear_form(parse("2 * (i - j) - -seqlen_k + 3")) == (
        {"i": 2, "j": -2, "seqlen_k": 1},
        3,
    )
    assert U.linear_form(parse("i * j")) is None
    with pytest.raises(ValueError, match="float_positions lacks i-j"):
        U.emit_cpp(parse("s + i"), names, float_positions={"i": "fi", "j": "fj"})


def test_emission_carries_no_user_text_but_checked_names():
    # a parameter's name is the only user text that reaches C++, and it is an identifier
    for bad in ["x); evil(", "new", "a b", "x__y", "fg_clamp_index"]:
        with pytest.raises(U.UserModError):
            U.check_params({bad: "scalar"})
    cpp = U.emit_cpp(parse("s * cap"), {"s": "x"})
    assert cpp == "(static_cast<float>(x) * static_cast<float>(p.cap))"


NAMES = {"s": "x", "b": "bb", "h": "hh", "i": "qi", "j": "kj", "seqlen_q": "sq", "seqlen_k": "sk"}
CPP_TYPE = {FLOAT: "float", INT: "int64_t", BOOL: "bool"}
CPP_PARAMS = """
struct Params {
  float cap;
  int64_t n;
  const float* slopes;
  const float* w;
  const int32_t* pre;
  const int32_t* dq;
  const int32_t* dk;
  const int32_t* doc;
  const float* bias;
  int64_t bias_cols;
  int64_t window;  // the examples' parameters
  const int32_t* prefix;
  int64_t chunk;
};
"""
SIGNATURE = (
    "(const Params& p, float x, int64_t bb, int64_t hh, int64_t qi, int64_t kj, int64_t sq, "
    "int64_t sk) const"
)


# float i, j and i - j, as the kernels' fg::ScorePos holds them (the emitter's float positions)
FLOAT_POSITIONS = {"i": "fqi", "j": "fkj", "i-j": "fij"}
FLOAT_LOCALS = (
    "    const float fqi = static_cast<float>(qi), fkj = static_cast<float>(kj),\n"
    "                fij = static_cast<float>(qi - kj);\n"
    "    (void)fqi, (void)fkj, (void)fij;\n"
)


# int32 arithmetic (emit_cpp's int32_bounds): None (int64 everywhere), the kernels' bounds
# (positions below 2^31: mostly int64 here, where products and sums of positions may not fit)
# or the host grid's own (nearly every int in int32, the helpers' negative operands included).
INT32_MODES = {
    "int64": None,
    "kernel": KERNEL_INT_BOUNDS,
    "grid": {
        "i": (0, SQ - 1),
        "j": (0, SK - 1),
        "b": (0, B - 1),
        "h": (0, H - 1),
        "seqlen_q": (SQ, SQ),
        "seqlen_k": (SK, SK),
        ParamKind.SCALAR_INT: (-8, 8),  # n
        **{k: (-(2**31), 2**31 - 1) for k in (ParamKind.PER_BATCH_INT, *TOKEN_KINDS)},
    },
}
# a table at an int32 column, through the int32 clamp
TABLE_INT32 = (
    "{p}.{name}[({index}) * {p}.{name}_cols + fg_clamp_last32({k}, fg_last32({p}.{name}_cols))]"
)


def _preamble(functor_src: str) -> str:
    """The emitted helpers (int64 and int32), the test's Params struct and the functors."""
    return U.CPP_HELPERS + U.CPP_HELPERS_INT32 + CPP_PARAMS + functor_src


def functors(exprs: list[U.Expr], float_positions: bool = False, int32: str = "int64") -> str:
    out = []
    for k, tree in enumerate(exprs):
        fpos = FLOAT_POSITIONS if float_positions else None
        body = U.emit_cpp(
            tree,
            NAMES,
            float_positions=fpos,
            int32_bounds=INT32_MODES[int32],
            table_int32_access=TABLE_INT32,
        )
        out.append(
            f"struct F{k} {{\n  FG_USERMOD_FN {CPP_TYPE[tree.type]} operator(){SIGNATURE} {{\n"
            f"{FLOAT_LOCALS if float_positions else ''}    return {body};\n  }}\n}};\n"
        )
    return "".join(out)


def nvcc(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        ["nvcc", "-std=c++17", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def emitted_corpus() -> list[U.Expr]:
    """A few hundred trees of every kind, the derivatives of the differentiable score trees,
    and the shipped examples."""
    scores = random_trees(11, 120, FLOAT, s=True)
    exprs = [*scores, *random_trees(12, 80, BOOL, s=False), *random_trees(13, 60, INT)]
    for t in scores[:80]:
        try:
            exprs.append(U.derivative(t))
        except U.UserModError:
            pass
    for ex in U.EXAMPLES:
        mod = ex.parse()
        exprs.append(mod.tree)
        if ex.kind == "score_mod":
            exprs.append(mod.derivative)
    return exprs


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize(
    ("float_positions", "int32"),
    [(False, "int64"), (True, "int64"), (True, "kernel"), (False, "grid")],
)
def test_emitted_cpp_compiles_as_device_functors(tmp_path, float_positions, int32):
    exprs = emitted_corpus()
    assert len(exprs) >= 300
    calls = "\n".join(
        f"  out[{k}] = static_cast<float>(F{k}{{}}(p, x, bb, hh, qi, kj, sq, sk));"
        for k in range(len(exprs))
    )
    source = (
        _preamble(functors(exprs, float_positions, int32))
        + "__global__ void run_all(Params p, float* out) {\n"
        + "  const float x = out[0];\n"
        + "  const int64_t bb = blockIdx.y, hh = blockIdx.z, qi = threadIdx.x, kj = threadIdx.y;\n"
        + "  const int64_t sq = 64, sk = 64;\n"
        + calls
        + "\n}\n"
    )
    (tmp_path / "usermods.cu").write_text(source)
    nvcc("-arch=sm_90", "-c", "usermods.cu", "-o", "usermods.o", cwd=tmp_path)


# int trees at the kernels' extreme positions (i, j up to 2^31 - 2, lengths 2^31 - 1): each
# with whether the kernels' bounds put its root in int32. Sums and products of positions, and
# a product with the int64 scalar n, must keep int64 (here n = 2^40).
EXTREME_INTS = [
    ("i * j", False),
    ("i + j", False),
    ("i * n", False),
    ("i + seqlen_k - seqlen_q - j", False),
    ("2 * j + 1", False),
    ("i - j", True),
    ("-i - j + j", False),
    ("abs(j - i)", True),
    ("abs(i - j) // 8", True),
    ("(i - j) // -7 % 5", True),
    ("(j - i) // 3 - (i - j) % 11", True),
    ("min(i, j) - max(i, j)", True),
    ("max(i - j, 0) // (j + 1)", True),
    ("where(i > j, i - j, j - i) + 16", False),
    ("where(i > j, i - j, j - i) // 2 + 16", True),
    ("where(abs(j - i) < 8, abs(j - i), 5) + 2147483640", True),
    ("where(abs(j - i) <= 8, abs(j - i), 5) + 2147483640", False),
    ("where(i - j >= 0, i - j, 0) * 1", True),
    ("floor(log(abs(j - i) / 8) * 2.8853900817779268 + 0.001) + 8", True),
    ("seqlen_q - i - 1", True),
    ("(seqlen_q - i) * 2", False),
]
EXTREME_POS = [0, 1, 2, 7, 8, 9, 2**31 - 9, 2**31 - 3, 2**31 - 2]
EXTREME_LEN = 2**31 - 1


def test_kernel_bounds_choose_int32_only_where_every_value_fits():
    for text, narrow in EXTREME_INTS:
        tree = U.parse_expr(text, {"n": "scalar_int"}) if "n" in text else U.parse_expr(text)
        assert tree.type is INT
        ids, _ = U.int32_nodes(tree, KERNEL_INT_BOUNDS)
        assert (id(tree) in ids) is narrow, text
        # an int32 node's int operands are int32 too
        for node in U.walk(tree):
            if id(node) in ids and not isinstance(node, Call):
                assert all(id(k) in ids for k in node.children() if k.type is INT), text


@pytest.mark.nvcc
@needs_nvcc
def test_int32_arithmetic_is_exact_at_the_kernels_extreme_positions(tmp_path):
    exprs = [
        U.parse_expr(t, {"n": "scalar_int"}) if "n" in t else U.parse_expr(t)
        for t, _ in EXTREME_INTS
    ]
    pos = ", ".join(str(v) for v in EXTREME_POS)
    printers = "\n".join(
        f'  EACH(printf("%lld\\n", (long long)F{k}{{}}(p, 0.f, 0, 0, qi, kj, sq, sq)));'
        for k in range(len(exprs))
    )
    main = f"""
static const int64_t pos[] = {{{pos}}};
#define EACH(stmt) \\
  for (int a = 0; a < {len(EXTREME_POS)}; ++a) for (int c = 0; c < {len(EXTREME_POS)}; ++c) \\
  {{ const int64_t qi = pos[a], kj = pos[c], sq = {EXTREME_LEN}; stmt; }}
int main() {{
  Params p = {{}};
  p.n = INT64_C(1) << 40;
{printers}
  return 0;
}}
"""
    source = "#include <cstdio>\n" + _preamble(functors(exprs, int32="kernel")) + main
    (tmp_path / "extreme.cu").write_text(source)
    nvcc("-o", "extreme", "extreme.cu", cwd=tmp_path)
    run = subprocess.run(["./extreme"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    got = np.array([int(t) for t in run.stdout.split()]).reshape(len(exprs), -1)
    env = {
        "i": np.array(EXTREME_POS).reshape(-1, 1),
        "j": np.array(EXTREME_POS).reshape(1, -1),
        "seqlen_q": EXTREME_LEN,
        "seqlen_k": EXTREME_LEN,
    }
    for k, tree in enumerate(exprs):
        want = U.evaluate(tree, env, {"n": 2**40}, dtype=np.float32).ravel()
        assert (got[k] == want).all(), (EXTREME_INTS[k][0], got[k][got[k] != want][:4])


def test_t5_buckets_are_computed_in_int32():
    from flashgen.generator.features.user import user_score_cpp

    for name in ("t5_bias", "t5_decoder_bias", "bucketed_bias"):
        mod = U.EXAMPLE_BY_NAME[name].parse()
        column = mod.tree.right.index[1]  # s + bias[h, column]
        ids, _ = U.int32_nodes(mod.tree, KERNEL_INT_BOUNDS)
        ints = [n for n in U.walk(column) if n.type is INT]
        assert ints and all(id(n) in ids for n in ints), name
        cpp = user_score_cpp(mod)
        value = cpp[cpp.index("float value(") : cpp.index("// the launch check")]
        assert "int64_t" not in value and "fg_clamp_last32(" in value, name
        assert "static FG_USERMOD_FN int32_t fg_iabs32" in cpp or name == "t5_decoder_bias"


def host_exact_corpus() -> list[U.Expr]:
    """Trees without exp / log / tanh: float32 + - * / conversions, comparisons and floor are
    IEEE-exact, so C++ on the host and numpy's float32 evaluator agree bit for bit."""
    opts = {"transcendental": False}
    return [
        *random_trees(21, 100, FLOAT, s=True, **opts),
        *random_trees(22, 60, BOOL, s=True, **opts),
        *random_trees(23, 100, INT, s=True, **opts),
    ]


def c_array(ctype: str, values: np.ndarray) -> str:
    if ctype == "float":
        items = ", ".join(U.cpp_float_literal(float(v)) for v in values.ravel())
    else:
        items = ", ".join(str(int(v)) for v in values.ravel())
    return f"{{{items}}}"


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize(
    ("float_positions", "int32"),
    [(False, "int64"), (True, "int64"), (False, "kernel"), (True, "kernel"), (False, "grid")],
)
def test_emitted_cpp_runs_on_the_host_like_the_float32_evaluator(tmp_path, float_positions, int32):
    # with float positions too, bit for bit: every term here is far below 2^24; and with int32
    # arithmetic wherever the mode's bounds prove it exact
    exprs = host_exact_corpus()
    if int32 != "int64":
        narrow = sum(len(U.int32_nodes(t, INT32_MODES[int32])[0]) for t in exprs)
        assert narrow > (1000 if int32 == "kernel" else 1500)
    printers = []
    for k, tree in enumerate(exprs):
        fmt = {FLOAT: '"%a\\n", (double)', INT: '"%lld\\n", (long long)', BOOL: '"%d\\n", (int)'}[
            tree.type
        ]
        printers.append(f"  EACH(printf({fmt}F{k}{{}}(p, x, bb, hh, qi, kj, {SQ}, {SK})));")
    scalars = f"{VALUES['cap']}f, {VALUES['n']}"
    main = f"""
static const float slopes[] = {c_array("float", VALUES["slopes"])};
static const float w[] = {c_array("float", VALUES["w"])};
static const int32_t pre[] = {c_array("int", VALUES["pre"])};
static const int32_t dq[] = {c_array("int", VALUES["dq"])};
static const int32_t dk[] = {c_array("int", VALUES["dk"])};
static const int32_t doc[] = {c_array("int", VALUES["doc"])};
static const float bias[] = {c_array("float", VALUES["bias"])};
static const float svals[] = {c_array("float", S_VALUES)};
#define EACH(stmt) \\
  for (int64_t bb = 0; bb < {B}; ++bb) for (int64_t hh = 0; hh < {H}; ++hh) \\
  for (int64_t qi = 0; qi < {SQ}; ++qi) for (int64_t kj = 0; kj < {SK}; ++kj) \\
  for (int si = 0; si < {len(S_VALUES)}; ++si) {{ const float x = svals[si]; stmt; }}
int main() {{
  const Params p = {{{scalars}, slopes, w, pre, dq, dk, doc, bias, 5, 0, pre, 1}};
{chr(10).join(printers)}
  return 0;
}}
"""
    source = "#include <cstdio>\n" + _preamble(functors(exprs, float_positions, int32)) + main
    (tmp_path / "host.cu").write_text(source)
    nvcc("-o", "host", "host.cu", cwd=tmp_path)
    run = subprocess.run(["./host"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    per = B * H * SQ * SK * len(S_VALUES)
    assert len(lines) == per * len(exprs)
    env = grid()
    for k, tree in enumerate(exprs):
        chunk = lines[k * per : (k + 1) * per]
        want = U.evaluate(tree, env, VALUES, dtype=np.float32).ravel()
        if tree.type is FLOAT:
            got = np.array([float.fromhex(t) for t in chunk], dtype=np.float32)
            same = (got == want) | (np.isnan(got) & np.isnan(want))
        else:
            got = np.array([int(t) for t in chunk])
            same = got == want.astype(np.int64)
        assert same.all(), (U.canonical(tree), got[~same][:4], want[~same][:4])
