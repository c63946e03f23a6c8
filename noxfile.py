"""nox sessions. Plain `nox` runs lint, tests, gen_check, compile and nvcc_sweeps.

Each session installs the project (`pip install -e '.[dev]'`) into its own virtualenv, which
needs a package index. Offline, or to test what is already installed:

    nox --no-venv    every session runs in the current environment and installs nothing
                     (the environment needs `pip install -e '.[dev]'`, plus `.[gpu]` for the
                     gpu and bench sessions)
    nox -R           reuses the sessions' virtualenvs from an earlier run, installing nothing

An install that fails (no index reachable) ends the session with a message saying so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["lint", "tests", "gen_check", "compile", "nvcc_sweeps"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).resolve().parent


def _install_packages(session: nox.Session, *args: str) -> None:
    """`session.install(*args)`, except under `--no-venv` (the current environment is used as
    it is); a failed install (offline) ends the session with what to do instead."""
    if getattr(session, "venv_backend", "none") == "none":
        return
    try:
        session.install(*args)
    except CommandFailed:
        session.error(
            f"could not install {' '.join(args)} into the session's virtualenv (is a package "
            "index reachable?); offline, run `nox --no-venv` in an environment that has "
            "`pip install -e '.[dev]'`, or `nox -R` to reuse virtualenvs from an earlier run"
        )


def _install(session: nox.Session, extras: str = "dev") -> None:
    _install_packages(session, "-e", f".[{extras}]")


def _have_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check."""
    _install_packages(session, "ruff")
    session.run("ruff", "check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The no-GPU test suite (GPU tests skip themselves)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "tests", *session.posargs)


@nox.session
def gen_check(session: nox.Session) -> None:
    """Fail if generated/ or the kernel table (docs/kernels.md) differ from what specs/ produce."""
    _install(session)
    session.run("flashgen", "generate", "specs/", "--check")


@nox.session
def compile(session: nox.Session) -> None:
    """nvcc every kernel of specs/ (no GPU needed); fails on compile errors or spills."""
    _install(session)
    session.run("flashgen", "compile", "specs/", *session.posargs)


@nox.session
def nvcc_sweeps(session: nox.Session) -> None:
    """The exhaustive nvcc sweeps the tests session leaves out (no GPU needed; minutes)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "-m", "nvcc_sweep", "tests", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU suite (tests/gpu); needs a CUDA GPU and pycuda."""
    if not _have_gpu():
        session.skip("no CUDA GPU found (nvidia-smi -L lists none): skipping the GPU suite")
    if not (ROOT / "tests" / "gpu").is_dir():
        session.skip("tests/gpu does not exist yet: nothing to run")
    _install(session, "dev,gpu")
    session.run("python", "-m", "pytest", "-q", "tests/gpu", *session.posargs)


@nox.session(name="gpu-session")
def gpu_session(session: nox.Session) -> None:
    """One whole GPU session (bench/gpu_session.sh): the sharded suite, the sm_80 builds as
    PTX, compute-sanitizer, and the benchmarks; build the libraries first (`flashgen compile
    specs/` and `flashgen compile specs/ --arch sm_80`). Stages: VERIFY=..., BENCH=..."""
    if not _have_gpu():
        session.skip("no CUDA GPU found (nvidia-smi -L lists none): skipping the GPU session")
    _install(session, "dev,gpu,bench")
    session.run("bash", str(ROOT / "bench" / "gpu_session.sh"), external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (flashgen bench); needs a CUDA GPU and pycuda."""
    if not _have_gpu():
        session.skip("no CUDA GPU found (nvidia-smi -L lists none): skipping benchmarks")
    _install(session, "dev,gpu,bench")
    session.run("flashgen", "bench", *session.posargs)


@nox.session
def figures(session: nox.Session) -> None:
    """The extras' figures (block size, block sparsity, GPT-2 HBM bytes); needs a GPU, torch,
    Nsight Compute. Writes bench/results/*_h200.json and docs/*_h200.png."""
    if not _have_gpu():
        session.skip("no CUDA GPU found (nvidia-smi -L lists none): skipping the figures")
    _install(session, "dev,gpu,bench")
    session.run("flashgen", "compile", "specs/", "bench/specs/blocksize.yaml")
    session.run("bash", "bench/run_figures.sh", external=True)
