"""`flashgen.torch` on a GPU: the PyTorch ops against the float64 reference, under
torch.compile, CUDA graphs, varlen, GQA, windows and dropout, head dims the kernels do not
serve (zero-padded, asked of the families: `PADDED_DIMS`) and views whose layout they cannot
read (copied), dense and varlen, the drop-in check against SDPA,
the score-stage features (softcap, ALiBi with either slope shape, attention sinks and their
gradient; alone, together, with GQA, varlen and a sliding window, under opcheck,
torch.compile and CUDA graphs) against a float64 torch reference written from their
definitions, and the errors of calls no kernel serves.

Skips without torch or a CUDA device (and, like the whole GPU suite, without PyCUDA). The
forward is judged like the kernel suite's (`checks.verdicts`: O in the dtype, LSE in float32
with the score floor), the gradients like the backward suite's (`test_backward.bwd_verdicts`:
the reference backward fed the op's own O and LSE, with the float32 dS floors), both by the
FlashAttention pass rule of verify/passrule.py. Drawn cases: FLASHGEN_GPU_EXAMPLES / 10 per
test (default 20).

The kernels these tests use are listed in examples/torch_kernels.yaml; build them ahead with
`flashgen compile examples/torch_kernels.yaml` (into $FLASHGEN_BUILD_DIR), else the first call
of each compiles it into the kernel cache ($FLASHGEN_CACHE_DIR), about a minute per kernel.
The score-feature tests use 19 more on an H200 (bf16 d = 64, and fp16 for softcap; not listed
there, tests/gpu/test_torch_kvcache.py's feature tests 4 decode kernels): they compile on
first use. So do the padded-head-dim tests' kernels at the padded head dims (on an H200 with
families serving every multiple of 8: d = 59 and 111 run at 64 and 112, 14 kernels, 7 of them
not in specs/).
"""

from __future__ import annotations

import math
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for the flashgen.torch tests", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from flashgen.generator.spec import KernelKind  # noqa: E402
from flashgen.torch import (  # noqa: E402
    UnsupportedCall,
    cache,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
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
CAP = tuple(torch.cuda.get_device_capability())
INFERENCE = (KernelKind.FORWARD,)
TRAINING = (KernelKind.FORWARD, KernelKind.BACKWARD)


def _unserved(kinds, candidates) -> list[int]:
    """The head dims of `candidates` that the kernels of `kinds` do not serve on this GPU,
    asked of the families (so the padded tests stay padded as the families grow; 59 and
    111 are not multiples of 8, which the kernels' 16-byte loads need)."""
    return [d for d in candidates if selection.padded_head_dim(d, CAP, kinds) != d]


PADDED_DIMS = _unserved(TRAINING, (59, 111, 40, 200))


# -- helpers -------------------------------------------------------------------------------------


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _np64(t) -> np.ndarray:
    """A float64 reference as it is (`_np` would round it to float32)."""
    return t.detach().double().cpu().numpy()


def _tensor(x: np.ndarray, dtype: str, grad: bool = False):
    return torch.tensor(x, dtype=DTYPES[dtype], device=DEV, requires_grad=grad)


def _values(rng, shape, kind: str) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return x * np.float32(3.0) if kind == "sharp" else x  # sharp: scores ~ N(0, 81)


def _spec(kind: str, dtype: str, d: int, *, causal=False, window=(-1, -1), varlen=False,
          gqa=False, dropout=False, deterministic=False, d_v=None):  # fmt: skip
    """The spec the op selects for such a call (what the shared checks read dtype and
    head_dim from). For a head dim the kernels do not serve, the op ran the spec of the
    zero-padded head dim (forward and backward: these checks take gradients); the checks
    then get that spec's dtype and features with the caller's head dim (the softmax scale
    1 / sqrt(d) of the pass rule's LSE floor). `d_v`: v's head dim when it is not d (served
    as it is: no padding)."""
    padded = selection.padded_head_dim(d, CAP, TRAINING)
    mask_causal, win, _ = selection.resolve_mask(causal, window)
    call = selection.AttentionCall(
        dtype=selection.DTYPES[str(DTYPES[dtype]).removeprefix("torch.")],
        head_dim=padded,
        capability=torch.cuda.get_device_capability(),
        causal=mask_causal,
        window=win,
        varlen=varlen,
        gqa=gqa,
        dropout=dropout,
        deterministic=deterministic,
        head_dim_v=None if d_v in (None, d) else d_v,
    )
    spec = (selection.forward_spec if kind == "fwd" else selection.backward_spec)(call)
    if padded != d:
        return SimpleNamespace(dtype=spec.dtype, head_dim=d, has=spec.has)
    return spec


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


def dense_inputs(case, dtype: str, d: int, grad: bool = True, d_v: int | None = None):
    """q, k of head dim d; v and dout of d_v (default d)."""
    rng = np.random.default_rng(case["seed"])
    b, h, hk = case["batch"], case["heads"], case["kv_heads"]
    d_v = d if d_v is None else d_v
    q = _tensor(_values(rng, (b, case["sq"], h, d), case["values"]), dtype, grad)
    k = _tensor(_values(rng, (b, case["sk"], hk, d), case["values"]), dtype, grad)
    v = _tensor(_values(rng, (b, case["sk"], hk, d_v), "normal"), dtype, grad)
    dout = _tensor(_values(rng, (b, case["sq"], h, d_v), "normal"), dtype)
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


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_v_192_128_matches_the_float64_reference(dtype, causal):
    """DeepSeek-style d_qk 192, d_v 128: out and dv of 128 columns, dq and dk of 192; the
    sm_90a forward and the sm_90 backward, the kernels of specs/dv.yaml."""

    @SETTINGS
    @given(case=dense_case())
    def prop(case):
        q, k, v, dout = dense_inputs(case, dtype, 192, d_v=128)
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        assert out.shape == (*q.shape[:-1], 128)
        check_call(dtype, 192, q, k, v, out, lse, dout, _ref_kw(causal), causal=causal, d_v=128)

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


@pytest.mark.parametrize("varlen", [False, True])
def test_packed_entry_points_equal_their_unpacked_calls(varlen):
    """flash_attn_(varlen_)qkvpacked_func and _kvpacked_func (GQA) give the unpacked calls'
    output, LSE and gradients bit for bit (deterministic kernels), the gradients landing in
    the packed tensor."""
    rng = np.random.default_rng(5)
    h, hk, d = 4, 2, 64
    lead, dim = ((258,), 1) if varlen else ((2, 129), 2)  # varlen: sequences of 50 and 208
    cu = torch.tensor([0, 50, 258], dtype=torch.int32, device="cuda")
    kw = {"causal": True, "deterministic": True, "return_attn_probs": True}
    qkv = _tensor(rng.standard_normal((*lead, 3, h, d)), "bf16", True)
    q = _tensor(rng.standard_normal((*lead, h, d)), "bf16", True)
    kv = _tensor(rng.standard_normal((*lead, 2, hk, d)), "bf16", True)
    dout = _tensor(rng.standard_normal((*lead, h, d)), "bf16")

    def unpacked(*tensors):
        """The plain call on copies of `tensors`: (out, lse, gradients)."""
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        seq = (cu, cu, 208, 208) if varlen else ()
        out, lse, _ = (flash_attn_varlen_func if varlen else flash_attn_func)(*leaves, *seq, **kw)
        return out, lse, torch.autograd.grad(out, leaves, dout)

    if varlen:
        out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, 208, **kw)
    else:
        out, lse, _ = flash_attn_qkvpacked_func(qkv, **kw)
    (g_qkv,) = torch.autograd.grad(out, (qkv,), dout)
    out2, lse2, grads = unpacked(*qkv.unbind(dim))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert torch.equal(g_qkv, torch.stack(grads, dim))

    if varlen:
        out, lse, _ = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 208, 208, **kw)
    else:
        out, lse, _ = flash_attn_kvpacked_func(q, kv, **kw)
    g_q, g_kv = torch.autograd.grad(out, (q, kv), dout)
    out2, lse2, grads = unpacked(q, *kv.unbind(dim))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert torch.equal(g_q, grads[0]) and torch.equal(g_kv, torch.stack(grads[1:], dim))


