"""The `flashgen` command line, the README's promises and the CI script."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from flashgen.generator.cli import main
from flashgen.generator.compile import LIB_SUFFIX, retarget
from flashgen.generator.families.forward import smem_bytes
from flashgen.generator.load import load_paths
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import Dtype, Target
from flashgen.generator.tiles import auto_tile

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TEST_COMMAND = "python -m pytest -q tests"
SWEEP_COMMAND = "python -m pytest -q -m nvcc_sweep tests"  # .ci/run's step after it


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


@pytest.fixture
def gqa_spec(tmp_path: Path) -> Path:
    p = tmp_path / "gqa.yaml"
    p.write_text("dtype: bf16\nhead_dim: 64\ngqa: true\nmask: {window: true}\n")
    return p


# 2 * 8 * 3 * 2 * 2 * 2 * 2 = 768 kernels: over the default --max-kernels (512).
FAMILY_768 = textwrap.dedent("""\
    dtype: [fp16, bf16]
    head_dim: [16, 32, 48, 64, 80, 96, 112, 128]
    mask: {causal: [none, top_left, bottom_right], window: [false, true], varlen: [false, true]}
    gqa: [false, true]
    dropout: [false, true]
    """)

# m128n128w8s2 at d=128 bf16 needs 174080 bytes of shared memory: sm_90 has 232448 per block,
# sm_86 only 101376.
BIG_TILE_SPEC = (
    "dtype: bf16\nhead_dim: 128\ntile: {block_m: 128, block_n: 128, warps: 8, stages: 2}\n"
)


def run(*argv: object) -> int:
    return main([str(a) for a in argv])


def one_error_line(err: str) -> str:
    """The single `flashgen: error: ...` line that `err` must be."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashgen: error: "), err
    return lines[0]


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def read_only(monkeypatch):
    """Make a directory read-only (restored afterwards). Where chmod 555 does not stop writes
    (running as root, as CI does), the directory is read-only to flashgen instead: os.access
    says so and the writer's staging gets EACCES there, which is what a read-only directory
    gives a normal user, so these tests run everywhere."""
    import flashgen.generator.writer as writer

    made: list[Path] = []
    simulated: set[Path] = set()

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o555)
        made.append(path)
        probe = path / ".probe"
        try:
            probe.write_text("x")
        except OSError:
            return path
        probe.unlink()
        simulated.add(path.resolve())
        return path

    real_access, real_stage = os.access, writer._stage

    def access(p, mode, *args, **kwargs):
        if mode & os.W_OK and Path(p).resolve() in simulated:
            return False
        return real_access(p, mode, *args, **kwargs)

    def stage(path, *args):
        if path.parent.resolve() in simulated:
            raise PermissionError(13, "Permission denied", str(path))
        return real_stage(path, *args)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(writer, "_stage", stage)
    yield make
    for path in made:
        path.chmod(0o755)


def fake_io_model(monkeypatch) -> list[dict]:
    """Replace verify.io_model with one that records the shapes `show` passes it."""
    calls: list[dict] = []

    def forward_bytes(spec, **shape):
        calls.append(shape)
        return {"Q": 10, "total": 10}

    fake = types.ModuleType("flashgen.verify.io_model")
    fake.forward_bytes = forward_bytes
    fake.standard_attention_bytes = lambda **shape: {"total": 100}
    monkeypatch.setitem(sys.modules, "flashgen.verify.io_model", fake)
    import flashgen.verify as verify

    monkeypatch.setattr(verify, "io_model", fake, raising=False)
    return calls


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


