"""flashgen in the PyTorch ecosystem, without a GPU: transformers' AttentionInterface
(`flashgen.torch.transformers_attention`) and torch's FlashAttention registry
(`flashgen.torch.sdpa_backend`).

First the pure parts: the name rule, that importing flashgen.torch does not import
transformers, how masks are classified (padding vs causal vs arbitrary), the unpad/pad index
math and its varlen sequences, and the mapping of the registry's aten arguments to flashgen's.
Then both integrations end to end on the CPU, with flashgen's kernels replaced by float64
references written from flash-attn's definitions (bottom-right causal, windows, GQA): a small
random Llama built with "sdpa" and with flashgen's name from the same weights agrees in float32
on prefill (with and without padding, with a 4-D mask, packed sequences), a training step and
greedy `generate()`; and aten's flash operators, overridden on the CPU dispatch key, return
what their schemas say and differentiate through aten's own autograd formulas. The GPU side is
tests/gpu/test_torch_ecosystem.py.

Skips without torch; the transformers tests skip without transformers.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from flashgen.torch import sdpa_backend as sb  # noqa: E402
from flashgen.torch import transformers_attention as ta  # noqa: E402
from flashgen.torch.selection import UnsupportedCall  # noqa: E402

# -- float64 references with flash-attn's conventions -------------------------------------------


def _allowed(sq: int, sk: int, causal: bool, window=(-1, -1)):
    """flash-attn's visibility: key j from query i, diagonal i + sk - sq (bottom-right)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        ok &= j <= diag
    elif right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok


def _ref(q, k, v, causal=False, scale=None, window=(-1, -1), softcap=0.0, sink=None):
    """One sequence: q (sq, h, d), k and v (sk, kv_heads, d) -> (out (sq, h, d) in q's
    dtype, lse (h, sq) float64). Differentiable (float64 inside)."""
    h, d = q.shape[1], q.shape[2]
    rep = h // k.shape[1]
    qd, kd, vd = (
        q.double(),
        k.double().repeat_interleave(rep, 1),
        v.double().repeat_interleave(rep, 1),
    )
    s = torch.einsum("qhd,khd->hqk", qd, kd) * (d**-0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_allowed(q.shape[0], k.shape[0], causal, window), -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double()[:, None, None].expand(h, s.shape[1], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("hqk,khd->qhd", p, vd)
    return out.to(q.dtype), lse


class RefKernels:
    """flash_attn_func / flash_attn_varlen_func on the CPU, recording each call."""

    def __init__(self):
        self.calls = []

    def dense(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        *,
        learnable_sink=None,
    ):
        assert dropout_p == 0.0 and alibi_slopes is None
        self.calls.append(("dense", tuple(q.shape), tuple(k.shape), causal, tuple(window_size)))
        outs = [
            _ref(q[b], k[b], v[b], causal, softmax_scale, window_size, softcap, learnable_sink)[0]
            for b in range(q.shape[0])
        ]
        return torch.stack(outs)

    def varlen(
        self,
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
        *,
        learnable_sink=None,
    ):
        assert dropout_p == 0.0 and alibi_slopes is None and block_table is None
        assert cu_q.dtype == cu_k.dtype == torch.int32
        lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
        assert max_q == max(lq) and max_k == max(lk)
        self.calls.append(("varlen", tuple(q.shape), tuple(k.shape), causal, tuple(window_size)))
        outs = []
        for b in range(len(lq)):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            outs.append(
                _ref(
                    q[qs], k[ks], v[ks], causal, softmax_scale, window_size, softcap, learnable_sink
                )[0]
            )
        return torch.cat(outs)


# -- the name rule, and imports ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["fgen", "fg", "my_attention", "FG-kernels"])
def test_plain_names_are_taken(name):
    assert ta.check_name(name) == name


@pytest.mark.parametrize(
    "name, match",
    [
        ("flashgen", "contains 'flash'"),
        ("FlashGen", "contains 'flash'"),
        ("my_flash", "contains 'flash'"),
        ("sdpa", "transformers' own"),
        ("eager", "transformers' own"),
        ("paged|fg", "transformers' own"),
        ("org/kernel", "Hub kernel"),
        ("org/kernel:fn", "Hub kernel"),
        ("", "non-empty"),
        (3, "non-empty"),
    ],
)
def test_names_transformers_would_misread_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        ta.check_name(name)


def test_importing_flashgen_torch_and_the_integrations_imports_no_transformers():
    code = (
        "import sys, flashgen.torch\n"
        "from flashgen.torch import transformers_attention, sdpa_backend\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_register_refuses_a_flash_name_before_importing_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import would fail
    with pytest.raises(ValueError, match="contains 'flash'"):
        ta.register("flash_attention_fg")


# -- masks, plans, unpad / pad -----------------------------------------------------------------


def _left_padded(lengths, total):
    return torch.stack([torch.arange(total) >= total - n for n in lengths])


def _right_padded(lengths, total):
    return torch.stack([torch.arange(total) < n for n in lengths])


def test_padding_plan_is_dense_without_padding_and_varlen_with_it():
    full = torch.ones(2, 5, dtype=torch.bool)
    assert ta.padding_plan(full, full, True).kind == "dense"
    k_valid = _left_padded([5, 3], 5)
    plan = ta.padding_plan(k_valid, k_valid, True)
    assert plan.kind == "padded" and plan.causal
    assert plan.indices_k.tolist() == [0, 1, 2, 3, 4, 7, 8, 9]
    assert plan.cu_seqlens_k.dtype == torch.int32 and plan.cu_seqlens_k.tolist() == [0, 5, 8]
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (5, 5)


def test_unpad_and_pad_are_inverse_on_the_kept_positions_and_zero_elsewhere():
    x = torch.randn(3, 6, 2, 4)
    valid = torch.rand(3, 6) > 0.4
    idx = valid.flatten().nonzero().flatten()
    y = ta.unpad(x.transpose(1, 2).transpose(1, 2), idx)  # a view: gathered as laid out
    assert torch.equal(y, x.reshape(18, 2, 4)[idx])
    back = ta.pad(y, idx, 3, 6)
    assert torch.equal(back[valid], x[valid]) and not back[~valid].any()


def test_a_2d_mask_keeps_the_last_keys_as_queries_and_a_single_query_always():
    mask = _left_padded([6, 4], 6).long()
    k_valid, q_valid = ta.padding_from_2d(mask, 2, 6)
    assert torch.equal(q_valid, k_valid[:, -2:])
    _, q_one = ta.padding_from_2d(_right_padded([6, 4], 6), 1, 6)
    assert q_one.all()
    longer, _ = ta.padding_from_2d(torch.ones(2, 9), 1, 6)  # read from the right
    assert longer.shape == (2, 6)


def test_the_padding_mask_of_the_varlen_call_is_sdpas_causal_padding_mask():
    """What varlen computes per sequence (bottom-right causal on the kept tokens) is, on the
    kept rows, transformers' causal mask with left padding, with a cache and without."""
    for lengths, q_len, kv_len in (([7, 4, 1], 7, 7), ([9, 5], 3, 9), ([9, 5], 1, 9)):
        k_valid = _left_padded(lengths, kv_len)
        q_valid = k_valid[:, kv_len - q_len :]
        mask = ta.mask_4d_from_padding(k_valid, q_valid, True)[:, 0]
        pos_q = torch.arange(kv_len - q_len, kv_len)
        sdpa = (torch.arange(kv_len)[None, :] <= pos_q[:, None])[None] & k_valid[:, None, :]
        assert torch.equal(mask[q_valid], sdpa[q_valid])
        assert not mask[~q_valid].any()


@pytest.mark.parametrize("window", [(2, 2), (3, 3)])
def test_the_sliding_window_mask_is_transformers_sliding_window(window):
    k_valid = _right_padded([8, 6], 8)
    mask = ta.mask_4d_from_padding(k_valid, k_valid, True, window)[:, 0]
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    sliding = (j <= i) & (j > i - (window[0] + 1))  # kv_idx > q_idx - sliding_window
    want = sliding[None] & k_valid[:, None, :] & k_valid[:, :, None]
    assert torch.equal(mask, want)


def _sdpa_style(k_valid, q_len, causal=True, float_mask=False):
    """A transformers-style 4-D mask: queries at the last q_len key positions."""
    kv_len = k_valid.shape[1]
    pos_q = torch.arange(kv_len - q_len, kv_len)
    m = k_valid[:, None, :].expand(-1, q_len, -1).clone()
    if causal:
        m &= torch.arange(kv_len)[None, None, :] <= pos_q[None, :, None]
    m = m[:, None]
    if float_mask:
        return torch.where(m, 0.0, torch.finfo(torch.float32).min)
    return m


@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_4d_padding_masks_are_classified_as_padding(causal, float_mask):
    k_valid = _left_padded([6, 3], 6)
    for q_len in (6, 2, 1):
        mask = _sdpa_style(k_valid, q_len, causal, float_mask)
        found = ta.classify_mask(mask, 2, q_len, 6, prefer_causal=True)
        assert found.kind == "padding", found.reason
        assert found.causal == (causal and q_len > 1) or q_len == 1
        assert torch.equal(found.k_valid, k_valid)


def test_a_right_padded_causal_4d_mask_is_padding_whose_pad_queries_are_dropped():
    """Eager-style: pad queries of right padding see the keys before them."""
    k_valid = _right_padded([6, 4], 6)
    mask = _sdpa_style(k_valid, 6, True, float_mask=True)
    found = ta.classify_mask(mask, 2, 6, 6, prefer_causal=True)
    assert found.kind == "padding" and found.causal
    assert torch.equal(found.k_valid, k_valid) and torch.equal(found.q_valid, k_valid)


def test_a_plain_causal_4d_mask_becomes_a_dense_causal_call():
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(3, 2, 5, 5)
    found = ta.classify_mask(mask, 3, 5, 5, prefer_causal=False)
    assert found.kind == "padding" and found.causal
    assert ta.padding_plan(found.k_valid, found.q_valid, found.causal).kind == "dense"


def test_a_static_cache_mask_drops_the_unwritten_keys():
    """A prefill of 3 tokens into a cache of 8 slots: keys 3..7 are never seen."""
    mask = torch.zeros(1, 1, 3, 8, dtype=torch.bool)
    mask[0, 0, :, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    found = ta.classify_mask(mask, 1, 3, 8, prefer_causal=True)
    assert found.kind == "padding" and found.causal
    assert found.k_valid.tolist() == [[True] * 3 + [False] * 5]


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: torch.rand(2, 1, 4, 4) - 0.5, "bias"),  # an additive bias, not a mask
        (lambda: torch.rand(2, 1, 4, 4) > 0.5, "not padding"),  # a random pattern
        (
            lambda: (
                torch.ones(2, 2, 4, 4, dtype=torch.bool)
                .tril()
                .index_fill(1, torch.tensor([1]), True)
            ),
            "heads",
        ),
        (lambda: torch.ones(2, 4, 4, dtype=torch.bool), "3-D"),
    ],
)
def test_arbitrary_masks_are_classified_as_arbitrary(make, reason):
    found = ta.classify_mask(make(), 2, 4, 4, prefer_causal=True)
    assert found.kind == "arbitrary" and reason in found.reason


def test_a_window_mask_is_padding_only_with_its_window():
    k_valid = torch.ones(1, 6, dtype=torch.bool)
    mask = ta.mask_4d_from_padding(k_valid, k_valid, True, (2, 2))
    assert ta.classify_mask(mask, 1, 6, 6, True, (2, 2)).kind == "padding"
    assert ta.classify_mask(mask, 1, 6, 6, True).kind == "arbitrary"


def test_packed_position_ids_give_the_sequences_and_their_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu = ta.cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32
    assert ta.cu_seqlens_from_position_ids(torch.arange(5)[None]) is None
    plan = ta.packed_plan(cu, cu, True)
    assert plan.kind == "packed" and (plan.max_seqlen_q, plan.max_seqlen_k) == (4, 4)
    mask = ta.packed_mask_4d(cu, cu, True)[0, 0]
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    assert torch.equal(mask, (seq[:, None] == seq[None, :]) & (j <= i))


def test_the_memo_reuses_a_result_per_tensor_until_it_changes():
    memo = ta._Memo()
    t = torch.ones(3)
    calls = []
    make = lambda: calls.append(1) or len(calls)  # noqa: E731
    assert memo.get(t, ("k",), make) == memo.get(t, ("k",), make) == 1
    t.add_(1)  # a new version: computed again
    assert memo.get(t, ("k",), make) == 2
    assert memo.get(torch.ones(3), ("k",), make) == 3  # another tensor


# -- transformers, end to end on the CPU --------------------------------------------------------


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture
def ref_kernels(monkeypatch):
    """flashgen's kernels replaced by the float64 references, CPU tensors taken as served,
    float32 served as it is (the references take it)."""
    ref = RefKernels()
    monkeypatch.setattr(ta, "_kernels", lambda: (ref.dense, ref.varlen))
    monkeypatch.setattr(ta, "_served_device", lambda t: True)
    monkeypatch.setattr(ta, "_target_dtype", lambda q, m: torch.float32)
    return ref


NAME = "fg_cpu_test"


def _llama_pair(transformers, name=NAME, **overrides):
    """Two small random Llamas (2 layers, GQA 4/2 heads) with the same weights: sdpa, flashgen."""
    ta.register(name)
    cfg = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    cfg.update(overrides)
    config = transformers.LlamaConfig(**cfg)
    return _pair(transformers, config, name)


def _pair(transformers, config, name):
    """The model of `config` built twice, with "sdpa" and with `name`, from the same weights
    (each its own config: models read the implementation from their config at every call)."""
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    sdpa = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    fg = auto.from_config(copy.deepcopy(config), attn_implementation=name)
    fg.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa"
    assert fg.config._attn_implementation == name
    return sdpa.eval(), fg.eval()


def _ids(batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 96, (batch, seq), generator=g)


def test_prefill_matches_sdpa_without_a_mask(transformers, ref_kernels):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(2, 9)
    with torch.no_grad():
        a, b = sdpa(ids).logits, fg(ids).logits
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    assert {c[0] for c in ref_kernels.calls} == {"dense"} and all(c[3] for c in ref_kernels.calls)
    assert ref_kernels.calls[0][2] == (2, 9, 2, 16)  # k keeps its 2 heads: no repeat_kv


@pytest.mark.parametrize("side", ["left", "right"])
def test_prefill_with_padding_runs_varlen_and_matches_sdpa_on_the_tokens(
    transformers, ref_kernels, side
):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(3, 8)
    lengths = [8, 5, 2]
    mask = (_left_padded if side == "left" else _right_padded)(lengths, 8).long()
    with torch.no_grad():
        a = sdpa(ids, attention_mask=mask).logits
        b = fg(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=2e-5, rtol=1e-4)
    assert [c[0] for c in ref_kernels.calls] == ["varlen", "varlen"]  # one per layer
    assert ref_kernels.calls[0][1] == (sum(lengths), 4, 16)


def test_a_4d_padding_mask_runs_varlen_and_an_arbitrary_one_falls_back(transformers, ref_kernels):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(2, 6)
    mask = _sdpa_style(_left_padded([6, 4], 6), 6, float_mask=True)
    with torch.no_grad():
        a, b = sdpa(ids, attention_mask=mask).logits, fg(ids, attention_mask=mask).logits
    keep = _left_padded([6, 4], 6)
    torch.testing.assert_close(b[keep], a[keep], atol=2e-5, rtol=1e-4)
    assert [c[0] for c in ref_kernels.calls] == ["varlen", "varlen"]
    ref_kernels.calls.clear()
    odd = torch.ones(6, 6, dtype=torch.bool).tril()
    odd[4, 1] = False  # a hole no padding makes
    odd = odd[None, None].expand(2, 1, 6, 6)
    ta._WARNED.clear()
    with pytest.warns(UserWarning, match="falls back to transformers' sdpa"):
        with torch.no_grad():
            b = fg(ids, attention_mask=odd).logits
    with torch.no_grad():
        a = sdpa(ids, attention_mask=odd).logits
    torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    assert not ref_kernels.calls


def test_packed_sequences_from_position_ids_run_varlen_and_match_sdpa(transformers, ref_kernels):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(1, 9)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    with torch.no_grad():
        a = sdpa(ids, position_ids=pos, use_cache=False).logits  # sdpa packs only without one
        b = fg(ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    if importlib.util.find_spec("transformers.masking_utils") is not None:
        assert [c[0] for c in ref_kernels.calls] == ["varlen", "varlen"]
    # (before 4.53 sdpa's models build a 4-D causal mask here, packing nothing: so do we)


def test_a_training_step_gives_sdpas_loss_and_gradients(transformers, ref_kernels):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(2, 7)
    mask = _right_padded([7, 4], 7).long()
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (sdpa, fg):
        model.train()
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = grads
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)


def test_greedy_generate_with_the_cache_gives_sdpas_tokens(transformers, ref_kernels):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(2, 6)
    mask = _left_padded([6, 3], 6).long()
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = sdpa.generate(ids, **kw)
        b = fg.generate(ids, **kw)
    assert torch.equal(a, b)
    decode = [c for c in ref_kernels.calls if c[1][0] == 2]  # varlen q of one token per row
    assert decode and all(c[0] == "varlen" and c[3] for c in decode)
    ref_kernels.calls.clear()
    with torch.no_grad():  # no padding: dense decode steps, q of 1 against the cache
        a = sdpa.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = fg.generate(ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    steps = [c for c in ref_kernels.calls if c[1][1] == 1]
    assert steps and all(c[0] == "dense" and c[3] and c[2][1] > 1 for c in steps)


def test_sliding_window_maps_to_the_flash_window_and_matches_sdpa(transformers, ref_kernels):
    ta.register(NAME)
    config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        max_position_embeddings=64,
    )
    sdpa, fg = _pair(transformers, config, NAME)
    ids = _ids(2, 10)
    mask = _left_padded([10, 7], 10).long()
    with torch.no_grad():
        a = sdpa(ids, attention_mask=mask).logits
        b = fg(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=2e-5, rtol=1e-4)
    assert all(c[4] == (3, 3) for c in ref_kernels.calls)


def test_off_cuda_it_falls_back_to_sdpa_once_or_raises_when_strict(transformers):
    sdpa, fg = _llama_pair(transformers)
    ids = _ids(2, 5)
    mask = _left_padded([5, 3], 5).long()
    ta._WARNED.clear()
    with pytest.warns(UserWarning, match="tensors on cpu"):
        with torch.no_grad():
            b = fg(ids, attention_mask=mask).logits
    with torch.no_grad():
        a = sdpa(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        with torch.no_grad():
            fg(ids, attention_mask=mask)
    _, strict = _llama_pair(transformers, name="fg_cpu_strict")
    ta.register("fg_cpu_strict", strict=True)
    with pytest.raises(UnsupportedCall, match="tensors on cpu"):
        with torch.no_grad():
            strict(ids)


def test_a_float32_model_falls_back_and_a_half_target_is_cast_to(transformers, monkeypatch):
    sdpa, fg = _llama_pair(transformers)
    monkeypatch.setattr(ta, "_served_device", lambda t: True)
    ids = _ids(1, 5)
    ta._WARNED.clear()
    with pytest.warns(UserWarning, match="float32 attention"):
        with torch.no_grad():
            torch.testing.assert_close(fg(ids).logits, sdpa(ids).logits)
    q = torch.randn(1, 4, 3, 16)
    assert ta._target_dtype(q, torch.nn.Linear(2, 2).to(torch.bfloat16)) == torch.bfloat16
    assert ta._target_dtype(q, torch.nn.Linear(2, 2)) is None


# -- torch's FlashAttention registry: argument mapping -------------------------------------------


def test_registry_arguments_map_to_flashgens():
    args = sb.forward_arguments(
        64, 0.1, True, False, scale=0.2, window_size_left=5, window_size_right=None, num_splits=4
    )
    assert args == sb.FlashgenArgs(0.1, 0.2, True, 5, -1)
    assert sb.forward_arguments(64).softmax_scale == pytest.approx(1 / 8)
    assert sb.forward_arguments(64, window_size_left=-1).window_left == -1
    assert sb.backward_arguments(16, 0.0, False, window_size_right=3) == sb.FlashgenArgs(
        0.0, 0.25, False, -1, 3
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(return_debug_mask=True), "return_debug_mask"),
        (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
        (dict(seqused_k=torch.ones(2)), "seqused_k"),
        (dict(block_table=torch.ones(2, 2)), "block_table"),
        (dict(some_future_arg=1), "some_future_arg"),
    ],
)
def test_registry_arguments_flashgen_cannot_serve_are_refused(kwargs, match):
    with pytest.raises(UnsupportedCall, match=match) as err:
        sb.forward_arguments(64, **kwargs)
    assert "restore_flash_attention_impl" in str(err.value)


def test_the_flash_operators_refuse_a_value_of_another_head_dim():
    """aten's flash-attention operators take one head dim; a v of its own is refused (not
    padded to q's), naming flash_attn_func, which takes it."""
    q, k = torch.zeros(1, 4, 2, 192), torch.zeros(1, 4, 2, 192)
    v = torch.zeros(1, 4, 2, 128)
    args = sb.forward_arguments(192)
    with pytest.raises(UnsupportedCall, match="value's head dim 128 differs from query's 192"):
        sb._forward(q, k, v, None, None, 4, 4, args)
    with pytest.raises(UnsupportedCall, match="flash_attn_func"):
        sb._backward(q[..., :128], q, k, v, q[..., :128], None, None, None, 4, 4, args, None)


def test_philox_state_round_trips_through_the_rng_state_tensor():
    for seed, offset in ((0, 0), (123, 8), (2**64 - 1, 2**63 + 4)):
        t = sb.pack_philox(seed, offset)
        assert t.dtype == torch.uint64 and t.shape == (2,)
        assert sb.unpack_philox(t) == (seed, offset)
    with pytest.raises(UnsupportedCall, match="rng_state"):
        sb.unpack_philox(torch.zeros(3, dtype=torch.int64))


def test_a_torch_without_the_registry_is_told_the_version_it_needs():
    msg = sb.registry_missing("2.9.1", False)
    assert "2.9.1" in msg and "2.10" in msg and "register_flash_attention_impl" in msg
    assert sb.registry_missing("2.11.0", True) is None


def test_the_layout_rule_reads_views_in_place_and_copies_others():
    wide = torch.zeros(2, 8, 4, 24, dtype=torch.float16)
    view = wide[..., :16].transpose(1, 2)  # strides 768, 24, 96, 1: read as it is
    assert sb.kernel_readable(view.shape, view.stride(), 0, 2) and sb._ready(view, 16) is view
    odd = torch.zeros(2, 8, 4, 20, dtype=torch.float16)[..., :16]  # row stride 20
    assert not sb.kernel_readable(odd.shape, odd.stride(), 0, 2)
    assert not sb.kernel_readable((2, 16), (16, 1), 3, 2)  # starts mid-vector
    y = sb._ready(odd, 16)  # copied
    assert y.is_contiguous() and sb.kernel_readable(y.shape, y.stride(), 0, 2)
    z = sb._ready(view, 24)  # zero-padded: a copy the kernels read
    assert z.shape[-1] == 24 and not z[..., 16:].any()


def test_register_and_activate_round_trip_in_the_registry():
    attention = pytest.importorskip("torch.nn.attention")
    if not hasattr(attention, "register_flash_attention_impl"):
        with pytest.raises(RuntimeError, match="2.10"):
            sb.register_sdpa_impl()
        return
    assert sb.register_sdpa_impl("flashgen_cpu_test") in attention.list_flash_attention_impls()
    try:
        sb.activate("flashgen_cpu_test")
        assert sb.is_active() and sb._ACTIVE.dispatch_key == "CUDA"
        assert set(sb.REQUIRED_OPS) <= set(sb._ACTIVE.ops)
        if hasattr(attention, "current_flash_attention_impl"):
            assert attention.current_flash_attention_impl() == "flashgen_cpu_test"
    finally:
        sb.deactivate()
    assert not sb.is_active()


# -- torch's FlashAttention registry: aten's operators on the CPU key ---------------------------


def _ref_backward(dout, q, k, v, out, causal, scale, window):
    """flash-attn's backward of one sequence in float64 (dS = P (dP - D)), GQA summed."""
    h, d = q.shape[1], q.shape[2]
    rep = h // k.shape[1]
    qd, kd, vd = (
        q.double(),
        k.double().repeat_interleave(rep, 1),
        v.double().repeat_interleave(rep, 1),
    )
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    s = s.masked_fill(~_allowed(q.shape[0], k.shape[0], causal, window), -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    do = dout.double()
    dv = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, vd)
    delta = (do * out.double()).sum(-1).T[:, :, None]
    ds = p * (dp - delta)
    dq = torch.einsum("hqk,khd->qhd", ds, kd) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, qd) * scale
    fold = lambda g: g.view(g.shape[0], k.shape[1], rep, d).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _sequences(q, k, cu_q, cu_k):
    if cu_q is None:
        return [(b, slice(None), slice(None)) for b in range(q.shape[0])]
    return [
        (None, slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1])))
        for i in range(cu_q.numel() - 1)
    ]


