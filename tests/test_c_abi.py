"""The vendoring path: a generated kernel's .cu and .h compile into a plain C++ program with
nvcc, and its C ABI refuses unusable parameters with a message before touching the GPU.
Needs nvcc, no GPU (no CUDA runtime call is reached on these paths)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MANIFEST = json.loads((REPO / "generated" / "manifest.json").read_text())

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH"),
]

MAIN = r"""
#include <cstdio>
#include "NAME.h"

alignas(16) static unsigned char buf[1 << 12];

static void show(const char* what, const fg_fwd_params& p) {
  const char* m = NAME_check(&p);
  std::printf("%s: %s\n", what, m ? m : "OK");
}

int main() {
  fg_fwd_params p = {};
  show("null", p);
  p.q = buf; p.k = buf; p.v = buf; p.o = buf; p.lse = reinterpret_cast<float*>(buf);
  p.batch = 1; p.heads = 2; p.kv_heads = 2; p.seqlen_q = 5; p.seqlen_k = 7;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = 128;
  p.softmax_scale = 0.125;
  show("good", p);
  fg_fwd_params bad = p; bad.k = buf + 8; show("misaligned", bad);
  bad = p; bad.v_head_stride = 12; show("stride", bad);
  bad = p; bad.kv_heads = 1; show("kv_heads", bad);
  bad = p; bad.softmax_scale = 0.0; show("scale", bad);
  bad = p; bad.seqlen_q = 1LL << 40; bad.heads = bad.kv_heads = 1LL << 30; show("grid", bad);
  bad = p; bad.k = buf + 8;
  std::printf("launch: %d\n", static_cast<int>(NAME_launch(&bad, nullptr)));
  std::printf("invalid value: %d\n", static_cast<int>(cudaErrorInvalidValue));
  return 0;
}
"""


def _dense_kernel() -> str:
    for k in MANIFEST["kernels"]:
        spec = k["spec"]
        if not spec["gqa"] and not spec["mask"]["varlen"] and not spec["dropout"]:
            return k["name"]
    raise AssertionError("no plain dense kernel in the manifest")


def test_vendored_kernel_builds_and_its_c_abi_refuses_bad_parameters(tmp_path):
    name = _dense_kernel()
    src = tmp_path / "main.cu"
    src.write_text(MAIN.replace("NAME", name))
    exe = tmp_path / "main"
    gen = REPO / "generated"
    subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "-O1",
            "-arch=sm_90",
            f"-I{gen}",
            str(src),
            str(gen / f"{name}.cu"),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    out = dict(
        line.split(": ", 1)
        for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()
    )
    assert out["null"] == "q, k, v, o and lse must all be non-null"
    assert out["good"] == "OK"
    assert out["misaligned"] == "q, k, v and o must be 16-byte aligned"
    assert out["stride"] == "q/k/v/o strides must be multiples of 8 elements (16 bytes)"
    assert out["kv_heads"] == "kv_heads must equal heads (spec has gqa: false)"
    assert out["scale"] == "softmax_scale must be finite and > 0"
    assert out["grid"].startswith("grid too large")
    assert out["launch"] == out["invalid value"]
