"""The `flashgen` command line, the README's promises and the CI script."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from flashgen.generator.cli import main
from flashgen.generator.families.forward import smem_bytes
from flashgen.generator.spec import Dtype, Target
from flashgen.generator.tiles import auto_tile

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TEST_COMMAND = "python -m pytest -q tests"


@pytest.fixture
def templates(tmp_path: Path) -> Path:
    root = tmp_path / "templates"
    (root / "include" / "flashgen").mkdir(parents=True)
    (root / "forward").mkdir()
    (root / "forward" / "kernel.cu.j2").write_text(
        '// {{ banner | join("\\n// ") }}\n#include "{{ header_name }}"\n'
        "// d={{ cfg.head_dim }} m={{ cfg.block_m }}\n"
    )
    (root / "forward" / "kernel.h.j2").write_text(
        '// {{ banner | join("\\n// ") }}\n#pragma once\n'
    )
    (root / "include" / "flashgen" / "params.h").write_text("// params\n")
    return root


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    p = tmp_path / "specs" / "t.yaml"
    p.parent.mkdir()
    p.write_text("dtype: [fp16, bf16]\nhead_dim: 64\nmask: {causal: bottom_right}\n")
    return p


def run(*argv: str) -> int:
    return main([str(a) for a in argv])


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def test_generate_writes_kernels_and_manifest(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 0
    assert len(list(out.glob("*.cu"))) == 2 and len(list(out.glob("*.h"))) == 2
    assert (out / "manifest.json").is_file() and (out / "include/flashgen/params.h").is_file()
    assert "2 kernels in" in capsys.readouterr().out


def test_generate_check_passes_when_up_to_date(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "gen"
    run("generate", spec_file, "-o", out, "--templates", templates)
    capsys.readouterr()
    assert run("generate", spec_file.parent, "-o", out, "--templates", templates, "--check") == 0
    assert "up to date" in capsys.readouterr().out


def test_generate_check_fails_with_a_diff_on_a_stale_file(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "gen"
    run("generate", spec_file, "-o", out, "--templates", templates)
    cu = sorted(out.glob("*.cu"))[0]
    cu.write_text(cu.read_text().replace("m=128", "m=64"))
    capsys.readouterr()
    assert run("generate", spec_file, "-o", out, "--templates", templates, "--check") == 1
    captured = capsys.readouterr()
    assert "-// d=64 m=64" in captured.out and "+// d=64 m=128" in captured.out
    assert "out of date" in captured.err
    assert "m=64" in cu.read_text()  # --check wrote nothing


def test_generate_check_fails_when_a_kernel_was_added(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "gen"
    run("generate", spec_file, "-o", out, "--templates", templates)
    spec_file.write_text("dtype: [fp16, bf16]\nhead_dim: [64, 128]\n")
    assert run("generate", spec_file, "-o", out, "--templates", templates, "--check") == 1


def test_spec_error_exits_2_with_one_line_and_no_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dtype: bf16\nhead_dim: 128\nmask: {causal: diagonal}\n")
    out = tmp_path / "gen"
    assert run("generate", bad, "-o", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashgen: error: ") and "Traceback" not in err
    assert re.search(r"bad\.yaml:3: mask\.causal: 'diagonal' is not allowed", err)
    assert not out.exists()  # nothing written


def test_invalid_spec_among_valid_ones_writes_nothing(tmp_path, templates, spec_file):
    (spec_file.parent / "z_bad.yaml").write_text("dtype: bf16\nhead_dim: 100\n")
    out = tmp_path / "gen"
    assert run("generate", spec_file.parent, "-o", out, "--templates", templates) == 2
    assert not out.exists()


def test_missing_spec_path_is_a_clean_error(tmp_path, capsys):
    assert run("generate", tmp_path / "nope.yaml", "-o", tmp_path / "gen") == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_template_error_is_reported_without_traceback(tmp_path, templates, spec_file, capsys):
    (templates / "forward" / "kernel.h.j2").write_text("{{ undefined_thing }}\n")
    assert run("generate", spec_file, "-o", tmp_path / "gen", "--templates", templates) == 1
    err = capsys.readouterr().err
    assert "rendering failed" in err and "undefined_thing" in err and "Traceback" not in err


def test_python_dash_m_generator_runs_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "generator", "--version"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 0 and proc.stdout.startswith("flashgen ")


# --------------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------------


def test_show_prints_resolved_spec_tile_smem_threads_and_name(spec_file, capsys, monkeypatch):
    import flashgen.verify as verify

    monkeypatch.setitem(sys.modules, "flashgen.verify.io_model", None)  # model unavailable
    monkeypatch.delattr(verify, "io_model", raising=False)
    assert run("show", spec_file) == 0
    out = capsys.readouterr().out
    assert out.count("fa_fwd_d64_") >= 2
    t = auto_tile(Target.SM90, Dtype.FP16, 64)
    smem = smem_bytes(t, 64, Dtype.FP16)
    assert f"{t.block_m}x{t.block_n}, {t.warps} warps, {t.stages} stages (auto)" in out
    assert f"threads:    {t.threads}" in out and f"{smem} bytes" in out
    assert "io model unavailable" in out


def test_show_uses_the_io_model_when_available(spec_file, capsys, monkeypatch):
    calls = []

    def forward_bytes(spec, **shape):
        calls.append(shape)
        return {"Q": 10, "K": 20, "V": 20, "O": 10, "LSE": 4, "total": 64}

    def standard_attention_bytes(**shape):
        calls.append(shape)
        return {"total": 640}

    fake = types.ModuleType("flashgen.verify.io_model")
    fake.forward_bytes = forward_bytes
    fake.standard_attention_bytes = standard_attention_bytes
    monkeypatch.setitem(sys.modules, "flashgen.verify.io_model", fake)
    import flashgen.verify as verify

    monkeypatch.setattr(verify, "io_model", fake, raising=False)
    assert run("show", spec_file, "--batch", 2, "--heads", 8, "--seqlen-q", 100) == 0
    out = capsys.readouterr().out
    assert calls[0] == dict(batch=2, heads=8, kv_heads=8, seqlen_q=100, seqlen_k=100)
    assert calls[1] == dict(batch=2, heads=8, seqlen_q=100, seqlen_k=100, d=64, elt=2)
    assert re.search(r"total\s+64\n", out) and re.search(r"standard\s+640 .*10.0x", out)


def test_show_with_the_real_io_model_prints_bytes(spec_file, capsys):
    pytest.importorskip("flashgen.verify.io_model")
    assert run("show", spec_file, "--seqlen-q", 1000, "--seqlen-k", 2000) == 0
    out = capsys.readouterr().out
    assert "io model failed" not in out and re.search(r"total\s+[\d,]+", out)


# --------------------------------------------------------------------------------------------
# compile (with a stand-in nvcc; the real nvcc sample is in test_generator.py)
# --------------------------------------------------------------------------------------------


def fake_nvcc(tmp_path: Path, spill: int = 0, fail: bool = False) -> Path:
    script = tmp_path / "fake-nvcc"
    script.write_text(
        textwrap.dedent(f"""\
        #!/usr/bin/env python3
        import sys
        args = sys.argv[1:]
        if args == ["--version"]:
            print("Build fake_0"); sys.exit(0)
        name = args[-1][:-3]
        if {fail}:
            sys.stderr.write(args[-1] + "(7): error: expected a ';'\\n"); sys.exit(1)
        open(args[args.index("-o") + 1], "wb").write(b"cubin")
        sys.stderr.write(
            "ptxas info    : Compiling entry function '" + name + "_kernel' for 'sm_90'\\n"
            "ptxas info    : Function properties for " + name + "_kernel\\n"
            "    {spill} bytes stack frame, {spill} bytes spill stores, "
            "{spill} bytes spill loads\\n"
            "ptxas info    : Used 96 registers, used 1 barriers\\n")
        """)
    )
    script.chmod(0o755)
    return script


def test_compile_prints_a_resource_table(tmp_path, templates, spec_file, capsys):
    nvcc = fake_nvcc(tmp_path)
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--templates", templates, "--nvcc", nvcc)
    assert rc == 0
    out = capsys.readouterr().out
    smem = smem_bytes(auto_tile(Target.SM90, Dtype.FP16, 64), 64, Dtype.FP16)
    assert re.search(rf"fa_fwd_d64_fp16_causalbr_\S+\s+sm_90\s+96\s+0\+{smem}\s+0\s+0/0\s+ok", out)


def test_compile_fails_on_spills(tmp_path, templates, spec_file, capsys):
    nvcc = fake_nvcc(tmp_path, spill=8)
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--templates", templates, "--nvcc", nvcc)
    assert rc == 1
    assert "spills (8 bytes stores" in capsys.readouterr().err


def test_compile_accepts_spills_when_the_spec_allows_them(tmp_path, templates, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("dtype: bf16\nhead_dim: 64\nallow_spills: true\n")
    nvcc = fake_nvcc(tmp_path, spill=8)
    rc = run("compile", spec, "-o", tmp_path / "b", "--templates", templates, "--nvcc", nvcc)
    assert rc == 0 and "spills (allowed)" in capsys.readouterr().out


def test_compile_failure_shows_the_nvcc_error(tmp_path, templates, spec_file, capsys):
    nvcc = fake_nvcc(tmp_path, fail=True)
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--templates", templates, "--nvcc", nvcc)
    assert rc == 1
    assert "error: expected a ';'" in capsys.readouterr().err


def test_compile_without_nvcc_is_a_clean_error(tmp_path, spec_file, capsys):
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--nvcc", tmp_path / "no-nvcc")
    assert rc == 1 and "not found" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# verify / bench dispatch
# --------------------------------------------------------------------------------------------


def test_verify_and_bench_dispatch_to_verify_gpu_cli(monkeypatch):
    seen = []
    fake = types.ModuleType("flashgen.verify.gpu_cli")
    fake.verify_main = lambda argv: seen.append(("verify", argv)) or 0
    fake.bench_main = lambda argv: seen.append(("bench", argv)) or 3
    monkeypatch.setitem(sys.modules, "flashgen.verify.gpu_cli", fake)
    import flashgen.verify as verify

    monkeypatch.setattr(verify, "gpu_cli", fake, raising=False)
    assert run("verify", "specs/", "--help") == 0
    assert run("bench", "-x") == 3
    assert seen == [("verify", ["specs/", "--help"]), ("bench", ["-x"])]


def test_verify_without_gpu_cli_says_so(monkeypatch, capsys):
    import flashgen.verify as verify

    monkeypatch.setitem(sys.modules, "flashgen.verify.gpu_cli", None)
    monkeypatch.delattr(verify, "gpu_cli", raising=False)
    assert run("verify") == 1
    assert "unavailable" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# README and CI
# --------------------------------------------------------------------------------------------


def test_readme_opens_with_the_two_first_commands():
    text = README.read_text()
    block = text[: text.index("## ")]
    assert "pip install -e . && flashgen generate specs/" in block
    assert f"pip install -e '.[dev]' && {TEST_COMMAND}" in block


def test_ci_runs_the_readme_test_command_then_check_and_compile():
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    lines = [ln.strip() for ln in ci.splitlines()]
    assert TEST_COMMAND in lines
    order = [lines.index(c) for c in (
        "python3 -m pip install -e '.[dev]'",
        TEST_COMMAND,
        "flashgen generate specs/ --check",
        "flashgen compile specs/ -j 2",
    )]  # fmt: skip
    assert order == sorted(order)


def test_readme_has_kernel_table_markers_and_placeholder_sections():
    text = README.read_text()
    assert text.index("<!-- kernels:begin -->") < text.index("<!-- kernels:end -->")
    assert "## Verification" in text and "## Performance" in text


def test_repo_files_hold_no_absolute_paths_of_this_machine():
    for rel in ("README.md", "docs/spec.md", "pyproject.toml", "noxfile.py", ".ci/run"):
        text = (REPO / rel).read_text()
        assert str(REPO) not in text, rel
