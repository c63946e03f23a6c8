"""A decode kernel's host library: the generic launch path plus the decode family's extra entry
points (the split count, merge_states)."""

from __future__ import annotations

import ctypes
from typing import Any

from flashgen.runtime.library import KernelLibrary, LaunchError, launch_error

__all__ = ["DecodeLibrary"]


class DecodeLibrary(KernelLibrary):
    """A decode kernel's host library: the generic launch path plus its extra entry points."""

    def _fn(self, role: str, restype: Any) -> Any:
        fn = getattr(self._lib, self.entry_points[role])  # Family.entry_points names them
        fn.argtypes = [ctypes.POINTER(self.Params)] + (
            [ctypes.c_void_p] if role == "merge_states" else []
        )
        fn.restype = restype
        return fn

    def num_splits(self, values: dict[str, Any]) -> int:
        """The split count a launch with these values uses (heuristic when num_splits is 0)."""
        return int(self._fn("num_splits", ctypes.c_int64)(ctypes.byref(self.pack(values))))

    def merge_check(self, values: dict[str, Any]) -> str | None:
        msg = self._fn("merge_check", ctypes.c_char_p)(ctypes.byref(self.pack(values)))
        return None if msg is None else msg.decode()

    def merge_states(self, values: dict[str, Any], stream: int = 0) -> None:
        """merge_states on `stream`: o (and lse) from o_parts / lse_parts (see decode_params.h)."""
        params = self.pack(values)
        msg = self._fn("merge_check", ctypes.c_char_p)(ctypes.byref(params))
        if msg is not None:
            raise LaunchError(f"{self.name}: {msg.decode()}")
        err = self._fn("merge_states", ctypes.c_int)(
            ctypes.byref(params), ctypes.c_void_p(int(stream) or None)
        )
        if err != 0:  # the message flashgen.torch's binding raises for it too
            raise launch_error(self.name, err, None)

    def merge_entry_addresses(self) -> dict[str, int]:
        """`entry_addresses` of merge_states: `launch` is `<name>_merge_states` (which runs
        `<name>_merge_check` itself and returns cudaErrorInvalidValue when it refuses),
        `check` is `<name>_merge_check`, `workspace` 0 (it needs none)."""

        def address(role: str) -> int:
            fn = getattr(self._lib, self.entry_points[role])
            return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

        return {"launch": address("merge_states"), "check": address("merge_check"), "workspace": 0}
