"""The kernel spec: enums (one table of spellings each), `Tile`, `Mask` and `KernelSpec`.

A YAML file becomes frozen `KernelSpec` objects in `generator.load`; they are validated when
constructed (`KernelSpec.__post_init__`), so nothing downstream re-validates or re-parses.

This is the bottom layer: it imports nothing of the project but the feature rows
(`generator.features`, plain data). The axes a spec names are the
kernel kind (`forward`, `backward`, `decode`: one family each, `generator.families`), the
architecture (`Target`, including `sm_90a`) and the features (mask, dropout, sparsity, GQA,
...). `FIELDS` is the one table of fields that everything listing fields derives from.

Notation (see docs/conventions.md): `block_m` query rows per CTA tile, `block_n` key/value
rows per K/V tile, `warps` warps per CTA, `stages` shared-memory pipeline depth.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

# The score-stage features are data (one module each), and user modifiers are parsed by their
# own front end; neither package imports anything of the project, so this module stays the
# bottom layer of everything that is not a feature row or the usermod front end.
from flashgen.generator.features import FEATURE_BY_NAME, FEATURES, USER_SLOTS
from flashgen.generator.usermod import (
    ParamKind,
    UserMod,
    UserModError,
    check_params,
    parse_mask_mod,
    parse_score_mod,
)

__all__ = [
    "Causal",
    "Dtype",
    "ELEMENTS",
    "Element",
    "KernelKind",
    "KvDtype",
    "KernelSpec",
    "Mask",
    "SpecError",
    "Sparsity",
    "Target",
    "TargetInfo",
    "Tile",
    "FIELDS",
    "FIELD_BY_PATH",
    "Field",
    "FieldKind",
    "build_spec",
    "implemented_kinds",
    "register_rules",
    "rules_for",
]


class SpecError(ValueError):
    """A spec is invalid. `str()` reads `file:line: field: message` (parts known so far)."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.field = field
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file + (f":{self.line}" if self.line is not None else "") + ": "
        fld = f"{self.field}: " if self.field else ""
        return f"{where}{fld}{self.message}"

    def located(self, file: str | None, line: int | None, prefix: str = "") -> SpecError:
        """A copy with file/line filled in (kept if already set) and `prefix` added to the field."""
        fld = self.field
        if prefix:
            fld = f"{prefix}.{fld}" if fld else prefix
        return SpecError(
            self.message,
            file=self.file if self.file is not None else file,
            line=self.line if self.line is not None else line,
            field=fld,
        )


# --------------------------------------------------------------------------------------------
# Enums. Each member's value is its row in the enum's one table of spellings.
# --------------------------------------------------------------------------------------------

E = TypeVar("E", bound="_Spelled")