def test_generate_into_an_existing_file_is_a_clean_error(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "out.txt"
    out.write_text("keep me\n")
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"-o {out}: exists and is not a directory" in line
    assert out.read_text() == "keep me\n"


def test_generate_check_with_an_existing_file_as_output_is_a_clean_error(
    tmp_path, templates, spec_file, capsys
):
    out = tmp_path / "out.txt"
    out.write_text("keep me\n")
    assert run("generate", spec_file, "-o", out, "--templates", templates, "--check") == 2
    assert "not a directory" in one_error_line(capsys.readouterr().err)


def test_generate_into_a_read_only_directory_is_a_clean_error(
    tmp_path, templates, spec_file, capsys, read_only
):
    out = read_only(tmp_path / "gen")
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write into {out}: directory is not writable" in line
    assert list(out.iterdir()) == []


def test_generate_below_a_read_only_directory_is_a_clean_error(
    tmp_path, templates, spec_file, capsys, read_only
):
    parent = read_only(tmp_path / "ro")
    out = parent / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(out) in line and f"{parent} is not writable" in line
    assert not out.exists()


def test_generate_into_a_read_only_directory_that_is_up_to_date_succeeds(
    tmp_path, templates, spec_file, capsys, read_only
):
    out = tmp_path / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 0
    read_only(out / "include" / "flashgen")
    read_only(out)
    capsys.readouterr()
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 0
    assert "0 file(s) written" in capsys.readouterr().out


def test_generate_with_a_read_only_subdirectory_writes_nothing(
    tmp_path, templates, spec_file, capsys, read_only
):
    out = tmp_path / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 0
    before = files_under(out)
    kernel_template = templates / "forward" / "kernel.cu.j2"
    kernel_template.write_text(kernel_template.read_text() + "// v2\n")  # every .cu changes
    (templates / "include" / "flashgen" / "params.h").write_text("// params v2\n")
    include_dir = read_only(out / "include" / "flashgen")
    capsys.readouterr()
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write into {include_dir}: directory is not writable" in line
    assert files_under(out) == before  # no kernel written before the failing header


def test_generate_refuses_a_family_over_512_kernels_by_default(tmp_path, templates, capsys):
    family = tmp_path / "family.yaml"
    family.write_text(FAMILY_768)
    out = tmp_path / "gen"
    assert run("generate", family, "-o", out, "--templates", templates) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{family} declares 768 kernels, more than --max-kernels 512" in line
    assert "pass --max-kernels 768" in line
    assert not out.exists()


def test_generate_max_kernels_sets_the_cap(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates, "--max-kernels", 1) == 2
    assert "declares 2 kernels, more than --max-kernels 1" in capsys.readouterr().err
    assert not out.exists()
    assert run("generate", spec_file, "-o", out, "--templates", templates, "--max-kernels", 2) == 0


# 2 * 16 * 3 * 2 * 2 * 2 * 2 * 2 * 4 * (2 * 4 * 2 * 3) = 589,824 valid kernels.
FAMILY_589824 = textwrap.dedent("""\
    dtype: [fp16, bf16]
    head_dim: [16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    mask: {causal: [none, top_left, bottom_right], window: [false, true], varlen: [false, true]}
    gqa: [false, true]
    dropout: [false, true]
    instrument_io: [false, true]
    target: [sm_80, sm_86, sm_89, sm_90]
    tile: {block_m: [64, 128], block_n: [32, 64, 96, 128], warps: [4, 8], stages: [1, 2, 3]}
    """)


@pytest.mark.parametrize("command", ["generate", "compile"])
def test_a_huge_family_is_refused_before_it_is_expanded(tmp_path, templates, capsys, command):
    family = tmp_path / "family.yaml"
    family.write_text(FAMILY_589824)
    out = tmp_path / "gen"
    start = time.perf_counter()
    assert run(command, family, "-o", out, "--templates", templates) == 2
    assert time.perf_counter() - start < 1.0
    line = one_error_line(capsys.readouterr().err)
    assert f"{family} declares 589824 kernels, more than --max-kernels 512" in line
    assert "pass --max-kernels 589824" in line and not out.exists()


def test_a_tile_of_aliased_lists_is_counted_not_expanded(tmp_path, templates, capsys):
    family = tmp_path / "family.yaml"
    values = ", ".join(map(str, range(1, 1001)))
    family.write_text(
        f"dtype: bf16\nhead_dim: 64\n"
        f"tile: {{block_m: &n [{values}], block_n: *n, warps: *n, stages: *n}}\n"
    )
    start = time.perf_counter()
    assert run("generate", family, "-o", tmp_path / "gen", "--templates", templates) == 2
    assert time.perf_counter() - start < 1.0
    assert "declares 1000000000000 kernels" in one_error_line(capsys.readouterr().err)


def test_the_kernel_cap_counts_across_files(tmp_path, templates, spec_file, capsys):
    other = spec_file.parent / "u.yaml"
    other.write_text("dtype: bf16\nhead_dim: [32, 64, 128]\n")
    args = ("generate", spec_file.parent, "-o", tmp_path / "gen", "--templates", templates)
    assert run(*args, "--max-kernels", 4) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "(3), " in line and "(2) declare 5 kernels, more than --max-kernels 4" in line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("head_dim: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
        ("- dtype: bf16\n", "top level must be a mapping"),
        ("bf16\n", "top level must be a mapping"),
        ("dtype: bf16\n---\ndtype: fp16\n", "invalid YAML"),
        ("dtype: !!python/object:os.system {}\n", "invalid YAML"),
        ("dtype: bf16\x00\n", "invalid YAML"),
        (b"\xff\xfe\x00d", "is not UTF-8 text"),
        ("#" * (4 * 1024 * 1024 + 1), "is larger than 4 MiB"),
    ],
    ids=["deep", "list", "scalar", "two-docs", "python-tag", "nul", "binary", "huge"],
)
def test_a_hostile_spec_file_is_one_error_line(tmp_path, capsys, text, message):
    spec = tmp_path / "hostile.yaml"
    if isinstance(text, bytes):
        spec.write_bytes(text)
    else:
        spec.write_text(text)
    assert run("generate", spec, "-o", tmp_path / "gen") == 2
    line = one_error_line(capsys.readouterr().err)
    assert message in line and "hostile.yaml" in line
    assert not (tmp_path / "gen").exists()