# -- head dims the kernels do not serve (zero-padded), layouts they cannot read (copied) ---------


@pytest.mark.parametrize(("dtype", "causal"), [("fp16", False), ("bf16", True)])
@pytest.mark.parametrize("d", PADDED_DIMS)
def test_unserved_head_dims_are_padded_and_match_the_reference(dtype, causal, d):
    """q, k, v zero-padded to the next head dim forward and backward serve; O, LSE and the
    gradients (sliced back to d) against the float64 reference at d, scale 1 / sqrt(d)."""

    @SETTINGS
    @given(case=dense_case())
    def prop(case):
        q, k, v, dout = dense_inputs(case, dtype, d)
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        assert out.shape == q.shape and out.is_contiguous() and lse.dtype == torch.float32
        check_call(dtype, d, q, k, v, out, lse, dout, _ref_kw(causal), causal=causal)

    prop()


@SETTINGS
@given(case=dense_case(gqa=True))
def test_unserved_head_dims_with_gqa_match_the_reference(case):
    d = PADDED_DIMS[-1]
    q, k, v, dout = dense_inputs(case, "bf16", d)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_call("bf16", d, q, k, v, out, lse, dout, _ref_kw(True), causal=True, gqa=True)


def test_without_grad_the_forward_alone_sets_the_padded_head_dim():
    """An inference call pads to the next head dim the forward serves (which may be smaller
    than what training needs): O and LSE against the reference."""
    dims = _unserved(INFERENCE, range(1, 257))
    differ = [x for x in dims if selection.padded_head_dim(x, CAP, TRAINING)
              != selection.padded_head_dim(x, CAP, INFERENCE)]  # fmt: skip
    d = (differ or [PADDED_DIMS[0]])[0]
    case = {"batch": 2, "heads": 3, "kv_heads": 3, "sq": 129, "sk": 65, "values": "normal",
            "seed": d}  # fmt: skip
    q, k, v, _ = dense_inputs(case, "bf16", d, grad=False)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    res = SimpleNamespace(inputs={"q": _np(q), "k": _np(k), "v": _np(v)}, o=_np(out), lse=_np(lse))
    spec = SimpleNamespace(dtype=selection.Dtype.BF16, head_dim=d)
    for name, verdict in verdicts(spec, res, **_ref_kw(False)).items():
        assert verdict.passed, f"{name}: {verdict.message}"


@SETTINGS
@given(
    lens_q=st.lists(st.one_of(st.just(0), st.sampled_from(LENGTHS)), min_size=1, max_size=4),
    lens_k=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_varlen_with_an_unserved_head_dim_matches_the_reference(lens_q, lens_k, seed):
    d = PADDED_DIMS[0]
    lens_k = [lens_k.draw(st.one_of(st.just(q_len), st.sampled_from(LENGTHS))) for q_len in lens_q]
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q[-1], lens_k[-1] = max(lens_q[-1], 1), max(lens_k[-1], 1)
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _tensor(rng.standard_normal((cu_q[-1], 4, d)), "bf16", True)
    k, v = (_tensor(rng.standard_normal((cu_k[-1], 4, d)), "bf16", True) for _ in range(2))
    dout = _tensor(rng.standard_normal((cu_q[-1], 4, d)), "bf16")
    out, lse, _ = flash_attn_varlen_func(
        q, k, v,
        torch.tensor(cu_q, device=DEV), torch.tensor(cu_k, device=DEV),
        max(lens_q), max(lens_k), causal=True, return_attn_probs=True,
    )  # fmt: skip
    assert out.shape == q.shape and lse.shape == (4, cu_q[-1])
    check_call("bf16", d, q, k, v, out, lse, dout, _ref_kw(True, cu_q=cu_q, cu_k=cu_k),
               causal=True, varlen=True)  # fmt: skip


def _view(layout: str, shape, rng):
    """(base, view): a base tensor that requires grad and `view(base)`, of `shape` (b, s, h,
    d), in a layout the kernels cannot read as it is (copied once) or, "bhsd", one they read
    in place."""
    b, s, h, d = shape
    n = b * s * h * d
    dims, view = {
        # x[..., :d] of a buffer 4 columns wider: strides not multiples of 8
        "wide": ((b, s, h, d + 4), lambda x: x[..., :d]),
        # head_dim not contiguous: a transposed (b, s, d, h) buffer
        "transposed": ((b, s, d, h), lambda x: x.transpose(-1, -2)),
        # strides fine, the first element 6 bytes past a 16-byte boundary
        "shifted": ((n + 8,), lambda x: x[3 : 3 + n].view(shape)),
        # (b, h, s, d) storage read as (b, s, h, d): aligned strides, no copy
        "bhsd": ((b, h, s, d), lambda x: x.transpose(1, 2)),
    }[layout]
    return _tensor(rng.standard_normal(dims), "bf16", True), view


@pytest.mark.parametrize("layout", ["wide", "transposed", "shifted", "bhsd"])
def test_views_are_read_in_place_or_copied_and_gradients_reach_their_base(layout):
    """q, k, v as views (those the kernels cannot read are copied once, differentiably): O,
    LSE and the gradients against the reference, and each base's gradient is its view's
    gradient in the view's place, zero elsewhere."""
    shape = (2, 129, 4, 64)
    rng = np.random.default_rng(30)
    made = [_view(layout, shape, rng) for _ in range(3)]
    q, k, v = (view(base) for base, view in made)
    assert q.shape == shape
    dout = _tensor(rng.standard_normal(shape), "bf16")
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    bases = [base for base, _ in made]
    grads = torch.autograd.grad(out, bases + [q, k, v], dout, retain_graph=True)
    for (base, view), g_base, g_view in zip(made, grads[:3], grads[3:]):
        assert torch.equal(view(g_base), g_view)
        outside = torch.ones_like(base, dtype=torch.bool)
        view(outside).fill_(False)
        assert torch.all(g_base[outside] == 0)
    check_call("bf16", 64, q, k, v, out, lse, dout, _ref_kw(True), causal=True)


def test_an_unreadable_varlen_view_with_an_unserved_head_dim_matches_the_reference():
    d = PADDED_DIMS[0]
    lens = [7, 130, 64]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rng = np.random.default_rng(34)
    packed = _tensor(rng.standard_normal((cu[-1], 3, 4, d + 5)), "bf16", True)
    q, k, v = (x[..., :d] for x in packed.unbind(dim=1))  # (total, 4, d) of a qkv buffer
    dout = _tensor(rng.standard_normal((cu[-1], 4, d)), "bf16")
    cu_t = torch.tensor(cu, device=DEV)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_t, cu_t, max(lens), max(lens),
                                         causal=True, return_attn_probs=True)  # fmt: skip
    check_call("bf16", d, q, k, v, out, lse, dout, _ref_kw(True, cu_q=cu, cu_k=cu),
               causal=True, varlen=True)  # fmt: skip


