"""The `flashgen` package itself (package/__init__.py) in the install these tests run on (an
editable one in a checkout; tests/test_install.py checks the same of a wheel): its version is
the distribution's, every package pyproject.toml maps imports, from the repository root too
(where `python -m pytest` puts the checkout on sys.path), and flashgen.torch imports without
torch, failing only when one of its functions is used."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def _setuptools_config() -> dict:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_flashgen_version_is_the_distribution_s():
    import flashgen
    import flashgen.generator

    assert flashgen.__version__ == importlib.metadata.version("flashgen")
    assert flashgen.generator.__version__ == flashgen.__version__  # one version, re-exported


def test_the_version_comes_from_the_flashgen_package():
    setuptools = _setuptools_config()
    assert setuptools["dynamic"]["version"] == {"attr": "flashgen.__version__"}
    assert setuptools["package-dir"]["flashgen"] == "package"
    assert not (REPO / "flashgen").exists()  # would shadow the install from the checkout


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_every_mapped_package_imports(where, tmp_path):
    setuptools = _setuptools_config()
    packages = setuptools["packages"]
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    out[name] = list(importlib.import_module(name).__path__)\n"
        "print(json.dumps(out))\n"
    )
    cwd = REPO if where == "root" else tmp_path
    proc = subprocess.run(
        [sys.executable, "-c", code, *packages],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    paths = json.loads(proc.stdout)
    import flashgen

    if Path(flashgen.__file__).resolve() != REPO / "package" / "__init__.py":
        return  # not an editable install of this checkout: where they come from is its own
    for name, folder in setuptools["package-dir"].items():
        assert str(REPO / folder) in paths[name], (name, paths[name])


def test_flashgen_torch_imports_without_torch_and_fails_at_use():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import flashgen, flashgen.torch\n"
        "print(flashgen.__version__)\n"
        "try:\n"
        "    flashgen.torch.flash_attn_func\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    proc = _python(code, REPO)
    assert proc.returncode == 0, proc.stderr
    version, error = proc.stdout.strip().splitlines()
    assert version == importlib.metadata.version("flashgen")
    assert error.startswith("ImportError: ") and "torch" in error.lower()