def test_a_mapping_over_the_key_cap_is_refused(tmp_path, capsys, monkeypatch):
    import flashgen.generator.load as load

    monkeypatch.setattr(load, "MAX_MAPPING_KEYS", 3)
    spec = tmp_path / "merge.yaml"
    spec.write_text(
        "defaults: &d {dtype: bf16, head_dim: 64, gqa: false}\n"
        "kernels:\n  - {<<: *d, dropout: true}\n"
    )
    assert run("generate", spec, "-o", tmp_path / "gen") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "merge.yaml:3: a mapping of 4 keys" in line and "more than the 3" in line


def test_an_unreadable_spec_directory_is_one_error_line(tmp_path, capsys, monkeypatch):
    specs = tmp_path / "specs"
    specs.mkdir()
    real_iterdir = Path.iterdir

    def iterdir(self):
        if self == specs:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)  # chmod 000 does not stop root
    assert run("generate", specs, "-o", tmp_path / "gen") == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{specs}: cannot read directory: Permission denied" in line


def test_a_fifo_named_like_a_spec_is_refused_without_reading_it(tmp_path, capsys):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    assert run("generate", fifo, "-o", tmp_path / "gen") == 2
    assert "is not a regular file or a directory" in one_error_line(capsys.readouterr().err)


def test_an_unreadable_output_folder_is_one_error_line(
    tmp_path, templates, spec_file, capsys, monkeypatch
):
    import flashgen.generator.writer as writer

    out = tmp_path / "gen"
    out.mkdir()

    def plan_generate(*args, **kwargs):  # what iterdir() of a folder without r/x raises
        raise PermissionError(13, "Permission denied", str(out))

    monkeypatch.setattr(writer, "plan_generate", plan_generate)
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 1
    assert one_error_line(capsys.readouterr().err) == f"flashgen: error: {out}: Permission denied"