def test_padding_and_copies_under_torch_compile_and_cuda_graphs():
    """The padded, copied call traces into a fullgraph torch.compile graph (bitwise equal to
    eager, gradients too) and replays from a CUDA graph with new values in the caller's
    (unpadded, strided) tensors."""
    d = PADDED_DIMS[0]
    rng = np.random.default_rng(35)
    base = _tensor(rng.standard_normal((2, 200, 4, d + 3)), "bf16", True)
    k, v = (_tensor(rng.standard_normal((2, 200, 4, d)), "bf16", True) for _ in range(2))
    dout = _tensor(rng.standard_normal((2, 200, 4, d)), "bf16")

    def fwd(base, k, v):
        return flash_attn_func(base[..., :d], k, v, causal=True, deterministic=True)

    want = fwd(base, k, v)
    got = torch.compile(fwd, fullgraph=True)(base, k, v)
    assert got.shape == (2, 200, 4, d) and torch.equal(got, want)
    for a, b_ in zip(torch.autograd.grad(got, (base, k, v), dout),
                     torch.autograd.grad(want, (base, k, v), dout)):  # fmt: skip
        assert torch.equal(a, b_)

    # Fresh leaves for the capture: the ones above took part in autograd graphs on the default
    # stream, and a leaf's AccumulateGrad node keeps the stream of its first graph; under
    # capture the engine would make that (legacy) stream wait on the capturing one, which
    # invalidates the capture (pytorch/pytorch#137483 and #180090; any op does this, not only
    # flashgen's). The warm-up below on a side stream is their first use.
    base, k, v = (t.detach().requires_grad_() for t in (base, k, v))

    def step():
        out = fwd(base, k, v)
        return (out, *torch.autograd.grad(out, (base, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (36, 37):
        fresh = np.random.default_rng(seed)
        with torch.no_grad():
            for t in (base, k, v, dout):
                t.copy_(_tensor(fresh.standard_normal(tuple(t.shape)), "bf16"))
        graph.replay()
        torch.cuda.synchronize()
        for a, b_ in zip(static, step()):
            assert torch.equal(a, b_)


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


@pytest.mark.parametrize("varlen", [False, True])
def test_return_attn_probs_with_dropout_is_flash_attns_s_dmask(varlen):
    """With dropout, the third result is flash-attn's S_dmask: its signs are the keep mask the
    kernel drew (verify.dropout, from the generator's seed and offset), its magnitudes
    exp(z - rowmax) (each visible row's largest is 1, and log(sum |S|) + rowmax is the LSE),
    and the output is the float64 reference's with that mask."""
    rng = np.random.default_rng(42)
    b, s, h, d, p = 2, 150, 3, 64, 0.25
    q, k, v = (_tensor(rng.standard_normal((b, s, h, d)), "bf16") for _ in range(3))
    torch.manual_seed(77)
    if varlen:
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device=DEV)
        flat = [t.reshape(b * s, h, d) for t in (q, k, v)]
        out, lse, S = flash_attn_varlen_func(*flat, cu, cu, s, s, p, causal=True,
                                             return_attn_probs=True)  # fmt: skip
        out = out.reshape(b, s, h, d)
        lse = lse.reshape(h, b, s).transpose(0, 1) if lse.dim() == 2 else lse
    else:
        out, lse, S = flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    assert S.shape == (b, h, s, s) and S.dtype == q.dtype
    keep = vdropout.keep_mask(77, 0, b, h, s, s, p)
    mag = _np64(S.abs())
    vis = mag > 0
    assert np.array_equal((_np64(S) > 0)[vis], keep[vis])
    z = np.einsum("bihd,bjhd->bhij", _np64(q), _np64(k)) * d**-0.5
    z = np.where(np.tril(np.ones((s, s), bool)), z, -np.inf)
    m = z.max(-1)
    assert np.all(mag.max(-1) == 1.0)
    assert np.allclose(np.log(mag.sum(-1)) + m, _np64(lse), atol=2e-2)
    res = SimpleNamespace(inputs={"q": _np(q), "k": _np(k), "v": _np(v)}, o=_np(out), lse=_np(lse))
    spec = _spec("fwd", "bf16", d, causal=True, dropout=True)  # equal lengths: as fixed
    for name, verdict in verdicts(spec, res, keep_mask=keep, dropout_p=p, **_ref_kw(True)).items():
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


def test_dropout_under_cuda_graph_capture_draws_a_new_mask_each_replay():
    """A captured forward + backward with dropout, replayed twice: the kernels read the Philox
    seed and offset on the device at each replay (torch's graph-safe generator state on the
    compiled binding, a device-drawn pair on the ctypes path) and the forward writes the pair
    it used. Each replay's keep mask, read back from O bit for bit (V is one-hot over the
    keys, so O[i, j] is 0 exactly where key j was dropped), is the one verify.dropout derives
    from that pair; the two replays' masks differ; O, dq, dk, dv are the float64 reference's
    with that mask (the backward replays the forward's mask)."""
    rng = np.random.default_rng(12)
    b, s, h, d, p = 1, 97, 2, 128, 0.3  # s <= d: one column of V per key
    shape = (b, s, h, d)
    onehot = np.zeros(shape)
    onehot[:, np.arange(s), :, np.arange(s)] = 1.0  # v[b, j, h, :] = e_j

    def inputs():
        # fresh leaf tensors: no autograd ran on them before the capture (pytorch#137483)
        qkv = [_tensor(rng.standard_normal(shape), "bf16", True) for _ in range(2)]
        return (*qkv, _tensor(onehot, "bf16", True), _tensor(rng.standard_normal(shape), "bf16"))

    def step(q, k, v, dout):
        out, lse, seed, offset = torch.ops.flashgen.fwd.default(
            q, k, v, None, None, 0, 0, p, d**-0.5, False, -1, -1, False
        )
        return (out, lse, seed, offset, *torch.autograd.grad(out, (q, k, v), dout))

    warm = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # libraries loaded, launch attributes set, plans made
        step(*warm)
    torch.cuda.current_stream().wait_stream(side)
    q, k, v, dout = inputs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, seed, offset, dq, dk, dv = step(q, k, v, dout)
    assert seed.device.type == "cuda" and offset.device.type == "cuda"
    masks, pairs = [], []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        pair = (ops._u64(seed), ops._u64(offset))
        keep = vdropout.keep_mask(*pair, b, h, s, s, p)
        drawn = _np(out)[..., :s].transpose(0, 2, 1, 3) != 0  # (b, h, i, j)
        assert np.array_equal(drawn, keep), f"the kernel's mask is not verify.dropout's {pair}"
        res = SimpleNamespace(inputs={"q": _np(q), "k": _np(k), "v": _np(v)}, o=_np(out),
                              lse=_np(lse))  # fmt: skip
        spec = _spec("fwd", "bf16", d, dropout=True)
        for name, verdict in verdicts(spec, res, keep_mask=keep, dropout_p=p).items():
            assert verdict.passed, f"forward {name}: {verdict.message}"
        bres = SimpleNamespace(
            inputs={"q": _np(q), "k": _np(k), "v": _np(v), "o": _np(out), "lse": _np(lse),
                    "dout": _np(dout)},
            dq=_np(dq), dk=_np(dk), dv=_np(dv),
        )  # fmt: skip
        ref_kw = {"keep_mask": keep, "dropout_p": p}
        for name, verdict in bwd_verdicts(_spec("bwd", "bf16", d, dropout=True), bres,
                                          ref_kw).items():  # fmt: skip
            assert verdict.passed, f"backward {name}: {verdict.message}"
        masks.append(keep)
        pairs.append(pair)
    assert pairs[0] != pairs[1]
    assert not np.array_equal(masks[0], masks[1])


def test_return_attn_probs_with_dropout_under_capture_is_refused():
    rng = np.random.default_rng(13)
    q, k, v = (_tensor(rng.standard_normal((1, 64, 2, 64)), "bf16") for _ in range(3))
    flash_attn_func(q, k, v, dropout_p=0.1)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedCall, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)


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
        # SDPA as the baseline defines the rule only where SDPA stays finite (seen: its fp16
        # backward overflows on 'sharp' scores, ~N(0, 81)); such draws say nothing of flashgen
        assume(all(np.isfinite(_np(b_)[np.isfinite(r)]).all() for b_, r in
                   zip(theirs, (o64, *grads64))))  # fmt: skip
        for name, a, b_, r in zip(names, ours, theirs, (o64, *grads64)):
            verdict = passrule.check(_np(a), r, _np(b_), dtype, extra_floor=floors.get(name, 0.0))
            assert verdict.passed, f"{name} against SDPA: {verdict.message}"

    prop()


# -- score-stage features: softcap, ALiBi, attention sinks ------------------------------------
#
# A torch reference written from the features' definitions (flash-attn's softcap and ALiBi,
# FlashAttention-4's learnable_sink), independent of flashgen.verify and of selection:
#
#     z_ij = scale * q_i . k_j;  softcap c > 0: z = c * tanh(z / c);
#     ALiBi: z -= slope[b, h] * |i + seqlen_k - seqlen_q - j|;  masked: z = -inf;
#     P_ij = exp(z_ij) / (exp(sink_h) + sum_j exp(z_ij)),  LSE_i = log(exp(sink_h) + sum_j ...)
#
# in float64 (the reference), and in the kernel's precision for the pass rule's baseline
# (scores in float32, the capped logit, P and dS rounded to the dtype, float32 accumulation:
# what standard attention in fp16 / bf16 gets). The backward is fed the op's own O and LSE
# (P = exp(z - LSE), D = rowsum(dO * O), dS = P (dP - D) times softcap's 1 - tanh^2,
# dsink_h = -sum_{b,i} exp(sink_h - LSE_bhi) D_bhi), as the suite's other backward checks.

TANH_REL = 2.0**-11  # the relative error bound of tanh.approx.f32 (PTX ISA), the kernels' tanh
EPS32 = float(np.finfo(np.float32).eps)


def _rnd(x, low):
    """x rounded to the torch dtype `low` (None: unchanged)."""
    return x if low is None else x.to(low).to(x.dtype)


def _visible(sq: int, sk: int, causal: bool, window) -> tuple:
    """flash-attn's mask (bottom-right aligned, causal sets right = 0) and ALiBi's |distance|
    `|i + sk - sq - j|`, both (sq, sk)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=DEV)[:, None] + (sk - sq)
    j = torch.arange(sk, device=DEV)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=DEV)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok, (i - j).abs()


def _logits(q, k, scale, softcap, slopes, ok, dist, low):
    """z `(heads, sq, sk)` (-inf where masked) and softcap's dz/ds = 1 - tanh^2 (or None) of
    one sequence: q `(sq, heads, d)`, k `(sk, heads, d)` (k already expanded to q's heads)."""
    z = torch.einsum("qhd,khd->hqk", q, k) * scale
    g = None
    if softcap > 0:
        t = _rnd(torch.tanh(z / softcap), low)  # the baseline: tanh's output in the dtype
        z, g = _rnd(softcap * t, low), 1 - t * t
    if slopes is not None:
        z = z - slopes[:, None, None] * dist.to(z.dtype)
    return z.masked_fill(~ok, -math.inf), g


def _softmax(z, sink):
    """Row softmax of z with the sink's exp(sink_h) in each denominator: (P, LSE); a row that
    sees no key gives P = 0 and LSE = sink_h (-inf without a sink)."""
    if z.shape[-1]:
        m = z.amax(-1)
    else:
        m = z.new_full(z.shape[:-1], -math.inf)
    if sink is not None:
        m = torch.maximum(m, sink[:, None])
    base = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - base[..., None])
    total = e.sum(-1)
    if sink is not None:
        total = total + torch.exp(sink[:, None] - base)
    empty = ~(total > 0)
    safe = torch.where(empty, torch.ones_like(total), total)
    return e / safe[..., None], torch.where(empty, -math.inf, base + torch.log(safe))


def _sequences(q, cu_q, cu_k):
    """(b, q index, k index) per sequence: an int (dense) or the packed rows (varlen)."""
    if cu_q is None:
        return [(b, b, b) for b in range(q.shape[0])]
    cq, ck = [int(x) for x in cu_q], [int(x) for x in cu_k]
    return [(b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]


def _lse_at(lse, b, iq, varlen: bool):
    return lse[:, iq] if varlen else lse[b]


class _Score:
    """One call's score arguments in the work dtype, per sequence."""

    def __init__(self, q, softcap, alibi_slopes, learnable_sink, scale, work):
        self.softcap = float(softcap)
        self.slopes = None if alibi_slopes is None else alibi_slopes.detach().to(work)
        self.sink = None if learnable_sink is None else learnable_sink.detach().to(work)
        self.scale = q.shape[-1] ** -0.5 if scale is None else scale

    def slopes_of(self, b: int):
        if self.slopes is None or self.slopes.dim() == 1:
            return self.slopes
        return self.slopes[b]


def _expand(x, heads: int):
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


def ref_forward(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                learnable_sink=None, scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                low=None):  # fmt: skip
    """(O, LSE) in the op's layouts: float64 (`low` None), or the baseline in the torch dtype
    `low` (O rounded to it, LSE float32)."""
    work = torch.float64 if low is None else torch.float32
    q, k, v = (x.detach().to(work) for x in (q, k, v))
    heads, varlen = q.shape[-2], cu_seqlens_q is not None
    k, v = _expand(k, heads), _expand(v, heads)
    sc = _Score(q, softcap, alibi_slopes, learnable_sink, scale, work)
    o = torch.zeros_like(q)
    lse = q.new_empty((heads, q.shape[0]) if varlen else (q.shape[0], heads, q.shape[1]))
    for b, iq, ik in _sequences(q, cu_seqlens_q, cu_seqlens_k):
        qb, kb, vb = q[iq], k[ik], v[ik]
        ok, dist = _visible(qb.shape[0], kb.shape[0], causal, window)
        z, _ = _logits(qb, kb, sc.scale, sc.softcap, sc.slopes_of(b), ok, dist, low)
        p, lse_b = _softmax(z, sc.sink)
        o[iq] = torch.einsum("hqk,khd->qhd", _rnd(p, low), vb)
        _lse_at(lse, b, iq, varlen)[...] = lse_b
    return _rnd(o, low), lse


def ref_backward(q, k, v, o, lse, dout, *, causal=False, window=(-1, -1), softcap=0.0,
                 alibi_slopes=None, learnable_sink=None, scale=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, low=None):  # fmt: skip
    """(dq, dk, dv, dsink) from the op's own `o` and `lse` (dsink None without a sink), and,
    in float64, the extra pass-rule floors of the kernels' float32 arithmetic: the standard
    bound on dS = P (dP - D) (dot products of length d, eps per operation) carried into dQ
    and dK, softcap's 1 - tanh^2 from tanh.approx (off by up to 2 * 2^-11, absolute: the
    documented bound, which matters where the scores saturate and 1 - tanh^2 is tiny), and
    the bound of dsink's float32 sums (its row terms, and each row's D)."""
    work = torch.float64 if low is None else torch.float32
    q, k, v, o, dout, lse = (x.detach().to(work) for x in (q, k, v, o, dout, lse))
    heads, kv_heads, d = q.shape[-2], k.shape[-2], q.shape[-1]
    varlen = cu_seqlens_q is not None
    k, v = _expand(k, heads), _expand(v, heads)
    sc = _Score(q, softcap, alibi_slopes, learnable_sink, scale, work)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    fq, fk = torch.zeros_like(q), torch.zeros_like(k)  # float64 floors
    dsink = None if sc.sink is None else torch.zeros_like(sc.sink)
    sink_floor = None if sc.sink is None else torch.zeros_like(sc.sink)
    rows = 0
    gamma = (d + 2) * EPS32
    for b, iq, ik in _sequences(q, cu_seqlens_q, cu_seqlens_k):
        qb, kb, vb, ob, dob = q[iq], k[ik], v[ik], o[iq], dout[iq]
        rows += qb.shape[0]
        ok, dist = _visible(qb.shape[0], kb.shape[0], causal, window)
        z, g = _logits(qb, kb, sc.scale, sc.softcap, sc.slopes_of(b), ok, dist, low)
        lse_b = _lse_at(lse, b, iq, varlen)  # (heads, sq)
        fin = torch.isfinite(lse_b)
        base = torch.where(fin, lse_b, torch.zeros_like(lse_b))
        p = torch.where(ok & fin[..., None], torch.exp(z - base[..., None]), 0.0)
        dv[ik] = torch.einsum("hqk,qhd->khd", _rnd(p, low), dob)
        dp = torch.einsum("qhd,khd->hqk", dob, vb)
        dd = (dob * ob).sum(-1).T  # (heads, sq): D = rowsum(dO * O)
        ds_z = p * (dp - dd[..., None])  # dL/dz
        ds = _rnd(ds_z if g is None else ds_z * g, low)
        dq[iq] = torch.einsum("hqk,khd->qhd", ds, kb) * sc.scale
        dk[ik] = torch.einsum("hqk,qhd->khd", ds, qb) * sc.scale
        if low is None:
            mag = torch.einsum("qhd,khd->hqk", dob.abs(), vb.abs())
            d_mag = (dob.abs() * ob.abs()).sum(-1).T
            e_ds = gamma * p * (mag + d_mag[..., None])
            if g is not None:  # 1 - tanh^2 from tanh.approx: off by up to 2 * 2^-11
                e_ds = e_ds * g + 2.0 * TANH_REL * ds_z.abs()
            fq[iq] = torch.einsum("hqk,khd->qhd", e_ds, kb.abs()) * sc.scale
            fk[ik] = torch.einsum("hqk,qhd->khd", e_ds, qb.abs()) * sc.scale
        if dsink is not None:
            w = torch.where(fin, torch.exp(sc.sink[:, None] - base), 0.0)
            dsink -= (w * dd).sum(-1)
            if low is None:
                sink_floor += (w * (dd.abs() + gamma * d_mag)).sum(-1)
    group = (*k.shape[:-2], kv_heads, heads // kv_heads, d)
    dk, dv, fk = (x.view(group).sum(-2) for x in (dk, dv, fk))
    grads = (_rnd(dq, low), _rnd(dk, low), _rnd(dv, low), dsink)
    floors = {}
    if low is None:
        floors = {"dq": float(fq.max()) if fq.numel() else 0.0,
                  "dk": float(fk.max()) if fk.numel() else 0.0, "dv": 0.0}  # fmt: skip
        if sink_floor is not None:
            floors["dsink"] = float(((rows + 8) * EPS32 * sink_floor).max())
    return grads, floors


def _lse_floor(q, k, scale, score, sq, sk) -> float:
    """The LSE's extra floor: the float32 score bound (passrule.score_floor), softcap's
    tanh.approx (2^-11 of the capped logit, |z| <= c) and ALiBi's float32 bias."""
    floor = passrule.score_floor(_np(q), _np(k), scale)
    cap = float(score.get("softcap", 0.0))
    if cap > 0:
        floor += TANH_REL * cap
    slopes = score.get("alibi_slopes")
    if slopes is not None:
        floor += 4 * EPS32 * float(slopes.abs().max()) * max(sq, sk)
    return floor


def check_score_call(dtype, q, k, v, out, lse, dout, score, *, causal=False, window=(-1, -1),
                     cu_q=None, cu_k=None, max_len=None, grads=True):  # fmt: skip
    """O and LSE, then (grads) dq, dk, dv and, when the sink requires grad, dsink of one op
    call with score arguments `score` (flash_attn_func's keywords), each by the pass rule
    against the float64 reference and the same-precision baseline."""
    kw = dict(causal=causal, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **score)
    low = DTYPES[dtype]
    o64, lse64 = ref_forward(q, k, v, **kw)
    ob, lseb = ref_forward(q, k, v, **kw, low=low)
    sq, sk = max_len if max_len is not None else (q.shape[1], k.shape[1])
    scale = q.shape[-1] ** -0.5
    found = {
        "o": passrule.check(_np(out), _np64(o64), _np(ob), dtype),
        "lse": passrule.check(_np(lse), _np64(lse64), _np(lseb), "fp32",
                              extra_floor=_lse_floor(q, k, scale, score, sq, sk)),
    }  # fmt: skip
    if grads:
        sink = score.get("learnable_sink")
        wrt = [q, k, v] + ([sink] if sink is not None and sink.requires_grad else [])
        got = torch.autograd.grad(out, wrt, dout)
        ref, floors = ref_backward(q, k, v, out, lse, dout, **kw)
        base, _ = ref_backward(q, k, v, out, lse, dout, **kw, low=low)
        for name, g, r, b_ in zip(("dq", "dk", "dv", "dsink"), got, ref, base):
            out_dtype = "fp32" if name == "dsink" else dtype
            if name == "dsink":
                assert g.dtype == torch.float32 and g.shape == sink.shape
            found[name] = passrule.check(
                _np(g), _np64(r), _np(b_), out_dtype, extra_floor=floors[name]
            )
    for name, verdict in found.items():
        assert verdict.passed, f"{name}: {verdict.message}; score {score}"


SOFTCAPS = [1.0, 5.0, 30.0]


def _slopes(rng, batch: int, heads: int, per_batch: bool, standard: bool):
    """ALiBi slopes: the standard geometric ones (2^(-8 (h + 1) / heads)) or uniform in [0, 1),
    one row for all sequences or one per sequence."""
    if standard:
        row = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
        x = np.stack([row * (1 + 0.1 * b) for b in range(batch)]) if per_batch else row
    else:
        x = rng.uniform(0.0, 1.0, (batch, heads) if per_batch else (heads,))
    return torch.tensor(x, dtype=torch.float32, device=DEV)


def _sinks(rng, heads: int, grad: bool = True):
    """One logit per head: around 0, and some far from it (a sink that takes nearly all the
    weight, one that takes none)."""
    x = rng.choice([-8.0, -2.0, 0.0, 0.0, 1.0, 4.0, 8.0], heads) + rng.normal(0.0, 0.5, heads)
    return torch.tensor(x, dtype=torch.float32, device=DEV, requires_grad=grad)


def test_the_reference_backward_is_the_autograd_of_the_reference_forward():
    """The explicit float64 backward above (fed the exact O and LSE) against torch.autograd
    through the float64 forward, every feature on, GQA, causal and not, sq != sk, varlen."""
    rng = np.random.default_rng(20)
    for causal, (sq, sk), per_batch in ((False, (37, 90), True), (True, (90, 37), False)):
        q = torch.tensor(rng.standard_normal((2, sq, 4, 32)), device=DEV, requires_grad=True)
        k, v = (torch.tensor(rng.standard_normal((2, sk, 2, 32)), device=DEV,
                             requires_grad=True) for _ in range(2))  # fmt: skip
        dout = torch.tensor(rng.standard_normal((2, sq, 4, 32)), device=DEV)
        sink = _sinks(rng, 4).double().detach().requires_grad_()
        score = {"softcap": 3.0, "alibi_slopes": _slopes(rng, 2, 4, per_batch, False),
                 "learnable_sink": sink}  # fmt: skip
        o, lse = _autograd_forward(q, k, v, sink, causal, score)
        want = torch.autograd.grad(o, (q, k, v, sink), dout)
        o64, lse64 = ref_forward(q, k, v, causal=causal, **score)
        assert torch.allclose(o, o64, rtol=1e-12, atol=1e-12)
        assert torch.allclose(lse, lse64, rtol=1e-12, atol=1e-12)
        got, _ = ref_backward(q, k, v, o64, lse64, dout, causal=causal, **score)
        for name, a, b_ in zip(("dq", "dk", "dv", "dsink"), got, want):
            assert torch.allclose(a, b_, rtol=1e-9, atol=1e-9), name


def _autograd_forward(q, k, v, sink, causal, score):
    """ref_forward's float64 arithmetic with autograd (no in-place writes of leaves)."""
    heads = q.shape[-2]
    ke, ve = _expand(k, heads), _expand(v, heads)
    slopes = score["alibi_slopes"].double()
    outs, lses = [], []
    for b in range(q.shape[0]):
        ok, dist = _visible(q.shape[1], k.shape[1], causal, (-1, -1))
        row = slopes if slopes.dim() == 1 else slopes[b]
        z, _ = _logits(q[b], ke[b], q.shape[-1] ** -0.5, score["softcap"], row, ok, dist, None)
        p, lse_b = _softmax(z, sink)
        outs.append(torch.einsum("hqk,khd->qhd", p, ve[b]))
        lses.append(lse_b)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize(("dtype", "causal"), [("fp16", True), ("bf16", False)])
def test_softcap_matches_the_reference(dtype, causal):
    @SETTINGS
    @given(case=dense_case(), cap=st.sampled_from(SOFTCAPS))
    def prop(case, cap):
        q, k, v, dout = dense_inputs(case, dtype, 64)
        score = {"softcap": cap}
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **score)
        check_score_call(dtype, q, k, v, out, lse, dout, score, causal=causal)

    prop()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_matches_the_reference(causal):
    @SETTINGS
    @given(case=dense_case(), per_batch=st.booleans(), standard=st.booleans())
    def prop(case, per_batch, standard):
        q, k, v, dout = dense_inputs(case, "bf16", 64)
        rng = np.random.default_rng(case["seed"] + 1)
        slopes = _slopes(rng, case["batch"], case["heads"], per_batch, standard)
        score = {"alibi_slopes": slopes}
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **score)
        check_score_call("bf16", q, k, v, out, lse, dout, score, causal=causal)

    prop()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("sq", "sk"), [(7, 300), (300, 7), (1, 129), (129, 1)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["heads", "batch-heads"])
def test_alibi_distance_is_flash_attns_when_the_lengths_differ(causal, sq, sk, per_batch):
    """`|i + seqlen_k - seqlen_q - j|`, with and without the causal mask, either slope shape."""
    case = {"batch": 2, "heads": 2, "kv_heads": 2, "sq": sq, "sk": sk, "values": "normal",
            "seed": sq * 1000 + sk}  # fmt: skip
    q, k, v, dout = dense_inputs(case, "bf16", 64)
    slopes = _slopes(np.random.default_rng(sq + sk), 2, 2, per_batch, standard=False)
    score = {"alibi_slopes": slopes}
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **score)
    check_score_call("bf16", q, k, v, out, lse, dout, score, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_forward_and_sink_gradient_match_the_reference(causal):
    @SETTINGS
    @given(case=dense_case())
    def prop(case):
        q, k, v, dout = dense_inputs(case, "bf16", 64)
        sink = _sinks(np.random.default_rng(case["seed"] + 2), case["heads"])
        score = {"learnable_sink": sink}
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **score)
        check_score_call("bf16", q, k, v, out, lse, dout, score, causal=causal)

    prop()


