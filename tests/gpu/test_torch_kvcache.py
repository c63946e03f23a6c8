"""`flashgen.torch.flash_attn_with_kvcache` and `merge_states` on a GPU: against the float64
decode reference by the pass rule (contiguous and paged caches with pages in random order,
GQA, causal, windows, ragged cache_seqlens with 0 and 1, 1..16 queries, the LSE), the
score-stage features (softcap, ALiBi of either slope shape, attention sinks) against the
float64 torch reference of tests/gpu/test_torch.py, paged == contiguous bitwise for one split
count, merge_states of two halves against the whole call, head dims the decode kernels do not
serve (zero-padded copies of q and the caches, asked of the family: `PADDED_DIMS`) and layouts
they cannot read (copied; the caller's caches untouched), the device-side input check, the
operators under opcheck and torch.compile, and the message of every refused call.

Skips without torch or a CUDA device (and, like the whole GPU suite, without PyCUDA). Drawn
cases: FLASHGEN_GPU_EXAMPLES / 10 per test (default 20). Kernels missing from
$FLASHGEN_BUILD_DIR compile into the kernel cache on first use (docs/torch.md); the bf16
d = 128 property tests use up to 8 decode kernels, 4 of which specs/decode.yaml ships; the
padded-head-dim tests 4 more at the padded head dims (d = 59 and 100 at 64 and 104 when the
family serves every multiple of 8).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for the flashgen.torch tests", allow_module_level=True)

from flashgen.generator.spec import KernelKind  # noqa: E402
from flashgen.torch import (  # noqa: E402
    UnsupportedCall,
    flash_attn_with_kvcache,
    kvcache,
    merge_states,
    selection,
)
from flashgen.torch.kvcache_select import CacheInputError  # noqa: E402
from flashgen.verify import passrule, reference_decode  # noqa: E402
from flashgen.verify.numerics import round_to  # noqa: E402

from .test_decode import make_problem  # noqa: E402
from .test_torch import SOFTCAPS, _lse_floor, _np64, _sinks, _slopes, ref_forward  # noqa: E402

EXAMPLES = max(1, int(os.environ.get("FLASHGEN_GPU_EXAMPLES", "200")) // 10)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEV = "cuda"
WINDOWS = [(-1, -1), (-1, -1), (0, -1), (3, -1), (70, -1), (70, 2), (3, 0), (-1, 2)]
CAP = tuple(torch.cuda.get_device_capability())
# Head dims the decode kernels do not serve on this GPU, asked of the family (59 is not a
# multiple of 8, which the kernels' 16-byte loads need): zero-padded by flash_attn_with_kvcache.
PADDED_DIMS = [d for d in (59, 100) if selection.padded_head_dim(d, CAP, (KernelKind.DECODE,)) != d]


# -- helpers -------------------------------------------------------------------------------------


def _t(x: np.ndarray, dtype: str):
    return torch.tensor(x, dtype=DTYPES[dtype], device=DEV)


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _lens(lens):
    return torch.tensor(lens, dtype=torch.int32, device=DEV)


@st.composite
def kv_case(draw, paged: bool, windows=WINDOWS, causal=None, sqs=(1, 1, 2, 3, 7, 16)):
    page = draw(st.sampled_from([16, 32, 64, 128, 256])) if paged else None
    batch = draw(st.integers(1, 4))
    special = [0, 1, 2, 63, 64, 65]
    if page:
        special += [page, page + 1, 2 * page, 2 * page + 1]
    lens = [draw(st.one_of(st.sampled_from(special), st.integers(0, 600))) for _ in range(batch)]
    kv_heads = draw(st.integers(1, 2))
    return {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "lens": lens,
        "sq": draw(st.sampled_from(sqs)),
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4, 8])),
        "kv_heads": kv_heads,
        "page": page,
        "capacity": max(lens) + draw(st.integers(0, 40)),
        "splits": draw(st.sampled_from([0, 0, 1, 2, 3, 7])),
        "values": draw(st.sampled_from(["normal", "normal", "large"])),
        "causal": draw(st.booleans()) if causal is None else causal,
        "window": draw(st.sampled_from(windows)),
    }


def paged_copy(x: np.ndarray, case) -> tuple[np.ndarray, np.ndarray]:
    """The case's paged layout of a contiguous cache: the same random page order for k and v
    (reference_decode.to_paged with the same generator state)."""
    rng = np.random.default_rng(case["seed"] + 1)
    return reference_decode.to_paged(x, case["lens"], case["page"], rng)


def run(case, dtype: str, d: int, *, paged: bool, **kw):
    """One flash_attn_with_kvcache call of the case; returns (out, lse, q, k, v) with the
    float32 contiguous q, k, v the reference must see (before rounding)."""
    _, q, k, v = make_problem(SimpleNamespace(head_dim=d), case)
    args = dict(
        cache_seqlens=_lens(case["lens"]),
        causal=case["causal"],
        window_size=case["window"],
        num_splits=case["splits"],
        return_softmax_lse=True,
        check_inputs=True,  # valid inputs must leave the error word clear
        **kw,
    )
    if paged:
        kp, table = paged_copy(k, case)
        vp, table_v = paged_copy(v, case)
        assert np.array_equal(table, table_v)
        out, lse = flash_attn_with_kvcache(
            _t(q, dtype), _t(kp, dtype), _t(vp, dtype), block_table=_lens(table), **args
        )
    else:
        out, lse = flash_attn_with_kvcache(_t(q, dtype), _t(k, dtype), _t(v, dtype), **args)
    return out, lse, q, k, v


def reference(dtype: str, case, q, k, v, scale=None):
    """float64 reference and same-precision baseline, from flash-attn's mask definition
    (bottom-right causal, intersected with the window; the reference's own rules)."""
    qi, ki, vi = round_to(q, dtype), round_to(k, dtype), round_to(v, dtype)
    kw = dict(
        causal="bottom_right" if case["causal"] else "none", window=case["window"], scale=scale
    )
    o64, lse64 = reference_decode.decode_reference(qi, ki, vi, case["lens"], **kw)
    ob, lseb = reference_decode.decode_baseline(qi, ki, vi, case["lens"], dtype=dtype, **kw)
    return (qi, ki), (o64, lse64), (ob, lseb)


def assert_matches(dtype: str, d: int, case, out, lse, q, k, v, scale=None) -> None:
    (qi, ki), (o64, lse64), (ob, lseb) = reference(dtype, case, q, k, v, scale)
    floor = passrule.score_floor(qi, np.nan_to_num(ki), scale or 1 / np.sqrt(d))
    found = {
        "o": passrule.check(_np(out), o64, ob, dtype),
        "lse": passrule.check(_np(lse), lse64, lseb, "fp32", extra_floor=floor),
    }
    for name, verdict in found.items():
        assert verdict.passed, f"{name}: {verdict.message}; {case}"


# -- numerics against the float64 reference --------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_bf16_d128_matches_the_reference(paged):
    @SETTINGS
    @given(case=kv_case(paged))
    def prop(case):
        out, lse, q, k, v = run(case, "bf16", 128, paged=paged)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert out.shape == (len(case["lens"]), case["sq"], case["heads"], 128)
        assert lse.shape == (len(case["lens"]), case["heads"], case["sq"])
        assert_matches("bf16", 128, case, out, lse, q, k, v)

    prop()


# (dtype, head_dim, paged, causal, windows, seqlen_q): kinds of call the shipped specs serve
# (one causal query takes the unmasked kernel, hence no 1 with plain causal)
ANY_SQ, SQ_2 = (1, 1, 2, 3, 7, 16), (2, 3, 7, 16)
SHIPPED_KINDS = [
    ("fp16", 128, False, False, [(-1, -1)], ANY_SQ),
    ("fp16", 128, True, False, [(-1, -1)], ANY_SQ),
    ("fp16", 64, False, True, [(3, -1), (70, -1)], ANY_SQ),
    ("bf16", 64, True, True, [(-1, -1)], SQ_2),
    ("bf16", 64, True, True, [(0, -1), (70, -1)], ANY_SQ),
]


@pytest.mark.parametrize(("dtype", "d", "paged", "causal", "windows", "sqs"), SHIPPED_KINDS)
def test_other_dtypes_and_head_dims_match_the_reference(dtype, d, paged, causal, windows, sqs):
    @SETTINGS
    @given(case=kv_case(paged, windows=windows, causal=causal, sqs=sqs))
    def prop(case):
        out, lse, q, k, v = run(case, dtype, d, paged=paged)
        assert_matches(dtype, d, case, out, lse, q, k, v)

    prop()


def test_softmax_scale_and_the_default_return():
    case = {"seed": 3, "lens": [0, 1, 200], "sq": 2, "heads": 4, "kv_heads": 2, "page": None,
            "capacity": 210, "splits": 0, "values": "normal", "causal": True,
            "window": (-1, -1)}  # fmt: skip
    out, lse, q, k, v = run(case, "bf16", 128, paged=False, softmax_scale=0.05)
    assert_matches("bf16", 128, case, out, lse, q, k, v, scale=0.05)
    only = flash_attn_with_kvcache(
        _t(q, "bf16"), _t(k, "bf16"), _t(v, "bf16"), cache_seqlens=_lens(case["lens"])
    )
    assert isinstance(only, torch.Tensor) and only.shape == q.shape
    # empty sequences: O = 0, LSE = -inf
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -torch.inf)


