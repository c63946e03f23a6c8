"""The vendoring path (docs/vendoring.md): a generated kernel's .cu and .h compile into a plain
C or C++ program, with nvcc or CMake, exactly as the doc says; `fg_fwd_params_default()` gives
warning-free, correct defaults; the C ABI refuses unusable parameters with a message before
touching the GPU; and building without `-arch` stops at one clear #error.

Kernels are rendered from specs/ with the current templates (not taken from generated/).
Needs nvcc (and gcc/g++, cmake for some tests), no GPU: no CUDA runtime call is reached."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashgen.generator.families import SCORE_PARAM_FIELDS
from flashgen.generator.families.forward import PARAMS
from flashgen.generator.paths import TEMPLATES_DIR

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "vendoring.md"
INCLUDE_ROOT = TEMPLATES_DIR / "include"  # holds flashgen/params.h, flashgen/arch_guard.cuh

needs = {
    tool: pytest.mark.skipif(shutil.which(tool) is None, reason=f"{tool} not on PATH")
    for tool in ("nvcc", "gcc", "g++", "cmake")
}
nvcc_test = [pytest.mark.nvcc, needs["nvcc"]]

WARNINGS = ["-Wall", "-Wextra", "-Werror"]
ARCH_ERROR = "flashgen kernels need sm_80 or newer"


def run(cmd: list[str] | str, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure, fail the test with its output."""
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        pytest.fail(f"{cmd} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def report(stdout: str) -> dict[str, str]:
    """`key: value` lines printed by the test programs."""
    return dict(line.split(": ", 1) for line in stdout.strip().splitlines())


# -- a freshly rendered kernel ---------------------------------------------------------------


class Kernel:
    def __init__(self, outdir: Path, entry: dict):
        self.dir = outdir
        self.name: str = entry["name"]
        self.head_dim: int = entry["spec"]["head_dim"]

    def vendor_into(self, dest: Path) -> None:
        """Copy the kernel as docs/vendoring.md says: .cu, .h and include/ side by side."""
        dest.mkdir(parents=True, exist_ok=True)
        for suffix in (".cu", ".h"):
            shutil.copy(self.dir / f"{self.name}{suffix}", dest)
        shutil.copytree(self.dir / "include", dest / "include")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Kernel:
    """The smallest plain dense kernel of specs/fwd_dense.yaml (no mask, no GQA, no dropout)."""
    out = tmp_path_factory.mktemp("generated")
    spec = REPO / "specs" / "fwd_dense.yaml"
    run([sys.executable, "-m", "flashgen.generator", "generate", str(spec), "-o", str(out),
         "--no-readme"])  # fmt: skip
    entries = json.loads((out / "manifest.json").read_text())["kernels"]
    plain = [
        k
        for k in entries
        if k["spec"]["mask"] == {"causal": "none", "window": False, "varlen": False}
        and not k["spec"]["gqa"]
        and not k["spec"]["dropout"]
    ]
    assert plain, "no plain dense kernel in specs/fwd_dense.yaml"
    return Kernel(out, min(plain, key=lambda k: k["spec"]["head_dim"]))


# -- 1. fg_fwd_params_default ------------------------------------------------------------------

# Every field that is not 0 / NULL by default.
DEFAULTS = {"window_left": "-1", "window_right": "-1", "blk_layout_heads": "1"}
PRINTF = {  # ctype -> (printf format, expression of field `{}`)
    "ptr": ("%s", '(p.{} == NULL ? "NULL" : "set")'),
    "i64": ("%lld", "(long long)p.{}"),
    "u64": ("%llu", "(unsigned long long)p.{}"),
    "f64": ("%g", "p.{}"),
}


def defaults_program() -> str:
    """C/C++ source printing every field of fg_fwd_params_default(), one `name: value` a line."""
    lines = ["#include <stdio.h>", '#include "flashgen/params.h"', "int main(void) {",
             "  fg_fwd_params p = fg_fwd_params_default();"]  # fmt: skip
    score = {f.name for f in SCORE_PARAM_FIELDS}  # members of the embedded `score` struct
    for f in PARAMS:
        fmt, expr = PRINTF[f.ctype]
        member = f"score.{f.name}" if f.name in score else f.name
        lines.append(f'  printf("{f.name}: {fmt}\\n", {expr.format(member)});')
    return "\n".join(lines + ["  return 0;", "}", ""])


@pytest.mark.parametrize(
    "compiler, flags",
    [
        pytest.param("g++", ["-x", "c++", "-std=c++17", *WARNINGS], marks=needs["g++"]),
        pytest.param("gcc", ["-x", "c", "-std=c99", "-pedantic", *WARNINGS], marks=needs["gcc"]),
        pytest.param(
            "nvcc",
            ["-x", "cu", "-std=c++17", "-Werror=all-warnings", "-Xcompiler=" + ",".join(WARNINGS)],
            marks=nvcc_test,
        ),
    ],
    ids=["c++17", "c99", "nvcc"],
)
def test_params_default_compiles_warning_free_and_sets_every_field(tmp_path, compiler, flags):
    src = tmp_path / "defaults.txt"  # the language comes from -x
    src.write_text(defaults_program())
    exe = tmp_path / "defaults"
    run([compiler, *flags, f"-I{INCLUDE_ROOT}", str(src), "-o", str(exe)])
    got = report(run([str(exe)]).stdout)
    want = {f.name: DEFAULTS.get(f.name, "NULL" if f.ctype == "ptr" else "0") for f in PARAMS}
    assert got == want


# -- 5. the C ABI refuses unusable parameters --------------------------------------------------

MAIN = r"""
#include <cstdio>
#include "NAME.h"

alignas(16) static unsigned char buf[1 << 12];

static void show(const char* what, const fg_fwd_params& p) {
  const char* m = NAME_check(&p);
  std::printf("%s: %s\n", what, m ? m : "OK");
}

int main() {
  fg_fwd_params p = fg_fwd_params_default();
  show("null", p);
  // Only the tensors and the shape: the defaults must do for everything else but the scale.
  p.q = buf; p.k = buf; p.v = buf; p.o = buf; p.lse = reinterpret_cast<float*>(buf);
  p.batch = 1; p.heads = 2; p.kv_heads = 2; p.seqlen_q = 5; p.seqlen_k = 7;
  show("no scale", p);
  p.softmax_scale = 0.125;
  show("no head dims", p);
  p.head_dim = p.head_dim_v = HEAD_DIM;
  show("defaults", p);
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = 128;
  show("good", p);
  fg_fwd_params bad = p; bad.k = buf + 8; show("misaligned", bad);
  bad = p; bad.v_head_stride = 12; show("stride", bad);
  bad = p; bad.kv_heads = 1; show("kv_heads", bad);
  bad = p; bad.softmax_scale = 0.0; show("scale", bad);
  bad = p; bad.head_dim = bad.head_dim_v = HEAD_DIM + 8; show("head_dim", bad);
  bad = p; bad.head_dim_v = HEAD_DIM / 2; show("head_dim_v", bad);
  bad = p; bad.seqlen_q = 1LL << 40; bad.heads = bad.kv_heads = 1LL << 30; show("grid", bad);
  bad = p; bad.k = buf + 8;
  std::printf("launch: %d\n", static_cast<int>(NAME_launch(&bad, nullptr)));
  std::printf("invalid value: %d\n", static_cast<int>(cudaErrorInvalidValue));
  return 0;
}
"""


@pytest.mark.nvcc
@needs["nvcc"]
def test_vendored_kernel_builds_and_its_c_abi_refuses_bad_parameters(tmp_path, kernel):
    src = tmp_path / "main.cu"
    src.write_text(MAIN.replace("NAME", kernel.name).replace("HEAD_DIM", str(kernel.head_dim)))
    exe = tmp_path / "main"
    cu = kernel.dir / f"{kernel.name}.cu"
    run(["nvcc", "-std=c++17", "-O1", "-arch=sm_90", "-Xcompiler=" + ",".join(WARNINGS),
         f"-I{kernel.dir}", str(src), str(cu), "-o", str(exe)])  # fmt: skip
    out = report(run([str(exe)]).stdout)
    assert out["null"] == "q, k, v, o and lse must all be non-null"
    assert out["no scale"] == "softmax_scale must be finite and > 0"
    d = kernel.head_dim
    want = f"head_dim and head_dim_v must both be {d}: the head dims this kernel was generated for"
    assert out["no head dims"] == out["head_dim"] == out["head_dim_v"] == want
    assert out["defaults"] == "OK"
    assert out["good"] == "OK"
    assert out["misaligned"] == "q, k, v and o must be 16-byte aligned"
    assert out["stride"] == "q/k/v/o strides must be multiples of 8 elements (16 bytes)"
    assert out["kv_heads"] == "kv_heads must equal heads (spec has gqa: false)"
    assert out["scale"] == "softmax_scale must be finite and > 0"
    assert out["grid"].startswith("grid too large")
    assert out["launch"] == out["invalid value"]


# -- 2. docs/vendoring.md builds as written ----------------------------------------------------


def doc_blocks(lang: str) -> list[str]:
    """The fenced code blocks of docs/vendoring.md tagged `lang`."""
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


# Appended to the doc's example (its `attention_params` and `attention`) to make a program.
DOC_MAIN = r"""
int main() {
  alignas(16) static unsigned char buf[1 << 12];
  fg_fwd_params p = attention_params(buf, buf, buf, buf, reinterpret_cast<float*>(buf),
                                     2, 4, 4, 100, 120, HEAD_DIM);
  const char* why = NAME_check(&p);
  printf("check: %s\n", why ? why : "OK");
  p.k = buf + 8;  // misaligned: attention() reports it and does not launch
  printf("attention: %d\n", static_cast<int>(attention(&p, nullptr)));
  printf("invalid value: %d\n", static_cast<int>(cudaErrorInvalidValue));
  return 0;
}
"""


def doc_project(root: Path, kernel: Kernel) -> Path:
    """A project laid out as the doc says, with the doc's example as main.cpp."""
    kernel.vendor_into(root / "third_party" / "flashgen")
    (example,) = doc_blocks("c")
    main = example + DOC_MAIN.replace("HEAD_DIM", str(kernel.head_dim))
    (root / "main.cpp").write_text(main.replace("<name>", kernel.name).replace("NAME", kernel.name))
    return root


def check_doc_program(exe: Path) -> None:
    out = run([str(exe)])
    got = report(out.stdout)
    assert got["check"] == "OK"
    assert got["attention"] == got["invalid value"]
    assert "flashgen: q, k, v and o must be 16-byte aligned" in out.stderr


@pytest.mark.nvcc
@needs["nvcc"]
def test_doc_nvcc_commands_build_the_example(tmp_path, kernel):
    project = doc_project(tmp_path, kernel)
    (commands,) = doc_blocks("sh")
    for line in commands.replace("<name>", kernel.name).splitlines():
        if line.strip():
            run(line, cwd=project, shell=True)
    check_doc_program(project / "myapp")


@pytest.mark.nvcc
@needs["nvcc"]
@needs["cmake"]
def test_doc_cmake_builds_a_plain_cpp_target(tmp_path, kernel):
    """The doc's CMakeLists.txt, with the C++ side held to -Wall -Wextra -Werror."""
    project = doc_project(tmp_path, kernel)
    (cmakelists,) = doc_blocks("cmake")
    (project / "CMakeLists.txt").write_text(cmakelists.replace("<name>", kernel.name))
    build = project / "build"
    run(["cmake", "-S", str(project), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
         "-DCMAKE_CXX_FLAGS=" + " ".join(WARNINGS)])  # fmt: skip
    run(["cmake", "--build", str(build)])
    check_doc_program(build / "myapp")


@pytest.mark.nvcc
@needs["nvcc"]
def test_doc_example_is_warning_free_c99(tmp_path, kernel):
    """The example is C as well as C++ (nvcc hands a `-x c` file to the host C compiler with the
    CUDA include path; no -pedantic: cuda_runtime.h itself is not ISO C99)."""
    project = doc_project(tmp_path, kernel)
    (example,) = doc_blocks("c")
    src = project / "attention.c"
    src.write_text(example.replace("<name>", kernel.name))
    run(["nvcc", "-x", "c", "-c", f"-I{project / 'third_party' / 'flashgen'}",
         "-Xcompiler=" + ",".join(["-std=c99", *WARNINGS]), str(src),
         "-o", str(project / "attention.o")])  # fmt: skip


# -- 3. building below sm_80 stops at one #error -----------------------------------------------


def compile_without_arch(src: Path, *include: Path) -> str:
    """nvcc -c with no -arch (nvcc's default target, below sm_80); must fail; its output."""
    out = subprocess.run(
        ["nvcc", "-c", *(f"-I{i}" for i in include), str(src), "-o", str(src.with_suffix(".o"))],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0, "compiled for nvcc's default target"
    return out.stdout + out.stderr


def assert_one_arch_error(output: str) -> None:
    assert ARCH_ERROR in output, output
    assert output.count("error:") == 1, output  # the #error, nothing after it
    assert "cp.async" not in output and "ptxas" not in output, output


GUARDED = r"""
#include "flashgen/arch_guard.cuh"
__global__ void copy(int* p) {
  asm volatile("cp.async.wait_all;\n");
  p[0] = 1;
}
"""


@pytest.mark.nvcc
@needs["nvcc"]
def test_arch_guard_gives_one_error_below_sm80(tmp_path):
    src = tmp_path / "guarded.cu"
    src.write_text(GUARDED)
    assert_one_arch_error(compile_without_arch(src, INCLUDE_ROOT))
    run(["nvcc", "-c", "-arch=sm_80", f"-I{INCLUDE_ROOT}", str(src), "-o", str(tmp_path / "ok.o")])


@pytest.mark.nvcc
@needs["nvcc"]
def test_generated_kernel_without_arch_gives_one_error(kernel):
    """arch.cuh includes arch_guard.cuh first, so the guard stops the device pass before any
    cp.async reaches ptxas."""
    assert_one_arch_error(compile_without_arch(kernel.dir / f"{kernel.name}.cu"))