def test_rows_that_see_no_key_give_zero_output_and_the_sink_as_lse():
    """Bottom-right causal with seqlen_q > seqlen_k: the first rows see no key; with a sink
    their O is 0 and their LSE the head's sink (no key, only exp(sink) in the sum)."""
    rng = np.random.default_rng(21)
    q = _tensor(rng.standard_normal((1, 40, 2, 64)), "bf16")
    k, v = (_tensor(rng.standard_normal((1, 10, 2, 64)), "bf16") for _ in range(2))
    sink = torch.tensor([0.0, -3.5], device=DEV)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                  learnable_sink=sink)  # fmt: skip
    assert torch.all(out[:, :30] == 0)
    want = sink[None, :, None].expand(1, 2, 30)
    assert torch.allclose(lse[:, :, :30], want, rtol=4 * EPS32, atol=0.0)
    assert torch.all(lse[:, :, 30:] > sink[None, :, None])  # the keys add to the sum


@SETTINGS
@given(case=dense_case(gqa=True), per_batch=st.booleans(), cap=st.sampled_from(SOFTCAPS))
def test_every_feature_together_with_gqa_matches_the_reference(case, per_batch, cap):
    q, k, v, dout = dense_inputs(case, "bf16", 64)
    rng = np.random.default_rng(case["seed"] + 3)
    score = {
        "softcap": cap,
        "alibi_slopes": _slopes(rng, case["batch"], case["heads"], per_batch, False),
        "learnable_sink": _sinks(rng, case["heads"]),
    }
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **score)
    check_score_call("bf16", q, k, v, out, lse, dout, score, causal=True)