def test_int_and_missing_cache_seqlens_mean_equal_lengths():
    rng = np.random.default_rng(4)
    q = _t(rng.standard_normal((3, 1, 8, 128)), "bf16")
    k, v = (_t(rng.standard_normal((3, 100, 2, 128)), "bf16") for _ in range(2))
    want = flash_attn_with_kvcache(q, k, v, cache_seqlens=_lens([77] * 3), num_splits=2)
    got = flash_attn_with_kvcache(q, k, v, cache_seqlens=77, num_splits=2)
    assert torch.equal(got, want)
    full = flash_attn_with_kvcache(q, k, v, cache_seqlens=_lens([100] * 3), num_splits=2)
    assert torch.equal(flash_attn_with_kvcache(q, k, v, num_splits=2), full)


def test_paged_and_contiguous_caches_give_bitwise_equal_outputs():
    for seed, splits, page in ((1, 1, 16), (2, 3, 64), (3, 5, 256), (4, 2, 32)):
        case = {"seed": seed, "lens": [0, 1, 300, 256, 257], "sq": 2, "heads": 8,
                "kv_heads": 2, "page": page, "capacity": 320, "splits": splits,
                "values": "normal", "causal": False, "window": (-1, -1)}  # fmt: skip
        a = run(case, "bf16", 128, paged=False)
        b = run(case, "bf16", 128, paged=True)
        assert torch.equal(a[0], b[0]), case
        assert torch.equal(a[1], b[1]), case


