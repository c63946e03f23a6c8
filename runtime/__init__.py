"""flashgen's runtime: loading a generated kernel's host library and launching it through its C
launcher (ctypes), the parameter structs, the backward's workspace layout and the decode
family's extra entry points. The shipped front end (flashgen.torch), the verification
runners (flashgen.verify) and the benchmarks all sit on this package; none of them imports
another's internals to launch a kernel.
"""

from flashgen.runtime.decode import DecodeLibrary
from flashgen.runtime.library import KernelLibrary, LaunchError, params_struct
from flashgen.runtime.workspace import WORKSPACE_ALIGN, workspace_layout

__all__ = [
    "DecodeLibrary",
    "KernelLibrary",
    "LaunchError",
    "WORKSPACE_ALIGN",
    "params_struct",
    "workspace_layout",
]
