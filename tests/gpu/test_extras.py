"""Dropout, block sparsity and IO counting on a GPU, each checked exactly where it can be:
keep-masks bit for bit against verify.dropout, p = 0 bitwise equal to the dense kernel,
block-sparse outputs by the pass rule under the same layout, and IO byte counts to the byte
against verify.io_model. Drawn cases carry the spec's score-stage values (softcap, ALiBi,
sinks: test_forward.runtime_case), which checks.verdicts hands the reference."""

from __future__ import annotations

import numpy as np
import pytest
from flashgen.generator.naming import kernel_name
from flashgen.verify import dropout, io_model
from flashgen.verify.blocksparse import compact_layout_for_spec
from flashgen.verify.runner import load_kernel
from flashgen.verify.strategies import block_layouts, fixed_score_args
from flashgen.verify.tiled_model import tiled_forward
from hypothesis import given
from hypothesis import strategies as st

from .checks import assert_pass, verdicts
from .conftest import CUBIN_DIR, ensure_cubins, shipped_specs
from .test_forward import SETTINGS, make_inputs, reference_kwargs, runtime_case

SPECS = [s for s in shipped_specs() if s.kernel.yaml == "forward"]
DROPOUT = [s for s in SPECS if s.dropout]
SPARSE = [s for s in SPECS if s.sparse]
IO = [s for s in SPECS if s.instrument_io]


@pytest.mark.parametrize("spec", DROPOUT, ids=kernel_name)
def test_dropout_keep_mask_is_bit_exact_and_output_passes(spec, specs, recorder):  # noqa: ARG001
    """Debug builds: the written keep-mask equals verify.dropout's bit for bit. Every build: the
    output passes against the reference fed that mask (which the debug build proved the
    kernel's own)."""
    kernel = load_kernel(spec, CUBIN_DIR)

    @SETTINGS
    @given(
        case=runtime_case(spec),
        p=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
        seed=st.integers(0, 2**64 - 1),
        offset=st.integers(0, 2**32 - 1),
    )
    def prop(case, p, seed, offset):
        q, k, v, kw = make_inputs(spec, case)
        res = kernel.run(
            q,
            k,
            v,
            dropout_p=p,
            seed=seed,
            offset=offset,
            memory_layout=case["memory_layout"],
            pad=case["pad"],
            **kw,
        )
        ref = reference_kwargs(spec, kw)  # causal, window, cu_seqlens
        h = q.shape[-2]
        if spec.mask.varlen:
            keep = dropout.keep_mask_varlen(seed, offset, h, case["lens_q"], case["lens_k"], p)
        else:
            keep = dropout.keep_mask(seed, offset, q.shape[0], h, q.shape[1], k.shape[1], p)
        if spec.debug_keep_mask:  # every element of every visited tile, and nothing else
            model = tiled_forward(
                spec,
                res.inputs["q"],
                res.inputs["k"],
                res.inputs["v"],
                keep_mask=keep,
                dropout_p=p,
                **{key: val for key, val in ref.items() if key != "causal"},
                **res.score.kwargs(),
            )
            np.testing.assert_array_equal(res.keep_mask, model.debug_keep_mask)
        found = verdicts(spec, res, keep_mask=keep, dropout_p=p, **ref)
        assert_pass(spec, found, recorder, "dropout", res)

    try:
        prop()
    except BaseException:
        recorder.fail(spec, "dropout")
        raise


@pytest.mark.parametrize("spec", [s for s in DROPOUT if s.debug_keep_mask], ids=kernel_name)
def test_seed_and_offset_through_pointers_draw_the_by_value_mask(spec, specs):  # noqa: ARG001
    """The graph-safe form (seed and offset read on the device, part of the offset added as
    philox_offset_add: torch's PhiloxCudaState under capture) gives the by-value launch's
    keep-mask and output bit for bit, and the kernel records the pair it used."""
    kernel = load_kernel(spec, CUBIN_DIR)

    @SETTINGS
    @given(
        case=runtime_case(spec),
        seed=st.integers(0, 2**64 - 1),
        offset=st.integers(0, 2**32 - 1),
    )
    def prop(case, seed, offset):
        q, k, v, kw = make_inputs(spec, case)
        runs = [
            kernel.run(
                q, k, v, dropout_p=0.3, seed=seed, offset=offset, philox_pointers=ptr, **kw
            )  # fmt: skip
            for ptr in (False, True)
        ]
        np.testing.assert_array_equal(runs[0].keep_mask, runs[1].keep_mask)
        np.testing.assert_array_equal(runs[0].o, runs[1].o)
        np.testing.assert_array_equal(runs[0].lse, runs[1].lse)
        assert runs[1].stats["philox_recorded"] == (seed, offset)
        assert runs[1].stats["margins_intact"]

    prop()


@pytest.mark.parametrize("spec", [s for s in DROPOUT if s.debug_keep_mask][:1], ids=kernel_name)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_binomial_bounds(spec, p, specs):  # noqa: ARG001
    kernel = load_kernel(spec, CUBIN_DIR)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 300, 2, spec.head_dim)).astype(np.float32) for _ in range(3))
    score = fixed_score_args(spec, 2, 2).kwargs()
    res = kernel.run(q, k, v, dropout_p=p, seed=1234567890123, offset=77, **score)
    n = res.keep_mask.size
    kept = int((res.keep_mask == 1).sum())
    assert int((res.keep_mask == 2).sum()) == 0
    mean, sd = n * (1 - p), np.sqrt(n * p * (1 - p))
    assert abs(kept - mean) < 5 * sd, (kept, mean, sd)


