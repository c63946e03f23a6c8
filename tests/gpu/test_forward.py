"""Forward kernels on a GPU against the float64 reference, with the pass rule and exact checks.

Each shipped spec gets FLASHGEN_GPU_EXAMPLES Hypothesis-drawn runtime cases (shapes with odd
lengths, 1, seqlen_q != seqlen_k both ways, memory layouts, values from normal to scores of
1e4, one-hot rows, and the values of the score-stage features the spec has: softcap, ALiBi
slopes, sinks, drawn by verify.strategies.score_args); outputs and margins are poisoned
before every launch. Hand-picked cases give a featured spec fixed values
(`fixed_score_args`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from flashgen.generator.naming import kernel_name
from flashgen.verify.runner import load_kernel
from flashgen.verify.strategies import fixed_score_args, score_args, self_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .checks import assert_pass, verdicts
from .conftest import CUBIN_DIR, shipped_specs

EXAMPLES = int(os.environ.get("FLASHGEN_GPU_EXAMPLES", "200"))
SPECS = [s for s in shipped_specs() if s.kernel.yaml == "forward"]
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def _kernel(spec):
    return load_kernel(spec, CUBIN_DIR)


@st.composite
def runtime_case(draw, spec, max_len: int = 160):
    """A runtime problem for `spec`: shapes, lengths, window, values, memory layout, and the
    values of its score-stage features (`case["score"]`)."""
    rng_seed = draw(st.integers(0, 2**32 - 1))
    lens = st.one_of(
        st.sampled_from([1, 2, 7, 15, 16, 17, 63, 64, 65, 97, 128, 129]), st.integers(1, max_len)
    )
    if spec.gqa:
        kv_heads = draw(st.integers(1, 2))
        heads = kv_heads * draw(st.integers(1, 3))
    else:
        heads = kv_heads = draw(st.integers(1, 2))
    case = {"heads": heads, "kv_heads": kv_heads, "seed": rng_seed}
    if spec.mask.varlen:
        nseq = draw(st.integers(1, 3))
        case["lens_q"] = [draw(lens) for _ in range(nseq)]
        case["lens_k"] = [draw(lens) for _ in range(nseq)]
        if self_attention(spec):  # a per_token vector: queries and keys are the same tokens
            case["lens_k"] = list(case["lens_q"])
    else:
        case["batch"] = draw(st.integers(1, 2))
        case["sq"] = draw(lens)
        case["sk"] = case["sq"] if self_attention(spec) else draw(lens)
    if spec.mask.window:
        case["window"] = (
            draw(st.sampled_from([-1, 0, 1, 5, 33, 100])),
            draw(st.sampled_from([-1, 0, 1, 5, 33, 100])),
        )
    case["values"] = draw(st.sampled_from(["normal", "normal", "large", "wide"]))
    case["memory_layout"] = draw(st.sampled_from(["bshd", "bhsd"]))
    case["pad"] = draw(st.sampled_from([0, 0, 8, 24]))
    batch = len(case["lens_q"]) if spec.mask.varlen else case["batch"]
    case["score"] = draw(score_args(spec, batch, heads, case_tokens(spec, case)))
    return case


def case_tokens(spec, case):
    """The case's query and key token counts (per-token parameters hold one id each)."""
    if spec.mask.varlen:
        return sum(case["lens_q"]), sum(case["lens_k"])
    return case["batch"] * case["sq"], case["batch"] * case["sk"]


def case_score(spec, case):
    """The case's score-stage values, or fixed ones for a hand-picked case without them."""
    if "score" in case:
        return case["score"]
    batch = len(case["lens_q"]) if spec.mask.varlen else case["batch"]
    return fixed_score_args(spec, batch, case["heads"], case_tokens(spec, case))


