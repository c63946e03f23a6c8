"""Kernel families: one module per kernel kind, siblings that share the spec, the loader,
naming, rendering and the launch path.

A family owns, in one place: its fields' validation and shared-memory formula, its `tile:
auto` rule, its templates folder (`templates/<family.templates>/`), its render context and
name parts, its C parameter table (the one list the C struct and the Python packing agree
on) and its IO model. Adding a family is one module here, one templates folder, specs and
tests, plus one line in `_MODULES` below (docs/design.md, "How to add a kernel family").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

from flashgen.generator.features import FEATURES, SCORE_PARAMS
from flashgen.generator.features.user import user_score_cpp
from flashgen.generator.features.user_mask import user_mask_cpp
from flashgen.generator.spec import (
    Dtype,
    KernelKind,
    KernelSpec,
    SpecError,
    Target,
    Tile,
    register_rules,
)
from flashgen.generator.tiles import mma_head_dim

__all__ = [
    "Family",
    "ParamField",
    "SCORE_PARAM_FIELDS",
    "SHAPE_PARAM_FIELDS",
    "family",
    "families",
]


@dataclass(frozen=True)
class ParamField:
    """One field of a family's C parameter struct. Every field is 8 bytes wide (`ptr`,
    `i64`, `u64` or `f64`), so the struct has no padding and one layout in C and Python."""

    name: str
    ctype: str  # "ptr" | "i64" | "u64" | "f64"

    C_TYPES: ClassVar[dict[str, tuple[str, ...]]] = {
        "ptr": ("void*", "float*", "int32_t*", "uint8_t*", "uint64_t*", "unsigned long long*"),
        "i64": ("int64_t",),
        "u64": ("uint64_t",),
        "f64": ("double",),
    }


def params_table(text: str) -> tuple[ParamField, ...]:
    """A table written as lines of `ctype name` (comments after `#`)."""
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ctype, name = line.split()
            assert ctype in ParamField.C_TYPES, ctype
            out.append(ParamField(name, ctype))
    return tuple(out)


# The score-stage features' runtime fields (`fg_score_params`, score_params.h): every family's
# C parameter struct ends with `fg_score_params score;`, so every PARAMS table ends with these.
SCORE_PARAM_FIELDS: tuple[ParamField, ...] = tuple(
    ParamField(r.name, r.ctype) for r in SCORE_PARAMS
)
# ... and then with the caller's head dims, which `<name>_check` compares with the kernel's
# (fields a family added later follow them: the structs only grow at their end).
SHAPE_PARAM_FIELDS: tuple[ParamField, ...] = (
    ParamField("head_dim", "i64"),
    ParamField("head_dim_v", "i64"),
)


class Family:
    """The rules of one kernel kind. Subclasses set the class attributes and override the
    methods marked as such; the defaults below are what every family shares."""

    kind: ClassVar[KernelKind]
    templates: ClassVar[str]  # folder under templates/
    # (template file in that folder, output suffix): the generated files of one kernel
    outputs: ClassVar[tuple[tuple[str, str], ...]] = (
        ("kernel.cu.j2", ".cu"),
        ("kernel.h.j2", ".h"),
    )
    params_struct: ClassVar[str]  # the C struct the launcher takes
    params_header: ClassVar[str]  # where it is declared, under include/flashgen/
    params: ClassVar[tuple[ParamField, ...]]
    io_keys: ClassVar[tuple[str, ...]]  # the instrument_io counters, in kernel order
    io_model: ClassVar[str]  # "module:function" giving predicted bytes (flashgen show)
    io_header: ClassVar[str] = "tile_io.cuh"  # where the C counter enum lives
    io_enum: ClassVar[str] = "IoTensor"  # the C enum of the counters in that header

    # -- validation (override) ---------------------------------------------------------------
    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        raise NotImplementedError

    def smem_bytes(self, spec: KernelSpec) -> int:
        raise NotImplementedError

    def threads(self, spec: KernelSpec) -> int:
        return spec.tile.threads

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        """The tile `tile: auto` resolves to; `values` are the entry's other parsed fields."""
        raise NotImplementedError

    def head_dim_ok(self, head_dim: Any) -> bool:
        raise NotImplementedError

    def head_dims_ok(self, values: dict) -> bool:
        """Whether the parsed fields' head dims (`head_dim`, and `head_dim_v` when given) are
        ones this family's `head_dim_ok` accepts."""
        d_v = values.get("head_dim_v")
        return self.head_dim_ok(values["head_dim"]) and (d_v is None or self.head_dim_ok(d_v))

    def auto_tile_of(self, values: dict) -> Tile:
        """`auto_tile` for parsed fields keyed by path: the tile rules size a kernel for
        max(d, d_v) (`KernelSpec.head_dim_max`); `values` tell them both dims."""
        d, d_v = values["head_dim"], values.get("head_dim_v")
        d_max = d if d_v is None else max(d, d_v)
        return self.auto_tile(values["target"], values["dtype"], d_max, values)

    # Whether the family's kernels take a V/O head dim d_v other than the Q/K one (override):
    # those that do accept every d_v their `head_dim_ok` accepts.
    serves_head_dim_v: ClassVar[bool] = False
    head_dim_v_refusal: ClassVar[str] = "head_dim_v = head_dim only"

    def head_dim_v_problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        """Refusals of the spec's `head_dim_v` (d_v), with what is allowed."""
        d_v = spec.head_dim_v
        if d_v is None:
            return []
        if not self.serves_head_dim_v:
            return [
                (
                    "head_dim_v",
                    f"{d_v} with head_dim {spec.head_dim} is not served by the "
                    f"{self.templates} family on {spec.target.yaml} (allowed: "
                    f"{self.head_dim_v_refusal})",
                )
            ]
        if not self.head_dim_ok(d_v):
            return [("head_dim_v", f"{d_v} is not allowed (allowed: multiples of 8 in 8..256)")]
        return []

    def chip_head_dim(self, head_dim: int) -> int:
        """The head dim the kernel holds on chip (its shared-memory tiles and fragments):
        `head_dim` rounded up to its MMA's k granularity, zero-filled past `head_dim` and never
        padded in HBM. The templates see it as `kHeadDimPad`; mma.sync: a multiple of 16."""
        return mma_head_dim(head_dim)

    # -- code generation (override `config`) -------------------------------------------------
    def config(self, spec: KernelSpec) -> dict[str, Any]:
        """The derived constants the templates see as `cfg`."""
        raise NotImplementedError

    def spec_config(self, spec: KernelSpec) -> dict[str, Any]:
        """The constants every family's `cfg` starts from: the spec's types, tile and feature
        flags as `templates/common/spec_struct.j2` names them (a family overrides a flag it
        does not take, e.g. decode's varlen)."""
        t = spec.tile
        return {
            "dtype_cpp": spec.dtype.cpp,
            "head_dim": spec.head_dim,
            "head_dim_pad": self.chip_head_dim(spec.head_dim),
            # d_v: the head dim of V and O (= head_dim without `head_dim_v`)
            "head_dim_v": spec.head_dim_vo,
            "head_dim_v_pad": self.chip_head_dim(spec.head_dim_vo),
            "block_m": t.block_m,
            "block_n": t.block_n,
            "warps": t.warps,
            "threads": spec.threads,
            "stages": t.stages,
            "smem_bytes": spec.smem_bytes,
            "causal_cpp": spec.mask.causal.cpp,
            "window": spec.mask.window,
            "varlen": spec.mask.varlen,
            "gqa": spec.gqa,
            "dropout": spec.dropout,
            "debug_keep_mask": spec.debug_keep_mask,
            "sparse": spec.sparse,
            "instrument_io": spec.instrument_io,
            "sm": spec.target.cc,
            # the score stage's functors (generator.features): C constant -> on
            "score_features": {f.cpp: spec.has(f.name) for f in FEATURES},
            # the spec's score_mod as the C++ of Spec::UserScore (generator/features/user.py),
            # or "" without one
            "user_score": user_score_cpp(spec.score_mod) if spec.score_mod is not None else "",
            # the spec's mask_mod as the C++ of Spec::UserMask (generator/features/user_mask.py),
            # or "" without one
            "user_mask": user_mask_cpp(spec.mask_mod) if spec.mask_mod is not None else "",
        }

    def entry_points(self, name: str) -> dict[str, str]:
        """Exported C symbols of one kernel."""
        return {
            "kernel": f"{name}_kernel",
            "check": f"{name}_check",
            "launch": f"{name}_launch",
        }

    def launch_info(self, spec: KernelSpec) -> dict[str, Any]:
        """What the manifest says about launching the kernel."""
        return {"threads": spec.threads}

    # -- shared helpers ----------------------------------------------------------------------
    @staticmethod
    def smem_problem(spec: KernelSpec, formula: str) -> list[tuple[str, str]]:
        info = spec.target.info
        out = []
        if spec.threads > info.max_threads_per_block:
            out.append(
                (
                    "tile.warps",
                    f"{spec.threads} threads exceed the {spec.target.yaml} "
                    f"limit of {info.max_threads_per_block}",
                )
            )
        if spec.smem_bytes > info.max_smem_per_block:
            out.append(
                (
                    "tile",
                    f"{spec.tile.short} needs {spec.smem_bytes} bytes of shared memory "
                    f"({formula}) but {spec.target.yaml} allows "
                    f"{info.max_smem_per_block} per block",
                )
            )
        return out


