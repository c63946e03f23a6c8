"""The wgmma table (generator/wgmma.py): the headers it renders are current, the 16-bit
section of sm90.cuh is what every sm_90a kernel has always included, and every row assembles
for sm_90a (nvcc and ptxas, no GPU) into the HGMMA of its shape."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from flashgen.generator import wgmma
from flashgen.generator.paths import TEMPLATES_DIR
from flashgen.generator.wgmma import HEADERS, ROWS, WgmmaRow

INCLUDE = TEMPLATES_DIR / "include" / "flashgen"


def test_rendered_headers_are_current():
    assert wgmma.check() == [], "run: python -m flashgen.generator.wgmma"
    assert wgmma.main(["--check"]) == 0


def test_table_has_the_16_bit_and_e4m3_rows_each_header_renders_its_own():
    assert len(ROWS) == len(set(ROWS)) == 42
    sixteen = [r for r in ROWS if r.k == 16 and r.n in (32, 64, 128)]
    assert {(r.n, r.a, r.src) for r in sixteen} == {
        (n, t, s) for n in (32, 64, 128) for t in ("bf16", "f16") for s in ("ss", "rs")
    }
    narrow = [r for r in ROWS if r.k == 16 and r.n not in (32, 64, 128)]
    assert {(r.n, r.a, r.src) for r in narrow} == {
        (n, t, s) for n in wgmma.NARROW_N for t in ("bf16", "f16") for s in ("ss", "rs")
    }
    fp8 = [r for r in ROWS if r.a == "e4m3"]
    assert {(r.n, r.k, r.b, r.src) for r in fp8} == {
        (n, 32, "e4m3", s) for n in (64, 128, 256) for s in ("ss", "rs")
    }
    sm90, sm90_narrow, sm90_fp8 = HEADERS
    assert set(sm90.rows) == set(sixteen) and set(sm90_fp8.rows) == set(fp8)
    assert set(sm90_narrow.rows) == set(narrow)
    assert all(r.transposable for r in sixteen + narrow) and not any(r.transposable for r in fp8)


def test_only_the_sm90a_forward_includes_the_narrow_header():
    """sm90_narrow.cuh renames the sm_90a forward kernels only."""
    users = [
        p.relative_to(TEMPLATES_DIR).as_posix()
        for p in TEMPLATES_DIR.rglob("*")
        if p.is_file() and '#include "sm90_narrow.cuh"' in p.read_text(errors="replace")
    ]
    assert users == ["include/flashgen/fwd_sm90_kernel.cuh"]


def test_no_kernel_template_includes_the_fp8_header():
    """sm90_fp8.cuh reaches generated/ (every header does) but no kernel's hash."""
    users = [
        p
        for p in TEMPLATES_DIR.rglob("*")
        if p.is_file() and "sm90_fp8.cuh" in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert sorted(p.relative_to(TEMPLATES_DIR).as_posix() for p in users) == [
        "include/flashgen/sm90_fp8.cuh",
        "wgmma/sm90_fp8.cuh.j2",
    ]


def test_a_changed_row_is_reported_stale(tmp_path, monkeypatch):
    root = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, root)
    assert wgmma.check(root) == []
    sm90, narrow, fp8 = HEADERS
    changed = tuple(r._replace(n=96) if r.n == 128 else r for r in sm90.rows)
    monkeypatch.setattr(wgmma, "HEADERS", (sm90._replace(rows=changed), narrow, fp8))
    assert wgmma.check(root) == ["include/flashgen/sm90.cuh"]
    assert wgmma.write(root) == ["include/flashgen/sm90.cuh"] and wgmma.check(root) == []
    text = (root / sm90.path).read_text()
    assert "wgmma_ss_m64n96k16_bf16" in text and "m64n128k16" not in text
    assert text.endswith("}  // namespace sm90\n}  // namespace fg\n")  # outside the section kept


def test_markers_must_each_appear_once(tmp_path):
    root = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, root)
    p = root / HEADERS[0].path
    p.write_text(p.read_text() + wgmma.SECTION_END)
    with pytest.raises(ValueError, match="must each appear once"):
        wgmma.check(root)


@pytest.mark.parametrize(
    "row, why",
    [
        (WgmmaRow(64, 64, 16, "e4m3", "e4m3", "f32", "ss"), "K is 32"),
        (WgmmaRow(64, 64, 32, "bf16", "bf16", "f32", "ss"), "K is 16"),
        (WgmmaRow(64, 260, 16, "f16", "f16", "f32", "rs"), "multiple of 8"),
        (WgmmaRow(64, 64, 16, "f16", "bf16", "f32", "ss"), "one type"),
        (WgmmaRow(64, 64, 32, "e5m2", "e5m2", "f32", "ss"), "not an element type"),
        (WgmmaRow(64, 64, 16, "f16", "f16", "f16", "ss"), "f32 accumulator"),
    ],
)
def test_rows_outside_what_the_template_renders_are_refused(row, why):
    with pytest.raises(ValueError, match=why):
        wgmma._check_row(row)


def test_operand_numbering_follows_the_ptx_operand_order():
    ss = WgmmaRow(64, 64, 16, "bf16", "bf16", "f32", "ss")
    assert (ss.acc_regs, ss.pred_operand(), ss.ab_operands()) == (
        32,
        34,
        "%32, %33, p, 1, 1, %35, %36",
    )
    rs = WgmmaRow(64, 256, 32, "e4m3", "e4m3", "f32", "rs")
    assert (rs.acc_regs, rs.a_regs, rs.pred_operand()) == (128, 4, 133)
    assert rs.ab_operands() == "{%128, %129, %130, %131}, %132, p, 1, 1"


