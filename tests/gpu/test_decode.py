"""Decode kernels on a GPU against the float64 reference (pass rule), plus the exact checks:
paged == contiguous bitwise for one split count, merge_states of a split call vs the unsplit
kernel, counted IO vs the model to the byte, and hostile inputs (flags and check messages).

Drawn cases carry the values of the score-stage features the spec has (softcap, ALiBi slopes
of shape (heads,) or (batch, heads), sinks: verify.strategies.score_args); hand-picked cases
use fixed ones (`fixed_score_args`), and IO counts include the slope and sink reads.

FP8-cache specs (`kv_dtype: e4m3`) run every test here too: the caches are stored as e4m3
codes of `k / k_descale` (descales drawn: ones, per (batch, kv head), per tensor), the
reference takes the e4m3 values with the descales (dequantised in float64) and the pass rule
is FlashAttention-3's FP8 one (`passrule.check_fp8_cache`); the FP8-only tests below check
that power-of-two descales only move exponents, bit for bit.

One command: `python -m pytest -q tests/gpu/test_decode.py` (FLASHGEN_GPU_EXAMPLES examples
per shipped spec). Failures print the kernel, the case and the pass rule's errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from flashgen.generator.families.decode import ERR_PAGE_ID, ERR_SEQLEN
from flashgen.generator.naming import kernel_name
from flashgen.verify import fp8, passrule, reference_decode
from flashgen.verify.io_model_decode import decode_bytes
from flashgen.verify.numerics import round_to
from flashgen.verify.runner import RunnerError
from flashgen.verify.runner_decode import load_decode_kernel
from flashgen.verify.strategies import fixed_score_args, score_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import CUBIN_DIR, shipped_specs

EXAMPLES = int(os.environ.get("FLASHGEN_GPU_EXAMPLES", "200"))
SPECS = [s for s in shipped_specs() if s.kernel.yaml == "decode"]
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def _kernel(spec):
    return load_decode_kernel(spec, CUBIN_DIR)


@st.composite
def decode_case(draw, spec, max_len: int = 700):
    page = draw(st.sampled_from([16, 32, 64, 128, 256])) if spec.paged else None
    batch = draw(st.integers(1, 4))
    special = [0, 1, 2, 63, 64, 65]
    if page:
        special += [page, page + 1, 2 * page, 2 * page + 1]
    lens = [
        draw(st.one_of(st.sampled_from(special), st.integers(0, max_len))) for _ in range(batch)
    ]
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4, 8, 16])) if spec.gqa else 1
    case = {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "lens": lens,
        "sq": draw(st.sampled_from([1, 1, 2, 3, 7, 16])),
        "heads": kv_heads * group,
        "kv_heads": kv_heads,
        "page": page,
        "capacity": max(lens) + draw(st.integers(0, 40)),
        "splits": draw(st.sampled_from([0, 0, 1, 2, 3, 7])),
        "values": draw(st.sampled_from(["normal", "normal", "large"])),
        "row_pad": draw(st.sampled_from([0, 0, 8])),
        "window": (draw(st.sampled_from([-1, 0, 3, 70])), draw(st.sampled_from([-1, 0, 2])))
        if spec.mask.window
        else (-1, -1),
    }
    case["score"] = draw(score_args(spec, batch, case["heads"]))
    if spec.kv_dtype is not None:
        case["descale"] = draw(st.sampled_from(["ones", "per_head", "per_head", "scalar"]))
    return case


def fp8_descales(spec, case):
    """(k_descale, v_descale) of an FP8-cache case: float32 (batch, kv_heads) arrays or
    scalars, from the case's seed; (None, None) for a 16-bit cache."""
    if spec.kv_dtype is None:
        return None, None
    kind = case.get("descale", "per_head")
    shape = (len(case["lens"]), case["kv_heads"])
    rng = np.random.default_rng(case["seed"] + 7)
    if kind == "ones":
        return np.float32(1.0), np.float32(1.0)
    if kind == "scalar":
        return np.float32(rng.uniform(0.01, 4.0)), np.float32(rng.uniform(0.01, 4.0))
    return (
        rng.uniform(0.01, 4.0, shape).astype(np.float32),
        rng.uniform(0.01, 4.0, shape).astype(np.float32),
    )


def _per_row(ds, shape):
    """A descale broadcast over a cache `(batch, rows, kv_heads, d)`."""
    ds = np.asarray(ds, dtype=np.float64)
    return ds if ds.ndim == 0 else ds[:, None, :, None]


