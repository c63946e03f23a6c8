"""Mocked kernel libraries: flashgen.torch's host path without a GPU.

`build(where)` compiles `MOCK_C`, a C library with the entry points of a forward, a
backward and a decode kernel: `<kind>_launch` keeps a copy of the parameter struct it is
given (read back with `take_<kind>`; decode's merge_states: `merge_launch`, `take_merge`),
counts its calls and zeroes the outputs the struct points at (dense calls), so outputs are
deterministic. `MockLibrary` is a `DecodeLibrary` (a `KernelLibrary`) over those entry
points (the Python path packs and calls through ctypes as with a real kernel);
`mock_cuda(patch, lib)` describes CPU tensors as CUDA ones on a (9, 0) device 0 and serves
every kernel from the mock. tests/torch_binding_cases.py and `python -m
flashgen.bench.host_cost` use them; host times measured this way leave out the CUDA
allocator and driver, so they compare the Python and C++ layers, not GPU calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashgen.generator.families import family
from flashgen.generator.paths import TEMPLATES_DIR
from flashgen.generator.spec import KernelKind
from flashgen.runtime import DecodeLibrary
from flashgen.runtime.library import _packing, params_struct

__all__ = ["MOCK_C", "MockLibrary", "build", "mock_cuda"]

MOCK_C = r"""
#include <stdint.h>
#include <string.h>
#include "params.h"
#include "bwd_params.h"
#include "decode_params.h"
static fg_fwd_params last_fwd;
static fg_bwd_params last_bwd;
static int fwd_calls, bwd_calls;
/* zero a (batch, rows, heads, cols) tensor of `bytes`-wide elements through its strides
   (dense calls; varlen: one batch of packed rows), so outputs are deterministic for opcheck */
