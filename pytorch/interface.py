"""flash-attn 2's Python interface over flashgen kernels: `flash_attn_func`,
`flash_attn_varlen_func`. Same names, argument names and order, layouts and conventions, so
switching is one import: `from flashgen.torch import flash_attn_func`.

Two things happen here, before the operators (`flashgen.torch.ops`, which take only what a
kernel reads as it is) see the tensors, as flash-attn does them in its Python layer:

- a head dim d in 1..256 that the kernels of the call do not serve is zero-padded: q, k and
  v get `F.pad` to the smallest served d' > d (`selection.padded_head_dim`, which asks the
  families), the kernels run at d' and the output is sliced back to d; autograd slices the
  gradients through the pad. The softmax scale stays 1 / sqrt(d) of the caller's d;
- a tensor whose layout the kernels cannot read (a last stride other than 1, another stride
  not a multiple of 8 elements, a first element off a 16-byte boundary) is copied once into
  the contiguous layout (`_readable`); aligned views (e.g. `qkv.unbind(2)`) are read in
  place.

Both are differentiable torch ops decided from shapes, strides and the device only (no
tensor values), so torch.compile(fullgraph=True) traces them and CUDA graphs capture them.
"""

import operator
from typing import Optional, Union

import torch
import torch.nn.functional as F
from flashgen.generator.spec import KernelKind
from flashgen.torch import attn_probs, ops, selection
from flashgen.torch import kvcache_prep as prep
from flashgen.torch import kvcache_select as ks
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

Result = Union[Tensor, tuple[Tensor, Tensor, None]]

_HALF = (torch.float16, torch.bfloat16)
_INFERENCE = (KernelKind.FORWARD,)
_TRAINING = (KernelKind.FORWARD, KernelKind.BACKWARD)  # one head dim: bwd reads fwd's output


def _on_cuda(t: Tensor) -> bool:
    """Whether t lives on a CUDA device (the mocked-CUDA CPU tests replace this)."""
    return t.device.type == "cuda"


@torch.compiler.assume_constant_result
def _kernel_head_dim(head_dim: int, index: Optional[int], backward: bool) -> int:
    """`selection.padded_head_dim` of a call on CUDA device `index` (None: the current one),
    with the backward's kernels too when it will run. torch.compile calls it once at trace
    time and keeps the result (it reads the device's compute capability, which it cannot
    trace); its guards on q's head dim, device and requires_grad cover what it reads."""
    if index is None:
        index = torch.cuda.current_device()
    kinds = _TRAINING if backward else _INFERENCE
    return selection.padded_head_dim(head_dim, ops._capability(index), kinds)


