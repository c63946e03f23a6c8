"""A spec's user-defined mask (`mask_mod`, generator.usermod) as a functor of the mask stage:
the C++ of `Spec::UserMask`, which `templates/common/spec_struct.j2` renders beside the spec's
other constants and `fg::MaskMod<U>` (templates/include/flashgen/mask_mod.cuh) runs in every
family that serves it.

The rendered struct (`user_mask_cpp`):

- `Vals`, `load(sp, b, h, q_tok0, k_tok0, v)`: the parameters, as `Spec::UserScore` reads them
  (generator/features/user.py, one slot table for both), plus the per-token vectors: a base
  pointer per side (`itok_<name>` for queries, `jtok_<name>` for keys) at the sequence's first
  token (`q_tok0`, `k_tok0`: packed positions with varlen, b * seqlen otherwise);
- `visible(p, i, j, sq, sk)`: the mask of one element (`usermod.emit_cpp`);
- `classify(p, i0, i1, j0, j1, sq, sk)`: the class of the tile of queries [i0, i1] and keys
  [j0, j1] (0 EMPTY, 1 PARTIAL, 2 FULL), emitted from the tree as calls of the interval
  helpers of `mask_mod_iv.h`, the C++ twin of `usermod.blocks` (`classify_cpp`). Int and bool
  nodes are bounded exactly as blocks.py bounds them; a comparison with a float operand may be
  either (blocks.py bounds floats too, with float32 widening: here such a mask runs its
  element-wise test on every tile, which is sound); a per-token vector is bounded by its values
  over the tile's rows or keys, read one by one (`fg_tok_bounds`), as blocks.py bounds a vector
  it is given;
- `check(sp)` (host): the launch check of the parameter slots (`user.slot_checks`).

No text of the expression reaches the C++ but what is emitted from the tree (parameter names
are checked identifiers).
"""

from __future__ import annotations

from flashgen.generator.features.user import (
    TOKEN_KINDS,
    VALS_ACCESS,
    slot_checks,
    slot_loads,
    slot_vals,
)
from flashgen.generator.usermod import (
    Binary,
    Call,
    Const,
    Expr,
    Param,
    ParamKind,
    Type,
    Unary,
    UserMod,
    Var,
    emit_cpp,
)

__all__ = ["classify_cpp", "user_mask_cpp", "visible_cpp"]

# how `visible` reads a parameter from `Vals` (per-token vectors: the side's base pointer)
_ACCESS = {
    **VALS_ACCESS,  # the per-(b, h) values: as a score_mod reads them
    ParamKind.PER_TOKEN_Q: "{p}.{var}tok_{name}[{index}]",
    ParamKind.PER_TOKEN_K: "{p}.{var}tok_{name}[{index}]",
    ParamKind.PER_TOKEN: "{p}.{var}tok_{name}[{index}]",
    ParamKind.TABLE: "{p}.v_{name}[fg_clamp_index({k}, {p}.n_{name})]",
}

_NAMES = {"b": "p.b", "h": "p.h", "i": "i", "j": "j", "seqlen_q": "sq", "seqlen_k": "sk"}

# the interval of each variable over a tile (i in [i0, i1], j in [j0, j1]; the rest exact)
_VAR_IV = {
    "i": "fg_iv_of(i0, i1)",
    "j": "fg_iv_of(j0, j1)",
    "b": "fg_iv_of(p.b, p.b)",
    "h": "fg_iv_of(p.h, p.h)",
    "seqlen_q": "fg_iv_of(sq, sq)",
    "seqlen_k": "fg_iv_of(sk, sk)",
}
_COMPARE = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
_ARITH = {"+": "add", "-": "sub", "*": "mul", "//": "floordiv", "%": "mod"}


