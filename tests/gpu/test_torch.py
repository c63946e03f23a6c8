"""`flashgen.torch` on a GPU: the PyTorch ops against the float64 reference, under
torch.compile, CUDA graphs, varlen, GQA, windows and dropout, the drop-in check against SDPA,
and the errors of calls no kernel serves.

Skips without torch or a CUDA device (and, like the whole GPU suite, without PyCUDA). The
forward is judged like the kernel suite's (`checks.verdicts`: O in the dtype, LSE in float32
with the score floor), the gradients like the backward suite's (`test_backward.bwd_verdicts`:
the reference backward fed the op's own O and LSE, with the float32 dS floors), both by the
FlashAttention pass rule of verify/passrule.py. Drawn cases: FLASHGEN_GPU_EXAMPLES / 10 per
test (default 20).

The kernels these tests use are listed in examples/torch_kernels.yaml; build them ahead with
`flashgen compile examples/torch_kernels.yaml` (into $FLASHGEN_BUILD_DIR), else the first call
of each compiles it into the kernel cache ($FLASHGEN_CACHE_DIR), about a minute per kernel.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for the flashgen.torch tests", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from flashgen.torch import (  # noqa: E402
    UnsupportedCall,
    cache,
    flash_attn_func,
    flash_attn_varlen_func,
    ops,
    selection,
)
from flashgen.verify import dropout as vdropout  # noqa: E402
from flashgen.verify import passrule, reference  # noqa: E402

from .checks import verdicts  # noqa: E402
from .test_backward import bwd_verdicts, gradient_floors  # noqa: E402

EXAMPLES = max(1, int(os.environ.get("FLASHGEN_GPU_EXAMPLES", "200")) // 10)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
LENGTHS = [1, 2, 7, 16, 17, 63, 64, 65, 127, 128, 129, 255, 257, 300]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEV = "cuda"


# -- helpers -------------------------------------------------------------------------------------


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _tensor(x: np.ndarray, dtype: str, grad: bool = False):
    return torch.tensor(x, dtype=DTYPES[dtype], device=DEV, requires_grad=grad)


def _values(rng, shape, kind: str) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return x * np.float32(3.0) if kind == "sharp" else x  # sharp: scores ~ N(0, 81)


def _spec(kind: str, dtype: str, d: int, *, causal=False, window=(-1, -1), varlen=False,
          gqa=False, dropout=False, deterministic=False):  # fmt: skip
    """The spec the op selects for such a call (what the shared checks read dtype and
    head_dim from)."""
    mask_causal, win, _ = selection.resolve_mask(causal, window)
    call = selection.AttentionCall(
        dtype=selection.DTYPES[str(DTYPES[dtype]).removeprefix("torch.")],
        head_dim=d,
        capability=torch.cuda.get_device_capability(),
        causal=mask_causal,
        window=win,
        varlen=varlen,
        gqa=gqa,
        dropout=dropout,
        deterministic=deterministic,
    )
    return (selection.forward_spec if kind == "fwd" else selection.backward_spec)(call)


def _ref_kw(causal: bool, window=(-1, -1), cu_q=None, cu_k=None) -> dict:
    """The reference's mask arguments for a flash-attn style call, written from flash-attn's
    definition (bottom-right alignment), independently of selection.resolve_mask."""
    kw: dict = {"causal": "bottom_right" if causal else "none", "window": tuple(window)}
    if cu_q is not None:
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return kw


def check_call(dtype, d, q, k, v, out, lse, dout, ref_kw, **spec_kw) -> None:
    """Forward (O, LSE) and gradients (dq, dk, dv of out against dout) of one op call, each
    by the pass rule against the float64 reference."""
    inputs = {"q": _np(q), "k": _np(k), "v": _np(v)}
    fwd_res = SimpleNamespace(inputs=inputs, o=_np(out), lse=_np(lse))
    found = verdicts(_spec("fwd", dtype, d, **spec_kw), fwd_res, **ref_kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    bwd_res = SimpleNamespace(
        inputs={**inputs, "o": _np(out), "lse": _np(lse), "dout": _np(dout)},
        dq=_np(dq),
        dk=_np(dk),
        dv=_np(dv),
    )
    found.update(bwd_verdicts(_spec("bwd", dtype, d, **spec_kw), bwd_res, ref_kw))
    for name, verdict in found.items():
        assert verdict.passed, f"{name}: {verdict.message}"


@st.composite
def dense_case(draw, gqa: bool = False):
    lens = st.sampled_from(LENGTHS)
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(2, 4)) if gqa else kv
    sq = draw(lens)
    return {
        "batch": draw(st.integers(1, 2)),
        "heads": heads,
        "kv_heads": kv,
        "sq": sq,
        "sk": sq if draw(st.booleans()) else draw(lens),
        "values": draw(st.sampled_from(["normal", "normal", "sharp"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def dense_inputs(case, dtype: str, d: int, grad: bool = True):
    rng = np.random.default_rng(case["seed"])
    b, h, hk = case["batch"], case["heads"], case["kv_heads"]
    q = _tensor(_values(rng, (b, case["sq"], h, d), case["values"]), dtype, grad)
    k = _tensor(_values(rng, (b, case["sk"], hk, d), case["values"]), dtype, grad)
    v = _tensor(_values(rng, (b, case["sk"], hk, d), "normal"), dtype, grad)
    dout = _tensor(_values(rng, (b, case["sq"], h, d), "normal"), dtype)
    return q, k, v, dout


# -- registration ------------------------------------------------------------------------------


def _op_args(q, k, v, *, causal=True, deterministic=True, cu=(None, None), max_len=(0, 0)):
    scale = q.shape[-1] ** -0.5
    return (q, k, v, cu[0], cu[1], max_len[0], max_len[1], 0.0, scale, causal, -1, -1,
            deterministic)  # fmt: skip


def test_opcheck_forward_op_with_its_autograd_formula():
    rng = np.random.default_rng(0)
    q, k, v = (_tensor(rng.standard_normal((2, 97, 4, 64)), "bf16", True) for _ in range(3))
    torch.library.opcheck(torch.ops.flashgen.fwd.default, _op_args(q, k, v))


def test_opcheck_backward_op():
    rng = np.random.default_rng(1)
    q, k, v, dout = (_tensor(rng.standard_normal((2, 97, 4, 64)), "bf16") for _ in range(4))
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(*_op_args(q, k, v))
    args = (dout, q, k, v, out, lse, seed, offset, None, None, 0, 0, 0.0, 64**-0.5, True,
            -1, -1, True)  # fmt: skip
    torch.library.opcheck(torch.ops.flashgen.bwd.default, args)


def test_opcheck_varlen_forward_op():
    rng = np.random.default_rng(2)
    lens = [5, 0, 130, 64]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=DEV)
    q, k, v = (_tensor(rng.standard_normal((sum(lens), 4, 64)), "bf16", True) for _ in range(3))
    args = _op_args(q, k, v, deterministic=False, cu=(cu, cu), max_len=(max(lens), max(lens)))
    torch.library.opcheck(torch.ops.flashgen.fwd.default, args)


# -- numerics against the float64 reference --------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_and_gradients_match_the_float64_reference(dtype, d, causal):
    @SETTINGS
    @given(case=dense_case())
    def prop(case):
        q, k, v, dout = dense_inputs(case, dtype, d)
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        check_call(dtype, d, q, k, v, out, lse, dout, _ref_kw(causal), causal=causal)

    prop()


@SETTINGS
@given(case=dense_case(gqa=True))
def test_gqa_fewer_kv_heads_match_the_reference(case):
    q, k, v, dout = dense_inputs(case, "bf16", 64)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_call("bf16", 64, q, k, v, out, lse, dout, _ref_kw(True), causal=True, gqa=True)


@SETTINGS
@given(
    case=dense_case(),
    window=st.tuples(st.sampled_from([0, 1, 5, 33, 100]), st.sampled_from([-1, 0, 3, 40])),
    causal=st.booleans(),
)
def test_sliding_window_matches_the_reference(case, window, causal):
    q, k, v, dout = dense_inputs(case, "bf16", 64)
    out, lse, _ = flash_attn_func(
        q, k, v, causal=causal, window_size=window, return_attn_probs=True
    )
    check_call("bf16", 64, q, k, v, out, lse, dout, _ref_kw(causal, window),
               causal=causal, window=window)  # fmt: skip


@SETTINGS
@given(
    lens_q=st.lists(st.one_of(st.just(0), st.sampled_from(LENGTHS)), min_size=1, max_size=4),
    lens_k=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_varlen_matches_the_reference_per_sequence(lens_q, lens_k, seed):
    lens_k = [lens_k.draw(st.one_of(st.just(q_len), st.sampled_from(LENGTHS))) for q_len in lens_q]
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q[-1], lens_k[-1] = max(lens_q[-1], 1), max(lens_k[-1], 1)
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _tensor(rng.standard_normal((cu_q[-1], 4, 64)), "bf16", True)
    k, v = (_tensor(rng.standard_normal((cu_k[-1], 4, 64)), "bf16", True) for _ in range(2))
    dout = _tensor(rng.standard_normal((cu_q[-1], 4, 64)), "bf16")
    out, lse, _ = flash_attn_varlen_func(
        q, k, v,
        torch.tensor(cu_q, device=DEV), torch.tensor(cu_k, device=DEV),
        max(lens_q), max(lens_k), causal=True, return_attn_probs=True,
    )  # fmt: skip
    assert lse.shape == (4, cu_q[-1])
    check_call("bf16", 64, q, k, v, out, lse, dout, _ref_kw(True, cu_q=cu_q, cu_k=cu_k),
               causal=True, varlen=True)  # fmt: skip


def test_packed_qkv_views_are_taken_without_a_copy():
    """q, k, v as views of one (b, s, 3, h, d) projection: strides (s*3*h*d, 3*h*d, d, 1)."""
    rng = np.random.default_rng(3)
    qkv = _tensor(rng.standard_normal((2, 129, 3, 4, 64)), "bf16", True)
    q, k, v = qkv.unbind(dim=2)
    dout = _tensor(rng.standard_normal((2, 129, 4, 64)), "bf16")
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_call("bf16", 64, q, k, v, out, lse, dout, _ref_kw(True), causal=True)


# -- dropout -------------------------------------------------------------------------------------


def test_dropout_forward_uses_the_generator_state_and_matches_the_reference():
    rng = np.random.default_rng(4)
    b, s, h, d, p = 2, 200, 3, 64, 0.3
    q, k, v = (_tensor(rng.standard_normal((b, s, h, d)), "bf16") for _ in range(3))
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.manual_seed(1234)
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(
        q, k, v, None, None, 0, 0, p, d**-0.5, False, -1, -1, False
    )
    assert (ops._u64(seed), ops._u64(offset)) == (1234, 0)
    assert gen.get_offset() == ops.PHILOX_OFFSET_STEP
    keep = vdropout.keep_mask(1234, 0, b, h, s, s, p)
    res = SimpleNamespace(inputs={"q": _np(q), "k": _np(k), "v": _np(v)}, o=_np(out), lse=_np(lse))
    found = verdicts(_spec("fwd", "bf16", d, dropout=True), res, keep_mask=keep, dropout_p=p)
    for name, verdict in found.items():
        assert verdict.passed, f"{name}: {verdict.message}"


def test_dropout_gradients_match_the_reference_with_the_forwards_keep_mask():
    rng = np.random.default_rng(5)
    b, s, h, d, p = 1, 150, 2, 64, 0.2
    q, k, v = (_tensor(rng.standard_normal((b, s, h, d)), "bf16", True) for _ in range(3))
    dout = _tensor(rng.standard_normal((b, s, h, d)), "bf16")
    torch.manual_seed(99)
    out, lse, _ = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_kw = {"keep_mask": vdropout.keep_mask(99, 0, b, h, s, s, p), "dropout_p": p}
    res = SimpleNamespace(
        inputs={"q": _np(q), "k": _np(k), "v": _np(v), "o": _np(out), "lse": _np(lse),
                "dout": _np(dout)},
        dq=_np(dq), dk=_np(dk), dv=_np(dv),
    )  # fmt: skip
    for name, verdict in bwd_verdicts(_spec("bwd", "bf16", d, dropout=True), res, ref_kw).items():
        assert verdict.passed, f"{name}: {verdict.message}"


def test_dropout_is_reproducible_under_manual_seed_and_differs_without():
    rng = np.random.default_rng(6)
    q, k, v = (_tensor(rng.standard_normal((2, 128, 4, 64)), "bf16", True) for _ in range(3))
    dout = _tensor(rng.standard_normal((2, 128, 4, 64)), "bf16")

    def step():
        out = flash_attn_func(q, k, v, dropout_p=0.25)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    torch.manual_seed(7)
    first = step()
    torch.manual_seed(7)
    again = step()
    later = step()  # the generator moved on: another mask
    for a, b_ in zip(first, again):
        assert torch.equal(a, b_)
    assert not torch.equal(first[0], later[0])


# -- torch.compile and CUDA graphs ---------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager_bitwise():
    rng = np.random.default_rng(8)
    q, k, v = (_tensor(rng.standard_normal((2, 257, 4, 64)), "bf16", True) for _ in range(3))
    dout = _tensor(rng.standard_normal((2, 257, 4, 64)), "bf16")

    def step(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return out * 2.0

    compiled = torch.compile(step, fullgraph=True)
    want = step(q, k, v)
    got = compiled(q, k, v)
    assert torch.equal(got, want)
    g_want = torch.autograd.grad(want, (q, k, v), dout)
    g_got = torch.autograd.grad(got, (q, k, v), dout)
    for a, b_ in zip(g_got, g_want):
        assert torch.equal(a, b_)


def test_cuda_graph_capture_and_replay_of_forward_and_backward():
    rng = np.random.default_rng(9)
    shape = (2, 200, 4, 64)
    q, k, v = (_tensor(rng.standard_normal(shape), "bf16", True) for _ in range(3))
    dout = _tensor(rng.standard_normal(shape), "bf16")

    def step():
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: libraries loaded, launch attributes set
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (10, 11):
        fresh = np.random.default_rng(seed)
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(_tensor(fresh.standard_normal(shape), "bf16"))
        graph.replay()
        torch.cuda.synchronize()
        for a, b_ in zip(static, step()):
            assert torch.equal(a, b_)


def test_dropout_under_cuda_graph_capture_is_refused():
    rng = np.random.default_rng(12)
    q, k, v = (_tensor(rng.standard_normal((1, 64, 2, 64)), "bf16") for _ in range(3))
    flash_attn_func(q, k, v, dropout_p=0.1)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedCall, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            flash_attn_func(q, k, v, dropout_p=0.1)


# -- the drop-in check: the same call through SDPA -------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_same_call_through_sdpa_is_within_the_pass_rule(dtype, d):
    """flashgen's O, dq, dk, dv must be within the pass rule with SDPA's as the baseline:
    error from the float64 reference at most twice SDPA's plus the floor."""

    @SETTINGS
    @given(case=dense_case(), causal=st.booleans())
    def prop(case, causal):
        if causal and case["sq"] > case["sk"]:  # SDPA would give NaN on the empty rows
            case = {**case, "sq": case["sk"]}
        q, k, v, dout = dense_inputs(case, dtype, d)
        out = flash_attn_func(q, k, v, causal=causal)
        ours = (out, *torch.autograd.grad(out, (q, k, v), dout))
        sq, sk = case["sq"], case["sk"]
        mask = None
        if causal:  # bottom-right, as flash-attn; SDPA's is_causal is top-left
            mask = torch.ones(sq, sk, dtype=torch.bool, device=DEV).tril(sk - sq)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        sdpa_out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
        theirs = (sdpa_out, *torch.autograd.grad(sdpa_out, (q, k, v), dout))
        qi, ki, vi, doi = (_np(x) for x in (q, k, v, dout))
        ref_kw = _ref_kw(causal)
        o64, lse64 = reference.attention_forward(qi, ki, vi, **ref_kw)
        grads64 = reference.attention_backward(qi, ki, vi, o64, lse64, doi, **ref_kw)
        floors = gradient_floors((qi, ki, vi, o64, lse64, doi), **ref_kw)
        names = ("o", "dq", "dk", "dv")
        for name, a, b_, r in zip(names, ours, theirs, (o64, *grads64)):
            verdict = passrule.check(_np(a), r, _np(b_), dtype, extra_floor=floors.get(name, 0.0))
            assert verdict.passed, f"{name} against SDPA: {verdict.message}"

    prop()


