"""The wgmma instructions as data: one table of rows, rendered into the Hopper headers.

A row is (M, N, K, A element, B element, accumulator, operand source): `ss` reads A and B
from shared memory through descriptors, `rs` reads A from registers (the m64kK fragment of
four 32-bit registers per thread, `sm90.cuh`'s glossary) and B through a descriptor. Element
types are `spec.ELEMENTS` keys (their PTX spelling); K must be the element's `mma_k` (32 bytes
of a row), M is 64 and the accumulator f32 (M * N / 128 registers per thread). The 16-bit
instructions take transpose immediates (`imm-trans-a`, shared-memory A only, and
`imm-trans-b`); FP8 has none, its operands are K-major only (PTX ISA, wgmma.mma_async).

Rendered by `templates/wgmma/`:

- the 16-bit rows into `include/flashgen/sm90.cuh`, the section from `SECTION_START` to
  `SECTION_END` (wrappers and the `Wgmma<Elem, N>` dispatch);
- the narrow 16-bit rows (N 8 to 56 but 32: the sm_90a forward's P V tail) into
  `include/flashgen/sm90_narrow.cuh`, which only the sm_90a forward includes;
- the e4m3 rows into `include/flashgen/sm90_fp8.cuh`, a header of its own that no kernel
  includes yet (the FP8 forward will), so adding them renames nothing.

`python -m flashgen.generator.wgmma` rewrites both from the table; `--check` reports whether
they are current (a test runs it, and another assembles every row with ptxas).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from flashgen.generator.paths import TEMPLATES_DIR
from flashgen.generator.spec import ELEMENTS

__all__ = [
    "Dispatch",
    "HEADERS",
    "NARROW_N",
    "ROWS",
    "SECTION_END",
    "SECTION_START",
    "Header",
    "WgmmaRow",
    "check",
    "render",
    "write",
]


class WgmmaRow(NamedTuple):
    m: int
    n: int
    k: int
    a: str  # element type of A (a `spec.ELEMENTS` key)
    b: str  # element type of B
    acc: str  # accumulator type: f32
    src: str  # "ss" (A and B in shared memory) or "rs" (A in registers)

    @property
    def suffix(self) -> str:
        return self.a if self.a == self.b else f"{self.a}{self.b}"

    @property
    def name(self) -> str:
        return f"wgmma_{self.src}_m{self.m}n{self.n}k{self.k}_{self.suffix}"

    @property
    def ptx(self) -> str:
        """The instruction, without operands."""
        return (
            f"wgmma.mma_async.sync.aligned.m{self.m}n{self.n}k{self.k}.{self.acc}.{self.a}.{self.b}"
        )

    @property
    def transposable(self) -> bool:
        """Whether the instruction takes transpose immediates (16-bit A and B)."""
        return ELEMENTS[self.a].nbytes == 2 and ELEMENTS[self.b].nbytes == 2

    @property
    def acc_regs(self) -> int:
        """f32 accumulator registers per thread of the warpgroup."""
        return self.m * self.n // 128

    @property
    def a_regs(self) -> int:
        """32-bit registers per thread of an A fragment from registers (`rs`)."""
        return self.m * self.k * ELEMENTS[self.a].nbytes // (128 * 4)

    def d_operands(self) -> str:
        """`{%0, %1, ...}`: the accumulator operands of the asm string."""
        return "{" + ", ".join(f"%{i}" for i in range(self.acc_regs)) + "}"

    def a_operands(self) -> str:
        """`{%N, ...}`: the register A operands (`rs`), numbered after the accumulator."""
        first = self.acc_regs
        return "{" + ", ".join(f"%{first + i}" for i in range(self.a_regs)) + "}"

    def pred_operand(self) -> int:
        """The operand number of `accumulate` (becomes the scale-d predicate)."""
        return self.acc_regs + (2 if self.src == "ss" else self.a_regs + 1)

    def ab_operands(self) -> str:
        """The asm string's operands after the accumulator: A, B, scale-d, the scale
        immediates (1: no negation) and the transpose immediates where the type has them."""
        acc = self.acc_regs
        if self.src == "ss":
            ab, trans = f"%{acc}, %{acc + 1}", [acc + 3, acc + 4]
        else:
            ab, trans = f"{self.a_operands()}, %{acc + self.a_regs}", [acc + self.a_regs + 2]
        imm = "".join(f", %{i}" for i in trans) if self.transposable else ""
        return f"{ab}, p, 1, 1{imm}"

    def input_constraints(self) -> list[str]:
        """The input constraint lines (the first follows `: `, the rest are indented)."""
        if self.src == "ss":
            ins = '"l"(desc_a), "l"(desc_b), "r"(accumulate)'
            return [ins + (', "n"(kTransA), "n"(kTransB));' if self.transposable else ");")]
        regs = ", ".join(f'"r"(a[{i}])' for i in range(self.a_regs))
        ins = f'{regs}, "l"(desc_b), "r"(accumulate)'
        return [ins + ",", '"n"(kTransB));'] if self.transposable else [ins + ");"]

    def d_constraints(self) -> list[str]:
        """The `"+f"(d[i])` output constraints, 8 a line, each line but the last ending ','."""
        regs = [f'"+f"(d[{i}])' for i in range(self.acc_regs)]
        lines = [", ".join(regs[i : i + 8]) for i in range(0, len(regs), 8)]
        return [line + ("," if i < len(lines) - 1 else "") for i, line in enumerate(lines)]


def _check_row(r: WgmmaRow) -> None:
    """The subset of PTX's wgmma.mma_async that the template renders."""
    for t in (r.a, r.b):
        if t not in ELEMENTS:
            raise ValueError(f"{r}: {t!r} is not an element type ({', '.join(ELEMENTS)})")
    ea, eb = ELEMENTS[r.a], ELEMENTS[r.b]
    if r.m != 64 or r.acc != "f32" or r.src not in ("ss", "rs"):
        raise ValueError(f"{r}: only m64, an f32 accumulator and ss/rs are rendered")
    if ea.mma_k != eb.mma_k or r.k != ea.mma_k:
        raise ValueError(f"{r}: K is {ea.mma_k} for {r.a} and {eb.mma_k} for {r.b}")
    if not (8 <= r.n <= 256 and r.n % 8 == 0):
        raise ValueError(f"{r}: N is a multiple of 8 from 8 to 256")
    if ea.nbytes != eb.nbytes or (ea.nbytes == 2 and r.a != r.b):
        raise ValueError(f"{r}: 16-bit A and B have one type; FP8 A and B are both FP8")