class RefOps:
    """torch.ops.flashgen.fwd / bwd on the CPU (float64 references), recording the calls."""

    def __init__(self):
        self.fwd_calls, self.bwd_calls = [], []

    @staticmethod
    def _rows(t, b, s):
        return t[b][s] if b is not None else t[s]

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, args):
        self.fwd_calls.append((tuple(q.shape), args))
        out = torch.empty(q.shape, dtype=q.dtype)  # contiguous, as flashgen's op allocates it
        lse = torch.empty(
            (q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0]),
            dtype=torch.float32,
        )
        for b, sq, sk in _sequences(q, k, cu_q, cu_k):
            o, l_ = _ref(
                self._rows(q, b, sq),
                self._rows(k, b, sk),
                self._rows(v, b, sk),
                args.causal,
                args.softmax_scale,
                (args.window_left, args.window_right),
            )
            if b is not None:
                out[b], lse[b] = o, l_.float()
            else:
                out[sq], lse[:, sq] = o, l_.float()
        return out, lse, sb._cpu_i64(11), sb._cpu_i64(4 if args.dropout_p else 0)

    def bwd(self, dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, args, det):
        self.bwd_calls.append((tuple(q.shape), args, int(seed), int(offset), det))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
        for b, sq, sk in _sequences(q, k, cu_q, cu_k):
            rows = [
                self._rows(t, b, s) for t, s in ((dout, sq), (q, sq), (k, sk), (v, sk), (out, sq))
            ]
            g = _ref_backward(
                *rows, args.causal, args.softmax_scale, (args.window_left, args.window_right)
            )
            for dst, src, s in ((dq, g[0], sq), (dk, g[1], sk), (dv, g[2], sk)):
                if b is not None:
                    dst[b][s] = src
                else:
                    dst[s] = src
        return dq, dk, dv


