"""Randomly drawn valid specs, compiled on the spot and checked like the shipped ones.

Hypothesis draws a spec over every axis the spec allows on sm_90 (dtype, head dim, tile,
causal alignment, window, varlen, GQA, dropout with or without the debug keep-mask, block
sparsity, IO counting, the score-stage features softcap / ALiBi / sinks), nvcc builds it,
and each drawn runtime case must pass the pass rule; debug keep-masks must equal
verify.dropout's bit for bit and IO counters verify.io_model's to the byte.
FLASHGEN_DRAWN_SPECS (default 6) sets how many specs a run draws.
"""

from __future__ import annotations

import os

import numpy as np
from flashgen.generator.compile import compile_specs
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import Target
from flashgen.verify import dropout, io_model
from flashgen.verify.blocksparse import compact_layout_for_spec
from flashgen.verify.runner import load_kernel
from flashgen.verify.strategies import block_layouts, valid_specs
from flashgen.verify.tiled_model import tiled_forward
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .checks import verdicts
from .conftest import REPO
from .test_forward import make_inputs, runtime_case

DRAWN = int(os.environ.get("FLASHGEN_DRAWN_SPECS", "6"))
CASES = 12
DRAWN_DIR = REPO / "build" / "drawn"


def _check_case(spec, kernel, data) -> None:
    case = data.draw(runtime_case(spec, max_len=300), label="case")
    if spec.sparse and spec.mask.varlen:  # one layout serves every sequence: equal lengths
        case["lens_q"] = [case["lens_q"][0]] * len(case["lens_q"])
        case["lens_k"] = [case["lens_k"][0]] * len(case["lens_k"])
    q, k, v, kw = make_inputs(spec, case)
    ref = {key: kw[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "window") if key in kw}
    ref["causal"] = spec.mask.causal.yaml
    if spec.mask.varlen:
        batch, sq, sk = len(case["lens_q"]), max(case["lens_q"]), max(case["lens_k"])
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    heads = q.shape[-2]
    layout = None
    if spec.sparse:
        tr, tc = -(-sq // spec.tile.block_m), -(-sk // spec.tile.block_n)
        lh = data.draw(st.sampled_from([1, heads]), label="layout heads")
        block_mask = data.draw(block_layouts(lh, tr, tc), label="block mask")
        layout = compact_layout_for_spec(
            block_mask, spec, seqlen_q=sq, seqlen_k=sk, window=kw.get("window", (-1, -1))
        )
        kw["layout"] = layout
        ref.update(block_mask=block_mask, block_m=spec.tile.block_m, block_n=spec.tile.block_n)
    if spec.dropout:
        p = data.draw(st.sampled_from([0.0, 0.2, 0.6]), label="p")
        seed = data.draw(st.integers(0, 2**64 - 1), label="seed")
        offset = data.draw(st.integers(0, 2**32 - 1), label="offset")
        kw.update(dropout_p=p, seed=seed, offset=offset)
        if spec.mask.varlen:
            keep = dropout.keep_mask_varlen(seed, offset, heads, case["lens_q"], case["lens_k"], p)
        else:
            keep = dropout.keep_mask(seed, offset, batch, heads, sq, sk, p)
        ref.update(keep_mask=keep, dropout_p=p)
    res = kernel.run(q, k, v, memory_layout=case["memory_layout"], pad=case["pad"], **kw)
    if spec.debug_keep_mask:  # every element of every visited tile, and nothing else
        model = tiled_forward(
            spec,
            res.inputs["q"],
            res.inputs["k"],
            res.inputs["v"],
            layout=layout,
            keep_mask=keep,
            dropout_p=kw["dropout_p"],
            **{key: kw[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "window") if key in kw},
            **res.score.kwargs(),
        )
        np.testing.assert_array_equal(res.keep_mask, model.debug_keep_mask)
    if spec.instrument_io:
        shape = {"batch": batch, "seqlen_q": sq, "seqlen_k": sk}
        if spec.mask.varlen:
            shape.update(cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_k=kw["cu_seqlens_k"])
        want = io_model.forward_bytes(
            spec,
            heads=heads,
            kv_heads=k.shape[-2],
            layout=layout,
            window=kw.get("window", (-1, -1)),
            **shape,
        )
        assert res.io == {key: val for key, val in want.items() if key != "total"}
    assert res.stats["margins_intact"], "a write landed outside an output buffer"
    for out, v in verdicts(spec, res, **ref).items():
        assert v.passed, f"{kernel_name(spec)} {out}: {v.message} (case {case})"


@settings(
    max_examples=DRAWN,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
@given(spec=valid_specs(target=Target.SM90), data=st.data())
def test_drawn_specs_compile_and_match_reference(spec, data):
    result = compile_specs([spec], DRAWN_DIR, jobs=1, progress=False)[0]
    assert result.ok, result.error
    kernel = load_kernel(spec, DRAWN_DIR)
    for _ in range(CASES):
        _check_case(spec, kernel, data)