# N of the narrow 16-bit rows (sm90_narrow.cuh); the others (32, 64, 128) are sm90.cuh's.
NARROW_N = (8, 16, 24, 40, 48, 56)

# The table. Order is rendering order (the 16-bit rows as sm90.cuh has always listed them).
ROWS: tuple[WgmmaRow, ...] = (
    WgmmaRow(64, 32, 16, "bf16", "bf16", "f32", "ss"),
    WgmmaRow(64, 32, 16, "bf16", "bf16", "f32", "rs"),
    WgmmaRow(64, 32, 16, "f16", "f16", "f32", "ss"),
    WgmmaRow(64, 32, 16, "f16", "f16", "f32", "rs"),
    WgmmaRow(64, 64, 16, "bf16", "bf16", "f32", "ss"),
    WgmmaRow(64, 64, 16, "bf16", "bf16", "f32", "rs"),
    WgmmaRow(64, 64, 16, "f16", "f16", "f32", "ss"),
    WgmmaRow(64, 64, 16, "f16", "f16", "f32", "rs"),
    WgmmaRow(64, 128, 16, "bf16", "bf16", "f32", "ss"),
    WgmmaRow(64, 128, 16, "bf16", "bf16", "f32", "rs"),
    WgmmaRow(64, 128, 16, "f16", "f16", "f32", "ss"),
    WgmmaRow(64, 128, 16, "f16", "f16", "f32", "rs"),
    # the sm_90a forward's P V tail below 128 columns (d_v % 64: 8..56; 32 is above)
    *(
        WgmmaRow(64, n, 16, t, t, "f32", s)
        for n in NARROW_N
        for t in ("bf16", "f16")
        for s in ("ss", "rs")
    ),
    # FP8 forward (Q K^T over d, P V over keys; both K-major).
    WgmmaRow(64, 64, 32, "e4m3", "e4m3", "f32", "ss"),
    WgmmaRow(64, 64, 32, "e4m3", "e4m3", "f32", "rs"),
    WgmmaRow(64, 128, 32, "e4m3", "e4m3", "f32", "ss"),
    WgmmaRow(64, 128, 32, "e4m3", "e4m3", "f32", "rs"),
    WgmmaRow(64, 256, 32, "e4m3", "e4m3", "f32", "ss"),
    WgmmaRow(64, 256, 32, "e4m3", "e4m3", "f32", "rs"),
)
for _r in ROWS:
    _check_row(_r)


class Dispatch(NamedTuple):
    """One `Wgmma<Elem, N>` specialisation: the ss and rs rows of one (element, N)."""

    cpp: str
    n: int
    suffix: str
    ss: WgmmaRow
    rs: WgmmaRow


