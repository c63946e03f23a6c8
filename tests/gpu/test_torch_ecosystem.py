"""flashgen in the PyTorch ecosystem on a GPU: a transformers model built with flashgen's
attention implementation (`flashgen.torch.transformers_attention`), and SDPA's FLASH backend
after flashgen is activated in torch's FlashAttention registry (`flashgen.torch.sdpa_backend`).

transformers: a small random-weight Llama (2 layers, hidden 256, 4 heads, 2 KV heads, head dim
64, vocab 1000; built from a LlamaConfig, nothing downloaded) in bfloat16, built with "eager",
"sdpa" and flashgen's name from the same weights. flashgen's logits, loss and gradients must
differ from sdpa's by at most twice what eager's differ from sdpa's (plus a floor of a few
bfloat16 ulps): prefill with and without left padding, one training step with right padding.
Greedy `generate()` with the KV cache (8 new tokens, left-padded and unpadded prompts) must
give sdpa's tokens, except where sdpa's own logits hold a near tie at the first differing step
(bfloat16 rounding may break a tie either way; the rows are not compared after it). The
attention function is also checked per call against float64 on decode-step shapes.

SDPA registry (torch >= 2.10): after `activate()`, `F.scaled_dot_product_attention` under
`sdpa_kernel(SDPBackend.FLASH_ATTENTION)` runs flashgen's kernels (the profiler sees `fa_fwd_*`
and `fa_bwd_*` kernels and none of PyTorch's FlashAttention-2), and its output and gradients
are within twice the built-in FlashAttention-2's error from a float64 reference (plus a floor);
`deactivate()` brings the built-in kernels back.

Skips without torch or a CUDA device (and, like the whole GPU suite, without PyCUDA); the
transformers tests skip without transformers. Kernels (H200, bf16 unless said): the forward and
backward of dense and causal d = 64 and 128 in fp16 and bf16, causal GQA d = 64 and causal
varlen d = 64 are in examples/torch_kernels.yaml; the causal varlen GQA d = 64 forward and
backward (the padded Llama calls) are not and compile into the kernel cache on first use
(about a minute each).
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for the flashgen.torch tests", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from flashgen.torch import sdpa_backend  # noqa: E402
from flashgen.torch import transformers_attention as ta  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

DEV = "cuda"
NAME = "fgen_gpu_test"
BF16_ULP = 2.0**-8


def _max_diff(a, b, keep=None) -> float:
    a, b = a.float(), b.float()
    if keep is not None:
        a, b = a[keep], b[keep]
    return (a - b).abs().max().item()


# -- transformers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(transformers):
    """eager, sdpa and flashgen Llamas with the same random weights, bf16 on the GPU."""
    ta.register(NAME)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    )
    built = {}
    for impl in ("sdpa", "eager", NAME):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=impl
        )
        if built:
            model.load_state_dict(built["sdpa"].state_dict())
        built[impl] = model.to(DEV, torch.bfloat16).eval()
        assert model.config._attn_implementation == impl
    return built["eager"], built["sdpa"], built[NAME]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records which of flashgen's functions each attention call reached, and with what."""
    calls = []
    real = ta._kernels()

    def dense(q, k, v, *args, **kwargs):
        calls.append(("dense", tuple(q.shape), tuple(k.shape), kwargs.get("causal")))
        return real[0](q, k, v, *args, **kwargs)

    def varlen(q, k, v, *args, **kwargs):
        calls.append(("varlen", tuple(q.shape), tuple(k.shape), kwargs.get("causal")))
        return real[1](q, k, v, *args, **kwargs)

    monkeypatch.setattr(ta, "_kernels", lambda: (dense, varlen))
    return calls


def _ids(batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (batch, seq), generator=g).to(DEV)


def _left_padding(lengths, total):
    return torch.stack([torch.arange(total) >= total - n for n in lengths]).long().to(DEV)


def _right_padding(lengths, total):
    return torch.stack([torch.arange(total) < n for n in lengths]).long().to(DEV)


