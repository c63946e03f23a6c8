"""flash_attn_with_kvcache / merge_states without torch or a GPU: the decode spec a call
derives (the shipped specs for the shipped kinds of call), the mask normalisation against
flash-attn's definition, and every refusal of `flashgen.torch.kvcache_select`. The GPU side
is tests/gpu/test_torch_kvcache.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import subprocess
import sys

import numpy as np
import pytest
from flashgen.generator.families import family
from flashgen.generator.families.decode import HEAD_DIMS as DECODE_HEAD_DIMS
from flashgen.generator.features import FEATURES
from flashgen.generator.load import load_paths
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import PACKAGE_ROOT
from flashgen.generator.spec import Causal, Dtype, KernelKind, Target
from flashgen.torch.kvcache_select import (
    CacheInputError,
    DecodeCall,
    check_kvcache,
    check_merge,
    check_paged_kv,
    check_prep,
    decode_mask,
    decode_spec,
    describe_errors,
    kvcache_window,
    merge_spec,
    used_strides,
    window_pair,
)
from flashgen.torch.selection import TensorMeta, UnsupportedCall, score_features

H200 = (9, 0)


def meta(shape, dtype="bfloat16", device="cuda", stride=None) -> TensorMeta:
    if stride is None:
        stride, acc = [], 1
        for n in reversed(shape):
            stride.insert(0, acc)
            acc *= n
    return TensorMeta(tuple(shape), tuple(stride), dtype, device)


def contiguous(batch=2, sq=1, heads=8, kv=2, d=128, cap=300, **kw):
    q, kc = meta((batch, sq, heads, d)), meta((batch, cap, kv, d))
    return check_kvcache(q, kc, kc, cache_seqlens=meta((batch,), "int32"), **kw)


def paged(batch=2, sq=1, heads=8, kv=2, d=128, pages=10, page=64, cols=4, table=None, **kw):
    q, kc = meta((batch, sq, heads, d)), meta((pages, page, kv, d))
    bt = table if table is not None else meta((batch, cols), "int32")
    return check_kvcache(q, kc, kc, cache_seqlens=meta((batch,), "int32"), block_table=bt, **kw)


# -- the call -> its spec ----------------------------------------------------------------------


def test_shipped_kinds_of_call_derive_the_shipped_specs():
    shipped = [
        s for s in load_paths([PACKAGE_ROOT / "specs" / "decode.yaml"]) if not s.instrument_io
    ]
    assert shipped
    for s in shipped:
        call = DecodeCall(s.dtype, s.head_dim, H200, s.paged, s.mask.causal, s.mask.window)
        assert kernel_name(decode_spec(call)) == kernel_name(s)


def test_spec_fields_and_targets():
    spec = decode_spec(DecodeCall(Dtype.FP16, 64, (8, 0), True, Causal.BOTTOM_RIGHT, True))
    assert spec.kernel.yaml == "decode" and spec.paged and spec.gqa and spec.tile_auto
    assert spec.target is Target.SM80 and spec.head_dim == 64 and spec.dtype is Dtype.FP16
    assert decode_spec(DecodeCall(Dtype.BF16, 128, H200)).target is Target.SM90  # not sm_90a
    with pytest.raises(UnsupportedCall, match=r"compute capability 7\.5"):
        decode_spec(DecodeCall(Dtype.BF16, 128, (7, 5)))


# Head dims the decode family does not serve (asked of it: the list follows the family).
UNSERVED = [d for d in (16, 59, 96, 111, 256, 300) if not family(KernelKind.DECODE).head_dim_ok(d)]
DECODE_DIMS = ", ".join(map(str, DECODE_HEAD_DIMS))


@pytest.mark.parametrize("d", UNSERVED)
def test_head_dims_without_a_decode_kernel_are_refused(d):
    with pytest.raises(UnsupportedCall, match=rf"head_dim {d} has no decode kernel.*{DECODE_DIMS}"):
        decode_spec(DecodeCall(Dtype.BF16, d, H200))


def test_merge_uses_the_contiguous_unmasked_kernel():
    spec = merge_spec(Dtype.BF16, 128, H200)
    assert kernel_name(spec) == kernel_name(decode_spec(DecodeCall(Dtype.BF16, 128, H200)))
    assert not spec.paged and spec.mask.causal is Causal.NONE and not spec.mask.window


# -- the mask ----------------------------------------------------------------------------------


def flash_attn_mask(causal, window, sq, sk) -> np.ndarray:
    """flash-attn's kvcache mask, from its definition: bottom-right aligned, causal sets
    right = 0, -1 unbounded."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def kernel_mask(spec_causal, spec_window, runtime, sq, sk) -> np.ndarray:
    """What a decode kernel of that spec computes with that runtime window (mask.cuh)."""
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if spec_causal is not Causal.NONE:
        ok &= j <= i
    if spec_window:
        left, right = runtime
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
    return ok


