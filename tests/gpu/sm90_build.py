"""The sm_90a unit tests' shared parts: the GPU check and the build of a test's .cu into a
shared library (tests/gpu/sm90/*.cu, against the repo's templates)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
from flashgen.generator.paths import build_dir

from .conftest import REPO


def sm90_gpu(what: str):
    """The GPU, or a skip naming `what` needs a compute capability 9.0 device."""
    from flashgen.verify.runner import Gpu

    gpu = Gpu.get()
    if gpu.device.compute_capability() != (9, 0):
        pytest.skip(f"{what} need a compute capability 9.0 GPU (H100/H200)")
    return gpu


def sm90_library(source: Path, name: str, *deps: Path) -> ctypes.CDLL:
    """`source` built for sm_90a into build_dir()/`name`.so, rebuilt when it or one of `deps`
    (headers it includes) is newer than the library."""
    out = build_dir() / f"{name}.so"
    newest = max(p.stat().st_mtime for p in (source, *deps))
    if not out.exists() or out.stat().st_mtime < newest:
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["nvcc", "-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17",
               "-gencode", "arch=compute_90a,code=sm_90a", "-I", str(REPO / "templates"),
               "-o", str(out), str(source)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(out))
