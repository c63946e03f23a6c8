"""Backward kernels on a GPU against the float64 reference, with the pass rule and exact checks.

Every shipped `kernel: backward` spec runs FLASHGEN_GPU_EXAMPLES Hypothesis-drawn cases of the
features it has (shapes with odd lengths, 1, seqlen_q != seqlen_k both ways, varlen batches
with empty sequences, GQA groups, windows, memory layouts and row padding on inputs and
outputs, block layouts, dropout, and the score-stage values: softcap, ALiBi slopes, sinks
drawn by verify.strategies.score_args; hand-picked cases use fixed_score_args). O and LSE
come from the float64 reference forward (O rounded to the dtype, LSE in float32), as a
training step would pass the forward's. Each of dq, dk, dv
must satisfy the pass rule (max |dX - ref64| <= 2 max |dX_baseline - ref64| + floor, the floor
for dq and dk at least the float32 error bound of dS = P (dP - D): see gradient_floors), and
so must dsinks (fp32, against the baseline backward's, the floor at least the float32 bound
of its sum); and, in every case, exactly:

- no NaN or inf anywhere (dsinks included), no write outside an output (poisoned margins and
  row padding);
- dq is exactly 0 on rows that see no key, dk and dv exactly 0 on keys no query sees;
- debug keep-masks equal verify.dropout's bit for bit wherever written, and every visible
  element is written (the buffer is poisoned with 2);
- instrument_io counters equal verify.io_model_bwd.backward_bytes to the byte.

GQA sums over each group are checked through the reference (its dk, dv are the group sums).
Values avoid scores of ~1e4: there the float32 score error of the recomputed P (about 1e-3
relative) exceeds the dtype's rounding, and the pass rule would compare summation orders.
"""

from __future__ import annotations

from functools import lru_cache, partial

import numpy as np
import pytest
from flashgen.generator.naming import kernel_name
from flashgen.verify import baseline, dropout, passrule, reference
from flashgen.verify.blocksparse import compact_layout_for_spec
from flashgen.verify.io_model_bwd import backward_bytes
from flashgen.verify.passrule import TANH_APPROX_REL
from flashgen.verify.runner_bwd import load_bwd_kernel
from flashgen.verify.score_mods import check_score_args, softcap_factor
from flashgen.verify.strategies import (
    block_layouts,
    fixed_score_args,
    score_args,
    self_attention,
)
from hypothesis import given
from hypothesis import strategies as st

from .checks import assert_pass
from .conftest import CUBIN_DIR, shipped_specs
from .test_forward import SETTINGS

SPECS = [s for s in shipped_specs() if s.kernel.yaml == "backward"]
LENGTHS = [1, 2, 7, 15, 16, 17, 31, 63, 64, 65, 97, 127, 128, 129, 255, 257, 300]
WINDOWS = [-1, 0, 1, 5, 33, 100, 300]


@lru_cache(maxsize=None)
def _kernel(spec):
    return load_bwd_kernel(spec, CUBIN_DIR)


# -- cases ---------------------------------------------------------------------------------------


