"""The one launch path without a GPU: a kernel built into its host library, loaded through
ctypes, and its C launcher's checks called from Python (`flashgen.runtime`)."""

from __future__ import annotations

import re
import shutil

import pytest
from flashgen.generator.compile import compile_specs
from flashgen.generator.load import load_spec_text
from flashgen.runtime import KernelLibrary, LaunchError

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH"),
]

DENSE = load_spec_text("dtype: bf16\nhead_dim: 32\n")[0]
GOOD = {
    "q": 0x1000,
    "k": 0x2000,
    "v": 0x3000,
    "o": 0x4000,
    "lse": 0x5000,
    "q_row_stride": 128,
    "batch": 1,
    "heads": 2,
    "kv_heads": 2,
    "seqlen_q": 3,
    "seqlen_k": 4,
    "softmax_scale": 0.125,
    "window_left": -1,
    "window_right": -1,
    "head_dim": 32,
    "head_dim_v": 32,
}


def _built(tmp_path_factory, spec, folder: str) -> KernelLibrary:
    """`spec`'s kernel built into its host library in a fresh folder, loaded."""
    out = tmp_path_factory.mktemp(folder)
    (res,) = compile_specs([spec], out, jobs=1, progress=False)
    assert res.ok, res.error
    return KernelLibrary(spec, out)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return _built(tmp_path_factory, DENSE, "libs")


def test_the_c_launcher_accepts_good_parameters(library):
    assert library.check(GOOD) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": 0x2008}, "16-byte aligned"),
        ({"q_row_stride": 100}, "multiples of 8 elements"),
        ({"lse": 0}, "must all be non-null"),
        ({"kv_heads": 1}, "kv_heads must equal heads"),
        ({"softmax_scale": float("nan")}, "softmax_scale must be finite"),
        ({"seqlen_q": -1}, "must be >= 0"),
        ({"head_dim": 0}, "head_dim and head_dim_v must both be 32"),
        ({"head_dim_v": 64}, "head_dim and head_dim_v must both be 32"),
    ],
)
def test_the_c_launcher_names_what_is_wrong(library, change, message):
    assert message in library.check({**GOOD, **change})
    with pytest.raises(LaunchError, match=message):
        library.launch({**GOOD, **change})


def test_unknown_fields_are_refused_before_the_launcher(library):
    with pytest.raises(KeyError, match="unknown fg_fwd_params fields"):
        library.check({"qq": 1})


def test_a_missing_library_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `flashgen compile`"):
        KernelLibrary(DENSE, tmp_path)


# The Hopper forward (sm_90a) adds TMA's rules to the checks, as host arithmetic (no driver).
HOPPER = load_spec_text("dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n")[0]
D, H, SQ, SK = 64, 2, 3, 4
HOPPER_GOOD = {
    **GOOD,
    "head_dim": D,
    "head_dim_v": D,
    **{f"{t}_{k}": v for t in "qo" for k, v in
       (("batch_stride", SQ * H * D), ("row_stride", H * D), ("head_stride", D))},
    **{f"{t}_{k}": v for t in "kv" for k, v in
       (("batch_stride", SK * H * D), ("row_stride", H * D), ("head_stride", D))},
}  # fmt: skip


@pytest.fixture(scope="module")
def hopper(tmp_path_factory):
    return _built(tmp_path_factory, HOPPER, "libs90a")


def test_the_hopper_launcher_accepts_good_parameters(hopper):
    assert hopper.check(HOPPER_GOOD) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 0x3008}, "16-byte aligned"),
        ({"q_head_stride": 0}, "positive row, head and batch strides"),
        ({"k_batch_stride": 2**40}, "below 2^40 bytes"),
        ({"v_row_stride": D, "v_head_stride": SK * D}, "k and v must order their strides alike"),
    ],
)
def test_the_hopper_launcher_names_tmas_rules(hopper, change, message):
    assert message in hopper.check({**HOPPER_GOOD, **change})
    with pytest.raises(LaunchError, match=re.escape(message)):
        hopper.launch({**HOPPER_GOOD, **change})


