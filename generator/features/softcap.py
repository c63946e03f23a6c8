"""softcap: `s = c * tanh(s / c)` on the scaled score, before masking (flash-attn's `softcap`).

The functor (`Softcap` in score_mod.cuh) takes the raw dot product x and the scale, keeps
the softmax in units of the capped logit (so the softmax's multiplier becomes log2 e), and
gives the backward its derivative `scale * (1 - tanh^2)`; `c` is a runtime value > 0.
"""

from __future__ import annotations

from flashgen.generator.features import Feature, ParamRow

FEATURE = Feature(
    name="softcap",
    part="cap",
    cpp="kSoftcap",
    label="softcap",
    torch_arg="softcap",
    params=(ParamRow("softcap", "f64", "double softcap", "c of c * tanh(s / c); > 0 and finite"),),
    doc="logit soft-capping s -> c tanh(s / c), c = softcap",
)
