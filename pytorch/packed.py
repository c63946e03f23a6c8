"""flash-attn 2's packed entry points: q, k and v (or k and v) stacked into one tensor.

`flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`, `flash_attn_varlen_qkvpacked_func`
and `flash_attn_varlen_kvpacked_func` take flash-attn 2.8's arguments and return what it
returns. Each splits the packed tensor into strided views (no copy: the kernels read any
row and head stride, docs/torch.md) and calls `flash_attn_func` or `flash_attn_varlen_func`,
so every feature, refusal and kernel choice is theirs. The gradient of the packed tensor is
assembled by autograd from the views' gradients (one write of dq, dk, dv into it, where
flash-attn's own backward writes them there directly).
"""

from __future__ import annotations

from typing import Optional

from flashgen.torch.interface import Result, flash_attn_func, flash_attn_varlen_func
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = [
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


def _unpack(t: Tensor, name: str, layout: str, dim: int, parts: int) -> tuple[Tensor, ...]:
    """The `parts` views of `t` along its packing dimension `dim`, or an UnsupportedCall
    naming the layout the argument must have (`layout`)."""
    if not isinstance(t, Tensor):
        raise UnsupportedCall(f"{name} must be a tensor {layout}, got {type(t).__name__}")
    rank = layout.count(",") + 1
    if t.dim() != rank or t.shape[dim] != parts:
        raise UnsupportedCall(
            f"{name} must be {layout} (dimension {dim} of size {parts}), got shape {tuple(t.shape)}"
        )
    return t.unbind(dim)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Result:
    """`flash_attn_func` of `qkv` `(batch, seqlen, 3, heads, head_dim)`: q, k and v are
    `qkv[:, :, 0]`, `[:, :, 1]` and `[:, :, 2]` (as many heads each; use
    `flash_attn_kvpacked_func` for GQA). Returns what `flash_attn_func` returns."""
    q, k, v = _unpack(qkv, "qkv", "(batch, seqlen, 3, heads, head_dim)", 2, 3)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Result:
    """`flash_attn_func` of q `(batch, seqlen_q, heads, head_dim)` and `kv` `(batch,
    seqlen_k, 2, kv_heads, head_dim)`: k and v are `kv[:, :, 0]` and `kv[:, :, 1]` (kv_heads
    divides heads: MQA / GQA). Returns what `flash_attn_func` returns."""
    k, v = _unpack(kv, "kv", "(batch, seqlen_k, 2, kv_heads, head_dim)", 2, 2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Result:
    """`flash_attn_varlen_func` of `qkv` `(total, 3, heads, head_dim)` with one set of
    sequence boundaries (`cu_seqlens`, `max_seqlen`) for queries and keys. Returns what
    `flash_attn_varlen_func` returns."""
    q, k, v = _unpack(qkv, "qkv", "(total, 3, heads, head_dim)", 1, 3)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        learnable_sink=learnable_sink,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Result:
    """`flash_attn_varlen_func` of q `(total_q, heads, head_dim)` and `kv` `(total_k, 2,
    kv_heads, head_dim)`: k and v are `kv[:, 0]` and `kv[:, 1]`. Returns what
    `flash_attn_varlen_func` returns."""
    k, v = _unpack(kv, "kv", "(total_k, 2, kv_heads, head_dim)", 1, 2)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink=learnable_sink,
    )  # fmt: skip
