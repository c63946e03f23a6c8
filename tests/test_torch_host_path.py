"""The host-side shortcuts of `flashgen.torch.ops` without a GPU (skips without torch): the
memoised `_call`, the backward-check memo, the score-feature memo, `_scalar` and `_stream`
give what the plain computations give, and refused calls are refused every time with the same
message. With a mocked CUDA (CPU tensors described as CUDA ones, a fake kernel library that
records its launch parameters), the ops' host paths for softcap, ALiBi and sinks: the fields
they launch with, the sink's gradient through autograd, refusals before any launch."""

from __future__ import annotations

import contextlib
import itertools
import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from flashgen.generator.features import FEATURES  # noqa: E402
from flashgen.generator.spec import KernelKind  # noqa: E402
from flashgen.torch import cache, kvcache, ops  # noqa: E402
from flashgen.torch.selection import (  # noqa: E402
    NO_FEATURES,
    Dtype,
    Problem,
    UnsupportedCall,
)

EVERY = frozenset(f.name for f in FEATURES)
BACKWARD = KernelKind.BACKWARD


@pytest.fixture(autouse=True)
def fresh_memos(monkeypatch):
    monkeypatch.setattr(ops, "_CALLS", {})
    monkeypatch.setattr(ops, "_BACKWARD_OK", set())
    monkeypatch.setattr(ops, "_SCORES", {})
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
    # a head dim no backward family of the (9, 0) device serves, asked of the families
    d = next(d for d in range(1, 257) if not ops.selection.head_dim_served(BACKWARD, (9, 0), d))
    big = _tensors(shape=(1, 16, 2, d))
    monkeypatch.setattr(ops, "_problem", lambda *a: PB._replace(head_dim=d))
    for _ in range(2):
        with pytest.raises(UnsupportedCall, match=f"head_dim {d} has no backward"):
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
        ((q, k, v[:, :20]), "same shape"),
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


# -- score-stage features ----------------------------------------------------------------------


def test_call_memo_keys_on_the_features():
    args = (_q(0), PB, 0.0, True, -1, -1, False)
    plain = ops._call(*args)
    assert plain[0].features == NO_FEATURES and ops._call(*args, NO_FEATURES) is plain
    seen = {plain[0]}
    for n in range(1, len(FEATURES) + 1):
        for combo in itertools.combinations([f.name for f in FEATURES], n):
            feats = frozenset(combo)
            got = ops._call(*args, feats)
            assert got == ops._make_call(*args, feats) and got[0].features == feats
            assert ops._call(*args, feats) is got
            seen.add(got[0])
    assert len(seen) == 2 ** len(FEATURES) == len(ops._CALLS)


@pytest.fixture
def as_cuda(monkeypatch):
    """ops._meta describing CPU tensors as CUDA ones (every other check as it is); counts
    selection.score_features' calls."""
    real_meta, real_score, calls = ops._meta, ops.selection.score_features, []

    def meta(t, device=None):
        m = real_meta(t, device)
        return m._replace(device="cuda") if m.device == "cpu" else m

    def score_features(*a, **kw):
        calls.append(1)
        return real_score(*a, **kw)

    monkeypatch.setattr(ops, "_meta", meta)
    monkeypatch.setattr(kvcache, "_meta", meta)
    monkeypatch.setattr(ops.selection, "score_features", score_features)
    monkeypatch.setattr(ops, "_PROBLEMS", {})
    return calls


def _q4(b=2, s=16, h=4, d=64, grad=False):
    return torch.zeros(b, s, h, d, dtype=torch.bfloat16, requires_grad=grad)


def test_score_features_fast_path_does_no_work(as_cuda):
    q = _q4()
    for _ in range(3):
        assert ops.score_features(q, 2, 4, 0.0, None, None) is NO_FEATURES
    assert not as_cuda and not ops._SCORES  # neither selection nor the memo was asked


def test_score_features_memo_gives_what_the_full_check_gives(as_cuda):
    q = _q4()
    slopes, rows, sink = torch.rand(4), torch.rand(2, 4), torch.zeros(4)
    cases = [
        ((30.0, None, None), {"softcap"}),
        ((0.0, slopes, None), {"alibi"}),
        ((0.0, rows, None), {"alibi"}),
        ((0.0, None, sink), {"sink"}),
        ((30.0, rows, sink), EVERY),
    ]
    for args, want in cases:
        first = ops.score_features(q, 2, 4, *args)
        assert first == want
        assert ops.score_features(q, 2, 4, *args) is first  # served from the memo
        assert ops.score_features(q, 2, 4, *(a.clone() if torch.is_tensor(a) else a
                                              for a in args)) is first  # fmt: skip
    assert len(as_cuda) == len(cases) == len(ops._SCORES)
    # the batch and heads are part of the key: (2, 4) slopes are wrong for a batch of 3
    with pytest.raises(UnsupportedCall, match=r"alibi_slopes has shape \(2, 4\)"):
        ops.score_features(q, 3, 4, 0.0, rows, None)


