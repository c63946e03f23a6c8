"""flashgen.torch's compiled host path: `flashgen::fwd` and `flashgen::bwd` in C++.

The ops' Python implementations (`flashgen.torch.ops`) cost tens of microseconds of host
time per call: the custom-op wrapper, the autograd Function, the memo lookups, a dict of
launch fields and `struct.pack`. The binding (`csrc/binding.cpp`) defines the same operators
(same schemas, inferred from the Python implementations) with boxed C++ kernels for CUDA and
an autograd kernel in C++. Each call builds a key of its tensors' layouts and its scalar
arguments, finds the launch plan made for that key, fills the C parameter struct and calls
the kernel's `<name>_launch`: no Python runs on a hit. A miss asks the Python planner
(`ops._fwd_plan`, which runs every check of the Python path and raises its errors) once per
key; calls the fast path does not serve (empty or misaligned tensors; dropout when torch has
no CUDA build, whose generator it reads) run the Python implementation, unchanged.
`flashgen::decode` and `flashgen::merge_states` (`flashgen.torch.kvcache`: `install_decode`,
`install_merge`) are served alike, their plans the planning call's struct as words plus the
words patched per call.

Built once per (source, torch, Python, compiler) with the C++ compiler (`$CXX`, else `c++`)
and torch's include and library paths (`torch.utils.cpp_extension`), into the kernel cache
(`<cache>/binding/<hash>/`), under the same exclusive lock and atomic rename as the kernels
(`flashgen.torch.cache`). One translation unit needs no build system, so ninja is not
required.

`FLASHGEN_TORCH_BINDING`: "1" uses the binding (an error if it cannot be built), "auto"
uses it when it builds (else the ctypes path, with a one-line notice on stderr), "0" keeps
the ctypes path, and any other value keeps it with a notice. Unset means "auto" where torch
sees a CUDA device and "0" where it sees none (nothing there would launch a kernel, so
nothing is built). Read once, when `flashgen.torch.ops` is first imported.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from flashgen.generator import paths
from flashgen.torch import cache

__all__ = ["CPU_TESTS_ENV", "ENV", "BindingUnavailable", "build", "load", "mode"]

ENV = "FLASHGEN_TORCH_BINDING"
# "1": also register the C++ kernels for CPU tensors (tests/test_torch_binding.py runs the
# fast path on the CPU against mocked kernels: never set it otherwise)
CPU_TESTS_ENV = "FLASHGEN_TORCH_BINDING_CPU_TESTS"
MODULE = "_flashgen_binding"
SOURCE = Path(__file__).with_name("csrc") / "binding.cpp"
# the C headers the source includes (the parameter structs it fills)
HEADERS = ("params.h", "bwd_params.h", "score_params.h")


class BindingUnavailable(RuntimeError):
    """The binding could not be built or loaded here (the message says why)."""


def mode() -> str:
    """ "0" (the ctypes path), "1" (the binding, required) or "auto" (the binding if it builds);
    unset or empty: "auto" with a CUDA device, else "0"."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        import torch

        return "auto" if torch.cuda.is_available() else "0"
    if value not in ("0", "1", "auto"):
        raise BindingUnavailable(f"{ENV} must be 0, 1 or auto, got {value!r}")
    return value


def _include_dir() -> Path:
    return paths.TEMPLATES_DIR / "include" / "flashgen"


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{_include_dir()}"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    defines = [
        f"-DTORCH_EXTENSION_NAME={MODULE}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
    ]
    libs = []
    for p in cpp_extension.library_paths():
        libs += [f"-L{p}", f"-Wl,-rpath,{p}"]
    libs += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    # A CUDA build of torch: dropout forwards take the default CUDA generator's Philox state in
    # C++ (graph-safe under capture); that needs libtorch_cuda's CUDAGeneratorImpl
    if torch.version.cuda is not None and any(
        (Path(p) / "libtorch_cuda.so").is_file() for p in cpp_extension.library_paths()
    ):
        defines.append("-DFLASHGEN_CUDA_GENERATOR")
        libs.append("-ltorch_cuda")
    return includes + defines, libs


def _stamp() -> str:
    """The build's identity: the source, the headers, torch, Python and the compiler."""
    import torch

    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    for name in HEADERS:
        h.update(b"\0" + (_include_dir() / name).read_bytes())
    h.update(f"\0{torch.__version__}\0{torch.version.git_version}".encode())
    h.update(f"\0{sys.version}\0{_compiler()}".encode())
    return h.hexdigest()[:12]


def build(verbose: bool = False) -> Path:
    """The binding's shared library, compiled into the cache on first use."""
    root = cache.cache_dir() / "binding" / _stamp()
    final = root / f"{MODULE}.so"
    if final.is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BindingUnavailable(f"cannot create the binding's cache folder {root}: {e}") from None
    with open(root / "build.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if final.is_file():  # another process built it while we waited
                return final
            flags, libs = _torch_flags()
            tmp = Path(tempfile.mkdtemp(prefix=".build.", dir=root))
            try:
                out = tmp / final.name
                print("flashgen: compiling the torch binding (first use) ...", file=sys.stderr)
                # C++17 serves torch's headers up to 2.13 at least; newer ones may need C++20
                for std in ("-std=c++17", "-std=c++20"):
                    cmd = [_compiler(), "-O2", std, "-fPIC", "-shared", "-w", str(SOURCE),
                           "-o", str(out), *flags, *libs]  # fmt: skip
                    try:
                        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    except FileNotFoundError as e:
                        raise BindingUnavailable(f"no C++ compiler ({_compiler()}): {e}") from None
                    if res.returncode == 0 and out.is_file():
                        break
                else:
                    errors = [line for line in res.stderr.splitlines() if "error" in line]
                    first = errors[0] if errors else "no error line"
                    raise BindingUnavailable(
                        f"compiling {SOURCE.name} failed ({_compiler()}): {first}\n"
                        + (res.stderr if verbose else res.stderr[-4000:])
                    )
                os.replace(out, final)  # atomic: readers see all of it or nothing
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final


_MODULE: ModuleType | None = None


def load() -> ModuleType:
    """The loaded extension module (built first if needed); BindingUnavailable if it cannot be."""
    global _MODULE
    if _MODULE is None:
        path = build()
        spec = importlib.util.spec_from_file_location(MODULE, path)
        if spec is None or spec.loader is None:
            raise BindingUnavailable(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except (ImportError, OSError) as e:
            raise BindingUnavailable(f"loading {path} failed: {e}") from None
        _MODULE = module
    return _MODULE
