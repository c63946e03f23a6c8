"""Score-stage features as data: one module per feature, one registry.

A feature is a boolean spec field that switches on one functor of the score stage
(`templates/include/flashgen/score_mod.cuh`): a transform of the scores (softcap, ALiBi) or a
term of the softmax denominator (attention sinks). Each feature module declares, in one
`Feature` row:

- its spec field (`name`, a top-level boolean in YAML), its kernel-name part, the kernel
  kinds that accept it and its extra validation (`problems`);
- its C++ constant (`cpp`, a `static constexpr bool` of the kernel's `Spec`);
- its runtime parameter rows (`params`): fields of `fg_score_params`, the C struct every
  family's parameter struct ends with. `score_params.h` is rendered from these rows
  (`render_score_params_h`) and `flashgen generate` keeps it current;
- the flash-attn argument it serves in `flashgen.torch` (`torch_arg`);
- its reference semantics, which `verify.score_mods` implements in float64 and in the
  kernel's precision, and its Hypothesis strategy (`verify.strategies.score_args`).

A spec's user-defined score modifier (`score_mod`, generator.usermod) is not a row: its
runtime parameters take the generic slots `USER_PARAMS` that close `fg_score_params`.

Everything that lists features iterates `FEATURES`: the spec's field table, the render
context, the parameter tables, the launch checks (`check_score_params` in score_mod.cuh),
the runners, the reference, the baseline and flashgen.torch's selection. Adding a score
modifier is one module here (plus its functor and tests); docs/design.md shows the cost.

This package imports nothing of the project: `generator.spec` builds its field rows from it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "FEATURES",
    "FEATURE_BY_NAME",
    "Feature",
    "ParamRow",
    "SCORE_PARAMS",
    "SCORE_PARAMS_HEADER",
    "USER_PARAMS",
    "USER_SLOTS",
    "render_score_params_h",
]


@dataclass(frozen=True)
class ParamRow:
    """One field of `fg_score_params` (8 bytes wide, like every parameter field)."""

    name: str
    ctype: str  # "ptr" | "i64" | "u64" | "f64"
    c_decl: str  # its C declaration, e.g. "const float* alibi_slopes"
    doc: str


@dataclass(frozen=True)
class Feature:
    """One score-stage feature (see the package docstring)."""

    name: str  # spec field and YAML key
    part: str  # kernel-name part when on
    cpp: str  # constexpr bool of the kernel's Spec
    label: str  # README table and `flashgen show`
    torch_arg: str  # flash-attn argument served by this feature
    params: tuple[ParamRow, ...]
    doc: str
    kinds: tuple[str, ...] | None = None  # kernel kinds (YAML spellings); None: every kind
    # extra validation: spec -> [(field, message)]
    check: Callable[[Any], list[tuple[str, str]]] | None = field(default=None, compare=False)

    def problems(self, spec: Any) -> list[tuple[str, str]]:
        return list(self.check(spec)) if self.check is not None else []


_MODULES = ("softcap", "alibi", "sink")  # order: kernel-name parts, C constants, param rows


def _load() -> tuple[Feature, ...]:
    return tuple(importlib.import_module(f"{__name__}.{m}").FEATURE for m in _MODULES)


FEATURES: tuple[Feature, ...] = _load()
FEATURE_BY_NAME = {f.name: f for f in FEATURES}

# A user modifier's runtime parameters (a spec's `params`, generator.usermod) travel in
# USER_SLOTS generic slots after the features' rows. Parameter k of the spec's `params`
# (sorted by name) owns slot k, and reads the field of its kind's type:
#   scalar                                    user_f<k>  (double; the kernel rounds to fp32)
#   scalar_int                                user_i<k>  (int64)
#   per_head, per_batch                       user_ptr<k> (fp32 vector: heads / batch)
#   per_batch_int                             user_ptr<k> (int32 vector: batch)
#   table                                     user_ptr<k> (fp32 (heads, columns), row-major)
#                                             and user_i<k> = columns (>= 1)
# Slots a kernel does not read must be 0 (NULL); the launch check refuses anything else, and
# a NULL pointer for a parameter the kernel reads.
USER_SLOTS = 4


def _user_rows(k: int) -> tuple[ParamRow, ...]:
    return (
        ParamRow(f"user_ptr{k}", "ptr", f"const void* user_ptr{k}", f"param {k}: its device array"),
        ParamRow(f"user_f{k}", "f64", f"double user_f{k}", f"param {k}: a scalar's value"),
        ParamRow(
            f"user_i{k}",
            "i64",
            f"int64_t user_i{k}",
            f"param {k}: a scalar_int's value, or a table's columns",
        ),
    )


USER_PARAMS: tuple[ParamRow, ...] = tuple(r for k in range(USER_SLOTS) for r in _user_rows(k))
SCORE_PARAMS: tuple[ParamRow, ...] = tuple(r for f in FEATURES for r in f.params) + USER_PARAMS


# where the rendered struct lives, relative to the templates folder (and to generated/)
SCORE_PARAMS_HEADER = "include/flashgen/score_params.h"


def render_score_params_h() -> str:
    """The text of `include/flashgen/score_params.h`: `fg_score_params` from `SCORE_PARAMS`."""
    lines = [
        "/* generated from generator/features/ by `flashgen generate`: do not edit. */",
        "/* flashgen: runtime parameters of the score-stage features (score_mod.cuh). Every",
        "   family's parameter struct ends with one `fg_score_params score;`. All fields are",
        "   8 bytes wide; zero (NULL) means the feature is not used by the call. */",
        "#ifndef FLASHGEN_SCORE_PARAMS_H",
        "#define FLASHGEN_SCORE_PARAMS_H",
        "",
        "#include <stdint.h>",
        "",
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        "typedef struct fg_score_params {",
    ]
    for f in FEATURES:
        lines.append(f"  /* {f.name} ({f.cpp}): {f.doc} */")
        for r in f.params:
            lines.append(f"  {r.c_decl}; /* {r.doc} */")
    lines += [
        f"  /* score_mod and mask_mod (Spec::UserScore, Spec::UserMask): the spec's params, "
        f"{USER_SLOTS}",
        "     slots; param k (by name) reads user_f<k> (scalar), user_i<k> (scalar_int),",
        "     user_ptr<k> (fp32 per_head / per_batch vector, int32 per_batch_int vector, fp32",
        "     (heads, columns) table with user_i<k> = columns, int32 per-token vector of a",
        "     mask_mod, by packed position); docs/usermod.md */",
    ]
    for r in USER_PARAMS:
        lines.append(f"  {r.c_decl}; /* {r.doc} */")
    lines += [
        "} fg_score_params;",
        "",
        "/* nonzero when a user slot is set: a kernel generated without score_mod refuses that",
        "   (score_check.h) */",
        "static inline int fg_score_user_slots_set(const fg_score_params* s) {",
    ]
    tests = [f"s->{r.name} != 0" + (".0" if r.ctype == "f64" else "") for r in USER_PARAMS]
    for n, t in enumerate(tests):
        lines.append(
            ("  return " if n == 0 else "         ") + t + (";" if n == len(tests) - 1 else " ||")
        )
    lines += [
        "}",
        "",
        "#ifdef __cplusplus",
        "}",
        "#endif",
        "#endif /* FLASHGEN_SCORE_PARAMS_H */",
        "",
    ]
    return "\n".join(lines)
