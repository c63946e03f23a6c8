"""The pass rule: a kernel passes when its error is at most twice the baseline's, plus a floor.

For one output (O, LSE, a gradient), with `ref` the float64 reference and `baseline` standard
attention in the kernel's precision (`verify.baseline`):

    kernel_err   = max |kernel - ref|
    baseline_err = max |baseline - ref|
    floor        = 2 * max |(r + 0.3 - 0.3) - r|,  r = ref rounded to the dtype, and the
                   +0.3 and -0.3 each done in float32 then rounded to the dtype; for fp16 and
                   bf16 at least half an ulp of max |r| (the output's own rounding), for the
                   float32 LSE at least 8 float32 ulps of max(1, max |r|)
    passed       iff kernel_err <= 2 * baseline_err + floor

The factor 2 on the baseline is FlashAttention's test rule; the floor is FlashAttention-3's
(the rounding noise of one add at the output's magnitude), so an exact baseline does not demand
an exact kernel. Positions where the reference is not finite (the -inf LSE of a row with no
visible key) must hold exactly the same value in the kernel output and are left out of both
maxima. A NaN or inf in the kernel output where the reference is finite always fails. A
non-finite baseline where the reference is finite makes the rule meaningless and raises
`ValueError` (pick inputs the dtype can hold).

`ratio = kernel_err / max(baseline_err + floor, tiny)` says how close a call was: every pass
has ratio <= (2 b + f) / (b + f) <= 2, so a ratio near 2 passed barely and a ratio <= 1 means
the kernel is at least as accurate as the baseline plus the floor. `check_all` applies the rule
to each named output separately.

FP8 KV caches (`kv_dtype: e4m3`, `check_fp8_cache`) follow FlashAttention-3's FP8 tests
(hopper/test_flash_attn.py, test_flash_attn_output and test_flash_attn_kvcache with
float8_e4m3fn): the inputs are the FP8 values themselves, the reference is attention on
the dequantised inputs (`descale * value`; here in float64, `verify.reference_decode`), the
baseline is the same attention in the lower precision on the same dequantised inputs, and
the kernel passes when `err <= rtol * baseline_err + fwd_atol` with FA3's `rtol = 2` (3 with
softcap) and `fwd_atol = 2 * max |ref + 0.3 - 0.3 - ref|`: this module's rule. FA3 loosens
its FP8 baseline by rounding P to e4m3 (its FP8 kernels run P V in FP8); flashgen's FP8-cache
decode keeps q, P and the MMA in the q dtype (only the cache is FP8), so its baseline is the
q-dtype standard attention on the dequantised caches, rounded to the q dtype (an input
rounding the kernel does not make: dequantised values are products of an e4m3 value and an
fp32 descale, which the kernel folds into the fp32 softmax scale and output scale instead).
The multiple is FA3's: 2, 3 with softcap (`FP8_MULTIPLE`, `FP8_MULTIPLE_SOFTCAP`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flashgen.verify.baseline import dtype_name, round_to_dtype

__all__ = [
    "FP8_MULTIPLE",
    "FP8_MULTIPLE_SOFTCAP",
    "TANH_APPROX_REL",
    "check_fp8_cache",
    "Verdict",
    "alibi_floor",
    "check",
    "check_all",
    "noise_floor",
    "output_dtype",
    "score_floor",
    "softcap_floor",
    "usermod_floor",
]

_TINY = float(np.finfo(np.float64).tiny)
# tanh.approx.f32's maximum relative error (PTX ISA: 2^-10.987), the kernels' softcap tanh
TANH_APPROX_REL = 2.0**-10.987


@dataclass(frozen=True)
class Verdict:
    """The pass rule's outcome for one output; errors are max absolute differences."""

    passed: bool
    kernel_err: float
    baseline_err: float
    floor: float
    ratio: float
    message: str

    def __bool__(self) -> bool:
        return self.passed


def noise_floor(ref: Any, dtype: Any) -> float:
    """FlashAttention-3's floor `2 * max |(r + 0.3 - 0.3) - r|` over the finite entries, r = ref
    rounded to `dtype`, each operation rounded to the dtype; at least half an ulp of max |r|
    for fp16 / bf16 and 8 float32 ulps of max(1, max |r|) for fp32 (module doc)."""
    ref = np.asarray(ref, dtype=np.float64)
    r = round_to_dtype(ref[np.isfinite(ref)], dtype)
    up = round_to_dtype(r + np.float32(0.3), dtype)
    back = round_to_dtype(up - np.float32(0.3), dtype)
    diff = np.abs(back.astype(np.float64) - r.astype(np.float64))
    floor = 2.0 * float(diff.max(initial=0.0))
    name = dtype_name(dtype)
    if name in _MANTISSA_BITS:
        # A 16-bit output is rounded once, to the nearest dtype value: an accurate float32 result
        # a hair past a rounding midpoint lands one ulp from the reference's nearest value, an
        # error of up to half an ulp that the rounding alone makes. The +-0.3 probe can round
        # exactly at some magnitudes (fp16 returns to 1.0 exactly; a row of -135.7 likewise), so
        # the floor is at least half an ulp at the output's largest magnitude.
        floor = max(floor, 0.5 * _ulp(float(np.abs(r).max(initial=0.0)), name))
    elif name == "fp32":
        # A float32 output (the LSE) is the sum of a few float32 terms, each computed by the GPU's
        # special-function unit (ex2/lg2.approx: ~2 ulp): the +-0.3 probe can round exactly
        # (a one-element row gives floor 0), so the floor is at least 8 ulp at the output's
        # magnitude. O and gradients (fp16/bf16) keep FlashAttention-3's floor unchanged.
        scale = max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0)))
        floor = max(floor, 8.0 * float(np.finfo(np.float32).eps) * scale)
    return floor


