"""The backward runner's argument checks and workspace carve, which need no GPU."""

from __future__ import annotations

import numpy as np
import pytest
from flashgen.generator.load import load_spec_text
from flashgen.verify.blocksparse import compact_layout_for_spec
from flashgen.verify.runner import RunnerError
from flashgen.verify.runner_bwd import BwdKernel, validate_bwd, workspace_layout

BWD = load_spec_text("kernel: backward\ndtype: bf16\nhead_dim: 64\n")[0]
BWD_VARLEN = load_spec_text(
    "kernel: backward\ndtype: fp16\nhead_dim: 64\nmask: {varlen: true}\ngqa: true\n"
)[0]
BWD_SPARSE = load_spec_text("kernel: backward\ndtype: bf16\nhead_dim: 64\nsparsity: block\n")[0]
FWD = load_spec_text("dtype: bf16\nhead_dim: 64\n")[0]


def _args(b=1, sq=8, sk=8, h=2, d=64):
    q = np.zeros((b, sq, h, d), np.float32)
    k = np.zeros((b, sk, h, d), np.float32)
    return q, k, k.copy(), q.copy(), np.zeros((b, h, sq), np.float32), q.copy()


def test_valid_arguments_pass():
    pb = validate_bwd(BWD, *_args(b=2, sq=9, sk=5))
    assert (pb.batch, pb.seqlen_q, pb.seqlen_k, pb.heads) == (2, 9, 5, 2)


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (3, np.zeros((1, 7, 2, 64), np.float32), "o must have q's shape"),
        (5, np.zeros((1, 8, 2, 64), np.int32), "dout must be a floating array"),
        (4, np.zeros((1, 8, 2), np.float32), r"lse must have shape \(batch, heads, seqlen_q\)"),
        (4, np.full((1, 2, 8), np.nan, np.float32), "no NaN"),
        (4, [[[0.0] * 8] * 2], "lse must be a numpy array"),
        (0, np.zeros((1, 8, 2, 32), np.float32), "head_dim 32"),
    ],
)
def test_bad_arguments_are_named(index, bad, message):
    args = list(_args())
    args[index] = bad
    with pytest.raises(RunnerError, match=message):
        validate_bwd(BWD, *args)


def test_minus_inf_lse_is_allowed():
    args = list(_args())
    args[4] = np.full((1, 2, 8), -np.inf, np.float32)
    validate_bwd(BWD, *args)


def test_varlen_lse_is_heads_by_total_rows():
    q = np.zeros((10, 4, 64), np.float32)
    k = np.zeros((7, 2, 64), np.float32)
    cu = dict(cu_seqlens_q=[0, 4, 10], cu_seqlens_k=[0, 3, 7])
    validate_bwd(BWD_VARLEN, q, k, k, q, np.zeros((4, 10), np.float32), q, **cu)
    with pytest.raises(RunnerError, match=r"\(heads, total_q\)"):
        validate_bwd(BWD_VARLEN, q, k, k, q, np.zeros((2, 4, 6), np.float32), q, **cu)


def test_the_layout_is_the_forwards_for_this_kernels_tiles():
    q, k, v, o, lse, do = _args(sq=130, sk=100)
    tr, tc = -(-130 // BWD_SPARSE.tile.block_m), -(-100 // BWD_SPARSE.tile.block_n)
    lay = compact_layout_for_spec(
        np.ones((1, tr, tc), bool), BWD_SPARSE, seqlen_q=130, seqlen_k=100
    )
    validate_bwd(BWD_SPARSE, q, k, v, o, lse, do, layout=lay)
    with pytest.raises(RunnerError, match="pass layout="):
        validate_bwd(BWD_SPARSE, q, k, v, o, lse, do)


def test_forward_specs_are_refused():
    with pytest.raises(RunnerError, match="forward kernel"):
        validate_bwd(FWD, *_args())
    with pytest.raises(RunnerError, match="forward kernel"):
        BwdKernel(FWD)


def test_workspace_is_dq_accum_then_dsum_each_rounded_to_256_bytes():
    ws = workspace_layout(batch=3, seqlen_q=5, heads=2, head_dim=64)
    rows = 3 * 5 * 2
    assert ws["dq_accum"] == 0
    assert ws["dsum"] == -(-rows * 64 * 4 // 256) * 256 == 7680
    assert ws["bytes"] == 7680 + 256
    assert ws["dq_sem"] is None
    assert workspace_layout(batch=0, seqlen_q=0, heads=1, head_dim=64)["bytes"] == 0


def test_deterministic_builds_add_one_int32_per_query_tile():
    ws = workspace_layout(
        batch=3, seqlen_q=130, heads=2, head_dim=64, block_m=64, deterministic=True
    )
    rows = 3 * 130 * 2
    dq_accum, dsum = -(-rows * 256 // 256) * 256, -(-rows * 4 // 256) * 256
    assert (ws["dsum"], ws["dq_sem"]) == (dq_accum, dq_accum + dsum)
    assert ws["bytes"] == dq_accum + dsum + 256  # 3 * 2 * 3 counters, rounded up


BWD_SINK = load_spec_text("kernel: backward\ndtype: bf16\nhead_dim: 64\nsink: true\n")[0]


def test_the_backward_checks_the_score_values_like_the_forward():
    validate_bwd(BWD_SINK, *_args(), sinks=np.zeros(2))
    with pytest.raises(RunnerError, match="this spec has sink: true: pass sinks"):
        validate_bwd(BWD_SINK, *_args())
    with pytest.raises(RunnerError, match="alibi_slopes given but this spec has alibi: false"):
        validate_bwd(BWD_SINK, *_args(), sinks=np.zeros(2), alibi_slopes=np.ones(2))
