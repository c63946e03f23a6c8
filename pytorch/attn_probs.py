"""The `S_dmask` that flash-attn returns with `return_attn_probs=True` and dropout, for tests.

flash-attn 2.x returns, in the third place of `flash_attn_func(..., dropout_p > 0,
return_attn_probs=True)`, the unnormalised probabilities with the dropped elements negated;
its own tests read the dropout mask from the signs (`S_dmask >= 0`) and check the output and
the probabilities against a reference that applies that mask. flashgen's kernels never write
the score matrix to HBM, so this module recomputes it on the device, after the kernel ran, from
the same inputs and the same Philox keep mask the kernel drew (docs/conventions.md, "Dropout";
`flashgen.verify.dropout` is its NumPy twin, and the GPU suite checks the kernels against that
bit for bit):

- `S[b, h, i, j] = exp(z_ij - m_i)` for a visible key, 0 for an invisible one, where `z` is the
  kernel's logit (scale, softcap, ALiBi, in that order; `flashgen.verify.score_mods`), `m_i`
  the row's max over its visible keys (so one block covers every key: the shim's
  `_get_block_size_n` must say so), computed in float32 and rounded once to q's dtype;
- negated where dropout drops the element: Philox4x32-10 with counter `(j >> 2, i, b * heads +
  h, offset mod 2^32)`, key `(seed mod 2^32, seed >> 32)`, word `j & 3`, kept iff the word is
  `>= floor(p * 2^32)`;
- shape `(batch, heads, max Sq, max Sk)` (varlen: each sequence in its own corner, zero
  elsewhere; fixed length: `(batch, heads, seqlen_q, seqlen_k)`, not rounded up to 128 as
  flash-attn's is: its tests pad or crop to their own lengths).

It costs one float32 score matrix per (sequence, head) on the device: a testing tool, as in
flash-attn ("testing only"). With `dropout_p == 0` flash-attn returns None there, and so does
flashgen. With `learnable_sink` the magnitudes are still `exp(z - m_i)` over the keys (the sink
joins only the denominator; flash-attn has no sinks to compare with).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["dropout_probs", "keep_words"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def keep_words(seed: int, offset: int, bh: int, seqlen_q: int, seqlen_k: int, device) -> Tensor:
    """The uint32 Philox words (as int64) of one `b * heads + h` block, `(seqlen_q, seqlen_k)`:
    `flashgen.verify.dropout._words` on the device. 32-bit words live in int64, whose
    wrapping products keep the low 64 bits of the exact ones."""
    groups = -(-seqlen_k // 4)
    c0 = torch.arange(groups, dtype=torch.int64, device=device)[None, :].expand(seqlen_q, groups)
    c1 = torch.arange(seqlen_q, dtype=torch.int64, device=device)[:, None].expand(seqlen_q, groups)
    c2 = torch.full_like(c0, bh & _U32)
    c3 = torch.full_like(c0, int(offset) & _U32)
    k0, k1 = int(seed) & _U32, (int(seed) >> 32) & _U32
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
        p0 = c0 * _M0  # c0 < 2^32: the exact product's low 64 bits
        p1 = c2 * _M1
        c0, c1, c2, c3 = (
            ((p1 >> 32) & _U32) ^ c1 ^ k0,
            p1 & _U32,
            ((p0 >> 32) & _U32) ^ c3 ^ k1,
            p0 & _U32,
        )
    words = torch.stack((c0, c1, c2, c3), dim=-1).reshape(seqlen_q, 4 * groups)
    return words[:, :seqlen_k]


def _logits(q: Tensor, k: Tensor, scale: float, softcap: float, slopes: Optional[Tensor],
            shift: int) -> Tensor:  # fmt: skip
    """`(heads, Sq, Sk)` float32 logits of one sequence: q `(Sq, heads, d)`, k `(Sk, heads, d)`
    (KV heads already repeated)."""
    z = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale
    if softcap > 0.0:
        z = softcap * torch.tanh(z / softcap)
    if slopes is not None:
        i = torch.arange(q.shape[0], device=q.device)[:, None]
        j = torch.arange(k.shape[0], device=q.device)[None, :]
        dist = (i + shift - j).abs().float()
        z = z - slopes.float()[:, None, None] * dist
    return z


def _visible(sq: int, sk: int, causal: bool, window: tuple[int, int], device) -> Tensor:
    """`(Sq, Sk)` bool: flash-attn's bottom-right causal / local mask (-1 unbounded)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def dropout_probs(
    q: Tensor,
    k: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    seed: int,
    offset: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
) -> Tensor:
    """flash-attn's `S_dmask` of a call that ran with these arguments (module docstring).
    q, k: `(batch, Sq, heads, d)` / `(batch, Sk, kv_heads, d)`, or packed `(total, heads, d)`
    with `cu_seqlens_q` / `cu_seqlens_k` (the caller's, unpadded head dims: scores do not
    change with zero padding)."""
    with torch.no_grad():
        varlen = cu_seqlens_q is not None
        if varlen:
            starts_q = cu_seqlens_q.tolist()
            starts_k = cu_seqlens_k.tolist()
            batch = len(starts_q) - 1
            lens_q = [b - a for a, b in zip(starts_q, starts_q[1:])]
            lens_k = [b - a for a, b in zip(starts_k, starts_k[1:])]
            sq_max = max([int(max_seqlen_q), *lens_q])  # (a max below a length: still fits)
            sk_max = max([int(max_seqlen_k), *lens_k])
        else:
            batch, sq_max = q.shape[0], q.shape[1]
            sk_max = k.shape[1]
        heads, kv_heads = q.shape[-2], k.shape[-2]
        out = torch.zeros(batch, heads, sq_max, sk_max, dtype=q.dtype, device=q.device)
        threshold = int(math.floor(float(dropout_p) * 2.0**32))
        for b in range(batch):
            if varlen:
                qb = q[starts_q[b] : starts_q[b + 1]]
                kb = k[starts_k[b] : starts_k[b + 1]]
            else:
                qb, kb = q[b], k[b]
            sq, sk = qb.shape[0], kb.shape[0]
            if sq == 0 or sk == 0:
                continue
            kb = kb.repeat_interleave(heads // kv_heads, dim=1)
            slopes = None
            if alibi_slopes is not None:
                slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            z = _logits(qb, kb, float(softmax_scale), float(softcap), slopes, sk - sq)
            ok = _visible(sq, sk, causal, window, q.device)
            z = z.masked_fill(~ok, float("-inf"))
            m = z.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(z - m)  # 0 where invisible
            for h in range(heads):
                keep = keep_words(seed, offset, b * heads + h, sq, sk, q.device) >= threshold
                ph = p[h].to(q.dtype)
                out[b, h, :sq, :sk] = torch.where(keep, ph, -ph)
        return out