def test_the_normalised_mask_is_flash_attn_s_mask():
    sides = [-1, 0, 1, 3, 17]
    for causal, left, right, sq in itertools.product((False, True), sides, sides, (1, 2, 5, 16)):
        got = decode_mask(causal, (left, right), sq)
        for sk in (sq, sq + 1, sq + 7, 40):
            want = flash_attn_mask(causal, (left, right), sq, sk)
            assert np.array_equal(kernel_mask(*got, sq, sk), want), (causal, left, right, sq, sk)


@pytest.mark.parametrize(
    ("causal", "window", "sq", "want"),
    [
        (False, (-1, -1), 1, (Causal.NONE, False, (-1, -1))),
        (True, (-1, -1), 1, (Causal.NONE, False, (-1, -1))),  # one query: causal is moot
        (True, (-1, -1), 2, (Causal.BOTTOM_RIGHT, False, (-1, -1))),
        (True, (100, -1), 1, (Causal.BOTTOM_RIGHT, True, (100, 0))),  # shipped causalbr_win
        (False, (100, -1), 1, (Causal.BOTTOM_RIGHT, True, (100, 0))),
        (False, (-1, 5), 1, (Causal.NONE, False, (-1, -1))),
        (True, (100, -1), 4, (Causal.BOTTOM_RIGHT, True, (100, 0))),
        (False, (100, 3), 4, (Causal.NONE, True, (100, 3))),
    ],
)
def test_mask_normalisation_picks_shipped_kinds(causal, window, sq, want):
    assert decode_mask(causal, window, sq) == want


def test_bad_mask_arguments_are_refused():
    with pytest.raises(UnsupportedCall, match="window_size"):
        decode_mask(False, (-2, 0), 1)
    with pytest.raises(UnsupportedCall, match="causal must be True or False"):
        decode_mask(1, (-1, -1), 1)


# -- accepted calls ----------------------------------------------------------------------------


def test_contiguous_call_sizes():
    pb = contiguous(batch=3, sq=4, heads=16, kv=2, d=64, cap=1000)
    assert (pb.batch, pb.seqlen_q, pb.heads, pb.kv_heads, pb.head_dim) == (3, 4, 16, 2, 64)
    assert not pb.paged and pb.capacity == 1000 and pb.dtype is Dtype.BF16


def test_paged_call_sizes():
    pb = paged(batch=2, pages=10, page=32, cols=5)
    assert pb.paged and pb.capacity == 160 and pb.page_size == 32
    assert (pb.num_pages, pb.max_pages, pb.block_table_stride) == (10, 5, 5)
    wide = meta((2, 5), "int32", stride=(8, 1))  # a view of a wider table
    assert paged(cols=5, table=wide).block_table_stride == 8


