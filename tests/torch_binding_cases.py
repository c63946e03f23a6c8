"""The compiled binding's fast path against the Python path, without a GPU.

Run by tests/test_torch_binding.py in a subprocess with FLASHGEN_TORCH_BINDING=1 and the
binding's CPU registration on (the C++ kernels then serve CPU tensors, which the mocks below
describe as CUDA ones), never collected directly (its name does not start with test_).

The kernel libraries are a mock (`flashgen.bench.mock_kernels`, compiled here):
`<kind>_launch` copies the parameter struct it is given into a buffer. The same call runs
through the C++ op and through the Python implementation (`ops._fwd_impl` / `_bwd_impl`,
ctypes), and the two structs must be equal field for field, output pointers aside (each
must point at its own path's outputs) and the workspace carve compared relative to its base.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.bench import mock_kernels  # noqa: E402
from flashgen.bench.mock_kernels import MockLibrary  # noqa: E402
from flashgen.generator.families import family  # noqa: E402
from flashgen.generator.spec import KernelKind  # noqa: E402
from flashgen.runtime.library import params_struct  # noqa: E402
from flashgen.torch import binding, cache, ops, selection  # noqa: E402
from flashgen.torch.selection import UnsupportedCall  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

if ops.BINDING is None:  # pragma: no cover - the outer test sets the environment
    pytest.skip("run through tests/test_torch_binding.py", allow_module_level=True)


_MOCK = []


def mock_lib():
    return _MOCK[0]


@pytest.fixture(scope="session")
def mock(tmp_path_factory):
    _MOCK.append(mock_kernels.build(tmp_path_factory.mktemp("mock")))
    return _MOCK[0]


@pytest.fixture(autouse=True)
def cuda_mocked(monkeypatch, mock):
    """CPU tensors taken for CUDA ones on a (9, 0) device 0; kernels from the mock."""
    mock_kernels.mock_cuda(monkeypatch.setattr, mock)
    ops.BINDING.clear()
    yield
    ops.BINDING.clear()


def taken(mock, kind: str) -> dict:
    """The struct the mock's last `<kind>_launch` received, by field name."""
    fam = family_of[kind]
    Params = params_struct(fam)
    buf = Params()
    getattr(mock, f"take_{kind}")(ctypes.byref(buf))
    return {p.name: getattr(buf, p.name) for p in fam.params}


# the C structs' tables (every family of a direction shares its struct)
family_of = {"fwd": family(KernelKind.FORWARD), "bwd": family(KernelKind.BACKWARD)}


def calls(mock, kind: str) -> int:
    return mock.calls(1 if kind == "bwd" else 0)


# -- drawing calls ------------------------------------------------------------------------------

SERVED_D = (32, 40, 64, 72, 96, 128)


@st.composite
def fwd_calls(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    d = draw(st.sampled_from(SERVED_D))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    batch = draw(st.integers(1, 3))
    varlen = draw(st.booleans())
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (16, 0), (7, 3)]))
    det = draw(st.booleans())
    softcap = draw(st.sampled_from([0.0, 0.0, 30.0]))
    alibi = draw(st.sampled_from([None, None, "heads", "batch_heads"]))
    sink = draw(st.booleans())
    strided = draw(st.booleans())  # q a view of a wider tensor (aligned, non-contiguous)
    if varlen:
        lens_q = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
        lens_k = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        q_shape, k_shape = (sum(lens_q), heads, d), (sum(lens_k), kv, d)
        max_q, max_k = max(lens_q), max(lens_k)
    else:
        sq, sk = draw(st.integers(1, 70)), draw(st.integers(1, 70))
        q_shape, k_shape = (batch, sq, heads, d), (batch, sk, kv, d)
        cu_q = cu_k = None
        max_q = max_k = 0
    if strided:
        wide = torch.randn(*q_shape[:-2], heads * 2, d, dtype=dtype)
        q = wide[..., :heads, :]
    else:
        q = torch.randn(q_shape, dtype=dtype)
    k, v = torch.randn(k_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype)
    slopes = None
    if alibi == "heads":
        slopes = torch.rand(heads)
    elif alibi == "batch_heads":
        slopes = torch.rand(batch, heads)
    sinks = torch.randn(heads) if sink else None
    scale = draw(st.sampled_from([d**-0.5, 0.1]))
    return (q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, *window, det, softcap,
            slopes, sinks)  # fmt: skip


def _normalised(rec: dict, outputs: dict) -> dict:
    """rec with each output pointer checked against its tensor and blanked."""
    out = dict(rec)
    for field, t in outputs.items():
        assert rec[field] == t.data_ptr(), field
        out[field] = "output"
    return out


FWD_OUTPUTS = ("o", "lse")


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(fwd_calls())
def test_forward_struct_equals_the_python_paths(mock, args):
    before = calls(mock, "fwd")
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(*args)
    fast = taken(mock, "fwd")
    assert calls(mock, "fwd") == before + 1
    py_out, py_lse, py_seed, py_offset = ops._fwd_impl(*args)
    slow = taken(mock, "fwd")
    assert out.shape == py_out.shape and out.dtype == py_out.dtype
    assert lse.shape == py_lse.shape and lse.stride() == py_lse.stride()
    assert (seed.item(), offset.item()) == (py_seed.item(), py_offset.item()) == (0, 0)
    assert _normalised(fast, {"o": out, "lse": lse}) == _normalised(
        slow, {"o": py_out, "lse": py_lse}
    )


