"""`flashgen.torch.compile_variant` on a GPU: a spec's score_mod compiled into the forward and
backward kernels of the call's GPU, against the float64 reference of verify/ (the same
expression tree evaluated in float64) by the pass rule of verify/passrule.py, and a CUDA-graph
capture of a variant's forward.

Variants: ALiBi written as a score_mod (per-head slopes), softcap as a score_mod (a scalar
cap) and a relative log-distance bias with a scalar rate. Run it on both host paths:

    FLASHGEN_TORCH_BINDING=0 python -m pytest tests/gpu/test_torch_variant.py
    FLASHGEN_TORCH_BINDING=1 python -m pytest tests/gpu/test_torch_variant.py

The kernels compile on first use into the kernel cache ($FLASHGEN_CACHE_DIR), about a minute
each. Skips without torch or a CUDA device. Drawn cases: FLASHGEN_GPU_EXAMPLES / 20 per test
(default 10).
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

from flashgen.torch import compile_variant, ops, selection  # noqa: E402
from flashgen.verify.score_mods import ScoreArgs, check_user_params  # noqa: E402

from .checks import verdicts  # noqa: E402
from .test_backward import bwd_verdicts  # noqa: E402
from .variant_cases import (  # noqa: E402
    COMPILED,
    GRAPH,
    HEAD_DIMS,
    HEADS,
    LENGTHS,
    VARIANTS,
    VARLEN,
)
from .variant_cases import DTYPES as DTYPE_NAMES  # noqa: E402

EXAMPLES = max(1, int(os.environ.get("FLASHGEN_GPU_EXAMPLES", "200")) // 20)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
DEV = "cuda"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_COMPILED: dict = {}


def variant(name: str):
    if name not in _COMPILED:
        _COMPILED[name] = compile_variant(VARIANTS[name])
    return _COMPILED[name]


def params_for(name: str, heads: int, rng) -> dict:
    if name == "alibi":
        slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
        return {"slopes": torch.tensor(slopes, dtype=torch.float32, device=DEV)}
    if name == "softcap":
        return {"cap": float(rng.choice([5.0, 30.0]))}
    return {"rate": float(rng.uniform(0.1, 2.0))}


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _spec(var, kind: str, dtype: str, d: int, causal: bool, varlen: bool = False):
    """The spec the op selects for such a variant call (the checks read its dtype)."""
    call = selection.AttentionCall(
        dtype=selection.DTYPES[str(DTYPES[dtype]).removeprefix("torch.")],
        head_dim=d,
        capability=torch.cuda.get_device_capability(),
        causal=selection.resolve_mask(causal, (-1, -1))[0],
        varlen=varlen,
        score_mod=var.score_mod,
    )
    return (selection.forward_spec if kind == "fwd" else selection.backward_spec)(call)


def check_variant(var, name, dtype, d, q, k, v, out, lse, dout, params, causal, cu=None):
    """O and LSE, then dq, dk, dv, each by the pass rule against the float64 reference of the
    same expression (the parameters as the device holds them)."""
    batch = q.shape[0] if cu is None else len(cu) - 1
    host = {n: (_np(x) if isinstance(x, torch.Tensor) else x) for n, x in params.items()}
    held = check_user_params(var.score_mod, host, batch=batch, heads=q.shape[-2])
    score = ScoreArgs(score_mod=var.score_mod, score_params=held)
    ref_kw: dict = {"causal": "bottom_right" if causal else "none", **score.kwargs()}
    if cu is not None:
        ref_kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    inputs = {"q": _np(q), "k": _np(k), "v": _np(v)}
    res = SimpleNamespace(inputs=inputs, o=_np(out), lse=_np(lse))
    found = verdicts(_spec(var, "fwd", dtype, d, causal, cu is not None), res, **ref_kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    bres = SimpleNamespace(
        inputs={**inputs, "o": _np(out), "lse": _np(lse), "dout": _np(dout)},
        dq=_np(dq),
        dk=_np(dk),
        dv=_np(dv),
    )
    found.update(bwd_verdicts(_spec(var, "bwd", dtype, d, causal, cu is not None), bres, ref_kw))
    for what, verdict in found.items():
        assert verdict.passed, f"{name} {what}: {verdict.message}"


def _tensor(rng, shape, dtype, grad=True):
    x = rng.standard_normal(shape).astype(np.float32)
    return torch.tensor(x, dtype=DTYPES[dtype], device=DEV, requires_grad=grad)


def test_the_host_path_is_the_one_asked_for():
    want = os.environ.get("FLASHGEN_TORCH_BINDING", "auto")
    if want == "1":
        assert ops.BINDING is not None
    elif want == "0":
        assert ops.BINDING is None


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_variant_forward_and_gradients_match_the_float64_reference(name, dtype, d):
    var = variant(name)

    @SETTINGS
    @given(
        batch=st.integers(1, 2),
        heads=st.sampled_from(HEADS),
        sq=st.sampled_from(LENGTHS),
        sk=st.sampled_from(LENGTHS),
        causal=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def prop(batch, heads, sq, sk, causal, seed):
        rng = np.random.default_rng(seed)
        q = _tensor(rng, (batch, sq, heads, d), dtype)
        k, v = (_tensor(rng, (batch, sk, heads, d), dtype) for _ in range(2))
        dout = _tensor(rng, (batch, sq, heads, d), dtype, grad=False)
        params = params_for(name, heads, rng)
        out, lse, _ = var(q, k, v, causal=causal, return_attn_probs=True, **params)
        check_variant(var, name, dtype, d, q, k, v, out, lse, dout, params, causal)

    prop()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_varlen_variant_matches_the_reference_per_sequence(name):
    var = variant(name)
    rng = np.random.default_rng(7)
    lens, dtype, d, heads = VARLEN["lens"], VARLEN["dtype"], VARLEN["head_dim"], VARLEN["heads"]
    causal = VARLEN["causal"]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (_tensor(rng, (cu[-1], heads, d), dtype) for _ in range(3))
    dout = _tensor(rng, (cu[-1], heads, d), dtype, grad=False)
    params = params_for(name, heads, rng)
    cu_t = torch.tensor(cu, device=DEV)
    out, lse, _ = var.varlen(q, k, v, cu_t, cu_t, max(lens), max(lens), causal=causal,
                             return_attn_probs=True, **params)  # fmt: skip
    check_variant(var, name, dtype, d, q, k, v, out, lse, dout, params, causal, cu=cu)


def test_a_variant_forward_replays_in_a_cuda_graph():
    """Captured once; replays read the static inputs and the slopes as they are then."""
    name, dtype, shape, causal, _ = GRAPH
    var = variant(name)
    rng = np.random.default_rng(11)
    q, k, v = (_tensor(rng, shape, dtype, grad=False) for _ in range(3))
    slopes = params_for(name, shape[2], rng)["slopes"]
    var(q, k, v, causal=causal, slopes=slopes)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = var(q, k, v, causal=causal, slopes=slopes)
    for step in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        slopes.mul_(0.5 + step)
        graph.replay()
        torch.cuda.synchronize()
        want = var(q, k, v, causal=causal, slopes=slopes)
        assert torch.equal(static_out, want)


def test_a_variant_compiles_under_torch_compile_fullgraph():
    name, dtype, shape, causal, _ = COMPILED
    var = variant(name)
    rng = np.random.default_rng(12)
    q, k, v = (_tensor(rng, shape, dtype) for _ in range(3))

    def step(q, k, v):
        return var(q, k, v, causal=causal, cap=30.0).float().square().sum()

    want = torch.autograd.grad(step(q, k, v), (q, k, v))
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
