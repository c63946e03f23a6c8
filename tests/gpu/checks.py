"""Shared checks of the GPU suite: one kernel result against the float64 reference and the
same-precision baseline, by the pass rule, with the record kept for the kernel."""

from __future__ import annotations

import numpy as np
from flashgen.generator.naming import kernel_name
from flashgen.verify import baseline, passrule, reference
from flashgen.verify.score_mods import ScoreArgs


def softmax_scale(spec) -> float:
    return 1.0 / float(np.sqrt(spec.head_dim))


def score_kwargs(res) -> dict:
    """The score-stage arguments of a run (softcap, slopes, sinks as the device held them)."""
    return getattr(res, "score", ScoreArgs()).kwargs()


def max_distance(q, k, ref_kwargs) -> int:
    """A bound on `|i + shift - j|` of the call: the longest Sq plus the longest Sk."""
    cu_q, cu_k = ref_kwargs.get("cu_seqlens_q"), ref_kwargs.get("cu_seqlens_k")
    if cu_q is not None:
        return int(np.diff(cu_q).max(initial=0)) + int(np.diff(cu_k).max(initial=0))
    return int(q.shape[1]) + int(k.shape[1])


def lse_floor(spec, q, k, ref_kwargs) -> float:
    """The LSE's extra floor: the float32 score error bound, plus ALiBi's bias bound,
    softcap's tanh.approx bound and a score_mod's float32 bound (passrule)."""
    return (
        passrule.score_floor(q, k, softmax_scale(spec))
        + passrule.alibi_floor(ref_kwargs.get("alibi_slopes"), max_distance(q, k, ref_kwargs))
        + passrule.softcap_floor(ref_kwargs.get("softcap", 0.0))
        + passrule.usermod_floor(
            # a mask_mod alone changes no logit: its parameters (document ids) are not a bound
            ref_kwargs.get("score_params") if ref_kwargs.get("score_mod") is not None else None,
            max_distance(q, k, ref_kwargs),
        )
    )


def verdicts(spec, res, **ref_kwargs) -> dict:
    """Pass-rule verdicts of O and LSE; `ref_kwargs` are the reference's mask/feature arguments.
    The run's score-stage values (`res.score`: softcap, ALiBi slopes, sinks) join them, so
    every test of a spec with such a feature checks it."""
    kw = {**score_kwargs(res), **ref_kwargs}
    qi, ki, vi = res.inputs["q"], res.inputs["k"], res.inputs["v"]
    o64, lse64 = reference.attention_forward(qi, ki, vi, **kw)
    ob, lseb = baseline.attention_forward(qi, ki, vi, dtype=spec.dtype.yaml, **kw)
    return {
        "o": passrule.check(res.o, o64, ob, spec.dtype.yaml),
        "lse": passrule.check(
            res.lse, lse64, lseb, "fp32", extra_floor=lse_floor(spec, qi, ki, kw)
        ),
    }


def assert_pass(spec, found: dict, recorder, test: str, res) -> None:
    """Record the verdicts for the kernel, then fail on a stray write or a failed output."""
    recorder.add(spec, found, test)
    assert res.stats["margins_intact"], "a write landed outside an output buffer"
    for out, v in found.items():
        assert v.passed, f"{kernel_name(spec)} {out}: {v.message}"