def test_int_and_missing_cache_seqlens():
    q, kc = meta((2, 1, 8, 128)), meta((2, 300, 2, 128))
    assert check_kvcache(q, kc, kc, cache_seqlens=300).capacity == 300
    assert check_kvcache(q, kc, kc, cache_seqlens=0).capacity == 300
    assert check_kvcache(q, kc, kc, cache_seqlens=None).capacity == 300
    for bad in (301, -1):
        with pytest.raises(UnsupportedCall, match=rf"cache_seqlens={bad} is outside 0\.\.300"):
            check_kvcache(q, kc, kc, cache_seqlens=bad)
    with pytest.raises(UnsupportedCall, match="cache_seqlens must be"):
        check_kvcache(q, kc, kc, cache_seqlens=2.0)


def test_strides_of_size_one_dimensions_do_not_matter():
    q = meta((1, 1, 8, 128), stride=(3, 5, 128, 1))  # batch 1, one query: strides unused
    kc = meta((1, 300, 2, 128))
    check_kvcache(q, kc, kc, cache_seqlens=meta((1,), "int32"))
    assert used_strides(q) == (0, 0, 128, 1)


def test_gqa_mqa_and_zero_sizes():
    assert contiguous(heads=8, kv=1).kv_heads == 1
    assert contiguous(heads=4, kv=4).kv_heads == 4
    assert contiguous(batch=0).batch == 0
    assert contiguous(sq=0).seqlen_q == 0
    assert contiguous(sq=16).seqlen_q == 16


# -- refusals ----------------------------------------------------------------------------------


# -- the composite path's host checks (appending, rotary, batch indices, left padding) ----------


