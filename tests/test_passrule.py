"""The pass rule: max|kernel - ref| <= 2 max|baseline - ref| + FlashAttention-3's floor."""

from __future__ import annotations

import numpy as np
import pytest
from flashgen.verify import baseline as B
from flashgen.verify import reference as R
from flashgen.verify.passrule import Verdict, check, check_all, noise_floor

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def test_floor_is_twice_the_rounding_of_adding_and_removing_0_3_in_the_dtype():
    # bf16: 1 + 0.3 -> 1.296875, - 0.3 -> 0.99609375: off by 2**-8, floor 2**-7
    assert noise_floor(np.array([1.0]), "bf16") == 2.0**-7
    # fp16 returns to exactly 1.0: the floor is half an fp16 ulp at 1.0 (the output's rounding)
    assert noise_floor(np.array([1.0]), "fp16") == 2.0**-11
    assert noise_floor(np.array([-135.72]), "fp16") == 2.0**-4  # probe exact; ulp(128) = 1/8
    assert noise_floor(np.array([1.0, -np.inf]), "bf16") == 2.0**-7  # -inf is ignored


def test_an_output_one_rounding_off_passes_and_two_ulps_off_fails():
    """A kernel's float32 value a hair past the midpoint rounds to the reference's other
    neighbour (up to 1 ulp off) while a lucky baseline rounds to the near one; the forward's
    P-rounding (P V with P in fp16, l the float32 sum) does this on the GPU suite's 'wide'
    case (fp16, |o| ~ 136: kernel 0.0986, baseline 0.034). Two ulps off still fails."""
    ref = np.array([-135.7236])
    near, far, farther = -135.75, -135.625, -135.5  # fp16 values: ulp 1/8 above 128
    assert check(np.array([far]), ref, np.array([near]), "fp16").passed
    assert not check(np.array([farther]), ref, np.array([near]), "fp16").passed


def test_a_kernel_as_accurate_as_the_baseline_passes():
    ref = np.linspace(-2, 2, 101)
    base = B.round_to_dtype(ref, "bf16")
    v = check(base, ref, base, "bf16")
    assert v.passed and v.kernel_err == v.baseline_err and 0 < v.ratio < 1
    assert "pass" in v.message


def test_an_exact_kernel_passes_even_with_an_exact_baseline():
    ref = np.array([0.5, 0.25])
    assert check(ref, ref, ref, "fp16").passed


def test_the_bound_is_twice_the_baseline_error_plus_the_floor():
    ref = np.zeros(4)
    base = np.full(4, 1e-3)
    floor = noise_floor(ref, "bf16")
    bound = 2e-3 + floor
    assert check(np.full(4, bound * 0.999), ref, base, "bf16").passed
    failed = check(np.full(4, bound * 1.001), ref, base, "bf16")
    assert not failed.passed and failed.ratio == pytest.approx(bound * 1.001 / (1e-3 + floor))
    assert "FAIL" in failed.message and "worst at index" in failed.message
    assert failed.floor == floor and failed.baseline_err == pytest.approx(1e-3)


def test_nan_or_inf_in_the_kernel_where_the_reference_is_finite_fails():
    ref = np.zeros(3)
    for bad in (np.nan, np.inf, -np.inf):
        v = check(np.array([0.0, bad, 0.0]), ref, ref + 1.0, "fp16")
        assert not v.passed and "NaN/inf" in v.message and v.kernel_err == np.inf


def test_minus_inf_lse_must_match_exactly_and_is_left_out_of_the_maxima():
    ref = np.array([-np.inf, 1.0, 2.0])
    base = np.array([-np.inf, 1.0, 2.0 + 1e-6])
    assert check(np.array([-np.inf, 1.0, 2.0]), ref, base, "fp32").passed
    v = check(np.array([-1e30, 1.0, 2.0]), ref, base, "fp32")
    assert not v.passed and "-inf" in v.message


def test_a_non_finite_baseline_makes_the_rule_undefined():
    with pytest.raises(ValueError, match="baseline"):
        check(np.zeros(2), np.zeros(2), np.array([0.0, np.inf]), "fp16")


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="shapes"):
        check(np.zeros(2), np.zeros(3), np.zeros(3), "fp16")


def test_verdict_is_truthy_when_passed():
    v = Verdict(True, 0.0, 0.0, 0.0, 0.0, "pass")
    assert v and not Verdict(False, 1.0, 0.0, 0.0, 1.0, "FAIL")


def _problem(seed=0, causal="bottom_right"):
    rng = np.random.default_rng(seed)
    q, k, v = (
        B.round_to_dtype(rng.standard_normal(s), "bf16").astype(np.float64)
        for s in ((2, 37, 4, 32), (2, 29, 2, 32), (2, 29, 2, 32))
    )
    return q, k, v


def test_check_all_judges_lse_in_fp32_and_passes_a_correct_kernel():
    q, k, v = _problem()
    o64, lse64 = R.attention_forward(q, k, v, causal="bottom_right")
    ob, lseb = B.attention_forward(q, k, v, dtype="bf16", causal="bottom_right")
    # A correct kernel: the exact result rounded once to its output precision.
    kern = {"o": B.round_to_dtype(o64, "bf16"), "lse": np.float32(lse64)}
    verdicts = check_all(kern, {"o": o64, "lse": lse64}, {"o": ob, "lse": lseb}, "bf16")
    assert set(verdicts) == {"o", "lse"}
    assert all(v.passed for v in verdicts.values()), [v.message for v in verdicts.values()]
    assert verdicts["lse"].floor == noise_floor(lse64, "fp32")
    assert verdicts["o"].floor == noise_floor(o64, "bf16")


def test_check_all_fails_a_kernel_that_ignores_the_causal_mask():
    q, k, v = _problem(1)
    o64, lse64 = R.attention_forward(q, k, v, causal="top_left")
    ob, lseb = B.attention_forward(q, k, v, dtype="bf16", causal="top_left")
    wrong, wrong_lse = B.attention_forward(q, k, v, dtype="bf16")
    verdicts = check_all(
        {"o": wrong, "lse": wrong_lse}, {"o": o64, "lse": lse64}, {"o": ob, "lse": lseb}, "bf16"
    )
    assert not verdicts["o"].passed and not verdicts["lse"].passed


def test_check_all_needs_the_same_output_names():
    with pytest.raises(ValueError, match="names"):
        check_all(
            {"o": np.zeros(1)}, {"o": np.zeros(1), "lse": np.zeros(1)}, {"o": np.zeros(1)}, "fp16"
        )
