"""`tile: auto` of the Hopper backward (sm_90a) compiles without spills for every head dim it
serves and each feature class it takes (ptxas through `flashgen compile`; no GPU needed).
The consumer warpgroups' 240 registers are nearly all accumulators (dK and dV of 64 keys,
S^T and dP^T), and ptxas is not monotone near that limit (a single extra predicate once
spilled 100 bytes), so this sweep guards the rule and the kernel's register economies
(include/flashgen/bwd_sm90_kernel.cuh)."""

from __future__ import annotations

import shutil

import pytest
from flashgen.generator.compile import compile_specs
from flashgen.generator.families.backward_sm90 import HEAD_DIMS
from flashgen.generator.load import load_spec_text

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH"),
]

FEATURES = {
    "dense": "",
    "causal": "mask: {causal: bottom_right}\n",
    "window_gqa": "mask: {causal: top_left, window: true}\ngqa: true\n",
}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hopper_backward_auto_tiles_do_not_spill(head_dim, tmp_path):
    specs = [
        load_spec_text(
            f"kernel: backward\ndtype: bf16\nhead_dim: {head_dim}\ntarget: sm_90a\n{extra}"
        )[0]
        for extra in FEATURES.values()
    ]
    results = compile_specs(specs, tmp_path, jobs=2, progress=False)
    for feature, r in zip(FEATURES, results):
        assert r.ok, f"d={head_dim} {feature}: {r.error}"
        assert not r.spills, f"d={head_dim} {feature} ({r.kernel}) spills"
