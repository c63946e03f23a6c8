"""flashgen.torch.attn_probs: flash-attn's S_dmask for return_attn_probs with dropout,
recomputed on the device, checked on the CPU against flashgen.verify's float64 logits and
its NumPy keep mask (the mask the GPU suite checks the kernels against bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from flashgen.torch.attn_probs import dropout_probs, keep_words  # noqa: E402
from flashgen.verify import dropout as vdropout  # noqa: E402


@given(
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    bh=st.integers(0, 2**32 - 1),
    sq=st.integers(1, 9),
    sk=st.integers(1, 23),
)
@settings(max_examples=60, deadline=None)
def test_keep_words_are_the_numpy_philox_words(seed, offset, bh, sq, sk):
    want = vdropout._words(seed, offset, bh, sq, sk).astype(np.int64)
    assert np.array_equal(keep_words(seed, offset, bh, sq, sk, "cpu").numpy(), want)


def _want(q, k, seed, offset, p, scale, causal, window, softcap, slopes, heads):
    """float64 S_dmask of one sequence: (heads, sq, sk)."""
    sq, sk = q.shape[0], k.shape[0]
    g = heads // k.shape[1]
    kk = np.repeat(k, g, axis=1)
    z = np.einsum("ihd,jhd->hij", q, kk) * scale
    if softcap:
        z = softcap * np.tanh(z / softcap)
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    if slopes is not None:
        z = z - slopes[:, None, None] * np.abs(i - j)
    left, right = window
    if causal:
        right = 0
    ok = np.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    z = np.where(ok, z, -np.inf)
    m = z.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.exp(z - m)


@given(
    data=st.data(),
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    d=st.sampled_from([8, 16]),
    varlen=st.booleans(),
    causal=st.booleans(),
    window=st.sampled_from([(-1, -1), (3, 0), (2, 5)]),
    softcap=st.sampled_from([0.0, 2.0]),
    alibi=st.booleans(),
    p=st.sampled_from([0.17, 0.5]),
    seed=st.integers(0, 2**64 - 1),
)
@settings(max_examples=40, deadline=None)
def test_dropout_probs_are_the_kernels_probabilities_and_keep_mask(
    data, batch, kv_heads, group, d, varlen, causal, window, softcap, alibi, p, seed
):
    heads = kv_heads * group
    rng = np.random.default_rng(seed % 2**32)
    offset = data.draw(st.integers(0, 2**40))
    if varlen:
        sq = [data.draw(st.integers(0, 12)) for _ in range(batch)]
        sk = [data.draw(st.integers(0, 12)) for _ in range(batch)]
    else:
        sq = [data.draw(st.integers(1, 12))] * batch
        sk = [data.draw(st.integers(1, 12))] * batch
    qs = [rng.standard_normal((n, heads, d)) for n in sq]
    ks = [rng.standard_normal((n, kv_heads, d)) for n in sk]
    slopes = rng.uniform(0.05, 0.5, (batch, heads)) if alibi else None
    dt = torch.float32  # the rounding to q's dtype is the identity: compare the float32 values
    if varlen:
        q = torch.tensor(np.concatenate(qs), dtype=dt)
        k = torch.tensor(np.concatenate(ks), dtype=dt)
        cu_q = torch.tensor(np.cumsum([0, *sq]), dtype=torch.int32)
        cu_k = torch.tensor(np.cumsum([0, *sk]), dtype=torch.int32)
        args = (cu_q, cu_k, max(sq), max(sk))
    else:
        q = torch.tensor(np.stack(qs), dtype=dt)
        k = torch.tensor(np.stack(ks), dtype=dt)
        args = (None, None, 0, 0)
    scale = d**-0.5
    got = dropout_probs(
        q, k, *args, seed, offset, p, scale, causal, window, softcap,
        None if slopes is None else torch.tensor(slopes, dtype=torch.float32),
    )  # fmt: skip
    assert got.shape == (batch, heads, max(sq), max(sk)) and got.dtype == dt
    keep = vdropout.keep_mask_varlen(seed, offset, heads, sq, sk, p)
    for b in range(batch):
        if sq[b] == 0 or sk[b] == 0:
            assert not got[b].any()
            continue
        s_ = None if slopes is None else slopes[b]
        want = _want(qs[b], ks[b], seed, offset, p, scale, causal, window, softcap, s_, heads)
        g = got[b, :, : sq[b], : sk[b]].double().numpy()
        kb = keep[b, :, : sq[b], : sk[b]]
        nz = want > 0
        assert np.array_equal((g > 0)[nz], kb[nz])  # the signs are the kernel's keep mask
        assert np.allclose(np.abs(g), want, rtol=1e-5, atol=1e-6)
        assert not got[b, :, sq[b] :].any() and not got[b, :, :, sk[b] :].any()