@SETTINGS
@given(
    lens_q=st.lists(st.one_of(st.just(0), st.sampled_from(LENGTHS)), min_size=1, max_size=4),
    lens_k=st.data(),
    seed=st.integers(0, 2**32 - 1),
    per_batch=st.booleans(),
)
def test_every_feature_varlen_matches_the_reference_per_sequence(lens_q, lens_k, seed,
                                                                 per_batch):  # fmt: skip
    lens_k = [lens_k.draw(st.one_of(st.just(q_len), st.sampled_from(LENGTHS))) for q_len in lens_q]
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q[-1], lens_k[-1] = max(lens_q[-1], 1), max(lens_k[-1], 1)
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _tensor(rng.standard_normal((cu_q[-1], 4, 64)), "bf16", True)
    k, v = (_tensor(rng.standard_normal((cu_k[-1], 4, 64)), "bf16", True) for _ in range(2))
    dout = _tensor(rng.standard_normal((cu_q[-1], 4, 64)), "bf16")
    score = {
        "softcap": 5.0,
        "alibi_slopes": _slopes(rng, len(lens_q), 4, per_batch, True),
        "learnable_sink": _sinks(rng, 4),
    }
    out, lse, _ = flash_attn_varlen_func(
        q, k, v,
        torch.tensor(cu_q, device=DEV), torch.tensor(cu_k, device=DEV),
        max(lens_q), max(lens_k), causal=True, return_attn_probs=True, **score,
    )  # fmt: skip
    assert lse.shape == (4, cu_q[-1])
    check_score_call("bf16", q, k, v, out, lse, dout, score, causal=True, cu_q=cu_q, cu_k=cu_k,
                     max_len=(max(lens_q), max(lens_k)))  # fmt: skip


