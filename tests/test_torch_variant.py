"""flashgen.torch.compile_variant without a GPU (skips without torch).

The kernels are the mocks of `flashgen.bench.mock_kernels` (their launchers keep a copy of the
parameter struct they are given), CPU tensors are described as CUDA ones on a (9, 0) device:
the launch struct's user slots must be what `verify.runner` packs for the same parameters,
slot for slot, forward and backward; refusals name what is wrong and what is allowed; the
kernels go through the kernel cache once; autograd, torch.compile(fullgraph=True) and opcheck
see ordinary ops. The binding's fast path is held to the Python path's structs by
tests/torch_binding_cases.py; the GPU side is tests/gpu/test_torch_variant.py.
"""

from __future__ import annotations

import ctypes
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashgen.bench import mock_kernels  # noqa: E402
from flashgen.bench.mock_kernels import MockLibrary  # noqa: E402
from flashgen.generator.families import family  # noqa: E402
from flashgen.generator.naming import kernel_name  # noqa: E402
from flashgen.generator.spec import KernelKind, SpecError  # noqa: E402
from flashgen.runtime.library import params_struct  # noqa: E402
from flashgen.torch import cache, compile_variant, interface, ops  # noqa: E402
from flashgen.torch.selection import UnsupportedCall  # noqa: E402

REAL_KERNEL_LIBRARY = cache.kernel_library

BIAS = """
kernel: [forward, backward]
dtype: bf16
head_dim: [64, 128]
score_mod: "s - slopes[h] * abs(i - j) + offset + bias[h, min(abs(i - j) // 8, 31)] * scale_b[b]"
params: {slopes: per_head, offset: scalar, bias: table, scale_b: per_batch}
"""
# every kind with a slot reading: scalar_int and per_batch_int beside the others
INTS = """
kernel: [forward, backward]
dtype: [bf16, fp16]
head_dim: 64
score_mod: "s + where(j < prefix[b], 1.0, 0.0) + window * 0.5"
params: {prefix: per_batch_int, window: scalar_int}
"""
ALIBI = """
kernel: [forward, backward]
dtype: bf16
head_dim: 64
score_mod: "s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)"
params: {slopes: per_head}
"""


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    return mock_kernels.build(tmp_path_factory.mktemp("mock"))


@pytest.fixture(autouse=True)
def cuda_mocked(monkeypatch, mock):
    mock_kernels.mock_cuda(monkeypatch.setattr, mock)
    monkeypatch.setattr(interface, "_on_cuda", lambda t: True)


def taken(mock, kind: str) -> dict:
    fam = family(KernelKind.BACKWARD if kind == "bwd" else KernelKind.FORWARD)
    buf = params_struct(fam)()
    getattr(mock, f"take_{kind}")(ctypes.byref(buf))
    return {p.name: getattr(buf, p.name) for p in fam.params}


def _qkv(batch=2, sq=24, heads=4, d=64, dtype=torch.bfloat16, grad=False):
    return tuple(
        torch.randn(batch, sq, heads, d, dtype=dtype, requires_grad=grad) for _ in range(3)
    )


def _bias_params(batch=2, heads=4, cols=32):
    return {
        "slopes": torch.rand(heads),
        "offset": 0.25,
        "bias": torch.randn(heads, cols),
        "scale_b": torch.rand(batch),
    }


# -- the user slots are the runner's ---------------------------------------------------------


class _FakeBuffer:
    """verify.runner.DeviceBuffer without a GPU: keeps what is uploaded."""

    def __init__(self, gpu, nbytes):
        self.ptr, self.host = 1, None

    def upload(self, host):
        self.host = np.array(host)


def _runner_fields(monkeypatch, mod, values: dict, batch: int, heads: int):
    """verify.runner's user fields for these values, and the host arrays it uploads per
    pointer field."""
    from flashgen.verify import runner
    from flashgen.verify.score_mods import ScoreArgs, check_user_params

    monkeypatch.setattr(runner, "DeviceBuffer", _FakeBuffer)
    host = {n: (v.numpy() if isinstance(v, torch.Tensor) else v) for n, v in values.items()}
    held = check_user_params(mod, host, batch=batch, heads=heads)
    bufs: list = []
    fields = runner.user_slot_params(None, ScoreArgs(score_mod=mod, score_params=held), bufs)
    uploads = {}
    it = iter(bufs)
    for k in range(4):
        if f"user_ptr{k}" in fields:
            uploads[f"user_ptr{k}"] = next(it).host
    return fields, uploads