def test_score_features_memo_keeps_no_refusal(as_cuda):
    q = _q4()
    bad = [
        ((-1.0, None, None), r"softcap=-1.0"),
        ((math.nan, None, None), r"softcap=nan"),
        ((0.0, torch.rand(4).half(), None), r"alibi_slopes has dtype float16"),
        ((0.0, torch.rand(5), None), r"alibi_slopes has shape \(5,\)"),
        ((0.0, None, torch.zeros(2, 4)), r"learnable_sink has shape \(2, 4\)"),
        ((0.0, None, torch.zeros(4, dtype=torch.float64)), r"learnable_sink has dtype float64"),
        ((0.0, None, torch.zeros(4, device="meta")), r"learnable_sink is on device meta but q"),
        ((0.0, torch.rand(4, device="meta"), None), r"alibi_slopes is on device meta but q"),
    ]
    for args, match in bad:
        for _ in range(2):
            with pytest.raises(UnsupportedCall, match=match):
                ops.score_features(q, 2, 4, *args)
    assert not ops._SCORES


def test_score_features_of_subclasses_and_symbolic_values_take_the_full_check(as_cuda):
    q = _q4()
    sink = torch.nn.Parameter(torch.zeros(4))
    assert ops.score_features(q, 2, 4, 0.0, None, sink) == {"sink"}
    assert ops.score_features(q, 2, 4, 0.0, None, sink) == {"sink"}
    assert len(as_cuda) == 2 and not ops._SCORES


def test_score_params_are_the_feature_rows_fields():
    slopes, rows, sink = torch.rand(4), torch.rand(3, 4), torch.zeros(4)
    assert ops.score_params(NO_FEATURES, 0.0, None, None) == {}
    assert ops.score_params(frozenset({"softcap"}), 30, None, None) == {"softcap": 30.0}
    assert ops.score_params(frozenset({"alibi"}), 0.0, slopes, None) == {
        "alibi_slopes": slopes.data_ptr(),
        "alibi_batch_stride": 0,
    }
    assert ops.score_params(frozenset({"alibi"}), 0.0, rows, None)["alibi_batch_stride"] == 4
    wide = torch.rand(3, 16)[:, :4]  # rows 16 floats apart
    assert ops.score_params(frozenset({"alibi"}), 0.0, wide, None)["alibi_batch_stride"] == 16
    one = torch.rand(1, 4)
    assert ops.score_params(frozenset({"alibi"}), 0.0, one, None)["alibi_batch_stride"] == 0
    got = ops.score_params(EVERY, 2.5, rows, sink)
    assert got == {"softcap": 2.5, "alibi_slopes": rows.data_ptr(), "alibi_batch_stride": 4,
                   "sinks": sink.data_ptr()}  # fmt: skip
    # every field is one of the features' parameter rows
    rows_named = {r.name for f in FEATURES for r in f.params}
    assert set(got) <= rows_named and rows_named - set(got) == {"dsinks"}


def test_rows_without_keys_get_the_sink_as_lse():
    lse = torch.empty(2, 3, 5)
    assert torch.all(ops._empty_lse(lse, None) == -math.inf)
    sink = torch.tensor([0.5, -1.0, 2.0])
    ops._empty_lse(lse, sink)
    assert torch.equal(lse, sink[None, :, None].expand(2, 3, 5))
    packed = torch.empty(3, 7)  # varlen: (heads, total_q)
    assert torch.equal(ops._empty_lse(packed, sink), sink[:, None].expand(3, 7))


def test_backward_key_reads_the_score_arguments():
    q, k, v = _tensors()
    rest = (None, None, 0.0, True, -1, -1, False)
    base = ops._backward_key(q, k, v, *rest)
    assert base == ops._backward_key(q, k, v, *rest, 0.0, None, None)
    sink, slopes = torch.zeros(2), torch.rand(2)
    keys = {
        ops._backward_key(q, k, v, *rest, 30.0, None, None),
        ops._backward_key(q, k, v, *rest, 0.0, slopes, None),
        ops._backward_key(q, k, v, *rest, 0.0, None, sink),
        ops._backward_key(q, k, v, *rest, 30.0, slopes, sink),
    }
    assert base not in keys and len(keys) == 4
    assert ops._backward_key(q, k, v, *rest, torch.tensor(3.0), None, None) is None