_MANTISSA_BITS = {"fp16": 10, "bf16": 7}  # explicit fraction bits of the 16-bit dtypes
_MIN_NORMAL_EXP = {"fp16": -14, "bf16": -126}


def _ulp(x: float, name: str) -> float:
    """The spacing of `name`'s values at magnitude `x` (subnormal spacing below the normals)."""
    exp = max(int(np.floor(np.log2(x))) if x > 0 else -1000, _MIN_NORMAL_EXP[name])
    return 2.0 ** (exp - _MANTISSA_BITS[name])


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max(initial=0.0))


FP8_MULTIPLE = 2.0  # FA3's rtol for FP8 (and every dtype) without softcap
FP8_MULTIPLE_SOFTCAP = 3.0  # ... with softcap


def check_fp8_cache(
    kernel_out: Any,
    ref64: Any,
    baseline: Any,
    dtype: Any,
    *,
    softcap: bool = False,
    extra_floor: float = 0.0,
) -> Verdict:
    """The pass rule of an FP8-cache decode output (module doc): `ref64` and `baseline` on
    the dequantised caches, FA3's multiple (2, or 3 with softcap) on the baseline's error."""
    return check(
        kernel_out,
        ref64,
        baseline,
        dtype,
        extra_floor=extra_floor,
        multiple=FP8_MULTIPLE_SOFTCAP if softcap else FP8_MULTIPLE,
    )


def check(
    kernel_out: Any,
    ref64: Any,
    baseline: Any,
    dtype: Any,
    *,
    extra_floor: float = 0.0,
    multiple: float = 2.0,
) -> Verdict:
    """The pass rule for one output (any shape; the three arrays must have the same one).

    `dtype` is the precision of the kernel output: 'fp16' / 'bf16' for O and gradients,
    'fp32' for the LSE (or an enum with that `.yaml`).
    """
    name = dtype_name(dtype)
    kern = np.asarray(kernel_out, dtype=np.float64)
    ref = np.asarray(ref64, dtype=np.float64)
    base = np.asarray(baseline, dtype=np.float64)
    if not kern.shape == ref.shape == base.shape:
        raise ValueError(
            f"shapes differ: kernel {kern.shape}, reference {ref.shape}, baseline {base.shape}"
        )
    if np.isnan(ref).any():
        raise ValueError("the reference holds NaN; it never should")
    finite = np.isfinite(ref)
    if not np.isfinite(base[finite]).all():
        raise ValueError(
            f"the {name} baseline is not finite where the reference is: the pass rule is "
            "undefined for these inputs (out of the dtype's range?)"
        )
    # `extra_floor` (default 0) lets a caller raise the floor to a stated error bound of the
    # kernel's arithmetic that the baseline does not share (see score_floor).
    floor = max(noise_floor(ref, name), float(extra_floor))
    baseline_err = _max_abs(base[finite], ref[finite])
    bound = multiple * baseline_err + floor

    problems = []
    special_bad = int(np.count_nonzero(~finite & (kern != ref)))
    if special_bad:
        problems.append(f"{special_bad} entries where the reference is -inf/inf differ")
    kf = kern[finite]
    nonfinite = int(np.count_nonzero(~np.isfinite(kf)))
    if nonfinite:
        problems.append(f"{nonfinite} NaN/inf entries where the reference is finite")
        kernel_err = float("inf")
    else:
        kernel_err = _max_abs(kf, ref[finite])
    ratio = kernel_err / max(baseline_err + floor, _TINY)
    if kernel_err > bound:
        worst = ""
        if not nonfinite:
            err = np.abs(np.where(finite, kern, 0.0) - np.where(finite, ref, 0.0))
            index = tuple(int(x) for x in np.unravel_index(int(np.argmax(err)), ref.shape))
            worst = f" (worst at index {index})"
        problems.append(
            f"max error {kernel_err:.3g} > {multiple:g} * baseline {baseline_err:.3g} + floor "
            f"{floor:.3g}"
            f" = {bound:.3g}{worst}"
        )
    passed = not problems
    message = (
        f"pass: max error {kernel_err:.3g} <= {bound:.3g} (ratio {ratio:.3g})"
        if passed
        else "FAIL: " + "; ".join(problems)
    )
    return Verdict(passed, kernel_err, baseline_err, floor, ratio, message)