def test_an_interrupt_while_staging_leaves_the_folder_as_it_was(
    tmp_path, templates, spec_file, capsys, monkeypatch
):
    import flashgen.generator.writer as writer

    out = tmp_path / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 0
    before = files_under(out)
    (templates / "forward" / "kernel.cu.j2").write_text("// {{ banner | join('') }} v2\n")
    (templates / "include" / "flashgen" / "extra.h").write_text("// new header\n")
    real_stage, calls = writer._stage, []

    def stage(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_stage(*args)

    monkeypatch.setattr(writer, "_stage", stage)
    capsys.readouterr()
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 130
    assert one_error_line(capsys.readouterr().err) == "flashgen: error: interrupted"
    assert files_under(out) == before  # no temp file, no half-written kernel


def test_an_interrupt_while_committing_waits_until_the_folder_is_complete(
    tmp_path, templates, spec_file, monkeypatch
):
    import flashgen.generator.writer as writer
    from flashgen.generator.load import load_paths

    class Stop(Exception):
        pass

    def on_term(signum, frame):
        raise Stop

    real_replace, sent = os.replace, []

    def replace(src, dst):
        if not sent:
            sent.append(dst)
            os.kill(os.getpid(), signal.SIGTERM)  # held back until the commit is done
        return real_replace(src, dst)

    out = tmp_path / "gen"
    plan = writer.plan_generate(load_paths([spec_file]), out, templates_dir=templates)
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        monkeypatch.setattr(writer.os, "replace", replace)
        with pytest.raises(Stop):
            writer.apply_plan(plan)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert sent
    assert files_under(out) == {p: plan.writes[p] for p in sorted(plan.writes)}


def test_a_stale_temp_file_of_a_killed_run_is_removed_by_the_next(
    tmp_path, templates, spec_file, capsys
):
    out = tmp_path / "gen"
    assert run("generate", spec_file, "-o", out, "--templates", templates) == 0
    stale = out / "include" / "flashgen" / ".params.h.0a1b2c3d.flashgen-tmp"
    stale.write_text("half a header")
    args = ("generate", spec_file, "-o", out, "--templates", templates)
    assert run(*args, "--check") == 1
    assert "stale file (would be removed)" in capsys.readouterr().out
    assert run(*args) == 0 and not stale.exists()


def test_generate_waits_for_the_lock_on_its_output_folder(tmp_path, templates, spec_file):
    from flashgen.generator.writer import output_lock

    out = tmp_path / "gen"
    out.mkdir()
    cmd = [sys.executable, "-m", "flashgen.generator", "generate", str(spec_file), "-o", str(out)]
    cmd += ["--templates", str(templates)]
    with output_lock(out):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stderr.readline()  # blocks until it reports that it waits
            assert "waiting for another flashgen generate writing into" in line
            assert proc.poll() is None and not (out / "manifest.json").exists()
        except BaseException:
            proc.kill()
            raise
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "2 kernels in" in stdout


def test_two_generate_runs_into_one_folder_leave_it_consistent(tmp_path, templates):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "a.yaml").write_text("dtype: [fp16, bf16]\nhead_dim: [32, 64, 96, 128]\n")
    (specs / "b.yaml").write_text("dtype: [fp16, bf16]\nhead_dim: [16, 48, 80, 112]\n")
    out = tmp_path / "gen"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "flashgen.generator", "generate", str(specs / f), "-o", str(out)]
            + ["--templates", str(templates)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for f in ("a.yaml", "b.yaml")
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
    manifest = json.loads((out / "manifest.json").read_text())
    names = {e["name"] for e in manifest["kernels"]}
    assert len(names) == 16
    assert names == {p.stem for p in out.glob("*.cu")} == {p.stem for p in out.glob("*.h")}
    assert not [p for p in out.rglob("*") if p.name.endswith(".flashgen-tmp")]


def test_generate_check_hint_repeats_output_templates_and_no_readme(
    tmp_path, templates, spec_file, capsys
):
    out = tmp_path / "gen dir"  # a space: the hint must quote it
    opts = ("-o", out, "--templates", templates, "--no-readme")
    assert run("generate", spec_file, *opts) == 0
    sorted(out.glob("*.cu"))[0].write_text("stale\n")
    capsys.readouterr()
    assert run("generate", spec_file, *opts, "--check") == 1
    hint = one_error_line(capsys.readouterr().err).split("; run: ", 1)[1]
    argv = shlex.split(hint)
    assert argv == ["flashgen", "generate", str(spec_file), *map(str, opts)]
    assert run(*argv[1:]) == 0  # the hint fixes what --check found
    assert run(*argv[1:], "--check") == 0


def test_generate_check_hint_repeats_readme(tmp_path, templates, spec_file, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- kernels:begin -->\n<!-- kernels:end -->\n")
    opts = ("-o", tmp_path / "gen", "--templates", templates, "--readme", readme)
    assert run("generate", spec_file, *opts) == 0
    readme.write_text(readme.read_text().replace("| `fa_fwd", "| `stale", 1))
    capsys.readouterr()
    assert run("generate", spec_file, *opts, "--check") == 1
    argv = shlex.split(one_error_line(capsys.readouterr().err).split("; run: ", 1)[1])
    assert argv[argv.index("--readme") + 1] == str(readme)
    assert run(*argv[1:]) == 0 and run(*argv[1:], "--check") == 0


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


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("--seqlen-q", "-5", "an integer >= 0"),
        ("--seqlen-k", "-1", "an integer >= 0"),
        ("--heads", "0", "an integer >= 1"),
        ("--batch", "0", "an integer >= 1"),
        ("--batch", "-2", "an integer >= 1"),
        ("--kv-heads", "0", "an integer >= 1"),
        ("--window-left", "-2", "an integer >= 0, or -1 for unbounded"),
        ("--window-right", "-7", "an integer >= 0, or -1 for unbounded"),
    ],
)
def test_show_rejects_an_out_of_range_shape_option(spec_file, capsys, option, value, allowed):
    with pytest.raises(SystemExit) as exc:
        run("show", spec_file, option, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"flashgen show: error: argument {option}: must be {allowed}, got {value}" in err
    assert "Traceback" not in err


def test_show_rejects_kv_heads_for_a_spec_without_gqa(spec_file, capsys):
    with pytest.raises(SystemExit) as exc:
        run("show", spec_file, "--kv-heads", 4)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --kv-heads: " in err and "has gqa: false" in err
    assert "--kv-heads must equal --heads (16), got 4" in err


def test_show_rejects_kv_heads_that_do_not_divide_heads(gqa_spec, capsys):
    with pytest.raises(SystemExit) as exc:
        run("show", gqa_spec, "--heads", 12, "--kv-heads", 5)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-heads: must divide --heads 12 (allowed: 1, 2, 3, 4, 6, 12), got 5" in err


def test_show_accepts_grouped_kv_heads_and_an_unbounded_window(gqa_spec, monkeypatch):
    calls = fake_io_model(monkeypatch)
    assert run("show", gqa_spec, "--kv-heads", 4, "--window-left", -1, "--window-right", 0) == 0
    assert calls[0]["kv_heads"] == 4 and calls[0]["window"] == (-1, 0)


def test_show_passes_seqlen_k_zero_to_the_io_model(spec_file, monkeypatch):
    calls = fake_io_model(monkeypatch)
    assert run("show", spec_file, "--seqlen-q", 100, "--seqlen-k", 0) == 0
    assert calls[0]["seqlen_q"] == 100 and calls[0]["seqlen_k"] == 0


DECODE_SPEC = "kernel: decode\ndtype: bf16\nhead_dim: 128\ngqa: true\n"


def test_show_defaults_to_one_new_query_over_a_4k_cache_for_decode(tmp_path, capsys):
    spec = tmp_path / "decode.yaml"
    spec.write_text(DECODE_SPEC)
    assert run("show", spec) == 0
    out = capsys.readouterr().out
    assert "seqlen_q=1, seqlen_k=4096" in out and "io model failed" not in out


def test_show_defaults_to_a_4k_square_call_for_forward(spec_file, monkeypatch):
    calls = fake_io_model(monkeypatch)
    assert run("show", spec_file) == 0
    assert calls[0]["seqlen_q"] == calls[0]["seqlen_k"] == 4096


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


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_compile_rejects_jobs_below_one(spec_file, capsys, jobs):
    with pytest.raises(SystemExit) as exc:
        run("compile", spec_file, "-j", jobs)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"argument -j/--jobs: must be an integer >= 1, got {jobs if jobs != 'two' else repr(jobs)}"
        in err
    )
    assert "Traceback" not in err


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