# -- calls no kernel serves: clear errors, no fallback -------------------------------------------


def _qkv(shape=(1, 16, 2, 64), dtype=torch.bfloat16, device=DEV, grad=False):
    return tuple(
        torch.randn(shape, dtype=dtype, device=device, requires_grad=grad) for _ in range(3)
    )


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _qkv(device="cpu"), "CUDA devices only"),
        (lambda: _qkv(dtype=torch.float32), "float16 or bfloat16"),
        (lambda: _qkv(shape=(1, 16, 2, 128))[:2] + _qkv()[2:], "same shape"),
        (lambda: (_qkv(shape=(1, 16, 3, 64))[0], *_qkv()[1:]), "must divide"),
        (lambda: tuple(t[..., ::2] for t in _qkv(shape=(1, 16, 2, 128))), "stride 1"),
        (lambda: _qkv(shape=(1, 16, 2, 144), grad=True), "head_dim 144 has no backward"),
    ],
    ids=["cpu", "fp32", "head-dims-differ", "kv-heads", "strided-head-dim", "bwd-d144"],
)
def test_unsupported_calls_raise_naming_what_is_supported(make, match):
    q, k, v = make()
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"softcap": 30.0}, "softcap"),
        ({"alibi_slopes": torch.zeros(2)}, "alibi"),
        ({"window_size": (-2, 0)}, "window_size"),
        ({"dropout_p": 1.0}, "dropout_p"),
    ],
    ids=["softcap", "alibi", "window", "dropout-1"],
)
def test_unsupported_arguments_raise(kwargs, match):
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_func(*_qkv(), **kwargs)