# -- the ops' host paths with a mocked CUDA ------------------------------------------------------


class FakeLibrary:
    """A kernel library that records its launches (the kernel never runs: outputs stay as
    torch.empty made them)."""

    def __init__(self, spec, launches):
        self.spec, self.launches, self.name = spec, launches, "fake"

    def launch(self, params, stream=0):
        self.launches.append((self.spec, dict(params)))

    def workspace_bytes(self, params):
        return 1 << 22


@pytest.fixture
def fake_cuda(monkeypatch, as_cuda):
    """CPU tensors taken for CUDA ones on a (9, 0) device 0; launches recorded."""
    launches = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cache, "kernel_library", lambda spec: FakeLibrary(spec, launches))
    monkeypatch.setattr(ops, "_stream", lambda device: 0)
    monkeypatch.setattr(ops, "_OnDevice", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kvcache, "_library", lambda spec: FakeLibrary(spec, launches))
    monkeypatch.setattr(kvcache, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    stream = SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return launches


SCORE_FIELDS = {r.name for f in FEATURES for r in f.params}


def test_plain_calls_launch_without_score_fields(fake_cuda):
    from flashgen.torch import flash_attn_func

    q, k, v = (_q4(grad=True) for _ in range(3))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert [s.kernel.yaml for s, _ in fake_cuda] == ["forward", "backward"]
    for spec, params in fake_cuda:
        assert spec.features == NO_FEATURES and not SCORE_FIELDS & set(params)
    assert not ops._SCORES


def test_every_feature_launches_its_fields_and_the_sink_gets_its_gradient(fake_cuda):
    from flashgen.torch import flash_attn_func

    q, k, v = (_q4(grad=True) for _ in range(3))
    slopes = torch.rand(2, 4)
    sink = torch.zeros(4, requires_grad=True)
    out = flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 30.0, slopes, learnable_sink=sink)
    dq, dk, dv, dsink = torch.autograd.grad(out.sum(), (q, k, v, sink))
    assert dsink.shape == (4,) and dsink.dtype == torch.float32 and dq.shape == q.shape
    (fs, fp), (bs, bp) = fake_cuda
    assert (fs.kernel.yaml, bs.kernel.yaml) == ("forward", "backward")
    assert fs.features == bs.features == EVERY
    for params in (fp, bp):
        assert params["softcap"] == 30.0 and params["alibi_slopes"] == slopes.data_ptr()
        assert params["alibi_batch_stride"] == 4 and params["sinks"] == sink.data_ptr()
    assert "dsinks" not in fp and bp["dsinks"] == dsink.data_ptr()


def test_the_sink_alone_may_require_grad(fake_cuda):
    from flashgen.torch import flash_attn_func

    q, k, v = (_q4() for _ in range(3))
    sink = torch.zeros(4, requires_grad=True)
    out = flash_attn_func(q, k, v, learnable_sink=sink)
    assert out.requires_grad
    out.sum().backward()
    assert sink.grad is not None and sink.grad.shape == (4,)
    assert [s.kernel.yaml for s, _ in fake_cuda] == ["forward", "backward"]


def test_slopes_and_softcap_get_no_gradient(fake_cuda):
    from flashgen.torch import flash_attn_func

    q = _q4(grad=True)
    k, v = _q4(), _q4()
    slopes = torch.rand(4, requires_grad=True)
    out = flash_attn_func(q, k, v, softcap=5.0, alibi_slopes=slopes)
    out.sum().backward()
    assert q.grad is not None and slopes.grad is None
    assert "dsinks" not in fake_cuda[1][1]