@SETTINGS
@given(case=dense_case(), left=st.sampled_from([0, 1, 5, 33, 128]))
def test_sinks_and_softcap_with_a_causal_sliding_window_match_the_reference(case, left):
    """gpt-oss' attention (sinks, causal window of `left` past keys) with Gemma 2's softcap."""
    q, k, v, dout = dense_inputs(case, "bf16", 64)
    rng = np.random.default_rng(case["seed"] + 4)
    score = {"softcap": 30.0, "learnable_sink": _sinks(rng, case["heads"])}
    window = (left, -1)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, window_size=window,
                                  return_attn_probs=True, **score)  # fmt: skip
    check_score_call("bf16", q, k, v, out, lse, dout, score, causal=True, window=window)


# -- score-stage features: the operators, torch.compile and CUDA graphs --------------------------


def _feature_inputs(seed: int, grad: bool = True):
    """GQA inputs with every feature's argument: softcap 30, (batch, heads) slopes, sinks."""
    rng = np.random.default_rng(seed)
    q = _tensor(rng.standard_normal((2, 97, 4, 64)), "bf16", grad)
    k, v = (_tensor(rng.standard_normal((2, 97, 2, 64)), "bf16", grad) for _ in range(2))
    dout = _tensor(rng.standard_normal((2, 97, 4, 64)), "bf16")
    slopes = _slopes(rng, 2, 4, True, False)
    return q, k, v, dout, slopes, _sinks(rng, 4, grad)