def dispatch(rows: Iterable[WgmmaRow]) -> list[Dispatch]:
    """Specialisations in element order (of first appearance), then N."""
    rows = list(rows)
    order = list(dict.fromkeys(r.suffix for r in rows))
    found: dict[tuple[str, int], dict[str, WgmmaRow]] = {}
    for r in rows:
        found.setdefault((r.suffix, r.n), {})[r.src] = r
    out = []
    for (suffix, n), by_src in sorted(
        found.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])
    ):
        if set(by_src) != {"ss", "rs"}:
            raise ValueError(f"{suffix} N={n}: a Wgmma specialisation needs an ss and an rs row")
        ss = by_src["ss"]
        out.append(Dispatch(ELEMENTS[ss.a].cpp, n, suffix, ss, by_src["rs"]))
    return out


class Header(NamedTuple):
    """One rendered text: the header (relative to the templates dir), its template, its rows,
    and the section markers (`None`: the template renders the whole file)."""

    path: str
    template: str
    rows: tuple[WgmmaRow, ...]
    start: str | None = None
    end: str | None = None


SECTION_START = "// The m64nNk16 instructions"
SECTION_END = "#undef FG_SM90_WGMMA\n"

HEADERS: tuple[Header, ...] = (
    Header(
        "include/flashgen/sm90.cuh",
        "wgmma/sm90_section.cuh.j2",
        tuple(r for r in ROWS if r.transposable and r.n not in NARROW_N),
        SECTION_START,
        SECTION_END,
    ),
    Header(
        "include/flashgen/sm90_narrow.cuh",
        "wgmma/sm90_narrow.cuh.j2",
        tuple(r for r in ROWS if r.transposable and r.n in NARROW_N),
    ),
    Header(
        "include/flashgen/sm90_fp8.cuh",
        "wgmma/sm90_fp8.cuh.j2",
        tuple(r for r in ROWS if not r.transposable),
    ),
)

# sm90.cuh's dispatch macro spells the k16 instruction names and the 4-register A fragment.
if any(r.k != 16 or r.a_regs != 4 for r in HEADERS[0].rows):
    raise ValueError("sm90.cuh's section renders k16 rows only")


def render(header: Header, templates_dir: Path | None = None) -> str:
    """The text of `header` (its section, where it has markers) rendered from its rows."""
    from flashgen.generator.render import environment

    env = environment(Path(templates_dir or TEMPLATES_DIR).resolve())
    return env.get_template(header.template).render(
        rows=header.rows, dispatch=dispatch(header.rows)
    )


def _section(text: str, header: Header) -> tuple[int, int]:
    """(start, end) of the marked section of `text`; ValueError unless each marker is there
    once and in order."""
    assert header.start is not None and header.end is not None
    if text.count(header.start) != 1 or text.count(header.end) != 1:
        raise ValueError(
            f"{header.path}: the markers {header.start!r} and {header.end!r} must each appear once"
        )
    s, e = text.index(header.start), text.index(header.end) + len(header.end)
    if e <= s:
        raise ValueError(f"{header.path}: {header.end!r} before {header.start!r}")
    return s, e


def expected(header: Header, templates_dir: Path | None = None) -> str:
    """The whole file as the table says it should read."""
    root = Path(templates_dir or TEMPLATES_DIR)
    text = render(header, root)
    if header.start is None:
        return text
    current = (root / header.path).read_text(encoding="utf-8")
    s, e = _section(current, header)
    return current[:s] + text + current[e:]


def check(templates_dir: Path | None = None) -> list[str]:
    """Headers (relative paths) whose text differs from what the table renders."""
    root = Path(templates_dir or TEMPLATES_DIR)
    stale = []
    for h in HEADERS:
        p = root / h.path
        if not p.is_file() or p.read_text(encoding="utf-8") != expected(h, root):
            stale.append(h.path)
    return stale


def write(templates_dir: Path | None = None) -> list[str]:
    """Rewrites the stale headers; returns their relative paths."""
    root = Path(templates_dir or TEMPLATES_DIR)
    stale = check(root)
    for rel in stale:
        h = next(h for h in HEADERS if h.path == rel)
        text = expected(h, root)
        (root / rel).write_text(text, encoding="utf-8", newline="\n")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flashgen.generator.wgmma", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--check", action="store_true", help="report stale headers, write nothing")
    args = ap.parse_args(argv)
    if args.check:
        stale = check()
        for rel in stale:
            print(f"stale: templates/{rel} (python -m flashgen.generator.wgmma)", file=sys.stderr)
        return 1 if stale else 0
    for rel in write():
        print(f"wrote templates/{rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