def make_inputs(spec, case):
    rng = np.random.default_rng(case["seed"])
    d, d_v, h, hk = spec.head_dim, spec.head_dim_vo, case["heads"], case["kv_heads"]
    if spec.mask.varlen:
        tq, tk = sum(case["lens_q"]), sum(case["lens_k"])
        shapes = ((tq, h, d), (tk, hk, d), (tk, hk, d_v))
    else:
        b = case["batch"]
        shapes = ((b, case["sq"], h, d), (b, case["sk"], hk, d), (b, case["sk"], hk, d_v))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    if case["values"] == "large":  # scores up to ~1e4 after scaling: a near-hard softmax
        q *= np.float32(1250.0)  # scale * q.k ~ N(0, 2500^2): scores reach +-1e4
        k *= np.float32(2.0)
    elif case["values"] == "wide":
        v *= np.float32(100.0)
        q *= np.float32(4.0)
    kwargs = {}
    if spec.mask.varlen:
        kwargs["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(case["lens_q"])]).astype(np.int32)
        kwargs["cu_seqlens_k"] = np.concatenate([[0], np.cumsum(case["lens_k"])]).astype(np.int32)
    if spec.mask.window:
        kwargs["window"] = case["window"]
    kwargs.update(case_score(spec, case).kwargs())  # softcap, alibi_slopes, sinks
    return q, k, v, kwargs


def reference_kwargs(spec, kwargs):
    """The reference's mask arguments (checks.verdicts adds the run's score-stage values)."""
    out = {"causal": spec.mask.causal.yaml}
    for key in ("cu_seqlens_q", "cu_seqlens_k", "window"):
        if key in kwargs:
            out[key] = kwargs[key]
    return out


def check_against_reference(spec, res, kwargs, recorder, test):
    assert_pass(spec, verdicts(spec, res, **reference_kwargs(spec, kwargs)), recorder, test, res)


@pytest.mark.parametrize(
    "spec", [s for s in SPECS if not s.dropout and not s.sparse], ids=kernel_name
)
def test_shipped_forward_matches_reference(spec, specs, recorder):  # noqa: ARG001
    kernel = _kernel(spec)

    @SETTINGS
    @given(case=runtime_case(spec))
    def prop(case):
        q, k, v, kwargs = make_inputs(spec, case)
        res = kernel.run(q, k, v, memory_layout=case["memory_layout"], pad=case["pad"], **kwargs)
        check_against_reference(spec, res, kwargs, recorder, "reference")

    try:
        prop()
    except BaseException:
        recorder.fail(spec, "reference")
        raise


@pytest.mark.parametrize(
    "spec",
    [s for s in SPECS if not s.dropout and not s.sparse and not s.mask.varlen][:6],
    ids=kernel_name,
)
def test_long_sequences_match_reference(spec, specs, recorder):  # noqa: ARG001
    """Fewer, longer cases: many K/V tiles, pipelines wrapping around, 1025-style tails."""
    kernel = _kernel(spec)

    @settings(max_examples=max(3, EXAMPLES // 40), deadline=None, database=None)
    @given(
        sq=st.sampled_from([1, 255, 1025, 1500]),
        sk=st.sampled_from([1, 513, 1025, 2000]),
        seed=st.integers(0, 2**32 - 1),
    )
    def prop(sq, sk, seed):
        case = {
            "heads": 1,
            "kv_heads": 1,
            "seed": seed,
            "batch": 1,
            "sq": sq,
            "sk": sk,
            "values": "normal",
            "memory_layout": "bshd",
            "pad": 0,
        }
        if spec.mask.window:
            case["window"] = (-1, -1)
        q, k, v, kwargs = make_inputs(spec, case)
        res = kernel.run(q, k, v, **kwargs)
        check_against_reference(spec, res, kwargs, recorder, "long")

    prop()


def _one_hot_problem(spec, sq, sk, seed):
    """Scores where every visible row has one key far above the rest: softmax is exactly
    one-hot in fp32, so O must equal that V row bit for bit."""
    d = spec.head_dim
    rng = np.random.default_rng(seed)
    assert sk <= d
    k = np.zeros((1, sk, 1, d), np.float32)
    k[0, np.arange(sk), 0, np.arange(sk)] = 32.0
    target = rng.integers(0, sk, size=sq)
    q = np.zeros((1, sq, 1, d), np.float32)
    q[0, np.arange(sq), 0, target] = 128.0
    v = rng.standard_normal((1, sk, 1, spec.head_dim_vo)).astype(np.float32)
    return q, k, v, target


@pytest.mark.parametrize(
    "spec",
    [
        s
        for s in SPECS
        if s.mask.causal.yaml == "none"
        and not s.mask.varlen
        and not s.mask.window
        and not s.dropout
        and not s.sparse
        and not s.features  # softcap, ALiBi and sinks change the weights of a one-hot row
        and s.score_mod is None  # and so does a score_mod
        and s.mask_mod is None  # a mask_mod may hide the row's key
    ],
    ids=kernel_name,
)
def test_one_hot_rows_return_their_v_row_exactly(spec, specs, recorder):  # noqa: ARG001
    kernel = _kernel(spec)

    @settings(max_examples=10, deadline=None, database=None)
    @given(
        sq=st.integers(1, 130),
        sk=st.integers(1, min(spec.head_dim, 130)),
        seed=st.integers(0, 2**32 - 1),
    )
    def prop(sq, sk, seed):
        q, k, v, target = _one_hot_problem(spec, sq, sk, seed)
        res = kernel.run(q, k, v)
        np.testing.assert_array_equal(res.o[0, :, 0, :], res.inputs["v"][0, target, 0, :])

    prop()


@pytest.mark.parametrize(
    "spec",
    [
        s
        for s in SPECS
        if s.mask.causal.yaml == "bottom_right"
        and not s.mask.varlen
        and not s.dropout
        and not s.sparse
    ],
    ids=kernel_name,
)
def test_fully_masked_rows_give_zero_and_minus_inf(spec, specs):  # noqa: ARG001
    """bottom_right causal with seqlen_q > seqlen_k: the first Sq - Sk rows see no key (with
    sinks their LSE is the head's sink instead of -inf)."""
    kernel = _kernel(spec)
    rng = np.random.default_rng(7)
    sq, sk = 77, 20
    q = rng.standard_normal((2, sq, 1, spec.head_dim)).astype(np.float32)
    k = rng.standard_normal((2, sk, 1, spec.head_dim)).astype(np.float32)
    v = rng.standard_normal((2, sk, 1, spec.head_dim_vo)).astype(np.float32)
    kwargs = {"window": (-1, -1)} if spec.mask.window else {}
    score = fixed_score_args(spec, 2, 1)
    res = kernel.run(q, k, v, **kwargs, **score.kwargs())
    empty = sq - sk
    assert np.all(res.o[:, :empty] == 0.0)
    want = -np.inf if score.sinks is None else np.float32(score.sinks[0])
    assert np.all(res.lse[:, :, :empty] == want)
    assert np.all(np.isfinite(res.lse[:, :, empty:]))


# (block-sparse kernels need a layout: their own tests repeat them)
_DENSE = [s for s in SPECS if not s.sparse]
REPEAT_SPECS = [s for s in _DENSE if s.mask.window or s.mask.varlen or s.gqa][:4] + _DENSE[:2]


@pytest.mark.parametrize("spec", REPEAT_SPECS, ids=kernel_name)
def test_repeated_runs_are_bitwise_identical(spec, specs):  # noqa: ARG001
    kernel = _kernel(spec)
    case = {
        "heads": 2,
        "kv_heads": 2 if not spec.gqa else 1,
        "seed": 3,
        "batch": 2,
        "sq": 300,
        "sk": 257,
        "values": "normal",
        "lens_q": [5, 300],
        "lens_k": [257, 1],
    }
    if spec.mask.window:
        case["window"] = (40, 7)
    q, k, v, kwargs = make_inputs(spec, case)
    first = kernel.run(q, k, v, **kwargs)
    for _ in range(3):
        again = kernel.run(q, k, v, **kwargs)
        assert np.array_equal(first.o.view(np.uint32), again.o.view(np.uint32))
        assert np.array_equal(first.lse.view(np.uint32), again.lse.view(np.uint32))
