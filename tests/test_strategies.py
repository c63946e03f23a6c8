"""The strategies draw what they promise: valid values, and the corner cases they exist for."""

from __future__ import annotations

import numpy as np
from flashgen.verify.strategies import (
    VALUE_KINDS,
    attention_inputs,
    block_layouts,
    cases_for_spec,
    cu_seqlens,
    dropout_params,
    seqlens,
    shapes,
    valid_specs,
    windows,
)
from hypothesis import Phase, given, settings
from hypothesis import find as _find
from hypothesis import strategies as st


def exists(strategy, condition, tries=2000):
    """Fails unless `strategy` draws a value satisfying `condition` within `tries` draws
    (no shrinking: only existence matters)."""
    _find(
        strategy,
        condition,
        settings=settings(max_examples=tries, database=None, phases=[Phase.generate]),
    )


@settings(max_examples=100, deadline=None)
@given(shapes(max_seqlen=40))
def test_shapes_are_valid(s):
    assert s.heads % s.kv_heads == 0
    assert 1 <= s.seqlen_q <= 40 and 1 <= s.seqlen_k <= 40
    assert s.head_dim in (8, 16)


def test_shapes_reach_the_corner_cases():
    exists(shapes(), lambda s: s.seqlen_q < s.seqlen_k)
    exists(shapes(), lambda s: s.seqlen_q > s.seqlen_k)
    exists(shapes(), lambda s: s.seqlen_q == s.seqlen_k == 1)
    exists(shapes(), lambda s: s.kv_heads < s.heads)
    exists(seqlens(200), lambda n: n == 97)
    exists(seqlens(200), lambda n: n % 2 == 1 and n > 100)


def test_shapes_without_gqa_have_equal_head_counts():
    @settings(max_examples=50, deadline=None)
    @given(shapes(gqa=False))
    def check(s):
        assert s.kv_heads == s.heads

    check()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4).flatmap(lambda b: st.tuples(st.just(b), cu_seqlens(b))))
def test_cu_seqlens_are_cumulative_int32_with_lengths_of_at_least_one(drawn):
    batch, (cq, ck) = drawn
    for cu in (cq, ck):
        assert cu.dtype == np.int32 and cu.shape == (batch + 1,) and cu[0] == 0
        assert np.all(np.diff(cu) >= 1)


def test_cu_seqlens_can_hold_empty_sequences_when_asked():
    exists(cu_seqlens(3, allow_empty=True), lambda c: np.any(np.diff(c[0]) == 0))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 50).flatmap(lambda sk: st.tuples(st.just(sk), windows(sk))))
def test_window_sides_are_minus_one_or_within_the_keys(drawn):
    sk, (left, right) = drawn
    assert left == -1 or 0 <= left <= sk
    assert right == -1 or 0 <= right <= sk


@settings(max_examples=100, deadline=None)
@given(block_layouts(2, 5, 7))
def test_block_layouts_are_bool_of_the_tile_grid(layout):
    assert layout.dtype == np.bool_ and layout.shape == (2, 5, 7)


def test_block_layouts_include_rows_with_no_block_and_partial_density():
    exists(block_layouts(1, 6, 6), lambda x: (~x.any(axis=-1)).any() and x.any())
    exists(block_layouts(1, 6, 6), lambda x: 0.2 < x.mean() < 0.8)


@settings(max_examples=100, deadline=None)
@given(dropout_params())
def test_dropout_params_are_in_range(dp):
    assert 0.0 <= dp.p < 1.0
    assert 0 <= dp.seed < 2**64 and 0 <= dp.offset < 2**32


def test_dropout_params_draw_each_kind_of_p():
    for pred in (
        lambda d: d.p == 0.0,
        lambda d: 0 < d.p <= 0.1,
        lambda d: d.p == 0.5,
        lambda d: d.p == 0.9,
        lambda d: d.seed >= 2**32,
    ):
        exists(dropout_params(), pred)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(VALUE_KINDS), st.data())
def test_attention_inputs_have_the_requested_shapes_and_kind(kind, data):
    q, k, v = data.draw(attention_inputs((2, 5, 4, 16), (2, 6, 2, 16), kind=kind, dtype="bf16"))
    assert q.shape == (2, 5, 4, 16) and k.shape == v.shape == (2, 6, 2, 16)
    assert q.dtype == np.float64 and np.all(np.isfinite(q))
    bits = q.astype(np.float32).view(np.uint32)
    assert np.all(bits & 0xFFFF == 0)  # bf16-representable
    scores = np.einsum("bihd,bjhd->bhij", q[:, :, ::2], k) / 4.0
    if kind == "large":
        assert np.abs(scores).max() > 1e3


def test_one_hot_inputs_make_some_rows_one_hot():
    def one_hot(qkv):
        q, k, _ = qkv
        s = np.einsum("bihd,bjhd->bhij", q, k) / 4.0
        gap = np.sort(s, axis=-1)
        return bool(np.any(gap[..., -1] - gap[..., -2] > 30.0))

    exists(attention_inputs((1, 4, 1, 16), (1, 6, 1, 16), kind="one_hot"), one_hot, 200)


def test_duplicate_keys_inputs_hold_equal_key_rows():
    def has_dup(qkv):
        rows = qkv[1][0, :, 0]
        return len({r.tobytes() for r in rows}) < len(rows)

    exists(attention_inputs((1, 3, 1, 8), (1, 6, 1, 8), kind="duplicate_keys"), has_dup, 200)


@settings(max_examples=60, deadline=None)
@given(valid_specs())
def test_valid_specs_are_real_validated_kernel_specs(spec):
    from flashgen.generator.spec import KernelSpec

    assert isinstance(spec, KernelSpec) and spec.problems() == []
    assert not spec.debug_keep_mask or spec.dropout


def test_valid_specs_reach_every_feature():
    for pred in (
        lambda s: s.sparsity.yaml == "block" and s.mask.varlen,
        lambda s: s.debug_keep_mask,
        lambda s: s.mask.causal.yaml == "bottom_right" and s.mask.window,
        lambda s: s.dtype.yaml == "bf16" and s.head_dim == 256,
        lambda s: s.gqa and s.instrument_io,
        lambda s: s.has("softcap") and s.has("alibi") and s.has("sink") and s.mask.varlen,
        lambda s: s.has("sink") and s.dropout,
        lambda s: not s.features,
    ):
        exists(valid_specs(), pred)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_cases_for_spec_only_use_features_the_spec_has(data):
    spec = data.draw(valid_specs(head_dims=(64,)))
    case = data.draw(cases_for_spec(spec))
    assert (case.cu_seqlens_q is not None) == spec.mask.varlen
    assert (case.block_mask is not None) == spec.sparse
    assert (case.dropout is not None) == spec.dropout
    assert spec.mask.window or case.window == (-1, -1)
    assert spec.gqa or case.kv_heads == case.heads
    assert case.score.features == spec.features  # every feature the spec has, no other
    if case.block_mask is not None:
        bm, bn = spec.tile.block_m, spec.tile.block_n
        assert case.block_mask.shape[1:] == (-(-case.seqlen_q // bm), -(-case.seqlen_k // bn))


def test_valid_specs_can_pin_the_score_features():
    @settings(max_examples=30, deadline=None)
    @given(valid_specs(features=frozenset()))
    def check(spec):
        assert spec.features == frozenset()

    check()