def _check_slots(rec: dict, fields: dict, uploads: dict, values: dict, mod) -> None:
    user = {n: v for n, v in rec.items() if n.startswith("user_")}
    assert {n for n, v in user.items() if v} == {n for n, v in fields.items() if v}
    for name, want in fields.items():
        if name.startswith("user_ptr"):
            k = int(name[-1])
            t = values[mod.params[k][0]]
            assert rec[name] == t.data_ptr()
            assert np.array_equal(t.numpy(), uploads[name]), name  # the same data, same dtype
            assert t.numpy().dtype == uploads[name].dtype
        else:
            assert rec[name] == want, name


@pytest.mark.parametrize("spec,d", [(BIAS, 64), (BIAS, 128), (INTS, 64)])
def test_the_user_slots_are_the_runners_forward_and_backward(mock, monkeypatch, spec, d):
    var = compile_variant(spec)
    batch, heads = 2, 4
    if spec is INTS:
        values = {"prefix": torch.tensor([3, 7], dtype=torch.int32), "window": 5}
    else:
        values = _bias_params(batch, heads)
    q, k, v = _qkv(batch, 24, heads, d, grad=True)
    out = var(q, k, v, causal=True, **values)
    out.float().sum().backward()
    fields, uploads = _runner_fields(monkeypatch, var.score_mod, values, batch, heads)
    for kind in ("fwd", "bwd"):
        _check_slots(taken(mock, kind), fields, uploads, values, var.score_mod)
    assert all(t.grad is not None for t in (q, k, v))


def test_the_variant_reaches_the_kernel_selected_for_the_call(monkeypatch):
    specs = []
    real = cache.kernel_library
    monkeypatch.setattr(cache, "kernel_library", lambda spec: specs.append(spec) or real(spec))
    var = compile_variant(ALIBI)
    q, k, v = _qkv(grad=True)
    var(q, k, v, causal=True, slopes=torch.rand(4)).float().sum().backward()
    assert [s.kernel for s in specs] == [KernelKind.FORWARD, KernelKind.BACKWARD]
    assert all(s.score_mod == var.score_mod for s in specs)
    assert all(f"_um{var.score_mod.digest()}_" in kernel_name(s) for s in specs)
    assert {s.target.yaml for s in specs} == {"sm_90a"}  # what flash_attn_func gets on (9, 0)
    specs.clear()
    monkeypatch.setattr(ops, "philox_state", lambda device, p: (1, 2))
    var(q, k, v, dropout_p=0.1, slopes=torch.rand(4)).float().sum().backward()
    assert [s.target.yaml for s in specs] == ["sm_90a", "sm_90"]  # as flash_attn_func's


