"""The grammar of user modifiers: a hand-written tokenizer and a recursive-descent parser that
build a typed tree (`tree.py`); nothing is evaluated and no text reaches C++ unchecked.

Grammar (loosest first; all binary operators are left-associative, comparisons do not chain):

    expr       := or
    or         := and ("or" and)*
    and        := not ("and" not)*
    not        := "not" not | comparison
    comparison := sum (("<" | "<=" | ">" | ">=" | "==" | "!=") sum)?
    sum        := product (("+" | "-") product)*
    product    := unary (("*" | "/" | "//" | "%") unary)*
    unary      := "-" unary | atom
    atom       := NUMBER | "True" | "False" | VARIABLE | PARAM | PARAM "[" expr ("," expr)? "]"
                | FUNCTION "(" expr ("," expr)* ")" | "(" expr ")"

Numbers are decimal: `12` is an int, `1.5`, `1.`, `.5`, `2e3` are floats.
"""

from __future__ import annotations

import difflib
import hashlib
import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from .tree import (
    COMPARISONS,
    FUNCTIONS,
    KIND_INFO,
    MAX_DEPTH,
    MAX_LENGTH,
    VARIABLES,
    Binary,
    Call,
    Const,
    Expr,
    Param,
    ParamKind,
    Type,
    Unary,
    UserModError,
    Var,
    canonical,
    negate,
    walk,
)

__all__ = [
    "ALLOWED",
    "UserMod",
    "check_params",
    "parse_expr",
    "parse_mask_mod",
    "parse_score_mod",
]

ALLOWED = (
    "operators + - * / // % < <= > >= == != and or not, functions "
    + ", ".join(f"{f}()" for f in FUNCTIONS)
    + ", parentheses, int and float literals, True, False"
)

# every C++ keyword and alternative token: a parameter's name becomes a C++ member name
_CPP_KEYWORDS = frozenset(
    """alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class compl concept const consteval constexpr constinit const_cast
    continue co_await co_return co_yield decltype default delete do double dynamic_cast else
    enum explicit export extern false float for friend goto if inline int long mutable
    namespace new noexcept not not_eq nullptr operator or or_eq private protected public
    register reinterpret_cast requires return short signed sizeof static static_assert
    static_cast struct switch template this thread_local throw true try typedef typeid typename
    union unsigned using virtual void volatile wchar_t while xor xor_eq""".split()
)
_WORDS = frozenset({"and", "or", "not", "True", "False"})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARAM_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_NUMBER = re.compile(r"(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?")
_TWO = ("//", "<=", ">=", "==", "!=")
_ONE = "+-*/%<>()[],"

# operators and characters outside the grammar, with what to write instead
_REFUSED = {
    "**": "`**` (power) is not in the grammar: write x * x, or exp(y * log(x)) for x > 0",
    "&&": "`&&` is not in the grammar: write `and`",
    "||": "`||` is not in the grammar: write `or`",
    "<<": "bit shifts are not in the grammar: multiply or floor-divide by a power of two",
    ">>": "bit shifts are not in the grammar: multiply or floor-divide by a power of two",
    "->": "`->` is not in the grammar",
    ":=": "assignments are not in the grammar",
    "!": "`!` is not in the grammar: write `not`",
    "=": "`=` is not in the grammar: compare with `==`",
    "&": "bitwise `&` is not in the grammar: combine conditions with `and`",
    "|": "bitwise `|` is not in the grammar: combine conditions with `or`",
    "^": "`^` is not in the grammar (neither power nor xor): write x * x, or `!=` of bools",
    "~": "`~` is not in the grammar: negate a condition with `not`",
    "?": "the ternary `?:` is not in the grammar: write where(c, a, b)",
    ":": "`:` is not in the grammar (no slices, no ternary): write where(c, a, b)",
    "@": "`@` is not in the grammar",
    ";": "`;` is not in the grammar: a modifier is one expression",
    "#": "comments are not allowed in an expression",
    "'": "strings are not allowed in an expression",
    '"': "strings are not allowed in an expression",
    "{": "braces are not in the grammar: group with ( )",
    "}": "braces are not in the grammar: group with ( )",
    ".": "attribute access is not in the grammar (a float literal is written 1.5 or .5)",
}

