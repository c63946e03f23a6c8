"""Where a kernel's host library comes from: shipped builds first, then a per-user cache that
is filled on first use. Imports no torch.

Lookup order for the library `<name>.so` of a spec (the name is the kernel's identity: it
hashes the spec, the generator version and the template sources, so it is the cache key):

1. the build directory (`$FLASHGEN_BUILD_DIR`, else the checkout's `build/kernels`: what
   `flashgen compile` writes, `generator.paths.build_dir()`);
2. the cache directory (`$FLASHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/flashgen/<version>`,
   else `~/.cache/flashgen/<version>`);
3. neither: the generator renders and compiles it (`generator.compile.compile_specs`) into
   the cache, printing one line on stderr.

Concurrent processes are safe: the compile runs under an exclusive `fcntl` lock on
`<cache>/<name>.lock`, the second process finds the library when it gets the lock, and the
library reaches its final path by an atomic rename from a private temporary directory, so a
reader that takes no lock never sees a half-written file.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from flashgen.generator import __version__, paths
from flashgen.generator.compile import LIB_SUFFIX, library_path
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import KernelSpec
from flashgen.runtime import KernelLibrary

__all__ = ["CompileFailed", "cache_dir", "clear", "find_library", "kernel_library", "library_for"]

Compiler = Callable[..., Sequence[Any]]  # compile_specs' signature and CompileResult-like items


class CompileFailed(RuntimeError):
    """The kernel a call needs is not built and could not be compiled (the message says why
    and how to build it ahead of time)."""


def cache_dir() -> Path:
    """The per-user kernel cache (read from the environment on every call)."""
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashgen" / __version__


def find_library(spec: KernelSpec) -> Path | None:
    """The spec's library in the build directory, else in the cache; None when neither has it."""
    name = kernel_name(spec)
    for where in (paths.build_dir(), cache_dir()):
        path = library_path(name, where)
        if path.is_file():
            return path
    return None


def _default_compiler() -> Compiler:
    from flashgen.generator.compile import compile_specs

    return compile_specs


def library_for(
    spec: KernelSpec, *, compiler: Compiler | None = None, log: TextIO | None = None
) -> Path:
    """The spec's library, compiled into the cache on first use (see the module docstring).

    `compiler` defaults to `generator.compile.compile_specs` (tests pass a fake with its
    signature); `log` defaults to stderr.
    """
    found = find_library(spec)
    if found is not None:
        return found
    name = kernel_name(spec)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = library_path(name, root)
    with open(root / f"{name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if final.is_file():  # another process built it while we waited
                return final
            _compile_into(spec, name, root, compiler or _default_compiler(), log or sys.stderr)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final


def _compile_into(spec: KernelSpec, name: str, root: Path, compiler: Compiler, log: TextIO) -> None:
    """Compile in a private temporary directory under `root`, then rename into `root`."""
    where = f"{spec.target.yaml}, first use; cached in {root}"
    print(f"flashgen: compiling {name} ({where}) ...", end="", file=log, flush=True)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        try:
            results = compiler([spec], tmp, jobs=1, progress=False)
        except FileNotFoundError as e:  # nvcc missing
            print(" failed", file=log, flush=True)
            raise CompileFailed(
                f"{name} is not built (looked in {paths.build_dir()} and {root}) and cannot be "
                f"compiled here: {e}. Install the CUDA toolkit (nvcc), or build it ahead of "
                "time with `flashgen compile` into $FLASHGEN_BUILD_DIR"
            ) from None
        res = results[0]
        built = tmp / f"{name}{LIB_SUFFIX}"
        if not getattr(res, "ok", False) or not built.is_file():
            print(" failed", file=log, flush=True)
            error = getattr(res, "error", "") or "no library was written"
            raise CompileFailed(f"compiling {name} failed:\n{error}")
        report = tmp / f"{name}.json"
        if report.is_file():
            os.replace(report, root / report.name)
        os.replace(built, root / built.name)  # atomic: readers see all of it or nothing
        note = ""
        if getattr(res, "spills", False):
            note = f", {res.spill_stores} bytes of register spills (slower than it should be)"
        print(f" done in {time.monotonic() - start:.0f} s{note}", file=log, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_LIBRARIES: dict[KernelSpec, KernelLibrary] = {}


def kernel_library(spec: KernelSpec) -> KernelLibrary:
    """The loaded library of a spec, kept for the life of the process (one dlopen and one
    ctypes setup per kernel, not per call)."""
    lib = _LIBRARIES.get(spec)
    if lib is None:
        path = library_for(spec)
        lib = _LIBRARIES[spec] = KernelLibrary(spec, path.parent)
    return lib


def clear() -> None:
    """Forget the loaded libraries (tests; the processes' dlopen handles stay)."""
    _LIBRARIES.clear()