def test_the_second_call_of_a_key_is_a_plan_hit(mock):
    q, k, v = (torch.randn(2, 33, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    args = (q, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False)
    s0 = ops.BINDING.stats()
    torch.ops.flashgen.fwd.default(*args)
    s1 = ops.BINDING.stats()
    torch.ops.flashgen.fwd.default(*args)
    s2 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (1, 0)
    assert (s2["misses"] - s1["misses"], s2["hits"] - s1["hits"]) == (0, 1)
    # another length is another key; the per-call scale is not part of it
    q2 = torch.randn(2, 34, 4, 64, dtype=torch.bfloat16)
    torch.ops.flashgen.fwd.default(q2, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False)
    torch.ops.flashgen.fwd.default(q, k, v, None, None, 0, 0, 0.0, 0.5, True, -1, -1, False)
    s3 = ops.BINDING.stats()
    assert (s3["misses"] - s2["misses"], s3["hits"] - s2["hits"]) == (1, 1)
    assert taken(mock, "fwd")["softmax_scale"] == 0.5


def test_varlen_keys_ignore_the_packed_lengths(mock):
    def call(lens):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        total = sum(lens)
        q, k, v = (torch.randn(total, 4, 64, dtype=torch.bfloat16) for _ in range(3))
        torch.ops.flashgen.fwd.default(
            q, k, v, cu, cu, max(lens), max(lens), 0.0, 0.125, True, -1, -1, False
        )
        return taken(mock, "fwd")

    s0 = ops.BINDING.stats()
    a = call([5, 17])
    b = call([30, 2])
    s1 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (1, 1)
    assert (a["seqlen_q"], a["total_q"], b["seqlen_q"], b["total_q"]) == (17, 22, 30, 32)


def test_refusals_are_the_python_paths_errors_every_time():
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 16, 4, 64, dtype=torch.float16)
    for _ in range(2):
        with pytest.raises(UnsupportedCall, match="k has dtype float16 but q has bfloat16"):
            torch.ops.flashgen.fwd.default(q, k, k, None, None, 0, 0, 0.0, 0.1, False, -1, -1,
                                           False)  # fmt: skip
    with pytest.raises(UnsupportedCall, match="softcap"):
        torch.ops.flashgen.fwd.default(q, q, q, None, None, 0, 0, 0.0, 0.1, False, -1, -1,
                                       False, -1.0)  # fmt: skip
    # a bad scale on a key that has a plan: the fast path leaves it to the Python check
    torch.ops.flashgen.fwd.default(q, q, q, None, None, 0, 0, 0.0, 0.1, False, -1, -1, False)
    with pytest.raises(UnsupportedCall, match="softmax_scale"):
        torch.ops.flashgen.fwd.default(q, q, q, None, None, 0, 0, 0.0, float("inf"), False, -1,
                                       -1, False)  # fmt: skip


# With a CUDA build of torch the binding takes dropout's Philox state itself (binding.cpp's
# take_philox, from the real CUDA generator: tests/gpu/test_torch.py checks it).
_NO_GENERATOR = pytest.mark.skipif(
    bool(ops.BINDING.CUDA_GENERATOR), reason="the binding serves dropout with torch's generator"
)


@_NO_GENERATOR
def test_dropout_and_empty_calls_take_the_python_implementation(monkeypatch, mock):
    monkeypatch.setattr(ops, "philox_state", lambda device, p: (1234, 8))
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    s0 = ops.BINDING.stats()
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(
        q, q, q, None, None, 0, 0, 0.1, 0.1, False, -1, -1, False
    )
    assert (seed.item(), offset.item()) == (1234, 8)
    assert taken(mock, "fwd")["seed"] == 1234
    empty = torch.randn(1, 0, 4, 64, dtype=torch.bfloat16)
    out, lse, _, _ = torch.ops.flashgen.fwd.default(
        q, empty, empty, None, None, 0, 0, 0.0, 0.1, False, -1, -1, False
    )
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all())
    assert ops.BINDING.stats()["fallbacks"] - s0["fallbacks"] == 2


def test_a_refused_launch_raises_the_launchers_message(monkeypatch, mock):
    from flashgen.runtime import LaunchError

    monkeypatch.setattr(cache, "kernel_library", lambda spec: MockLibrary(spec, mock, fail=True))
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="mock_forward: mock: refused"):
        torch.ops.flashgen.fwd.default(q, q, q, None, None, 0, 0, 0.0, 0.1, False, -1, -1, False)


# -- backward and autograd ---------------------------------------------------------------------


def _bwd_args(fwd_args, out, lse, seed, offset):
    (q, k, v, cu_q, cu_k, max_q, max_k, p, scale, causal, wl, wr, det, softcap, slopes,
     sinks) = fwd_args  # fmt: skip
    dout = torch.randn_like(out)
    return (dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, p, scale, causal,
            wl, wr, det, softcap, slopes, sinks)  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(fwd_calls())
def test_backward_struct_equals_the_python_paths(mock, args):
    out, lse, seed, offset = ops._fwd_impl(*args)
    assert_backward_structs_agree(mock, _bwd_args(args, out, lse, seed, offset))


