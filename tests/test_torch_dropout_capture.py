"""Dropout under CUDA-graph capture, without a GPU (skips without torch).

The kernels are the mocks of `flashgen.bench.mock_kernels` (their launchers keep a copy of the
parameter struct they are given) and CPU tensors are described as CUDA ones, as in
tests/test_torch_variant.py; `ops.capturing` is patched to say whether a capture is under
way. What is held here: a captured dropout forward is served (no
refusal) and hands the kernel device pointers for the Philox seed and offset plus the two
outputs it writes, never host values; outside a capture the by-value fields are what they
were; the backward takes a captured forward's outputs through pointers. The compiled
binding's structs are held to these by tests/torch_binding_cases.py; the GPU side (replays
draw new masks, each verify.dropout's) is tests/gpu/test_torch.py.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from flashgen.bench import mock_kernels  # noqa: E402
from flashgen.generator.families import family  # noqa: E402
from flashgen.generator.spec import KernelKind  # noqa: E402
from flashgen.runtime.library import params_struct  # noqa: E402
from flashgen.torch import interface, ops  # noqa: E402
from flashgen.torch.selection import UnsupportedCall  # noqa: E402

PHILOX_FIELDS = ("philox_seed_ptr", "philox_offset_ptr", "philox_offset_add")


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    return mock_kernels.build(tmp_path_factory.mktemp("mock"))


@pytest.fixture(autouse=True)
def cuda_mocked(monkeypatch, mock):
    mock_kernels.mock_cuda(monkeypatch.setattr, mock)
    monkeypatch.setattr(interface, "_on_cuda", lambda t: True)


def capturing(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(ops, "capturing", lambda: on)


def taken(mock, kind: str) -> dict:
    fam = family(KernelKind.BACKWARD if kind == "bwd" else KernelKind.FORWARD)
    buf = params_struct(fam)()
    getattr(mock, f"take_{kind}")(ctypes.byref(buf))
    return {p.name: getattr(buf, p.name) for p in fam.params}


def _fwd_args(p=0.2, sq=33, sk=40):
    q = torch.randn(2, sq, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    return (q, k, v, None, None, 0, 0, p, 0.125, False, -1, -1, False)


def _bwd_args(fwd_args, out, lse, seed, offset):
    q, k, v, cu_q, cu_k, max_q, max_k, *rest = fwd_args
    return (torch.randn_like(out), q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k,
            *rest)  # fmt: skip


def test_a_captured_dropout_forward_passes_pointers_and_returns_device_outputs(monkeypatch, mock):
    capturing(monkeypatch, True)
    monkeypatch.setattr(ops, "philox_state", lambda device, p: pytest.fail("host state read"))
    args = _fwd_args()
    out, lse, seed, offset = ops._fwd_impl(*args)
    rec = taken(mock, "fwd")
    # the pair the kernel reads: two int64 words drawn on q's device, one after the other
    assert rec["philox_seed_ptr"] != 0
    assert rec["philox_offset_ptr"] == rec["philox_seed_ptr"] + 8
    assert rec["philox_offset_add"] == 0
    assert (rec["seed"], rec["offset"]) == (0, 0)
    # what it writes: the returned 0-dim int64 tensors on q's device, which the backward reads
    assert rec["philox_seed_out"] == seed.data_ptr()
    assert rec["philox_offset_out"] == offset.data_ptr()
    for t in (seed, offset):
        assert t.dim() == 0 and t.dtype == torch.int64 and t.device == args[0].device
    assert rec["dropout_p"] == pytest.approx(0.2)


def test_outside_a_capture_the_forward_keeps_the_by_value_fields(monkeypatch, mock):
    capturing(monkeypatch, False)
    monkeypatch.setattr(ops, "philox_state", lambda device, p: (2**64 - 5, 12))
    out, lse, seed, offset = ops._fwd_impl(*_fwd_args())
    rec = taken(mock, "fwd")
    assert (rec["seed"], rec["offset"]) == (2**64 - 5, 12)
    for name in (*PHILOX_FIELDS, "philox_seed_out", "philox_offset_out"):
        assert rec[name] == 0, name
    assert (ops._u64(seed), ops._u64(offset)) == (2**64 - 5, 12)
    assert seed.device.type == offset.device.type == "cpu"


def test_without_dropout_a_capture_touches_no_philox_field(monkeypatch, mock):
    capturing(monkeypatch, True)
    ops._fwd_impl(*_fwd_args(p=0.0))
    rec = taken(mock, "fwd")
    for name in ("seed", "offset", *PHILOX_FIELDS, "philox_seed_out", "philox_offset_out"):
        assert rec[name] == 0, name


def test_a_captured_forward_without_keys_returns_a_zero_pair(monkeypatch, mock):
    capturing(monkeypatch, True)
    calls = mock.calls(0)
    out, lse, seed, offset = ops._fwd_impl(*_fwd_args(sk=0))
    assert mock.calls(0) == calls  # no kernel ran: the pair is set on the host
    assert (seed.item(), offset.item()) == (0, 0)
    assert bool((out == 0).all())


def test_the_backward_takes_host_pairs_by_value(monkeypatch, mock):
    monkeypatch.setattr(ops, "philox_state", lambda device, p: (77, 40))
    args = _fwd_args()
    ops._bwd_impl(*_bwd_args(args, *ops._fwd_impl(*args)))
    rec = taken(mock, "bwd")
    assert (rec["seed"], rec["offset"]) == (77, 40)
    for name in PHILOX_FIELDS:
        assert rec[name] == 0, name


class _DeviceScalar:
    """A 0-dim int64 tensor on a CUDA device, as far as `_philox_pointers` looks at one."""

    def __init__(self, address: int) -> None:
        self.device = SimpleNamespace(type="cuda")
        self.address = address

    def data_ptr(self) -> int:
        return self.address

    def item(self):  # a host read of device memory: a sync, and under capture an error
        pytest.fail("the backward read a device pair on the host")


def test_the_backward_reads_a_captured_forwards_pair_through_pointers():
    fields = ops._philox_pointers(_DeviceScalar(0x7F00_0000), _DeviceScalar(0x7F00_0100))
    assert fields == {"philox_seed_ptr": 0x7F00_0000, "philox_offset_ptr": 0x7F00_0100}
    host = ops._philox_pointers(ops._scalar(2**64 - 1), ops._scalar(4))
    assert host == {"seed": 2**64 - 1, "offset": 4}


@pytest.mark.parametrize(
    "seed",
    [torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int32)],
    ids=["shape", "dtype"],
)
def test_the_backward_refuses_a_pair_that_is_not_the_forwards(monkeypatch, seed):
    monkeypatch.setattr(ops, "philox_state", lambda device, p: (1, 0))
    args = _fwd_args()
    out, lse, _, offset = ops._fwd_impl(*args)
    with pytest.raises(UnsupportedCall, match="philox_seed must be the forward's 0-dim int64"):
        ops._bwd_impl(*_bwd_args(args, out, lse, seed, offset))


def test_capture_no_longer_refuses_dropout_through_flash_attn_func(monkeypatch, mock):
    capturing(monkeypatch, True)
    q, k, v = _fwd_args()[:3]
    out = interface.flash_attn_func(q, k, v, dropout_p=0.1)
    assert out.shape == q.shape and taken(mock, "fwd")["philox_seed_ptr"] != 0


def test_return_attn_probs_with_dropout_under_capture_names_the_reason(monkeypatch):
    capturing(monkeypatch, True)
    q, k, v = _fwd_args()[:3]
    with pytest.raises(UnsupportedCall, match="return_attn_probs=True with dropout_p > 0"):
        interface.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)


# torch.utils.cpp_extension imports setuptools, whose distutils shim cannot load in a process
# that imported the standard library's distutils first: the flags are read in a subprocess,
# as tests/test_torch_binding.py builds the binding in one.
_FLAGS = """
import sys, torch
from pathlib import Path
from torch.utils import cpp_extension
from flashgen.torch import binding
lib = Path(sys.argv[1])
(lib / "libtorch_cuda.so").write_bytes(b"")
cpp_extension.library_paths = lambda *a, **k: [str(lib)]
torch.version.cuda = "13.0" if sys.argv[2] == "1" else None
flags, libs = binding._torch_flags()
print("-DFLASHGEN_CUDA_GENERATOR" in flags, "-ltorch_cuda" in libs)
"""


@pytest.mark.parametrize("cuda", [True, False])
def test_the_binding_links_the_cuda_generator_only_with_a_cuda_torch(tmp_path, cuda):
    res = subprocess.run(
        [sys.executable, "-c", _FLAGS, str(tmp_path), "1" if cuda else "0"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [str(cuda), str(cuda)]