def test_compile_accept_spills_reports_them_and_exits_0(tmp_path, templates, spec_file, capsys):
    nvcc = fake_nvcc(tmp_path, spill=8)
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--templates", templates, "--nvcc", nvcc,
             "--accept-spills")  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0 and "spills (accepted)" in captured.out and "spills (8" not in captured.err


def test_compile_failure_shows_the_nvcc_error(tmp_path, templates, spec_file, capsys):
    nvcc = fake_nvcc(tmp_path, fail=True)
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--templates", templates, "--nvcc", nvcc)
    assert rc == 1
    assert "error: expected a ';'" in capsys.readouterr().err


def test_compile_without_nvcc_is_a_clean_error(tmp_path, spec_file, capsys):
    rc = run("compile", spec_file, "-o", tmp_path / "b", "--nvcc", tmp_path / "no-nvcc")
    assert rc == 1 and "not found" in capsys.readouterr().err


def test_compile_into_an_existing_file_is_a_clean_error(tmp_path, templates, spec_file, capsys):
    out = tmp_path / "kernels"
    out.write_text("keep me\n")
    nvcc = fake_nvcc(tmp_path)
    rc = run("compile", spec_file, "-o", out, "--templates", templates, "--nvcc", nvcc)
    assert rc == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"-o {out}: exists and is not a directory" in line
    assert out.read_text() == "keep me\n"


def test_compile_refuses_a_family_over_512_kernels_by_default(tmp_path, templates, capsys):
    family = tmp_path / "family.yaml"
    family.write_text(FAMILY_768)
    out = tmp_path / "b"
    nvcc = fake_nvcc(tmp_path)
    assert run("compile", family, "-o", out, "--templates", templates, "--nvcc", nvcc) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{family} declares 768 kernels, more than --max-kernels 512" in line
    assert "pass --max-kernels 768" in line
    assert not out.exists()


def test_compile_arch_sm86_refuses_a_tile_over_its_shared_memory(tmp_path, templates, capsys):
    spec = tmp_path / "big.yaml"
    spec.write_text(BIG_TILE_SPEC)
    out = tmp_path / "b"
    nvcc = fake_nvcc(tmp_path)
    rc = run(
        "compile", spec, "--arch", "sm_86", "-o", out, "--templates", templates, "--nvcc", nvcc
    )
    assert rc == 2
    line = one_error_line(capsys.readouterr().err)
    assert "big.yaml" in line and "cannot build for sm_86" in line and "101376" in line
    assert not out.exists()