def test_inputs_that_require_grad_give_outputs_without_grad():
    rng = np.random.default_rng(5)
    q = _t(rng.standard_normal((2, 1, 8, 64)), "bf16").requires_grad_()
    k, v = (_t(rng.standard_normal((2, 64, 2, 64)), "bf16").requires_grad_() for _ in range(2))
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=_lens([10, 64]))
    assert not out.requires_grad
    with torch.no_grad():
        assert torch.equal(out, flash_attn_with_kvcache(q, k, v, cache_seqlens=_lens([10, 64])))


# -- head dims the decode kernels do not serve (zero-padded), layouts they cannot read ----------


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d", PADDED_DIMS)
def test_unserved_head_dims_are_padded_and_match_the_reference(paged, d):
    """q and the caches read through copies zero-padded to the next head dim the decode
    kernels serve; O (sliced back to d) and LSE against the float64 reference at d."""

    @SETTINGS
    @given(case=kv_case(paged, windows=[(-1, -1)], causal=False))
    def prop(case):
        out, lse, q, k, v = run(case, "bf16", d, paged=paged)
        assert out.shape == (len(case["lens"]), case["sq"], case["heads"], d)
        assert out.is_contiguous() and lse.shape == (len(case["lens"]), case["heads"], case["sq"])
        assert_matches("bf16", d, case, out, lse, q, k, v)

    prop()


