"""The launch path lives in `flashgen.runtime` (runtime/library.py): this module re-exports it,
so `from flashgen.generator.launch import KernelLibrary` keeps working."""

from flashgen.runtime.library import *  # noqa: F403
from flashgen.runtime.library import __all__  # noqa: F401