class _Spelled(enum.Enum):
    """Base for enums whose value is a NamedTuple row starting with the YAML spelling."""

    @property
    def yaml(self) -> str:
        return self.value.yaml

    @classmethod
    def allowed(cls) -> list[str]:
        """YAML spellings, in table order."""
        return [m.yaml for m in cls]

    @classmethod
    def from_yaml(cls: type[E], text: str) -> E:
        for m in cls:
            if m.yaml == text:
                return m
        raise SpecError(
            f"{text!r} is not allowed (allowed: {', '.join(cls.allowed())})"
            + _did_you_mean(text, cls.allowed())
        )

    def __str__(self) -> str:
        return self.yaml

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def _did_you_mean(text: Any, choices: list[str]) -> str:
    import difflib

    if not isinstance(text, str):
        return ""
    close = difflib.get_close_matches(text, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class _KindRow(NamedTuple):
    yaml: str
    short: str


class KernelKind(_Spelled):
    """The kernel-kind axis: each kind is one family (`generator.families`)."""

    FORWARD = _KindRow("forward", "fwd")
    BACKWARD = _KindRow("backward", "bwd")
    DECODE = _KindRow("decode", "dec")

    @property
    def short(self) -> str:
        return self.value.short


class Element(NamedTuple):
    """One element type a kernel's operands can have: a row of `ELEMENTS`."""

    ptx: str  # its PTX type, the key of `ELEMENTS` and of the wgmma table (generator.wgmma)
    cpp: str
    nbytes: int
    array_name: str  # numpy.<name> (ml_dtypes for bfloat16) and torch.<name>: the same spelling
    mma_k: int  # the reduction depth of one tensor-core MMA: 32 bytes of it
    rounding: str  # how a float32 becomes one (PTX cvt modifiers): nearest, ties to even
    min_cc: int  # the first compute capability whose MMA (16-bit) or conversions (FP8) it needs


# The one table of element types. e4m3: FP8 (OCP E4M3, torch.float8_e4m3fn, max 448, NaN but
# no inf); PTX converts a float32 to it only saturating (cvt.rn.satfinite), and has its
# conversions from sm_89 (its wgmma is sm_90a's).
ELEMENTS: dict[str, Element] = {
    e.ptx: e
    for e in (
        Element("f16", "__half", 2, "float16", 16, "rn", 80),
        Element("bf16", "__nv_bfloat16", 2, "bfloat16", 16, "rn", 80),
        Element("e4m3", "__nv_fp8_e4m3", 1, "float8_e4m3fn", 32, "rn.satfinite", 89),
    )
}


class _OperandsRow(NamedTuple):
    """A dtype spelling and the element types of the operands it decides."""

    yaml: str
    short: str  # kernel-name part
    k: Element  # of K (and Q: a `Dtype`)
    v: Element
    out: Element | None  # of the output; None: the q dtype's (a `KvDtype`)


def _forwarded(*names: str, **renamed: str) -> Callable[[type], type]:
    """Class decorator: read-only properties forwarding to the class's `element` (its K
    element), `names` under the element's own field names, `renamed` as attr=field."""

    def prop(fieldname: str) -> property:
        return property(lambda self: getattr(self.element, fieldname))

    def deco(cls: type) -> type:
        for attr, fieldname in {**{n: n for n in names}, **renamed}.items():
            setattr(cls, attr, prop(fieldname))
        return cls

    return deco


@_forwarded(
    "cpp", "nbytes", "mma_k", "rounding", "min_cc", numpy_name="array_name", torch_name="array_name"
)
class _OperandsView(_Spelled):
    """Base of the dtype enums: a member is a view of its `_OperandsRow` and of the element
    rows it names; `cpp`, `nbytes`, `mma_k`, `rounding`, `min_cc`, `numpy_name` and
    `torch_name` are its K element's."""

    cpp: str
    nbytes: int
    mma_k: int
    rounding: str
    min_cc: int
    numpy_name: str
    torch_name: str

    @property
    def short(self) -> str:
        return self.value.short

    @property
    def element(self) -> Element:
        return self.value.k

    @property
    def k_element(self) -> Element:
        return self.value.k

    @property
    def v_element(self) -> Element:
        return self.value.v

    @property
    def out_element(self) -> Element | None:
        return self.value.out


def _same(yaml: str, ptx: str) -> _OperandsRow:
    """A dtype whose Q, K, V and output all have one element type."""
    e = ELEMENTS[ptx]
    return _OperandsRow(yaml, yaml, e, e, e)


class Dtype(_OperandsView):
    """The element type of Q, K, V and the output (`dtype`)."""

    FP16 = _same("fp16", "f16")
    BF16 = _same("bf16", "bf16")


class KvDtype(_OperandsView):
    """The element type of a decode kernel's K/V cache when it is not the q dtype
    (`kv_dtype`; absent: K/V have the q dtype). e4m3: FP8 (`ELEMENTS["e4m3"]`), dequantised
    as `k_descale * K` and `v_descale * V` with fp32 descales (docs/decode.md, "FP8 KV
    caches"). Converted to the q dtype on chip with `cvt.rn.f16x2.e4m3x2`, which PTX has from
    sm_89 (`min_cc`)."""

    E4M3 = _OperandsRow("e4m3", "kve4m3", ELEMENTS["e4m3"], ELEMENTS["e4m3"], None)


class _CausalRow(NamedTuple):
    yaml: str
    short: str
    cpp: str


class Causal(_Spelled):
    NONE = _CausalRow("none", "", "fg::Causal::kNone")
    TOP_LEFT = _CausalRow("top_left", "causaltl", "fg::Causal::kTopLeft")
    BOTTOM_RIGHT = _CausalRow("bottom_right", "causalbr", "fg::Causal::kBottomRight")

    @property
    def short(self) -> str:
        return self.value.short

    @property
    def cpp(self) -> str:
        return self.value.cpp


class _SparsityRow(NamedTuple):
    yaml: str
    short: str


class Sparsity(_Spelled):
    NONE = _SparsityRow("none", "")
    BLOCK = _SparsityRow("block", "sparse")

    @property
    def short(self) -> str:
        return self.value.short


class TargetInfo(NamedTuple):
    """Hardware limits of one target (CUDA occupancy tables)."""

    max_smem_per_block: int  # bytes of dynamic shared memory per block (opt-in maximum)
    regs_per_sm: int
    max_regs_per_thread: int
    sm_count: int  # of the reference part (A100, A10/3090, L4/4090 class, H100 SXM)
    max_threads_per_block: int


class _TargetRow(NamedTuple):
    yaml: str
    cc: int
    suffix: str  # "" or "a": the architecture-specific feature set (wgmma, setmaxnreg)
    info: TargetInfo


_SM90_INFO = TargetInfo(232448, 65536, 255, 132, 1024)


class Target(_Spelled):
    """The architecture axis: a compute capability plus an optional feature-set suffix.

    `sm_90a` is the same chip as `sm_90` with Hopper's architecture-specific instructions
    (wgmma, setmaxnreg) enabled; its code runs only on compute capability 9.0.
    """

    SM80 = _TargetRow("sm_80", 80, "", TargetInfo(166912, 65536, 255, 108, 1024))
    SM86 = _TargetRow("sm_86", 86, "", TargetInfo(101376, 65536, 255, 84, 1024))
    SM89 = _TargetRow("sm_89", 89, "", TargetInfo(101376, 65536, 255, 128, 1024))
    SM90 = _TargetRow("sm_90", 90, "", _SM90_INFO)
    SM90A = _TargetRow("sm_90a", 90, "a", _SM90_INFO)

    @property
    def cc(self) -> int:
        return self.value.cc

    @property
    def arch(self) -> str:
        return self.value.yaml

    @property
    def short(self) -> str:
        return f"sm{self.value.cc}{self.value.suffix}"

    @property
    def gencode(self) -> str:
        """nvcc's -gencode value: machine code for the target plus its PTX (so a newer GPU
        can still run the kernel through the driver's JIT)."""
        v = f"{self.value.cc}{self.value.suffix}"
        return f"arch=compute_{v},code=[sm_{v},compute_{v}]"

    @property
    def info(self) -> TargetInfo:
        return self.value.info


# --------------------------------------------------------------------------------------------
# Spec objects.
# --------------------------------------------------------------------------------------------


def _check_int(value: Any, fld: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{value!r} is not an integer", field=fld)


def _check_bool(value: Any, fld: str) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{value!r} is not a boolean (allowed: true, false)", field=fld)


def _check_enum(value: Any, cls: type[_Spelled], fld: str) -> None:
    if not isinstance(value, cls):
        raise SpecError(
            f"{value!r} is not a {cls.__name__} (allowed: {', '.join(cls.allowed())})", field=fld
        )


@dataclass(frozen=True)
class Tile:
    """CTA tile: `block_m` query rows, `block_n` K/V rows, `warps`, `stages` (pipeline depth).

    What each number may be, and what it costs in shared memory, is the family's business
    (`generator.families`): the same four numbers describe a forward, backward or decode CTA.
    """

    block_m: int
    block_n: int
    warps: int
    stages: int

    FIELDS = ("block_m", "block_n", "warps", "stages")

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def short(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"

    def type_problems(self) -> list[tuple[str, str]]:
        """Non-integer tile fields, as (field, message) pairs."""
        for name in self.FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                return [(f"tile.{name}", f"{v!r} is not an integer")]
        return []


@dataclass(frozen=True)
class Mask:
    """Which masks the kernel supports; window sizes and lengths are runtime parameters."""

    causal: Causal = Causal.NONE
    window: bool = False
    varlen: bool = False


# --------------------------------------------------------------------------------------------
# The field table: every list of spec fields (loader, canonical form, name parts, README
# table, `show`) is derived from FIELDS, so a new field is one row here.
# --------------------------------------------------------------------------------------------


class FieldKind(enum.Enum):
    ENUM = "enum"
    BOOL = "bool"
    INT = "int"
    TILE = "tile"
    EXPR = "expr"  # a user modifier's expression (generator.usermod), kept as a `UserMod`
    PARAMS = "params"  # the runtime parameters a user modifier declares: {name: kind}


@dataclass(frozen=True)
class Field:
    """One spec field.

    `path` is the YAML key (`mask.causal` for a sub-field of `mask`). `default` is the value
    when the YAML omits it (None: required). `part` makes the field's kernel-name part from
    its value ("" adds nothing). `feature` is its label in the README table and `show` when
    the field is a boolean feature that is on; `kinds` lists the kernel kinds that accept it
    (None: every kind).
    """

    path: str
    kind: FieldKind
    default: Any = None
    enum: type[_Spelled] | None = None
    part: Callable[[Any], str] | None = None
    feature: str = ""
    kinds: tuple[KernelKind, ...] | None = None
    doc: str = ""
    # a score-stage feature (generator.features): the value is membership in spec.features
    score_feature: bool = False
    # absent by default (`default` None means "not given", not "required"): left out of the
    # canonical form when absent, so the canonical spec and the name of every kernel without
    # the field are what they were before the field existed
    optional: bool = False

    @property
    def top(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def sub(self) -> str:
        return self.path.split(".", 1)[1] if "." in self.path else ""

    def get(self, spec: KernelSpec) -> Any:
        if self.score_feature:
            return self.path in spec.features
        obj: Any = spec
        for part in self.path.split("."):
            obj = getattr(obj, part)
        return obj

    def yaml_value(self, value: Any) -> Any:
        """The value as YAML/JSON spells it (enums by their YAML name, tiles as mappings)."""
        if isinstance(value, _Spelled):
            return value.yaml
        if isinstance(value, Tile):
            return {name: getattr(value, name) for name in Tile.FIELDS}
        if isinstance(value, UserMod):
            return value.canonical
        if self.kind is FieldKind.PARAMS and value is not None:
            return {name: kind.value for name, kind in value.items()}
        return value


def _flag(part: str) -> Callable[[Any], str]:
    return lambda on: part if on else ""


FIELDS: tuple[Field, ...] = (
    Field("kernel", FieldKind.ENUM, KernelKind.FORWARD, KernelKind, lambda k: k.short),
    Field("head_dim", FieldKind.INT, None, part=lambda d: f"d{d}", doc="d"),
    # d_v, the head dim of V and O when it is not d (absent: d_v = d, and the canonical form,
    # name and hash of every kernel without it are what they were before the field existed)
    Field(
        "head_dim_v",
        FieldKind.INT,
        None,
        part=lambda v: f"v{v}" if v is not None else "",
        doc="d_v",
        optional=True,
    ),
    Field("dtype", FieldKind.ENUM, None, Dtype, lambda d: d.short),
    Field("mask.causal", FieldKind.ENUM, Causal.NONE, Causal, lambda c: c.short),
    Field("mask.window", FieldKind.BOOL, False, part=_flag("win"), feature="window"),
    Field("mask.varlen", FieldKind.BOOL, False, part=_flag("varlen"), feature="varlen"),
    Field("gqa", FieldKind.BOOL, False, part=_flag("gqa"), feature="gqa"),
    Field("dropout", FieldKind.BOOL, False, part=_flag("drop"), feature="dropout"),
    Field(
        "debug_keep_mask", FieldKind.BOOL, False, part=_flag("dropdbg"), feature="debug_keep_mask"
    ),
    Field(
        "sparsity",
        FieldKind.ENUM,
        Sparsity.NONE,
        Sparsity,
        lambda s: s.short,
        feature="block sparse",
    ),
    Field(
        "deterministic",
        FieldKind.BOOL,
        False,
        part=_flag("det"),
        feature="deterministic",
        kinds=(KernelKind.BACKWARD,),
    ),
    Field(
        "paged",
        FieldKind.BOOL,
        False,
        part=_flag("paged"),
        feature="paged KV cache",
        kinds=(KernelKind.DECODE,),
    ),
    Field(
        "kv_dtype",
        FieldKind.ENUM,
        None,
        KvDtype,
        lambda k: k.short if k is not None else "",
        kinds=(KernelKind.DECODE,),
        doc="the K/V cache's element type when not the q dtype (e4m3: an FP8 cache)",
        optional=True,
    ),
    *(
        Field(
            f.name,
            FieldKind.BOOL,
            False,
            part=_flag(f.part),
            feature=f.label,
            kinds=None if f.kinds is None else tuple(KernelKind.from_yaml(k) for k in f.kinds),
            doc=f.doc,
            score_feature=True,
        )
        for f in FEATURES
    ),
    Field(
        "score_mod",
        FieldKind.EXPR,
        None,
        part=lambda m: f"um{m.digest()}" if m is not None else "",
        feature="score_mod",
        doc="a user-defined score modifier (docs/usermod.md)",
        optional=True,
    ),
    Field(
        "mask_mod",
        FieldKind.EXPR,
        None,
        part=lambda m: f"mm{m.digest()}" if m is not None else "",
        feature="mask_mod",
        kinds=(KernelKind.FORWARD, KernelKind.BACKWARD),  # not sm_90a's backward: see below
        doc="a user-defined mask (docs/usermod.md)",
        optional=True,
    ),
    Field(
        "params",
        FieldKind.PARAMS,
        None,
        doc="the runtime parameters of score_mod and mask_mod",
        optional=True,
    ),
    Field("instrument_io", FieldKind.BOOL, False, part=_flag("io"), feature="instrument_io"),
    Field("tile", FieldKind.TILE, "auto", part=lambda t: t.short),
    Field("target", FieldKind.ENUM, Target.SM90, Target, lambda t: t.short),
    Field("allow_spills", FieldKind.BOOL, False, feature="allow_spills"),
)
FIELD_BY_PATH = {f.path: f for f in FIELDS}
REQUIRED = tuple(f.path for f in FIELDS if f.default is None and not f.optional)
# Boolean features that are on, by label (README table, `show`): the non-mask flags.
FEATURE_FIELDS = tuple(f for f in FIELDS if f.feature and not f.path.startswith("mask."))


# --------------------------------------------------------------------------------------------
# Families register their rules here (generator.families does it on import). The registry
# lives in this module so that a KernelSpec validates itself at construction while this
# module imports nothing of the project's.
# --------------------------------------------------------------------------------------------


class FamilyRules(Protocol):
    """What `KernelSpec` asks of its family (the full interface: generator.families.Family)."""

    def problems(self, spec: KernelSpec) -> list[tuple[str, str]]: ...
    def smem_bytes(self, spec: KernelSpec) -> int: ...
    def threads(self, spec: KernelSpec) -> int: ...


_FAMILY_RULES: dict[KernelKind, FamilyRules] = {}


def register_rules(kind: KernelKind, rules: FamilyRules) -> None:
    _FAMILY_RULES[kind] = rules


def rules_for(kind: KernelKind) -> FamilyRules | None:
    return _FAMILY_RULES.get(kind)


def implemented_kinds() -> list[KernelKind]:
    return [k for k in KernelKind if k in _FAMILY_RULES]


@dataclass(frozen=True)
class KernelSpec:
    """One validated kernel. Construct through `generator.load` or directly with enums.

    A value object: construction validates (common rules here, family rules through the
    registry) and nothing else; it reads no files. `tile` is always resolved (`tile_auto`
    records whether it was derived); `source` is "file:line" of the YAML entry and takes no
    part in equality, hash or canonical form. The kernel's name (which hashes template files)
    is `generator.naming.kernel_name(spec)`.
    """

    kernel: KernelKind
    dtype: Dtype
    head_dim: int
    tile: Tile
    tile_auto: bool = False
    # the head dim of V and O (d_v); None when it equals head_dim (see `head_dim_vo`)
    head_dim_v: int | None = None
    mask: Mask = Mask()
    dropout: bool = False
    debug_keep_mask: bool = False
    sparsity: Sparsity = Sparsity.NONE
    gqa: bool = False
    deterministic: bool = False
    paged: bool = False
    # the K/V cache's element type, or None: the q dtype (decode only)
    kv_dtype: KvDtype | None = None
    # score-stage features that are on (names of generator.features rows: softcap, alibi,
    # sink); spelled in YAML as top-level booleans
    features: frozenset[str] = frozenset()
    # a user-defined score modifier (generator.usermod; YAML `score_mod` and `params`), or None
    score_mod: UserMod | None = None
    # a user-defined mask (generator.usermod; YAML `mask_mod`, sharing `params`), or None
    mask_mod: UserMod | None = None
    target: Target = Target.SM90
    instrument_io: bool = False
    allow_spills: bool = False
    source: str = field(default="", compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim_v is not None and self.head_dim_v == self.head_dim:
            # `head_dim_v: 128` beside `head_dim: 128` is the kernel without the field
            object.__setattr__(self, "head_dim_v", None)
        for fld, problem in self.problems():
            raise SpecError(problem, field=fld)

    # -- validation ---------------------------------------------------------------------
    def problems(self) -> list[tuple[str, str]]:
        """All constraint violations as (field path, message); empty when valid."""
        if not isinstance(self.tile, Tile):
            raise SpecError(f"{self.tile!r} is not a Tile", field="tile")
        if not isinstance(self.mask, Mask):
            raise SpecError(f"{self.mask!r} is not a Mask", field="mask")
        for f in FIELDS:
            value = f.get(self)
            if f.kind is FieldKind.ENUM:
                if not (f.optional and value is None):
                    _check_enum(value, f.enum, f.path)
            elif f.kind is FieldKind.BOOL:
                _check_bool(value, f.path)
            elif f.kind is FieldKind.INT and not (f.optional and value is None):
                _check_int(value, f.path)
        if self.score_mod is not None and not (
            isinstance(self.score_mod, UserMod) and self.score_mod.kind == "score_mod"
        ):
            raise SpecError(
                f"{self.score_mod!r} is not a score_mod (generator.usermod.parse_score_mod)",
                field="score_mod",
            )
        if self.mask_mod is not None and not (
            isinstance(self.mask_mod, UserMod) and self.mask_mod.kind == "mask_mod"
        ):
            raise SpecError(
                f"{self.mask_mod!r} is not a mask_mod (generator.usermod.parse_mask_mod)",
                field="mask_mod",
            )
        _check_bool(self.tile_auto, "tile_auto")
        if not isinstance(self.features, frozenset) or any(
            n not in FEATURE_BY_NAME for n in self.features
        ):
            raise SpecError(
                f"{self.features!r} is not a frozenset of feature names (allowed: "
                f"{', '.join(FEATURE_BY_NAME)})",
                field="features",
            )

        out: list[tuple[str, str]] = list(self.tile.type_problems())
        rules = rules_for(self.kernel)
        if rules is None:
            allowed = ", ".join(k.yaml for k in implemented_kinds())
            out.append(
                ("kernel", f"{self.kernel.yaml!r} is not implemented yet (allowed: {allowed})")
            )
            return out
        for f in FIELDS:
            if f.kinds is not None and self.kernel not in f.kinds and f.get(self) != f.default:
                allowed = ", ".join(k.yaml for k in f.kinds)
                out.append((f.path, f"applies to kernel: {allowed} only, not {self.kernel.yaml}"))
        if self.debug_keep_mask and not self.dropout:
            out.append(("debug_keep_mask", "true requires dropout: true"))
        for name in sorted(self.features):
            out.extend(FEATURE_BY_NAME[name].problems(self))
        out.extend(_score_mod_problems(self))
        out.extend(_mask_mod_problems(self))
        out.extend(_params_problems(self))
        if not out:
            out.extend(rules.problems(self))
        return out

    # -- derived ------------------------------------------------------------------------
    @property
    def threads(self) -> int:
        return _FAMILY_RULES[self.kernel].threads(self)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel's main CTA, bytes (the family's formula)."""
        return _FAMILY_RULES[self.kernel].smem_bytes(self)

    def has(self, feature: str) -> bool:
        """Whether score-stage feature `feature` (a generator.features name) is on."""
        if feature not in FEATURE_BY_NAME:
            raise KeyError(f"{feature!r} is not a feature (allowed: {', '.join(FEATURE_BY_NAME)})")
        return feature in self.features

    @property
    def params(self) -> dict[str, ParamKind] | None:
        """The runtime parameters the user modifier declares, `{name: kind}` sorted by name
        (their slots of `fg_score_params`, in this order), or None without one."""
        mod = self.score_mod if self.score_mod is not None else self.mask_mod
        return None if mod is None else dict(mod.params)

    @property
    def head_dim_vo(self) -> int:
        """d_v: the head dim of V and O (and dV), `head_dim_v` when given, else `head_dim`;
        `head_dim` is that of Q and K (and dQ, dK)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def head_dim_max(self) -> int:
        """max(d, d_v): the head dim the `tile: auto` rules size a kernel for."""
        return max(self.head_dim, self.head_dim_vo)

    @property
    def kv_nbytes(self) -> int:
        """Bytes per K/V cache element: the q dtype's, or kv_dtype's."""
        return self.dtype.nbytes if self.kv_dtype is None else self.kv_dtype.nbytes

    @property
    def sparse(self) -> bool:
        return self.sparsity is Sparsity.BLOCK

    @property
    def plain(self) -> bool:
        """Nothing beyond the causal mask: no window, varlen, GQA, dropout, block sparsity,
        score-stage feature or IO counting (the kernels benchmarks compare with SDPA, and
        dense twins)."""
        return not (
            self.mask.window
            or self.mask.varlen
            or self.gqa
            or self.dropout
            or self.sparse
            or self.instrument_io
            or self.features
            or self.score_mod is not None
            or self.mask_mod is not None
            or self.kv_dtype is not None
        )

    @property
    def source_file(self) -> str:
        """The spec file part of `source` ("" when unknown)."""
        return self.source.rsplit(":", 1)[0] if ":" in self.source else self.source

    def to_canonical(self) -> dict[str, Any]:
        """Plain dict in FIELDS order, YAML spellings, resolved tile and `tile_auto`."""
        out: dict[str, Any] = {}
        for f in FIELDS:
            if f.optional and f.get(self) is None:
                continue  # absent: the canonical form it had before the field existed
            value = f.yaml_value(f.get(self))
            if f.sub:
                out.setdefault(f.top, {})[f.sub] = value
            else:
                out[f.path] = value
            if f.path == "tile":
                out["tile_auto"] = self.tile_auto
        return out

    @classmethod
    def from_canonical(cls, data: dict[str, Any], source: str = "") -> KernelSpec:
        """Inverse of `to_canonical` (e.g. the `spec` of a manifest entry). Fields the data
        lacks take their defaults (a manifest written before the field existed)."""
        values: dict[str, Any] = {}
        for f in FIELDS:
            container = data.get(f.top, {}) if f.sub else data
            if not isinstance(container, dict) or (f.sub or f.path) not in container:
                if (f.default is None and not f.optional) or f.kind is FieldKind.TILE:
                    raise SpecError(f"canonical spec lacks key {f.path!r}")
                values[f.path] = f.default
                continue
            raw = container[f.sub or f.path]
            if f.kind is FieldKind.ENUM:
                raw = f.enum.from_yaml(raw)
            elif f.kind is FieldKind.TILE:
                if not isinstance(raw, dict) or any(n not in raw for n in Tile.FIELDS):
                    raise SpecError(
                        f"canonical tile must be a mapping of {', '.join(Tile.FIELDS)}, "
                        f"got {raw!r}",
                        field="tile",
                    )
                raw = Tile(*(raw[name] for name in Tile.FIELDS))
            values[f.path] = raw
        return build_spec(values, tile_auto=bool(data.get("tile_auto", False)), source=source)

    def replace(self, **changes: Any) -> KernelSpec:
        """A validated copy with some fields changed (`dataclasses.replace`); a feature name
        (`softcap=True`) switches that score-stage feature."""
        feats = set(self.features)
        for name in [n for n in changes if n in FEATURE_BY_NAME]:
            on = changes.pop(name)
            _check_bool(on, name)
            (feats.add if on else feats.discard)(name)
        if feats != set(self.features):
            changes.setdefault("features", frozenset(feats))
        return dataclasses.replace(self, **changes)


# The built-in modifiers a score_mod cannot be combined with: each transforms the score with
# units and a derivative of its own, and a user modifier already says everything about the
# logit (write them in the expression: docs/usermod.md has both). The sink only adds to the
# softmax's denominator, so it composes.
_NOT_WITH_SCORE_MOD = ("softcap", "alibi")
# Parameter kinds a score_mod does not read: per-token vectors are read by a mask_mod only
# (their token offsets, varlen's packed positions included, come with the mask stage,
# templates/include/flashgen/mask_mod.cuh).
_KINDS_NOT_SERVED = (ParamKind.PER_TOKEN_Q, ParamKind.PER_TOKEN_K, ParamKind.PER_TOKEN)


def _score_mod_problems(spec: KernelSpec) -> list[tuple[str, str]]:
    """What the kernels do not serve of a spec's score_mod, as (field, message) pairs."""
    mod = spec.score_mod
    if mod is None:
        return []
    out = []
    for name in _NOT_WITH_SCORE_MOD:
        if name in spec.features:
            out.append(
                (
                    name,
                    f"{name}: true cannot be combined with score_mod: the score_mod gives the "
                    f"whole logit, so write {name} inside it (docs/usermod.md, Examples: "
                    + ("`cap * tanh(s / cap)`" if name == "softcap" else "`s - slopes[h] * ...`")
                    + ")",
                )
            )
    if spec.instrument_io:
        out.append(
            (
                "instrument_io",
                "true cannot be combined with score_mod: the IO models do not count a "
                "score_mod's parameter reads (a table is read per score)",
            )
        )
    for name, kind in mod.used_params:
        if kind in _KINDS_NOT_SERVED:
            served = ", ".join(k.value for k in ParamKind if k not in _KINDS_NOT_SERVED)
            out.append(
                (
                    f"params.{name}",
                    f"kind {kind.value} is read by a mask_mod only (a per-token vector); kinds "
                    f"a score_mod reads: {served}",
                )
            )
    return out


# What a mask_mod is built for: the mma.sync forward and backward and the sm_90a forward
# (mask_mod.cuh); every other kernel kind, and the features below, are refused.
MASK_MOD_KINDS = ("forward (any target)", "backward (mma.sync targets, not sm_90a)")
_NOT_WITH_MASK_MOD = {
    "sparsity": "block sparsity has its own tile lists (the mask stage classifies tiles itself)",
    "deterministic": "the deterministic dQ order walks every dense step (first_visitor)",
    "instrument_io": "the IO models do not count the mask stage's skipped tiles or reads",
    "debug_keep_mask": "the keep-mask is written per visited tile, and EMPTY tiles are skipped",
}


def _mask_mod_problems(spec: KernelSpec) -> list[tuple[str, str]]:
    """What the kernels do not serve of a spec's mask_mod, as (field, message) pairs."""
    if spec.mask_mod is None:
        return []
    out = []
    # (decode is refused by the field's kinds)
    if spec.kernel is KernelKind.BACKWARD and spec.target.value.suffix == "a":
        what = "backward, target: sm_90a"
        out.append(
            (
                "mask_mod",
                f"is not built for kernel: {what} (allowed: "
                f"{', '.join(MASK_MOD_KINDS)}; docs/usermod.md, mask_mod in a spec)",
            )
        )
    for name, why in _NOT_WITH_MASK_MOD.items():
        value = FIELD_BY_PATH[name].get(spec)
        if value != FIELD_BY_PATH[name].default:
            out.append(
                (
                    name,
                    f"{FIELD_BY_PATH[name].yaml_value(value)} cannot be combined "
                    f"with mask_mod: {why}",
                )
            )
    return out


def _params_problems(spec: KernelSpec) -> list[tuple[str, str]]:
    """The declared `params`, shared by score_mod and mask_mod: at most USER_SLOTS, and each
    read by one of them."""
    mods = [m for m in (spec.score_mod, spec.mask_mod) if m is not None]
    if not mods:
        return []
    out = []
    declared = dict(mods[0].params)
    if len(declared) > USER_SLOTS:
        out.append(
            (
                "params",
                f"{len(declared)} parameters declared; a kernel has {USER_SLOTS} parameter "
                f"slots (fg_score_params.user_*)",
            )
        )
    used = {n for m in mods for n, _ in m.used_params}
    unused = sorted(set(declared) - used)
    if unused:
        readers = " or ".join(m.kind for m in mods)
        out.append(
            (
                f"params.{unused[0]}",
                f"declared but not read by {readers}: remove it, or use it in the expression "
                "(every declared parameter is a launch argument)",
            )
        )
    return out


def parse_user_mod(text: Any, params: Any, kind: str = "score_mod") -> UserMod | None:
    """The `UserMod` of a spec's `score_mod` (or, with kind="mask_mod", `mask_mod`) text and
    `params` mapping (None when the text is not given); SpecError names the field (`score_mod`,
    `mask_mod`, `params` or `params.<name>`) and, for the expression, the column (1-based,
    from the start of the text)."""
    if text is None:
        if params is not None and kind == "score_mod":
            raise SpecError(
                "declares the runtime parameters of a score_mod or mask_mod: give score_mod or "
                "mask_mod too",
                field="params",
            )
        return None
    if isinstance(text, UserMod):
        return text
    if not isinstance(text, str):
        example = "s - slopes[h] * abs(i - j)" if kind == "score_mod" else "j <= i"
        raise SpecError(
            f'{text!r} is not an expression (a string, e.g. "{example}")',
            field=kind,
        )
    if params is not None and not isinstance(params, dict):
        raise SpecError(
            f"expected a mapping of parameter names to kinds, e.g. {{slopes: per_head}}, "
            f"got {params!r}",
            field="params",
        )
    decl = {k: (v.value if isinstance(v, ParamKind) else v) for k, v in (params or {}).items()}
    for name, pkind in decl.items():
        if not isinstance(pkind, str):
            kinds = ", ".join(k.value for k in ParamKind)
            raise SpecError(
                f"{pkind!r} is not a parameter kind (allowed: {kinds})", field=f"params.{name}"
            )
    try:
        check_params(decl)
    except UserModError as e:
        bad = next((n for n in decl if f"{n!r}" in e.message), None)
        raise SpecError(e.message, field=f"params.{bad}" if bad else "params") from None
    try:
        if kind == "mask_mod":
            return parse_mask_mod(text, decl)
        return parse_score_mod(text, decl)
    except UserModError as e:
        raise SpecError(str(e), field=kind) from None


def build_spec(values: dict[str, Any], *, tile_auto: bool = False, source: str = "") -> KernelSpec:
    """A KernelSpec from parsed values keyed by field path (`mask.causal`, ...); `score_mod`
    (text or a `UserMod`) and `params` ({name: kind}) become one `UserMod`."""
    user = {"score_mod", "mask_mod", "params"}
    top = {
        f.path: values[f.path]
        for f in FIELDS
        if not f.sub and not f.score_feature and f.path not in user
    }
    params = values.get("params")
    given = values.get("score_mod") is not None or values.get("mask_mod") is not None
    if not given:
        parse_user_mod(None, params)  # params without an expression is refused
    top["score_mod"] = (
        None if values.get("score_mod") is None else parse_user_mod(values["score_mod"], params)
    )
    top["mask_mod"] = parse_user_mod(values.get("mask_mod"), params, kind="mask_mod")
    top["kv_dtype"] = values.get("kv_dtype")
    mask = Mask(**{f.sub: values[f.path] for f in FIELDS if f.top == "mask"})
    feats = [f for f in FIELDS if f.score_feature]
    for f in feats:
        _check_bool(values.get(f.path, False), f.path)
    features = frozenset(f.path for f in feats if values.get(f.path, False))
    return KernelSpec(**top, mask=mask, features=features, tile_auto=tile_auto, source=source)