def test_padded_caches_are_read_not_written_and_softmax_scale_is_kept():
    d = PADDED_DIMS[0]
    case = {"seed": 40, "lens": [0, 1, 200], "sq": 3, "heads": 4, "kv_heads": 2, "page": None,
            "capacity": 210, "splits": 0, "values": "normal", "causal": False,
            "window": (-1, -1)}  # fmt: skip
    _, q, k, v = make_problem(SimpleNamespace(head_dim=d), case)
    tq, tk, tv = _t(q, "bf16"), _t(np.nan_to_num(k), "bf16"), _t(np.nan_to_num(v), "bf16")
    before = (tk.clone(), tv.clone())
    out, lse = flash_attn_with_kvcache(tq, tk, tv, cache_seqlens=_lens(case["lens"]),
                                       softmax_scale=0.07, return_softmax_lse=True)  # fmt: skip
    assert torch.equal(tk, before[0]) and torch.equal(tv, before[1])
    assert_matches("bf16", d, case, out, lse, q, np.nan_to_num(k), np.nan_to_num(v), scale=0.07)
    # one tensor for both caches, an int cache_seqlens: the same call
    both = flash_attn_with_kvcache(tq, tk, tk, cache_seqlens=200)
    want = flash_attn_with_kvcache(tq, tk, tk.clone(), cache_seqlens=_lens([200] * 3))
    assert torch.equal(both, want)


def test_layouts_the_kernels_cannot_read_are_read_through_a_copy():
    """A strided head_dim (q), strides not multiples of 8 (k_cache), a cache 8 bytes off a
    16-byte boundary (v_cache): each is copied once (the caller's tensors untouched) and the
    output is, bitwise, that of the same values laid out contiguously."""
    q, k, v, lens = _base()
    want = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    wide = torch.zeros(2, 1, 8, 2 * 128, device=DEV, dtype=torch.bfloat16)
    wide[..., ::2] = q
    padded = torch.zeros(2, 64, 2, 132, device=DEV, dtype=torch.bfloat16)
    padded[..., :128] = k
    flat = torch.zeros(v.numel() + 8, device=DEV, dtype=torch.bfloat16)
    flat[4 : 4 + v.numel()] = v.flatten()
    views = {
        "q": wide[..., ::2],
        "k_cache": padded[..., :128],
        "v_cache": flat[4 : 4 + v.numel()].view(v.shape),  # 8 bytes off a 16-byte boundary
    }
    for name, view in views.items():
        args = {"q": q, "k_cache": k, "v_cache": v, name: view}
        kept = view.clone()
        got = flash_attn_with_kvcache(**args, cache_seqlens=lens)
        assert torch.equal(got, want), name
        assert torch.equal(view, kept), name


# -- score-stage features ----------------------------------------------------------------------


def score_reference(dtype: str, case, q, k, v, score, scale=None):
    """float64 reference and same-precision baseline (O, LSE) of a decode call with score
    arguments `score`: test_torch's ref_forward per sequence over its cache_seqlens keys
    (flash-attn's bottom-right mask and ALiBi distance with seqlen_k = cache_seqlens[b])."""
    tq, tk, tv = _t(q, dtype), _t(k, dtype), _t(v, dtype)  # the op's rounded inputs
    res = {"o64": [], "lse64": [], "ob": [], "lseb": []}
    slopes = score.get("alibi_slopes")
    for b, n in enumerate(case["lens"]):
        kw = dict(score, causal=case["causal"], window=case["window"], scale=scale)
        if slopes is not None and slopes.dim() == 2:
            kw["alibi_slopes"] = slopes[b : b + 1]  # a batch of one: its row
        args = (tq[b : b + 1], tk[b : b + 1, :n], tv[b : b + 1, :n])
        o64, lse64 = ref_forward(*args, **kw)
        ob, lseb = ref_forward(*args, **kw, low=DTYPES[dtype])
        for key, x in zip(res, (o64, lse64, ob, lseb)):
            res[key].append(x)
    return {key: torch.cat(x) for key, x in res.items()}


def assert_score_matches(dtype: str, d: int, case, out, lse, q, k, v, score, scale=None):
    ref = score_reference(dtype, case, q, k, v, score, scale)
    tk = torch.nan_to_num(_t(k, dtype))
    floor = _lse_floor(_t(q, dtype), tk, scale or d**-0.5, score, case["sq"], case["capacity"])
    found = {
        "o": passrule.check(_np(out), _np64(ref["o64"]), _np(ref["ob"]), dtype),
        "lse": passrule.check(_np(lse), _np64(ref["lse64"]), _np(ref["lseb"]), "fp32",
                              extra_floor=floor),
    }  # fmt: skip
    for name, verdict in found.items():
        assert verdict.passed, f"{name}: {verdict.message}; {case}; score {score}"