@st.composite
def bwd_case(draw, spec, max_len: int = 300):
    """A runtime problem for `spec`: sizes, lengths, window, values, memory layout, and the
    spec's features (block mask, dropout, score-stage values)."""
    lens = st.one_of(st.sampled_from(LENGTHS), st.integers(1, max_len))
    if spec.gqa:
        kv_heads = draw(st.integers(1, 2))
        heads = kv_heads * draw(st.integers(1, 4 // kv_heads))
    else:
        heads = kv_heads = draw(st.integers(1, 3))
    case = {"heads": heads, "kv_heads": kv_heads, "seed": draw(st.integers(0, 2**32 - 1))}
    if spec.mask.varlen:
        nseq = draw(st.integers(1, 4))
        if spec.sparse:  # one layout serves every sequence: equal lengths
            sq, sk = draw(lens), draw(lens)
            case["lens_q"], case["lens_k"] = [sq] * nseq, [sk] * nseq
        else:
            each = st.one_of(st.just(0), lens) if draw(st.booleans()) else lens
            case["lens_q"] = [draw(each) for _ in range(nseq)]
            case["lens_k"] = [draw(each) for _ in range(nseq)]
            # at least one row and one key in the batch (no zero-sized tensors)
            if sum(case["lens_q"]) == 0:
                case["lens_q"][-1] = draw(lens)
            if sum(case["lens_k"]) == 0:
                case["lens_k"][0] = draw(lens)
        if self_attention(spec):  # a per_token vector: queries and keys are the same tokens
            case["lens_k"] = list(case["lens_q"])
        case["batch"] = nseq
        case["sq"], case["sk"] = max(case["lens_q"]), max(case["lens_k"])
    else:
        case["batch"] = draw(st.integers(1, 2))
        case["sq"] = draw(lens)
        case["sk"] = case["sq"] if draw(st.integers(0, 3)) == 0 else draw(lens)
        if self_attention(spec):
            case["sk"] = case["sq"]
    if spec.mask.window:
        case["window"] = (draw(st.sampled_from(WINDOWS)), draw(st.sampled_from(WINDOWS)))
    case["values"] = draw(st.sampled_from(["normal", "normal", "wide", "sharp"]))
    case["memory_layout"] = draw(st.sampled_from(["bshd", "bhsd"]))
    case["pad"] = draw(st.sampled_from([0, 0, 8, 24]))
    if spec.sparse:
        tr = -(-case["sq"] // spec.tile.block_m)
        tc = -(-case["sk"] // spec.tile.block_n)
        lh = draw(st.sampled_from(sorted({1, heads})))
        case["block_mask"] = draw(block_layouts(lh, tr, tc))
    if spec.dropout:
        case["p"] = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9]))
        case["drop_seed"] = draw(st.integers(0, 2**64 - 1))
        case["drop_offset"] = draw(st.integers(0, 2**32 - 1))
    case["score"] = draw(score_args(spec, case["batch"], heads, case_tokens(spec, case)))
    return case


def case_tokens(spec, case):
    """The case's query and key token counts (per-token parameters hold one id each)."""
    if spec.mask.varlen:
        return sum(case["lens_q"]), sum(case["lens_k"])
    return case["batch"] * case["sq"], case["batch"] * case["sk"]


def make_inputs(spec, case):
    """float32 q, k, v, dout of the case's shapes and value kind; the runner's keyword
    arguments (lengths, window, layout, dropout) and the reference's."""
    rng = np.random.default_rng(case["seed"])
    d, d_v, h, hk = spec.head_dim, spec.head_dim_vo, case["heads"], case["kv_heads"]
    if spec.mask.varlen:
        tq, tk = sum(case["lens_q"]), sum(case["lens_k"])
        q_shape, k_shape = (tq, h, d), (tk, hk, d)
    else:
        b = case["batch"]
        q_shape, k_shape = (b, case["sq"], h, d), (b, case["sk"], hk, d)
    # v, o and dout have the spec's d_v (head_dim_v) as their last dim
    o_shape, v_shape = q_shape[:-1] + (d_v,), k_shape[:-1] + (d_v,)
    q = rng.standard_normal(q_shape).astype(np.float32)
    dout = rng.standard_normal(o_shape).astype(np.float32)
    k = rng.standard_normal(k_shape).astype(np.float32)
    v = rng.standard_normal(v_shape).astype(np.float32)
    if case["values"] == "wide":  # large outputs and gradients, ordinary scores
        v *= np.float32(30.0)
        q *= np.float32(2.0)
    elif case["values"] == "sharp":  # scores ~ N(0, 81): near one-hot rows
        q *= np.float32(3.0)
        k *= np.float32(3.0)
    run_kw: dict = {}
    ref_kw: dict = {"causal": spec.mask.causal.yaml}
    if spec.mask.varlen:
        for nm, lens in (("cu_seqlens_q", case["lens_q"]), ("cu_seqlens_k", case["lens_k"])):
            run_kw[nm] = ref_kw[nm] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if spec.mask.window:
        run_kw["window"] = ref_kw["window"] = tuple(case["window"])
    if spec.sparse:
        run_kw["layout"] = compact_layout_for_spec(
            case["block_mask"],
            spec,
            seqlen_q=case["sq"],
            seqlen_k=case["sk"],
            window=case.get("window", (-1, -1)),
        )
        ref_kw.update(
            block_mask=case["block_mask"], block_m=spec.tile.block_m, block_n=spec.tile.block_n
        )
    if spec.dropout:
        p, seed, offset = case["p"], case["drop_seed"], case["drop_offset"]
        if spec.mask.varlen:
            keep = dropout.keep_mask_varlen(seed, offset, h, case["lens_q"], case["lens_k"], p)
        else:
            keep = dropout.keep_mask(seed, offset, case["batch"], h, case["sq"], case["sk"], p)
        run_kw.update(dropout_p=p, seed=seed, offset=offset)
        ref_kw.update(keep_mask=keep, dropout_p=p)
    score = case.get("score") or fixed_score_args(spec, case["batch"], h, case_tokens(spec, case))
    run_kw.update(score.kwargs())  # float32-representable: the runner uploads them as they are
    ref_kw.update(score.kwargs())
    return q, k, v, dout, run_kw, ref_kw


def forward_outputs(spec, q, k, v, ref_kw):
    """O (rounded to the dtype) and LSE (float32) of the float64 reference forward."""
    dt = spec.dtype.yaml
    qr, kr, vr = (baseline.round_to_dtype(x, dt) for x in (q, k, v))
    o64, lse64 = reference.attention_forward(qr, kr, vr, **ref_kw)
    return baseline.round_to_dtype(o64, dt), lse64.astype(np.float32)


# -- checks --------------------------------------------------------------------------------------


def _ds_bound_core(inp, o, lse, do, rows: int = 0):
    """`reference.run_backward` core: per element of dQ and dK, the float32 error bound of
    dS = P (dP - D) carried through dQ = scale dS K and dK = scale dS^T Q (dV: none); with
    sinks, per head, the float32 bound of dsink = -sum_i exp(sink - LSE_i) D_i, a sum of
    `rows` terms (the head's rows over the whole batch; functools.partial sets it)."""
    s = reference.scaled_scores(inp)
    p = reference.probabilities_from_lse(reference.score_logits(inp, s), inp.visible, lse)
    d = max(inp.q.shape[-1], inp.v.shape[-1])  # S is a length-d dot, dP one of length d_v
    gamma = (d + 2) * float(np.finfo(np.float32).eps)  # two length-d dots and a subtraction
    do_h = np.abs(do.transpose(1, 0, 2))  # (h, Sq, d)
    dp_mag = do_h @ np.abs(inp.v.transpose(1, 2, 0))  # (h, Sq, Sk): sum |dO| |V|
    if inp.keep is not None:
        dp_mag = dp_mag * inp.keep / (1.0 - inp.dropout_p)
    d_mag = np.sum(do_h * np.abs(o.transpose(1, 0, 2)), axis=-1)  # (h, Sq): sum |dO| |O|
    e_ds = gamma * p * (dp_mag + d_mag[..., None])
    cap = softcap_factor(s, inp.softcap)  # dS = dZ (1 - t^2): the factor is at most 1
    if cap is not None:
        # tanh.approx (relative 2^-11 in t) moves the recomputed P by c 2^-11 relative (the
        # logit) and 1 - t^2 by 2 2^-11 absolute: |dZ| times both, the second of which the
        # baseline's accurate 1 - t^2 does not share where t saturates
        dp = do.transpose(1, 0, 2) @ inp.v.transpose(1, 2, 0)
        if inp.keep is not None:
            dp = dp * inp.keep / (1.0 - inp.dropout_p)
        delta = np.sum(do.transpose(1, 0, 2) * o.transpose(1, 0, 2), axis=-1)
        dz = np.abs(p * (dp - delta[..., None]))
        e_ds = e_ds * cap + TANH_APPROX_REL * dz * (inp.softcap * cap + 2.0)
    # a score_mod: dS = dZ d(mod)/ds, so dZ's bound scales by |d(mod)/ds| (0 where P = 0)
    grad = reference.score_grad(inp, s)
    if grad is not None:
        e_ds = reference.through_score_grad(e_ds, p, np.abs(grad))
    dq = (e_ds @ np.abs(inp.k.transpose(1, 0, 2))) * inp.scale
    dk = (e_ds.transpose(0, 2, 1) @ np.abs(inp.q.transpose(1, 0, 2))) * inp.scale
    dsink = None
    if inp.sinks is not None:
        # D in float32 (length-d dot), exp(sink - LSE) (the subtraction's rounding grows with
        # |sink - LSE|, plus the exponential's), and the sum over the rows and the CTA's
        # reduction: relative (rows + d + 8 + |sink - LSE|) eps32 of sum P_sink |dO| |O|
        fin = np.isfinite(lse)
        gap = np.abs(np.where(fin, inp.sinks[:, None] - np.where(fin, lse, 0.0), 0.0))
        w = np.where(fin, np.exp(inp.sinks[:, None] - np.where(fin, lse, 0.0)), 0.0)
        eps = float(np.finfo(np.float32).eps)
        dsink = eps * ((rows + d + 8 + gap) * w * d_mag).sum(axis=-1)
    return dq.transpose(1, 0, 2), dk.transpose(1, 0, 2), np.zeros_like(inp.v), dsink


def gradient_floors(
    args,
    *,
    causal="none",
    window=(-1, -1),
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    keep_mask=None,
    dropout_p=0.0,
    block_mask=None,
    block_m=None,
    block_n=None,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    score_mod=None,
    score_params=None,
    mask_mod=None,
) -> dict[str, float]:
    """Extra pass-rule floors for dq and dk (passrule.check's `extra_floor`): the standard
    float32 bound on dS = P (dP - D), dot products of length d with eps per operation
    (tensor cores need not round to nearest), propagated through dQ and dK. `args` are the
    backward's (q, k, v, o, lse, dout), the keywords the reference's.

    When dP_ij and D_i nearly cancel (a row that sees one key: seqlen_k = 1, a window (0, 0),
    the first row of top_left causal) the exact gradient is ~0 and both the kernel and the
    baseline return float32 noise whose size depends on the summation order alone, so the
    factor 2 would compare summation orders. Elsewhere the bound is at most of the order of
    the fp16 noise floor (far below it for bf16), so the rule stays the dtype-rounding rule.
    With softcap the bound adds tanh.approx's documented error (see _ds_bound_core); with a
    score_mod it scales by |d(mod)/ds|.

    dsinks (fp32 like the baseline's, a sum over every row of a head) gets the float32 bound
    of that sum ('dsinks', the largest over the heads): kernel and baseline sum in different
    orders, and D_i = rowsum(dO O) cancels to float32 noise exactly where dsink is ~0.
    """
    heads = args[0].shape[-2]
    out = reference.run_backward(
        partial(_ds_bound_core, rows=np.asarray(args[4]).size // heads),
        *args,
        work_dtype=np.float64,
        scale=None,
        causal=causal,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        keep_mask=keep_mask,
        dropout_p=dropout_p,
        block_mask=block_mask,
        block_m=block_m,
        block_n=block_n,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )
    bq, bk = out[0], out[1]
    floors = {"dq": float(bq.max(initial=0.0)), "dk": float(bk.max(initial=0.0)), "dv": 0.0}
    if sinks is not None:
        floors["dsinks"] = float(out[3].max(initial=0.0))
    return floors


def bwd_verdicts(spec, res, ref_kw) -> dict:
    """Pass-rule verdicts of dq, dk, dv (and dsinks, fp32, for a spec with sink) against the
    reference and the same-precision baseline, both fed the kernel's (rounded) inputs, with
    `gradient_floors` as extra floors."""
    i = res.inputs
    args = (i["q"], i["k"], i["v"], i["o"], i["lse"], i["dout"])
    ref = reference.attention_backward(*args, **ref_kw)
    base = baseline.attention_backward(*args, dtype=spec.dtype.yaml, **ref_kw)
    floors = gradient_floors(args, **ref_kw)
    found = {
        nm: passrule.check(g, r, b_, spec.dtype.yaml, extra_floor=floors[nm])
        for nm, g, r, b_ in zip(("dq", "dk", "dv"), (res.dq, res.dk, res.dv), ref, base)
    }
    if spec.has("sink"):
        assert res.dsinks is not None and res.dsinks.shape == (i["q"].shape[-2],)
        found["dsinks"] = passrule.check(
            res.dsinks, ref[3], base[3], "fp32", extra_floor=floors["dsinks"]
        )
    else:  # (results of other front ends, e.g. flashgen.torch's, carry no dsinks at all)
        assert getattr(res, "dsinks", None) is None
    return found


def _packed(per_seq: np.ndarray, cu: np.ndarray | None) -> np.ndarray:
    """`(batch, heads, L)` -> the tensor's `(batch, L, heads)` (dense) or `(total, heads)`."""
    if cu is None:
        return per_seq.transpose(0, 2, 1)
    parts = [per_seq[b, :, : cu[b + 1] - cu[b]].T for b in range(len(cu) - 1)]
    return np.concatenate(parts, axis=0)


def visibility(spec, case, ref_kw) -> np.ndarray:
    """Bool `(batch, heads, max Sq, max Sk)`: rules 1-4 for this case."""
    extra = {
        key: ref_kw[key]
        for key in ("window", "cu_seqlens_q", "cu_seqlens_k", "block_mask", "block_m", "block_n")
        if key in ref_kw
    }
    return reference.visible_mask(
        case["batch"],
        case["heads"],
        case["sq"],
        case["sk"],
        causal=spec.mask.causal.yaml,
        **extra,
    )


def check_exact(spec, case, res, run_kw, ref_kw, vis) -> None:
    """The checks that need no tolerance (see the module docstring)."""
    for nm in ("dq", "dk", "dv") + (("dsinks",) if spec.has("sink") else ()):
        assert np.all(np.isfinite(getattr(res, nm))), f"{nm} holds NaN or inf"
    batch, heads, kv = case["batch"], case["heads"], case["kv_heads"]
    empty_rows = ~vis.any(axis=-1)  # (batch, heads, Sq)
    unseen = ~vis.reshape(batch, kv, heads // kv, case["sq"], case["sk"]).any(axis=(2, 3))
    rows = _packed(empty_rows, run_kw.get("cu_seqlens_q"))
    keys = _packed(unseen, run_kw.get("cu_seqlens_k"))
    assert np.all(res.dq[rows] == 0), "dq is not exactly 0 on a row that sees no key"
    assert np.all(res.dk[keys] == 0), "dk is not exactly 0 on a key no query sees"
    assert np.all(res.dv[keys] == 0), "dv is not exactly 0 on a key no query sees"
    if spec.debug_keep_mask:
        km = res.keep_mask
        assert km is not None and km.shape == vis.shape
        assert np.all(km <= 2), "keep-mask bytes must be 0, 1 or 2 (never written)"
        written = km != 2
        want = ref_kw["keep_mask"].astype(np.uint8)
        np.testing.assert_array_equal(km[written], want[written])
        assert np.all(written[vis]), "a visible element's keep bit was not written"
        if spec.mask.varlen:  # nothing outside each sequence's (Sq_b, Sk_b) corner
            lq, lk = np.diff(run_kw["cu_seqlens_q"]), np.diff(run_kw["cu_seqlens_k"])
            inside = (np.arange(case["sq"])[None, :, None] < lq[:, None, None]) & (
                np.arange(case["sk"])[None, None, :] < lk[:, None, None]
            )
            assert not np.any(written & ~inside[:, None]), "keep bits written outside a sequence"
    if spec.instrument_io:
        want_io = backward_bytes(
            spec,
            batch=batch,
            heads=heads,
            kv_heads=kv,
            seqlen_q=case["sq"],
            seqlen_k=case["sk"],
            window=run_kw.get("window", (-1, -1)),
            cu_seqlens_q=run_kw.get("cu_seqlens_q"),
            cu_seqlens_k=run_kw.get("cu_seqlens_k"),
            layout=run_kw.get("layout"),
        )
        want_io.pop("total")
        assert res.io == want_io, {
            key: (res.io[key], val) for key, val in want_io.items() if res.io[key] != val
        }


def run_and_check(spec, case, recorder, test: str):
    """One case end to end: inputs, forward outputs, the kernel, every check."""
    q, k, v, dout, run_kw, ref_kw = make_inputs(spec, case)
    o, lse = forward_outputs(spec, q, k, v, ref_kw)
    res = _kernel(spec).run(
        q, k, v, o, lse, dout, memory_layout=case["memory_layout"], pad=case["pad"], **run_kw
    )
    found = bwd_verdicts(spec, res, ref_kw)
    assert_pass(spec, found, recorder, test, res)
    vis = visibility(spec, case, ref_kw)
    check_exact(spec, case, res, run_kw, ref_kw, vis)
    return res, vis


def _drawn_cases(spec, recorder, test: str) -> None:
    @SETTINGS
    @given(case=bwd_case(spec))
    def prop(case):
        run_and_check(spec, case, recorder, test)

    try:
        prop()
    except BaseException:
        recorder.fail(spec, test)
        raise


# -- the drawn suites: each spec runs in exactly one -------------------------------------------


def _plain(s):
    return not s.dropout and not s.sparse and not s.instrument_io


@pytest.mark.parametrize("spec", [s for s in SPECS if _plain(s)], ids=kernel_name)
def test_backward_matches_reference(spec, specs, recorder):  # noqa: ARG001
    _drawn_cases(spec, recorder, "bwd_reference")


@pytest.mark.parametrize(
    "spec", [s for s in SPECS if s.dropout and not s.instrument_io], ids=kernel_name
)
def test_backward_dropout_matches_reference_and_keep_mask_is_bit_exact(
    spec,
    specs,
    recorder,  # noqa: ARG001
):
    _drawn_cases(spec, recorder, "bwd_dropout")


@pytest.mark.parametrize(
    "spec",
    [s for s in SPECS if s.sparse and not s.dropout and not s.instrument_io],
    ids=kernel_name,
)
def test_backward_block_sparse_matches_reference_under_the_same_layout(
    spec,
    specs,
    recorder,  # noqa: ARG001
):
    _drawn_cases(spec, recorder, "bwd_sparse")


@pytest.mark.parametrize("spec", [s for s in SPECS if s.instrument_io], ids=kernel_name)
def test_backward_io_counters_equal_backward_bytes_to_the_byte(spec, specs, recorder):  # noqa: ARG001
    _drawn_cases(spec, recorder, "bwd_io")


# -- fixed cases ---------------------------------------------------------------------------------


def _fixed_case(spec, *, sq, sk, lens_q=None, lens_k=None, window=(-1, -1), seed=0):
    """A hand-picked case: dense `sq` x `sk`, or varlen `lens_q`, `lens_k` (with block
    sparsity every sequence gets the longest lengths: one layout serves them all); a full
    block mask, dropout p = 0."""
    heads, kv = (4, 2) if spec.gqa else (2, 2)
    case = {
        "heads": heads,
        "kv_heads": kv,
        "seed": seed,
        "batch": 2,
        "sq": sq,
        "sk": sk,
        "values": "normal",
        "memory_layout": "bshd",
        "pad": 0,
    }
    if self_attention(spec):  # a per_token vector: queries and keys are the same tokens
        case["sk"] = sk = sq
        lens_k = lens_q
    if spec.mask.varlen:
        lens_q, lens_k = list(lens_q), list(lens_k)
        if spec.sparse:
            lens_q, lens_k = [max(lens_q)] * len(lens_q), [max(lens_k)] * len(lens_k)
        case["lens_q"], case["lens_k"] = lens_q, lens_k
        case["batch"] = len(lens_q)
        case["sq"], case["sk"] = max(lens_q), max(lens_k)
    if spec.mask.window:
        case["window"] = window
    if spec.sparse:
        tr, tc = -(-case["sq"] // spec.tile.block_m), -(-case["sk"] // spec.tile.block_n)
        case["block_mask"] = np.ones((1, tr, tc), bool)
    if spec.dropout:
        case.update(p=0.0, drop_seed=1, drop_offset=2)
    return case


EDGE_SHAPES = [(1, 1), (1, 300), (300, 1), (17, 129), (129, 17), (64, 64), (65, 63), (128, 257)]
# varlen: empty query and key sequences, a key-only and a query-only sequence, and 1 x 1
EDGE_LENS = ([0, 5, 130, 1, 0, 64], [7, 0, 129, 1, 0, 300])


@pytest.mark.parametrize("spec", SPECS, ids=kernel_name)
def test_edge_shapes(spec, specs, recorder):  # noqa: ARG001
    """seqlen 1, odd lengths, seqlen_q != seqlen_k both ways; varlen batches with empty
    sequences (their rows get dq = 0, their keys dk = dv = 0)."""
    windows = [(-1, -1), (7, 0), (0, 7)] if spec.mask.window else [(-1, -1)]
    for window in windows:
        if spec.mask.varlen:
            lens_q, lens_k = EDGE_LENS
            cases = [_fixed_case(spec, sq=0, sk=0, lens_q=lens_q, lens_k=lens_k, window=window)]
        else:
            cases = [_fixed_case(spec, sq=sq, sk=sk, window=window) for sq, sk in EDGE_SHAPES]
        for case in cases:
            run_and_check(spec, case, recorder, "bwd_edge")


EMPTY_ROW_SPECS = [s for s in SPECS if s.mask.causal.yaml == "bottom_right" or s.mask.window]


@pytest.mark.parametrize("spec", EMPTY_ROW_SPECS, ids=kernel_name)
def test_rows_with_no_visible_key_give_dq_exactly_zero(spec, specs, recorder):  # noqa: ARG001
    """bottom_right with seqlen_q > seqlen_k, or a window (3, 0) that leaves rows without a
    key in every alignment: those rows have LSE = -inf; their dq must be exactly 0 and nothing
    may be NaN (exp(S - LSE) must never form inf * 0)."""
    case = _fixed_case(spec, sq=150, sk=40, lens_q=[150, 7], lens_k=[40, 50], window=(3, 0))
    res, vis = run_and_check(spec, case, recorder, "bwd_empty_rows")
    assert (~vis.any(axis=-1)).any(), "the case was meant to have rows with no visible key"


ALIBI_SPECS = [s for s in SPECS if s.has("alibi") and s.score_mod is None]


@pytest.mark.parametrize("spec", ALIBI_SPECS, ids=kernel_name)
def test_negative_alibi_slopes_give_finite_gradients_past_the_sequence(spec, specs, recorder):  # noqa: ARG001
    """Slopes -0.5 (and 0): the bias -slope |i - j| grows with the distance, to exp(+150)
    for the query rows past the sequence in the last tile (their Q rows read as 0, and on
    the sm_90a ring their LSE as 0). Nothing of them may reach dK, dV or dQ as inf or NaN;
    the visible elements pass the rule as always."""
    case = _fixed_case(spec, sq=300, sk=300, lens_q=[300, 77], lens_k=[300, 129],
                       window=(200, 50))  # fmt: skip
    heads = case["heads"]
    slopes = np.full(heads, -0.5, np.float32)
    slopes[-1] = 0.0
    case["score"] = check_score_args(
        20.0 if spec.has("softcap") else 0.0, slopes,
        np.linspace(-2.0, 4.0, heads).astype(np.float32) if spec.has("sink") else None,
        batch=case["batch"], heads=heads,
    )  # fmt: skip
    res, _ = run_and_check(spec, case, recorder, "bwd_negative_alibi")
    for nm in ("dq", "dk", "dv"):
        assert np.isfinite(getattr(res, nm)).all(), nm


DETERMINISTIC = [s for s in SPECS if s.deterministic]
REPEAT_SPECS = [s for s in SPECS if (s.gqa or s.mask.varlen) and not s.deterministic][:3]
REPEAT_SPECS += [s for s in SPECS if _plain(s) and not s.deterministic][:2] + DETERMINISTIC


@pytest.mark.parametrize("spec", REPEAT_SPECS, ids=kernel_name)
def test_repeated_runs_are_bitwise_identical_where_promised(spec, specs):  # noqa: ARG001
    """dK and dV are summed in a fixed order (no atomics): repeated runs agree bit for bit;
    deterministic builds order the dQ adds too, so dQ agrees as well; dsinks always."""
    case = _fixed_case(spec, sq=300, sk=257, lens_q=[5, 300], lens_k=[257, 1], window=(40, 7))
    q, k, v, dout, run_kw, ref_kw = make_inputs(spec, case)
    o, lse = forward_outputs(spec, q, k, v, ref_kw)
    kernel = _kernel(spec)
    first = kernel.run(q, k, v, o, lse, dout, **run_kw)
    same = ("dq", "dk", "dv") if spec.deterministic else ("dk", "dv")
    same += ("dsinks",) if spec.has("sink") else ()  # the dsink kernel sums in a fixed order
    for _ in range(2 if not spec.deterministic else 4):
        again = kernel.run(q, k, v, o, lse, dout, **run_kw)
        for nm in same:
            a, b = getattr(first, nm), getattr(again, nm)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), nm


@pytest.mark.parametrize("spec", DETERMINISTIC, ids=kernel_name)
def test_deterministic_dq_is_bitwise_repeatable_with_many_key_tiles(spec, specs):  # noqa: ARG001
    """Many K/V tiles (18 to 36) add into every query tile of dQ: with unordered adds the fp32
    sums differ from run to run; the deterministic builds' ordered turns make them identical.
    With a window, later query tiles' first visiting key tile is past 0 (its turn starts
    there), and keys past the window's right edge are never visited. With causal alone the
    turns descend from each query tile's last visiting key tile: a square problem (the
    diagonal crosses every query tile) and one with more queries than keys run as well."""
    n = 2304
    if spec.mask.window:
        shapes = [(n, n)]
    elif spec.mask.causal.yaml != "none":
        shapes = [(320, n), (n, n), (n, 1100)]
    else:
        shapes = [(320, n)]
    kernel = _kernel(spec)
    for sq, sk in shapes:
        case = _fixed_case(spec, sq=sq, sk=sk, lens_q=[min(sq, 320), 77],
                           lens_k=[sk, 1000], window=(1500, 0))  # fmt: skip
        q, k, v, dout, run_kw, ref_kw = make_inputs(spec, case)
        o, lse = forward_outputs(spec, q, k, v, ref_kw)
        first = kernel.run(q, k, v, o, lse, dout, **run_kw)
        assert np.isfinite(first.dq).all() and np.abs(first.dq).max() > 0
        for _ in range(4):
            again = kernel.run(q, k, v, o, lse, dout, **run_kw)
            for nm in ("dq", "dk", "dv"):
                a, b = getattr(first, nm), getattr(again, nm)
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (nm, sq, sk)