def prep_call(batch=2, sq=1, heads=8, kv=2, d=64, cap=32, paged=False, **kw):
    """check_prep of a call with these sizes; keyword arguments replace the tensors' metas
    (True: the default meta of that argument)."""
    q = meta((batch, sq, heads, d))
    cache = meta((3 * batch, 16, kv, d)) if paged else meta((batch, cap, kv, d))
    defaults = {
        "k": meta((batch, 2, kv, d)),
        "v": meta((batch, 2, kv, d)),
        "rotary_cos": meta((cap, 8), "bfloat16"),
        "rotary_sin": meta((cap, 8), "bfloat16"),
        "cache_batch_idx": meta((batch,), "int32"),
        "cache_leftpad": meta((batch,), "int32"),
    }
    args = {"cache_seqlens": meta((batch,), "int32")}
    if paged:
        args["block_table"] = meta((batch, cap // 16), "int32")
    for name, value in kw.items():
        args[name] = defaults[name] if value is True else value
    return check_prep(q, args.pop("k_cache", cache), args.pop("v_cache", cache), **args)


def test_composite_call_sizes():
    pc = prep_call(k=True, v=True, rotary_cos=True, rotary_sin=True, cache_leftpad=True)
    assert (pc.batch, pc.seqlen_q, pc.heads, pc.kv_heads, pc.head_dim) == (2, 1, 8, 2, 64)
    assert (pc.capacity, pc.cache_rows, pc.seqlen_new) == (32, 2, 2)
    assert (pc.rotary_dim, pc.rotary_rows, pc.decode, pc.paged) == (16, 32, True, False)
    long = prep_call(sq=300, paged=True, cap=64)
    assert not long.decode and long.paged and long.capacity == 64 and long.page_size == 16
    assert (long.num_pages, long.max_pages, long.cache_rows) == (6, 4, 0)
    # any number of cache rows with cache_batch_idx; float32 tables; rotary_dim up to d
    many = meta((7, 32, 2, 64))
    assert prep_call(k_cache=many, v_cache=many, cache_batch_idx=True).cache_rows == 7
    f32 = meta((40, 32), "float32")
    assert prep_call(k=True, v=True, rotary_cos=f32, rotary_sin=f32).rotary_dim == 64
    assert prep_call(k=True, v=True, cache_seqlens=30).seqlen_new == 2  # 30 + 2 fits 32


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"k": True}, r"k without v: k and v append new tokens together"),
        ({"v": True}, r"v without k"),
        ({"k": meta((2, 2, 8, 64)), "v": meta((2, 2, 8, 64))},
         r"k has shape \(2, 2, 8, 64\); it must be \(batch, seqlen_new, kv_heads, head_dim\) = "
         r"\(2, 2, 2, 64\)"),
        ({"k": True, "v": meta((2, 3, 2, 64))}, r"v has shape \(2, 3, 2, 64\)"),
        ({"k": True, "v": meta((2, 2, 2, 64), "float16")}, r"v has dtype float16 but q has"),
        ({"k": True, "v": meta((2, 2, 2, 64), device="cpu")}, r"v is on device 'cpu'"),
        ({"k": meta((2, 33, 2, 64)), "v": meta((2, 33, 2, 64))},
         r"k has seqlen_new 33, more than the cache's capacity 32"),
        ({"k": True, "v": True, "cache_seqlens": None}, r"cache_seqlens is required with k, v"),
        ({"k": True, "v": True, "cache_seqlens": 31},
         r"cache_seqlens=31 is outside 0\.\.30 \(the cache's capacity 32, less the 2"),
        ({"rotary_cos": True, "rotary_sin": True}, r"rotary_cos/rotary_sin need k and v"),
        ({"k": True, "v": True, "rotary_cos": True},
         r"rotary_cos and rotary_sin: both or neither"),
        ({"k": True, "v": True, "rotary_cos": meta((31, 8)), "rotary_sin": meta((31, 8))},
         r"rotary_cos has 31 rows; it needs at least the cache's capacity 32"),
        ({"k": True, "v": True, "rotary_cos": meta((32, 33)), "rotary_sin": meta((32, 33))},
         r"rotary_dim = 2 \* 33 = 66 exceeds head_dim 64"),
        ({"k": True, "v": True, "rotary_cos": meta((32, 8), "float16"),
          "rotary_sin": meta((32, 8), "float16")},
         r"rotary_cos has dtype float16; allowed: q's bfloat16 \(as flash-attn\) or float32"),
        ({"k": True, "v": True, "rotary_cos": True, "rotary_sin": meta((32, 4))},
         r"rotary_sin \(32, 4\) and rotary_cos \(32, 8\) must have the same shape"),
        ({"k": True, "v": True, "rotary_cos": meta((32,)), "rotary_sin": meta((32,))},
         r"rotary_cos has 1 dimensions \(32,\); it must be \(rotary_rows, rotary_dim / 2\)"),
        ({"cache_batch_idx": meta((2,), "int64")},
         r"cache_batch_idx must be an int32 tensor of shape \(2,\)"),
        ({"cache_leftpad": meta((3,), "int32")},
         r"cache_leftpad must be an int32 tensor of shape \(2,\)"),
        ({"cache_leftpad": meta((2,), "int32", device="cpu")},
         r"cache_leftpad is on device 'cpu'"),
        ({"k_cache": meta((3, 32, 2, 64)), "v_cache": meta((3, 32, 2, 64))},
         r"q has batch 2 but k_cache has 3; .*any number of rows with cache_batch_idx"),
        ({"k_cache": meta((0, 32, 2, 64)), "v_cache": meta((0, 32, 2, 64)),
          "cache_batch_idx": True}, r"k_cache has no rows; cache_batch_idx needs"),
        ({"num_splits": 129}, r"num_splits=129: allowed 0"),
        ({"softmax_scale": 0.0}, r"softmax_scale must be finite and > 0"),
    ],
)  # fmt: skip
def test_composite_refusals_name_the_argument_and_what_is_allowed(kw, match):
    with pytest.raises(UnsupportedCall, match=match):
        prep_call(**kw)


@pytest.mark.parametrize("name", ["cache_batch_idx", "cache_leftpad"])
def test_batch_indices_and_left_padding_are_not_served_with_pages(name):
    with pytest.raises(UnsupportedCall, match=rf"{name} with a block_table: not served"):
        prep_call(paged=True, **{name: True})