def _score(feature: str, case, rng, draw) -> dict:
    batch, heads = len(case["lens"]), case["heads"]
    if feature == "softcap":
        return {"softcap": draw(st.sampled_from(SOFTCAPS))}
    if feature == "alibi":
        per_batch, standard = draw(st.booleans()), draw(st.booleans())
        return {"alibi_slopes": _slopes(rng, batch, heads, per_batch, standard)}
    return {"learnable_sink": _sinks(rng, heads, grad=False)}


@pytest.mark.parametrize("feature", ["softcap", "alibi", "sink"])
def test_each_score_feature_matches_the_reference(feature):
    """Contiguous bf16 d = 128 caches, no mask (one decode kernel per feature), ragged
    cache_seqlens with 0 and 1 (with a sink: O = 0 and LSE = sink there)."""

    @SETTINGS
    @given(case=kv_case(False, windows=[(-1, -1)], causal=False), data=st.data())
    def prop(case, data):
        rng = np.random.default_rng(case["seed"] + 5)
        score = _score(feature, case, rng, data.draw)
        out, lse, q, k, v = run(case, "bf16", 128, paged=False, **score)
        assert_score_matches("bf16", 128, case, out, lse, q, k, v, score)

    prop()


@SETTINGS
@given(case=kv_case(True, windows=[(-1, -1)], causal=True, sqs=SQ_2),
       per_batch=st.booleans(), cap=st.sampled_from(SOFTCAPS))  # fmt: skip
def test_every_score_feature_over_a_paged_cache_with_causal_queries(case, per_batch, cap):
    rng = np.random.default_rng(case["seed"] + 6)
    score = {
        "softcap": cap,
        "alibi_slopes": _slopes(rng, len(case["lens"]), case["heads"], per_batch, False),
        "learnable_sink": _sinks(rng, case["heads"], grad=False),
    }
    out, lse, q, k, v = run(case, "bf16", 128, paged=True, **score)
    assert_score_matches("bf16", 128, case, out, lse, q, k, v, score)


def test_an_empty_sequence_gives_zero_output_and_the_sink_as_lse():
    case = {"seed": 7, "lens": [0, 130], "sq": 3, "heads": 8, "kv_heads": 2, "page": 64,
            "capacity": 140, "splits": 0, "values": "normal", "causal": True,
            "window": (-1, -1)}  # fmt: skip
    sink = torch.linspace(-4.0, 4.0, 8, device=DEV)
    out, lse, *_ = run(case, "bf16", 128, paged=True, learnable_sink=sink, softcap=30.0,
                       alibi_slopes=torch.full((8,), 0.25, device=DEV))  # fmt: skip
    assert torch.all(out[0] == 0)
    want = sink[:, None].expand(8, 3)
    assert torch.allclose(lse[0], want, rtol=4 * float(np.finfo(np.float32).eps), atol=0.0)


def _score_decode_args(seed: int):
    rng = np.random.default_rng(seed)
    q = _t(rng.standard_normal((2, 3, 8, 128)), "bf16")
    pages = _t(rng.standard_normal((6, 64, 2, 128)), "bf16")
    table = torch.tensor([[0, 5, 2], [4, 1, 3]], dtype=torch.int32, device=DEV)
    slopes = _slopes(rng, 2, 8, True, False)
    return q, pages, table, slopes, _sinks(rng, 8, grad=False)


def test_opcheck_decode_op_with_every_score_feature():
    q, pages, table, slopes, sink = _score_decode_args(12)
    args = (q, pages, pages, _lens([150, 3]), table, 128**-0.5, True, -1, -1, 0, 0, False,
            30.0, slopes, sink)  # fmt: skip
    torch.library.opcheck(torch.ops.flashgen.decode.default, args)