@pytest.fixture
def cpu_registry(monkeypatch):
    """flashgen installed over aten's flash operators on the CPU dispatch key, its ops
    replaced by the float64 references."""
    ops = RefOps()
    monkeypatch.setattr(sb, "_flashgen_fwd", ops.fwd)
    monkeypatch.setattr(sb, "_flashgen_bwd", ops.bwd)
    handle = sb._install("CPU")
    yield ops
    handle.remove()
    assert not sb.is_active()


def _sdpa_reference(q, k, v, causal, scale=None):
    """(batch, heads, seq, d) attention in float64 (GQA by repeating k, v)."""
    rep = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(rep, 1) for t in (k, v))
    mask = _allowed(q.shape[2], k.shape[2], causal)
    return F.scaled_dot_product_attention(q.double(), kd, vd, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 16), (4, 2, 24)])
def test_sdpa_flash_operator_and_its_backward_run_flashgen(
    cpu_registry, causal, heads, kv_heads, d
):
    torch.manual_seed(0)
    q = torch.randn(2, heads, 7, d, requires_grad=True)
    k = torch.randn(2, kv_heads, 7, d, requires_grad=True)
    v = torch.randn(2, kv_heads, 7, d, requires_grad=True)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=0.3)
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, debug = res
    assert out.shape == q.shape and out.stride() == q.stride()  # empty_like(q)'s, as meta's
    assert lse.shape == (2, heads, 7) and lse.dtype == torch.float32
    assert (max_q, max_k) == (7, 7) and rng.dtype == torch.uint64 and debug.numel() == 0
    ref = _sdpa_reference(q, k, v, causal, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)
    ((shape, args),) = cpu_registry.fwd_calls
    assert shape == (2, 7, heads, d) and args == sb.FlashgenArgs(0.0, 0.3, causal, -1, -1)
    assert len(cpu_registry.bwd_calls) == 1