def output_dtype(output_name: str, dtype: Any) -> str:
    """The precision an output is stored in: LSE outputs are float32, the rest `dtype`."""
    return "fp32" if "lse" in output_name.lower() else dtype_name(dtype)


def check_all(
    kernel_outputs: Mapping[str, Any],
    refs: Mapping[str, Any],
    baselines: Mapping[str, Any],
    dtype: Any,
) -> dict[str, Verdict]:
    """`check` applied to each named output (e.g. 'o', 'lse', 'dq', 'dk', 'dv').

    The three mappings must have the same keys. Outputs whose name contains 'lse' are judged
    in float32 (the kernels store the LSE in float32); the others in `dtype`. The overall
    verdict is `all(v.passed for v in result.values())`.
    """
    keys = set(kernel_outputs)
    if keys != set(refs) or keys != set(baselines):
        raise ValueError(
            f"output names differ: kernel {sorted(kernel_outputs)}, reference {sorted(refs)}, "
            f"baseline {sorted(baselines)}"
        )
    return {
        key: check(kernel_outputs[key], refs[key], baselines[key], output_dtype(key, dtype))
        for key in kernel_outputs
    }


def score_floor(q: Any, k: Any, scale: float) -> float:
    """The standard error bound of float32 dot products, for outputs that carry a raw score.

    Tensor cores accumulate Q K^T in float32 in their own order (not round-to-nearest between
    partial sums), which NumPy's float32 baseline does not reproduce; an LSE near a row's max
    score inherits that error. The classic bound for a length-d float32 dot product,
    `d * eps32 * sum_k |q_k| |k_k|`, scaled, is the most that may be blamed on it.
    Shapes `(..., seqlen, heads, d)` or any pair whose last axes are the head dim.
    """
    qa = np.abs(np.asarray(q, dtype=np.float64)).reshape(-1, np.shape(q)[-1])
    ka = np.abs(np.asarray(k, dtype=np.float64)).reshape(-1, np.shape(k)[-1])
    d = qa.shape[-1]
    if qa.size == 0 or ka.size == 0:
        return 0.0
    # max over (query row, key row) pairs, across batches and heads too: a slight over-estimate
    worst = float((qa @ ka.T).max())
    return d * float(np.finfo(np.float32).eps) * scale * worst


def alibi_floor(alibi_slopes: Any, max_distance: int) -> float:
    """The float32 error bound of the ALiBi bias, for outputs that carry a logit (the LSE).

    The kernels form `slope * |dist|` in float32 in units of their own (the slope divided by
    the softmax scale, the product times `scale * log2 e` with the scores): a few roundings,
    each of relative `eps32`, of a bias up to `max |slope| * max_distance`, which the float32
    baseline (one rounding) does not share. 4 eps32 of that bias is the most that may be
    blamed on it; 0 without slopes. `max_distance` bounds `|i + shift - j|` (`Sq + Sk`)."""
    if alibi_slopes is None:
        return 0.0
    slope = float(np.abs(np.asarray(alibi_slopes, dtype=np.float64)).max(initial=0.0))
    return 4.0 * float(np.finfo(np.float32).eps) * slope * float(max_distance)


def usermod_floor(score_params: Any, max_distance: int) -> float:
    """The float32 error bound of a score_mod's logit, for outputs that carry a logit (the LSE).

    The kernel evaluates the expression in float32 in the emitted order (the baseline's
    float32 evaluation shares that order) but with `__expf` / `__logf` (a few ulp) and its
    own rounding of s = scale x; a logit built from parameters of magnitude up to M, possibly
    times a distance (ALiBi written as an expression), carries a few float32 roundings of
    `M * (1 + max_distance)`. 8 eps32 of that is the most blamed on it; 0 without a score_mod
    (`score_params` None). A floor for the GPU run to confirm, not a derived bound."""
    if score_params is None:
        return 0.0
    m = 1.0
    for value in score_params.values():
        arr = np.abs(np.asarray(value, dtype=np.float64))
        m = max(m, float(arr.max(initial=0.0)))
    return 8.0 * float(np.finfo(np.float32).eps) * m * (1.0 + float(max_distance))


def softcap_floor(softcap: float) -> float:
    """The error bound of the kernels' capped logit, for outputs that carry a logit (the LSE).

    The kernels take `t = tanh(scale x / c)` from tanh.approx.f32 (relative error 2^-10.987,
    one MUFU instruction), so the logit `c t` may be off by `2^-10.987 c`; the baseline's
    capped score is rounded to the dtype instead, an error of the same order for fp16 that
    need not land where the kernel's does. 0 without softcap."""
    return TANH_APPROX_REL * float(softcap) if softcap else 0.0
