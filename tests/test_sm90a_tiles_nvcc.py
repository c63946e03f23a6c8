"""`tile: auto` of the Hopper forward (sm_90a) compiles without spills for every head dim and
feature class (ptxas through `flashgen compile`; no GPU needed). The rule's register limits
(three consumer warpgroups at 160 registers, the pipelined loop beside dropout) were found by
exactly this sweep, so it guards them."""

from __future__ import annotations

import shutil

import pytest
from flashgen.generator.compile import compile_specs
from flashgen.generator.load import load_spec_text

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH"),
]

FEATURES = {
    "dense": "",
    "causal": "mask: {causal: bottom_right}\n",
    "window_gqa": "mask: {causal: top_left, window: true}\ngqa: true\n",
    "dropout": "dropout: true\n",
    "dropout_debug": "mask: {causal: bottom_right}\ndropout: true\ndebug_keep_mask: true\n",
    # varlen, block sparsity and instrument_io (7 byte counters per thread), each combined with
    # the features that weigh most on registers beside it. (Not here: the two verification
    # builds together, debug_keep_mask with instrument_io, on varlen + window + GQA: 16 bytes
    # of spills at d >= 208; such a spec says allow_spills, as the mma.sync io builds do.)
    "varlen_sparse_io": "mask: {causal: bottom_right, varlen: true}\nsparsity: block\n"
    "instrument_io: true\n",
    "varlen_window_gqa_dropout_io": "mask: {causal: top_left, window: true, varlen: true}\n"
    "gqa: true\ndropout: true\ninstrument_io: true\n",
}


@pytest.mark.parametrize("head_dim", range(16, 257, 16))
def test_hopper_auto_tiles_do_not_spill(head_dim, tmp_path):
    specs = [
        load_spec_text(f"dtype: bf16\nhead_dim: {head_dim}\ntarget: sm_90a\n{extra}")[0]
        for extra in FEATURES.values()
    ]
    results = compile_specs(specs, tmp_path, jobs=2, progress=False)
    for feature, r in zip(FEATURES, results):
        assert r.ok, f"d={head_dim} {feature}: {r.error}"
        assert not r.spills, f"d={head_dim} {feature} ({r.kernel}) spills"