# Varlen on the Hopper forward: the tensor maps span the packed tensors, whose rows the
# launcher can only learn from total_q / total_k (cu_seqlens are on the device).
HOPPER_VARLEN = load_spec_text(
    "dtype: bf16\nhead_dim: 64\ntarget: sm_90a\nmask: {causal: bottom_right, varlen: true}\n"
)[0]
TQ, TK = 7, 9  # two sequences: q (3, 4), k (4, 5); seqlen_q, seqlen_k are the maxima
HOPPER_VARLEN_GOOD = {
    **HOPPER_GOOD,
    "cu_seqlens_q": 0x6000,
    "cu_seqlens_k": 0x7000,
    "batch": 2,
    "seqlen_q": 4,
    "seqlen_k": 5,
    "total_q": TQ,
    "total_k": TK,
    **{f"{t}_batch_stride": 0 for t in "qkvo"},  # packed: unused
    "lse_batch_stride": 0,
    "lse_head_stride": TQ,
}


@pytest.fixture(scope="module")
def hopper_varlen(tmp_path_factory):
    return _built(tmp_path_factory, HOPPER_VARLEN, "libs90a_varlen")


# Varlen on the Hopper backward: the same totals, for its four loaded tensors' maps (dq_accum's
# map stays dense: batch x the longest sequence).
HOPPER_BWD_VARLEN = load_spec_text(
    "kernel: backward\ndtype: bf16\nhead_dim: 64\ntarget: sm_90a\n"
    "mask: {causal: bottom_right, varlen: true}\n"
)[0]
HOPPER_BWD_VARLEN_GOOD = {
    **{t: 0x1000 * (i + 1) for i, t in enumerate(
        ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "dsum"))},
    **{f"{t}_{k}": v for t in ("q", "o", "do", "dq", "k", "v", "dk", "dv") for k, v in
       (("batch_stride", 0), ("row_stride", H * D), ("head_stride", D))},
    "lse_batch_stride": 0,
    "lse_head_stride": TQ,
    "cu_seqlens_q": 0x20000,
    "cu_seqlens_k": 0x21000,
    "batch": 2,
    "heads": H,
    "kv_heads": H,
    "seqlen_q": 4,
    "seqlen_k": 5,
    "total_q": TQ,
    "total_k": TK,
    "softmax_scale": 0.125,
    "window_left": -1,
    "window_right": -1,
    "head_dim": D,
    "head_dim_v": D,
}  # fmt: skip


@pytest.fixture(scope="module")
def hopper_bwd_varlen(tmp_path_factory):
    return _built(tmp_path_factory, HOPPER_BWD_VARLEN, "libs90a_bwd_varlen")


VARLEN_LAUNCHERS = {
    "hopper_varlen": HOPPER_VARLEN_GOOD,
    "hopper_bwd_varlen": HOPPER_BWD_VARLEN_GOOD,
}


@pytest.mark.parametrize("lib", VARLEN_LAUNCHERS)
def test_the_hopper_varlen_launchers_accept_packed_tensors_with_their_totals(request, lib):
    # (batch strides 0: a packed tensor has none, and TMA's stride rule does not apply to them)
    assert request.getfixturevalue(lib).check(VARLEN_LAUNCHERS[lib]) is None


@pytest.mark.parametrize(
    ("lib", "change", "message"),
    [
        ("hopper_varlen", {"total_q": 0}, "varlen needs total_q"),
        ("hopper_varlen", {"total_k": 4}, "varlen needs total_k"),
        ("hopper_varlen", {"total_k": 2**31}, "below 2^31"),
        ("hopper_bwd_varlen", {"total_q": 3}, "varlen needs total_q"),
        ("hopper_bwd_varlen", {"total_k": 0}, "varlen needs total_k"),
        ("hopper_bwd_varlen", {"total_q": 2**31}, "below 2^31"),
        ("hopper_bwd_varlen", {"do_row_stride": 100}, "multiples of 8 elements"),
    ],
)
def test_the_hopper_varlen_launchers_name_what_is_wrong(request, lib, change, message):
    library, params = request.getfixturevalue(lib), {**VARLEN_LAUNCHERS[lib], **change}
    assert message in library.check(params)
    with pytest.raises(LaunchError, match=re.escape(message)):
        library.launch(params)
