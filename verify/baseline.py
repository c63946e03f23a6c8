"""Standard attention in the kernel's precision: the yardstick of the pass rule.

What a careful non-fused implementation in fp16 / bf16 gets (FlashAttention's test baseline):
inputs rounded to the dtype; S = scale * Q K^T and the softmax in float32; P rounded to the
dtype before `P V`; float32 accumulation; the output rounded to the dtype. LSE stays float32.
Arguments and layouts are those of `verify.reference` (same plumbing, a float32 numeric core).

NumPy has no bfloat16, so bf16 values are float32 arrays holding bf16-representable numbers
(`round_to_dtype`). Results are float32 arrays holding dtype values.

Score-stage features (`softcap`, `alibi_slopes`, `sinks`; `verify.score_mods`) are applied as
the reference applies them, in float32, with the roundings of an unfused softcap: the capped
score `c * tanh(z / c)` is rounded to the dtype before the bias and the softmax, and so is
tanh's output `t` before the multiplication by c, because an unfused implementation holds
both tensors in the dtype (Gemma-2's eager path: `tanh(scores / c) * c` on fp16 / bf16
tensors; flash-attn's own test reference, `attention_ref(upcast=False)`, likewise). The
ALiBi bias `slope * |i + shift - j|` and the sink term are float32 (slopes and sinks are
fp32 tensors); the backward's softcap factor is `1 - t^2` in float32 from that rounded `t`
(autograd keeps tanh's output), multiplied into dS before dS is rounded; dsinks
`-sum exp(sink - LSE) D` is a float32 sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flashgen.verify import score_mods
from flashgen.verify.numerics import round_to
from flashgen.verify.reference import (
    SeqInputs,
    masked_softmax,
    probabilities_from_lse,
    run_backward,
    scaled_scores,
    score_grad,
    score_logits,
    through_score_grad,
)
from flashgen.verify.reference import run_forward as _run_forward

__all__ = ["DTYPES", "attention_backward", "attention_forward", "dtype_name", "round_to_dtype"]

DTYPES = ("fp16", "bf16", "fp32")


def dtype_name(dtype: Any) -> str:
    """'fp16', 'bf16' or 'fp32' from a string or an enum with that `.yaml`."""
    name = getattr(dtype, "yaml", dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed (allowed: {', '.join(DTYPES)})")
    return name


def round_to_dtype(x: Any, dtype: Any) -> np.ndarray:
    """`x` rounded to fp16, bf16 or fp32 (nearest even), returned as a float32 array.

    The value is first converted to float32 (as a kernel's float32 accumulator would hold it),
    then rounded; fp16 overflow gives inf, as the hardware conversion does.
    """
    name = dtype_name(dtype)
    x32 = np.asarray(x, dtype=np.float32)
    if name == "fp32":
        return x32.copy()
    if name == "fp16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    return round_to(x32, "bf16")


def _forward_core(name: str):
    def core(inp: SeqInputs) -> tuple[np.ndarray, np.ndarray]:
        z = score_logits(inp, capped_dtype=name)  # float32, the capped score rounded
        p, lse = masked_softmax(z, inp.visible, inp.sinks)
        if inp.keep is not None:
            p = p * inp.keep * np.float32(1.0 / (1.0 - inp.dropout_p))
        p = round_to_dtype(p, name)
        o = p @ inp.v.transpose(1, 0, 2)  # float32 accumulation
        return round_to_dtype(o.transpose(1, 0, 2), name), lse

    return core


def _backward_core(name: str):
    def core(
        inp: SeqInputs, o: np.ndarray, lse: np.ndarray, do: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        s = scaled_scores(inp)  # float32
        p = probabilities_from_lse(score_logits(inp, s, capped_dtype=name), inp.visible, lse)
        z = None
        if inp.keep is not None:
            z = inp.keep * np.float32(1.0 / (1.0 - inp.dropout_p))
        pz = round_to_dtype(p if z is None else p * z, name)
        do_h = do.transpose(1, 0, 2)
        dv = pz.transpose(0, 2, 1) @ do_h
        dp = do_h @ inp.v.transpose(1, 2, 0)
        if z is not None:
            dp = dp * z
        delta = np.sum(do_h * o.transpose(1, 0, 2), axis=-1, dtype=np.float32)
        ds = p * (dp - delta[..., None])
        cap = score_mods.softcap_factor(s, inp.softcap, capped_dtype=name)  # 1 - t^2
        if cap is not None:
            ds = ds * cap
        ds = through_score_grad(ds, p, score_grad(inp, s))  # a score_mod's, float32
        ds = round_to_dtype(ds, name)
        sc = np.float32(inp.scale)
        dq = (ds @ inp.k.transpose(1, 0, 2)) * sc
        dk = (ds.transpose(0, 2, 1) @ inp.q.transpose(1, 0, 2)) * sc
        dsink = None if inp.sinks is None else score_mods.dsink_terms(inp.sinks, lse, delta)
        # dk, dv stay float32 here: the GQA group sum happens in float32, rounding follows.
        return (
            round_to_dtype(dq.transpose(1, 0, 2), name),
            dk.transpose(1, 0, 2),
            dv.transpose(1, 0, 2),
            dsink,
        )

    return core


def attention_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    dtype: Any,
    scale: float | None = None,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    keep_mask: Any = None,
    dropout_p: float = 0.0,
    block_mask: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Standard attention in `dtype` ('fp16' / 'bf16'): `(o, lse)` as float32 arrays.

    o holds dtype values with q's layout; lse is float32 `(batch, heads, Sq)` (varlen
    `(heads, total_q)`). Arguments as `verify.reference.attention_forward`, including
    `softcap`, `alibi_slopes` and `sinks` (see the module doc for where they round).
    """
    name = dtype_name(dtype)
    q, k, v = (round_to_dtype(x, name) for x in (q, k, v))
    return _run_forward(
        _forward_core(name),
        q,
        k,
        v,
        work_dtype=np.float32,
        scale=scale,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        keep_mask=keep_mask,
        dropout_p=dropout_p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )


def attention_backward(
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    do: Any,
    *,
    dtype: Any,
    scale: float | None = None,
    causal: Any = "none",
    window: Sequence[int] = (-1, -1),
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    keep_mask: Any = None,
    dropout_p: float = 0.0,
    block_mask: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    score_params: Any = None,
    mask_mod: Any = None,
) -> tuple[np.ndarray, ...]:
    """Standard attention backward in `dtype`: `(dq, dk, dv)` as float32 holding dtype values.

    P is recomputed in float32 from `lse`; P (times the dropout factor) and dS are rounded to
    the dtype before their matmuls, accumulation is float32, each gradient is rounded once at
    the end. Pass this module's own forward outputs as `o` and `lse`. With `sinks` it returns
    `(dq, dk, dv, dsinks)`, dsinks float32 `(heads,)`.
    """
    name = dtype_name(dtype)
    q, k, v, o, do = (round_to_dtype(x, name) for x in (q, k, v, o, do))
    out = run_backward(
        _backward_core(name),
        q,
        k,
        v,
        o,
        np.asarray(lse, dtype=np.float32),
        do,
        work_dtype=np.float32,
        scale=scale,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        keep_mask=keep_mask,
        dropout_p=dropout_p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )
    dq, dk, dv = out[:3]
    grads = (dq, round_to_dtype(dk, name), round_to_dtype(dv, name))
    return grads + tuple(out[3:])  # dsinks stays float32 (the kernels write fp32)