def test_return_attn_probs_gives_the_lse_and_no_probabilities():
    q, k, v = _qkv(shape=(2, 33, 2, 64))
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 33)
    assert probs is None


def test_rows_that_see_no_key_give_zero_output_and_minus_inf_lse():
    """Bottom-right causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows."""
    q = _qkv(shape=(1, 40, 2, 64))[0]
    k, v = _qkv(shape=(1, 10, 2, 64))[1:]
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.all(out[:, :30] == 0) and torch.all(lse[:, :, :30] == -torch.inf)
    assert torch.isfinite(lse[:, :, 30:]).all()


# -- compile on first use ------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_first_use_compiles_into_the_cache_once(tmp_path, monkeypatch, capfd):
    """A kernel in neither the build directory nor the cache is compiled once, with one line
    on stderr, and found in the cache afterwards (fp16, d = 32: used by no other test)."""
    monkeypatch.setenv("FLASHGEN_BUILD_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = _spec("fwd", "fp16", 32)
    assert cache.find_library(spec) is None
    rng = np.random.default_rng(13)
    q, k, v = (_tensor(rng.standard_normal((1, 70, 2, 32)), "fp16") for _ in range(3))
    out = flash_attn_func(q, k, v)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "flashgen: compiling" in ln]
    assert len(lines) == 1 and "done" in lines[0], lines
    assert cache.find_library(spec).parent == tmp_path / "cache"
    cache.clear()
    again = flash_attn_func(q, k, v)
    assert "compiling" not in capfd.readouterr().err
    assert torch.equal(out, again)
