"""The host-side shortcuts of `flashgen.torch.ops` without a GPU (skips without torch): the
memoised `_call`, the backward-check memo, `_scalar` and `_stream` give what the plain
computations give, and refused calls are refused every time with the same message."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from flashgen.torch import ops  # noqa: E402
from flashgen.torch.selection import Dtype, Problem, UnsupportedCall  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_memos(monkeypatch):
    monkeypatch.setattr(ops, "_CALLS", {})
    monkeypatch.setattr(ops, "_BACKWARD_OK", set())
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0) if index == 0 else (8, 0))


def _q(index):
    """What `_call` reads of q: its device."""
    return SimpleNamespace(device=SimpleNamespace(index=index))


PB = Problem(2, 8, 2, 100, 100, 64, False, Dtype.BF16)


@pytest.mark.parametrize("index", [0, 1, None])
def test_call_memo_gives_what_the_plain_derivation_gives(monkeypatch, index):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    grid = itertools.product(
        (PB, PB._replace(kv_heads=8), PB._replace(varlen=True), PB._replace(head_dim=128)),
        (0.0, 0.1),
        (False, True),
        ((-1, -1), (-1, 0), (16, 0), (4, 4)),
        (False, True),
    )
    for pb, p, causal, (left, right), det in grid:
        args = (_q(index), pb, p, causal, left, right, det)
        want = ops._make_call(*args)
        assert ops._call(*args) == want
        again = ops._call(*args)
        assert again == want
        if index is not None:
            assert again is ops._call(*args)  # served from the memo
    assert len(ops._CALLS) == (0 if index is None else 4 * 2 * 2 * 4 * 2)


def test_call_memo_keeps_no_refusal():
    for args, match in [
        ((_q(0), PB, 1.0, True, -1, -1, False), "dropout_p"),
        ((_q(0), PB, 0.0, True, -2, 0, False), "window_size"),
        ((_q(0), PB, float("nan"), True, -1, -1, False), "dropout_p"),
    ]:
        for _ in range(2):
            with pytest.raises(UnsupportedCall, match=match):
                ops._call(*args)
    assert not ops._CALLS


def test_call_memo_skips_what_it_cannot_hash_or_must_not_specialise():
    args = (_q(0), PB, 0, True, [3], 0, False)  # an int dropout_p, a list window
    with pytest.raises(UnsupportedCall, match="window_size"):
        ops._call(*args)
    assert ops._call(_q(0), PB, 0, True, -1, -1, False) == ops._make_call(
        _q(0), PB, 0, True, -1, -1, False
    )
    assert not ops._CALLS


def test_capability_follows_the_device_index():
    a, _ = ops._call(_q(0), PB, 0.0, False, -1, -1, False)
    b, _ = ops._call(_q(1), PB, 0.0, False, -1, -1, False)
    assert (a.capability, b.capability) == ((9, 0), (8, 0))


def _tensors(shape=(1, 16, 2, 64), dtype=torch.bfloat16):
    return tuple(torch.zeros(shape, dtype=dtype) for _ in range(3))


def test_backward_key_reads_every_selecting_feature():
    q, k, v = _tensors()
    base = ops._backward_key(q, k, v, None, None, 0.0, True, -1, -1, False)
    assert base is not None
    variants = [
        _tensors(dtype=torch.float16),
        _tensors(shape=(1, 16, 2, 128)),
        (_tensors(shape=(1, 16, 4, 64))[0], k, v),
        (q, *_tensors(shape=(1, 16, 1, 64))[1:]),
    ]
    keys = {ops._backward_key(*t, None, None, 0.0, True, -1, -1, False) for t in variants}
    rest = [
        (0.1, True, -1, -1, False),
        (0.0, False, -1, -1, False),
        (0.0, True, 8, -1, False),
        (0.0, True, -1, 3, False),
        (0.0, True, -1, -1, True),
    ]
    keys |= {ops._backward_key(q, k, v, None, None, *r) for r in rest}
    cu = torch.zeros(2, dtype=torch.int32)
    keys |= {ops._backward_key(q, k, v, cu, cu, 0.0, True, -1, -1, False)}
    keys |= {ops._backward_key(q, k, v, cu, None, 0.0, True, -1, -1, False)}
    assert base not in keys and len(keys) == len(variants) + len(rest) + 2


def test_backward_memo_takes_only_plain_tensors_and_hashable_arguments():
    q, k, v = _tensors()
    p = torch.nn.Parameter(q)
    assert ops._backward_key(p, k, v, None, None, 0.0, True, -1, -1, False) is None
    assert ops._backward_key(torch.zeros(()), k, v, None, None, 0.0, True, -1, -1, False) is None
    assert not ops._backward_known(q, k, v, None, None, 0.0, True, [1], -1, False)
    odd = [(torch.tensor(0.0), True), (0.0, torch.tensor(True))]
    assert all(ops._backward_key(q, k, v, None, None, p, c, -1, -1, False) is None for p, c in odd)
    assert not ops._backward_known(q, k, v, None, None, 0.0, True, -1, -1, False)


def test_check_backward_refuses_every_time_and_remembers_only_what_it_accepts(monkeypatch):
    q, k, v = _tensors()  # CPU tensors: _problem refuses them, before any memo
    for _ in range(2):
        with pytest.raises(UnsupportedCall, match="CUDA devices only"):
            ops.check_backward(q, k, v, None, None, 0, 0, 0.0, True, -1, -1, False)
    assert not ops._BACKWARD_OK
    # With _problem accepting them (as for CUDA tensors), the verdict is backward_spec's.
    monkeypatch.setattr(ops, "_problem", lambda *a: PB)
    monkeypatch.setattr(ops, "_device_index", lambda t: 0)
    monkeypatch.setattr(ops, "_CALLS", {})
    ops.check_backward(q, k, v, None, None, 0, 0, 0.0, True, -1, -1, False)
    assert ops._backward_known(q, k, v, None, None, 0.0, True, -1, -1, False)
    big = _tensors(shape=(1, 16, 2, 144))
    monkeypatch.setattr(ops, "_problem", lambda *a: PB._replace(head_dim=144))
    for _ in range(2):
        with pytest.raises(UnsupportedCall, match="head_dim 144 has no backward"):
            ops.check_backward(*big, None, None, 0, 0, 0.0, True, -1, -1, False)
    assert not ops._backward_known(*big, None, None, 0.0, True, -1, -1, False)
    assert len(ops._BACKWARD_OK) == 1


@pytest.mark.parametrize("value", [0, 1, 4, 2**32 + 7, 2**63 - 1, 2**63, 2**64 - 1, -1])
def test_scalar_is_a_fresh_int64_cpu_tensor_holding_the_u64(value):
    a, b = ops._scalar(value), ops._scalar(value)
    assert a.dtype == torch.int64 and a.dim() == 0 and a.device.type == "cpu"
    assert not a.requires_grad and a is not b and a.data_ptr() != b.data_ptr()
    assert ops._u64(a) == value & (2**64 - 1)
    want = value & (2**64 - 1)
    assert torch.equal(a, torch.tensor(want - 2**64 if want >= 2**63 else want))


def test_stream_prefers_the_raw_current_stream(monkeypatch):
    monkeypatch.setattr(ops, "_raw_stream", lambda index: 1000 + index)
    assert ops._stream(torch.device("cuda", 3)) == 1003
    stream = SimpleNamespace(cuda_stream=7)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    assert ops._stream(torch.device("cuda")) == 7  # no index: the public call
    monkeypatch.setattr(ops, "_raw_stream", None)
    assert ops._stream(torch.device("cuda", 3)) == 7


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """check_problem taking these CPU tensors for CUDA ones (the rest of its checks as they
    are), counting its calls."""
    real, calls = ops.selection.check_problem, []

    def check_problem(q, k, v, *, extra=(), **kw):
        calls.append(1)
        cuda = {"cpu": "cuda"}
        q, k, v = (m._replace(device=cuda.get(m.device, m.device)) for m in (q, k, v))
        extra = [(n, m._replace(device=cuda.get(m.device, m.device)), like) for n, m, like in extra]
        return real(q, k, v, extra=extra, **kw)

    monkeypatch.setattr(ops.selection, "check_problem", check_problem)
    monkeypatch.setattr(ops, "_PROBLEMS", {})
    return calls


def test_problem_memo_gives_what_the_full_check_gives(cpu_as_cuda):
    q, k, v = _tensors((2, 40, 4, 64))
    out = torch.zeros_like(q)
    for extra in ((), (("out", out, "q"), ("dout", out, "q"))):
        want = ops._check_problem(q, k, v, None, None, 0, 0, extra)
        assert ops._problem(q, k, v, None, None, 0, 0, extra) == want
        assert ops._problem(q, k, v, None, None, 7, 9, extra) is ops._problem(
            q, k, v, None, None, 0, 0, extra
        )
    assert len(ops._PROBLEMS) == 2 and len(cpu_as_cuda) == 4  # two full checks, two misses
    gqa = (q, *_tensors((2, 40, 2, 64))[1:])
    assert ops._problem(*gqa, None, None, 0, 0).kv_heads == 2
    half = _tensors((2, 40, 4, 64), dtype=torch.float16)
    assert ops._problem(*half, None, None, 0, 0).dtype is Dtype.FP16


def test_problem_memo_keeps_no_refusal_and_reads_every_layout(cpu_as_cuda):
    q, k, v = _tensors((2, 40, 4, 64))
    ops._problem(q, k, v, None, None, 0, 0)
    wide = torch.zeros(2, 40, 4, 68, dtype=torch.bfloat16)[..., :64]  # strides not multiples of 8
    cases = [
        ((q, k[:1], v[:1]), "batch"),
        ((q, k, v[..., :32]), "same shape"),
        ((wide, k, v), "multiple of 8"),
        ((q, k.float(), v), "dtype"),
        ((q[0], k[0], v[0]), "dimensions"),
    ]
    for tensors, match in cases:
        for _ in range(2):
            with pytest.raises(UnsupportedCall, match=match):
                ops._problem(*tensors, None, None, 0, 0)
    bad_out = (("out", torch.zeros(2, 41, 4, 64, dtype=torch.bfloat16), "q"),)
    with pytest.raises(UnsupportedCall, match="out has shape"):
        ops._problem(q, k, v, None, None, 0, 0, bad_out)
    assert len(ops._PROBLEMS) == 1


def test_problem_memo_skips_varlen_and_subclassed_tensors(cpu_as_cuda):
    q, k, v = _tensors((70, 4, 64))
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    with pytest.raises(UnsupportedCall, match="cu_seqlens_q must be"):  # CPU cu_seqlens
        ops._problem(q, k, v, cu, cu, 40, 40)
    dense = _tensors()
    ops._problem(torch.nn.Parameter(dense[0]), *dense[1:], None, None, 0, 0)
    assert not ops._PROBLEMS