def _dense_twin(spec):
    """The shipped forward kernel that differs from `spec` only in dropout: no window,
    varlen, GQA, sparsity or IO counting, the same score-stage features (None if none)."""
    for s in shipped_specs(sharded=False):
        if (
            s.kernel.yaml == "forward"
            and s.target is spec.target
            and s.replace(features=frozenset()).plain
            and s.features == spec.features
            and s.mask.causal == spec.mask.causal
            and s.head_dim == spec.head_dim
            and s.dtype == spec.dtype
            and s.tile == spec.tile
        ):
            return s
    return None


@pytest.mark.parametrize("spec", [s for s in DROPOUT if not s.debug_keep_mask], ids=kernel_name)
def test_dropout_p0_is_bitwise_the_dense_kernel(spec, specs, recorder):  # noqa: ARG001
    twin = _dense_twin(spec)
    if twin is None and spec.features:
        pytest.skip("no shipped dense twin with the same score-stage features")
    assert twin is not None, "no dense kernel with the same tile to compare with"
    ensure_cubins([twin])
    kd, kp = load_kernel(twin, CUBIN_DIR), load_kernel(spec, CUBIN_DIR)
    rng = np.random.default_rng(11)
    score = fixed_score_args(spec, 2, 2).kwargs()
    for sq, sk in ((1, 1), (97, 300), (513, 129)):
        q = rng.standard_normal((2, sq, 2, spec.head_dim)).astype(np.float32)
        k = rng.standard_normal((2, sk, 2, spec.head_dim)).astype(np.float32)
        v = rng.standard_normal((2, sk, 2, spec.head_dim)).astype(np.float32)
        a, b = kd.run(q, k, v, **score), kp.run(q, k, v, dropout_p=0.0, seed=99, **score)
        assert np.array_equal(a.o.view(np.uint32), b.o.view(np.uint32))
        assert np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32))
        assert_pass(spec, verdicts(spec, b, causal=spec.mask.causal.yaml), recorder, "p0", b)


@st.composite
def sparse_case(draw, spec):
    case = draw(runtime_case(spec, max_len=400))
    tr = -(-case["sq"] // spec.tile.block_m)
    tc = -(-case["sk"] // spec.tile.block_n)
    lh = draw(st.sampled_from([1, case["heads"]]))
    case["block_mask"] = draw(block_layouts(lh, tr, tc))
    return case


@pytest.mark.parametrize("spec", [s for s in SPARSE if not s.instrument_io], ids=kernel_name)
def test_block_sparse_matches_reference_under_the_same_layout(spec, specs, recorder):  # noqa: ARG001
    kernel = load_kernel(spec, CUBIN_DIR)

    @SETTINGS
    @given(case=sparse_case(spec))
    def prop(case):
        q, k, v, kw = make_inputs(spec, case)
        layout = compact_layout_for_spec(
            case["block_mask"], spec, seqlen_q=case["sq"], seqlen_k=case["sk"]
        )
        res = kernel.run(
            q, k, v, layout=layout, memory_layout=case["memory_layout"], pad=case["pad"], **kw
        )
        found = verdicts(
            spec,
            res,
            causal=spec.mask.causal.yaml,
            block_mask=case["block_mask"],
            block_m=spec.tile.block_m,
            block_n=spec.tile.block_n,
        )
        assert_pass(spec, found, recorder, "sparse", res)

    try:
        prop()
    except BaseException:
        recorder.fail(spec, "sparse")
        raise


@pytest.mark.parametrize("spec", IO, ids=kernel_name)
def test_io_counters_equal_the_io_model_to_the_byte(spec, specs, recorder):  # noqa: ARG001
    kernel = load_kernel(spec, CUBIN_DIR)
    strategy = sparse_case(spec) if spec.sparse else runtime_case(spec, max_len=400)

    @SETTINGS
    @given(case=strategy)
    def prop(case):
        q, k, v, kw = make_inputs(spec, case)
        layout = None
        if spec.sparse:
            layout = compact_layout_for_spec(
                case["block_mask"], spec, seqlen_q=case["sq"], seqlen_k=case["sk"]
            )
            kw["layout"] = layout
        res = kernel.run(q, k, v, **kw)
        if spec.mask.varlen:
            cu_q, cu_k = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
            shape = dict(
                batch=len(cu_q) - 1,
                seqlen_q=int(np.diff(cu_q).max()),
                seqlen_k=int(np.diff(cu_k).max()),
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
            )
        else:
            shape = dict(batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1])
        want = io_model.forward_bytes(
            spec,
            heads=q.shape[-2],
            kv_heads=k.shape[-2],
            window=kw.get("window", (-1, -1)),
            layout=layout,
            **shape,
        )
        want = {key: val for key, val in want.items() if key != "total"}
        assert res.io == want
        ref_kwargs = {
            key: kw[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "window") if key in kw
        }
        if spec.sparse:
            ref_kwargs.update(
                block_mask=case["block_mask"], block_m=spec.tile.block_m, block_n=spec.tile.block_n
            )
        assert_pass(
            spec,
            verdicts(spec, res, causal=spec.mask.causal.yaml, **ref_kwargs),
            recorder,
            "io",
            res,
        )

    try:
        prop()
    except BaseException:
        recorder.fail(spec, "io")
        raise