def test_varlen_takes_per_batch_parameters_per_sequence(mock):
    var = compile_variant(BIAS)
    lens = [5, 19]
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    q, k, v = (torch.randn(24, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    values = _bias_params(batch=len(lens))
    var.varlen(q, k, v, cu, cu, 19, 19, causal=True, **values)
    rec = taken(mock, "fwd")
    assert rec["user_ptr2"] == values["scale_b"].data_ptr() and rec["batch"] == 2
    with pytest.raises(UnsupportedCall, match=r"'scale_b' \(per_batch, slot 2\) has shape \(3,\)"):
        var.varlen(q, k, v, cu, cu, 19, 19, **{**values, "scale_b": torch.rand(3)})


def test_calls_without_a_variant_pass_no_user_argument(mock):
    q, k, v = _qkv()
    interface._attention(q, k, v, None, None, 0, 0, 0.0, None, True, (-1, -1), 0.0, None,
                         False, False, None)  # fmt: skip
    rec = taken(mock, "fwd")
    assert not any(v for n, v in rec.items() if n.startswith("user_"))


# -- refusals ---------------------------------------------------------------------------------


_FWD = "kernel: forward\ndtype: bf16\nhead_dim: 64\n"
_DECODE = "kernel: decode\ndtype: bf16\nhead_dim: 128\nmask: {causal: bottom_right}\n"


@pytest.mark.parametrize(
    "text,error,match",
    [
        (_FWD, UnsupportedCall, "has no score_mod.*flash_attn_func"),
        (_FWD + 'score_mod: "s +* 2"\n', SpecError, "score_mod"),
        (_FWD + 'score_mod: "s + slopes[h]"\n', SpecError, "slopes"),
        (_FWD + 'score_mod: "s"\nsoftcap: true\n', SpecError, "softcap"),
        (_DECODE + 'score_mod: "s * 2.0"\n', UnsupportedCall, "decode takes no variant"),
        (_FWD + 'score_mod: ["s * 2.0", "s * 3.0"]\n', UnsupportedCall, "one variant per spec"),
        (_FWD + 'score_mod: "s * causal"\nparams: {causal: scalar}\n', UnsupportedCall,
         "name of an argument of the call"),
        ("no_such_field: 1\n", SpecError, "no_such_field"),
    ],
)  # fmt: skip
def test_specs_it_cannot_build_are_refused(text, error, match):
    with pytest.raises(error, match=match):
        compile_variant(text)


def test_a_spec_file_is_read_and_a_missing_one_refused(tmp_path):
    path = tmp_path / "alibi.yaml"
    path.write_text(ALIBI)
    assert compile_variant(str(path)).params == compile_variant(path).params
    with pytest.raises(SpecError, match="no such spec file"):
        compile_variant(str(tmp_path / "missing.yaml"))
    with pytest.raises(TypeError):
        compile_variant(3)


def test_parameters_are_checked_by_name_kind_and_shape():
    var = compile_variant(BIAS)
    q, k, v = _qkv()
    good = _bias_params()
    cases = [
        ({k_: v_ for k_, v_ in good.items() if k_ != "offset"}, "missing offset"),
        ({**good, "slope": 1.0}, "unknown slope"),
        ({**good, "slopes": torch.rand(5)}, r"'slopes' \(per_head, slot 3\) has shape \(5,\)"),
        ({**good, "slopes": torch.rand(4, dtype=torch.float64)}, "float32"),
        ({**good, "slopes": torch.rand(8)[::2]}, "contiguous"),
        ({**good, "slopes": 1.0}, r"slopes= \(per_head\) must be a float32 tensor \(heads,\)"),
        ({**good, "offset": torch.tensor(1.0)}, "Python number, not a tensor"),
        ({**good, "offset": float("nan")}, "finite"),
        ({**good, "bias": torch.randn(4, 0)}, r"\(heads, columns\) = \(4, columns >= 1\)"),
        ({**good, "bias": torch.randn(32, 4).t()}, "contiguous"),
        ({**good, "scale_b": torch.rand(2, dtype=torch.float16)}, "float32"),
    ]
    for params, match in cases:
        with pytest.raises(UnsupportedCall, match=match):
            var(q, k, v, **params)
    ints = compile_variant(INTS)
    with pytest.raises(UnsupportedCall, match="int32"):
        ints(q, k, v, prefix=torch.tensor([1, 2]), window=3)
    with pytest.raises(UnsupportedCall, match="must be an integer"):
        ints(q, k, v, prefix=torch.tensor([1, 2], dtype=torch.int32), window=2.5)


def test_dtypes_head_dims_and_kernels_the_spec_does_not_declare_are_refused():
    var = compile_variant(ALIBI)
    slopes = torch.rand(4)
    with pytest.raises(UnsupportedCall, match="dtype float16.*declares bfloat16"):
        var(*_qkv(dtype=torch.float16), slopes=slopes)
    with pytest.raises(UnsupportedCall, match="head_dim 128.*declares head_dim 64"):
        var(*_qkv(d=128), slopes=slopes)
    fwd_only = compile_variant(ALIBI.replace("[forward, backward]", "forward"))
    with pytest.raises(UnsupportedCall, match="no backward kernel"):
        fwd_only(*_qkv(grad=True), slopes=slopes)
    with torch.no_grad():
        fwd_only(*_qkv(grad=True), slopes=slopes)
    with pytest.raises(UnsupportedCall, match="softcap= is not taken by a variant"):
        var(*_qkv(), 0.0, None, False, (-1, -1), 30.0, slopes=slopes)  # flash_attn_func's place
    with pytest.raises(UnsupportedCall, match="alibi_slopes= is not taken"):
        var(*_qkv(), alibi_slopes=slopes, slopes=slopes)


def test_the_variant_ops_refuse_user_arguments_without_a_variant_and_bad_keys():
    q, k, v = _qkv()
    base = (q, k, v, None, None, 0, 0, 0.0, 0.125, False, -1, -1, False, 0.0, None, None)
    with pytest.raises(UnsupportedCall, match="score_mod is ''"):
        torch.ops.flashgen.fwd_variant.default(*base, "", torch.rand(4))
    with pytest.raises(UnsupportedCall, match="score_mod is ''"):
        torch.ops.flashgen.fwd_variant.default(*base, "", None, None, None, None, 1.0)
    with pytest.raises(UnsupportedCall, match="not a variant key"):
        torch.ops.flashgen.fwd_variant.default(*base, "s * 2")
    key = compile_variant(ALIBI).key
    with pytest.raises(UnsupportedCall, match="user slot 1 is set.*slopes \\(slot 0\\)"):
        torch.ops.flashgen.fwd_variant.default(*base, key, torch.rand(4), torch.rand(4))
    bad = key.replace("abs(", "abz(")
    with pytest.raises(UnsupportedCall, match="abz"):
        torch.ops.flashgen.fwd_variant.default(*base, bad, torch.rand(4))


def test_the_plain_ops_take_no_user_arguments():
    """fwd and bwd keep their 16 and 21 arguments (every flash_attn_func call goes through
    them, and the custom-op wrapper's cost grows with the argument count); the user
    arguments are the variant ops' alone."""
    for name, n in (("fwd", 16), ("bwd", 21)):
        plain = getattr(torch.ops.flashgen, name).default._schema.arguments
        variant = getattr(torch.ops.flashgen, f"{name}_variant").default._schema.arguments
        assert len(plain) == n and [a.name for a in variant[n:]] == list(ops.USER_ARGS)

        def sig(args):
            return [(a.name, str(a.type), a.default_value) for a in args]

        assert sig(variant[:n]) == sig(plain)
    q, k, v = _qkv()
    base = (q, k, v, None, None, 0, 0, 0.0, 0.125, False, -1, -1, False, 0.0, None, None)
    with pytest.raises(RuntimeError, match="expected at most 16 argument"):
        torch.ops.flashgen.fwd.default(*base, "")


def test_a_variant_call_uses_the_variant_ops_and_a_plain_call_the_plain_ones(mock):
    from flashgen.torch import flash_attn_func
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "flashgen":
                self.seen.append((func.__name__, len(args)))
            return func(*args, **(kwargs or {}))

    var = compile_variant(ALIBI)
    for call, want in (
        (lambda q, k, v: var(q, k, v, causal=True, slopes=torch.rand(4)), "_variant"),
        (lambda q, k, v: flash_attn_func(q, k, v, causal=True), ""),
    ):
        q, k, v = _qkv(grad=True)
        with Ops() as mode:
            call(q, k, v).float().sum().backward()
        names = [n for n, _ in mode.seen]
        assert names == [f"fwd{want}.default", f"bwd{want}.default"], mode.seen


# -- the kernel cache -------------------------------------------------------------------------


def test_the_kernels_compile_once_into_the_cache(monkeypatch, tmp_path, mock):
    """First use compiles the forward and the backward into the cache; later calls, and a
    process that forgot its loaded libraries, compile nothing; a failed compile leaves no
    library behind."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASHGEN_BUILD_DIR", str(tmp_path / "build"))
    compiled = []

    def compiler(specs, where, jobs=1, progress=False):
        class Result:
            ok, spills, error = True, False, ""

        for spec in specs:
            compiled.append(spec)
            (where / f"{kernel_name(spec)}.so").write_bytes(b"mock")
        return [Result()]

    monkeypatch.setattr(cache, "kernel_library", REAL_KERNEL_LIBRARY)
    monkeypatch.setattr(cache, "_LIBRARIES", {})
    monkeypatch.setattr(cache, "_default_compiler", lambda: compiler)
    monkeypatch.setattr(cache, "KernelLibrary", lambda spec, where: MockLibrary(spec, mock))
    monkeypatch.setattr("sys.stderr", io.StringIO())
    var = compile_variant(ALIBI)
    slopes = torch.rand(4)
    for _ in range(2):
        q, k, v = _qkv(grad=True)
        var(q, k, v, causal=True, slopes=slopes).float().sum().backward()
    assert [s.kernel for s in compiled] == [KernelKind.FORWARD, KernelKind.BACKWARD]
    cache.clear()
    q, k, v = _qkv(grad=True)
    var(q, k, v, causal=True, slopes=slopes).float().sum().backward()
    assert len(compiled) == 2
    names = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".so")
    assert names == sorted(f"{kernel_name(s)}.so" for s in compiled)

    def failing(specs, where, jobs=1, progress=False):
        (where / f"{kernel_name(specs[0])}.so").write_bytes(b"half")

        class Result:
            ok, spills, error = False, False, "ptxas: error"

        return [Result()]

    monkeypatch.setattr(cache, "_default_compiler", lambda: failing)
    other = compile_variant(ALIBI.replace("abs(", "2.0 * abs("))
    with pytest.raises(cache.CompileFailed, match="ptxas: error"):
        other(*_qkv(), slopes=slopes)
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert not any(other.score_mod.digest() in n and not n.endswith(".lock") for n in left)


# -- autograd, torch.compile, opcheck ------------------------------------------------------------


def test_gradients_flow_to_q_k_v_not_to_the_parameters(mock):
    var = compile_variant(BIAS)
    q, k, v = _qkv(grad=True)
    values = _bias_params()
    values["slopes"].requires_grad_(True)
    out = var(q, k, v, **values)
    out.float().sum().backward()
    assert all(t.grad is not None for t in (q, k, v))
    assert values["slopes"].grad is None
    assert taken(mock, "bwd")["user_f1"] == 0.25  # offset: slot 1 (bias, offset, ...)


def test_torch_compile_fullgraph_traces_a_variant(mock):
    var = compile_variant(BIAS)
    values = _bias_params()

    def step(q, k, v, slopes, bias, scale_b):
        out = var(q, k, v, causal=True, slopes=slopes, bias=bias, scale_b=scale_b, offset=0.25)
        return out.float().sum()

    q, k, v = _qkv(grad=True)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, values["slopes"], values["bias"], values["scale_b"]).backward()
    assert all(t.grad is not None for t in (q, k, v))
    rec = taken(mock, "bwd")
    assert rec["user_f1"] == 0.25 and rec["user_ptr3"] == values["slopes"].data_ptr()


def test_opcheck_passes_on_a_variant_call():
    var = compile_variant(BIAS)
    q, k, v = _qkv(grad=True)
    user = var.user_args(_bias_params())
    args = (q, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1, False, 0.0, None, None, *user)
    torch.library.opcheck(torch.ops.flashgen.fwd_variant.default, args)
    out, lse, seed, offset = torch.ops.flashgen.fwd_variant.default(*args)
    d = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    bargs = (torch.randn_like(out), *d[:3], out.detach(), lse, seed, offset, *d[3:])
    torch.library.opcheck(torch.ops.flashgen.bwd_variant.default, bargs)


def test_the_example_spec_is_a_variant(mock):
    """examples/variant_alibi_bias.yaml, as its header calls it."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "variant_alibi_bias.yaml"
    var = compile_variant(str(path))
    assert list(var.params) == ["bias", "gain", "slopes"]
    assert var.dtypes == {"bfloat16", "float16"} and var.head_dims == {64, 128}
    q, k, v = _qkv(grad=True)
    out = var(q, k, v, causal=True, slopes=torch.rand(4), bias=torch.randn(4, 32), gain=0.5)
    out.float().sum().backward()
    assert taken(mock, "bwd")["user_f1"] == 0.5
