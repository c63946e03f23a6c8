"""Attention sinks (gpt-oss, FlashAttention-4's `learnable_sink`): one logit per query head
that joins only the softmax denominator.

    P_ij = exp(z_ij) / (exp(sink_h) + sum_j exp(z_ij)),   O_i = sum_j P_ij V_j,
    LSE_i = log(exp(sink_h) + sum_j exp(z_ij)),

with z the (modified) scaled scores and `sink_h` in the same natural-log units as z (not
multiplied by the softmax scale). A row that sees no key gives O = 0 and LSE = sink_h.
The backward's gradient is `dsink_h = -sum_{b,i} exp(sink_h - LSE_bhi) * D_bhi` with
`D = rowsum(dO * O)`, written (not accumulated) to `dsinks`; dQ, dK, dV need nothing new
because the LSE already holds the sink.
"""

from __future__ import annotations

from flashgen.generator.features import Feature, ParamRow

FEATURE = Feature(
    name="sink",
    part="sink",
    cpp="kSink",
    label="attention sink",
    torch_arg="learnable_sink",
    params=(
        ParamRow("sinks", "ptr", "const float* sinks", "fp32 (heads): natural-log sink logits"),
        ParamRow(
            "dsinks", "ptr", "float* dsinks", "backward: fp32 (heads) output, dL/dsink (written)"
        ),
    ),
    doc="a per-head logit in the softmax denominator only",
)
