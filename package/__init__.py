"""flashgen: YAML kernel specs -> specialised CUDA FlashAttention kernels.

This folder is the `flashgen` package itself and holds only this file: its sub-packages are
the repository's top-level folders (flashgen.generator, flashgen.runtime, flashgen.verify,
flashgen.bench, flashgen.torch, ...), which pyproject.toml maps under it. It is not named
flashgen/ so that it cannot shadow an installed flashgen when Python runs from the checkout.
"""

import sys as _sys

__version__ = "0.1.0"  # the distribution's version (pyproject.toml reads it from here)

# A wheel installs every sub-package inside this folder. An editable install (setuptools)
# finds those that live elsewhere through its import hook, but the folders without an
# __init__.py (templates, specs, tests) only through a placeholder entry of sys.path, which a
# package must also hold in its __path__ for their imports to reach the hook.
__path__ += [
    p for p in _sys.path if p.startswith("__editable__.flashgen-") and p.endswith(".__path_hook__")
]
