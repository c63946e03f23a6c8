"""`flashgen.torch.flash_attn_with_kvcache` and `merge_states` on a GPU: against the float64
decode reference by the pass rule (contiguous and paged caches with pages in random order,
GQA, causal, windows, ragged cache_seqlens with 0 and 1, 1..16 queries, the LSE), the
score-stage features (softcap, ALiBi of either slope shape, attention sinks) against the
float64 torch reference of tests/gpu/test_torch.py, paged == contiguous bitwise for one split
count, merge_states of two halves against the whole call, head dims the decode kernels do not
serve (zero-padded copies of q and the caches, asked of the family: `PADDED_DIMS`) and layouts
they cannot read (copied; the caller's caches untouched), the device-side input check, the
operators under opcheck and torch.compile, and the message of every refused call.

The composite path (flash-attn's whole signature): appended k, v with rotary (both layouts,
rotary_dim <= d), cache_batch_idx, cache_leftpad, windows at the capacity, 1..130 queries and
a 512-query chunk over a 3000-key paged cache, against the float64 reference of the keys after
the append (caches poisoned with NaN wherever no key lies), the caches after the call against
the reference caches, paged == contiguous bitwise with an append, a decode step captured in a
CUDA graph and replayed (bitwise the eager steps), window_size as a tensor, the refusals
leaving the caches untouched; and flash_attn_varlen_func with a block_table bitwise equal to
the varlen call on the keys packed by hand, gradients included.

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
    flash_attn_varlen_func,
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


def test_cache_seqlens_beyond_the_capacity_raise_with_check_inputs(monkeypatch):
    q, pages, table = _paged_inputs()
    bad = _lens([40, 81])  # capacity: 5 pages of 16
    with pytest.raises(CacheInputError, match=r"capacity 80"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=bad, block_table=table,
                                check_inputs=True)  # fmt: skip
    monkeypatch.setenv(kvcache.CHECK_ENV, "1")
    with pytest.raises(CacheInputError, match=r"cache_seqlens holds an entry"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=bad, block_table=table)


# Without check_inputs a bad device value stops the kernel with a device-side assert, as
# flash-attn's guard does (no sync; the CUDA context is lost), so each call runs in its own
# process. The script: the inputs of _paged_inputs, then one call with `lens` and `edit`.
_TRAP_SCRIPT = """
import sys, torch
from flashgen.torch import flash_attn_with_kvcache
dev = "cuda"
q = torch.randn(2, 1, 4, 128, device=dev).bfloat16()
pages = torch.randn(12, 16, 1, 128, device=dev).bfloat16()
table = torch.arange(10, dtype=torch.int32, device=dev).reshape(2, 5)
lens = torch.tensor({lens}, dtype=torch.int32, device=dev)
{edit}
out = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table{extra})
torch.cuda.synchronize()
print("NO_ERROR", bool(torch.isfinite(out).all()))
"""


def _run_trap_script(lens, edit="", extra=""):
    import subprocess
    import sys

    script = _TRAP_SCRIPT.format(lens=list(lens), edit=edit, extra=extra)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=os.environ.copy())  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "lens, edit, allowed",
    [
        ((40, 81), "", r"cache_seqlens\[b\] <= capacity"),  # 5 pages of 16: capacity 80
        ((40, -1), "", r"cache_seqlens\[b\] <= capacity"),
        ((40, 70), "table[1, 2] = 12", r"block_table entries of used pages in \[0, num_pages\)"),
        ((40, 70), "table[0, 1] = -3", r"block_table entries of used pages in \[0, num_pages\)"),
    ],
)
def test_unchecked_bad_values_stop_the_kernel_with_a_device_side_assert(lens, edit, allowed):
    import re

    rc, output = _run_trap_script(lens, edit)
    assert rc != 0 and "NO_ERROR" not in output, output
    assert "device-side assert" in output, output
    assert re.search(allowed, output), output  # the assert's message says what is allowed


def test_values_at_the_bounds_do_not_trap():
    """The positive controls: a length at the capacity and the last page id are served; an
    unused column may hold anything (the kernels never read it); and with the check on, the
    bad value is a Python exception instead (the context survives)."""
    rc, output = _run_trap_script((80, 0), "table[0, 4] = 11; table[1, :] = 99")
    assert rc == 0 and "NO_ERROR True" in output, output
    rc, output = _run_trap_script((40, 81), "", ", check_inputs=True")
    assert rc != 0 and "CacheInputError" in output and "device-side" not in output, output


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


# -- appending, rotary, batch indices, left padding, long chunks (the composite path) ----------


def _rope64(x, cos, sin, pos, interleaved):
    """float64 rotary of x `(b, s, h, d)` at positions pos `(b, s)`, pair by pair, from
    flash-attn's apply_rotary_emb: pair i is columns (2i, 2i + 1) interleaved, else (i, i +
    r / 2); cos, sin `(rows, r / 2)`; columns past r unchanged."""
    x = np.asarray(x, dtype=np.float64)
    cos, sin = np.asarray(cos, dtype=np.float64), np.asarray(sin, dtype=np.float64)
    half = cos.shape[1]
    out = x.copy()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = cos[pos, i][..., None], sin[pos, i][..., None]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def _normalised(window, capacity):
    """flash-attn's binding: a window side >= the cache's capacity is unbounded."""
    return tuple(-1 if side >= capacity else side for side in window)


@st.composite
def append_case(draw, sqs=(1, 2, 7, 16, 17, 64, 130), paged=None):
    paged = draw(st.booleans()) if paged is None else paged
    batch = draw(st.integers(1, 4))
    kv_heads = draw(st.integers(1, 2))
    sq = draw(st.sampled_from(sqs))
    n_new = draw(st.sampled_from([0, 1, 1, 3, sq]))
    page = draw(st.sampled_from([16, 64, 256])) if paged else None
    capacity = draw(st.integers(max(n_new, 1), 700))
    if paged:
        capacity = -(-capacity // page) * page
    top = capacity - n_new
    lens = [
        draw(st.one_of(st.sampled_from([0, 1, top]), st.integers(0, top))) for _ in range(batch)
    ]
    lens = [min(x, top) for x in lens]
    leftpad = None
    rows = batch
    batch_idx = None
    if not paged and draw(st.booleans()):
        leftpad = [draw(st.integers(0, n)) for n in lens]
    if not paged and draw(st.booleans()):
        rows = batch + draw(st.integers(0, 3))
        batch_idx = draw(st.permutations(range(rows)))[:batch]
    rotary = n_new > 0 and draw(st.booleans())
    side = st.sampled_from([-1, 0, 3, 70, capacity - 1, capacity])
    return {
        "seed": draw(st.integers(0, 2**32 - 1)),
        "paged": paged,
        "page": page,
        "lens": lens,
        "sq": sq,
        "n_new": n_new,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
        "kv_heads": kv_heads,
        "capacity": capacity,
        "rows": rows,
        "leftpad": leftpad,
        "batch_idx": batch_idx,
        "rotary_dim": draw(st.sampled_from([8, 16, 32, 64])) if rotary else 0,
        "interleaved": draw(st.booleans()),
        "table_f32": draw(st.booleans()),
        "causal": draw(st.booleans()),
        "window": (draw(side), draw(side)) if draw(st.booleans()) else (-1, -1),
        "splits": draw(st.sampled_from([0, 0, 1, 3])),
    }


def run_append(case, dtype: str, d: int):
    """One composite flash_attn_with_kvcache call of the case (caches poisoned with NaN
    wherever no key of a sequence lies); returns (out, lse, reference inputs, the caches
    after the call and the reference caches after it, the appended rows' mask)."""
    rng = np.random.default_rng(case["seed"])
    batch, sq, h, hk, n = (
        len(case["lens"]),
        case["sq"],
        case["heads"],
        case["kv_heads"],
        case["n_new"],
    )
    cap, lens = case["capacity"], case["lens"]
    start = case["leftpad"] or [0] * batch
    q = round_to(rng.standard_normal((batch, sq, h, d)).astype(np.float32), dtype)
    k_new = round_to(rng.standard_normal((batch, n, hk, d)).astype(np.float32), dtype)
    v_new = round_to(rng.standard_normal((batch, n, hk, d)).astype(np.float32), dtype)
    logical_k = np.full((batch, cap, hk, d), np.nan, dtype=np.float32)
    logical_v = logical_k.copy()
    for b in range(batch):
        span = slice(start[b], lens[b])
        shape = logical_k[b, span].shape
        logical_k[b, span] = round_to(rng.standard_normal(shape).astype(np.float32), dtype)
        logical_v[b, span] = round_to(rng.standard_normal(shape).astype(np.float32), dtype)
    rot = case["rotary_dim"]
    advance = case["causal"] or any(x >= 0 for x in _normalised(case["window"], cap))
    kw = {}
    q_ref, k_rot = q, k_new
    if rot:
        rows = cap + sq
        angle = rng.uniform(0, 2 * np.pi, (rows, rot // 2))
        table = "fp32" if case["table_f32"] else dtype
        cos = (
            round_to(np.cos(angle).astype(np.float32), table)
            if table != "fp32"
            else np.cos(angle).astype(np.float32)
        )
        sin = (
            round_to(np.sin(angle).astype(np.float32), table)
            if table != "fp32"
            else np.sin(angle).astype(np.float32)
        )
        t_dtype = torch.float32 if table == "fp32" else DTYPES[dtype]
        kw["rotary_cos"] = torch.tensor(cos, dtype=t_dtype, device=DEV)
        kw["rotary_sin"] = torch.tensor(sin, dtype=t_dtype, device=DEV)
        kw["rotary_interleaved"] = case["interleaved"]
        qpos = np.array(
            [[lens[b] + (i if advance else 0) for i in range(sq)] for b in range(batch)]
        )
        kpos = np.array([[lens[b] + i for i in range(n)] for b in range(batch)]).reshape(batch, n)
        q_ref = round_to(_rope64(q, cos, sin, qpos, case["interleaved"]).astype(np.float32), dtype)
        k_rot = round_to(
            _rope64(k_new, cos, sin, kpos, case["interleaved"]).astype(np.float32), dtype
        )
    after_k, after_v = logical_k.copy(), logical_v.copy()
    for b in range(batch):
        after_k[b, lens[b] : lens[b] + n] = k_rot[b]
        after_v[b, lens[b] : lens[b] + n] = v_new[b]
    keys = [lens[b] + n - start[b] for b in range(batch)]
    k_ref = np.zeros((batch, max(keys + [1]), hk, d), dtype=np.float32)
    v_ref = np.zeros_like(k_ref)
    for b in range(batch):
        k_ref[b, : keys[b]] = after_k[b, start[b] : lens[b] + n]
        v_ref[b, : keys[b]] = after_v[b, start[b] : lens[b] + n]

    def physical(logical):
        if case["paged"]:
            page, cols = case["page"], cap // case["page"]
            pages = np.full((batch * cols + 2, page, hk, d), np.nan, dtype=np.float32)
            order = np.random.default_rng(case["seed"] + 1).permutation(batch * cols + 2)
            table = order[: batch * cols].reshape(batch, cols)
            for b in range(batch):
                for c in range(cols):
                    pages[table[b, c]] = logical[b, c * page : (c + 1) * page]
            return pages, table
        out = np.full((case["rows"], cap, hk, d), np.nan, dtype=np.float32)
        for b, r in enumerate(case["batch_idx"] or range(batch)):
            out[r] = logical[b]
        return out, None

    k_cache, table = physical(logical_k)
    v_cache, _ = physical(logical_v)
    want_k, _ = physical(after_k)
    want_v, _ = physical(after_v)
    tk, tv = _t(k_cache, dtype), _t(v_cache, dtype)
    if table is not None:
        kw["block_table"] = _lens(table)
    if case["leftpad"] is not None:
        kw["cache_leftpad"] = _lens(case["leftpad"])
    if case["batch_idx"] is not None:
        kw["cache_batch_idx"] = _lens(case["batch_idx"])
    if n:
        kw["k"], kw["v"] = _t(k_new, dtype), _t(v_new, dtype)
    out, lse = flash_attn_with_kvcache(
        _t(q, dtype), tk, tv, cache_seqlens=_lens(lens), causal=case["causal"],
        window_size=case["window"], num_splits=case["splits"], return_softmax_lse=True,
        check_inputs=True, **kw,
    )  # fmt: skip
    ref_case = dict(case, lens=keys, window=_normalised(case["window"], cap))
    appended = np.zeros(k_cache.shape, dtype=bool)  # every element of an appended row
    rows_of = case["batch_idx"] or range(batch)
    for b in range(batch):
        for i in range(n):
            p = lens[b] + i
            if case["paged"]:
                appended[table[b, p // case["page"]], p % case["page"]] = True
            else:
                appended[rows_of[b], p] = True
    return out, lse, (q_ref, k_ref, v_ref, ref_case), (tk, tv, want_k, want_v, appended)


def assert_caches(dtype, got_k, got_v, want_k, want_v, appended, rotary):
    """Every element the call did not append is bitwise what it was (NaN included); appended
    values are the reference's, k within one rounding when rotary applies."""
    for name, got, want, tol in (
        ("k_cache", got_k, want_k, rotary),
        ("v_cache", got_v, want_v, False),
    ):
        g = got.float().cpu().numpy()
        same = ~appended
        assert np.array_equal(g[same], want[same], equal_nan=True), (
            f"{name}: a row that must not change changed"
        )
        if tol:
            eps = {"fp16": 2.0**-10, "bf16": 2.0**-7}[dtype]
            err = np.abs(g[appended].astype(np.float64) - want[appended])
            assert np.all(err <= eps * np.abs(want[appended]) + 1e-7), f"{name}: appended rows"
        else:
            assert np.array_equal(g[appended], want[appended]), f"{name}: appended rows"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_append_rotary_batch_indices_left_padding_and_long_chunks_match_the_reference(dtype):
    """flash-attn's test_flash_attn_kvcache, drawn: contiguous and paged caches (pages in
    random order, NaN wherever no key lies), appended k, v, rotary of both layouts with
    rotary_dim <= d and tables in the dtype or float32, cache_batch_idx, cache_leftpad,
    causal and windows (sides at and past the capacity), 1..130 queries (the decode kernels
    up to 16, the varlen forward over a packed copy beyond); O and LSE by the pass rule
    against the float64 reference of the keys after the append, and the caches after the
    call against the reference caches."""

    @SETTINGS
    @given(case=append_case())
    def prop(case):
        out, lse, (q, k, v, ref_case), caches = run_append(case, dtype, 64)
        assert out.shape == (len(case["lens"]), case["sq"], case["heads"], 64)
        assert lse.shape == (len(case["lens"]), case["heads"], case["sq"])
        assert_matches(dtype, 64, ref_case, out, lse, q, k, v)
        assert_caches(dtype, *caches, rotary=case["rotary_dim"] > 0)

    prop()


@pytest.mark.parametrize("d", [128] + PADDED_DIMS[:1])
def test_a_decode_step_with_append_and_rotary_at_other_head_dims(d):
    """d = 128 (the serving shape) and a head dim the decode kernels do not serve (the caches
    written in place at d, read through copies padded to the next served one)."""

    @SETTINGS
    @given(case=append_case(sqs=(1, 4, 16, 20)))
    def prop(case):
        case = dict(case, rotary_dim=min(case["rotary_dim"], d // 2 * 2))
        out, lse, (q, k, v, ref_case), caches = run_append(case, "bf16", d)
        assert_matches("bf16", d, ref_case, out, lse, q, k, v)
        assert_caches("bf16", *caches, rotary=case["rotary_dim"] > 0)

    prop()


def test_chunked_prefill_over_a_long_paged_cache_matches_the_reference():
    """512 new tokens over 3000 cached ones (page 256, causal, rotary): the varlen forward
    over a packed copy of each sequence's keys, appended in place afterwards."""
    case = {"seed": 21, "paged": True, "page": 256, "lens": [3000, 1700], "sq": 512,
            "n_new": 512, "heads": 8, "kv_heads": 2, "capacity": 14 * 256, "rows": 2,
            "leftpad": None, "batch_idx": None, "rotary_dim": 64, "interleaved": False,
            "table_f32": False, "causal": True, "window": (-1, -1), "splits": 0}  # fmt: skip
    out, lse, (q, k, v, ref_case), caches = run_append(case, "bf16", 128)
    assert_matches("bf16", 128, ref_case, out, lse, q, k, v)
    assert_caches("bf16", *caches, rotary=True)


@pytest.mark.parametrize(
    "d, page, n_new",
    [(256, None, 0), (256, 64, 2), (200, None, 2), (136, 24, 0), (128, 8, 2), (64, 512, 0)],
)
def test_head_dims_and_page_sizes_no_decode_kernel_takes_run_the_varlen_route(d, page, n_new):
    """Head dims above the decode kernels' (192) and page sizes they do not take (outside the
    powers of two 16..256) are served by the varlen forward over a packed copy of the used
    keys, with and without appended tokens, against the float64 reference."""
    from flashgen.torch.kvcache_select import decode_serves

    assert not decode_serves(d, page)  # else the test would not reach the route
    cap = 336 if page is None else -(-336 // page) * page  # whole pages, above every length
    case = {"seed": 31, "paged": page is not None, "page": page, "lens": [0, 5, 300, 190],
            "sq": 3, "n_new": n_new, "heads": 8, "kv_heads": 2, "capacity": cap, "rows": 4,
            "leftpad": None, "batch_idx": None, "rotary_dim": 0, "interleaved": False,
            "table_f32": False, "causal": True, "window": (-1, -1), "splits": 0}  # fmt: skip
    out, lse, (q, k, v, ref_case), caches = run_append(case, "bf16", d)
    assert_matches("bf16", d, ref_case, out, lse, q, k, v)
    assert_caches("bf16", *caches, rotary=False)


@pytest.mark.parametrize("sq", [3, 40])
def test_append_into_paged_and_contiguous_caches_gives_bitwise_equal_results(sq):
    """The same logical cache and call, contiguous and paged (page 16 and 64): outputs and
    LSE bitwise equal for a fixed split count, and the same rows appended."""
    base = {"seed": 22, "lens": [0, 17, 100, 255], "sq": sq, "n_new": 3, "heads": 8,
            "kv_heads": 2, "capacity": 320, "rows": 4, "leftpad": None, "batch_idx": None,
            "rotary_dim": 32, "interleaved": True, "table_f32": False, "causal": True,
            "window": (-1, -1), "splits": 3}  # fmt: skip
    ref = run_append(dict(base, paged=False, page=None), "bf16", 128)
    for page in (16, 64):
        got = run_append(dict(base, paged=True, page=page), "bf16", 128)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), page


def test_a_decode_loop_captured_in_a_cuda_graph_replays_the_eager_steps():
    """A whole decode step (rotary, append into the caller's paged cache, attention,
    cache_seqlens + 1) captured once and replayed: no host sync on that path, so the replays
    give, bitwise, the outputs and caches of the same steps run eagerly."""
    rng = np.random.default_rng(23)
    batch, page, cols, heads, kv, d, steps = 3, 16, 8, 8, 2, 128, 20
    pages = _t(rng.standard_normal((batch * cols, page, kv, d)), "bf16")
    table = torch.randperm(batch * cols, device=DEV).int().reshape(batch, cols)
    angle = torch.rand(page * cols, 32, device=DEV) * 6.283
    cos, sin = torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()
    qs = _t(rng.standard_normal((steps, batch, 1, heads, d)), "bf16")
    ks = _t(rng.standard_normal((steps, batch, 1, kv, d)), "bf16")
    vs = _t(rng.standard_normal((steps, batch, 1, kv, d)), "bf16")

    def step(q, k, v, kc, vc, lens):
        out = flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=lens, block_table=table, causal=True,
                                      num_splits=2, check_inputs=False)  # fmt: skip
        lens.add_(1)
        return out

    eager_k, eager_v = pages.clone(), pages.clone()
    eager_lens = _lens([0, 5, 60])
    eager = [step(qs[i], ks[i], vs[i], eager_k, eager_v, eager_lens).clone() for i in range(steps)]
    kc, vc = pages.clone(), pages.clone()
    lens = _lens([0, 5, 60])
    sq_, sk_, sv_ = qs[0].clone(), ks[0].clone(), vs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels loaded, caches allocated
        warm_k, warm_v, warm_lens = pages.clone(), pages.clone(), _lens([0, 5, 60])
        step(sq_, sk_, sv_, warm_k, warm_v, warm_lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(sq_, sk_, sv_, kc, vc, lens)
    got = []
    for i in range(steps):
        sq_.copy_(qs[i])
        sk_.copy_(ks[i])
        sv_.copy_(vs[i])
        graph.replay()
        got.append(static_out.clone())
    torch.cuda.synchronize()
    for i in range(steps):
        assert torch.equal(got[i], eager[i]), f"step {i}"
    assert torch.equal(kc, eager_k) and torch.equal(vc, eager_v)
    assert torch.equal(lens, eager_lens)


def test_window_size_as_a_cuda_tensor_is_the_tuple():
    q, k, v, lens = _base(sq=4)
    want = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, window_size=(7, 0))
    for w in ([7, 0], torch.tensor([7, 0], device=DEV), torch.tensor([7, 0])):
        assert torch.equal(
            flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, window_size=w), want
        )


def _paged_varlen(seed, page, batch=3, heads=8, kv=2, d=128):
    """A paged varlen call (pages in random order, sequences of 0 keys allowed) and its keys
    packed by hand: (q, k_pages, v_pages, table, cu_q, cu_k, max_q, max_k, rows), `rows`
    the flat page rows of the packed keys in order."""
    rng = np.random.default_rng(seed)
    sk = rng.integers(0, 5 * page, batch)
    sq = rng.integers(1, 300, batch)
    cols = 5
    order = rng.permutation(batch * cols + 3)[: batch * cols].reshape(batch, cols)
    table = _lens(order)
    k_pages = _t(rng.standard_normal((batch * cols + 3, page, kv, d)), "bf16")
    v_pages = _t(rng.standard_normal((batch * cols + 3, page, kv, d)), "bf16")
    q = _t(rng.standard_normal((int(sq.sum()), heads, d)), "bf16")
    cu_q = _lens(np.concatenate([[0], np.cumsum(sq)]))
    cu_k = _lens(np.concatenate([[0], np.cumsum(sk)]))
    flat = [int(order[b, j // page]) * page + j % page for b in range(batch) for j in range(sk[b])]
    rows = torch.tensor(flat, dtype=torch.int64, device=DEV)
    return q, k_pages, v_pages, table, cu_q, cu_k, int(sq.max()), int(sk.max()), rows


@pytest.mark.parametrize("page", [16, 256, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_varlen_equals_the_packed_call_bitwise(page, causal):
    """flash_attn_varlen_func(block_table=...) (vLLM's paged prefill) gives, bitwise, the
    varlen call on the same keys packed by hand; gradients of q equal too, and the pages'
    gradients are the packed call's scattered back to the rows that were read."""
    q, kp, vp, table, cu_q, cu_k, mq, mk, rows = _paged_varlen(24 + page, page)
    k, v = kp.flatten(0, 1)[rows], vp.flatten(0, 1)[rows]
    args = (cu_q, cu_k, mq, mk)
    want = flash_attn_varlen_func(q, k, v, *args, causal=causal, return_attn_probs=True)
    got = flash_attn_varlen_func(q, kp, vp, *args, causal=causal, return_attn_probs=True,
                                 block_table=table)  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    qg = q.clone().requires_grad_()
    kg, vg = kp.clone().requires_grad_(), vp.clone().requires_grad_()
    out = flash_attn_varlen_func(qg, kg, vg, *args, causal=causal, deterministic=True,
                                 block_table=table)  # fmt: skip
    dout = torch.randn_like(out)
    out.backward(dout)
    qw = q.clone().requires_grad_()
    kw, vw = k.clone().requires_grad_(), v.clone().requires_grad_()
    flash_attn_varlen_func(qw, kw, vw, *args, causal=causal, deterministic=True).backward(dout)
    assert torch.equal(qg.grad, qw.grad)
    for got_grad, packed_grad, pages in ((kg.grad, kw.grad, kp), (vg.grad, vw.grad, vp)):
        want_grad = torch.zeros_like(pages).flatten(0, 1).index_add_(0, rows, packed_grad)
        torch.testing.assert_close(got_grad, want_grad.view_as(pages), rtol=0, atol=0)


def test_paged_varlen_refuses_bad_page_ids():
    q, kp, vp, table, cu_q, cu_k, mq, mk, _ = _paged_varlen(25, 16)
    lens = cu_k[1:] - cu_k[:-1]
    b = int(lens.argmax())
    assert int(lens[b]) > 0
    table[b, 0] = kp.shape[0]  # a used page, past num_pages
    with pytest.raises(UnsupportedCall, match=rf"block_table row {b} holds page id"):
        flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, mq, mk, block_table=table)


# -- refusals ------------------------------------------------------------------------------------


def _base(d=128, sq=1, dtype=torch.bfloat16, cap=64, batch=2):
    q = torch.randn(batch, sq, 8, d, device=DEV).to(dtype)
    k = torch.randn(batch, cap, 2, d, device=DEV).to(dtype)
    return q, k, k.clone(), _lens([cap] * batch)


def _refused(match, q, k_cache, v_cache, cache_seqlens=None, **kw):
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, **kw)


def test_composite_refusals_write_nothing():
    """Refusals of calls that append, rotate, index or left-pad: before anything is written
    (host checks, and with check_inputs the device values), the caches bitwise as they were."""
    q, k, v, lens = _base()
    new = torch.randn(2, 1, 2, 128, device=DEV).bfloat16()
    cos = torch.randn(64, 32, device=DEV).bfloat16()
    before = k.clone(), v.clone()
    bad_lens = _lens([10, 64])  # 64 + 1 appended > the capacity 64
    for match, kw in [
        (r"k without v", dict(k=new)),
        (r"k has shape \(2, 1, 8, 128\); it must be", dict(k=q, v=q)),
        (r"rotary_cos/rotary_sin need k and v", dict(rotary_cos=cos, rotary_sin=cos)),
        (r"rotary_cos has 63 rows; it needs at least the cache's capacity 64",
         dict(k=new, v=new, rotary_cos=cos[:63], rotary_sin=cos[:63])),
        (r"rotary_cos has dtype float16; allowed: q's bfloat16",
         dict(k=new, v=new, rotary_cos=cos.half(), rotary_sin=cos.half())),
        (r"cache_batch_idx must be an int32 tensor", dict(cache_batch_idx=lens.long())),
        (r"cache_leftpad is on device 'cpu'", dict(cache_leftpad=lens.cpu())),
        (r"cache_seqlens\[1\] = 64 is outside 0\.\.63",
         dict(k=new, v=new, cache_seqlens=bad_lens, check_inputs=True)),
        (r"cache_leftpad\[0\] = 11 is outside 0\.\.cache_seqlens\[0\]",
         dict(k=new, v=new, cache_seqlens=_lens([10, 5]), cache_leftpad=_lens([11, 0]),
              check_inputs=True)),
        (r"cache_batch_idx\[1\] = 2 is outside 0\.\.1",
         dict(k=new, v=new, cache_seqlens=_lens([10, 5]), cache_batch_idx=_lens([0, 2]),
              check_inputs=True)),
    ]:  # fmt: skip
        kw.setdefault("cache_seqlens", lens - 1)
        _refused(match, q, k, v, **kw)
        assert torch.equal(k, before[0]) and torch.equal(v, before[1]), match
    # more than 16 queries always check the values (the packed copy needs a sync anyway)
    _refused(r"cache_seqlens\[1\] = 64 is outside 0\.\.63", _base(sq=40)[0], k, v,
             k=new, v=new, cache_seqlens=bad_lens)  # fmt: skip
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


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
    _refused(r"head_dim 300: allowed 1\.\.256 .*decode kernels serve", *_base(d=300))
    _refused(r"head_dim 59 differs from k_cache's 128", _base(d=59)[0], k, v, lens)
    # head dims above the decode kernels' (up to 256) run the varlen route: see
    # test_head_dims_and_page_sizes_no_decode_kernel_takes_run_the_varlen_route
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
    # page sizes the decode kernels do not take (8, 24, 512) run the varlen route: see
    # test_head_dims_and_page_sizes_no_decode_kernel_takes_run_the_varlen_route
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


# -- FP8 (e4m3) caches: FA3's k_descale / v_descale, vLLM's per-tensor scales ----------------------

FP8_KINDS = [  # (dtype, head_dim, paged): specs/decode_fp8.yaml's serving kernels
    ("bf16", 128, False),
    ("bf16", 128, True),
    ("fp16", 128, False),
    ("fp16", 128, True),
    ("bf16", 64, False),
    ("fp16", 64, True),
]


def _fp8_cache(x: np.ndarray):
    """x (already divided by its descale) as a float8_e4m3fn CUDA tensor, and the e4m3
    values it holds (float64, NaN kept)."""
    t = torch.tensor(x, dtype=torch.float32, device=DEV).to(torch.float8_e4m3fn)
    return t, t.to(torch.float64).cpu().numpy()


def _descales(kind: str, rng, batch: int, kv_heads: int):
    if kind == "float":
        return float(rng.uniform(0.05, 3.0)), float(rng.uniform(0.05, 3.0))
    if kind == "scalar_tensor":
        return tuple(
            torch.tensor([rng.uniform(0.05, 3.0)], dtype=torch.float32, device=DEV) for _ in "kv"
        )
    return tuple(
        torch.tensor(rng.uniform(0.05, 3.0, (batch, kv_heads)), dtype=torch.float32, device=DEV)
        for _ in "kv"
    )


def _as_array(ds, batch, kv_heads) -> np.ndarray:
    if isinstance(ds, float):
        return np.full((batch, kv_heads), ds, np.float32)
    host = ds.cpu().numpy().astype(np.float32)
    if host.size == 1:
        return np.full((batch, kv_heads), host.reshape(()), np.float32)
    return host.reshape(batch, kv_heads)


@pytest.mark.parametrize(("dtype", "d", "paged"), FP8_KINDS)
def test_fp8_caches_match_the_reference_on_the_dequantised_cache(dtype, d, paged):
    """flash_attn_with_kvcache over float8_e4m3fn caches with descales of every accepted
    form, against the float64 reference of descale * e4m3 value by FA3's FP8 rule."""

    @SETTINGS
    @given(
        # the shipped FP8 kinds: one query without a mask, or (bf16, d 128, paged) causal
        # queries with a window
        case=kv_case(paged, windows=[(70, -1), (3, 0), (0, -1)], causal=True)
        if (dtype, d, paged) == ("bf16", 128, True)
        else kv_case(paged, windows=[(-1, -1)], causal=False, sqs=(1,)),
        kind=st.sampled_from(["per_head", "float", "scalar_tensor"]),
    )
    def prop(case, kind):
        rng, q, k, v = make_problem(SimpleNamespace(head_dim=d), case)
        b, kvh = len(case["lens"]), case["kv_heads"]
        kd, vd = _descales(kind, rng, b, kvh)
        kd_a, vd_a = _as_array(kd, b, kvh), _as_array(vd, b, kvh)
        k_s = k / kd_a[:, None, :, None]
        v_s = v / vd_a[:, None, :, None]
        args = dict(
            cache_seqlens=_lens(case["lens"]), causal=case["causal"],
            window_size=case["window"], num_splits=case["splits"], return_softmax_lse=True,
            check_inputs=True, k_descale=kd, v_descale=vd,
        )  # fmt: skip
        if paged:
            kp, table = paged_copy(k_s, case)
            vp, _ = paged_copy(v_s, case)
            (kt, _), (vt, _) = _fp8_cache(kp), _fp8_cache(vp)
            out, lse = flash_attn_with_kvcache(
                _t(q, dtype), kt, vt, block_table=_lens(table), **args
            )
        else:
            (kt, _), (vt, _) = _fp8_cache(k_s), _fp8_cache(v_s)
            out, lse = flash_attn_with_kvcache(_t(q, dtype), kt, vt, **args)
        assert out.dtype == DTYPES[dtype] and lse.dtype == torch.float32
        k8, v8 = _fp8_cache(k_s)[1], _fp8_cache(v_s)[1]
        qi = round_to(q, dtype)
        kw = dict(
            causal="bottom_right" if case["causal"] else "none", window=case["window"],
            k_descale=kd_a, v_descale=vd_a,
        )  # fmt: skip
        o64, lse64 = reference_decode.decode_reference(qi, k8, v8, case["lens"], **kw)
        ob, lseb = reference_decode.decode_baseline(qi, k8, v8, case["lens"], dtype=dtype, **kw)
        deq = reference_decode.dequantize(np.nan_to_num(k8), kd_a)
        floor = passrule.score_floor(qi, deq, 1 / np.sqrt(d))
        found = {
            "o": passrule.check_fp8_cache(_np(out), o64, ob, dtype),
            "lse": passrule.check_fp8_cache(_np(lse), lse64, lseb, "fp32", extra_floor=floor),
        }
        for name, verdict in found.items():
            assert verdict.passed, f"{name}: {verdict.message}; {case} {kind}"

    prop()


def test_fp8_refusals_name_what_is_wrong_and_what_is_allowed():
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.bfloat16)
    k8 = torch.randn(2, 64, 2, 128, device=DEV).to(torch.float8_e4m3fn)
    lens = _lens([10, 64])
    ok = torch.ones(2, 2, device=DEV)
    cases = [
        (dict(k_cache=k8, v_cache=k8), "needs k_descale"),
        (dict(k_cache=k8, v_cache=k8, k_descale=ok, v_descale=ok.half()), "dtype float16"),
        (dict(k_cache=k8, v_cache=k8, k_descale=ok, v_descale=ok[:1]), r"shape \(1, 2\)"),
        (dict(k_cache=k8, v_cache=k8.bfloat16(), k_descale=ok, v_descale=ok), "mixed"),
        (dict(k_cache=k8.bfloat16(), v_cache=k8.bfloat16(), k_descale=ok, v_descale=ok),
         "are for FP8 caches"),
    ]  # fmt: skip
    for kw, message in cases:
        with pytest.raises(UnsupportedCall, match=message):
            flash_attn_with_kvcache(q, cache_seqlens=lens, **kw)
    new = torch.randn(2, 1, 2, 128, device=DEV, dtype=torch.float16)
    before = k8.clone()
    with pytest.raises(UnsupportedCall, match="k has dtype float16"):
        flash_attn_with_kvcache(
            q, k8, k8, k=new, v=new, cache_seqlens=lens, k_descale=ok, v_descale=ok
        )
    with pytest.raises(UnsupportedCall, match=r"v_descale has shape \(1, 2\)"):
        cos = torch.ones(64, 64, device=DEV, dtype=torch.bfloat16)
        flash_attn_with_kvcache(  # the composite path (rotary) checks the descales first
            q, k8, k8, k=new.bfloat16(), v=new.bfloat16(), rotary_cos=cos, rotary_sin=cos,
            cache_seqlens=lens, k_descale=ok, v_descale=ok[:1],
        )  # fmt: skip
    assert torch.equal(k8.view(torch.uint8), before.view(torch.uint8))  # refused: untouched
    with pytest.raises(UnsupportedCall, match="FP8 caches take q in float16 or bfloat16"):
        flash_attn_with_kvcache(
            q.to(torch.float8_e4m3fn), k8, k8, cache_seqlens=lens, k_descale=ok, v_descale=ok
        )


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_appending_into_fp8_caches_quantises_with_the_descales(paged):
    """k, v appended at cache_seqlens[b] + i are stored as the e4m3 codes of x / descale
    (clamped to +-448; the torch cast rounds to nearest-even), other rows untouched, and the
    call attends over the new lengths like the reference of the dequantised caches."""
    rng = np.random.default_rng(12)
    b, hk, h, d, cap, n = 3, 2, 8, 128, 256, 2
    lens0 = [0, 100, 200]
    kd = torch.tensor(rng.uniform(0.01, 0.05, (b, hk)), dtype=torch.float32, device=DEV)
    vd = torch.tensor(rng.uniform(0.01, 0.05, (b, hk)), dtype=torch.float32, device=DEV)
    k_all = torch.tensor(rng.standard_normal((b, cap, hk, d)), dtype=torch.float32, device=DEV)
    v_all = torch.tensor(rng.standard_normal((b, cap, hk, d)), dtype=torch.float32, device=DEV)
    k_new = torch.tensor(rng.standard_normal((b, n, hk, d)) * 20, device=DEV).bfloat16()
    v_new = torch.tensor(rng.standard_normal((b, n, hk, d)), device=DEV).bfloat16()
    k8 = (k_all / kd[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (v_all / vd[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_k, want_v = k8.clone(), v8.clone()
    for i, n0 in enumerate(lens0):
        want_k[i, n0 : n0 + n] = (
            (k_new[i].float() / kd[i][None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        )
        want_v[i, n0 : n0 + n] = (
            (v_new[i].float() / vd[i][None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        )
    q = torch.tensor(rng.standard_normal((b, n, h, d)), device=DEV).bfloat16()
    kw = dict(k=k_new, v=v_new, cache_seqlens=_lens(lens0), causal=True, k_descale=kd,
              v_descale=vd, return_softmax_lse=True)  # fmt: skip
    if paged:
        page = 64
        perm = torch.randperm(b * cap // page, device=DEV)
        kp = torch.empty(b * cap // page, page, hk, d, device=DEV, dtype=torch.uint8)
        vp = torch.empty_like(kp)
        kp[perm] = k8.view(torch.uint8).reshape(-1, page, hk, d)
        vp[perm] = v8.view(torch.uint8).reshape(-1, page, hk, d)
        table = perm.view(b, cap // page).to(torch.int32)
        kc, vc = kp.view(torch.float8_e4m3fn), vp.view(torch.float8_e4m3fn)
        out, lse = flash_attn_with_kvcache(q, kc, vc, block_table=table, **kw)
        got_k = kc.view(torch.uint8)[perm].reshape(b, cap, hk, d)
        got_v = vc.view(torch.uint8)[perm].reshape(b, cap, hk, d)
    else:
        out, lse = flash_attn_with_kvcache(q, k8, v8, **kw)
        got_k, got_v = k8.view(torch.uint8), v8.view(torch.uint8)
    assert torch.equal(got_k, want_k.view(torch.uint8))
    assert torch.equal(got_v, want_v.view(torch.uint8))
    lens1 = [x + n for x in lens0]
    kw_ref = dict(causal="bottom_right", k_descale=kd.cpu().numpy(), v_descale=vd.cpu().numpy())
    qi = _np(q).astype(np.float64)
    k64 = want_k.to(torch.float64).cpu().numpy()
    v64 = want_v.to(torch.float64).cpu().numpy()
    o64, lse64 = reference_decode.decode_reference(qi, k64, v64, lens1, **kw_ref)
    ob, lseb = reference_decode.decode_baseline(qi, k64, v64, lens1, dtype="bf16", **kw_ref)
    deq = reference_decode.dequantize(k64, kw_ref["k_descale"])
    floor = passrule.score_floor(qi, deq, 1 / np.sqrt(d))
    assert passrule.check_fp8_cache(_np(out), o64, ob, "bf16").passed
    assert passrule.check_fp8_cache(_np(lse), lse64, lseb, "fp32", extra_floor=floor).passed


FP8_COMPOSITE = [  # (name, seqlen_q, paged, extra arguments): each route of the composite path
    ("chunked prefill, paged", 40, True, {}),
    ("left padding", 1, False, {"cache_leftpad": True}),
    ("batch indices", 3, False, {"cache_batch_idx": True}),
    ("softcap", 1, True, {"softcap": 20.0}),
    ("sinks", 2, False, {"learnable_sink": True}),
    ("alibi", 1, False, {"alibi_slopes": True}),
]


@pytest.mark.parametrize(("name", "sq", "paged", "extra"), FP8_COMPOSITE,
                         ids=[c[0] for c in FP8_COMPOSITE])  # fmt: skip
def test_fp8_caches_on_the_composite_path_equal_the_dequantised_16_bit_call(name, sq, paged,
                                                                              extra):  # fmt: skip
    """FP8 calls the FP8 decode kernel does not take as they are (docs/torch.md), with k, v
    appended: the codes written are `quantize_rows`'s, and the output is the same call's on
    bf16 caches holding `descale * code` (the new rows quantised and dequantised first). The
    varlen route of more than 16 queries reads exactly those bf16 values on both sides
    (bitwise equal); elsewhere the two calls take different kernels (close)."""
    from flashgen.torch import kvcache_fp8 as fp8

    g = torch.Generator(device="cpu").manual_seed(len(name))
    b, hk, h, d, cap, n = 3, 2, 8, 128, 256, sq
    rows = b + 1 if extra.get("cache_batch_idx") else b
    kd = (torch.rand(b, hk, generator=g) * 0.5 + 0.05).to(DEV)
    vd = (torch.rand(b, hk, generator=g) * 0.5 + 0.05).to(DEV)
    k8 = torch.randn(rows, cap, hk, d, generator=g).to(DEV).to(torch.float8_e4m3fn)
    v8 = torch.randn(rows, cap, hk, d, generator=g).to(DEV).to(torch.float8_e4m3fn)
    k_new = torch.randn(b, n, hk, d, generator=g).to(DEV).bfloat16()
    v_new = torch.randn(b, n, hk, d, generator=g).to(DEV).bfloat16()
    q = torch.randn(b, sq, h, d, generator=g).to(DEV).bfloat16()
    lens = _lens([5, 100, 180])
    kw = dict(cache_seqlens=lens, causal=True, return_softmax_lse=True)
    seq_rows = torch.arange(b, device=DEV)
    if extra.get("cache_batch_idx"):
        kw["cache_batch_idx"] = _lens([3, 0, 1])
        seq_rows = kw["cache_batch_idx"].long()
    if extra.get("cache_leftpad"):
        kw["cache_leftpad"] = _lens([0, 40, 7])
    if "softcap" in extra:
        kw["softcap"] = extra["softcap"]
    if extra.get("learnable_sink"):
        kw["learnable_sink"] = torch.randn(h, generator=g).to(DEV)
    if extra.get("alibi_slopes"):
        kw["alibi_slopes"] = (torch.rand(h, generator=g) * 0.2).to(DEV)
    # the 16-bit twin: bf16 caches holding descale * code for each sequence's row
    deq = torch.zeros(rows, cap, hk, d, device=DEV, dtype=torch.bfloat16)
    deq_v = torch.zeros_like(deq)
    deq[seq_rows] = (k8[seq_rows].float() * kd[:, None, :, None]).bfloat16()
    deq_v[seq_rows] = (v8[seq_rows].float() * vd[:, None, :, None]).bfloat16()
    k_codes, v_codes = fp8.quantize_rows(k_new, kd), fp8.quantize_rows(v_new, vd)
    k_twin = (k_codes.float() * kd[:, None, :, None]).bfloat16()
    v_twin = (v_codes.float() * vd[:, None, :, None]).bfloat16()
    if paged:
        page = 16
        perm = torch.randperm(rows * cap // page, generator=g).to(DEV)
        table = perm.view(rows, cap // page).to(torch.int32)

        def to_pages(x):
            flat = x.reshape(-1, page, hk, d)
            out = torch.empty_like(flat)
            out[perm] = flat
            return out

        as_pages = [to_pages(x.view(torch.uint8)).view(x.dtype) if x.dtype == torch.float8_e4m3fn
                    else to_pages(x) for x in (k8, v8, deq, deq_v)]  # fmt: skip
        k8, v8, deq, deq_v = as_pages
        kw["block_table"] = table
    want_k = k8.view(torch.uint8).clone()
    out16, lse16 = flash_attn_with_kvcache(q, deq, deq_v, k=k_twin, v=v_twin, **kw)
    out, lse = flash_attn_with_kvcache(q, k8, v8, k=k_new, v=v_new, k_descale=kd,
                                       v_descale=vd, **kw)  # fmt: skip
    got = k8.view(torch.uint8)
    for i in range(b):  # the appended codes, at cache_seqlens[i] + j of sequence i's row / pages
        for j in range(n):
            pos = int(lens[i]) + j
            if paged:
                at = (int(table[i, pos // page]), pos % page)
            else:
                at = (int(seq_rows[i]), pos)
            assert torch.equal(got[at], k_codes[i, j].view(torch.uint8)), (name, i, j)
            want_k[at] = got[at]
    assert torch.equal(got, want_k), "a code the call must not write changed"
    if sq > 16:  # both calls: the varlen forward over the same bf16 values
        assert torch.equal(out, out16), name
        assert torch.equal(lse, lse16), name
    else:  # the FP8 decode kernel, or the varlen forward against the 16-bit decode kernel
        torch.testing.assert_close(out, out16, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, lse16, atol=2e-3, rtol=2e-3)