def test_opcheck_forward_and_backward_ops_with_every_feature():
    q, k, v, dout, slopes, sink = _feature_inputs(22)
    args = _op_args(q, k, v) + (30.0, slopes, sink)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, args)
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(*args)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, seed, offset,
                None, None, 0, 0, 0.0, 64**-0.5, True, -1, -1, True, 30.0, slopes,
                sink.detach())  # fmt: skip
    torch.library.opcheck(torch.ops.flashgen.bwd.default, bwd_args)
    dq, dk, dv, dsink = torch.ops.flashgen.bwd.default(*bwd_args)
    assert dsink.shape == (4,) and dsink.dtype == torch.float32 and dq.shape == q.shape


def test_torch_compile_fullgraph_with_every_feature_matches_eager_bitwise():
    q, k, v, dout, slopes, sink = _feature_inputs(23)

    def step(q, k, v, slopes, sink):
        out = flash_attn_func(q, k, v, causal=True, softcap=30.0, alibi_slopes=slopes,
                              deterministic=True, learnable_sink=sink)  # fmt: skip
        return out * 2.0

    want = step(q, k, v, slopes, sink)
    got = torch.compile(step, fullgraph=True)(q, k, v, slopes, sink)
    assert torch.equal(got, want)
    g_want = torch.autograd.grad(want, (q, k, v, sink), dout)
    g_got = torch.autograd.grad(got, (q, k, v, sink), dout)
    for a, b_ in zip(g_got, g_want):
        assert torch.equal(a, b_)


