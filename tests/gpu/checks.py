"""Shared checks of the GPU suite: one kernel result against the float64 reference and the
same-precision baseline, by the pass rule, with the record kept for the kernel."""

from __future__ import annotations

import numpy as np
from flashgen.generator.naming import kernel_name
from flashgen.verify import baseline, passrule, reference


def softmax_scale(spec) -> float:
    return 1.0 / float(np.sqrt(spec.head_dim))


def verdicts(spec, res, **ref_kwargs) -> dict:
    """Pass-rule verdicts of O and LSE; `ref_kwargs` are the reference's mask/feature arguments."""
    qi, ki, vi = res.inputs["q"], res.inputs["k"], res.inputs["v"]
    o64, lse64 = reference.attention_forward(qi, ki, vi, **ref_kwargs)
    ob, lseb = baseline.attention_forward(qi, ki, vi, dtype=spec.dtype.yaml, **ref_kwargs)
    return {
        "o": passrule.check(res.o, o64, ob, spec.dtype.yaml),
        "lse": passrule.check(
            res.lse,
            lse64,
            lseb,
            "fp32",
            extra_floor=passrule.score_floor(qi, ki, softmax_scale(spec)),
        ),
    }


def assert_pass(spec, found: dict, recorder, test: str, res) -> None:
    """Record the verdicts for the kernel, then fail on a stray write or a failed output."""
    recorder.add(spec, found, test)
    assert res.stats["margins_intact"], "a write landed outside an output buffer"
    for out, v in found.items():
        assert v.passed, f"{kernel_name(spec)} {out}: {v.message}"