def test_outputs_and_gradients_are_laid_out_as_empty_like_without_a_copy_for_projections(
    cpu_registry,
):
    """q, k, v as models make them (a (batch, seq, heads * d) projection viewed and
    transposed): flashgen's contiguous (batch, seq, heads, d) results are those strides."""
    x = torch.randn(2, 7, 3, 4, 16, requires_grad=True)  # (batch, seq, q/k/v, heads, d)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
    assert out.stride() == torch.empty_like(q).stride() == (7 * 4 * 16, 16, 4 * 16, 1)
    assert out.transpose(1, 2).is_contiguous()  # flashgen's own buffer, not a copy
    dout = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dout)
    ref = _sdpa_reference(q, k, v, False)
    (dx_ref,) = torch.autograd.grad(ref, x, dout.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-5)


def test_varlen_flash_operator_with_a_window_and_its_backward_run_flashgen(cpu_registry):
    torch.manual_seed(1)
    bounds = ((0, 5), (5, 7), (7, 14))
    cu = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    q, k, v = (torch.randn(14, 2, 16, requires_grad=True) for _ in range(3))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, 7, 7, 0.0, True, False, window_size_left=2, window_size_right=0
    )
    assert out.shape == (14, 2, 16) and lse.shape == (2, 14)
    ref = torch.cat([_ref(q[a:b], k[a:b], v[a:b], True, None, (2, 0))[0] for a, b in bounds])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert cpu_registry.fwd_calls[0][1] == sb.FlashgenArgs(0.0, 0.25, True, 2, 0)
    assert cpu_registry.bwd_calls[0][1] == sb.FlashgenArgs(0.0, 0.25, True, 2, 0)