def test_the_shared_rules_match_check_kvcache():
    """Dtypes, devices, dimensions, head dims and heads: the same messages as the decode
    call's check."""
    for q, cache, match in [
        (meta((2, 1, 8, 64), "float32"), meta((2, 32, 2, 64), "float32"), r"q has dtype float32"),
        (meta((2, 1, 8, 64)), meta((2, 32, 2, 64), "float16"), r"k_cache has dtype float16"),
        (meta((2, 8, 64)), meta((2, 32, 2, 64)), r"q has 3 dimensions"),
        (meta((2, 1, 8, 64)), meta((2, 32, 2, 32)), r"q's head_dim 64 differs from k_cache's 32"),
        (meta((2, 1, 8, 64)), meta((2, 32, 3, 64)), r"k/v heads must divide"),
        (meta((2, 1, 8, 64), device="cpu"), meta((2, 32, 2, 64)), r"q is on device 'cpu'"),
    ]:
        with pytest.raises(UnsupportedCall, match=match):
            check_prep(q, cache, cache, cache_seqlens=meta((2,), "int32"))
    with pytest.raises(UnsupportedCall, match=r"block_table must be an int32 tensor"):
        prep_call(paged=True, block_table=meta((2, 2), "int64"))


def test_window_pair_takes_tuples_lists_and_two_element_tensors():
    assert window_pair((-1, -1)) == (-1, -1)
    assert window_pair([3, 0]) == (3, 0)
    for bad in ((1.0, 2), (True, 0), (1, 2, 3), 5, "ab", None, (1,)):
        with pytest.raises(UnsupportedCall, match=r"window_size must be \(left, right\)"):
            window_pair(bad)
    if importlib.util.find_spec("torch") is None:
        return
    import torch

    assert window_pair(torch.tensor([5, 2])) == (5, 2)
    assert window_pair((torch.tensor(4), torch.tensor(-1))) == (4, -1)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), torch.tensor([True, False])):
        with pytest.raises(UnsupportedCall, match=r"window_size must be \(left, right\)"):
            window_pair(bad)


def test_kvcache_window_normalises_as_flash_attns_binding():
    """A side >= the capacity is unbounded; rotary positions of queries advance when causal
    or when a window remains."""
    assert kvcache_window(False, (-1, -1), 10) == (-1, -1, False)
    assert kvcache_window(True, (-1, -1), 10) == (-1, -1, True)
    assert kvcache_window(False, (10, 12), 10) == (-1, -1, False)
    assert kvcache_window(False, (9, 10), 10) == (9, -1, True)
    assert kvcache_window(False, (-1, 0), 10) == (-1, 0, True)
    with pytest.raises(UnsupportedCall, match="window_size"):
        kvcache_window(False, (-2, 0), 10)
    with pytest.raises(UnsupportedCall, match="causal must be True or False"):
        kvcache_window(1, (-1, -1), 10)


def test_check_paged_kv():
    pages, table, cu = meta((9, 5, 2, 64)), meta((3, 4), "int32"), meta((4,), "int32")
    assert check_paged_kv(pages, pages, table, cu) == (5, 9)
    for k, v, t, c, match in [
        (meta((9, 2, 64)), pages, table, cu, r"k has 3 dimensions .*paged cache"),
        (pages, meta((9, 5, 1, 64)), table, cu, r"must have the same shape"),
        (meta((0, 5, 2, 64)), meta((0, 5, 2, 64)), table, cu, r"has no pages"),
        (pages, pages, meta((2, 4), "int32"), cu, r"block_table must be an int32 tensor of "
         r"shape \(3, 4\)"),
        (pages, pages, meta((3, 0), "int32"), cu, r"block_table has no columns"),
        (pages, pages, table, meta((4,), "int64"), r"cu_seqlens_k must be a 1-D int32"),
        (pages, pages, table, cu._replace(device="cpu"), r"cu_seqlens_k is on device 'cpu'"),
    ]:  # fmt: skip
        with pytest.raises(UnsupportedCall, match=match):
            check_paged_kv(k, v, t, c)


