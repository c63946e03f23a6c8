"""`tile: auto` of the Hopper (sm_90a) forward and backward compiles without spills for every
head dim and feature class each serves (ptxas through `flashgen compile`; no GPU needed).

Forward: the rule's register limits (three consumer warpgroups at 160 registers, the pipelined
loop beside dropout) were found by exactly this sweep, so it guards them. Backward: the
consumer warpgroups' 240 registers are nearly all accumulators (dK and dV of 64 keys, S^T and
dP^T), and ptxas is not monotone near that limit (a single extra predicate once spilled 100
bytes), so the sweep guards the rule and the kernel's register economies
(include/flashgen/bwd_sm90_kernel.cuh).

About 5 minutes on 2 cores: marked `nvcc_sweep`, which the default run leaves out;
`python -m pytest -m nvcc_sweep tests` runs it (CI does, as a step of its own, .ci/run)."""

from __future__ import annotations

import shutil

import pytest
from flashgen.generator.compile import compile_specs
from flashgen.generator.families.backward_sm90 import HEAD_DIMS as BWD_HEAD_DIMS
from flashgen.generator.load import load_spec_text

pytestmark = [
    pytest.mark.nvcc,
    pytest.mark.nvcc_sweep,  # not in the default run: python -m pytest -m nvcc_sweep tests
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


BWD_FEATURES = {
    "dense": "",
    "causal": "mask: {causal: bottom_right}\n",
    "window_gqa": "mask: {causal: top_left, window: true}\ngqa: true\n",
    # ALiBi's distances beside P^T formed while dP^T runs (64 rows at 64 columns), and with a
    # mask at 128 rows
    "alibi": "alibi: true\n",
    "alibi_causal": "mask: {causal: bottom_right}\nalibi: true\n",
    "alibi_window_gqa": "mask: {causal: top_left, window: true}\ngqa: true\nalibi: true\n",
    # the ordered dQ adds: the counter and turn beside the dQ writer's 24 registers, and with
    # a window the turn's search in the consumers
    "deterministic_causal": "mask: {causal: bottom_right}\ndeterministic: true\n",
    "deterministic_window_gqa": "mask: {causal: top_left, window: true}\ngqa: true\n"
    "deterministic: true\n",
}


def _assert_auto_tiles_do_not_spill(kind, features, head_dim, tmp_path):
    specs = [
        load_spec_text(
            f"kernel: {kind}\ndtype: bf16\nhead_dim: {head_dim}\ntarget: sm_90a\n{extra}"
        )[0]
        for extra in features.values()
    ]
    results = compile_specs(specs, tmp_path, jobs=2, progress=False)
    for feature, r in zip(features, results):
        assert r.ok, f"{kind} d={head_dim} {feature}: {r.error}"
        assert not r.spills, f"{kind} d={head_dim} {feature} ({r.kernel}) spills"


# every multiple of 16, and the multiples of 8 below 128 (the P V tail's widths 8..56)
FWD_HEAD_DIMS = sorted({*range(16, 257, 16), *range(8, 128, 16)})


@pytest.mark.parametrize("head_dim", FWD_HEAD_DIMS)
def test_hopper_auto_tiles_do_not_spill(head_dim, tmp_path):
    _assert_auto_tiles_do_not_spill("forward", FEATURES, head_dim, tmp_path)


@pytest.mark.parametrize("head_dim", BWD_HEAD_DIMS)
def test_hopper_backward_auto_tiles_do_not_spill(head_dim, tmp_path):
    _assert_auto_tiles_do_not_spill("backward", BWD_FEATURES, head_dim, tmp_path)
