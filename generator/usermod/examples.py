"""Shipped examples of user modifiers: the grammar at work, and test cases (tests/test_usermod.py
checks each against an independent formulation, and the masks' block classification for
exactness). docs/usermod.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .parse import UserMod, parse_mask_mod, parse_score_mod

__all__ = ["EXAMPLES", "EXAMPLE_BY_NAME", "Example"]


@dataclass(frozen=True)
class Example:
    """One example: its name, kind ('score_mod' or 'mask_mod'), text, parameters and what it
    computes."""

    name: str
    kind: str
    text: str
    params: tuple[tuple[str, str], ...]
    doc: str

    def parse(self) -> UserMod:
        if self.kind == "score_mod":
            return parse_score_mod(self.text, dict(self.params))
        return parse_mask_mod(self.text, dict(self.params))


# T5's relative-position buckets (Raffel et al.; HF transformers' _relative_position_bucket),
# with n the distance: below max_exact a bucket per distance, then logarithmic up to
# max_distance = 128, the last bucket beyond. The float factor is
# (buckets - max_exact) / ln(max_distance / max_exact); the `+ 0.001` keeps distances where the
# float value is exactly an integer (16, 32, 64 in the encoder form) on the upper side in every
# precision (fast __logf included): no other distance below 128 lies within 0.011 of a bucket
# edge, and from 128 on the bucket is clamped.
_T5_ENCODER = (
    "s + bias[h, where(j > i, 16, 0) + where(abs(j - i) < 8, abs(j - i), "
    "min(8 + floor(log(abs(j - i) / 8) * 2.8853900817779268 + 0.001), 15))]"
)
_T5_DECODER = (
    "s + bias[h, where(i - j < 16, max(i - j, 0), "
    "min(16 + floor(log((i - j) / 16) * 7.694373551407805 + 0.001), 31))]"
)

EXAMPLES: tuple[Example, ...] = (
    Example(
        "alibi",
        "score_mod",
        "s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)",
        (("slopes", "per_head"),),
        "flashgen's built-in ALiBi (`alibi: true`) with causal none or bottom_right: the bias "
        "-slope_h |i + Sk - Sq - j| (shift Sk - Sq, as flash-attn's alibi_slopes)",
    ),
    Example(
        "alibi_top_left",
        "score_mod",
        "s - slopes[h] * abs(i - j)",
        (("slopes", "per_head"),),
        "the built-in ALiBi with causal top_left (shift 0)",
    ),
    Example(
        "softcap",
        "score_mod",
        "cap * tanh(s / cap)",
        (("cap", "scalar"),),
        "the built-in softcap (`softcap: true`): c tanh(s / c) of the scaled score",
    ),
    Example(
        "bucketed_bias",
        "score_mod",
        "s + bias[h, min(abs(i - j) // 8, 31)]",
        (("bias", "table"),),
        "a learned bias per head and bucket of 8 distances, the last bucket for 248 and beyond: "
        "bias is (heads, 32)",
    ),
    Example(
        "t5_bias",
        "score_mod",
        _T5_ENCODER,
        (("bias", "table"),),
        "T5's encoder bias: 32 bidirectional buckets (16 per direction, 8 exact, logarithmic "
        "to distance 128): bias is (heads, 32)",
    ),
    Example(
        "t5_decoder_bias",
        "score_mod",
        _T5_DECODER,
        (("bias", "table"),),
        "T5's decoder bias: 32 buckets of past distances (16 exact, logarithmic to 128), "
        "future keys in bucket 0 (a causal mask hides them): bias is (heads, 32)",
    ),
    Example("causal", "mask_mod", "j <= i", (), "causal, aligned top-left"),
    Example(
        "causal_bottom_right",
        "mask_mod",
        "j <= i + seqlen_k - seqlen_q",
        (),
        "causal, aligned bottom-right (flash-attn's causal=True)",
    ),
    Example(
        "sliding_window",
        "mask_mod",
        "j <= i and i - j <= window",
        (("window", "scalar_int"),),
        "causal sliding window: the query and the `window` keys before it (flash-attn's "
        "window_size=(window, 0), top-left)",
    ),
    Example(
        "document",
        "mask_mod",
        "doc[i] == doc[j]",
        (("doc", "per_token"),),
        "document masking of packed sequences: doc holds each token's document id (one "
        "vector for queries and keys: self-attention)",
    ),
    Example(
        "prefix_lm",
        "mask_mod",
        "j < prefix[b] or j <= i",
        (("prefix", "per_batch_int"),),
        "prefix-LM: the first prefix[b] keys of sequence b are visible to every query, the rest "
        "causally",
    ),
    Example(
        "chunked",
        "mask_mod",
        "i // chunk == j // chunk",
        (("chunk", "scalar_int"),),
        "chunked attention: queries see the keys of their own chunk of `chunk` tokens (add "
        "`and j <= i` for the causal, Llama-4 form)",
    ),
)

EXAMPLE_BY_NAME: dict[str, Example] = {e.name: e for e in EXAMPLES}