def test_an_unserved_head_dim_is_padded_and_the_scale_is_the_callers(cpu_registry, monkeypatch):
    monkeypatch.setattr(
        sb, "_kernel_head_dim", lambda t, kind: 24 if t.shape[-1] == 20 else t.shape[-1]
    )
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 20, requires_grad=True) for _ in range(3))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
    assert out.shape == (1, 2, 5, 20)
    ref = _sdpa_reference(q, k, v, False)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))  # an expanded dout
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for g, r in zip(grads, ref_grads):
        assert g.shape == (1, 2, 5, 20)
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)
    ((shape, args),) = cpu_registry.fwd_calls
    assert shape == (1, 5, 2, 24) and args.softmax_scale == pytest.approx(20**-0.5)
    assert cpu_registry.bwd_calls[0][0] == (1, 5, 2, 24)


def test_dropouts_philox_state_reaches_the_backward(cpu_registry):
    q, k, v = (torch.randn(1, 2, 4, 16, requires_grad=True) for _ in range(3))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.25)
    assert sb.unpack_philox(res[6]) == (11, 4)  # the reference op's seed and offset
    res[0].sum().backward()
    ((_, args, seed, offset, _),) = cpu_registry.bwd_calls
    assert (args.dropout_p, seed, offset) == (0.25, 11, 4)


def test_what_flashgen_cannot_serve_raises_through_the_operator(cpu_registry):
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(UnsupportedCall, match="return_debug_mask"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, True)
    with pytest.raises(UnsupportedCall, match="alibi_slopes"):
        x = q.transpose(1, 2)
        torch.ops.aten._flash_attention_forward(
            x, x, x, None, None, 4, 4, 0.0, False, False, alibi_slopes=torch.ones(2)
        )