_MODULES = {
    KernelKind.FORWARD: "flashgen.generator.families.forward",
    KernelKind.BACKWARD: "flashgen.generator.families.backward",
    KernelKind.DECODE: "flashgen.generator.families.decode",
}
# Families that serve a kind on one architecture-specific target instead of the kind's
# portable family: the same kernel kind and C ABI, another mainloop.
_TARGET_MODULES = {
    (KernelKind.FORWARD, Target.SM90A): "flashgen.generator.families.forward_sm90",
    (KernelKind.BACKWARD, Target.SM90A): "flashgen.generator.families.backward_sm90",
}
_FAMILIES: dict[KernelKind, Family] = {}
_TARGET_FAMILIES: dict[tuple[KernelKind, Target], Family] = {}


class _ByTarget:
    """The rules a spec sees for its kind: those of the family serving its target."""

    def __init__(self, kind: KernelKind) -> None:
        self.kind = kind

    def _of(self, target: Target) -> Family:
        return family(self.kind, target)

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]:
        fam = self._of(spec.target)
        return fam.head_dim_v_problems(spec) or fam.problems(spec)

    def smem_bytes(self, spec: KernelSpec) -> int:
        return self._of(spec.target).smem_bytes(spec)

    def threads(self, spec: KernelSpec) -> int:
        return self._of(spec.target).threads(spec)

    def auto_tile(self, target: Target, dtype: Dtype, head_dim: int, values: dict) -> Tile:
        return self._of(target).auto_tile(target, dtype, head_dim, values)

    def head_dim_ok(self, head_dim: Any) -> bool:
        return family(self.kind).head_dim_ok(head_dim)