def test_under_torch_compile_with_every_score_feature():
    q, pages, table, slopes, sink = _score_decode_args(13)
    lens = _lens([150, 3])

    def step(q, pages, lens, table, slopes, sink):
        return flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table,
                                       causal=True, softcap=30.0, alibi_slopes=slopes,
                                       return_softmax_lse=True, check_inputs=False,
                                       learnable_sink=sink)  # fmt: skip

    want = step(q, pages, lens, table, slopes, sink)
    got = torch.compile(step, fullgraph=True)(q, pages, lens, table, slopes, sink)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- merge_states --------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [128] + PADDED_DIMS[:1])
@pytest.mark.parametrize("sq", [1, 5])
def test_merge_states_of_two_halves_matches_the_whole_call(sq, d):
    """Parts = the call on keys [0, cut) and [cut, n) of every sequence (no causal mask: the
    parts' keys are a partition), merged, against the whole call and the reference (at a
    head dim the kernels do not serve, calls and merge run zero-padded)."""
    rng = np.random.default_rng(6 + sq)
    b, h, hk, n, cut = 3, 8, 2, 700, 300
    lens = [700, 250, 301]
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, n, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, n, hk, d)).astype(np.float32)
    tq, tk, tv = _t(q, "bf16"), _t(k, "bf16"), _t(v, "bf16")
    first = _lens([min(x, cut) for x in lens])
    second = _lens([max(x - cut, 0) for x in lens])
    o1, l1 = flash_attn_with_kvcache(tq, tk[:, :cut], tv[:, :cut], cache_seqlens=first,
                                     return_softmax_lse=True)  # fmt: skip
    o2, l2 = flash_attn_with_kvcache(tq, tk[:, cut:].contiguous(), tv[:, cut:].contiguous(),
                                     cache_seqlens=second, return_softmax_lse=True)  # fmt: skip
    whole, whole_lse = flash_attn_with_kvcache(
        tq, tk, tv, cache_seqlens=_lens(lens), return_softmax_lse=True, num_splits=1
    )
    qi, ki, vi = round_to(q, "bf16"), round_to(k, "bf16"), round_to(v, "bf16")
    o64, lse64 = reference_decode.decode_reference(qi, ki, vi, lens)
    for parts, out_dtype in ((torch.stack([o1, o2]), None),
                             (torch.stack([o1, o2]).float(), torch.bfloat16)):  # fmt: skip
        o, lse = merge_states(parts, torch.stack([l1, l2]), out_dtype=out_dtype)
        assert o.dtype == torch.bfloat16 and o.shape == (b, sq, h, d)
        assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
        found = {
            "o": passrule.check(_np(o), o64, _np(whole), "bf16"),
            "lse": passrule.check(_np(lse), lse64, _np(whole_lse), "fp32"),
        }
        for name, verdict in found.items():
            assert verdict.passed, f"merge_states {name} ({parts.dtype}): {verdict.message}"


def test_merge_states_of_empty_parts_gives_zero_and_minus_inf():
    o = torch.randn(2, 1, 3, 4, 128, device=DEV, dtype=torch.bfloat16)
    lse = torch.full((2, 1, 4, 3), -torch.inf, device=DEV)
    out, out_lse = merge_states(o, lse)
    assert torch.all(out == 0) and torch.all(out_lse == -torch.inf)


# -- the device-side input check -------------------------------------------------------------------


def _paged_inputs(lens=(40, 70), page=16):
    rng = np.random.default_rng(9)
    q = _t(rng.standard_normal((len(lens), 1, 4, 128)), "bf16")
    pages = _t(rng.standard_normal((12, page, 1, 128)), "bf16")
    table = torch.arange(10, dtype=torch.int32, device=DEV).reshape(2, 5)
    return q, pages, table


def test_bad_page_ids_raise_with_check_inputs():
    q, pages, table = _paged_inputs()
    lens = _lens([40, 70])
    flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table,
                            check_inputs=True)  # fmt: skip
    table[1, 2] = 12  # a used page (keys 32..47 of sequence 1), past num_pages
    with pytest.raises(CacheInputError, match=r"page id outside \[0, 12\)"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table,
                                check_inputs=True)  # fmt: skip
    out = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table)
    assert torch.isfinite(out).all()  # unchecked: no sync, finite but meaningless


