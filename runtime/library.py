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
import struct
from collections.abc import Callable
from functools import lru_cache
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

from flashgen.generator.compile import library_path
from flashgen.generator.families import Family, family
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import KernelSpec

__all__ = ["KernelLibrary", "LaunchError", "launch_error", "params_struct"]

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


def launch_error(name: str, err: int, msg: str | None) -> LaunchError:
    """The LaunchError of kernel `name`'s failed launch: the launcher's message when its
    check refused the parameters, else the cudaError_t `err`."""
    if msg is not None:
        return LaunchError(f"{name}: {msg}")
    return LaunchError(f"{name}: launch failed with {_CUDA_ERRORS.get(err, 'cudaError')} ({err})")


@lru_cache(maxsize=None)
def params_struct(fam: Family) -> type[ctypes.Structure]:
    """The family's C parameter struct as a ctypes Structure (fields in table order)."""
    fields = [(p.name, _CTYPES[p.ctype]) for p in fam.params]
    return type(fam.params_struct, (ctypes.Structure,), {"_fields_": fields})


_U64_MASK = 2**64 - 1


def _to_u64(v: Any) -> int:
    return int(v) & _U64_MASK


# How `pack` converts a value for a field of each C type (ptr and u64 wrap two's complement),
# and the `struct` code of its 8 bytes.
_CONVERT = {"ptr": _to_u64, "u64": _to_u64, "i64": int, "f64": float}
_STRUCT_CODE = {"ptr": "Q", "u64": "Q", "i64": "q", "f64": "d"}


class _Packing(NamedTuple):
    """What `pack` needs of a family, built once: its field names (a set and in struct
    order), each field's converter, and the struct's bytes as a `struct.Struct` (native byte
    order, 8 bytes a field and no padding: the layout of `params_struct`)."""

    known: frozenset[str]
    names: tuple[str, ...]
    fields: tuple[tuple[str, Callable[[Any], Any]], ...]
    layout: struct.Struct


@lru_cache(maxsize=None)
def _packing(fam: Family) -> _Packing:
    return _Packing(
        frozenset(p.name for p in fam.params),
        tuple(p.name for p in fam.params),
        tuple((p.name, _CONVERT[p.ctype]) for p in fam.params),
        struct.Struct("=" + "".join(_STRUCT_CODE[p.ctype] for p in fam.params)),
    )


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
        self._packing = _packing(self.family)
        ptr = ctypes.POINTER(self.Params)
        # the exported symbols by role, as the family names them (Family.entry_points)
        self.entry_points = self.family.entry_points(self.name)
        self._check = getattr(self._lib, self.entry_points["check"])
        self._check.argtypes, self._check.restype = [ptr], ctypes.c_char_p
        self._launch = getattr(self._lib, self.entry_points["launch"])
        self._launch.argtypes, self._launch.restype = [ptr, ctypes.c_void_p], ctypes.c_int
        workspace = self.entry_points.get("workspace")
        self._workspace = getattr(self._lib, workspace, None) if workspace else None
        if self._workspace is not None:
            self._workspace.argtypes, self._workspace.restype = [ptr], ctypes.c_size_t

    def entry_addresses(self) -> dict[str, int]:
        """The addresses of the C entry points (`launch`, `check`, `workspace`; 0 where the
        kernel exports none), for callers that call them from C++ (flashgen.torch's
        binding). They stay valid while this object lives (it holds the library open)."""

        def address(fn: Any) -> int:
            return 0 if fn is None else int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

        return {
            "launch": address(self._launch),
            "check": address(self._check),
            "workspace": address(self._workspace),
        }

    def workspace_bytes(self, values: dict[str, Any]) -> int:
        """Bytes of workspace the kernel needs for these parameters (`<name>_workspace_bytes`;
        0 for kernels that export none, such as the forward)."""
        if self._workspace is None:
            return 0
        return int(self._workspace(ctypes.byref(self.pack(values))))

    def pack(self, values: dict[str, Any]) -> ctypes.Structure:
        """The parameter struct; missing fields are 0, unknown ones a KeyError.

        Fields take `int(v)` (ptr and u64 wrapped to 64 bits two's complement) or `float(v)`
        (f64). Fast path: `struct` packs the values as they are when each already is what
        its field stores (an integer in the field's range, a number for f64), which then
        equals that conversion; anything else (a float for an int field, a negative
        pointer, ...) takes the field-by-field conversion."""
        known, names, fields, layout = self._packing
        if not values.keys() <= known:
            unknown = set(values) - known
            raise KeyError(f"unknown {self.family.params_struct} fields: {sorted(unknown)}")
        try:
            packed = layout.pack(*map(values.get, names, repeat(0)))
        except Exception:  # noqa: BLE001 - the conversions below raise what applies
            get = values.get
            return self.Params(*[convert(get(name, 0)) for name, convert in fields])
        return self.Params.from_buffer_copy(packed)

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
        raise launch_error(self.name, err, None if msg is None else msg.decode())

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