def fp8_stored(spec, case, k, v):
    """What the runner is given to store: k / k_descale, v / v_descale (FP8 caches), and the
    descale arguments; the 16-bit caches as they are."""
    kd, vd = fp8_descales(spec, case)
    if kd is None:
        return k, v, {}
    k = (k / _per_row(kd, k.shape)).astype(np.float32)
    v = (v / _per_row(vd, v.shape)).astype(np.float32)
    return k, v, {"k_descale": kd, "v_descale": vd}


def fp8_kwargs(res):
    """The descales of a result for the reference (empty for a 16-bit cache)."""
    if "k_descale" not in res.inputs:
        return {}
    return {"k_descale": res.inputs["k_descale"], "v_descale": res.inputs["v_descale"]}


def case_score(spec, case):
    """The case's score-stage values, or fixed ones for a hand-picked case."""
    if "score" in case:
        return case["score"]
    return fixed_score_args(spec, len(case["lens"]), case["heads"])


def make_problem(spec, case):
    rng = np.random.default_rng(case["seed"])
    b, d = len(case["lens"]), spec.head_dim
    q = rng.standard_normal((b, case["sq"], case["heads"], d)).astype(np.float32)
    k = rng.standard_normal((b, case["capacity"], case["kv_heads"], d)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    if case["values"] == "large":
        q *= np.float32(300.0)
    for i, n in enumerate(case["lens"]):  # rows past a sequence's length must never be read
        k[i, n:] = np.nan
        v[i, n:] = np.nan
    return rng, q, k, v


def run_case(kernel, spec, case, **extra):
    """One run of the case's problem; returns the result and the problem's q, k, v as drawn
    (FP8: before the division by the descales that `fp8_stored` makes for the upload)."""
    rng, q, k, v = make_problem(spec, case)
    kw = dict(window=case["window"], row_pad=case["row_pad"], **extra)
    res = _run_arrays(kernel, spec, case, q, *fp8_stored(spec, case, k, v), rng=rng, **kw)
    return res, q, k, v


def _rule(spec):
    """The pass rule of the spec's outputs: FA3's FP8 rule for FP8 caches (passrule docs)."""
    if spec.kv_dtype is None:
        return passrule.check

    def rule(kernel_out, ref64, baseline, dtype, *, extra_floor=0.0):
        return passrule.check_fp8_cache(
            kernel_out, ref64, baseline, dtype, softcap=spec.has("softcap"),
            extra_floor=extra_floor,
        )  # fmt: skip

    return rule


def check_reference(spec, case, res, recorder, test):
    qi, ki, vi = res.inputs["q"], res.inputs["k"], res.inputs["v"]  # contiguous (see below)
    kw = dict(causal=spec.mask.causal.yaml, window=case["window"], **res.score.kwargs())
    kw.update(fp8_kwargs(res))
    o64, lse64 = reference_decode.decode_reference(qi, ki, vi, case["lens"], **kw)
    ob, lseb = reference_decode.decode_baseline(
        qi, ki, vi, case["lens"], dtype=spec.dtype.yaml, **kw
    )
    k_eff = ki if spec.kv_dtype is None else reference_decode.dequantize(ki, kw["k_descale"])
    check = _rule(spec)
    found = {
        "o": check(res.o, o64, ob, spec.dtype.yaml),
        "lse": check(
            res.lse,
            lse64,
            lseb,
            "fp32",
            extra_floor=passrule.score_floor(qi, np.nan_to_num(k_eff), 1 / np.sqrt(spec.head_dim))
            + passrule.alibi_floor(res.score.alibi_slopes, case["sq"] + max(case["lens"]))
            + passrule.softcap_floor(res.score.softcap)
            + passrule.usermod_floor(res.score.score_params, case["sq"] + max(case["lens"])),
        ),
    }
    recorder.add(spec, found, test)
    assert res.stats["margins_intact"], f"{kernel_name(spec)}: a write outside a buffer ({case})"
    assert res.stats["row_pad_intact"], f"{kernel_name(spec)}: a write into row padding ({case})"
    assert res.errors == 0, f"{kernel_name(spec)}: error word {res.errors} on valid input ({case})"
    for out, v in found.items():
        assert v.passed, f"{kernel_name(spec)} {out}: {v.message}; splits {res.num_splits}; {case}"


def _reference_inputs(spec, case, res, q, k, v):
    """res.inputs in the contiguous layout (paged caches gathered back)."""
    from flashgen.verify.numerics import round_to

    dt = spec.dtype.yaml
    if spec.kv_dtype is not None:  # the e4m3 values of k / k_descale (the runner's upload)
        k, v, _ = fp8_stored(spec, case, k, v)
        kr, vr = fp8.round_trip(k), fp8.round_trip(v)
    else:
        kr, vr = round_to(k, dt), round_to(v, dt)
    res.inputs = {
        **res.inputs,  # the score-stage fp32 arrays and the descales, if any
        "q": round_to(q, dt),
        "k": kr,
        "v": vr,
    }
    return res


@pytest.mark.parametrize("spec", SPECS, ids=kernel_name)
def test_shipped_decode_matches_reference(spec, specs, recorder):  # noqa: ARG001
    kernel = _kernel(spec)

    @SETTINGS
    @given(case=decode_case(spec))
    def prop(case):
        res, q, k, v = run_case(kernel, spec, case)
        check_reference(
            spec, case, _reference_inputs(spec, case, res, q, k, v), recorder, "reference"
        )

    try:
        prop()
    except BaseException:
        recorder.fail(spec, "reference")
        raise


def _pairs():
    """(contiguous, paged) shipped specs that differ only in `paged`."""
    by_key = {}
    for s in SPECS:
        by_key.setdefault(s.replace(paged=False, tile=s.tile), {})[s.paged] = s
    return [(d[False], d[True]) for d in by_key.values() if len(d) == 2]


@pytest.mark.parametrize("pair", _pairs(), ids=lambda p: kernel_name(p[1]))
def test_paged_and_contiguous_caches_give_bitwise_equal_outputs(pair):
    contiguous, paged = (_kernel(s) for s in pair)
    for seed, splits, page in ((1, 1, 16), (2, 3, 64), (3, 5, 256), (4, 2, 32)):
        case = {
            "seed": seed,
            "lens": [0, 1, 300, 256, 257],
            "sq": 2,
            "heads": 8,
            "kv_heads": 2,
            "page": page,
            "capacity": 320,
            "splits": splits,
            "values": "normal",
            "row_pad": 0,
            "window": (100, 0) if pair[0].mask.window else (-1, -1),
        }
        a, *_ = run_case(contiguous, pair[0], case)
        b, *_ = run_case(paged, pair[1], case)
        assert a.num_splits == b.num_splits == splits
        assert np.array_equal(a.o.view(np.uint32), b.o.view(np.uint32)), case
        assert np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32)), case