_PY_KEYWORD_HINTS = {
    "if": "conditional expressions are not in the grammar: write where(c, a, b)",
    "else": "conditional expressions are not in the grammar: write where(c, a, b)",
    "is": "`is` is not in the grammar: compare with `==`",
    "in": "`in` is not in the grammar: compare with `==` and combine with `or`",
    "lambda": "a modifier is an expression of its variables, not a lambda",
    "true": "booleans are spelled True and False",
    "false": "booleans are spelled True and False",
}


@dataclass(frozen=True)
class _Token:
    kind: str  # "num" | "name" | "op" | "end"
    text: str
    col: int  # 1-based


def _tokenize(text: str) -> list[_Token]:
    out: list[_Token] = []
    pos, n = 0, len(text)
    while pos < n:
        ch = text[pos]
        col = pos + 1
        if ch.isspace():
            pos += 1
            continue
        m = _NUMBER.match(text, pos)
        if m and (ch.isdigit() or (ch == "." and pos + 1 < n and text[pos + 1].isdigit())):
            end = m.end()
            if end < n and (text[end].isalnum() or text[end] in "_."):
                raise UserModError(
                    f"malformed number {text[pos : end + 1]!r}: a number is digits with an "
                    "optional fraction and exponent (12, 1.5, 2e-3), without underscores",
                    col,
                )
            out.append(_Token("num", m.group(), col))
            pos = end
            continue
        m = _NAME.match(text, pos)
        if m:
            out.append(_Token("name", m.group(), col))
            pos = m.end()
            continue
        two = text[pos : pos + 2]
        if two in _TWO:
            out.append(_Token("op", two, col))
            pos += 2
            continue
        if two in _REFUSED:
            raise UserModError(f"{_REFUSED[two]} (allowed: {ALLOWED})", col)
        if ch in _ONE:
            out.append(_Token("op", ch, col))
            pos += 1
            continue
        why = _REFUSED.get(ch, f"unexpected character {ch!r}")
        raise UserModError(f"{why} (allowed: {ALLOWED})", col)
    out.append(_Token("end", "", n + 1))
    return out