@pytest.mark.parametrize("feature", [f.name for f in FEATURES])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_the_decode_spec_carries_the_calls_features(feature, paged):
    plain = DecodeCall(Dtype.BF16, 128, H200, paged, Causal.BOTTOM_RIGHT, True)
    call = dataclasses.replace(plain, features=frozenset({feature}))
    spec = decode_spec(call)
    assert spec.features == {feature} and spec.has(feature)
    assert spec.kernel.yaml == "decode" and spec.paged is paged and spec.gqa
    assert decode_spec(plain).features == frozenset()
    assert kernel_name(spec) != kernel_name(decode_spec(plain))


def test_every_feature_at_once_on_every_decode_target():
    every = frozenset(f.name for f in FEATURES)
    for cap in ((8, 0), (8, 6), (8, 9), H200):
        spec = decode_spec(DecodeCall(Dtype.FP16, 64, cap, True, features=every))
        assert spec.features == every


def test_decode_calls_check_the_score_arguments_like_the_attention_ops():
    """kvcache passes (batch, heads) of q to selection.score_features: the slopes' and
    sinks' shapes follow the decode call's q."""
    pb = contiguous(batch=3, heads=8, kv=2)
    slopes = meta((pb.batch, pb.heads), "float32")
    got = score_features(
        {"softcap": 50.0, "alibi_slopes": slopes, "learnable_sink": meta((8,), "float32")},
        batch=pb.batch,
        heads=pb.heads,
    )
    assert got == frozenset(f.name for f in FEATURES)
    with pytest.raises(UnsupportedCall, match=r"alibi_slopes has shape \(3, 2\); it must be"):
        score_features({"alibi_slopes": meta((3, 2), "float32")}, batch=3, heads=8)
    with pytest.raises(UnsupportedCall, match=r"learnable_sink has shape \(2,\)"):
        score_features({"learnable_sink": meta((2,), "float32")}, batch=3, heads=8)


def test_seqlen_q_over_16_is_refused():
    with pytest.raises(UnsupportedCall, match=r"seqlen_q 17; decode kernels take 1\.\.16.*"):
        contiguous(sq=17)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8"])
def test_dtypes_other_than_fp16_bf16_are_refused(dtype):
    q, kc = meta((2, 1, 8, 128), dtype), meta((2, 300, 2, 128), dtype)
    with pytest.raises(UnsupportedCall, match=rf"q has dtype {dtype}; .*float16 or bfloat16"):
        check_kvcache(q, kc, kc, cache_seqlens=meta((2,), "int32"))


def test_mismatched_dtypes_are_refused():
    q, kc, vc = meta((2, 1, 8, 128)), meta((2, 300, 2, 128)), meta((2, 300, 2, 128), "float16")
    with pytest.raises(UnsupportedCall, match="v_cache has dtype float16 but q has bfloat16"):
        check_kvcache(q, kc, vc, cache_seqlens=meta((2,), "int32"))


@pytest.mark.parametrize("which", ["q", "k_cache", "cache_seqlens", "block_table"])
def test_non_cuda_tensors_are_refused(which):
    q, kc = meta((2, 1, 8, 128)), meta((10, 64, 2, 128))
    lens, table = meta((2,), "int32"), meta((2, 4), "int32")
    args = {"q": q, "k_cache": kc, "cache_seqlens": lens, "block_table": table}
    args[which] = args[which]._replace(device="cpu")
    with pytest.raises(UnsupportedCall, match=rf"{which} is on device 'cpu'"):
        check_kvcache(
            args["q"],
            args["k_cache"],
            kc,
            cache_seqlens=args["cache_seqlens"],
            block_table=args["block_table"],
        )


def test_strides_are_refused_with_their_rule():
    kc = meta((2, 300, 2, 128))
    lens = meta((2,), "int32")
    q = meta((2, 2, 8, 128), stride=(2052, 1028, 128, 1))
    with pytest.raises(UnsupportedCall, match=r"q has strides .*multiple of 8 elements"):
        check_kvcache(q, kc, kc, cache_seqlens=lens)
    q = meta((2, 1, 8, 128), stride=(2048, 2048, 1, 8))
    with pytest.raises(UnsupportedCall, match=r"q's last dimension \(head_dim\) has stride 8"):
        check_kvcache(q, kc, kc, cache_seqlens=lens)
    bad = meta((2, 300, 2, 128), stride=(300 * 260, 260, 130, 1))
    with pytest.raises(UnsupportedCall, match=r"k_cache has strides .*multiple of 8"):
        check_kvcache(meta((2, 1, 8, 128)), bad, kc, cache_seqlens=lens)


