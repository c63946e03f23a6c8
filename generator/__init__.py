"""flashgen: YAML kernel specs -> specialised CUDA FlashAttention kernels."""

__version__ = "0.1.0"