# ALiBi's distance and a sink belong to the whole cache, not to a part of it: merging parts
# run as separate calls is a different problem for those specs, and for a score_mod that
# reads positions or lengths (j restarts in each part, seqlen_k is the part's)
_POSITIONS = frozenset({"i", "j", "seqlen_q", "seqlen_k"})
MERGE_SPECS = [
    s
    for s in SPECS
    if not (s.has("alibi") or s.has("sink"))
    and (s.score_mod is None or not s.score_mod.variables & _POSITIONS)
][:4]


@pytest.mark.parametrize("spec", MERGE_SPECS, ids=kernel_name)
def test_merge_states_of_split_parts_matches_the_unsplit_kernel(spec, recorder):
    """Parts = the kernel run on disjoint key ranges (as context parallelism makes them),
    merged by merge_states, against the unsplit kernel and the reference, by the pass rule."""
    kernel = _kernel(spec)
    rng = np.random.default_rng(5)
    d, b, sq, h, n = spec.head_dim, 2, 1, 8, 900
    hk = 2 if spec.gqa else h  # a spec without gqa takes kv_heads == heads only
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, n, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, n, hk, d)).astype(np.float32)
    cuts = [0, 100, 555, n]
    parts_o, parts_lse = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        case = {
            "seed": 0,
            "lens": [hi - lo] * b,
            "sq": sq,
            "heads": h,
            "kv_heads": hk,
            "page": 64,
            "capacity": hi - lo,
            "splits": 1,
            "values": "normal",
            "row_pad": 0,
            "window": (-1, -1),
        }
        part = run_case_arrays(kernel, spec, case, q, k[:, lo:hi], v[:, lo:hi])
        parts_o.append(part.o)
        parts_lse.append(part.lse)
    for in_dtype in (False, True):
        o, lse = kernel.merge_states(
            np.stack(parts_o), np.stack(parts_lse), parts_in_dtype=in_dtype
        )
        whole = run_case_arrays(
            kernel,
            spec,
            {
                "seed": 0,
                "lens": [n] * b,
                "sq": sq,
                "heads": h,
                "kv_heads": hk,
                "page": 64,
                "capacity": n,
                "splits": 1,
                "values": "normal",
                "row_pad": 0,
                "window": (-1, -1),
            },
            q,
            k,
            v,
        )
        qi, ki, vi = whole.inputs["q"], whole.inputs["k"], whole.inputs["v"]
        o64, lse64 = reference_decode.decode_reference(
            qi, ki, vi, [n] * b, **whole.score.kwargs(), **fp8_kwargs(whole)
        )
        check = _rule(spec)
        found = {
            "o": check(o, o64, whole.o, spec.dtype.yaml),
            "lse": check(lse, lse64, whole.lse, "fp32"),
        }
        recorder.add(spec, found, "merge_states")
        for out, verdict in found.items():
            assert verdict.passed, (
                f"merge_states {out} (parts in dtype: {in_dtype}): {verdict.message}"
            )