def _readable(t: Tensor) -> Tensor:
    """t itself when the kernels can read its layout (`selection.layout_ok`, and a first
    element on a 16-byte boundary), else one copy of it in the contiguous layout: `clone`
    (differentiable), as `.contiguous()` would keep an odd stride of a size-1 dimension.
    Under torch.compile the start address is not known at trace time; a view that begins
    mid-vector is then refused by the op at run time, as before."""
    if selection.layout_ok(t.stride()) and (
        torch.compiler.is_compiling()
        or t.storage_offset() == 0  # the common case: the storage's (aligned) start
        or not selection.misaligned(t.shape, t.storage_offset(), t.element_size())
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _padded_strides(shape) -> tuple[int, ...]:
    """Contiguous strides of `shape` with its last dimension rounded up to a multiple of 8:
    a layout the kernels read, as the padded copies have."""
    shape = tuple(shape)
    out, acc = [1], -(-int(shape[-1]) // 8) * 8
    for n in reversed(shape[:-1]):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _check_unpadded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """The op's checks of the caller's tensors as they will be copied (their shapes, readable
    strides), so that a refusal names the caller's shapes and their first problem, not the
    padded shapes or a stride only the copy would have fixed."""
    metas = [ops._meta(t) for t in (q, k, v)]
    q_m, k_m, v_m = (m._replace(stride=_padded_strides(m.shape)) if m.shape else m for m in metas)
    selection.check_problem(
        q_m, k_m, v_m,
        cu_seqlens_q=None if cu_seqlens_q is None else ops._meta(cu_seqlens_q),
        cu_seqlens_k=None if cu_seqlens_k is None else ops._meta(cu_seqlens_k),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )  # fmt: skip


def _kernel_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   backward: bool,
                   pad: bool = True) -> tuple[Tensor, Tensor, Tensor, int]:  # fmt: skip
    """(q, k, v) as the kernels read them, and the head dim they run at: zero-padded to
    `_kernel_head_dim` when the kernels do not serve q's head dim, then copied where their
    layout is one the kernels cannot read. Tensors the op refuses anyway (not CUDA, not
    float16/bfloat16, head dims that differ) are passed on as they are, to its message.
    `pad=False` (a compile_variant call, whose spec names its head dims) never pads."""
    d = q.shape[-1]
    if not (_on_cuda(q) and q.dtype in _HALF):
        return q, k, v, d
    compiling = torch.compiler.is_compiling()
    if k.dim() == 0 or v.dim() == 0 or k.shape[-1] != d or v.shape[-1] != d:
        if not compiling:  # refused: say the head dims differ (not that a stride is odd)
            _check_unpadded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return q, k, v, d
    padded = _kernel_head_dim(operator.index(d), q.device.index, backward) if pad else d
    if padded != d:
        if not compiling:
            _check_unpadded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        pad = (0, padded - d)
        qp = F.pad(q, pad)
        kp = qp if k is q else F.pad(k, pad)
        vp = qp if v is q else kp if v is k else F.pad(v, pad)
        q, k, v = qp, kp, vp
    return _readable(q), _readable(k), _readable(v), padded


def _attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
    softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_attn_probs, learnable_sink, user=(),
) -> Result:  # fmt: skip
    """The shared body of flash_attn_func, flash_attn_varlen_func and compile_variant's
    callables (`user`: a variant's nine user arguments, `ops.USER_ARGS`, which take the call
    to the variant ops; () for the others, which call fwd and bwd)."""
    variant = len(user) > 0  # (not `not user`: dynamo does not trace `not` on a tuple)
    head_dim = q.shape[-1]
    q_in, k_in = q, k  # the caller's, for return_attn_probs with dropout
    if softmax_scale is None:  # the caller's head dim, padded or not (0: refused below)
        softmax_scale = head_dim**-0.5 if head_dim > 0 else 1.0
    if type(softcap) is not float:
        softcap = ops.as_softcap(softcap)
    if alibi_slopes is not None or learnable_sink is not None:
        ops.check_score_tensors(alibi_slopes, learnable_sink)
    window_left, window_right = window_size
    if return_attn_probs and dropout_p > 0.0 and ops.capturing():
        raise UnsupportedCall(
            "return_attn_probs=True with dropout_p > 0 is not supported under CUDA graph "
            "capture: S_dmask is recomputed from the seed and offset on the host, which a "
            "captured forward only knows on the device (its philox outputs)"
        )
    backward = torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (isinstance(learnable_sink, Tensor) and learnable_sink.requires_grad)
    )
    q, k, v, kernel_head_dim = _kernel_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backward,
        not variant,  # pad: never for a variant (positional, as the tests' stand-ins take it)
    )  # fmt: skip
    if backward and (ops.BINDING is None or variant) and not torch.compiler.is_compiling():
        # (the binding's autograd kernel makes the same check, once per key, before the
        # forward runs; the variant ops are Python custom ops on either path)
        # Refuse an unsupported backward before the forward runs (and perhaps compiles);
        # under torch.compile the op's autograd set-up does the same at trace time. A call
        # of a kind check_backward accepted before skips it: the forward then refuses
        # anything it would have refused, with the same message (ops._backward_known; a
        # float softmax_scale: float() below cannot raise first).
        rest = (dropout_p, causal, window_left, window_right, deterministic)
        score = (softcap, alibi_slopes, learnable_sink)
        if type(softmax_scale) is not float or not ops._backward_known(
            q, k, v, cu_seqlens_q, cu_seqlens_k, *rest, *score, *user
        ):
            ops.check_backward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest, *score,
                *user,
            )  # fmt: skip
    op = torch.ops.flashgen.fwd_variant.default if variant else torch.ops.flashgen.fwd.default
    out, lse, seed, offset = op(
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
        *user,
    )
    if kernel_head_dim != head_dim:  # zero-padded: the output's first head_dim columns
        out = out[..., :head_dim].contiguous()
    if return_attn_probs:
        probs = None
        # flash-attn's S_dmask, recomputed (flashgen.torch.attn_probs); not for a variant,
        # whose score_mod the recomputation does not know (None, as without dropout)
        if dropout_p > 0.0 and not variant:
            probs = attn_probs.dropout_probs(
                q_in.detach(), k_in.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, ops._u64(seed), ops._u64(offset), float(dropout_p),
                float(softmax_scale), bool(causal), (int(window_left), int(window_right)),
                softcap, alibi_slopes,
            )  # fmt: skip
        return out, lse, probs
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
        q: `(batch, seqlen_q, heads, head_dim)`, float16 or bfloat16, on a CUDA device;
            head_dim in 1..256. A head dim the kernels do not serve is zero-padded to the
            next one they serve (a copy of q, k and v; the output and the gradients are
            sliced back), as flash-attn does; docs/torch.md, "Head dims and layouts".
        k, v: `(batch, seqlen_k, kv_heads, head_dim)`; `kv_heads` divides `heads` (GQA/MQA:
            query head h reads k/v head `h // (heads // kv_heads)`). Views whose last
            dimension is contiguous and whose other strides are multiples of 8 elements,
            such as `qkv[:, :, 0]` of a packed projection, are read in place; any other
            layout (e.g. `x[..., :d]` of a wider tensor with d not a multiple of 8) is
            copied once into a contiguous buffer (differentiable, like the padding).
        dropout_p: dropout probability on the attention weights (0.0 at evaluation). Seed and
            offset come from the device's default CUDA generator (`torch.manual_seed` makes
            a forward/backward pair reproducible); under CUDA graph capture the kernels
            read them on the device at each replay, so every replay draws a new mask.
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
        return_attn_probs: also return `softmax_lse` (see below) and flash-attn's `S_dmask`:
            None without dropout (as flash-attn); with dropout, the unnormalised
            probabilities `exp(z - rowmax)` with the dropped elements negated, `(batch, heads,
            seqlen_q, seqlen_k)` in q's dtype, recomputed on the device after the kernel from
            the same inputs and keep mask (`flashgen.torch.attn_probs`; for tests: one
            float32 score matrix per head, and a device-to-host copy of seed and offset).
        learnable_sink (keyword only, FlashAttention-4's name): None, or float32 `(heads,)` on
            q's device: one logit per query head that joins only the softmax's denominator,
            `P_ij = exp(z_ij) / (exp(sink_h) + sum_j exp(z_ij))` with z the scaled (capped,
            biased) scores; sink_h is in z's natural-log units (not multiplied by
            softmax_scale). Differentiable: when it requires grad, the backward returns
            `dsink_h = -sum_{b,i} exp(sink_h - LSE_bhi) * rowsum(dO * O)_bhi`, float32.

    Returns:
        `out` `(batch, seqlen_q, heads, head_dim)` in q's dtype (contiguous); with
        `return_attn_probs=True`, `(out, softmax_lse, S_dmask)` (S_dmask None without
        dropout). `softmax_lse` is float32
        `(batch, heads, seqlen_q)`, the natural-log log-sum-exp of each row's scores
        `log(sum_j exp(z_ij))` over visible keys (before dropout; plus `exp(sink_h)` in the
        sum with a sink), -inf on rows that see no key (sink_h with a sink). It is not
        differentiable (as in flash-attn).

    Raises:
        UnsupportedCall (a ValueError) when no flashgen kernel serves the call: CPU tensors,
        a dtype other than float16/bfloat16, a head_dim outside 1..256 (or one that no
        served head dim >= it covers), a GPU other than compute capability 8.0, 8.6, 8.9 or
        9.0, a softcap < 0, NaN or inf, alibi_slopes or learnable_sink of another shape,
        dtype, device or a strided last dimension. It says what is allowed; nothing falls
        back.
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
    in `flash_attn_func`.

    `block_table` (paged K/V, flash-attn's paged prefill as vLLM calls it): k and v are then
    paged caches `(num_pages, page_size, kv_heads, head_dim)` (any page_size >= 1) and
    `block_table` int32 `(batch, max_pages)`: key j of sequence b (j below `cu_seqlens_k[b + 1]
    - cu_seqlens_k[b]`) is row `j % page_size` of page `block_table[b, j // page_size]`. The
    kernels read packed K/V, so the used rows are first gathered into a packed copy
    (`kvcache_prep.pack`: `cu_seqlens_k[-1]` rows of k and of v, one read and one write of
    each, every call); learning that size and checking the lengths (`0..max_pages *
    page_size`) and the used page ids (`[0, num_pages)`) is one device-to-host copy (a sync).
    Bad values raise `UnsupportedCall` naming them. Gradients, where q, k or v require grad,
    flow back through the gather into the pages (flash-attn's paged forward has no backward).
    flash-attn 2.8's function has no `seqused_k`, nor has this one.
    """
    if block_table is not None:
        k, v = _paged_kv(k, v, cu_seqlens_k, block_table)
    return _attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, learnable_sink,
    )  # fmt: skip


def _paged_kv(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, block_table: Tensor):
    """(k, v) packed from their pages for the varlen forward (see flash_attn_varlen_func)."""
    for name, t in (("cu_seqlens_k", cu_seqlens_k), ("block_table", block_table)):
        if not isinstance(t, Tensor):
            raise UnsupportedCall(f"{name} must be an int32 CUDA tensor, got {type(t).__name__}")
    page_size, num_pages = ks.check_paged_kv(
        ops._meta(k), ops._meta(v), ops._meta(block_table), ops._meta(cu_seqlens_k)
    )
    devices = {t.device for t in (k, v, cu_seqlens_k, block_table)}
    if len(devices) > 1:
        raise UnsupportedCall(
            "k, v, cu_seqlens_k and block_table must be on one device, got "
            + ", ".join(str(d) for d in devices)
        )
    table = block_table.detach()
    total = prep.paged_total(cu_seqlens_k.detach(), table, page_size=page_size, num_pages=num_pages)
    cu = cu_seqlens_k.detach()
    return (
        prep.pack(k, cu, total, block_table=table),
        prep.pack(v, cu, total, block_table=table),
    )
