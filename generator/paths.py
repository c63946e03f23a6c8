"""Where flashgen's own files are, and where its outputs go by default.

The package root holds generator/, templates/, verify/, bench/ and tests/gpu: in a checkout
that is the repository; installed, the `flashgen` package directory (pyproject.toml maps the
top-level folders under one namespace). Defaults that write (records, builds) go to the
checkout when running from one, else under the current directory, never into site-packages.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "PACKAGE_ROOT",
    "TEMPLATES_DIR",
    "build_dir",
    "checkout_root",
    "records_dir",
]

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = PACKAGE_ROOT / "templates"


def checkout_root() -> Path | None:
    """The repository when running from a checkout (editable install or PYTHONPATH)."""
    if (PACKAGE_ROOT / "pyproject.toml").is_file() and (PACKAGE_ROOT / "specs").is_dir():
        return PACKAGE_ROOT
    return None


def records_dir() -> Path:
    """Verification records: $FLASHGEN_RECORDS_DIR, else the checkout's verify/records,
    else ./flashgen-records."""
    env = os.environ.get("FLASHGEN_RECORDS_DIR")
    if env:
        return Path(env)
    root = checkout_root()
    return root / "verify" / "records" if root else Path.cwd() / "flashgen-records"


def build_dir() -> Path:
    """Compiled kernels: $FLASHGEN_BUILD_DIR, else the checkout's build/kernels, else
    ./build/kernels."""
    env = os.environ.get("FLASHGEN_BUILD_DIR")
    if env:
        return Path(env)
    root = checkout_root()
    return (root or Path.cwd()) / "build" / "kernels"
