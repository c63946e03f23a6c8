"""examples/variant_kernels.yaml prebuilds every kernel of the GPU variant tests and of the
usermod bench on an H200 (skips without torch).

`flashgen compile examples/variant_kernels.yaml` writes build/kernels, the first place the
kernel cache looks; a kernel missing from it compiles on first use (about a minute each, one
after the other). With CUDA mocked at compute capability (9, 0), every call of
tests/gpu/test_torch_variant.py (its case lists, tests/gpu/variant_cases.py) and of
`python -m flashgen.bench.usermod_bench --check` (its VARIANTS, DIMS and CAUSALS; the built-in
backend's flash_attn_func calls too) is made once per kernel-selecting combination, forward
and backward, and each kernel the cache is asked for must be one the file declares.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.bench import mock_kernels, usermod_bench  # noqa: E402
from flashgen.bench.mock_kernels import MockLibrary  # noqa: E402
from flashgen.generator.load import load_paths  # noqa: E402
from flashgen.generator.naming import kernel_name  # noqa: E402
from flashgen.torch import cache, compile_variant, interface  # noqa: E402
from gpu import variant_cases as gpu  # noqa: E402

SPEC = Path(__file__).resolve().parent.parent / "examples" / "variant_kernels.yaml"
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# sq != sk, sq == sk and sk == 1: the mask the selection resolves for causal does not
# depend on the lengths, but a change that made it so would show here
LENGTH_PAIRS = ((gpu.LENGTHS[0], gpu.LENGTHS[-1]), (gpu.LENGTHS[-1], gpu.LENGTHS[0]), (17, 17))


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """The specs the kernel cache is asked for, in order."""
    mock = mock_kernels.build(tmp_path)
    mock_kernels.mock_cuda(monkeypatch.setattr, mock)
    monkeypatch.setattr(interface, "_on_cuda", lambda t: True)
    specs: list = []
    libraries: dict = {}

    def library(spec):
        specs.append(spec)
        return libraries.setdefault(spec, MockLibrary(spec, mock))

    monkeypatch.setattr(cache, "kernel_library", library)
    return specs


def _params(name: str, heads: int) -> dict:
    if name == "alibi":
        return {"slopes": torch.rand(heads)}
    return {"cap": 30.0} if name == "softcap" else {"rate": 0.5}


def _forward_and_backward(fn, shape_q, shape_k, dtype, grad=True, extra=(), **kw):
    """fn(q, k, v, *extra, **kw), then its backward when `grad`."""
    q = torch.randn(shape_q, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(shape_k, dtype=dtype, requires_grad=grad) for _ in range(2))
    if not grad:
        with torch.no_grad():
            fn(q, k, v, *extra, **kw)
        return
    fn(q, k, v, *extra, **kw).float().sum().backward()


def gpu_test_calls() -> None:
    for name, text in gpu.VARIANTS.items():
        var = compile_variant(text)
        for dtype in gpu.DTYPES:
            for d in gpu.HEAD_DIMS:
                for heads in gpu.HEADS:
                    for sq, sk in LENGTH_PAIRS:
                        for causal in gpu.CAUSALS:
                            _forward_and_backward(
                                var, (2, sq, heads, d), (2, sk, heads, d), TORCH_DTYPES[dtype],
                                causal=causal, **_params(name, heads),
                            )  # fmt: skip
        vl = gpu.VARLEN
        cu = torch.tensor([0, *torch.tensor(vl["lens"]).cumsum(0).tolist()], dtype=torch.int32)
        n, top = int(cu[-1]), max(vl["lens"])
        shape = (n, vl["heads"], vl["head_dim"])
        _forward_and_backward(
            var.varlen, shape, shape, TORCH_DTYPES[vl["dtype"]], extra=(cu, cu, top, top),
            causal=vl["causal"], **_params(name, vl["heads"]),
        )  # fmt: skip
    for name, dtype, shape, causal, grad in (gpu.GRAPH, gpu.COMPILED):
        var = compile_variant(gpu.VARIANTS[name])
        _forward_and_backward(
            var, shape, shape, TORCH_DTYPES[dtype], grad, causal=causal, **_params(name, shape[2])
        )


def bench_calls() -> None:
    heads, n = 4, 257  # the sizes do not select kernels (the mock's workspace holds 4 MiB)
    for name in usermod_bench.VARIANTS:
        values = usermod_bench.VARIANTS[name].values(heads, "cpu")
        for d in usermod_bench.DIMS:
            for causal in usermod_bench.CAUSALS["both"]:
                for backend in ("flashgen", "builtin"):
                    fn = usermod_bench.attention(backend, name, d, causal, values)
                    if fn is None:
                        continue
                    for grad in (False, True):
                        shape = (2, n, heads, d)
                        _forward_and_backward(fn, shape, shape, torch.bfloat16, grad)


@pytest.mark.parametrize("calls", [gpu_test_calls, bench_calls], ids=["gpu_test", "bench"])
def test_the_spec_file_declares_every_kernel_asked_for(asked, calls):
    calls()
    assert asked, "no kernel was asked for: the mocks no longer reach the cache"
    declared = {kernel_name(s) for s in load_paths([SPEC])}
    missing = sorted({kernel_name(s) for s in asked} - declared)
    assert not missing, f"{len(missing)} kernels not in {SPEC.name}: {missing}"
