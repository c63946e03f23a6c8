"""The one launch path: Python calls a kernel's generated C launcher through ctypes.

`flashgen compile` builds each kernel into a host shared library `<name>.so` holding the
device code and the generated C ABI (`<name>_check`, `<name>_launch`). `KernelLibrary` loads
it and calls those functions with the family's parameter struct, built as a ctypes
Structure from the family's one parameter table (`Family.params`), so the argument checks
and the grid are the C launcher's alone: tests, benchmarks and users run the same code.

Pointers are plain integers (device addresses): PyCUDA allocations and foreign ones such as
a torch tensor's `data_ptr()` work alike, as both live in the device's primary context,
which is the one the CUDA runtime inside the library uses. `stream` is a `cudaStream_t` as
an integer (0: the legacy default stream; `torch.cuda.current_stream().cuda_stream`).
Loading a library and calling `check` need no GPU.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Any

from flashgen.generator.compile import library_path
from flashgen.generator.families import Family, family
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import KernelSpec

__all__ = ["KernelLibrary", "LaunchError", "params_struct"]

_CTYPES = {
    "ptr": ctypes.c_uint64,  # device addresses as integers (0 = NULL)
    "i64": ctypes.c_int64,
    "u64": ctypes.c_uint64,
    "f64": ctypes.c_double,
}

# The few cudaError_t values a launch can return, for messages (cuda_runtime_api.h).
_CUDA_ERRORS = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    9: "cudaErrorInvalidConfiguration",
    35: "cudaErrorInsufficientDriver",
    98: "cudaErrorInvalidDeviceFunction",
    100: "cudaErrorNoDevice",
    209: "cudaErrorNoKernelImageForDevice",
    400: "cudaErrorInvalidResourceHandle",
    700: "cudaErrorIllegalAddress",
    701: "cudaErrorLaunchOutOfResources",
}


class LaunchError(ValueError):
    """The launcher refused the parameters (its message says what and what is allowed), or
    the CUDA runtime reported an error."""


@lru_cache(maxsize=None)
def params_struct(fam: Family) -> type[ctypes.Structure]:
    """The family's C parameter struct as a ctypes Structure (fields in table order)."""
    fields = [(p.name, _CTYPES[p.ctype]) for p in fam.params]
    return type(fam.params_struct, (ctypes.Structure,), {"_fields_": fields})


class KernelLibrary:
    """One compiled kernel: `check(values)` and `launch(values, stream)`."""

    def __init__(self, spec: KernelSpec, lib_dir: Path | str | None = None) -> None:
        self.spec = spec
        self.family = family(spec)
        self.name = kernel_name(spec)
        self.path = library_path(self.name, lib_dir)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"no library for {self.name} at {self.path}: run `flashgen compile` for its spec"
            )
        self._lib = ctypes.CDLL(str(self.path.resolve()))
        self.Params = params_struct(self.family)
        ptr = ctypes.POINTER(self.Params)
        self._check = getattr(self._lib, f"{self.name}_check")
        self._check.argtypes, self._check.restype = [ptr], ctypes.c_char_p
        self._launch = getattr(self._lib, f"{self.name}_launch")
        self._launch.argtypes, self._launch.restype = [ptr, ctypes.c_void_p], ctypes.c_int

    def workspace_bytes(self, values: dict[str, Any]) -> int:
        """Bytes of workspace the kernel needs for these parameters (`<name>_workspace_bytes`;
        0 for kernels that export none, such as the forward)."""
        fn = getattr(self._lib, f"{self.name}_workspace_bytes", None)
        if fn is None:
            return 0
        fn.argtypes, fn.restype = [ctypes.POINTER(self.Params)], ctypes.c_size_t
        return int(fn(ctypes.byref(self.pack(values))))

    def pack(self, values: dict[str, Any]) -> ctypes.Structure:
        """The parameter struct; missing fields are 0, unknown ones a KeyError."""
        known = {p.name for p in self.family.params}
        unknown = set(values) - known
        if unknown:
            raise KeyError(f"unknown {self.family.params_struct} fields: {sorted(unknown)}")
        p = self.Params()
        for f in self.family.params:
            v = values.get(f.name, 0)
            if f.ctype == "f64":
                setattr(p, f.name, float(v))
            elif f.ctype in ("ptr", "u64"):
                setattr(p, f.name, int(v) & (2**64 - 1))
            else:
                setattr(p, f.name, int(v))
        return p

    def check(self, values: dict[str, Any]) -> str | None:
        """None when the launcher accepts the parameters, else its message."""
        msg = self._check(ctypes.byref(self.pack(values)))
        return None if msg is None else msg.decode()

    def launch(self, values: dict[str, Any], stream: int = 0) -> None:
        """Launch on `stream` (asynchronous; nothing is synchronised). The C launcher checks
        the parameters itself; only when it refuses them is `_check` asked for the reason."""
        params = self.pack(values)
        err = self._launch(ctypes.byref(params), ctypes.c_void_p(int(stream) or None))
        if err == 0:
            return
        msg = self._check(ctypes.byref(params)) if err == 1 else None  # cudaErrorInvalidValue
        if msg is not None:
            raise LaunchError(f"{self.name}: {msg.decode()}")
        raise LaunchError(
            f"{self.name}: launch failed with {_CUDA_ERRORS.get(err, 'cudaError')} ({err})"
        )

    def launcher(self, values: dict[str, Any], stream: int = 0):
        """A no-argument callable launching with these parameters (checked once now), for
        benchmarks and graph capture; it raises LaunchError if a launch fails."""
        params = self.pack(values)
        msg = self._check(ctypes.byref(params))
        if msg is not None:
            raise LaunchError(f"{self.name}: {msg.decode()}")
        ref, handle, fn = ctypes.byref(params), ctypes.c_void_p(int(stream) or None), self._launch

        def launch() -> None:
            err = fn(ref, handle)
            if err != 0:
                raise LaunchError(f"{self.name}: launch failed ({err})")

        launch.params = params  # keeps the struct alive with the callable
        return launch