def test_the_multiple_of_8_rule_applies_to_used_strides_only():
    # one query per sequence: q's row stride is never used, only the batch stride must obey
    q = meta((2, 1, 8, 128), stride=(1032, 1028, 128, 1))
    kc = meta((2, 300, 2, 128))
    check_kvcache(q, kc, kc, cache_seqlens=meta((2,), "int32"))


@pytest.mark.parametrize("page", [8, 24, 512, 1])
def test_page_sizes_outside_the_powers_of_two_16_to_256_are_refused(page):
    with pytest.raises(UnsupportedCall, match=rf"page_size {page} .*power of two in 16\.\.256"):
        paged(page=page)


@pytest.mark.parametrize("splits", [-1, 129, 1000])
def test_num_splits_outside_0_to_128_is_refused(splits):
    with pytest.raises(UnsupportedCall, match=rf"num_splits={splits}: allowed 0 .* 1\.\.128"):
        contiguous(num_splits=splits)


def test_num_splits_range_ends_pass():
    contiguous(num_splits=0)
    contiguous(num_splits=128)


def test_bad_block_tables_are_refused():
    with pytest.raises(UnsupportedCall, match=r"block_table must be an int32 tensor"):
        paged(table=meta((2, 4), "int64"))
    with pytest.raises(UnsupportedCall, match=r"block_table must be an int32 tensor"):
        paged(table=meta((3, 4), "int32"))
    with pytest.raises(UnsupportedCall, match=r"block_table must be int32 \(batch, max_pages\)"):
        paged(table=meta((8,), "int32"))
    with pytest.raises(UnsupportedCall, match=r"block_table's last dimension has stride 2"):
        paged(table=meta((2, 4), "int32", stride=(8, 2)))
    with pytest.raises(UnsupportedCall, match=r"block_table's row stride 0 is below"):
        paged(table=meta((2, 4), "int32", stride=(0, 1)))
    with pytest.raises(UnsupportedCall, match=r"block_table has no columns"):
        paged(table=meta((2, 0), "int32"))


def test_bad_shapes_are_refused():
    lens = meta((2,), "int32")
    q = meta((2, 1, 8, 128))
    with pytest.raises(UnsupportedCall, match=r"q has batch 2 but k_cache has 3"):
        check_kvcache(q, meta((3, 300, 2, 128)), meta((3, 300, 2, 128)), cache_seqlens=lens)
    with pytest.raises(UnsupportedCall, match=r"k/v heads must divide"):
        check_kvcache(q, meta((2, 300, 3, 128)), meta((2, 300, 3, 128)), cache_seqlens=lens)
    with pytest.raises(UnsupportedCall, match=r"head_dim 128 differs from k_cache's 64"):
        check_kvcache(q, meta((2, 300, 2, 64)), meta((2, 300, 2, 64)), cache_seqlens=lens)
    with pytest.raises(UnsupportedCall, match=r"must have the same shape"):
        check_kvcache(q, meta((2, 300, 2, 128)), meta((2, 200, 2, 128)), cache_seqlens=lens)
    with pytest.raises(UnsupportedCall, match=r"q has 3 dimensions"):
        check_kvcache(meta((2, 8, 128)), meta((2, 300, 2, 128)), meta((2, 300, 2, 128)))
    with pytest.raises(UnsupportedCall, match=r"cache_seqlens must be an int32 tensor of shape"):
        contiguous_lens = meta((2,), "int64")
        kc = meta((2, 300, 2, 128))
        check_kvcache(q, kc, kc, cache_seqlens=contiguous_lens)


def test_softmax_scale_must_be_finite_and_positive():
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(UnsupportedCall, match="softmax_scale must be finite and > 0"):
            contiguous(softmax_scale=bad)