# ---- assembling every row -------------------------------------------------------------------


def _calls(r: WgmmaRow) -> list[str]:
    """Calls of the row's wrapper, every transpose variant it has."""
    a = "desc_a" if r.src == "ss" else "a"
    if not r.transposable:
        return [f"{r.name}(d, {a}, desc_b, acc);"]
    if r.src == "ss":
        return [f"{r.name}<{ta}, {tb}>(d, {a}, desc_b, acc);" for ta in (0, 1) for tb in (0, 1)]
    return [f"{r.name}<{tb}>(d, {a}, desc_b, acc);" for tb in (0, 1)]


def _source() -> str:
    lines = ['#include "sm90_fp8.cuh"', '#include "sm90_narrow.cuh"', "using namespace fg::sm90;"]
    for i, r in enumerate(ROWS):
        a = (
            "uint64_t desc_a = p[0];"
            if r.src == "ss"
            else "const uint32_t a[4] = {u[0], u[1], u[2], u[3]};"
        )
        lines += [
            f"__global__ void row{i}(float* out, const uint64_t* p, const uint32_t* u, int acc) {{",
            f"  float d[{r.acc_regs}];",
            f"  for (int i = 0; i < {r.acc_regs}; ++i) d[i] = out[i];",
            f"  {a}",
            "  const uint64_t desc_b = p[1];",
            "  wgmma_fence();",
            *(f"  {c}" for c in _calls(r)),
            "  wgmma_commit();",
            "  wgmma_wait<0>();",
            f"  for (int i = 0; i < {r.acc_regs}; ++i) out[i] = d[i];",
            "}",
        ]
    # The dispatch structs, 16-bit and FP8, resolve to the rows.
    lines.append("__global__ void dispatch(float* out, uint64_t x, int acc) {")
    lines.append("  const uint32_t a[4] = {1, 2, 3, 4};")
    for s in wgmma.dispatch(ROWS):
        elem = s.cpp
        lines += [
            "  {",
            f"    float d[{s.ss.acc_regs}] = {{}};",
            f"    Wgmma<{elem}, {s.n}>::ss<0>(d, x, x, acc);",
            f"    Wgmma<{elem}, {s.n}>::rs<0>(d, a, x, acc);",
            f"    out[{s.n}] = d[0];",
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


# The SASS spelling of each element type in a GMMA opcode (f16 is the default: none).
_SASS_TYPE = {"bf16": ".BF16", "f16": "", "e4m3": ".E4M3"}


def _gmma(r: WgmmaRow) -> str:
    """The row's SASS opcode: HGMMA (16-bit) or QGMMA (FP8), e.g. HGMMA.64x64x16.F32.BF16."""
    unit = "Q" if r.a == "e4m3" else "H"
    types = _SASS_TYPE[r.a] + (_SASS_TYPE[r.b] if unit == "Q" else "")
    return f"{unit}GMMA.{r.m}x{r.n}x{r.k}.{r.acc.upper()}{types}"


def _transposes(r: WgmmaRow) -> set[str]:
    """The descriptor suffixes `_calls` makes ptxas emit."""
    if not r.transposable:
        return {""}
    return {"", ".tnspB", ".tnspA", ".tnspA.tnspB"} if r.src == "ss" else {"", ".tnspB"}


nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def cubin(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wgmma")
    src, out = tmp / "rows.cu", tmp / "rows.cubin"
    src.write_text(_source())
    cmd = ["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", f"-I{INCLUDE}", str(src)]
    res = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.nvcc
@nvcc
def test_every_row_assembles_for_sm90a(cubin):
    assert cubin.stat().st_size > 0


@pytest.mark.nvcc
@nvcc
@pytest.mark.skipif(
    shutil.which("cuobjdump") is None or shutil.which("nvdisasm") is None,
    reason="cuobjdump and nvdisasm not on PATH",
)
def test_every_row_is_the_gmma_of_its_shape_types_and_operands(cubin):
    sass = subprocess.run(
        ["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    bodies = re.split(r"\n\s*Function : ", sass)
    by_name = {b.split(None, 1)[0]: b for b in bodies[1:]}
    for i, r in enumerate(ROWS):
        body = by_name[f"_Z{len(f'row{i}')}row{i}PfPKmPKji"]
        gmma = re.findall(r"\b([HQ]GMMA\.\S+) ([^;]*);", body)
        assert len(gmma) == len(_calls(r)), (r, gmma)
        assert {op for op, _ in gmma} == {_gmma(r)}, (r, gmma)
        a_operand = {ops.split(", ")[1].split("[")[0] for _, ops in gmma}
        if r.src == "ss":
            assert a_operand == {"gdesc"}, (r, gmma)
        else:
            assert all(re.fullmatch(r"R\d+", a) for a in a_operand), (r, gmma)
        trans = {re.search(r"gdesc\[UR\d+\]((?:\.tnsp[AB])*)", ops).group(1) for _, ops in gmma}
        assert trans == _transposes(r), (r, gmma)
    # The dispatch structs reach every (element, N) of the table, ss then rs.
    ops = [op for op, _ in re.findall(r"\b([HQ]GMMA\.\S+) ([^;]*);", by_name["_Z8dispatchPfmi"])]
    assert ops == [_gmma(s.ss) for s in wgmma.dispatch(ROWS) for _ in "sr"]