def assert_backward_structs_agree(mock, bargs) -> dict:
    """The binding's and the Python path's backward structs for one call, equal field for
    field (outputs and the workspace carve normalised); returns the binding's."""
    dq, dk, dv, dsink = torch.ops.flashgen.bwd.default(*bargs)
    fast = taken(mock, "bwd")
    py = ops._bwd_impl(*bargs)
    slow = taken(mock, "bwd")
    for a, b in zip((dq, dk, dv, dsink), py):
        assert a.shape == b.shape and a.dtype == b.dtype
    names = ("dq", "dk", "dv")
    fast_n = _normalised(fast, dict(zip(names, (dq, dk, dv))))
    slow_n = _normalised(slow, dict(zip(names, py[:3])))
    for rec in (fast_n, slow_n):  # the carve, relative to the workspace's base
        base = rec["dq_accum"]
        rec["dq_accum"] = 0
        rec["dsum"] -= base
        rec["dq_sem"] = rec["dq_sem"] - base if rec["dq_sem"] else 0
    if bargs[-1] is not None:
        assert fast["dsinks"] == dsink.data_ptr() and slow["dsinks"] == py[3].data_ptr()
        fast_n["dsinks"] = slow_n["dsinks"] = "output"
    assert fast_n == slow_n
    return fast


def test_a_dropout_backward_takes_the_forwards_pair_by_value_on_both_paths(monkeypatch, mock):
    monkeypatch.setattr(ops, "philox_state", lambda device, p: (2**64 - 3, 20))
    q, k, v = (torch.randn(2, 33, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    args = (q, k, v, None, None, 0, 0, 0.2, 0.125, False, -1, -1, False, 0.0, None, None)
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(*args)
    fast = assert_backward_structs_agree(mock, _bwd_args(args, out, lse, seed, offset))
    assert (fast["seed"], fast["offset"]) == (2**64 - 3, 20)
    assert fast["philox_seed_ptr"] == fast["philox_offset_ptr"] == 0


@_NO_GENERATOR
def test_a_captured_dropout_forward_without_the_cuda_generator_is_the_python_paths(
    monkeypatch, mock
):
    """A CPU build of torch has no CUDA generator for the binding to read (binding.cpp's
    take_philox): its dropout forwards, captured or not, run the Python implementation,
    which under capture hands the kernel device pointers."""
    monkeypatch.setattr(ops, "capturing", lambda: True)
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16)
    s0 = ops.BINDING.stats()
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(
        q, q, q, None, None, 0, 0, 0.1, 0.1, False, -1, -1, False
    )
    rec = taken(mock, "fwd")
    assert rec["philox_seed_ptr"] != 0 and rec["philox_offset_ptr"] == rec["philox_seed_ptr"] + 8
    assert (rec["philox_seed_out"], rec["philox_offset_out"]) == (
        seed.data_ptr(),
        offset.data_ptr(),
    )
    assert ops.BINDING.stats()["fallbacks"] - s0["fallbacks"] == 1


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 4),
    sq=st.integers(1, 300),
    heads=st.integers(1, 16),
    d=st.sampled_from([8, 40, 64, 128, 256]),
    block_m=st.sampled_from([16, 64, 128]),
    det=st.booleans(),
)
def test_workspace_carve_is_the_runtime_layout(batch, sq, heads, d, block_m, det):
    from flashgen.runtime import workspace_layout

    want = workspace_layout(batch, sq, heads, d, block_m=block_m, deterministic=det)
    assert ops.BINDING.workspace_carve(batch, sq, heads, d, block_m, det) == want


