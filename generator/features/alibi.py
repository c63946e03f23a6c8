"""ALiBi: flash-attn's `alibi_slopes`, a bias `-slope * |i + shift - j|` added to the scaled score.

`shift` is the mask's diagonal offset: `seqlen_k - seqlen_q` for bottom_right (and for no
causal mask, as flash-attn defines the non-causal bias), 0 for top_left. Slopes are fp32 of
shape (heads) or (batch, heads); `alibi_batch_stride` is 0 or `heads`, in elements.
"""

from __future__ import annotations

from flashgen.generator.features import Feature, ParamRow

FEATURE = Feature(
    name="alibi",
    part="alibi",
    cpp="kAlibi",
    label="alibi",
    torch_arg="alibi_slopes",
    params=(
        ParamRow(
            "alibi_slopes",
            "ptr",
            "const float* alibi_slopes",
            "fp32 (heads) or (batch, heads): bias -slope * |i + shift - j|",
        ),
        ParamRow(
            "alibi_batch_stride",
            "i64",
            "int64_t alibi_batch_stride",
            "elements between batches' slopes: 0 (one row for all) or heads",
        ),
    ),
    doc="ALiBi bias -slope_h * |i + shift - j| on the scaled score",
)
