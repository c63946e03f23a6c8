"""The sm_90a forward multiplies no zero columns (nvcc -ptx, no GPU): its Q K^T runs
ceil(d / 16) k16 slices, not one per column of the 64-column TMA boxes, and below 128
columns its P V runs 64-column chunks and a tail of d_v % 64 (fwd_sm90_kernel.cuh, kOTail;
the narrow rows of sm90_narrow.cuh), not the box's padded width. Read from the shipped
kernels' PTX: the wgmma shapes each issues, and the ratio of Q K^T to P V instructions (both
are issued from the same code paths, kBlockN / 16 P V instructions per chunk and tile)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter

import pytest
from flashgen.generator.paths import PACKAGE_ROOT

GENERATED = PACKAGE_ROOT / "generated"
pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH"),
]

# (kernel name prefix, d, block_n, the N of each P V chunk)
CASES = [
    ("fa_fwd_d72_bf16_m128n128w8s3_sm90a_", 72, 128, (64, 8)),
    ("fa_fwd_d96_bf16_m128n128w8s3_sm90a_", 96, 128, (64, 32)),
    ("fa_fwd_d40_bf16_m192n128w12s3_sm90a_", 40, 128, (40,)),
    ("fa_fwd_d136_bf16_m128n64w8s3_sm90a_", 136, 64, (64, 64, 8)),  # above 128 columns too
    ("fa_fwd_d200_bf16_m128n64w8s2_sm90a_", 200, 64, (64, 64, 64, 8)),
    ("fa_fwd_d256_bf16_m128n64w8s2_sm90a_", 256, 64, (128, 128)),  # no tail: 128-wide chunks
]


def _ptx_shapes(prefix: str, tmp_path) -> Counter:
    (src,) = [p for p in GENERATED.glob(f"{prefix}*.cu")]
    out = tmp_path / "k.ptx"
    cmd = ["nvcc", "-ptx", "-arch=sm_90a", "-std=c++17", "-O3", f"-I{GENERATED}",
           f"-I{GENERATED / 'include'}", str(src), "-o", str(out)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", out.read_text())
    return Counter(int(n) for n in found)


@pytest.mark.parametrize(("prefix", "d", "block_n", "chunks"), CASES, ids=[c[0] for c in CASES])
def test_the_forward_multiplies_only_the_head_dims_columns(prefix, d, block_n, chunks, tmp_path):
    shapes = _ptx_shapes(prefix, tmp_path)
    qk = shapes.pop(block_n) if block_n not in chunks else None
    assert set(shapes) <= set(chunks) | {block_n}, shapes
    assert set(chunks) <= set(shapes) | ({block_n} if qk is None else set()), shapes
    if qk is not None:  # Q K^T's instructions per P V instruction of one chunk
        pv = shapes[chunks[-1]] // chunks.count(chunks[-1])
        assert qk * (block_n // 16) == pv * -(-d // 16), (qk, pv, shapes)