def test_compile_arch_refusal_comes_before_looking_for_nvcc(tmp_path, capsys):
    spec = tmp_path / "big.yaml"
    spec.write_text(BIG_TILE_SPEC)
    rc = run("compile", spec, "--arch", "sm_86", "-o", tmp_path / "b", "--nvcc", tmp_path / "no")
    assert rc == 2
    assert "cannot build for sm_86" in one_error_line(capsys.readouterr().err)


def test_compile_arch_says_what_it_left_out_and_refuses_an_empty_build(tmp_path, capsys):
    spec = tmp_path / "hopper.yaml"
    spec.write_text("dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n")
    out = tmp_path / "b"
    rc = run("compile", spec, "--arch", "sm_80", "-o", out, "--nvcc", tmp_path / "no")
    assert rc == 2
    err = capsys.readouterr().err
    assert "left out 1 kernel(s) of an architecture-specific target" in err
    assert "nothing to build for sm_80" in err
    assert not out.exists()


def test_compile_arch_writes_nothing_named_after_the_original_kernel(
    tmp_path, templates, spec_file, capsys
):
    out = tmp_path / "b"
    nvcc = fake_nvcc(tmp_path)
    opts = ("-o", out, "--templates", templates, "--nvcc", nvcc)
    rc = run("compile", spec_file, "--arch", "sm_86", *opts)
    assert rc == 0, capsys.readouterr().err
    specs = load_paths([spec_file])
    original = [kernel_name(s, templates) for s in specs]
    retargeted = [kernel_name(s, templates) for s in retarget(specs, Target.SM86)]
    assert set(original).isdisjoint(retargeted)
    written = [p.name for p in out.rglob("*") if p.is_file()]
    assert not [f for f in written for name in original if name in f]
    assert not [f for f in written if "_sm90_" in f]
    assert {f"{name}{LIB_SUFFIX}" for name in retargeted} <= set(written)


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


def test_verify_without_a_gpu_verifies_nothing_and_exits_1(monkeypatch, capsys):
    import flashgen.verify.runner as runner
    import pytest as pytest_module

    monkeypatch.setattr(runner, "gpu_available", lambda: (False, "cuInit failed: no device"))
    monkeypatch.setattr(pytest_module, "main", lambda *a, **k: pytest.fail("pytest ran"))
    assert run("verify") == 1
    line = one_error_line(capsys.readouterr().err)
    assert "nothing was verified" in line and "cuInit failed: no device" in line


def test_verify_exits_1_when_every_gpu_test_skipped(monkeypatch, capsys):
    import flashgen.verify.runner as runner
    import pytest as pytest_module

    def fake_main(args, plugins=()):
        report = types.SimpleNamespace(
            when="setup",
            passed=False,
            failed=False,
            skipped=True,
            longrepr=("t.py", 1, "Skipped: kernel not built"),
        )
        for plugin in plugins:
            plugin.pytest_runtest_logreport(report)
        return 0

    monkeypatch.setattr(runner, "gpu_available", lambda: (True, "Fake GPU"))
    monkeypatch.setattr(pytest_module, "main", fake_main)
    assert run("verify", "-k", "nothing") == 1
    line = one_error_line(capsys.readouterr().err)
    assert "nothing was verified: no GPU test ran (1 skipped: kernel not built)" in line


def test_verify_help_is_its_own_short_help(capsys):
    assert run("verify", "--help") == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashgen verify")
    assert "--pytest-help" in out and len(out.splitlines()) < 40


def test_top_level_help_says_what_each_command_builds(capsys):
    with pytest.raises(SystemExit) as exc:
        run("--help")
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "host library <name>.so" in out and "cubin" not in out
    assert "verify --help" in out and "needs a GPU" in out


def test_version_is_the_cli_s_and_the_package_metadata_s(capsys):
    import importlib.metadata

    import flashgen

    with pytest.raises(SystemExit) as exc:
        run("--version")
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashgen {flashgen.__version__}"
    assert importlib.metadata.version("flashgen") == flashgen.__version__


