"""The runner's argument checks, which need no GPU: they run before anything is launched."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from flashgen.generator.families import family
from flashgen.generator.load import load_spec_text
from flashgen.runtime import params_struct
from flashgen.verify.runner import RunnerError, validate

DENSE = load_spec_text("dtype: bf16\nhead_dim: 64\n")[0]
VARLEN_GQA = load_spec_text("dtype: fp16\nhead_dim: 64\nmask: {varlen: true}\ngqa: true\n")[0]


def _qkv(b=1, s=8, h=2, d=64, hk=None):
    hk = h if hk is None else hk
    return (
        np.zeros((b, s, h, d), np.float32),
        np.zeros((b, s, hk, d), np.float32),
        np.zeros((b, s, hk, d), np.float32),
    )


def test_params_struct_is_the_family_table_one_8_byte_word_per_field():
    fam = family(DENSE)
    Params = params_struct(fam)
    assert [name for name, _ in Params._fields_] == [p.name for p in fam.params]
    assert ctypes.sizeof(Params) == 8 * len(fam.params)
    p = Params(seed=2**64 - 1, softmax_scale=0.125, window_left=-1)
    assert (p.seed, p.softmax_scale, p.window_left) == (2**64 - 1, 0.125, -1)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (_qkv(d=32), {}, "head_dim 32, the kernel was generated for 64"),
        (_qkv(hk=1), {}, "gqa: false"),
        ((np.zeros((8, 2, 64), np.float32),) * 3, {}, r"shape \(batch, seqlen, heads, head_dim\)"),
        (_qkv(), {"softmax_scale": 0.0}, "softmax_scale must be finite and > 0"),
        (_qkv(), {"window": (3, 3)}, "mask.window: false"),
        (_qkv(), {"dropout_p": 0.1}, "dropout: false"),
        (_qkv(), {"cu_seqlens_q": [0, 8], "cu_seqlens_k": [0, 8]}, "mask.varlen: false"),
    ],
)
def test_dense_kernel_refuses_what_it_cannot_take(args, kwargs, message):
    with pytest.raises(RunnerError, match=message):
        validate(DENSE, *args, **kwargs)


def test_varlen_lengths_must_cover_the_packed_rows():
    q = np.zeros((10, 4, 64), np.float32)
    k = np.zeros((7, 2, 64), np.float32)
    with pytest.raises(RunnerError, match="end at 10"):
        validate(VARLEN_GQA, q, k, k, cu_seqlens_q=[0, 4, 9], cu_seqlens_k=[0, 3, 7])
    pb = validate(VARLEN_GQA, q, k, k, cu_seqlens_q=[0, 4, 10], cu_seqlens_k=[0, 3, 7])
    assert (pb.batch, pb.seqlen_q, pb.seqlen_k, pb.heads, pb.kv_heads) == (2, 6, 4, 4, 2)


SPARSE = load_spec_text("dtype: bf16\nhead_dim: 64\nsparsity: block\n")[0]


def test_sparse_layout_must_match_the_lengths_and_name_real_tiles():
    from flashgen.verify.blocksparse import compact_layout_for_spec

    q = np.zeros((1, 130, 2, 64), np.float32)
    k = np.zeros((1, 100, 2, 64), np.float32)
    tr, tc = -(-130 // SPARSE.tile.block_m), -(-100 // SPARSE.tile.block_n)
    ok = compact_layout_for_spec(np.ones((1, tr, tc), bool), SPARSE, seqlen_q=130, seqlen_k=100)
    validate(SPARSE, q, k, k, layout=ok)
    other = compact_layout_for_spec(np.ones((1, tr, tc), bool), SPARSE, seqlen_q=130, seqlen_k=128)
    with pytest.raises(RunnerError, match=r"built for \(seqlen_q, seqlen_k\) = \(130, 128\)"):
        validate(SPARSE, q, k, k, layout=other)
    ok.full_idx[0, 0, 0] = -1
    ok.full_count[0, 0] = max(int(ok.full_count[0, 0]), 1)
    with pytest.raises(RunnerError, match="full_idx names K/V tiles outside"):
        validate(SPARSE, q, k, k, layout=ok)


FEATURED = load_spec_text("dtype: bf16\nhead_dim: 64\nsoftcap: true\nalibi: true\nsink: true\n")[0]
SCORE_OK = dict(softcap=30.0, alibi_slopes=np.array([0.5, 0.25]), sinks=np.array([1.0, -1.0]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"softcap": 30.0}, "softcap given but this spec has softcap: false"),
        ({"alibi_slopes": np.ones(2)}, "alibi_slopes given but this spec has alibi: false"),
        ({"sinks": np.zeros(2)}, "sinks given but this spec has sink: false"),
    ],
)
def test_a_kernel_without_a_feature_refuses_its_value(kwargs, message):
    with pytest.raises(RunnerError, match=message):
        validate(DENSE, *_qkv(), **kwargs)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("softcap", "this spec has softcap: true: pass softcap > 0"),
        ("alibi_slopes", "this spec has alibi: true: pass alibi_slopes"),
        ("sinks", "this spec has sink: true: pass sinks"),
    ],
)
def test_a_kernel_with_a_feature_requires_its_value(drop, message):
    kwargs = {k: v for k, v in SCORE_OK.items() if k != drop}
    with pytest.raises(RunnerError, match=message):
        validate(FEATURED, *_qkv(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"softcap": -2.0}, "softcap=-2.0 must be finite and >= 0"),
        ({"alibi_slopes": np.ones(3)}, r"alibi_slopes must have shape \(heads,\) = \(2,\)"),
        ({"alibi_slopes": np.ones((2, 2))}, r"\(batch, heads\) = \(1, 2\), got \(2, 2\)"),
        ({"sinks": np.array([np.nan, 0.0])}, "sinks must be finite"),
    ],
)
def test_bad_score_values_are_named(kwargs, message):
    with pytest.raises(RunnerError, match=message):
        validate(FEATURED, *_qkv(), **{**SCORE_OK, **kwargs})


def test_slopes_and_sinks_are_taken_as_the_fp32_values_the_device_holds():
    third = np.array([1 / 3, 2 / 3])
    pb = validate(FEATURED, *_qkv(), softcap=30.0, alibi_slopes=third, sinks=third)
    want = third.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(pb.score.alibi_slopes, want)
    np.testing.assert_array_equal(pb.score.sinks, want)
    assert pb.score.softcap == 30.0
    assert validate(DENSE, *_qkv()).score.features == frozenset()