def test_cuda_graph_capture_and_replay_with_every_feature():
    """The slopes and sinks are read on the device at each replay: new values copied into
    them (and into q, k, v, dout) give what an eager call on those values gives."""
    q, k, v, dout, slopes, sink = _feature_inputs(24)

    def step():
        out = flash_attn_func(q, k, v, causal=True, softcap=30.0, alibi_slopes=slopes,
                              deterministic=True, learnable_sink=sink)  # fmt: skip
        return (out, *torch.autograd.grad(out, (q, k, v, sink), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (25, 26):
        nq, nk, nv, ndout, nslopes, nsink = _feature_inputs(seed, grad=False)
        with torch.no_grad():
            for t, new in ((q, nq), (k, nk), (v, nv), (dout, ndout), (slopes, nslopes),
                           (sink, nsink)):  # fmt: skip
                t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for a, b_ in zip(static, step()):
            assert torch.equal(a, b_)


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
        # (v's head dim may differ from q's and k's: d_v; its other dims may not)
        (lambda: _qkv(shape=(1, 16, 2, 128))[:2] + _qkv(shape=(1, 17, 2, 64))[2:], "same shape"),
        (lambda: (_qkv(shape=(1, 16, 3, 64))[0], *_qkv()[1:]), "must divide"),
        (lambda: _qkv(shape=(1, 16, 2, 300)), r"head_dim 300: allowed 1\.\.256"),
        (lambda: _qkv(shape=(1, 16, 2, 300), grad=True), r"head_dim 300: allowed 1\.\.256"),
        (lambda: _qkv(shape=(1, 16, 2, 0)), r"head_dim 0: allowed 1\.\.256"),
        (lambda: (_qkv(shape=(1, 16, 2, 59))[0], *_qkv()[1:]), "head_dim 59 differs from k's 64"),
    ],
    ids=["cpu", "fp32", "v-keys-differ", "kv-heads", "d300", "d300-grad", "d0", "d59-d64"],
)
def test_unsupported_calls_raise_naming_what_is_supported(make, match):
    q, k, v = make()
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"softcap": -1.0}, r"softcap=-1.0: allowed 0.0 \(off\) or a finite c > 0"),
        ({"softcap": float("nan")}, r"softcap=nan"),
        ({"softcap": float("inf")}, r"softcap=inf"),
        ({"alibi_slopes": torch.zeros(2)}, r"alibi_slopes is on device cpu but q is on cuda"),
        (
            {"alibi_slopes": torch.zeros(2, device=DEV).half()},
            r"alibi_slopes has dtype float16; it must be float32",
        ),
        (
            {"alibi_slopes": torch.zeros(3, device=DEV)},
            r"alibi_slopes has shape \(3,\); it must be \(nheads,\) = \(2,\) or "
            r"\(batch, nheads\) = \(1, 2\)",
        ),
        (
            {"alibi_slopes": torch.zeros(2, 2, device=DEV)[:, :1].T},
            r"alibi_slopes's last dimension has stride 2",
        ),
        ({"learnable_sink": torch.zeros(1, 2, device=DEV)}, r"learnable_sink has shape \(1, 2\)"),
        (
            {"learnable_sink": torch.zeros(2, device=DEV).bfloat16()},
            r"learnable_sink has dtype bfloat16; it must be float32",
        ),
        ({"learnable_sink": torch.zeros(2)}, r"learnable_sink is on device cpu but q is on"),
        ({"window_size": (-2, 0)}, "window_size"),
        ({"dropout_p": 1.0}, "dropout_p"),
    ],
    ids=[
        "softcap-negative", "softcap-nan", "softcap-inf", "alibi-cpu", "alibi-fp16",
        "alibi-shape", "alibi-stride", "sink-shape", "sink-bf16", "sink-cpu", "window",
        "dropout-1",
    ],
)  # fmt: skip
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_unsupported_arguments_raise(kwargs, match, grad):
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn_func(*_qkv(grad=grad), **kwargs)


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


# --------------------------------------------------------------------------------------------
# A thread with no current CUDA context
# --------------------------------------------------------------------------------------------


def _detach_context() -> None:
    """Leaves the calling thread with no current CUDA context (the driver's
    cuCtxSetCurrent(NULL)), as autograd's worker thread can be: its device is set through
    torch's runtime, which makes a context current only when a call needs one."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuCtxSetCurrent(None) == 0
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value is None


@pytest.mark.skipif(
    torch.cuda.get_device_capability() != (9, 0), reason="the sm_90a families need an H100/H200"
)
def test_sm90a_kernels_encode_their_tensor_maps_in_a_thread_with_no_current_context():
    """The sm_90a launchers encode TMA tensor maps with a driver call, which needs a current
    context; seen on an H200, the first sm_90a backward in autograd's worker thread failed
    with cudaErrorInvalidValue (the encode's CUDA_ERROR_INVALID_CONTEXT). The call runs in a
    thread whose context was detached, at a shape no other test uses (so no cached map
    hides the encode), forward and backward in that thread, on either path (binding or
    ctypes, FLASHGEN_TORCH_BINDING), and must match the same call from the main thread."""
    import threading

    mask_causal, window, _ = selection.resolve_mask(True, (-1, -1))
    call = selection.AttentionCall(
        dtype=selection.DTYPES["bfloat16"], head_dim=64, capability=(9, 0),
        causal=mask_causal, window=window,
    )  # fmt: skip
    for spec in (selection.forward_spec(call), selection.backward_spec(call)):
        assert spec.target.arch == "sm_90a", spec  # else the test would not reach an encode
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (1, 136, 3, 64)
    q, k, v, g = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(4))  # fmt: skip

    def leaves() -> tuple:
        return tuple(t.clone().requires_grad_() for t in (q, k, v))

    def run(qg, kg, vg) -> tuple:
        out = flash_attn_func(qg, kg, vg, causal=True)
        out.backward(g)
        return out.detach(), qg.grad, kg.grad, vg.grad

    # The main thread's call first: its freed buffers let the thread's call allocate from
    # torch's cache (no runtime call that would make a context current before the launch).
    # Its leaves stay alive, so the thread's inputs have other addresses (maps are cached by
    # address and shape).
    main_leaves = leaves()
    main = run(*main_leaves)
    torch.cuda.synchronize()
    inputs = leaves()  # cloned here: a copy kernel in the thread would make a context current
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(inputs, main_leaves))
    torch.cuda.synchronize()
    results: dict[str, object] = {}

    def in_thread() -> None:
        try:
            _detach_context()
            with torch.autograd.set_multithreading_enabled(False):  # the backward runs here
                results["thread"] = run(*inputs)
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            results["error"] = e

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join()
    if "error" in results:
        raise results["error"]
    assert torch.equal(results["thread"][0], main[0])  # the forward is deterministic
    for got, want in zip(results["thread"][1:], main[1:]):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # atomics order dQ