static void zero(void* base, int64_t batch, int64_t rows, int64_t heads, int64_t cols,
                 int64_t bs, int64_t rs, int64_t hs, int bytes) {
  if (!base) return;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h)
        memset((char*)base + (b * bs + r * rs + h * hs) * bytes, 0, cols * bytes);
}
int fwd_launch(const fg_fwd_params* p, void* stream) {
  last_fwd = *p; ++fwd_calls;
  int64_t batch = p->cu_seqlens_q ? 1 : p->batch, rows = p->cu_seqlens_q ? p->total_q : p->seqlen_q;
  zero(p->o, batch, rows, p->heads, p->head_dim_v, p->o_batch_stride, p->o_row_stride,
       p->o_head_stride, 2);
  zero(p->lse, batch, 1, p->heads, rows, p->lse_batch_stride, 0, p->lse_head_stride, 4);
  return 0;
}
int bwd_launch(const fg_bwd_params* p, void* stream) {
  last_bwd = *p; ++bwd_calls;
  int64_t batch = p->cu_seqlens_q ? 1 : p->batch;
  int64_t rq = p->cu_seqlens_q ? -1 : p->seqlen_q, rk = p->cu_seqlens_q ? -1 : p->seqlen_k;
  if (rq < 0) return 0; /* varlen: the tests compare structs only */
  zero(p->dq, batch, rq, p->heads, p->head_dim, p->dq_batch_stride, p->dq_row_stride,
       p->dq_head_stride, 2);
  zero(p->dk, batch, rk, p->kv_heads, p->head_dim, p->dk_batch_stride, p->dk_row_stride,
       p->dk_head_stride, 2);
  zero(p->dv, batch, rk, p->kv_heads, p->head_dim_v, p->dv_batch_stride, p->dv_row_stride,
       p->dv_head_stride, 2);
  if (p->score.dsinks) memset(p->score.dsinks, 0, p->heads * 4);
  return 0;
}
static fg_decode_params last_decode;
static int decode_calls;
int decode_launch(const fg_decode_params* p, void* stream) {
  last_decode = *p; ++decode_calls;
  zero(p->o, p->batch, p->seqlen_q, p->heads, p->head_dim_v, p->o_batch_stride, p->o_row_stride,
       p->o_head_stride, 2);
  zero(p->lse, p->batch, 1, p->heads, p->seqlen_q, p->lse_batch_stride, 0, p->lse_head_stride, 4);
  return 0;
}
void take_decode(fg_decode_params* out) { *out = last_decode; }
int decode_count(void) { return decode_calls; }
/* merge_states: its own symbols (DecodeLibrary sets the argtypes of the ones it calls) */
static fg_decode_params last_merge;
static int merge_calls;
int merge_launch(const fg_decode_params* p, void* stream) {
  last_merge = *p; ++merge_calls;
  zero(p->o, p->batch, p->seqlen_q, p->heads, p->head_dim_v, p->o_batch_stride, p->o_row_stride,
       p->o_head_stride, 2);
  zero(p->lse, p->batch, 1, p->heads, p->seqlen_q, p->lse_batch_stride, 0, p->lse_head_stride, 4);
  return 0;
}
int merge_fail(const void* p, void* stream) { return 1; }
const char* merge_check_ok(const void* p) { return 0; }
const char* merge_check_refuses(const void* p) { return "mock: merge refused (allowed: nothing)"; }
void take_merge(fg_decode_params* out) { *out = last_merge; }
int merge_count(void) { return merge_calls; }
int fail_launch(const void* p, void* stream) { return 1; }
const char* check_ok(const void* p) { return 0; }
const char* check_refuses(const void* p) { return "mock: refused (allowed: nothing)"; }
size_t workspace(const void* p) { return (size_t)1 << 22; }
void take_fwd(fg_fwd_params* out) { *out = last_fwd; }
void take_bwd(fg_bwd_params* out) { *out = last_bwd; }
int calls(int bwd) { return bwd ? bwd_calls : fwd_calls; }
"""


def build(where: Path | str) -> ctypes.CDLL:
    """Compile MOCK_C in `where` with `$CC` (else `cc`) and load it."""
    where = Path(where)
    (where / "mock_kernels.c").write_text(MOCK_C)
    so = where / "mock_kernels.so"
    include = TEMPLATES_DIR / "include" / "flashgen"
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O1", "-shared", "-fPIC", f"-I{include}",
         str(where / "mock_kernels.c"), "-o", str(so)],
        check=True,
    )  # fmt: skip
    return ctypes.CDLL(str(so))


class MockLibrary(DecodeLibrary):
    """A KernelLibrary whose entry points are the mock's (the Python path packs and launches
    through ctypes exactly as with a real kernel); decode specs also merge_states (a
    DecodeLibrary's `merge_states` / `merge_check`, the mock's `merge_launch`)."""

    def __init__(self, spec, mock, fail=False):  # noqa: D107 - no .so of the spec is loaded
        self.spec, self.family, self.name = spec, family(spec), "mock_" + spec.kernel.yaml
        self.Params, self._packing = params_struct(self.family), _packing(self.family)
        self._lib = mock
        ptr = ctypes.POINTER(self.Params)
        bwd = spec.kernel == KernelKind.BACKWARD
        dec = spec.kernel == KernelKind.DECODE
        launch = mock.decode_launch if dec else (mock.bwd_launch if bwd else mock.fwd_launch)
        self._launch = mock.fail_launch if fail else launch
        self._launch.argtypes, self._launch.restype = [ptr, ctypes.c_void_p], ctypes.c_int
        self._check = mock.check_refuses if fail else mock.check_ok
        self._check.argtypes, self._check.restype = [ptr], ctypes.c_char_p
        self._workspace = mock.workspace if (bwd or dec) else None
        if self._workspace is not None:
            self._workspace.argtypes, self._workspace.restype = [ptr], ctypes.c_size_t
        self.entry_points = (
            {"merge_states": "merge_fail" if fail else "merge_launch",
             "merge_check": "merge_check_refuses" if fail else "merge_check_ok"}
            if dec else {}
        )  # fmt: skip


def mock_cuda(patch: Callable[[Any, str, Any], None], mock: ctypes.CDLL) -> None:
    """CPU tensors taken for CUDA ones on a (9, 0) device 0, kernels from the mock.
    `patch(obj, name, value)`: pytest's monkeypatch.setattr, or setattr for a script."""
    import torch
    from flashgen.torch import cache, ops

    real_meta = ops._meta

    def meta(t, device=None):
        m = real_meta(t, device)
        return m._replace(device="cuda") if m.device == "cpu" else m

    libraries: dict = {}
    patch(ops, "_meta", meta)
    patch(ops, "_PROBLEMS", {})
    patch(ops, "_CALLS", {})
    patch(ops, "_SCORES", {})
    patch(ops, "_BACKWARD_OK", set())
    patch(ops, "_capability", lambda index: (9, 0))
    patch(ops, "_device_index", lambda t: 0)
    patch(torch.cuda, "current_device", lambda: 0)
    patch(ops, "_stream", lambda device: 0)
    patch(ops, "_OnDevice", lambda device: contextlib.nullcontext())
    patch(cache, "kernel_library", lambda spec: libraries.setdefault(spec, MockLibrary(spec, mock)))
    from flashgen.torch import kvcache

    patch(kvcache, "_meta", meta)
    patch(kvcache, "_capability", lambda device: (9, 0))
    patch(kvcache, "_library", lambda spec: libraries.setdefault(spec, MockLibrary(spec, mock)))
    patch(torch.cuda, "device", lambda device: contextlib.nullcontext())

    class _Stream:
        cuda_stream = 0

    patch(torch.cuda, "current_stream", lambda device=None: _Stream())
