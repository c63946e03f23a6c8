"""User-defined score_mod and mask_mod expressions (issue 26): the front end.

A spec may describe its own score modifier (`score_mod`: a float expression of the scaled
score `s`, the indices and runtime parameters, giving the new logit) and its own mask
(`mask_mod`: a bool expression, True where key j is visible to query i), as FlexAttention's
score_mod / mask_mod do in Python. This package turns their text into everything the rest of
flashgen needs, independently of the kernels:

- `parse_score_mod`, `parse_mask_mod` (`parse.py`): a hand-written tokenizer and
  recursive-descent parser into an immutable, typed tree (`tree.py`); refusals are
  `UserModError(message, column)`;
- `canonical` (`tree.py`): one text per tree, for kernel names (`UserMod.digest`);
- `derivative`, `simplify` (`calculus.py`): d(score_mod)/ds for the backward;
- `emit_cpp`, `CPP_HELPERS`, `cpp_helpers_int32` (`emit.py`): a C++ expression for a device
  functor, and the helpers it calls (int32 ones where bounds prove that an int fits);
- `evaluate` (`numeric.py`): numpy in float64 (the reference) or float32 (the baseline);
- `classify_block`, `block_map` (`blocks.py`): FULL / EMPTY / PARTIAL tiles of a mask,
  soundly, from interval bounds (`bounds`, `node_bounds`);
- `EXAMPLES` (`examples.py`).

docs/usermod.md documents the grammar, the types, the integer semantics, what is
differentiable and what the block classification guarantees. Nothing here evaluates text or
pastes it into C++, and nothing imports the rest of the project.
"""

from __future__ import annotations

from .blocks import Block, Interval, block_map, bounds, classify_block, node_bounds
from .calculus import derivative, simplify
from .emit import (
    CPP_HELPERS,
    CPP_HELPERS_INT32,
    DEFAULT_ACCESS,
    cpp_float_literal,
    cpp_helpers_int32,
    emit_cpp,
    int32_nodes,
    linear_form,
)
from .examples import EXAMPLE_BY_NAME, EXAMPLES, Example
from .numeric import evaluate, floor_int, floordiv, modulo
from .parse import ALLOWED, UserMod, check_params, parse_expr, parse_mask_mod, parse_score_mod
from .tree import (
    FUNCTIONS,
    KIND_INFO,
    MAX_DEPTH,
    MAX_LENGTH,
    VARIABLES,
    Binary,
    Call,
    Const,
    Expr,
    KindInfo,
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
    "Binary",
    "Block",
    "CPP_HELPERS",
    "CPP_HELPERS_INT32",
    "Call",
    "Const",
    "DEFAULT_ACCESS",
    "EXAMPLES",
    "EXAMPLE_BY_NAME",
    "Example",
    "Expr",
    "FUNCTIONS",
    "Interval",
    "KIND_INFO",
    "KindInfo",
    "MAX_DEPTH",
    "MAX_LENGTH",
    "Param",
    "ParamKind",
    "Type",
    "Unary",
    "UserMod",
    "UserModError",
    "VARIABLES",
    "Var",
    "block_map",
    "bounds",
    "canonical",
    "check_params",
    "classify_block",
    "cpp_float_literal",
    "cpp_helpers_int32",
    "derivative",
    "emit_cpp",
    "int32_nodes",
    "linear_form",
    "evaluate",
    "floor_int",
    "floordiv",
    "modulo",
    "negate",
    "node_bounds",
    "parse_expr",
    "parse_mask_mod",
    "parse_score_mod",
    "simplify",
    "walk",
]