def test_varlen_takes_one_slope_row_per_sequence(fake_cuda):
    from flashgen.torch import flash_attn_varlen_func

    q, k, v = (torch.zeros(40, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
    slopes = torch.rand(3, 4)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu, cu, 15, 15, alibi_slopes=slopes, learnable_sink=torch.zeros(4),
        return_attn_probs=True,
    )  # fmt: skip
    assert out.shape == q.shape and lse.shape == (4, 40)
    spec, params = fake_cuda[0]
    assert spec.mask.varlen and spec.features == {"alibi", "sink"}
    assert params["alibi_batch_stride"] == 4 and params["batch"] == 3
    with pytest.raises(UnsupportedCall, match=r"alibi_slopes has shape \(2, 4\)"):
        flash_attn_varlen_func(q, k, v, cu, cu, 15, 15, alibi_slopes=torch.rand(2, 4))


def test_no_key_anywhere_gives_the_sink_as_lse_and_zero_gradients(fake_cuda):
    from flashgen.torch import flash_attn_func

    q = torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(1, 0, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sink = torch.tensor([0.25, -3.0], requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert torch.all(out == 0) and torch.equal(lse, sink.detach()[None, :, None].expand(1, 2, 5))
    (dsink,) = torch.autograd.grad(out.sum(), (sink,))
    assert torch.equal(dsink, torch.zeros(2)) and not fake_cuda  # no kernel was launched


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"softcap": -0.5}, r"softcap=-0.5: allowed 0.0 \(off\) or a finite c > 0"),
        ({"softcap": math.inf}, r"softcap=inf"),
        ({"softcap": "big"}, r"softcap must be a float"),
        ({"softcap": None}, r"softcap must be a float"),
        ({"alibi_slopes": torch.rand(4, dtype=torch.float64)}, r"alibi_slopes has dtype float64"),
        ({"alibi_slopes": torch.rand(3, 4)}, r"alibi_slopes has shape \(3, 4\); it must be"),
        ({"alibi_slopes": [1.0] * 4}, r"alibi_slopes must be a float32 tensor .* got list"),
        ({"alibi_slopes": torch.rand(4, device="meta")}, r"alibi_slopes is on device meta"),
        ({"learnable_sink": torch.zeros(2, 4)}, r"learnable_sink has shape \(2, 4\)"),
        ({"learnable_sink": torch.zeros(4).half()}, r"learnable_sink has dtype float16"),
        ({"learnable_sink": 1.0}, r"learnable_sink must be a float32 tensor .* got float"),
    ],
)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_bad_score_arguments_are_refused_before_any_launch(fake_cuda, kwargs, match, grad):
    from flashgen.torch import flash_attn_func

    q, k, v = (_q4(grad=grad) for _ in range(3))
    for _ in range(2):
        with pytest.raises(UnsupportedCall, match=match):
            flash_attn_func(q, k, v, **kwargs)
    assert not fake_cuda and not ops._SCORES and not ops._BACKWARD_OK


def test_the_decode_op_launches_the_score_fields(fake_cuda):
    from flashgen.torch import flash_attn_with_kvcache

    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    cache_k = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    lens = torch.tensor([10, 64], dtype=torch.int32)
    slopes, sink = torch.rand(2, 8), torch.zeros(8)
    flash_attn_with_kvcache(q, cache_k, cache_k, cache_seqlens=lens, softcap=20.0,
                           alibi_slopes=slopes, learnable_sink=sink)  # fmt: skip
    flash_attn_with_kvcache(q, cache_k, cache_k, cache_seqlens=lens)
    (spec, params), (plain, plain_params) = fake_cuda
    assert spec.kernel.yaml == "decode" and spec.features == EVERY
    assert params["softcap"] == 20.0 and params["alibi_batch_stride"] == 8
    assert params["alibi_slopes"] == slopes.data_ptr() and params["sinks"] == sink.data_ptr()
    assert plain.features == NO_FEATURES and not SCORE_FIELDS & set(plain_params)
    for kwargs, match in [
        ({"softcap": float("nan")}, r"softcap=nan"),
        ({"alibi_slopes": torch.rand(8).half()}, r"alibi_slopes has dtype float16"),
        ({"alibi_slopes": torch.rand(2)}, r"alibi_slopes has shape \(2,\)"),
        ({"learnable_sink": torch.zeros(2)}, r"learnable_sink has shape \(2,\)"),
    ]:
        with pytest.raises(UnsupportedCall, match=match):
            flash_attn_with_kvcache(q, cache_k, cache_k, cache_seqlens=lens, **kwargs)
    assert len(fake_cuda) == 2


def test_an_empty_cache_gives_the_sink_as_lse(fake_cuda):
    from flashgen.torch import flash_attn_with_kvcache

    q = torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16)
    empty = torch.zeros(2, 0, 2, 64, dtype=torch.bfloat16)
    sink = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out, lse = flash_attn_with_kvcache(q, empty, empty, cache_seqlens=0, learnable_sink=sink,
                                       return_softmax_lse=True)  # fmt: skip
    assert torch.all(out == 0) and torch.equal(lse, sink[None, :, None].expand(2, 4, 3))
    assert not fake_cuda