# -- merge_states --------------------------------------------------------------------------------


def test_merge_inputs():
    o16, lse = meta((3, 2, 5, 8, 128)), meta((3, 2, 8, 5), "float32")
    assert check_merge(o16, lse, None) == (Dtype.BF16, True)
    o32 = meta((3, 2, 5, 8, 128), "float32")
    assert check_merge(o32, lse, "float16") == (Dtype.FP16, False)
    with pytest.raises(UnsupportedCall, match="float32 o_parts need out_dtype"):
        check_merge(o32, lse, None)
    with pytest.raises(UnsupportedCall, match="out_dtype float16 differs from o_parts' bfloat16"):
        check_merge(o16, lse, "float16")
    with pytest.raises(UnsupportedCall, match=r"lse_parts must be float32 \(3, 2, 8, 5\)"):
        check_merge(o16, meta((3, 2, 5, 8), "float32"), None)
    d = UNSERVED[0]
    with pytest.raises(UnsupportedCall, match=rf"head_dim {d} has no merge_states kernel"):
        check_merge(meta((3, 2, 5, 8, d)), lse, None)
    with pytest.raises(UnsupportedCall, match=r"o_parts has dtype float64"):
        check_merge(meta((3, 2, 5, 8, 128), "float64"), lse, None)
    with pytest.raises(UnsupportedCall, match=r"o_parts is on device 'cpu'"):
        check_merge(o16._replace(device="cpu"), lse, None)
    with pytest.raises(UnsupportedCall, match=r"must be \(parts, batch, seqlen_q, heads"):
        check_merge(meta((2, 5, 8, 128)), lse, None)
    strided = meta((3, 2, 5, 8, 128), "float32", stride=(2 * 5 * 8 * 132, 5 * 8 * 132, 8 * 132,
                                                          132, 1))  # fmt: skip
    assert check_merge(strided, lse, "bfloat16") == (Dtype.BF16, False)  # 132 % 4 == 0
    bad = meta((3, 2, 5, 8, 128), stride=(2 * 5 * 8 * 132, 5 * 8 * 132, 8 * 132, 132, 1))
    with pytest.raises(UnsupportedCall, match=r"multiple of 16 bytes \(8 elements\)"):
        check_merge(bad, lse, None)


# -- device errors, imports ------------------------------------------------------------------------


def test_error_word_messages():
    assert "page id outside [0, 7)" in describe_errors(1, 100, 7)
    assert "capacity 100" in describe_errors(2, 100, None)
    both = describe_errors(3, 100, 7)
    assert "page id" in both and "cache_seqlens" in both
    assert "0x4" in describe_errors(4, 1, None)
    assert issubclass(CacheInputError, ValueError)


def test_the_package_and_selection_import_no_torch():
    code = (
        "import sys, flashgen.torch, flashgen.torch.kvcache_select as k; "
        "assert 'flash_attn_with_kvcache' in flashgen.torch.__all__; "
        "assert 'merge_states' in flashgen.torch.__all__; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_without_torch_the_names_say_how_to_install_it():
    import flashgen.torch

    for name in ("flash_attn_with_kvcache", "merge_states"):
        with pytest.raises(
            ImportError,
            match=r"needs PyTorch.*pip install '\.\[torch\]' \(from a flashgen checkout\)",
        ):
            getattr(flashgen.torch, name)


def test_softcap_must_be_a_number_not_text():
    """flash-attn's softcap is a float: text that float() would parse is refused, numbers are
    taken as they are (found by the GPU kvcache refusal test: "30" used to pass)."""
    pytest.importorskip("torch")
    from flashgen.torch.ops import as_softcap
    from flashgen.torch.selection import UnsupportedCall

    assert as_softcap(30) == 30.0 and as_softcap(2.5) == 2.5
    for bad in ("30", b"30", None, [30.0], True):
        with pytest.raises(UnsupportedCall, match="softcap must be a float"):
            as_softcap(bad)