def run_case_arrays(kernel, spec, case, q, k, v):
    """run_case with given arrays (no NaN rows past the lengths: the lengths are full)."""
    res = _run_arrays(kernel, spec, case, q, *fp8_stored(spec, case, k, v))
    return _reference_inputs(spec, case, res, q, k, v)


def _run_arrays(kernel, spec, case, q, k, v, descales, rng=None, **kw):
    """One run of stored arrays (FP8: already divided by the descales, which are passed);
    a paged spec's pages are placed by `rng` (default: one seeded by the case)."""
    args = {**case_score(spec, case).kwargs(), **descales, **kw}
    if spec.paged:
        rng = rng if rng is not None else np.random.default_rng(case["seed"])
        kp, table = reference_decode.to_paged(k, case["lens"], case["page"], rng)
        vp = np.full_like(kp, np.nan)
        for bi, n in enumerate(case["lens"]):
            for p in range(-(-n // case["page"])):
                rows = min(case["page"], n - p * case["page"])
                vp[table[bi, p], :rows] = v[bi, p * case["page"] : p * case["page"] + rows]
        return kernel.run(
            q, kp, vp, case["lens"], block_table=table, num_splits=case["splits"], **args
        )
    return kernel.run(q, k, v, case["lens"], num_splits=case["splits"], **args)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.instrument_io], ids=kernel_name)
def test_counted_io_equals_the_model_to_the_byte(spec):
    kernel = _kernel(spec)
    for seed, splits, page, lens, sq in (
        (1, 1, 16, [0, 1, 300], 1),
        (2, 3, 64, [257, 64, 5], 3),
        (3, 7, 256, [1000, 999], 16),
        (4, 2, 32, [33], 2),
    ):
        case = {
            "seed": seed,
            "lens": lens,
            "sq": sq,
            "heads": 8,
            "kv_heads": 2,
            "page": page,
            "capacity": max(lens) + 3,
            "splits": splits,
            "values": "normal",
            "row_pad": 0,
            "window": (50, 1),
        }
        res, *_ = run_case(kernel, spec, case)
        want = decode_bytes(
            spec,
            batch=len(lens),
            heads=8,
            kv_heads=2,
            seqlen_q=sq,
            seqlen_k=0,
            cache_seqlens=lens,
            window=(50, 1),
            page_size=page,
            num_splits=res.num_splits,
        )
        want.pop("total")
        assert res.io == want, f"{kernel_name(spec)} {case}: counted {res.io}, model {want}"


def _hostile_spec():
    # every shard runs the hostile-input tests, so they take a paged kernel from all shipped
    # decode specs, not only this shard's
    paged = [s for s in shipped_specs(sharded=False) if s.kernel.yaml == "decode" and s.paged]
    if not paged:
        pytest.skip("no paged decode kernel among the shipped specs")
    return paged[0]


def test_out_of_range_page_ids_are_flagged_and_never_read():
    spec = _hostile_spec()
    kernel = _kernel(spec)
    case = {
        "seed": 9,
        "lens": [40, 70],
        "sq": 1,
        "heads": 4,
        "kv_heads": 1,
        "page": 16,
        "capacity": 70,
        "splits": 1,
        "values": "normal",
        "row_pad": 0,
        "window": (-1, -1),
    }
    rng, q, k, v = make_problem(spec, case)
    kp, table = reference_decode.to_paged(k, case["lens"], 16, rng)
    vp = np.zeros_like(kp)
    score = case_score(spec, case).kwargs()
    for bad in (kp.shape[0], 1 << 30, -1):
        t = table.copy()
        t[1, 2] = bad
        res = kernel.run(q, kp, vp, case["lens"], block_table=t, **score)
        assert res.errors & ERR_PAGE_ID, f"page id {bad}: error word {res.errors}"
        assert res.stats["margins_intact"]


