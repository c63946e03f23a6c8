"""flashgen: YAML kernel specs -> specialised CUDA FlashAttention kernels."""

from flashgen import __version__  # noqa: F401 - one version, set in package/__init__.py

# Families register their validation rules with the spec module on import, so that every
# KernelSpec, however constructed, is checked against its family.
from flashgen.generator import families as _families  # noqa: E402,F401
