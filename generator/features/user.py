"""A spec's user-defined score modifier (`score_mod`, generator.usermod) as a functor of the
score stage: the C++ of `Spec::UserScore`, which `templates/common/spec_struct.j2` renders
beside the spec's other constants and `fg::User<U>` (score_mod.cuh) composes into `ScoreMod`.

Not a `Feature` row (a score_mod is an expression, not a boolean): its runtime parameters
take the generic slots `USER_PARAMS` of `fg_score_params`, parameter k of the spec's sorted
`params` owning slot k (the slot table is in this package's `__init__`).

The rendered struct (`user_score_cpp`):

- `Vals`: what the functor reads once per (batch b, head h): b and h, every scalar (fp32 or
  int64), the per_head / per_batch values at h / b, and a table's row h (a pointer) with its
  column count; parameter `name` is member `v_name`, a table's columns `n_name` and its last
  column as int32 `l_name` (the int32 column clamp), so no two members clash whatever the
  names (`bias` beside `bias_cols`, or `Vals`);
- the int32 helpers the expression calls (`usermod.cpp_helpers_int32`), as static members:
  `value` computes in int32 the ints that `KERNEL_INT_BOUNDS` proves fit;
- `load(sp, b, h, v)`: fills `Vals` from the slots (`__ldg` reads of the vectors);
- `value(s, p, q)`: the expression (`usermod.emit_cpp`) of s = scale * x, the `Vals` p and the
  position q (`fg::ScorePos`: i, j, seqlen_q, seqlen_k);
- `grad(s, p, q)`: d(score_mod)/ds (`usermod.derivative`), only when it is not the constant 1
  (`kHasGrad`);
- `check(sp)` (host): the launch check of the slots: a NULL or misaligned pointer of a declared
  parameter, a table with fewer than one column, a non-finite scalar, and any field that no
  declared parameter reads, are refused with a message naming the parameter and the slot.

No text of the expression reaches the C++ but what `emit_cpp` writes from the tree (parameter
names are checked identifiers); the canonical text appears once, in a `//` comment (it holds no
newline).
"""

from __future__ import annotations

from flashgen.generator.features import USER_SLOTS
from flashgen.generator.usermod import (
    Const,
    ParamKind,
    UserMod,
    cpp_helpers_int32,
    emit_cpp,
)

__all__ = [
    "KERNEL_INT_BOUNDS",
    "SLOT_FIELDS",
    "TOKEN_KINDS",
    "slot_checks",
    "slot_loads",
    "slot_vals",
    "user_score_cpp",
    "user_slots",
]

# the field of slot k a kind reads: ptr (its device array), f (a scalar), i (an int, a table's
# columns)
SLOT_FIELDS: dict[ParamKind, tuple[str, ...]] = {
    ParamKind.SCALAR: ("f",),
    ParamKind.SCALAR_INT: ("i",),
    ParamKind.PER_HEAD: ("ptr",),
    ParamKind.PER_BATCH: ("ptr",),
    ParamKind.PER_BATCH_INT: ("ptr",),
    ParamKind.TABLE: ("ptr", "i"),
    # int32 per-token vectors (read by a mask_mod only: generator/features/user_mask.py)
    ParamKind.PER_TOKEN_Q: ("ptr",),
    ParamKind.PER_TOKEN_K: ("ptr",),
    ParamKind.PER_TOKEN: ("ptr",),
}

# per-token kinds: a base pointer per side (`itok_<name>` for queries, `jtok_<name>` for
# keys), offset to the sequence's first token when loaded
TOKEN_KINDS = {
    ParamKind.PER_TOKEN_Q: ("i",),
    ParamKind.PER_TOKEN_K: ("j",),
    ParamKind.PER_TOKEN: ("i", "j"),
}

# how the expression reads a parameter from `Vals` (the index is fixed by the grammar: h for
# per_head and tables, b for per_batch, so the value is loaded once per (b, h))
VALS_ACCESS = {
    ParamKind.SCALAR: "{p}.v_{name}",
    ParamKind.SCALAR_INT: "{p}.v_{name}",
    ParamKind.PER_HEAD: "{p}.v_{name}",
    ParamKind.PER_BATCH: "{p}.v_{name}",
    ParamKind.PER_BATCH_INT: "{p}.v_{name}",
    ParamKind.TABLE: "__ldg({p}.v_{name} + fg_clamp_index({k}, {p}.n_{name}))",
}

# the variables: s the scaled score; b, h from Vals; i, j and the lengths from fg::ScorePos
_NAMES = {
    "s": "s",
    "b": "p.b",
    "h": "p.h",
    "i": "q.i",
    "j": "q.j",
    "seqlen_q": "q.sq",
    "seqlen_k": "q.sk",
}
# float i, j and i - j of fg::ScorePos (usermod/emit.py: float positions)
_FLOAT_POSITIONS = {"i": "q.fi", "j": "q.fj", "i-j": "q.fij"}