def test_cache_seqlens_beyond_the_capacity_raise_with_check_inputs(monkeypatch):
    q, pages, table = _paged_inputs()
    bad = _lens([40, 81])  # capacity: 5 pages of 16
    with pytest.raises(CacheInputError, match=r"capacity 80"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=bad, block_table=table,
                                check_inputs=True)  # fmt: skip
    monkeypatch.setenv(kvcache.CHECK_ENV, "1")
    with pytest.raises(CacheInputError, match=r"cache_seqlens holds an entry"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=bad, block_table=table)


# -- operators -----------------------------------------------------------------------------------


def test_opcheck_decode_op():
    rng = np.random.default_rng(10)
    q = _t(rng.standard_normal((2, 3, 8, 128)), "bf16")
    pages = _t(rng.standard_normal((6, 64, 2, 128)), "bf16")
    table = torch.tensor([[0, 5, 2], [4, 1, 3]], dtype=torch.int32, device=DEV)
    args = (q, pages, pages, _lens([150, 3]), table, 128**-0.5, True, -1, -1, 0, 0, False)
    torch.library.opcheck(torch.ops.flashgen.decode.default, args)


def test_opcheck_merge_states_op():
    o = torch.randn(3, 2, 5, 4, 128, device=DEV)
    lse = torch.randn(3, 2, 4, 5, device=DEV)
    torch.library.opcheck(torch.ops.flashgen.merge_states.default, (o, lse, "float16"))


@pytest.mark.parametrize("d", [128] + PADDED_DIMS[:1])
def test_under_torch_compile(d):
    rng = np.random.default_rng(11)
    q = _t(rng.standard_normal((2, 1, 8, d)), "bf16")
    k, v = (_t(rng.standard_normal((2, 200, 2, d)), "bf16") for _ in range(2))
    lens = _lens([200, 17])

    def step(q, k, v, lens):
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                       return_softmax_lse=True, check_inputs=False)  # fmt: skip

    want = step(q, k, v, lens)
    got = torch.compile(step, fullgraph=True)(q, k, v, lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -- refusals ------------------------------------------------------------------------------------


def _base(d=128, sq=1, dtype=torch.bfloat16, cap=64, batch=2):
    q = torch.randn(batch, sq, 8, d, device=DEV).to(dtype)
    k = torch.randn(batch, cap, 2, d, device=DEV).to(dtype)
    return q, k, k.clone(), _lens([cap] * batch)


def _refused(match, q, k_cache, v_cache, cache_seqlens=None, **kw):
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, **kw)


def test_unimplemented_arguments_are_refused():
    q, k, v, lens = _base()
    new = torch.randn(2, 1, 2, 128, device=DEV).bfloat16()
    cos = torch.randn(64, 64, device=DEV)
    _refused(r"k and v: appending new tokens .*write them into k_cache", q, k, v, lens,
             k=new, v=new)  # fmt: skip
    _refused(r"rotary_cos/rotary_sin", q, k, v, rotary_cos=cos, rotary_sin=cos,
             cache_seqlens=lens)  # fmt: skip
    _refused(r"cache_batch_idx", q, k, v, cache_seqlens=lens, cache_batch_idx=lens.long())
    _refused(r"cache_leftpad", q, k, v, cache_seqlens=lens, cache_leftpad=lens)


def test_bad_score_arguments_are_refused():
    q, k, v, lens = _base()  # batch 2, 8 query heads
    ones = torch.ones(8, device=DEV)
    _refused(r"softcap=-1.0: allowed 0.0 \(off\) or a finite c > 0", q, k, v, lens,
             softcap=-1.0)  # fmt: skip
    _refused(r"softcap=nan", q, k, v, lens, softcap=float("nan"))
    _refused(r"softcap must be a float", q, k, v, lens, softcap="30")
    _refused(r"alibi_slopes has dtype float16; it must be float32", q, k, v, lens,
             alibi_slopes=ones.half())  # fmt: skip
    _refused(r"alibi_slopes has shape \(2,\); it must be \(nheads,\) = \(8,\) or "
             r"\(batch, nheads\) = \(2, 8\)", q, k, v, lens,
             alibi_slopes=torch.ones(2, device=DEV))  # fmt: skip
    _refused(r"alibi_slopes is on device cpu but q is on cuda", q, k, v, lens,
             alibi_slopes=ones.cpu())  # fmt: skip
    _refused(r"alibi_slopes's last dimension has stride 2", q, k, v, lens,
             alibi_slopes=torch.ones(16, device=DEV)[::2])  # fmt: skip
    _refused(r"learnable_sink has shape \(2, 8\)", q, k, v, lens,
             learnable_sink=torch.ones(2, 8, device=DEV))  # fmt: skip
    _refused(r"learnable_sink has dtype float64", q, k, v, lens, learnable_sink=ones.double())
    _refused(r"learnable_sink must be a float32 tensor", q, k, v, lens, learnable_sink=[0.0])


