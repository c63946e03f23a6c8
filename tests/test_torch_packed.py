"""flash-attn 2's packed entry points (flashgen.torch.packed), without a GPU: each hands views
of its packed tensor (no copy) and every argument on to flash_attn_func or
flash_attn_varlen_func, and refuses a tensor of another layout naming the one it needs. The
GPU suite (tests/gpu/test_torch.py) checks their results and gradients against the unpacked
calls bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen.torch import (  # noqa: E402
    UnsupportedCall,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    packed,
)

KW = dict(dropout_p=0.1, softmax_scale=0.3, causal=True, window_size=(5, 0), softcap=2.0,
          alibi_slopes=None, deterministic=True, return_attn_probs=True)  # fmt: skip
CALLED = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
          "deterministic", "return_attn_probs")  # fmt: skip


@pytest.fixture
def calls(monkeypatch):
    """The calls the packed functions make, as (function name, args, keyword args)."""
    seen = []

    def recorder(name):
        def fn(*args, **kwargs):
            seen.append((name, args, kwargs))
            return "result"

        return fn

    monkeypatch.setattr(packed, "flash_attn_func", recorder("flash_attn_func"))
    monkeypatch.setattr(packed, "flash_attn_varlen_func", recorder("flash_attn_varlen_func"))
    return seen


def _is_view(view, base, dim, index):
    """`view` is `base.select(dim, index)`: the same storage, offset and strides."""
    want = base.select(dim, index)
    return (
        view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and view.storage_offset() == want.storage_offset()
        and view.stride() == want.stride()
        and view.shape == want.shape
    )


def _positional(args, start):
    """The eight flash-attn arguments after the tensors (and sequence boundaries)."""
    return dict(zip(CALLED, args[start:]))


def test_qkvpacked_passes_views_and_every_argument(calls):
    qkv = torch.randn(2, 17, 3, 4, 16)
    sink = torch.randn(4)
    assert flash_attn_qkvpacked_func(qkv, **KW, learnable_sink=sink) == "result"
    ((name, args, kwargs),) = calls
    assert name == "flash_attn_func"
    assert all(_is_view(args[i], qkv, 2, i) for i in range(3))
    assert _positional(args, 3) == KW and kwargs == {"learnable_sink": sink}


def test_kvpacked_passes_q_and_views_of_kv(calls):
    q, kv = torch.randn(2, 9, 4, 16), torch.randn(2, 17, 2, 2, 16)
    flash_attn_kvpacked_func(q, kv, **KW)
    ((name, args, kwargs),) = calls
    assert name == "flash_attn_func" and args[0] is q
    assert _is_view(args[1], kv, 2, 0) and _is_view(args[2], kv, 2, 1)
    assert _positional(args, 3) == KW and kwargs == {"learnable_sink": None}


def test_varlen_qkvpacked_uses_one_set_of_boundaries(calls):
    qkv, cu = torch.randn(30, 3, 4, 16), torch.tensor([0, 10, 30], dtype=torch.int32)
    flash_attn_varlen_qkvpacked_func(qkv, cu, 20, **KW)
    ((name, args, _),) = calls
    assert name == "flash_attn_varlen_func"
    assert all(_is_view(args[i], qkv, 1, i) for i in range(3))
    assert args[3] is cu and args[4] is cu and args[5:7] == (20, 20)
    assert _positional(args, 7) == KW


def test_varlen_kvpacked_passes_both_sets_of_boundaries(calls):
    q, kv = torch.randn(12, 4, 16), torch.randn(30, 2, 2, 16)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 30], dtype=torch.int32)
    flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 7, 20, **KW)
    ((name, args, _),) = calls
    assert name == "flash_attn_varlen_func" and args[0] is q
    assert _is_view(args[1], kv, 1, 0) and _is_view(args[2], kv, 1, 1)
    assert args[3] is cu_q and args[4] is cu_k and args[5:7] == (7, 20)
    assert _positional(args, 7) == KW


def test_defaults_are_flash_attn_s(calls):
    flash_attn_qkvpacked_func(torch.randn(1, 4, 3, 2, 16))
    ((_, args, kwargs),) = calls
    assert _positional(args, 3) == dict(
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False,
    )  # fmt: skip
    assert kwargs == {"learnable_sink": None}


@pytest.mark.parametrize(
    ("call", "layout"),
    [
        (lambda: flash_attn_qkvpacked_func(torch.randn(2, 17, 2, 4, 16)),
         r"qkv must be \(batch, seqlen, 3, heads, head_dim\) \(dimension 2 of size 3\), got "
         r"shape \(2, 17, 2, 4, 16\)"),
        (lambda: flash_attn_qkvpacked_func(torch.randn(17, 3, 4, 16)),
         r"qkv must be \(batch, seqlen, 3, heads, head_dim\)"),
        (lambda: flash_attn_kvpacked_func(torch.randn(2, 9, 4, 16), torch.randn(2, 17, 3, 2, 16)),
         r"kv must be \(batch, seqlen_k, 2, kv_heads, head_dim\)"),
        (lambda: flash_attn_varlen_qkvpacked_func(torch.randn(2, 17, 3, 4, 16), None, 17),
         r"qkv must be \(total, 3, heads, head_dim\)"),
        (lambda: flash_attn_varlen_kvpacked_func(torch.randn(12, 4, 16), [1, 2], None, None, 1, 1),
         r"kv must be a tensor \(total_k, 2, kv_heads, head_dim\), got list"),
    ],
)  # fmt: skip
def test_a_tensor_of_another_layout_is_refused_naming_the_layout(calls, call, layout):
    with pytest.raises(UnsupportedCall, match=layout):
        call()
    assert calls == []


def test_the_packed_names_are_exported():
    import flashgen.torch

    for name in packed.__all__:
        assert name in flashgen.torch.__all__
        assert getattr(flashgen.torch, name) is getattr(packed, name)
