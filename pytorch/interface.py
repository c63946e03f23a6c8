"""flash-attn 2's Python interface over flashgen kernels: `flash_attn_func`,
`flash_attn_varlen_func`. Same names, argument names and order, layouts and conventions, so
switching is one import: `from flashgen.torch import flash_attn_func`.
"""

from typing import Optional, Union

import torch
from flashgen.torch import ops
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

Result = Union[Tensor, tuple[Tensor, Tensor, None]]


def _attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_attn_probs, learnable_sink,
) -> Result:  # fmt: skip
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if type(softcap) is not float:
        softcap = ops.as_softcap(softcap)
    if alibi_slopes is not None or learnable_sink is not None:
        ops.check_score_tensors(alibi_slopes, learnable_sink)
    window_left, window_right = window_size
    if (
        not torch.compiler.is_compiling()
        and torch.is_grad_enabled()
        and (
            q.requires_grad
            or k.requires_grad
            or v.requires_grad
            or (isinstance(learnable_sink, Tensor) and learnable_sink.requires_grad)
        )
    ):
        # Refuse an unsupported backward before the forward runs (and perhaps compiles);
        # under torch.compile the op's autograd set-up does the same at trace time. A call
        # of a kind check_backward accepted before skips it: the forward then refuses
        # anything it would have refused, with the same message (ops._backward_known; a
        # float softmax_scale: float() below cannot raise first).
        rest = (dropout_p, causal, window_left, window_right, deterministic)
        score = (softcap, alibi_slopes, learnable_sink)
        if type(softmax_scale) is not float or not ops._backward_known(
            q, k, v, cu_seqlens_q, cu_seqlens_k, *rest, *score
        ):
            ops.check_backward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest, *score
            )
    out, lse, _, _ = torch.ops.flashgen.fwd.default(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        float(dropout_p),
        float(softmax_scale),
        bool(causal),
        int(window_left),
        int(window_right),
        bool(deterministic),
        softcap,
        alibi_slopes,
        learnable_sink,
    )
    if return_attn_probs:
        return out, lse, None
    return out


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    """Attention over `(batch, seqlen, heads, head_dim)` tensors, as flash-attn 2's.

    Arguments:
        q: `(batch, seqlen_q, heads, head_dim)`, float16 or bfloat16, on a CUDA device.
        k, v: `(batch, seqlen_k, kv_heads, head_dim)`; `kv_heads` divides `heads` (GQA/MQA:
            query head h reads k/v head `h // (heads // kv_heads)`). The last dimension must
            be contiguous and every other stride a multiple of 8 elements; views such as
            `qkv[:, :, 0]` of a packed projection are taken as they are, without a copy.
        dropout_p: dropout probability on the attention weights (0.0 at evaluation). Seed and
            offset come from the device's default CUDA generator (`torch.manual_seed` makes
            a forward/backward pair reproducible); refused under CUDA graph capture.
        softmax_scale: scale of `q k^T` before the softmax; default `1 / sqrt(head_dim)`.
        causal: causal mask aligned to the bottom-right corner (flash-attn >= 2.1): key j is
            visible from query i iff `j <= i + seqlen_k - seqlen_q`. Rows that see no key
            (seqlen_q > seqlen_k) give output 0.
        window_size: `(left, right)` sliding window, -1 unbounded: key j is visible iff
            `i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`;
            `causal=True` sets `right = 0`.
        softcap: 0.0 (off), or c > 0: each scaled score s becomes `c * tanh(s / c)` before
            the mask and the ALiBi bias (flash-attn's soft-capping; no gradient flows to c).
        alibi_slopes: None, or float32 `(heads,)` or `(batch, heads)` on q's device: the bias
            `-slope[b, h] * |i + seqlen_k - seqlen_q - j|` is added to the (capped) score of
            query i and key j, causal or not (flash-attn's definition; no gradient).
        deterministic: use the deterministic backward kernel (bitwise repeatable dq, dk, dv).
        return_attn_probs: also return `softmax_lse` (see below) and, in the place of
            flash-attn's `S_dmask`, None: flashgen never materialises the attention matrix.
        learnable_sink (keyword only, FlashAttention-4's name): None, or float32 `(heads,)` on
            q's device: one logit per query head that joins only the softmax's denominator,
            `P_ij = exp(z_ij) / (exp(sink_h) + sum_j exp(z_ij))` with z the scaled (capped,
            biased) scores; sink_h is in z's natural-log units (not multiplied by
            softmax_scale). Differentiable: when it requires grad, the backward returns
            `dsink_h = -sum_{b,i} exp(sink_h - LSE_bhi) * rowsum(dO * O)_bhi`, float32.

    Returns:
        `out` `(batch, seqlen_q, heads, head_dim)` in q's dtype (contiguous); with
        `return_attn_probs=True`, `(out, softmax_lse, None)`. `softmax_lse` is float32
        `(batch, heads, seqlen_q)`, the natural-log log-sum-exp of each row's scores
        `log(sum_j exp(z_ij))` over visible keys (before dropout; plus `exp(sink_h)` in the
        sum with a sink), -inf on rows that see no key (sink_h with a sink). It is not
        differentiable (as in flash-attn).

    Raises:
        UnsupportedCall (a ValueError) when no flashgen kernel serves the call: CPU tensors,
        a dtype other than float16/bfloat16, a head_dim without a kernel (forward: multiples
        of 16 in 16..256; backward, when an input requires grad: 16..128 step 16 and 160,
        192, 224, 256), a GPU other than compute capability 8.0, 8.6, 8.9 or 9.0, a layout
        the kernels cannot read, a softcap < 0, NaN or inf, alibi_slopes or learnable_sink
        of another shape, dtype or device. It says what is allowed; nothing falls back.
    """
    return _attention(
        q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, learnable_sink,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    block_table: Optional[Tensor] = None,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Result:
    """Attention over packed variable-length sequences, as flash-attn 2's.

    q is `(total_q, heads, head_dim)`, k and v `(total_k, kv_heads, head_dim)`: sequence b
    holds rows `cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1` of q and `cu_seqlens_k[b] ..
    cu_seqlens_k[b+1] - 1` of k and v. `cu_seqlens_q`, `cu_seqlens_k` are int32 CUDA tensors
    of `batch + 1` cumulative lengths starting at 0; `max_seqlen_q`, `max_seqlen_k` are the
    longest lengths (they size the grid; they are not checked against the tensors, which
    would need a device-to-host copy). Masks and the ALiBi distance are per sequence,
    aligned to each sequence's own bottom-right corner; `alibi_slopes` `(batch, heads)` has
    one row per sequence. `softmax_lse` is float32 `(heads, total_q)`. Everything else is as
    in `flash_attn_func`; `block_table` (paged K/V) is not implemented.
    """
    if block_table is not None:
        raise UnsupportedCall("block_table: paged K/V caches are not implemented (allowed: None)")
    return _attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink,
    )  # fmt: skip