def test_shapes_dtypes_and_devices_are_refused():
    q, k, v, lens = _base()
    _refused(r"seqlen_q 17; decode kernels take 1\.\.16", _base(sq=17)[0], k, v,
             cache_seqlens=lens)  # fmt: skip
    _refused(r"head_dim 300: allowed 1\.\.256 .*decode kernels serve", *_base(d=300))
    _refused(r"head_dim 59 differs from k_cache's 128", _base(d=59)[0], k, v, lens)
    served = selection.served_head_dims(CAP, (KernelKind.DECODE,))
    uncovered = [d for d in range(1, 257) if d > max(served)]
    if uncovered:  # no decode kernel at d nor above it (up to 256): nothing to pad to
        d = uncovered[0]
        _refused(rf"head_dim {d} has no decode kernel, nor has any head dim from {d} to 256",
                 *_base(d=d))  # fmt: skip
    _refused(r"q has dtype float32", *_base(dtype=torch.float32))
    _refused(r"v_cache has dtype float16 but q has bfloat16", q, k, v.half(), lens)
    _refused(r"q is on device 'cpu'", q.cpu(), k, v, cache_seqlens=lens)
    _refused(r"cache_seqlens is on device 'cpu'", q, k, v, cache_seqlens=lens.cpu())
    _refused(r"cache_seqlens must be an int32 tensor", q, k, v, cache_seqlens=lens.long())
    _refused(r"cache_seqlens=65 is outside 0\.\.64", q, k, v, cache_seqlens=65)
    if torch.cuda.device_count() > 1:
        _refused(r"all tensors must be on one device", q, k.to("cuda:1"), v, cache_seqlens=lens)


def test_paged_arguments_are_refused():
    q, _, _, lens = _base()
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    for page in (8, 24, 512):
        pages = torch.randn(4, page, 2, 128, device=DEV).bfloat16()
        _refused(rf"page_size {page} .*power of two in 16\.\.256", q, pages, pages,
                 cache_seqlens=lens, block_table=table)  # fmt: skip
    pages = torch.randn(4, 16, 2, 128, device=DEV).bfloat16()
    _refused(r"block_table must be an int32 tensor", q, pages, pages, cache_seqlens=lens,
             block_table=table.long())  # fmt: skip
    _refused(r"block_table's last dimension has stride 2", q, pages, pages, cache_seqlens=lens,
             block_table=torch.zeros(2, 8, dtype=torch.int32, device=DEV)[:, ::2])  # fmt: skip


def test_num_splits_outside_0_to_128_is_refused():
    q, k, v, lens = _base()
    for bad in (-1, 129):
        _refused(rf"num_splits={bad}: allowed 0 .* 1\.\.128", q, k, v, cache_seqlens=lens,
                 num_splits=bad)  # fmt: skip


def test_merge_states_refusals():
    o = torch.randn(2, 1, 3, 4, 64, device=DEV)
    lse = torch.randn(2, 1, 4, 3, device=DEV)
    with pytest.raises(UnsupportedCall, match="float32 o_parts need out_dtype"):
        merge_states(o, lse)
    with pytest.raises(UnsupportedCall, match=r"head_dim 300: allowed 1\.\.256 .*merge_states"):
        merge_states(torch.randn(2, 1, 3, 4, 300, device=DEV).half(), lse)
    with pytest.raises(UnsupportedCall, match=r"lse_parts must be float32"):
        merge_states(o.half(), lse.half())