# What the kernels guarantee of the ints a score_mod reads, for the int32 arithmetic of
# usermod/emit.py. fg::ScorePos holds i, j, seqlen_q and seqlen_k as int32 (score_mod.cuh:
# positions and lengths below 2^31), so a score that counts (0 <= i < seqlen_q, 0 <= j <
# seqlen_k) reads positions in [0, 2^31 - 2]; the launchers refuse batch or heads over
# 2^31 - 1 (launch.cuh, bwd_launch.cuh, decode_launch.cuh), so b, h are below 2^31 - 1; a
# per_batch_int vector is int32. Other scores (the rows past a sequence, masked) may see
# wrapped int32 values: signed overflow there is undefined behaviour in C++, tolerated because
# those scores are discarded (P = 0) and no int32 operation traps on the GPU (the helpers
# guard `// 0` and `// -1`). scalar_int parameters are int64 (`user_i<k>`): unbounded, so
# they keep int64.
KERNEL_INT_BOUNDS: dict[str | ParamKind, tuple[int, int]] = {
    "i": (0, 2**31 - 2),
    "j": (0, 2**31 - 2),
    "seqlen_q": (0, 2**31 - 1),
    "seqlen_k": (0, 2**31 - 1),
    "b": (0, 2**31 - 2),
    "h": (0, 2**31 - 2),
    ParamKind.PER_BATCH_INT: (-(2**31), 2**31 - 1),
}
# a table read at an int32 column: clamped to [0, l_name], its last column as int32
_TABLE_INT32 = "__ldg({p}.v_{name} + fg_clamp_last32({k}, {p}.l_{name}))"


def user_slots(mod: UserMod) -> list[tuple[int, str, ParamKind]]:
    """(slot, name, kind) of each declared parameter: slot k is the k-th by name."""
    return [(k, name, kind) for k, (name, kind) in enumerate(mod.params)]


def slot_vals(mod: UserMod) -> list[str]:
    """The members of `Vals`; per-token vectors (a mask_mod's) have a base pointer per side."""
    out = ["int64_t b, h;"]
    for _, name, kind in user_slots(mod):
        if kind in TOKEN_KINDS:
            if mod.kind == "mask_mod":
                for side in TOKEN_KINDS[kind]:
                    out.append(
                        f"const int32_t* {side}tok_{name};  // {name} at token 0 of the sequence"
                    )
        elif kind is ParamKind.TABLE:
            out.append(f"const float* v_{name};  // row h of the (heads, n_{name}) table {name}")
            out.append(f"int64_t n_{name};")
            if mod.kind == "score_mod":  # the int32 column clamp's bound
                out.append(f"int32_t l_{name};  // its last column, at most 2^31 - 1")
        elif kind in (ParamKind.SCALAR_INT, ParamKind.PER_BATCH_INT):
            out.append(f"int64_t v_{name};")
        else:
            out.append(f"float v_{name};")
    return out


def slot_loads(mod: UserMod) -> list[str]:
    """The body of `load`: a mask_mod's also takes the sequence's first query and key token
    (`q_tok0`, `k_tok0`: packed positions with varlen, b * seqlen otherwise)."""
    out = ["v.b = b;", "v.h = h;"]
    for k, name, kind in user_slots(mod):
        ptr = f"sp.user_ptr{k}"
        if kind in TOKEN_KINDS:
            if mod.kind == "mask_mod":
                for side in TOKEN_KINDS[kind]:
                    base = "q_tok0" if side == "i" else "k_tok0"
                    out.append(f"v.{side}tok_{name} = static_cast<const int32_t*>({ptr}) + {base};")
        elif kind is ParamKind.SCALAR:
            out.append(f"v.v_{name} = static_cast<float>(sp.user_f{k});")
        elif kind is ParamKind.SCALAR_INT:
            out.append(f"v.v_{name} = sp.user_i{k};")
        elif kind is ParamKind.PER_HEAD:
            out.append(f"v.v_{name} = __ldg(static_cast<const float*>({ptr}) + h);")
        elif kind is ParamKind.PER_BATCH:
            out.append(f"v.v_{name} = __ldg(static_cast<const float*>({ptr}) + b);")
        elif kind is ParamKind.PER_BATCH_INT:
            out.append(f"v.v_{name} = __ldg(static_cast<const int32_t*>({ptr}) + b);")
        elif kind is ParamKind.TABLE:
            out.append(f"v.n_{name} = sp.user_i{k};")
            if mod.kind == "score_mod":
                out.append(f"v.l_{name} = fg_last32(v.n_{name});")
            out.append(f"v.v_{name} = static_cast<const float*>({ptr}) + h * v.n_{name};")
        else:  # refused by the spec (generator.spec._KINDS_NOT_SERVED)
            raise ValueError(f"parameter kind {kind.value} has no slot reading")
    return out


