"""`flashgen` installed from a wheel (not editable) into a fresh virtualenv and run from
another directory: every command starts, none prints a traceback, and the install adds no
import name but `flashgen`.

The virtualenv is made `--without-pip` and without the outer environment's site-packages
(whose editable flashgen would quietly serve a module missing from the wheel); a .pth file
lends it the outer site-packages directories as plain paths, so the dependencies and pip are
found but no editable-install hook runs. The install tries `pip install --no-deps
--no-build-isolation --no-index` (offline) first, then `pip install --no-deps` (build
requirements from the configured index), and skips with pip's reason when both fail.

About 10 s; deselect with `--ignore=tests/test_install.py`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120
# Not needed to build the package, or outputs of a checkout: left out of the copy (as is
# every hidden entry at the root: .git, .nox, caches).
SKIP_AT_ROOT = {"build", "dist", "generated"}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pip") is None, reason="pip is not installed: cannot build a wheel"
)


@dataclass
class Installed:
    python: Path  # the virtualenv's interpreter
    flashgen: Path  # its console script
    purelib: Path  # its site-packages
    src: Path  # the copy of the repository that was installed
    cwd: Path  # an empty directory, outside both, to run commands from
    env: dict[str, str]


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(directory) == REPO:
        skip |= {n for n in names if n in SKIP_AT_ROOT or n.startswith(".")}
    return skip


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return " | ".join(lines[-3:]) or f"exit status {proc.returncode}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=_ignore)  # builds write build/ and *.egg-info here
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_RETRIES="0", PIP_TIMEOUT="15")

    venv = root / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtualenv: {_tail(made)}")
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.strip()
    )
    outer = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (purelib / "_flashgen_test_outer.pth").write_text("\n".join(outer) + "\n")

    errors = []
    for extra in (["--no-build-isolation", "--no-index"], []):
        cmd = [python, "-m", "pip", "install", "-q", "--no-deps", *extra, str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            errors.append(f"pip install {' '.join(extra)} took over {TIMEOUT} s")
            continue
        if proc.returncode == 0:
            break
        errors.append(f"pip install {' '.join(extra)}: {_tail(proc)}")
    else:
        pytest.skip("pip cannot build and install flashgen here: " + "; ".join(errors))

    cwd = root / "elsewhere"
    cwd.mkdir()
    script = bindir / ("flashgen.exe" if os.name == "nt" else "flashgen")
    return Installed(python, script, purelib, src, cwd, env)


def flashgen(inst: Installed, *args: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [inst.flashgen, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=inst.cwd,
        env=inst.env,
        timeout=TIMEOUT,
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def _python(inst: Installed, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [inst.python, "-c", code],
        capture_output=True,
        text=True,
        cwd=inst.cwd,
        env=inst.env,
        timeout=TIMEOUT,
    )


def _installed_version(inst: Installed) -> str:
    code = (
        "import importlib.metadata as m, flashgen, flashgen.generator\n"
        "print(flashgen.__version__, m.version('flashgen'), flashgen.generator.__version__)"
    )
    proc = _python(inst, code)
    assert proc.returncode == 0, proc.stderr
    version, distribution, generator = proc.stdout.split()
    assert version == distribution == generator
    return version


# --------------------------------------------------------------------------------------------
# What the wheel holds
# --------------------------------------------------------------------------------------------


def test_installed_package_adds_no_top_level_name_but_flashgen(installed):
    dist_infos = sorted(installed.purelib.glob("flashgen-*.dist-info"))
    assert len(dist_infos) == 1, dist_infos
    dist_info = dist_infos[0]
    top_level = dist_info / "top_level.txt"
    if top_level.is_file():
        assert top_level.read_text().split() == ["flashgen"]
    outside = []
    for row in (dist_info / "RECORD").read_text().splitlines():
        path = row.rsplit(",", 2)[0]
        if path.startswith("../"):  # the console script, outside site-packages
            assert Path(path).stem == "flashgen", path
            continue
        if path.split("/", 1)[0] not in ("flashgen", dist_info.name):
            outside.append(path)
    assert outside == []
    added = {p.name for p in installed.purelib.iterdir()} - {"_flashgen_test_outer.pth"}
    assert added == {"flashgen", dist_info.name}


def test_installed_metadata_has_the_licence_and_only_the_generator_s_dependencies(installed):
    (dist_info,) = installed.purelib.glob("flashgen-*.dist-info")
    metadata = (dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata
    assert any(p.name == "LICENSE" for p in dist_info.rglob("*"))
    required = [
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(required) == ["jinja2", "numpy", "pyyaml"]


def test_installed_modules_come_from_the_installed_package(installed):
    modules = [
        "flashgen",
        "flashgen.torch",
        "flashgen.generator.cli",
        "flashgen.verify.gpu_cli",
        "flashgen.verify.runner",
        "flashgen.bench.fwd_bench",
        "flashgen.tests.gpu.conftest",
    ]
    code = "import importlib as il, sys\nfor m in sys.argv[1:]: print(il.import_module(m).__file__)"
    proc = subprocess.run(
        [installed.python, "-c", code, *modules],
        capture_output=True,
        text=True,
        cwd=installed.cwd,
        env=installed.env,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    files = [Path(f) for f in proc.stdout.split()]
    assert len(files) == len(modules)
    for f in files:
        assert f.is_relative_to(installed.purelib / "flashgen"), f


# --------------------------------------------------------------------------------------------
# Every command, run from a directory that is neither the checkout nor site-packages
# --------------------------------------------------------------------------------------------


def test_installed_flashgen_prints_its_version(installed):
    proc = flashgen(installed, "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("flashgen "), proc.stderr
    assert proc.stdout.split() == ["flashgen", _installed_version(installed)]


def test_installed_flashgen_version_is_the_distribution_s_and_the_checkout_s(installed):
    import flashgen

    assert _installed_version(installed) == flashgen.__version__


def test_installed_flashgen_torch_imports_without_torch_and_fails_at_use(installed):
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import flashgen.torch\n"
        "try:\n"
        "    flashgen.torch.flash_attn_func\n"
        "except ImportError:\n"
        "    print('ImportError')\n"
    )
    proc = _python(installed, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ImportError"


def test_installed_flashgen_generates_the_shipped_specs(installed, tmp_path):
    out = tmp_path / "out"
    proc = flashgen(installed, "generate", installed.src / "specs", "-o", out, "--no-readme")
    assert proc.returncode == 0, proc.stderr
    assert (out / "manifest.json").is_file() and list(out.glob("*.cu"))
    assert "kernels in" in proc.stdout


def test_installed_flashgen_shows_a_spec(installed):
    spec = sorted((installed.src / "specs").glob("*.yaml"))[0]
    proc = flashgen(installed, "show", spec)
    assert proc.returncode == 0, proc.stderr
    assert "smem:" in proc.stdout and "entries:" in proc.stdout


def test_installed_flashgen_verify_collects_the_gpu_suite_or_says_why(installed):
    proc = flashgen(installed, "verify", "--collect-only", "-q")
    out = (proc.stdout + proc.stderr).replace(os.sep, "/")
    if proc.returncode == 0:
        assert "flashgen/tests/gpu/test_forward.py" in out  # the installed copy of the suite
        assert "ERROR" not in out and "Interrupted" not in out, out
    else:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("flashgen: error: "), out


def test_installed_flashgen_bench_prints_its_help(installed):
    proc = flashgen(installed, "bench", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: flashgen bench")


def test_installed_flashgen_bench_elsewhere_ends_with_one_error_line(installed):
    proc = flashgen(installed, "bench")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("flashgen: error: "), proc.stderr