def _within_eagers_difference(ours, theirs, eager, keep=None, what="logits"):
    """flashgen vs sdpa at most twice eager vs sdpa, or a floor of 4 bf16 ulps of the scale."""
    d_ours = _max_diff(ours, theirs, keep)
    d_eager = _max_diff(eager, theirs, keep)
    scale = theirs.float().abs().max().item()
    bound = max(2.0 * d_eager, 4 * BF16_ULP * scale)
    assert d_ours <= bound, f"{what}: flashgen-sdpa {d_ours:.3g}, eager-sdpa {d_eager:.3g}"


@pytest.mark.parametrize("padded", [False, True])
def test_llama_prefill_logits_agree_with_sdpa_as_eager_does(models, kernel_calls, padded):
    eager, sdpa, fg = models
    ids = _ids(3, 96)
    mask = _left_padding([96, 70, 17], 96) if padded else None
    with torch.no_grad():
        out = [m(ids, attention_mask=mask).logits for m in (eager, sdpa, fg)]
    keep = mask.bool() if padded else None
    _within_eagers_difference(out[2], out[1], out[0], keep)
    assert [c[0] for c in kernel_calls] == ["varlen" if padded else "dense"] * 2
    assert all(c[3] for c in kernel_calls)  # causal
    assert kernel_calls[0][2][-2] == 2  # k keeps its 2 KV heads (no repeat_kv)


def test_llama_training_step_loss_and_gradients_agree_with_sdpa_as_eager_does(models, kernel_calls):
    eager, sdpa, fg = models
    ids = _ids(2, 80)
    mask = _right_padding([80, 53], 80)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in (eager, sdpa, fg):
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
        model.eval()
    (l_e, g_e), (l_s, g_s), (l_f, g_f) = results
    _within_eagers_difference(l_f, l_s, l_e, what="loss")
    for name in g_s:
        _within_eagers_difference(g_f[name], g_s[name], g_e[name], what=f"grad of {name}")
    assert [c[0] for c in kernel_calls] == ["varlen", "varlen"]


def _check_greedy(fg_out, sdpa_out, prompt_len, tol):
    """Rows equal, or diverging first at a step where sdpa's scores have flashgen's token
    within `tol` of their maximum (a near tie)."""
    for row in range(sdpa_out.sequences.shape[0]):
        a = sdpa_out.sequences[row, prompt_len:]
        b = fg_out.sequences[row, prompt_len:]
        differ = (a != b).nonzero()
        if differ.numel() == 0:
            continue
        step = int(differ[0])
        scores = sdpa_out.scores[step][row].float()
        gap = (scores.max() - scores[b[step]]).item()
        assert gap <= tol, f"row {row} differs at new token {step} with a logit gap {gap:.3g}"