def test_cache_seqlens_past_the_capacity_are_flagged_and_clamped():
    for spec in SPECS[:2]:
        kernel = _kernel(spec)
        case = {
            "seed": 10,
            "lens": [30],
            "sq": 1,
            "heads": 4,
            "kv_heads": 1,
            "page": 16,
            "capacity": 32,
            "splits": 0,
            "values": "normal",
            "row_pad": 0,
            "window": (-1, -1),
        }
        res, *_ = run_case(kernel, spec, case)
        assert res.errors == 0
        rng, q, k, v = make_problem(spec, case)
        k = np.nan_to_num(k)
        v = np.nan_to_num(v)
        score = case_score(spec, case).kwargs()
        if spec.paged:
            kp, table = reference_decode.to_paged(k, [32], 16, rng, spare_columns=0)
            res = kernel.run(q, kp, kp, [10_000], block_table=table, **score)
        else:
            res = kernel.run(q, k, v, [10_000], **score)
        assert res.errors & ERR_SEQLEN and np.all(np.isfinite(res.o))


def test_bad_parameters_are_refused_with_messages():
    spec = _hostile_spec()
    kernel = _kernel(spec)
    case = {
        "seed": 11,
        "lens": [20],
        "sq": 1,
        "heads": 4,
        "kv_heads": 1,
        "page": 16,
        "capacity": 20,
        "splits": 1,
        "values": "normal",
        "row_pad": 0,
        "window": (-1, -1),
    }
    cases = {
        "page_size": ({"page_size": 24}, "power of two"),
        "seqlen_q": ({"seqlen_q": 17}, "1..16"),
        "splits": ({"num_splits": 129}, "1..128"),
        "misaligned": ({"q_row_stride": 4 * 64 + 4}, "multiples of 8"),
        "workspace": ({"workspace_size": 16}, "workspace_size"),
        "table": ({"block_table_stride": 0, "max_pages": 2}, "block_table_stride"),
    }
    for what, (override, message) in cases.items():
        with pytest.raises(RunnerError, match=message):
            run_case(kernel, spec, case, overrides=override)
        assert what


# -- FP8 caches (kv_dtype: e4m3) ---------------------------------------------------------------

FP8_SPECS = [s for s in SPECS if s.kv_dtype is not None]


def _fp8_id(spec):
    return kernel_name(spec) if spec is not None else "none"


def _fp8_case(seed, lens, window, splits=1):
    return {
        "seed": seed,
        "lens": lens,
        "sq": 2,
        "heads": 8,
        "kv_heads": 2,
        "page": 64,
        "capacity": max(lens) + 5,
        "splits": splits,
        "values": "normal",
        "row_pad": 0,
        "window": window,
    }


@pytest.mark.parametrize("spec", FP8_SPECS or [None], ids=_fp8_id)
def test_fp8_power_of_two_descales_only_move_exponents(spec, specs):  # noqa: ARG001
    """k_descale joins the softmax scale and v_descale multiplies O where it is normalised,
    so with powers of two they only move exponents: the kernel with descales (kd, vd) and
    softmax scale s gives bitwise the LSE of descales (1, 1) with scale s * kd, and O times
    vd, for the same split count. (The FP8 kernel reads K and V through registers in another
    head-dim order than a 16-bit kernel's ldmatrix, and takes P V in fp16, so it is not
    compared bitwise with its 16-bit twin; the reference test bounds both.)"""
    if spec is None:
        pytest.skip("no FP8 spec in this shard")
    kernel = _kernel(spec)
    window = (100, 0) if spec.mask.window else (-1, -1)
    for seed, splits in ((1, 1), (2, 3)):
        case = _fp8_case(seed, [0, 1, 300, 257], window, splits)
        rng, q, k, v = make_problem(spec, case)
        k8, v8 = fp8.round_trip(np.nan_to_num(k)), fp8.round_trip(np.nan_to_num(v))
        kd, vd = float(2.0 ** rng.integers(-3, 4)), float(2.0 ** rng.integers(0, 4))
        s = 1.0 / np.sqrt(spec.head_dim)
        args = dict(num_splits=splits, window=window)
        if spec.paged:
            k8, table = reference_decode.to_paged(k8, case["lens"], 64, np.random.default_rng(0))
            v8, _ = reference_decode.to_paged(v8, case["lens"], 64, np.random.default_rng(0))
            args["block_table"] = table
        a = kernel.run(q, k8, v8, case["lens"], k_descale=kd, v_descale=vd, softmax_scale=s,
                       **args)  # fmt: skip
        b = kernel.run(q, k8, v8, case["lens"], k_descale=1.0, v_descale=1.0,
                       softmax_scale=s * kd, **args)  # fmt: skip
        assert a.num_splits == b.num_splits == splits
        assert np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32)), case
        # O is rounded once to the output dtype: scaling by vd >= 1 commutes with that
        # rounding where the unscaled value is a normal number of the output dtype
        tiny = np.finfo(np.float16).tiny if spec.dtype.yaml == "fp16" else 2.0**-126
        normal = np.abs(b.o) >= tiny
        assert normal.mean() > 0.5, case
        assert np.array_equal(a.o[normal], b.o[normal] * np.float32(vd)), case