def test_the_generator_commands_import_neither_pytest_nor_hypothesis():
    code = (
        "import sys\n"
        "from flashgen.generator.cli import main\n"
        "import flashgen.verify.gpu_cli, flashgen.verify.io_model\n"
        "main(['show', 'specs/fwd_dense.yaml'])\n"
        "print(sorted(m for m in ('pytest', 'hypothesis') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_pytest_and_hypothesis_are_extras_not_dependencies():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(project["dependencies"]) == ["jinja2", "numpy", "pyyaml"]
    extras = project["optional-dependencies"]
    assert {"pytest", "hypothesis"} <= set(extras["test"]) <= set(extras["dev"])
    assert project["license"] == "Apache-2.0" and (REPO / "LICENSE").is_file()
    assert "Apache License" in (REPO / "LICENSE").read_text()


def run_cli_elsewhere(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m flashgen.generator ARGV` from a directory outside the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "flashgen.generator", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )


def test_verify_collects_the_gpu_suite_from_another_directory(tmp_path):
    proc = run_cli_elsewhere(tmp_path, "verify", "--collect-only", "-q")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "ERROR" not in out
    assert "test_forward.py" in out


def test_bench_help_works_from_another_directory(tmp_path):
    proc = run_cli_elsewhere(tmp_path, "bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: flashgen bench")


def test_bench_help_runs_the_real_benchmark_parser(capsys):
    assert run("bench", "--help") == 0
    assert capsys.readouterr().out.startswith("usage: flashgen bench")


def test_bench_without_pycuda_names_it_and_the_gpu_extra(spec_file, monkeypatch, capsys):
    import flashgen.verify.runner as runner

    def load_kernel(spec, lib_dir=None):  # where the runner first needs PyCUDA
        import pycuda.driver  # noqa: F401

    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    monkeypatch.setattr(runner, "load_kernel", load_kernel)
    assert run("bench", "--specs", spec_file) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "needs pycuda" in line and "pip install '.[gpu]' (from a flashgen checkout)" in line


def test_bench_without_torch_names_it_and_the_gpu_extra(spec_file, monkeypatch, capsys):
    import flashgen.verify.runner as runner

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(runner, "load_kernel", lambda spec, lib_dir=None: types.SimpleNamespace())
    assert run("bench", "--specs", spec_file, "--seqlens", 512) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "needs torch" in line and "pip install '.[gpu,torch]' (from a flashgen checkout)" in line


def test_install_hints_say_to_install_from_a_checkout_not_from_an_index():
    # flashgen is on no package index: `pip install 'flashgen[gpu]'` would fail
    for folder in ("generator", "runtime", "verify", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            assert "flashgen[" not in path.read_text(), path


def test_bench_with_a_missing_spec_is_one_error_line(tmp_path, capsys):
    assert run("bench", "--specs", tmp_path / "nope.yaml") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "nope.yaml: no such file or directory" in line


def test_bench_with_an_invalid_spec_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dtype: bf16\nhead_dim: 100\n")
    assert run("bench", "--specs", bad) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "bad.yaml:2: head_dim: 100 is not allowed" in line


def test_bench_from_another_directory_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default --specs is relative to the cwd
    assert run("bench") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no such file or directory" in line and "pass --specs" in line


def test_bench_without_compiled_kernels_is_one_error_line(tmp_path, spec_file, monkeypatch, capsys):
    monkeypatch.setenv("FLASHGEN_BUILD_DIR", str(tmp_path / "libs"))
    assert run("bench", "--specs", spec_file) == 1
    line = one_error_line(capsys.readouterr().err)
    assert str(tmp_path / "libs") in line and "flashgen compile" in line


# --------------------------------------------------------------------------------------------
# README and CI
# --------------------------------------------------------------------------------------------


def test_readme_opens_with_the_two_first_commands():
    text = README.read_text()
    block = text[: text.index("## ")]
    assert "pip install -e . && flashgen generate specs/" in block
    assert f"pip install -e '.[dev]' && {TEST_COMMAND}" in block


def test_ci_runs_the_readme_test_command_then_check_compile_and_the_sweeps():
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    lines = [ln.strip() for ln in ci.splitlines()]
    assert TEST_COMMAND in lines
    order = [lines.index(c) for c in (
        "python3 -m pip install -e '.[dev]'",
        TEST_COMMAND,
        "flashgen generate specs/ --check",
        "flashgen compile specs/ -j 2",
        SWEEP_COMMAND,
    )]  # fmt: skip
    assert order == sorted(order)


def _collected(*args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
    return [ln for ln in proc.stdout.splitlines() if "::" in ln]


def test_the_nvcc_sweeps_are_left_out_of_the_test_command_and_run_with_their_marker():
    sweeps = ["tests/test_sm90a_tiles_nvcc.py", "tests/test_auto_tiles_nvcc.py"]
    default = _collected(*sweeps)  # the test command's selection: pyproject's addopts
    selected = _collected("-m", "nvcc_sweep", *sweeps)  # a -m of one's own replaces it
    assert not any("test_sm90a_tiles_nvcc.py" in t for t in default)
    assert not any("compiles_without_spills" in t or "known_spills" in t for t in default)
    assert any("test_auto_tile_is_legal_for_every_head_dim" in t for t in default)  # fast
    assert sum("test_sm90a_tiles_nvcc.py" in t for t in selected) >= 16
    assert sum("test_auto_tile_compiles_without_spills" in t for t in selected) >= 16
    assert set(default).isdisjoint(selected)


def test_kernel_table_doc_has_markers_and_readme_its_sections():
    table = (REPO / "docs" / "kernels.md").read_text()
    assert table.index("<!-- kernels:begin -->") < table.index("<!-- kernels:end -->")
    text = README.read_text()
    assert "## Verification" in text and "## Performance" in text
    assert "<!-- kernels:begin -->" not in text  # the table lives in docs/kernels.md


def test_readme_is_short_and_has_a_five_line_quickstart():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    quick = text.split("## Quickstart", 1)[1].split("```", 2)[1].strip().splitlines()
    assert len(quick) == 5
    assert [ln.split()[:2] for ln in quick[1:4]] == [
        ["flashgen", "show"],
        ["flashgen", "generate"],
        ["flashgen", "compile"],
    ]
    # it says how to run the nvcc sweeps the test command leaves out, and where they build
    assert SWEEP_COMMAND in text and "take a while" in text
    assert "temporary folder" in text and "FLASHGEN_BUILD_DIR" in text
    assert "pip install 'flashgen" not in text  # not on an index: install from a checkout


def test_generate_into_the_repo_s_generated_rewrites_docs_kernels_md(monkeypatch):
    from flashgen.generator.cli import _default_readme

    assert _default_readme(REPO / "generated") == REPO / "docs" / "kernels.md"
    assert _default_readme(REPO / "elsewhere") is None


_NOXFILE: list[types.ModuleType] = []


def load_noxfile() -> types.ModuleType:
    """noxfile.py as a module, loaded once (loading registers its sessions with nox)."""
    pytest.importorskip("nox")
    if not _NOXFILE:
        spec = importlib.util.spec_from_file_location("flashgen_noxfile", REPO / "noxfile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _NOXFILE.append(module)
    return _NOXFILE[0]


class FakeNoxSession:
    """What the noxfile's sessions call on a nox.Session, recorded."""

    posargs: list[str] = []

    def __init__(self, venv_backend: str = "virtualenv", install_fails: bool = False) -> None:
        self.venv_backend = venv_backend
        self.install_fails = install_fails
        self.installed: list[tuple[str, ...]] = []
        self.ran: list[tuple[str, ...]] = []

    def install(self, *args: str) -> None:
        from nox.command import CommandFailed

        self.installed.append(args)
        if self.install_fails:
            raise CommandFailed("pip: no index")

    def run(self, *args: str, **kwargs: object) -> None:
        self.ran.append(args)

    def error(self, msg: str) -> None:
        raise RuntimeError(msg)  # nox.Session.error raises too

    def skip(self, msg: str) -> None:
        pytest.fail(f"unexpected skip: {msg}")


NOX_DEFAULT = ["lint", "tests", "gen_check", "compile", "nvcc_sweeps"]


def test_nox_default_sessions_are_lint_tests_gen_check_compile_nvcc_sweeps():
    import nox

    load_noxfile()
    assert nox.options.sessions == NOX_DEFAULT


def test_nox_nvcc_sweeps_session_runs_ci_s_sweep_command():
    session = FakeNoxSession(venv_backend="none")
    load_noxfile().nvcc_sweeps(session)
    assert session.ran == [tuple(SWEEP_COMMAND.split())]


@pytest.mark.parametrize("name", NOX_DEFAULT)
def test_nox_no_venv_sessions_install_nothing(name):
    session = FakeNoxSession(venv_backend="none")
    getattr(load_noxfile(), name)(session)
    assert session.installed == [] and session.ran


@pytest.mark.parametrize("name", NOX_DEFAULT)
def test_nox_failed_install_says_how_to_run_offline(name):
    session = FakeNoxSession(install_fails=True)
    with pytest.raises(RuntimeError, match=r"nox --no-venv"):
        getattr(load_noxfile(), name)(session)
    assert session.ran == []


def test_noxfile_says_no_venv_runs_in_the_current_environment():
    doc = load_noxfile().__doc__
    assert "nox --no-venv" in doc and "current environment" in doc and "Offline" in doc


def test_repo_files_hold_no_absolute_paths_of_this_machine():
    for rel in ("README.md", "docs/spec.md", "pyproject.toml", "noxfile.py", ".ci/run"):
        text = (REPO / rel).read_text()
        assert str(REPO) not in text, rel