def test_autograd_runs_the_backward_kernel_and_the_sinks_gradient(mock):
    q, k, v = (torch.randn(2, 20, 4, 64, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    sink = torch.zeros(4, requires_grad=True)
    slopes = torch.rand(4, requires_grad=True)
    before = calls(mock, "bwd")
    out, lse, _, _ = torch.ops.flashgen.fwd.default(
        q, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False, 0.0, slopes, sink
    )
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert calls(mock, "bwd") == before + 1
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
    assert sink.grad is not None and sink.grad.shape == (4,)
    assert slopes.grad is None  # as in flash-attn: the slopes get no gradient
    rec = taken(mock, "bwd")
    assert (rec["sinks"], rec["alibi_slopes"]) == (sink.data_ptr(), slopes.data_ptr())
    assert rec["seqlen_q"] == 20 and rec["softmax_scale"] == 0.125


def test_no_grad_calls_skip_the_autograd_graph(mock):
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        out, *_ = torch.ops.flashgen.fwd.default(
            q, q, q, None, None, 0, 0, 0.0, 0.1, False, -1, -1, False
        )
    assert out.grad_fn is None and not out.requires_grad


def test_a_call_without_a_backward_kernel_is_refused_at_its_forward(monkeypatch):
    def no_backward(call):
        raise UnsupportedCall(f"head_dim {call.head_dim} has no backward kernel (test)")

    monkeypatch.setattr(selection, "backward_spec", no_backward)
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    before = calls(mock_lib(), "fwd")
    for _ in range(2):  # refused every time: a refusal is not remembered
        with pytest.raises(UnsupportedCall, match="head_dim 64 has no backward kernel"):
            torch.ops.flashgen.fwd.default(q, q, q, None, None, 0, 0, 0.0, 0.1, False, -1, -1,
                                           False)  # fmt: skip
    assert calls(mock_lib(), "fwd") == before  # before the forward ran
    with torch.no_grad():  # the forward alone is served
        torch.ops.flashgen.fwd.default(q, q, q, None, None, 0, 0, 0.0, 0.1, False, -1, -1, False)
    assert calls(mock_lib(), "fwd") == before + 1


def test_flash_attn_func_goes_through_the_binding(mock):
    from flashgen.torch import flash_attn_func

    q = torch.randn(2, 24, 4, 64, dtype=torch.bfloat16)
    s0 = ops.BINDING.stats()
    flash_attn_func(q, q, q, causal=True)
    flash_attn_func(q, q, q, causal=True)
    s1 = ops.BINDING.stats()
    assert s1["hits"] + s1["misses"] - s0["hits"] - s0["misses"] == 2
    assert s1["fallbacks"] == s0["fallbacks"]


def test_the_schemas_are_the_python_implementations():
    """The binding's fwd and bwd have the Python path's schemas, and the variant ops' are
    those with the user arguments appended, in `USER_ARGS` order, with their defaults."""
    for name in ("fwd", "bwd"):
        op = getattr(torch.ops.flashgen, name).default
        schema = {"fwd": ops._FWD_SCHEMA, "bwd": ops._BWD_SCHEMA}[name]
        assert op._schema == torch._C.parse_schema(f"flashgen::{name}{schema}")
        full = getattr(torch.ops.flashgen, f"{name}_variant").default._schema
        n = len(op._schema.arguments)
        assert [str(a.name) + str(a.type) for a in op._schema.arguments] == [
            str(a.name) + str(a.type) for a in full.arguments[:n]
        ]
        assert [a.name for a in full.arguments[n:]] == list(ops.USER_ARGS)
        assert [a.default_value for a in full.arguments[n:]] == list(ops.NO_USER)
        assert [str(r.type) for r in full.returns] == [str(r.type) for r in op._schema.returns]


def test_the_extension_is_cached_by_its_sources():
    assert binding.build() == binding.build()
    assert Path(binding.build()).parent.name == binding._stamp()


# -- torch.library's checks and torch.compile ---------------------------------------------------


def _op_args(grad=False, sink=False):
    q, k, v = (torch.randn(2, 24, 4, 64, dtype=torch.bfloat16, requires_grad=grad)
               for _ in range(3))  # fmt: skip
    sinks = torch.randn(4, requires_grad=grad) if sink else None
    return (q, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False, 0.0, None, sinks)


@pytest.mark.parametrize("sink", [False, True])
def test_opcheck_passes_on_the_compiled_ops(sink):
    args = _op_args(grad=True, sink=sink)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, args)
    out, lse, seed, offset = torch.ops.flashgen.fwd.default(*args)
    bargs = _bwd_args(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                      out.detach(), lse, seed, offset)  # fmt: skip
    torch.library.opcheck(torch.ops.flashgen.bwd.default, bargs)


def test_torch_compile_fullgraph_traces_the_compiled_ops(mock):
    def step(q, k, v):
        out, *_ = torch.ops.flashgen.fwd.default(
            q, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False
        )
        return out.float().sum()

    args = _op_args(grad=True)[:3]
    before = (calls(mock, "fwd"), calls(mock, "bwd"))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(*args).backward()
    assert (calls(mock, "fwd"), calls(mock, "bwd")) == (before[0] + 1, before[1] + 1)
    assert all(t.grad is not None and bool((t.grad == 0).all()) for t in args)


# -- tracing, compiled autograd, double backward, slopes (review findings) ---------------------


def _graph_counter():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return graphs, backend


def _fwd_sum(q, k, v, cu=None, m=0):
    out, *_ = torch.ops.flashgen.fwd.default(q, k, v, cu, cu, m, m, 0.0, 0.125, True, -1, -1,
                                             False)  # fmt: skip
    return out.float().sum()


def test_dynamic_shapes_with_grad_compile_one_graph():
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    compiled = torch.compile(_fwd_sum, backend=backend, dynamic=True)
    for s in (24, 32, 40):
        q, k, v = (torch.randn(2, s, 4, 64, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        compiled(q, k, v).backward()
    assert len(graphs) == 1  # the autograd kernel reads no symbolic size


def test_varlen_with_grad_compiles_with_dynamic_shapes():
    torch._dynamo.reset()
    graphs, backend = _graph_counter()
    compiled = torch.compile(_fwd_sum, backend=backend, dynamic=True, fullgraph=True)
    for lens in ([5, 17], [30, 2], [3, 9, 11]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.randn(sum(lens), 4, 64, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        compiled(q, k, v, cu, max(lens)).backward()
    assert len(graphs) <= 2  # the batch count (cu_seqlens' length) may specialise once


def test_compiled_autograd_runs_the_backward():
    q, k, v = _op_args(grad=True)[:3]
    loss = _fwd_sum(q, k, v)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
    assert all(t.grad is not None for t in (q, k, v))


def test_double_backward_is_refused():
    q, k, v = _op_args(grad=True)[:3]
    (dq,) = torch.autograd.grad(_fwd_sum(q, k, v), q, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative|autograd|not implemented"):
        torch.autograd.grad(dq.float().sum(), k)


def test_slopes_alone_requiring_grad_make_the_output_require_grad():
    q = torch.randn(2, 24, 4, 64, dtype=torch.bfloat16)
    slopes = torch.rand(4, requires_grad=True)
    out, *_ = torch.ops.flashgen.fwd.default(
        q, q, q, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False, 0.0, slopes, None
    )
    assert out.requires_grad  # as with the Python path's custom op
    out.float().sum().backward()
    assert slopes.grad is None  # the slopes get no gradient (flash-attn's rule)


def test_varlen_backward_keys_ignore_the_packed_lengths():
    s0 = ops.BINDING.stats()
    for lens in ([5, 17], [30, 2], [8, 8], [1, 40]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (torch.randn(sum(lens), 4, 64, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        _fwd_sum(q, k, v, cu, max(lens)).backward()
    s1 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (2, 6)  # fwd + bwd once


# -- flashgen::decode ------------------------------------------------------------------------------

DECODE_FAMILY = family(KernelKind.DECODE)


def taken_decode(mock) -> dict:
    Params = params_struct(DECODE_FAMILY)
    buf = Params()
    mock.take_decode(ctypes.byref(buf))
    return {p.name: getattr(buf, p.name) for p in DECODE_FAMILY.params}


@st.composite
def decode_calls(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    d = draw(st.sampled_from((64, 128)))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 4]))
    batch = draw(st.integers(1, 3))
    sq = draw(st.integers(1, 16))
    paged = draw(st.booleans())
    if paged:
        page = draw(st.sampled_from([16, 64]))
        cols = draw(st.integers(1, 4))
        pages = batch * cols + 1
        k_cache = torch.randn(pages, page, kv, d, dtype=dtype)
        table = torch.randperm(pages)[: batch * cols].to(torch.int32).reshape(batch, cols)
        capacity = cols * page
    else:
        capacity = draw(st.integers(1, 300))
        k_cache = torch.randn(batch, capacity, kv, d, dtype=dtype)
        table = None
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([draw(st.integers(0, capacity)) for _ in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, sq, heads, d, dtype=dtype)
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (32, 0), (5, 3)]))
    splits = draw(st.sampled_from([0, 1, 3]))
    softcap = draw(st.sampled_from([0.0, 30.0]))
    slopes = draw(st.sampled_from([None, "h"]))
    slopes = torch.rand(heads) if slopes else None
    sinks = torch.randn(heads) if draw(st.booleans()) else None
    max_k = draw(st.sampled_from([0, capacity // 2, capacity + 7]))
    return (q, k_cache, v_cache, lens, table, d**-0.5, causal, *window, splits, max_k, False,
            softcap, slopes, sinks)  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(decode_calls())
def test_decode_struct_equals_the_python_paths(mock, args):
    from flashgen.torch import kvcache

    before = mock.decode_count()
    out, lse = torch.ops.flashgen.decode.default(*args)
    fast = taken_decode(mock)
    assert mock.decode_count() == before + 1
    py_out, py_lse = kvcache._decode_impl(*args)
    slow = taken_decode(mock)
    assert out.shape == py_out.shape and lse.shape == py_lse.shape
    fast = _normalised(fast, {"o": out, "lse": lse})
    slow = _normalised(slow, {"o": py_out, "lse": py_lse})
    assert fast["workspace"] != 0 and slow["workspace"] != 0
    fast["workspace"] = slow["workspace"] = "workspace"
    assert fast == slow


def test_decode_keys_hit_and_check_inputs_takes_the_python_path(monkeypatch, mock):
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    cache_k = torch.randn(2, 100, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([50, 100], dtype=torch.int32)
    args = [q, cache_k, cache_k, lens, None, 0.125, True, -1, -1, 0, 0, False]
    s0 = ops.BINDING.stats()
    for max_k in (0, 60, 100):  # a per-call value: one key
        args[10] = max_k
        torch.ops.flashgen.decode.default(*args)
        taken = taken_decode(mock)
        assert taken["max_seqlen_k"] == min(max_k, 100)
        assert taken["trap_on_error"] == 1  # unchecked: bad device values trap (flash-attn's)
    s1 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (1, 2)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: 0)  # the error word: no error
    args[11] = True
    torch.ops.flashgen.decode.default(*args)
    assert ops.BINDING.stats()["fallbacks"] - s1["fallbacks"] == 1
    assert taken_decode(mock)["trap_on_error"] == 0  # checked: the word is read instead


# -- flashgen::merge_states ----------------------------------------------------------------------


def taken_merge(mock):
    """The decode struct the mock's last `merge_launch` received (ctypes)."""
    buf = params_struct(DECODE_FAMILY)()
    mock.take_merge(ctypes.byref(buf))
    return buf


def _merge_bytes(buf, out, lse) -> bytes:
    """The struct's bytes with its output pointers checked against their tensors and zeroed."""
    assert (buf.o, buf.lse) == (out.data_ptr(), lse.data_ptr())
    buf.o = buf.lse = 0
    return bytes(buf)


@st.composite
def merge_calls(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    out_dtype = (draw(st.sampled_from(["float16", "bfloat16"])) if dtype == torch.float32
                 else str(dtype).removeprefix("torch."))  # fmt: skip
    d = draw(st.sampled_from((32, 64, 128)))
    parts, batch = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    sq, heads = draw(st.integers(1, 40)), draw(st.integers(1, 5))
    if draw(st.booleans()):  # a view of wider parts (aligned, not contiguous)
        o_parts = torch.randn(parts, batch, sq, heads + 2, d, dtype=dtype)[:, :, :, 1:-1]
    else:
        o_parts = torch.randn(parts, batch, sq, heads, d, dtype=dtype)
    if draw(st.booleans()):  # lse_parts a view of a longer one (its last stride stays 1)
        lse_parts = torch.randn(parts, batch, heads, sq + 3)[..., :sq]
    else:
        lse_parts = torch.randn(parts, batch, heads, sq)
    return o_parts, lse_parts, out_dtype


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(merge_calls())
def test_merge_struct_equals_the_python_paths_byte_for_byte(mock, args):
    """The call after the planning one (a plan hit) on other tensors of the same layouts."""
    from flashgen.torch import kvcache

    torch.ops.flashgen.merge_states.default(*args)  # the key's plan (or a hit)
    args = (*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
              for t in args[:2]), args[2])  # fmt: skip
    s0, before = ops.BINDING.stats(), mock.merge_count()
    out, lse = torch.ops.flashgen.merge_states.default(*args)
    fast = taken_merge(mock)
    assert mock.merge_count() == before + 1
    assert ops.BINDING.stats()["hits"] == s0["hits"] + 1
    py_out, py_lse = kvcache._merge_impl(*args)
    slow = taken_merge(mock)
    assert mock.merge_count() == before + 2
    assert (out.shape, out.dtype, out.stride()) == (py_out.shape, py_out.dtype, py_out.stride())
    assert (lse.shape, lse.dtype, lse.stride()) == (py_lse.shape, py_lse.dtype, py_lse.stride())
    assert (fast.o_parts, fast.lse_parts) == (args[0].data_ptr(), args[1].data_ptr())
    assert _merge_bytes(fast, out, lse) == _merge_bytes(slow, py_out, py_lse)


def _merge_args(parts=2, batch=2, sq=33, heads=4, d=64, dtype=torch.bfloat16):
    return (torch.randn(parts, batch, sq, heads, d, dtype=dtype),
            torch.randn(parts, batch, heads, sq))  # fmt: skip


def test_merge_keys_hit_on_the_second_call(mock):
    o_parts, lse_parts = _merge_args()
    s0 = ops.BINDING.stats()
    torch.ops.flashgen.merge_states.default(o_parts, lse_parts, "bfloat16")
    s1 = ops.BINDING.stats()
    other, other_lse = _merge_args()  # other tensors, the same layouts: the same key
    out, lse = torch.ops.flashgen.merge_states.default(other, other_lse, "bfloat16")
    s2 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (1, 0)
    assert (s2["misses"] - s1["misses"], s2["hits"] - s1["hits"]) == (0, 1)
    rec = taken_merge(mock)
    assert (rec.o_parts, rec.lse_parts, rec.o) == (other.data_ptr(), other_lse.data_ptr(),
                                                    out.data_ptr())  # fmt: skip
    # another length, or float32 parts into another dtype: other keys
    torch.ops.flashgen.merge_states.default(*_merge_args(sq=34), "bfloat16")
    f32, f32_lse = _merge_args(dtype=torch.float32)
    for name in ("float16", "bfloat16", "float16"):
        out, _ = torch.ops.flashgen.merge_states.default(f32, f32_lse, name)
        assert out.dtype == getattr(torch, name)
    s3 = ops.BINDING.stats()
    assert (s3["misses"] - s2["misses"], s3["hits"] - s2["hits"]) == (3, 1)
    assert s3["fallbacks"] == s0["fallbacks"]


def test_merge_refusals_are_the_python_paths_errors_every_time(mock):
    from flashgen.torch import kvcache

    o_parts, lse_parts = _merge_args()
    cases = [
        ((o_parts, lse_parts[..., :5], "bfloat16"), r"lse_parts must be float32 \(2, 2, 4, 33\)"),
        ((o_parts.float(), lse_parts, "float32"), "float32 o_parts need out_dtype"),
        ((o_parts, lse_parts, "float16"), "out_dtype float16 differs from o_parts' bfloat16"),
        ((o_parts[..., :60], lse_parts, "bfloat16"), "head_dim 60 has no merge_states kernel"),
    ]  # fmt: skip
    before = mock.merge_count()
    for args, match in cases:
        for _ in range(2):  # a refusal is not remembered
            with pytest.raises(UnsupportedCall, match=match):
                torch.ops.flashgen.merge_states.default(*args)
        with pytest.raises(UnsupportedCall, match=match):
            kvcache._merge_impl(*args)
    assert mock.merge_count() == before


def test_merge_calls_the_fast_path_does_not_serve_take_the_python_implementation(mock):
    o_parts, lse_parts = _merge_args()
    torch.ops.flashgen.merge_states.default(o_parts, lse_parts, "bfloat16")  # the key's plan
    s0, before = ops.BINDING.stats(), mock.merge_count()
    # a view that begins mid-vector, with the layout of a served call: the Python check
    flat = torch.randn(o_parts.numel() + 8, dtype=torch.bfloat16)
    shifted = flat[1 : 1 + o_parts.numel()].view(o_parts.shape)
    assert shifted.stride() == o_parts.stride() and shifted.data_ptr() % 16
    with pytest.raises(UnsupportedCall, match="o_parts starts at an address that is not 16-byte"):
        torch.ops.flashgen.merge_states.default(shifted, lse_parts, "bfloat16")
    # no rows: empty outputs from the Python implementation, no launch
    empty, empty_lse = _merge_args(batch=0)
    out, lse = torch.ops.flashgen.merge_states.default(empty, empty_lse, "bfloat16")
    assert out.shape == (0, 33, 4, 64) and lse.shape == (0, 4, 33)
    s1 = ops.BINDING.stats()
    assert s1["fallbacks"] - s0["fallbacks"] == 2 and mock.merge_count() == before


def test_a_refused_merge_raises_the_launchers_message_on_both_paths(monkeypatch, mock):
    from flashgen.runtime import LaunchError
    from flashgen.torch import kvcache

    monkeypatch.setattr(kvcache, "_library", lambda spec: MockLibrary(spec, mock, fail=True))
    args = (*_merge_args(), "bfloat16")
    match = r"^mock_decode: mock: merge refused \(allowed: nothing\)$"
    with pytest.raises(LaunchError, match=match):
        torch.ops.flashgen.merge_states.default(*args)
    with pytest.raises(LaunchError, match=match):
        kvcache._merge_impl(*args)


def test_merge_states_goes_through_the_binding_and_remembers_plain_layouts(monkeypatch, mock):
    from flashgen.torch import kvcache, merge_states

    monkeypatch.setattr(kvcache, "_on_cuda", lambda t: True)  # the padding and layout checks
    monkeypatch.setattr(kvcache, "_PLAIN_MERGES", {})
    o_parts, lse_parts = _merge_args()
    s0, before = ops.BINDING.stats(), mock.merge_count()
    for _ in range(3):
        out, lse = merge_states(o_parts, lse_parts)
    s1 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (1, 2)
    assert mock.merge_count() == before + 3 and len(kvcache._PLAIN_MERGES) == 1
    assert taken_merge(mock).o_parts == o_parts.data_ptr()  # read as given
    # requires grad: detached, outputs that do not
    out, _ = merge_states(o_parts.clone().requires_grad_(), lse_parts.clone().requires_grad_())
    assert not out.requires_grad
    # a head dim the kernels pad and a layout they cannot read: copies, not remembered
    wide = torch.randn(2, 2, 33, 4, 68, dtype=torch.bfloat16)
    for parts, d in ((wide[..., :60], 60), (wide[..., :64], 64)):
        for _ in range(2):
            out, _ = merge_states(parts, lse_parts)
            assert out.shape == (2, 33, 4, d)
            assert taken_merge(mock).o_parts != parts.data_ptr()
    assert len(kvcache._PLAIN_MERGES) == 1
    # a refusal is refused every time, remembered or not
    for _ in range(2):
        with pytest.raises(UnsupportedCall, match="out_dtype float16 differs"):
            merge_states(o_parts, lse_parts, torch.float16)


def test_the_merge_schema_is_the_python_implementations():
    from flashgen.torch import kvcache

    inferred = torch.library.infer_schema(kvcache._merge_impl, mutates_args=())
    assert torch.ops.flashgen.merge_states.default._schema == torch._C.parse_schema(
        f"flashgen::merge_states{inferred}"
    )


def test_opcheck_and_torch_compile_pass_on_the_compiled_merge(mock):
    args = (*_merge_args(), "bfloat16")
    torch.library.opcheck(torch.ops.flashgen.merge_states.default, args)

    def step(o_parts, lse_parts):
        out, lse = torch.ops.flashgen.merge_states.default(o_parts, lse_parts, "bfloat16")
        return out.float().sum() + lse.sum()

    before = mock.merge_count()
    torch.compile(step, fullgraph=True, backend="aot_eager")(*args[:2])
    assert mock.merge_count() == before + 1


# -- compile_variant: the user arguments (docs/torch.md, "User-defined variants") -----------------

_VARIANT = """
kernel: [forward, backward]
dtype: bf16
head_dim: 64
score_mod: >-
  s - slopes[h] * abs(i - j) + offset + bias[h, min(abs(i - j) // 8, 31)]
  + where(j < n, 0.0, 1.0)
params: {slopes: per_head, offset: scalar, bias: table, n: scalar_int}
"""


def _variant_args(var, offset=0.25, n=3, grad=False, cu=False):
    if cu:
        cu_t = torch.tensor([0, 9, 24], dtype=torch.int32)
        q, k, v = (torch.randn(24, 4, 64, dtype=torch.bfloat16) for _ in range(3))
        dense = (cu_t, cu_t, 15, 15)
    else:
        q, k, v = (torch.randn(2, 24, 4, 64, dtype=torch.bfloat16, requires_grad=grad)
                   for _ in range(3))  # fmt: skip
        dense = (None, None, 0, 0)
    params = {"slopes": torch.rand(4), "offset": offset, "bias": torch.randn(4, 32), "n": n}
    user = var.user_args(params)
    return (q, k, v, *dense, 0.0, 0.125, True, -1, -1, False, 0.0, None, None, *user)


def _bwd_variant_args(args, out, lse, seed, offset):
    return (torch.randn_like(out), *args[:3], out, lse, seed, offset, *args[3:])


def _no_binding_traffic(s0: dict) -> bool:
    """Whether the binding served nothing since `s0` (no hit, miss or fallback)."""
    s1 = ops.BINDING.stats()
    return all(s1[n] == s0[n] for n in ("hits", "misses", "fallbacks"))


@pytest.mark.parametrize("cu", [False, True])
def test_variant_ops_take_the_python_path_with_the_user_fields(mock, cu):
    """The variant ops are Python custom ops beside the binding's fwd and bwd: the binding
    sees none of their calls, and their structs carry the user fields as the ctypes path
    packs them (ops.user_params)."""
    from flashgen.torch import compile_variant

    var = compile_variant(_VARIANT)
    args = _variant_args(var, cu=cu)
    s0 = ops.BINDING.stats()
    n0 = calls(mock, "fwd")
    out, lse, seed, offset = torch.ops.flashgen.fwd_variant.default(*args)
    assert calls(mock, "fwd") == n0 + 1
    via_op = taken(mock, "fwd")
    py_out, py_lse, *_ = ops._fwd_impl(*args)
    direct = taken(mock, "fwd")
    assert _normalised(via_op, {"o": out, "lse": lse}) == _normalised(
        direct, {"o": py_out, "lse": py_lse}
    )
    assert via_op["user_ptr3"] == args[16 + 4].data_ptr()  # slopes: slot 3 (bias, n, offset, ..)
    assert (via_op["user_i0"], via_op["user_i1"], via_op["user_f2"]) == (32, 3, 0.25)
    bargs = _bwd_variant_args(args, out, lse, seed, offset)
    dq, dk, dv, _ = torch.ops.flashgen.bwd_variant.default(*bargs)
    rec = taken(mock, "bwd")
    assert rec["dq"] == dq.data_ptr() and rec["user_ptr3"] == args[20].data_ptr()
    assert (rec["user_i0"], rec["user_i1"], rec["user_f2"]) == (32, 3, 0.25)
    assert _no_binding_traffic(s0)


def test_variant_calls_leave_the_plain_keys_and_structs_alone(mock):
    from flashgen.torch import compile_variant

    var = compile_variant(_VARIANT)
    args = _variant_args(var)
    plain = args[:16]
    torch.ops.flashgen.fwd.default(*plain)  # a miss: the key's plan
    s0 = ops.BINDING.stats()
    torch.ops.flashgen.fwd_variant.default(*args)  # the same layouts, through Python
    assert _no_binding_traffic(s0)
    again = _variant_args(var, offset=-1.5, n=7)  # other values and tensors, same layouts
    torch.ops.flashgen.fwd_variant.default(*again)
    rec = taken(mock, "fwd")
    assert (rec["user_i1"], rec["user_f2"], rec["user_ptr0"]) == (7, -1.5, again[17].data_ptr())
    torch.ops.flashgen.fwd.default(*plain)
    s1 = ops.BINDING.stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (0, 1)
    rec = taken(mock, "fwd")
    assert not any(v for n, v in rec.items() if n.startswith("user_"))  # the plain call's


def test_variant_values_the_python_path_refuses_are_refused(mock):
    from flashgen.torch import compile_variant

    var = compile_variant(_VARIANT)
    torch.ops.flashgen.fwd_variant.default(*_variant_args(var))
    args = list(_variant_args(var))
    args[16 + 5 + 2] = float("nan")  # offset (slot 2)
    with pytest.raises(UnsupportedCall, match=r"'offset' \(scalar, slot 2\) must be finite"):
        torch.ops.flashgen.fwd_variant.default(*args)
    args = list(_variant_args(var))
    args[16 + 5 + 1] = 2.5  # n (scalar_int, slot 1)
    with pytest.raises(UnsupportedCall, match=r"'n' \(scalar_int, slot 1\) must be an integer"):
        torch.ops.flashgen.fwd_variant.default(*args)
    args = list(_variant_args(var))
    args[16 + 5 + 3] = 1.0  # slot 3 is slopes, a tensor: its number must stay 0
    with pytest.raises(UnsupportedCall, match="user_s3 must be 0.0"):
        torch.ops.flashgen.fwd_variant.default(*args)


def test_opcheck_and_autograd_pass_on_a_variant_call(mock):
    from flashgen.torch import compile_variant

    var = compile_variant(_VARIANT)
    args = _variant_args(var, grad=True)
    torch.library.opcheck(torch.ops.flashgen.fwd_variant.default, args)
    q, k, v = args[:3]
    s0 = ops.BINDING.stats()
    out, *_ = torch.ops.flashgen.fwd_variant.default(*args)
    out.float().sum().backward()
    assert all(t.grad is not None for t in (q, k, v))
    rec = taken(mock, "bwd")
    assert (rec["user_i0"], rec["user_i1"], rec["user_f2"]) == (32, 3, 0.25)
    assert rec["user_ptr3"] == args[20].data_ptr()
    assert _no_binding_traffic(s0)


def test_a_compile_variant_call_with_grad_uses_the_variant_ops(mock):
    """Through compile_variant with the binding on: forward and backward via the Python
    variant ops, the backward checked before the forward (the binding's autograd kernel,
    which does that for fwd, does not see the call)."""
    from flashgen.torch import compile_variant

    var = compile_variant(_VARIANT)
    q, k, v = (torch.randn(2, 24, 4, 64, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    params = {"slopes": torch.rand(4), "offset": 0.5, "bias": torch.randn(4, 32), "n": 2}
    s0 = ops.BINDING.stats()
    var(q, k, v, causal=True, **params).float().sum().backward()
    assert _no_binding_traffic(s0) and all(t.grad is not None for t in (q, k, v))
    assert taken(mock, "bwd")["user_f2"] == 0.5