@pytest.mark.parametrize("spec", FP8_SPECS[:4] or [None], ids=_fp8_id)
def test_fp8_descale_broadcast_equals_the_full_array(spec, specs):  # noqa: ARG001
    """A per-tensor descale (one element, strides 0) and the (batch, kv_heads) array holding
    the same value give bitwise equal outputs."""
    if spec is None:
        pytest.skip("no FP8 spec in this shard")
    kernel = _kernel(spec)
    case = _fp8_case(3, [40, 129], (50, 0) if spec.mask.window else (-1, -1), 2)
    _, q, k, v = make_problem(spec, case)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    kw = dict(num_splits=2, window=case["window"])
    if spec.paged:
        kp, table = reference_decode.to_paged(k, case["lens"], 64, np.random.default_rng(0))
        vp, _ = reference_decode.to_paged(v, case["lens"], 64, np.random.default_rng(0))
        k, v = kp, vp
        kw["block_table"] = table
    one = kernel.run(q, k, v, case["lens"], k_descale=0.375, v_descale=1.5, **kw)
    full = kernel.run(
        q, k, v, case["lens"], k_descale=np.full((2, 2), 0.375, np.float32),
        v_descale=np.full((2, 2), 1.5, np.float32), **kw,
    )  # fmt: skip
    assert np.array_equal(one.o.view(np.uint32), full.o.view(np.uint32))
    assert np.array_equal(one.lse.view(np.uint32), full.lse.view(np.uint32))


@pytest.mark.parametrize("spec", FP8_SPECS[:4] or [None], ids=_fp8_id)
def test_fp8_nan_codes_propagate_as_nan_does_in_a_16_bit_cache(spec, specs):  # noqa: ARG001
    """A NaN code (0x7F) in a key or value row a query sees makes exactly the rows of that
    sequence and KV head's group NaN (as a NaN in a bf16 cache would: every query of the group
    sees the row); the other sequences and heads stay finite. (e4m3fn has no inf: an inf
    quantises to NaN or +-448, verify/fp8.py.)"""
    if spec is None:
        pytest.skip("no FP8 spec in this shard")
    kernel = _kernel(spec)
    case = _fp8_case(4, [64, 90], (-1, -1), 1)
    case["sq"] = 1
    _, q, k, v = make_problem(spec, case)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    for cache in ("k", "v"):
        kk, vv = k.copy(), v.copy()
        (kk if cache == "k" else vv)[1, 10, 0, 3] = np.nan  # sequence 1, KV head 0, key 10
        o64, _ = reference_decode.decode_reference(
            round_to(q, spec.dtype.yaml), fp8.round_trip(kk), fp8.round_trip(vv), case["lens"],
            causal=spec.mask.causal.yaml, k_descale=1.0, v_descale=1.0,
        )  # fmt: skip
        want = np.isnan(o64).any(axis=-1)  # (batch, sq, heads): the reference's NaN rows
        assert want[1, :, :4].all() and not want[0].any() and not want[1, :, 4:].any()
        kw = {}
        if spec.paged:
            kk, table = reference_decode.to_paged(kk, case["lens"], 64, np.random.default_rng(0))
            vv, _ = reference_decode.to_paged(vv, case["lens"], 64, np.random.default_rng(0))
            kw["block_table"] = table
        res = kernel.run(q, kk, vv, case["lens"], num_splits=1, **kw)
        nan_rows = np.isnan(res.o).any(axis=-1)
        assert np.array_equal(nan_rows, want), f"{cache}: NaN rows {np.argwhere(nan_rows)}"