class _Bounds:
    """C++ of an int node's `fg_iv` or a bool node's `fg_tri` (module doc), mirroring
    usermod.blocks._Bounder on ints and bools."""

    def __init__(self) -> None:
        self.tokens: set[tuple[str, str]] = set()  # (side, name) of per-token reads

    def __call__(self, node: Expr) -> str:
        if node.type is Type.BOOL:
            return self.tri(node)
        if node.type is Type.INT:
            return self.iv(node)
        raise AssertionError("float nodes are not bounded (their comparisons are fg_tri_any)")

    def tri(self, node: Expr) -> str:
        if isinstance(node, Const):
            return f"fg_tri_const({'true' if node.value else 'false'})"
        if isinstance(node, Unary):  # not
            return f"fg_tri_not({self.tri(node.arg)})"
        if isinstance(node, Binary):
            if node.op in ("and", "or"):
                return f"fg_tri_{node.op}({self.tri(node.left)}, {self.tri(node.right)})"
            if node.left.type is not Type.INT or node.right.type is not Type.INT:
                return "fg_tri_any()"  # a float comparison: not bounded here
            return f"fg_iv_{_COMPARE[node.op]}({self.iv(node.left)}, {self.iv(node.right)})"
        if isinstance(node, Call) and node.func == "where":
            c, a, b = node.args
            return f"fg_tri_where({self.tri(c)}, {self.tri(a)}, {self.tri(b)})"
        raise AssertionError(f"not a bool node: {node!r}")

    def iv(self, node: Expr) -> str:
        if isinstance(node, Const):
            return f"fg_iv_of({node.value}ll, {node.value}ll)"
        if isinstance(node, Var):
            return _VAR_IV[node.name]
        if isinstance(node, Param):
            if node.kind in (ParamKind.SCALAR_INT, ParamKind.PER_BATCH_INT):
                return f"fg_iv_of(p.v_{node.name}, p.v_{node.name})"
            if node.kind in TOKEN_KINDS:  # its values over the tile's rows or keys
                side = node.index[0].name
                self.tokens.add((side, node.name))
                return f"fg_iv_of(lo_{side}_{node.name}, hi_{side}_{node.name})"
            raise AssertionError(f"not an int parameter: {node!r}")
        if isinstance(node, Unary):
            return f"fg_iv_neg({self.iv(node.arg)})"
        if isinstance(node, Binary):
            return f"fg_iv_{_ARITH[node.op]}({self.iv(node.left)}, {self.iv(node.right)})"
        if isinstance(node, Call):
            f, args = node.func, node.args
            if f == "where":
                return f"fg_iv_where({self.tri(args[0])}, {self.iv(args[1])}, {self.iv(args[2])})"
            if f in ("min", "max"):
                return f"fg_iv_{f}({self.iv(args[0])}, {self.iv(args[1])})"
            if f == "abs":
                return f"fg_iv_abs({self.iv(args[0])})"
            if f == "floor":
                x = args[0]
                return self.iv(x) if x.type is Type.INT else "fg_iv_top()"
        raise AssertionError(f"not an int node: {node!r}")


def classify_cpp(mod: UserMod) -> tuple[list[str], str]:
    """The C++ of the tile class of `mod` (an int: 0 EMPTY, 1 PARTIAL, 2 FULL), of `p` (Vals),
    the tile's `i0, i1, j0, j1` and the lengths `sq`, `sk` (int64_t): the statements that
    bound the per-token vectors it reads over the tile's rows (side i) or keys (side j), and
    the expression."""
    bounds = _Bounds()
    expr = f"fg_tri_class({bounds.tri(mod.tree)})"
    stmts = []
    for side, name in sorted(bounds.tokens):
        lo, hi = ("i0", "i1") if side == "i" else ("j0", "j1")
        stmts.append(f"int64_t lo_{side}_{name}, hi_{side}_{name};")
        stmts.append(
            f"fg_tok_bounds(p.{side}tok_{name}, {lo}, {hi}, lo_{side}_{name}, hi_{side}_{name});"
        )
    return stmts, expr


def visible_cpp(mod: UserMod) -> str:
    """The C++ bool expression of `mod` at query `i`, key `j` (int64_t), of `p`, `sq`, `sk`."""
    return emit_cpp(mod.tree, _NAMES, access=_ACCESS)


def user_mask_cpp(mod: UserMod, indent: str = "  ") -> str:
    """The C++ of `struct UserMask` for `mod` (module doc), indented by `indent`."""
    sides = {side for _, kind in mod.params if kind in TOKEN_KINDS for side in TOKEN_KINDS[kind]}
    lines = [
        f"// mask_mod: {mod.canonical}",
        "// (generator/usermod; i and j 0-based in the sequence, True: visible; docs/usermod.md)",
        "struct UserMask {",
        "  static constexpr bool kOn = true;",
        f"  static constexpr bool kTokens = {'true' if sides else 'false'};  // per-token vectors",
        "  struct Vals {",
        *(f"    {line}" for line in slot_vals(mod)),
        "  };",
        "  static __device__ __forceinline__ void load(const fg_score_params& sp, int64_t b,",
        "                                              int64_t h, int64_t q_tok0, int64_t k_tok0,",
        "                                              Vals& v) {",
        "    (void)q_tok0, (void)k_tok0;",
        *(f"    {line}" for line in slot_loads(mod)),
        "  }",
        "  // key j visible to query i (both inside the sequence)",
        "  static FG_USERMOD_FN bool visible(const Vals& p, int64_t i, int64_t j, int64_t sq,",
        "                                    int64_t sk) {",
        "    (void)p, (void)i, (void)j, (void)sq, (void)sk;",
        f"    return {visible_cpp(mod)};",
        "  }",
        "  // the tile of queries [i0, i1] x keys [j0, j1]: 0 EMPTY, 1 PARTIAL, 2 FULL",
        "  static FG_USERMOD_FN int classify(const Vals& p, int64_t i0, int64_t i1, int64_t j0,",
        "                                    int64_t j1, int64_t sq, int64_t sk) {",
        "    (void)p, (void)i0, (void)i1, (void)j0, (void)j1, (void)sq, (void)sk;",
        *(f"    {line}" for line in classify_cpp(mod)[0]),
        f"    return {classify_cpp(mod)[1]};",
        "  }",
        "  // the launch check of the parameter slots (fg_score_params.user_*)",
        "  static const char* check(const fg_score_params& sp) {",
        *(f"    {line}" for line in slot_checks(mod)),
        "  }",
        "};",
    ]
    return "\n".join(indent + line if line else line for line in lines)
