"""The calls of tests/gpu/test_torch_variant.py, importable without torch or a GPU: the
variants' specs and the dtypes, head dims, head counts, lengths and masks the tests draw
from. tests/test_variant_prebuild.py reads them to hold examples/variant_kernels.yaml (what
`flashgen compile` prebuilds) to every kernel the tests ask for."""

from __future__ import annotations

_HEAD = "kernel: [forward, backward]\ndtype: [bf16, fp16]\nhead_dim: [64, 128]\n"
VARIANTS = {
    "alibi": (
        _HEAD + 'score_mod: "s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)"\n'
        "params: {slopes: per_head}\n"
    ),
    "softcap": _HEAD + 'score_mod: "cap * tanh(s / cap)"\nparams: {cap: scalar}\n',
    "relative": (_HEAD + 'score_mod: "s - rate * log(1.0 + abs(i - j))"\nparams: {rate: scalar}\n'),
}
# the dense test: every variant, dtype and head dim; heads, lengths and the mask are drawn
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128)
HEADS = (1, 3, 4)
LENGTHS = (1, 7, 16, 17, 64, 65, 128, 129, 257)
CAUSALS = (False, True)
# the varlen test: every variant on (total, 4, 64) bf16, causal, these sequence lengths
VARLEN = {"dtype": "bf16", "head_dim": 64, "heads": 4, "lens": (5, 130, 64), "causal": True}
# the CUDA-graph test (a forward without gradients) and the torch.compile test (with them):
# (variant, dtype, (batch, seqlen, heads, head_dim), causal, gradients)
GRAPH = ("alibi", "bf16", (2, 256, 4, 128), True, False)
COMPILED = ("softcap", "bf16", (2, 129, 4, 64), True, True)
