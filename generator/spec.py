"""The kernel spec: enums (one table of spellings each), `Tile`, `Mask` and `KernelSpec`.

A YAML file becomes frozen `KernelSpec` objects in `generator.load`; they are validated when
constructed (`KernelSpec.__post_init__`), so nothing downstream re-validates or re-parses.

Notation (see docs/conventions.md): `block_m` query rows per CTA tile, `block_n` key/value
rows per K/V tile, `warps` warps per CTA (each warp owns `16 * mt` query rows, `mt` in {1, 2}),
`stages` K/V shared-memory pipeline depth.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "Causal",
    "Dtype",
    "KernelKind",
    "KernelSpec",
    "Mask",
    "SMEM_ROW_PAD",
    "SpecError",
    "Sparsity",
    "Target",
    "TargetInfo",
    "Tile",
    "HEAD_DIMS",
    "TILE_WARPS",
    "TILE_STAGES",
    "IMPLEMENTED_KINDS",
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
    FORWARD = _KindRow("forward", "fwd")
    BACKWARD = _KindRow("backward", "bwd")

    @property
    def short(self) -> str:
        return self.value.short


IMPLEMENTED_KINDS = (KernelKind.FORWARD,)


class _DtypeRow(NamedTuple):
    yaml: str
    cpp: str
    nbytes: int
    numpy_name: str


class Dtype(_Spelled):
    FP16 = _DtypeRow("fp16", "__half", 2, "float16")
    BF16 = _DtypeRow("bf16", "__nv_bfloat16", 2, "bfloat16")

    @property
    def short(self) -> str:
        return self.value.yaml

    @property
    def cpp(self) -> str:
        return self.value.cpp

    @property
    def nbytes(self) -> int:
        return self.value.nbytes

    @property
    def numpy_name(self) -> str:
        return self.value.numpy_name


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
    info: TargetInfo


class Target(_Spelled):
    SM80 = _TargetRow("sm_80", 80, TargetInfo(166912, 65536, 255, 108, 1024))
    SM86 = _TargetRow("sm_86", 86, TargetInfo(101376, 65536, 255, 84, 1024))
    SM89 = _TargetRow("sm_89", 89, TargetInfo(101376, 65536, 255, 128, 1024))
    SM90 = _TargetRow("sm_90", 90, TargetInfo(232448, 65536, 255, 132, 1024))

    @property
    def cc(self) -> int:
        return self.value.cc

    @property
    def arch(self) -> str:
        return self.value.yaml

    @property
    def short(self) -> str:
        return f"sm{self.value.cc}"

    @property
    def info(self) -> TargetInfo:
        return self.value.info


# --------------------------------------------------------------------------------------------
# Spec objects.
# --------------------------------------------------------------------------------------------

HEAD_DIMS = tuple(range(16, 257, 16))
TILE_WARPS = (1, 2, 4, 8)
TILE_STAGES = (1, 2, 3)
TILE_MT = (1, 2)  # 16-row MMA tiles per warp along the query dimension
SMEM_ROW_PAD = 8  # the kernel pads each shared-memory row by 8 elements (bank conflicts)


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
    """CTA tile: `block_m` query rows, `block_n` K/V rows per step, `warps`, `stages`."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def short(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}"

    def smem_bytes(self, head_dim: int, dtype: Dtype) -> int:
        """Dynamic shared memory in bytes: Q tile plus `stages` K and V tiles, padded rows."""
        rows = self.block_m + 2 * self.stages * self.block_n
        return rows * (head_dim + SMEM_ROW_PAD) * dtype.nbytes

    def problems(self) -> list[tuple[str, str]]:
        """Shape constraints independent of head_dim/target, as (field, message) pairs."""
        out: list[tuple[str, str]] = []
        for name in ("block_m", "block_n", "warps", "stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                return [(f"tile.{name}", f"{v!r} is not an integer")]
        if self.warps not in TILE_WARPS:
            out.append(("tile.warps", f"{self.warps} is not allowed (allowed: 1, 2, 4, 8)"))
        if self.block_m <= 0 or self.block_m % 16:
            out.append(("tile.block_m", f"{self.block_m} is not a positive multiple of 16"))
        elif self.warps in TILE_WARPS and self.block_m not in [
            16 * self.warps * mt for mt in TILE_MT
        ]:
            allowed = ", ".join(str(16 * self.warps * mt) for mt in TILE_MT)
            out.append(
                (
                    "tile.block_m",
                    f"{self.block_m} does not fit {self.warps} warps: each warp owns 16 or 32 "
                    f"query rows, so block_m must be 16 * warps * (1 or 2) "
                    f"(allowed with warps={self.warps}: {allowed})",
                )
            )
        if not (16 <= self.block_n <= 256 and self.block_n % 16 == 0):
            out.append(
                (
                    "tile.block_n",
                    f"{self.block_n} is not allowed (allowed: multiples of 16 in 16..256)",
                )
            )
        if self.stages not in TILE_STAGES:
            out.append(("tile.stages", f"{self.stages} is not allowed (allowed: 1, 2, 3)"))
        return out


@dataclass(frozen=True)
class Mask:
    """Which masks the kernel supports; window sizes and lengths are runtime parameters."""

    causal: Causal = Causal.NONE
    window: bool = False
    varlen: bool = False


@dataclass(frozen=True)
class KernelSpec:
    """One validated kernel. Construct through `generator.load` or directly with enums.

    `tile` is always resolved (`tile_auto` records whether it was derived); `source` is
    "file:line" of the YAML entry and takes no part in equality, hash or canonical form.
    """

    kernel: KernelKind
    dtype: Dtype
    head_dim: int
    tile: Tile
    tile_auto: bool = False
    mask: Mask = Mask()
    dropout: bool = False
    debug_keep_mask: bool = False
    sparsity: Sparsity = Sparsity.NONE
    gqa: bool = False
    target: Target = Target.SM90
    instrument_io: bool = False
    allow_spills: bool = False
    source: str = field(default="", compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for fld, problem in self.problems():
            raise SpecError(problem, field=fld)

    # -- validation ---------------------------------------------------------------------
    def problems(self) -> list[tuple[str, str]]:
        """All constraint violations as (field path, message); empty when valid."""
        _check_enum(self.kernel, KernelKind, "kernel")
        _check_enum(self.dtype, Dtype, "dtype")
        _check_int(self.head_dim, "head_dim")
        if not isinstance(self.tile, Tile):
            raise SpecError(f"{self.tile!r} is not a Tile", field="tile")
        if not isinstance(self.mask, Mask):
            raise SpecError(f"{self.mask!r} is not a Mask", field="mask")
        _check_enum(self.mask.causal, Causal, "mask.causal")
        _check_bool(self.mask.window, "mask.window")
        _check_bool(self.mask.varlen, "mask.varlen")
        _check_enum(self.sparsity, Sparsity, "sparsity")
        _check_enum(self.target, Target, "target")
        for name in (
            "tile_auto",
            "dropout",
            "debug_keep_mask",
            "gqa",
            "instrument_io",
            "allow_spills",
        ):
            _check_bool(getattr(self, name), name)

        out: list[tuple[str, str]] = []
        if self.kernel not in IMPLEMENTED_KINDS:
            allowed = ", ".join(k.yaml for k in IMPLEMENTED_KINDS)
            out.append(
                ("kernel", f"{self.kernel.yaml!r} is not implemented yet (allowed: {allowed})")
            )
        if self.head_dim not in HEAD_DIMS:
            out.append(
                (
                    "head_dim",
                    f"{self.head_dim} is not allowed (allowed: multiples of 16 in 16..256)",
                )
            )
        if self.debug_keep_mask and not self.dropout:
            out.append(("debug_keep_mask", "true requires dropout: true"))
        tile_problems = self.tile.problems()
        out.extend(tile_problems)
        if not tile_problems and self.head_dim in HEAD_DIMS:
            info = self.target.info
            if self.threads > info.max_threads_per_block:
                out.append(
                    (
                        "tile.warps",
                        f"{self.threads} threads exceed the {self.target.yaml} "
                        f"limit of {info.max_threads_per_block}",
                    )
                )
            if self.smem_bytes > info.max_smem_per_block:
                out.append(
                    (
                        "tile",
                        f"{self.tile.short} needs {self.smem_bytes} bytes of shared memory "
                        f"((block_m + 2*stages*block_n) * (head_dim + {SMEM_ROW_PAD}) * "
                        f"{self.dtype.nbytes}) but {self.target.yaml} allows "
                        f"{info.max_smem_per_block} per block",
                    )
                )
        return out

    # -- derived ------------------------------------------------------------------------
    @property
    def threads(self) -> int:
        return self.tile.threads

    @property
    def smem_bytes(self) -> int:
        return self.tile.smem_bytes(self.head_dim, self.dtype)

    @property
    def sparse(self) -> bool:
        return self.sparsity is Sparsity.BLOCK

    @property
    def source_file(self) -> str:
        """The spec file part of `source` ("" when unknown)."""
        return self.source.rsplit(":", 1)[0] if ":" in self.source else self.source

    @property
    def name(self) -> str:
        """Kernel name (identity): readable parts + hash, templates from the default dir."""
        from generator.naming import kernel_name

        return kernel_name(self)

    @property
    def hash(self) -> str:
        """8 hex digits of sha256(canonical spec, template bytes, generator version)."""
        from generator.naming import spec_hash

        return spec_hash(self)

    def to_canonical(self) -> dict[str, Any]:
        """Plain dict in a fixed key order, YAML spellings, resolved tile and `tile_auto`."""
        return {
            "kernel": self.kernel.yaml,
            "dtype": self.dtype.yaml,
            "head_dim": self.head_dim,
            "tile": {
                "block_m": self.tile.block_m,
                "block_n": self.tile.block_n,
                "warps": self.tile.warps,
                "stages": self.tile.stages,
            },
            "tile_auto": self.tile_auto,
            "mask": {
                "causal": self.mask.causal.yaml,
                "window": self.mask.window,
                "varlen": self.mask.varlen,
            },
            "dropout": self.dropout,
            "debug_keep_mask": self.debug_keep_mask,
            "sparsity": self.sparsity.yaml,
            "gqa": self.gqa,
            "target": self.target.yaml,
            "instrument_io": self.instrument_io,
            "allow_spills": self.allow_spills,
        }

    @classmethod
    def from_canonical(cls, data: dict[str, Any], source: str = "") -> KernelSpec:
        """Inverse of `to_canonical` (e.g. the `spec` of a manifest entry)."""
        try:
            t = data["tile"]
            m = data["mask"]
            return cls(
                kernel=KernelKind.from_yaml(data["kernel"]),
                dtype=Dtype.from_yaml(data["dtype"]),
                head_dim=data["head_dim"],
                tile=Tile(t["block_m"], t["block_n"], t["warps"], t["stages"]),
                tile_auto=data["tile_auto"],
                mask=Mask(Causal.from_yaml(m["causal"]), m["window"], m["varlen"]),
                dropout=data["dropout"],
                debug_keep_mask=data["debug_keep_mask"],
                sparsity=Sparsity.from_yaml(data["sparsity"]),
                gqa=data["gqa"],
                target=Target.from_yaml(data["target"]),
                instrument_io=data["instrument_io"],
                allow_spills=data["allow_spills"],
                source=source,
            )
        except KeyError as e:
            raise SpecError(f"canonical spec lacks key {e.args[0]!r}") from None

    def replace(self, **changes: Any) -> KernelSpec:
        """A validated copy with some fields changed (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)