def slot_checks(mod: UserMod) -> list[str]:
    """The body of `UserScore::check` (host code): declared slots set as their kind needs,
    everything else 0."""
    out = []
    used: dict[int, tuple[str, ...]] = {}
    for k, name, kind in user_slots(mod):
        fields = SLOT_FIELDS[kind]
        used[k] = fields
        what = f"{mod.kind} parameter {name} ({kind.value}, slot {k})"
        if "ptr" in fields:
            out.append(f'if (!sp.user_ptr{k}) return "{what}: user_ptr{k} must be non-null";')
            out.append(
                f"if (reinterpret_cast<uintptr_t>(sp.user_ptr{k}) % 4 != 0)"
                f' return "{what}: user_ptr{k} must be 4-byte aligned";'
            )
        if kind is ParamKind.TABLE:
            out.append(
                f'if (sp.user_i{k} < 1) return "{what}: user_i{k} (its columns) must be >= 1";'
            )
        if kind is ParamKind.SCALAR:
            out.append(f'if (!isfinite(sp.user_f{k})) return "{what}: user_f{k} must be finite";')
    for k in range(USER_SLOTS):
        fields = used.get(k, ())
        for f in ("ptr", "f", "i"):
            if f in fields:
                continue
            test = {"ptr": f"sp.user_ptr{k}", "f": f"sp.user_f{k} != 0.0", "i": f"sp.user_i{k}"}[f]
            why = (
                f"slot {k} holds no parameter of this kernel's {mod.kind}"
                if not fields
                else f"slot {k} is {user_slots(mod)[k][1]}, which does not read it"
            )
            out.append(f'if ({test}) return "user_{f}{k} is set but {why}";')
    out.append("return nullptr;")
    return out


def user_score_cpp(mod: UserMod, indent: str = "  ") -> str:
    """The C++ of `struct UserScore` for `mod` (module doc), indented by `indent`."""
    emit = dict(
        access=VALS_ACCESS,
        float_positions=_FLOAT_POSITIONS,
        int32_bounds=KERNEL_INT_BOUNDS,
        table_int32_access=_TABLE_INT32,
    )
    value = emit_cpp(mod.tree, _NAMES, **emit)
    grad_tree = mod.derivative
    has_grad = not (isinstance(grad_tree, Const) and grad_tree.value == 1.0)
    grad_cpp = emit_cpp(grad_tree, _NAMES, **emit) if has_grad else ""
    loads = "\n".join(slot_loads(mod))
    helpers = cpp_helpers_int32(f"{value}\n{grad_cpp}\n{loads}", member=True)
    lines = [
        f"// score_mod: {mod.canonical}",
        "// (generator/usermod; s = scale * q.k, i and j 0-based in the sequence: docs/usermod.md)",
        "struct UserScore {",
        f"  static constexpr bool kOn = true, kHasGrad = {'true' if has_grad else 'false'};",
        *(
            ["  // int32 helpers (generator/usermod/emit.py: int32 arithmetic)"]
            + [f"  {line}" for line in helpers.splitlines()]
            if helpers
            else []
        ),
        "  struct Vals {",
        *(f"    {line}" for line in slot_vals(mod)),
        "  };",
        "  static __device__ __forceinline__ void load(const fg_score_params& sp, int64_t b,",
        "                                              int64_t h, Vals& v) {",
        *(f"    {line}" for line in slot_loads(mod)),
        "  }",
        "  static __device__ __forceinline__ float value(float s, const Vals& p,",
        "                                                const fg::ScorePos& q) {",
        "    (void)s, (void)p, (void)q;",
        f"    return {value};",
        "  }",
    ]
    if has_grad:
        lines += [
            "  // d(score_mod)/ds",
            "  static __device__ __forceinline__ float grad(float s, const Vals& p,",
            "                                               const fg::ScorePos& q) {",
            "    (void)s, (void)p, (void)q;",
            f"    return static_cast<float>({grad_cpp});",
            "  }",
        ]
    lines += [
        "  // the launch check of the parameter slots (fg_score_params.user_*)",
        "  static const char* check(const fg_score_params& sp) {",
        *(f"    {line}" for line in slot_checks(mod)),
        "  }",
        "};",
    ]
    return "\n".join(indent + line if line else line for line in lines)
