"""The runner's argument checks, which need no GPU: they run before anything is launched."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from flashgen.generator.families import family
from flashgen.generator.launch import params_struct
from flashgen.generator.load import load_spec_text
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
