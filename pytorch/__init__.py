"""flashgen kernels as PyTorch operators, behind flash-attn 2's interface.

    from flashgen.torch import flash_attn_func            # instead of: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)          # (batch, seqlen, heads, head_dim)

    attn = compile_variant(spec_yaml)                    # a spec's score_mod (docs/torch.md)
    out = attn(q, k, v, causal=True, slopes=slopes)      # flash_attn_func's conventions

Needs PyTorch (`pip install '.[torch]'` from a flashgen checkout). The functions, the operators
`torch.ops.flashgen.fwd` / `torch.ops.flashgen.bwd` and their conventions are documented in
`flashgen.torch.interface` and docs/torch.md. Kernel selection (`flashgen.torch.selection`)
and the kernel cache (`flashgen.torch.cache`) import no torch, so importing this package does
not either: torch is imported when one of the names below is first used, and its absence is
an ImportError saying how to install it.
"""

from importlib import import_module
from typing import Any

__all__ = [
    "UnsupportedCall",
    "compile_variant",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_states",
    "register_sdpa_impl",
    "register_transformers",
]

_FROM = {
    "flash_attn_func": "flashgen.torch.interface",
    "flash_attn_varlen_func": "flashgen.torch.interface",
    # flash-attn 2's packed entry points: views of the packed tensor into the two above
    "flash_attn_qkvpacked_func": "flashgen.torch.packed",
    "flash_attn_kvpacked_func": "flashgen.torch.packed",
    "flash_attn_varlen_qkvpacked_func": "flashgen.torch.packed",
    "flash_attn_varlen_kvpacked_func": "flashgen.torch.packed",
    "UnsupportedCall": "flashgen.torch.selection",
    # docs/torch.md, "User-defined variants": a spec's score_mod as a flash_attn_func
    "compile_variant": "flashgen.torch.variant",
    "flash_attn_with_kvcache": "flashgen.torch.kvcache",
    "merge_states": "flashgen.torch.kvcache",
    # docs/torch_ecosystem.md: SDPA's FLASH backend and transformers' attn_implementation
    "register_sdpa_impl": "flashgen.torch.sdpa_backend",
    "register_transformers": "flashgen.torch.transformers_attention",
}


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'flashgen.torch' has no attribute {name!r}")
    if module.endswith(
        (
            ".interface",
            ".kvcache",
            ".packed",
            ".sdpa_backend",
            ".transformers_attention",
            ".variant",
        )
    ):
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"flashgen.torch.{name} needs PyTorch >= 2.4, which is not importable here "
                f"({e}): pip install '.[torch]' (from a flashgen checkout)"
            ) from e
    return getattr(import_module(module), name)
