"""flashgen: YAML kernel specs -> specialised CUDA FlashAttention kernels."""

__version__ = "0.1.0"

# Families register their validation rules with the spec module on import, so that every
# KernelSpec, however constructed, is checked against its family.
from flashgen.generator import families as _families  # noqa: E402,F401