def _load() -> None:
    for kind, module in _MODULES.items():
        fam = importlib.import_module(module).FAMILY
        assert fam.kind is kind, (module, fam.kind)
        _FAMILIES[kind] = fam
    for (kind, target), module in _TARGET_MODULES.items():
        fam = importlib.import_module(module).FAMILY
        assert fam.kind is kind, (module, fam.kind)
        _TARGET_FAMILIES[(kind, target)] = fam
    for kind in _FAMILIES:
        register_rules(kind, _ByTarget(kind))


def family(kind: KernelKind | KernelSpec, target: Target | None = None) -> Family:
    """The family of a kernel kind on a target (default: the kind's portable family), or of a
    spec (its kind and target)."""
    if isinstance(kind, KernelSpec):
        kind, target = kind.kernel, kind.target if target is None else target
    k = kind
    try:
        base = _FAMILIES[k]
    except KeyError:
        allowed = ", ".join(x.yaml for x in _FAMILIES)
        raise SpecError(f"{k.yaml!r} is not implemented yet (allowed: {allowed})") from None
    return _TARGET_FAMILIES.get((k, target), base) if target is not None else base


def families() -> list[Family]:
    """Every family: each kind's portable one, then the target-specific ones."""
    return list(_FAMILIES.values()) + list(_TARGET_FAMILIES.values())


_load()