def check_params(params: Mapping[str, str | ParamKind] | None) -> dict[str, ParamKind]:
    """Validated parameter declarations `{name: kind}` (kinds as `ParamKind` or their YAML
    spelling). Names are identifiers that do not shadow a variable, a function, a word of the
    grammar, a Python or C++ keyword, and hold no `__` and no `fg_` prefix (they become C++
    member names)."""
    out: dict[str, ParamKind] = {}
    for name, kind in (params or {}).items():
        if not isinstance(name, str) or not _PARAM_NAME.match(name):
            raise UserModError(
                f"parameter name {name!r} is not allowed: a letter, then letters, digits, _"
            )
        clash = (
            "a variable"
            if name in VARIABLES
            else "a function"
            if name in FUNCTIONS
            else "a word of the grammar"
            if name in _WORDS
            else "a Python keyword"
            if keyword.iskeyword(name)
            else "a C++ keyword"
            if name in _CPP_KEYWORDS
            else None
        )
        if clash is None and ("__" in name or name.startswith("fg_")):
            clash = "reserved (no `__`, no `fg_` prefix)"
        if clash:
            raise UserModError(f"parameter name {name!r} is {clash}: choose another name")
        if isinstance(kind, ParamKind):
            out[name] = kind
            continue
        kinds = [k.value for k in ParamKind]
        if kind not in kinds:
            near = difflib.get_close_matches(str(kind), kinds, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UserModError(
                f"parameter {name!r} has kind {kind!r}{hint}; kinds: {', '.join(kinds)}"
            )
        out[name] = ParamKind(kind)
    return out


class _Parser:
    def __init__(self, text: str, params: dict[str, ParamKind], allow_s: bool) -> None:
        self.toks = _tokenize(text)
        self.pos = 0
        self.params = params
        self.allow_s = allow_s
        self.nesting = 0

    # -- helpers ---------------------------------------------------------------------------

    @property
    def tok(self) -> _Token:
        return self.toks[self.pos]

    def _advance(self) -> _Token:
        t = self.toks[self.pos]
        self.pos += 1
        return t

    def _at(self, kind: str, text: str | None = None) -> bool:
        t = self.tok
        return t.kind == kind and (text is None or t.text == text)

    def _expect(self, text: str, what: str) -> _Token:
        if not self._at("op", text):
            got = self._describe(self.tok)
            raise UserModError(f"expected `{text}` {what}, got {got}", self.tok.col)
        return self._advance()

    @staticmethod
    def _describe(t: _Token) -> str:
        return "the end of the expression" if t.kind == "end" else f"`{t.text}`"

    def _enter(self, col: int) -> None:
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise UserModError(f"the expression nests deeper than {MAX_DEPTH} levels", col)

    def _leave(self) -> None:
        self.nesting -= 1

    @staticmethod
    def _made(node: Expr) -> Expr:
        if node.depth > MAX_DEPTH:
            raise UserModError(
                f"the expression is deeper than {MAX_DEPTH} levels (split long sums or products "
                "into fewer terms)",
                node.col,
            )
        return node

    # -- grammar ---------------------------------------------------------------------------

    def parse(self) -> Expr:
        if self._at("end"):
            raise UserModError(f"the expression is empty (allowed: {ALLOWED})", 1)
        node = self._or()
        if not self._at("end"):
            t = self.tok
            if t.kind == "name" and t.text in _PY_KEYWORD_HINTS:
                raise UserModError(_PY_KEYWORD_HINTS[t.text], t.col)
            hint = (
                " (comparisons do not chain: write `a < b and b < c`)"
                if t.kind == "op" and t.text in COMPARISONS
                else ""
            )
            raise UserModError(
                f"unexpected {self._describe(t)} after a complete expression{hint}", t.col
            )
        return node

    def _or(self) -> Expr:
        left = self._and()
        while self._at("name", "or"):
            col = self._advance().col
            left = self._made(Binary("or", left, self._and(), col=col))
        return left

    def _and(self) -> Expr:
        left = self._not()
        while self._at("name", "and"):
            col = self._advance().col
            left = self._made(Binary("and", left, self._not(), col=col))
        return left

    def _not(self) -> Expr:
        if self._at("name", "not"):
            col = self._advance().col
            self._enter(col)
            arg = self._not()
            self._leave()
            return self._made(Unary("not", arg, col=col))
        return self._comparison()

    def _comparison(self) -> Expr:
        left = self._sum()
        if self.tok.kind == "op" and self.tok.text in COMPARISONS:
            op = self._advance()
            right = self._sum()
            left = self._made(Binary(op.text, left, right, col=op.col))
            if self.tok.kind == "op" and self.tok.text in COMPARISONS:
                raise UserModError(
                    "comparisons do not chain: write `a < b and b < c`", self.tok.col
                )
        return left

    def _sum(self) -> Expr:
        left = self._product()
        while self.tok.kind == "op" and self.tok.text in ("+", "-"):
            op = self._advance()
            left = self._made(Binary(op.text, left, self._product(), col=op.col))
        return left

    def _product(self) -> Expr:
        left = self._unary()
        while self.tok.kind == "op" and self.tok.text in ("*", "/", "//", "%"):
            op = self._advance()
            left = self._made(Binary(op.text, left, self._unary(), col=op.col))
        return left

    def _unary(self) -> Expr:
        if self._at("op", "-"):
            col = self._advance().col
            self._enter(col)
            arg = self._unary()
            self._leave()
            return self._made(negate(arg, col=col))
        if self._at("op", "+"):
            raise UserModError("unary `+` is not in the grammar: drop it", self.tok.col)
        return self._atom()

    def _atom(self) -> Expr:
        t = self.tok
        if t.kind == "num":
            self._advance()
            is_float = any(c in t.text for c in ".eE")
            value: int | float = float(t.text) if is_float else int(t.text)
            if is_float and value == float("inf"):
                raise UserModError(
                    f"the float literal {t.text} is out of float32's range (|x| <= 3.4e38)", t.col
                )
            return Const(value, col=t.col)
        if t.kind == "name":
            return self._name()
        if self._at("op", "("):
            self._advance()
            self._enter(t.col)
            node = self._or()
            self._leave()
            self._expect(")", f"to close the `(` at column {t.col}")
            return node
        if t.kind == "end":
            raise UserModError("the expression ends where an operand is expected", t.col)
        raise UserModError(
            f"expected an operand (a number, a name, a call or `(`), got {self._describe(t)}",
            t.col,
        )

    def _name(self) -> Expr:
        t = self._advance()
        name, col = t.text, t.col
        if name in ("True", "False"):
            return Const(name == "True", col=col)
        if name in ("and", "or", "not"):
            raise UserModError(f"expected an operand, got `{name}`", col)
        if name in FUNCTIONS:
            return self._call(name, col)
        if name in VARIABLES:
            if name == "s" and not self.allow_s:
                raise UserModError(
                    "the score `s` is not available in a mask_mod: a mask decides visibility "
                    "from b, h, i, j, seqlen_q, seqlen_k and parameters (use a score_mod to "
                    "change scores)",
                    col,
                )
            if self._at("op", "(") or self._at("op", "["):
                what = "called" if self.tok.text == "(" else "indexed"
                raise UserModError(f"{name!r} is a variable and cannot be {what}", self.tok.col)
            return Var(name, col=col)
        if name in self.params:
            return self._param(name, self.params[name], col)
        raise UserModError(self._unknown(name), col)

    def _unknown(self, name: str) -> str:
        if name in _PY_KEYWORD_HINTS:
            return _PY_KEYWORD_HINTS[name]
        if keyword.iskeyword(name):
            return f"the Python keyword `{name}` is not in the grammar (allowed: {ALLOWED})"
        names = [v for v in VARIABLES if v != "s" or self.allow_s]
        candidates = [*names, *self.params, *FUNCTIONS, *sorted(_WORDS)]
        near = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        declared = (
            f"; parameters: {', '.join(self.params)}"
            if self.params
            else "; declare runtime values as params: {name: kind}"
        )
        return (
            f"unknown name {name!r}{hint}; variables: {', '.join(names)}{declared}; "
            f"functions: {', '.join(FUNCTIONS)}"
        )

    def _call(self, func: str, col: int) -> Expr:
        if not self._at("op", "("):
            raise UserModError(f"{func} is a function: call it as {func}(...)", col)
        self._advance()
        self._enter(col)
        args = [self._or()]
        while self._at("op", ","):
            self._advance()
            args.append(self._or())
        self._leave()
        self._expect(")", f"to close {func}( at column {col}")
        return self._made(Call(func, tuple(args), col=col))

    def _param(self, name: str, kind: ParamKind, col: int) -> Expr:
        info = KIND_INFO[kind]
        usage = info.syntax.replace("name", name)
        if not info.index:
            if self._at("op", "["):
                raise UserModError(
                    f"{kind.value} parameter {name!r} takes no index: write {name}", self.tok.col
                )
            return Param(name, kind, col=col)
        if not self._at("op", "["):
            raise UserModError(f"{kind.value} parameter {name!r} is read as {usage}", col)
        self._advance()
        self._enter(col)
        index = [self._or()]
        while self._at("op", ","):
            self._advance()
            index.append(self._or())
        self._leave()
        self._expect("]", f"to close {name}[ at column {col}")
        return self._made(Param(name, kind, tuple(index), col=col))


def parse_expr(
    text: str,
    params: Mapping[str, str | ParamKind] | None = None,
    *,
    allow_s: bool = True,
) -> Expr:
    """The typed tree of `text`, of any type (`parse_score_mod` and `parse_mask_mod` also
    check the result's type). `params` declares the runtime parameters `{name: kind}`;
    `allow_s=False` refuses the score `s` (mask_mod). Raises `UserModError`."""
    if not isinstance(text, str):
        raise UserModError(f"an expression is text, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise UserModError(
            f"the expression is {len(text)} characters long: at most {MAX_LENGTH} are allowed"
        )
    declared = check_params(params)
    return _Parser(text, declared, allow_s).parse()


@dataclass(frozen=True)
class UserMod:
    """A parsed, checked modifier: its `kind` ('score_mod' or 'mask_mod'), tree, declared
    parameters (sorted by name) and source text."""

    kind: str
    tree: Expr
    params: tuple[tuple[str, ParamKind], ...]
    text: str = field(default="", compare=False)

    @cached_property
    def canonical(self) -> str:
        """The canonical text of the tree (`tree.canonical`)."""
        return canonical(self.tree)

    @property
    def variables(self) -> frozenset[str]:
        """The built-in variables the expression reads."""
        return frozenset(n.name for n in walk(self.tree) if isinstance(n, Var))

    @property
    def used_params(self) -> tuple[tuple[str, ParamKind], ...]:
        """The declared parameters the expression reads."""
        used = {n.name for n in walk(self.tree) if isinstance(n, Param)}
        return tuple(p for p in self.params if p[0] in used)

    @cached_property
    def derivative(self) -> Expr:
        """d(score_mod)/ds, simplified (`calculus.derivative`); a mask_mod has none."""
        if self.kind != "score_mod":
            raise UserModError("a mask_mod has no derivative: only a score_mod changes scores")
        from .calculus import derivative

        return derivative(self.tree)

    def digest(self, length: int = 8) -> str:
        """A hex digest of the kind, canonical text and declared parameters: equal for every
        spelling of one modifier, for kernel names."""
        decl = ",".join(f"{n}:{k.value}" for n, k in self.params)
        data = f"{self.kind}\n{self.canonical}\n{decl}".encode()
        return hashlib.sha256(data).hexdigest()[:length]


def _sorted_params(params: Mapping[str, str | ParamKind] | None) -> tuple:
    return tuple(sorted(check_params(params).items()))


def parse_score_mod(
    text: str,
    params: Mapping[str, str | ParamKind] | None = None,
    *,
    need_grad: bool = True,
) -> UserMod:
    """A score_mod: a float expression of the scaled score `s`, the indices and parameters,
    giving the new logit. `need_grad` (the default) also requires d/ds to exist (refused
    constructs: `calculus.derivative`)."""
    tree = parse_expr(text, params, allow_s=True)
    if tree.type is not Type.FLOAT:
        hint = (
            "a comparison or mask belongs in a mask_mod"
            if tree.type is Type.BOOL
            else "add it to the score, e.g. `s + (...)`, or make it float with `* 1.0`"
        )
        raise UserModError(
            f"a score_mod must give a float score, but this expression is {tree.type.value} "
            f"({hint})",
            tree.col,
        )
    mod = UserMod("score_mod", tree, _sorted_params(params), text)
    if need_grad:
        _ = mod.derivative
    return mod


def parse_mask_mod(text: str, params: Mapping[str, str | ParamKind] | None = None) -> UserMod:
    """A mask_mod: a bool expression of b, h, i, j, seqlen_q, seqlen_k and parameters; True
    means key j is visible to query i."""
    tree = parse_expr(text, params, allow_s=False)
    if tree.type is not Type.BOOL:
        raise UserModError(
            f"a mask_mod must give a bool (True: key j is visible to query i), but this "
            f"expression is {tree.type.value} (compare it, e.g. `... != 0`)",
            tree.col,
        )
    return UserMod("mask_mod", tree, _sorted_params(params), text)