@pytest.mark.parametrize("padded", [True, False])
def test_llama_greedy_generate_with_the_cache_gives_sdpas_tokens(models, kernel_calls, padded):
    _, sdpa, fg = models
    if padded:
        mask = _left_padding([24, 11], 24)
        ids = _ids(2, 24).masked_fill(mask == 0, 0)
    else:
        mask, ids = None, _ids(1, 24)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        theirs = sdpa.generate(ids, **kw)
        ours = fg.generate(ids, **kw)
    assert ours.sequences.shape == theirs.sequences.shape
    # the prefill's logits differ by about eager's difference; a tie closer than 4x that
    # may be broken either way
    with torch.no_grad():
        d = _max_diff(fg(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits)
    _check_greedy(ours, theirs, ids.shape[1], tol=max(4 * d, 4 * BF16_ULP))
    steps = [c for c in kernel_calls if c[0] == ("varlen" if padded else "dense")]
    decode = [c for c in steps if (c[1][0] == 2 if padded else c[1][1] == 1)]
    assert len(decode) >= 2 * 7 and all(c[3] for c in decode)  # every layer, every new token


def _ref_attention(q, k, v, causal, k_valid=None):
    """float64 (batch, heads, q, d) attention of q against k, v: bottom-right causal, keys
    `k_valid` (batch, kv) only, GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = (
        q.double(),
        k.double().repeat_interleave(rep, 1),
        v.double().repeat_interleave(rep, 1),
    )
    sq, sk = q.shape[2], k.shape[2]
    allowed = torch.ones(q.shape[0], 1, sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    if k_valid is not None:
        allowed &= k_valid[:, None, None, :]
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_the_attention_function_on_decode_steps_matches_float64(transformers, q_len, padded):
    """One layer's call as generate() makes it: q of 1 or 3 new tokens, k and v the whole
    (left-padded) cache in transformers' (batch, kv_heads, seq, d) layout."""
    ta.register(NAME)
    fn = transformers.AttentionInterface()[NAME]
    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    torch.manual_seed(3)
    b, h, hk, n, d = 2, 4, 2, 77, 64
    q = torch.randn(b, h, q_len, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, hk, n, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(b, hk, n, d, device=DEV, dtype=torch.bfloat16)
    mask = _left_padding([n, 40], n) if padded else None
    out, weights = fn(module, q, k, v, mask, dropout=0.0, scaling=d**-0.5)
    assert weights is None and out.shape == (b, q_len, h, d)
    ref = _ref_attention(q, k, v, True, None if mask is None else mask.bool()).transpose(1, 2)
    err = (out.double() - ref).abs().max().item()
    assert err <= 4 * BF16_ULP * ref.abs().max().item() + 1e-3, err


# -- torch's FlashAttention registry ---------------------------------------------------------------


def _registry():
    attention = pytest.importorskip("torch.nn.attention")
    if not hasattr(attention, "register_flash_attention_impl"):
        pytest.skip(f"torch {torch.__version__} has no FlashAttention registry (2.10+)")
    return attention


@pytest.fixture
def registry():
    attention = _registry()
    sdpa_backend.deactivate()
    yield attention
    sdpa_backend.deactivate()


def _sdpa_flash(q, k, v, causal, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def _inputs(dtype, d, heads=4, kv_heads=4, seq=256, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def make(h):
        x = torch.randn(2, h, seq, d, device=DEV, dtype=dtype, generator=g)
        return x.requires_grad_()

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    return q, k, v, torch.randn(2, heads, seq, d, device=DEV, dtype=dtype, generator=g)


def _run(q, k, v, dout, causal, **kw):
    out = _sdpa_flash(q, k, v, causal, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _kernel_names(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


def test_activated_sdpa_flash_backend_runs_flashgens_kernels_and_deactivate_restores(registry):
    q, k, v, dout = _inputs(torch.bfloat16, 64)
    sdpa_backend.activate()
    assert sdpa_backend.is_active() and "flashgen" in registry.list_flash_attention_impls()
    _run(q, k, v, dout, True)  # warm up: kernels load (or compile) outside the profile
    names = _kernel_names(lambda: _run(q, k, v, dout, True))
    assert any(n.startswith("fa_fwd_") for n in names), names
    assert any(n.startswith("fa_bwd_") for n in names), names
    assert not any("pytorch_flash" in n for n in names), names
    sdpa_backend.deactivate()
    assert not sdpa_backend.is_active()
    names = _kernel_names(lambda: _run(q, k, v, dout, True))
    assert not any(n.startswith("fa_") for n in names), names
    assert any("flash" in n for n in names), names  # the built-in FlashAttention-2 again


def _reference(q, k, v, dout, causal, enable_gqa=False):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=enable_gqa)
    return (out.detach(), *torch.autograd.grad(out, (qd, kd, vd), dout.double()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_activated_sdpa_flash_backend_is_as_close_to_float64_as_the_builtin(
    registry, dtype, d, causal
):
    q, k, v, dout = _inputs(dtype, d)
    ref = _reference(q, k, v, dout, causal)
    builtin = _run(q, k, v, dout, causal)
    sdpa_backend.activate()
    ours = _run(q, k, v, dout, causal)
    ulp = 2.0**-10 if dtype == torch.float16 else BF16_ULP
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, builtin, ref):
        err, base = _max_diff(a, r), _max_diff(b, r)
        bound = max(2.0 * base, 2 * ulp * r.abs().max().item())
        assert err <= bound, f"{name}: flashgen {err:.3g}, built-in FA2 {base:.3g}"


def test_activated_sdpa_flash_backend_with_gqa(registry):
    q, k, v, dout = _inputs(torch.bfloat16, 64, heads=4, kv_heads=2)
    sdpa_backend.activate()
    try:
        ours = _run(q, k, v, dout, True, enable_gqa=True)
    except RuntimeError as e:
        if "No available kernel" in str(e):
            pytest.skip(f"this torch's FLASH backend takes no enable_gqa ({e})")
        raise
    ref = _reference(q, k, v, dout, True, enable_gqa=True)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert _max_diff(a, r) <= 8 * BF16_ULP * r.abs().max().item(), name


def test_activated_sdpa_flash_backend_dropout_is_reproducible_from_the_seed(registry):
    q, k, v, dout = _inputs(torch.bfloat16, 64)
    sdpa_backend.activate()
    torch.manual_seed(7)
    first = _run(q, k, v, dout, False, dropout_p=0.2)
    torch.manual_seed(7)
    again = _run(q, k, v, dout, False, dropout_p=0.2)
    assert torch.equal(first[0], again[0])  # the same mask, forward
    for a, b in zip(first[1:], again[1:]):  # and backward (dq's accumulation order may vary)
        assert _max_diff(a, b) <= 2 * BF16_ULP * a.float().abs().max().item()
    plain = _run(q, k, v, dout, False)
    assert _max_diff(first[0], plain[0]) > 0.05  # dropout did drop
    # the expectation of dropout's output is the plain output: a loose check of the scaling
    mean = torch.stack([_run(q, k, v, dout, False, dropout_p=0.2)[0].float() for _ in range(8)])
    assert (mean.mean(0) - plain[0].float()).abs().mean().item() < 0.1


def test_activated_varlen_attn_runs_flashgen_forward_and_backward(registry):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    sdpa_backend.activate()
    bounds = [(0, 100), (100, 137), (137, 201)]
    cu = torch.tensor([0, 100, 137, 201], dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(5)

    def make():
        x = torch.randn(201, 4, 64, device=DEV, dtype=torch.bfloat16, generator=g)
        return x.requires_grad_()

    q, k, v = make(), make(), make()
    causal = dict(window_size=(-1, 0))  # varlen_attn's causal
    run = lambda: varlen.varlen_attn(q, k, v, cu, cu, 100, 100, **causal)  # noqa: E731
    names = _kernel_names(lambda: torch.autograd.grad(run(), (q, k, v), torch.ones_like(q)))
    assert any(n.startswith("fa_fwd_") for n in names), names
    assert any(n.startswith("fa_bwd_") for n in names), names
    out = run()
    dout = torch.randn(out.shape, device=DEV, dtype=out.dtype, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    refs = []
    for a, b in bounds:  # (seq, heads, d) -> (1, heads, seq, d) and back
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in leaves)
        refs.append(_ref_attention(qs, ks, vs, True)[0].transpose(0, 1))
    ref = torch.cat(refs)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert _max_diff(a, r) <= 8 * BF16_ULP * r.abs().max().item(), name


def test_activated_sdpa_under_torch_compile_matches_eager(registry):
    q, k, v, dout = _inputs(torch.bfloat16, 64)
    sdpa_backend.activate()
    eager = _run(q, k, v, dout, True)
    compiled = torch.compile(lambda q, k, v: _sdpa_flash(q, k, v, True))
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(eager, (out.detach(), *grads)):
        assert _max_diff(a, b) <= 2 * BF16_ULP * a.float().abs().max().item()


def test_what_flashgen_cannot_serve_is_refused_with_a_message(registry):
    sdpa_backend.activate()
    q = torch.randn(1, 2, 16, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="return_debug_mask"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, True)
    x = q.transpose(1, 2)
    with pytest.raises(ValueError, match="alibi_slopes"):
        torch.ops.aten._flash_attention_forward(
            x,
            x,
            x,
            None,
            None,
            16,
            16,
            0.0,
            False,
            False,
            alibi_slopes=torch.ones(2, device=DEV, dtype=torch.float32),
        )
    assert math.isfinite(float(_sdpa_flash(q, q, q, False).float().sum()))
