"""flashgen.torch's compiled binding without a GPU (skips without torch or a C++ compiler).

The cases (tests/torch_binding_cases.py) need the binding to define the operators, so they
run in a subprocess with FLASHGEN_TORCH_BINDING=1 and the binding's CPU registration on: the
C++ fast path serves CPU tensors described as CUDA ones, against mocked kernels, and each
call's parameter struct must equal the Python path's. The GPU side is tests/gpu/test_torch.py
run with FLASHGEN_TORCH_BINDING=1 (docs/torch.md, "The compiled binding")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One binding build for the module's subprocesses (the caller's cache if it set one)."""
    return os.environ.get("FLASHGEN_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))


@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")
def test_binding_fast_path_equals_the_python_path(cache_dir):
    env = dict(os.environ)
    env.update(
        FLASHGEN_TORCH_BINDING="1",
        FLASHGEN_TORCH_BINDING_CPU_TESTS="1",
        FLASHGEN_CACHE_DIR=cache_dir,
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(HERE / "torch_binding_cases.py")],
        env=env, capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1]


@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")
def test_binding_refuses_cpu_tensors_with_the_python_paths_message(cache_dir):
    env = dict(os.environ)
    env.pop("FLASHGEN_TORCH_BINDING_CPU_TESTS", None)
    env.update(
        FLASHGEN_TORCH_BINDING="1",
        FLASHGEN_CACHE_DIR=cache_dir,
    )
    code = (
        "import torch, pytest\n"
        "from flashgen.torch import flash_attn_func, ops\n"
        "from flashgen.torch.selection import UnsupportedCall\n"
        "assert ops.BINDING is not None\n"
        "q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)\n"
        "for grad in (False, True):\n"
        "    x = q.clone().requires_grad_(grad)\n"
        "    with pytest.raises(UnsupportedCall, match='CUDA devices only'):\n"
        "        flash_attn_func(x, x, x)\n"
        "    with pytest.raises(UnsupportedCall, match='CUDA devices only'):\n"
        "        torch.ops.flashgen.fwd.default(x, x, x, None, None, 0, 0, 0.0, 0.1, False, -1,"
        " -1, False)\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)


def test_the_default_is_auto_with_a_cuda_device_and_off_without(monkeypatch):
    import torch
    from flashgen.torch import binding

    monkeypatch.delenv(binding.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert binding.mode() == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert binding.mode() == "0"
    monkeypatch.setenv(binding.ENV, " ")  # empty after stripping: the default
    assert binding.mode() == "0"
    monkeypatch.setenv(binding.ENV, "AUTO")
    assert binding.mode() == "auto"


def test_without_a_cuda_device_the_default_keeps_the_ctypes_ops():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHGEN_TORCH_BINDING")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no device, whatever the machine has
    code = (
        "from flashgen.torch import ops; import torch; "
        "assert not torch.cuda.is_available(); "
        "assert ops.BINDING is None; "
        "assert type(ops.fwd).__name__ == 'CustomOpDef', type(ops.fwd)"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)


def test_a_bad_mode_is_refused_with_what_is_allowed(monkeypatch):
    from flashgen.torch import binding

    monkeypatch.setenv(binding.ENV, "yes")
    with pytest.raises(binding.BindingUnavailable, match="must be 0, 1 or auto"):
        binding.mode()


def test_a_bad_mode_at_import_keeps_the_ctypes_path_with_a_notice():
    env = dict(os.environ, FLASHGEN_TORCH_BINDING="yes")
    code = "from flashgen.torch import ops; assert ops.BINDING is None"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "FLASHGEN_TORCH_BINDING must be 0, 1 or auto, got 'yes'; using the ctypes path" in (
        res.stderr
    )
