"""64-bit offsets: a problem with more than 2^31 elements per tensor, checked at its far end.

batch 16400 x seqlen 1024 x 1 head x d 128 is 2.15e9 elements (4.3 GB in bf16) per tensor, so
the last batches sit past every 32-bit element offset. Inputs are made on the GPU with PyTorch
(skipped without it); the first and last two batches are compared with the reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from flashgen.bench.fwd_bench import make_launcher, torch_params
from flashgen.generator.naming import kernel_name
from flashgen.verify.runner import load_kernel

from .checks import verdicts
from .conftest import CUBIN_DIR, shipped_specs

SPEC = next(
    (
        s
        for s in shipped_specs()
        if s.kernel.yaml == "forward"
        and s.head_dim == 128
        and s.dtype.yaml == "bf16"
        and s.mask.causal.yaml == "none"
        and s.plain
    ),
    None,  # not among this run's kernels (another shard has it)
)


@pytest.mark.parametrize("spec", [SPEC] if SPEC else [], ids=kernel_name)
def test_offsets_past_two_to_the_31_elements(specs, spec):  # noqa: ARG001
    torch = pytest.importorskip("torch")
    b, n, h, d = 16400, 1024, 1, spec.head_dim
    assert b * n * h * d > 2**31
    kernel = load_kernel(spec, CUBIN_DIR)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, n), float("nan"), device="cuda", dtype=torch.float32)
    make_launcher(kernel, torch_params(kernel, q, k, v, o, lse, d**-0.5))()
    torch.cuda.synchronize()
    assert not bool(torch.isnan(o).any()), "some output element was never written"
    assert not bool(torch.isnan(lse).any())
    for sel in (slice(0, 1), slice(b - 2, b)):
        res = SimpleNamespace(
            inputs={nm: t[sel].float().cpu().numpy() for nm, t in (("q", q), ("k", k), ("v", v))},
            o=o[sel].float().cpu().numpy(),
            lse=lse[sel].cpu().numpy(),
            stats={"margins_intact": True},
        )
        for out, verdict in verdicts(spec, res, causal="none").items():
            assert verdict.passed, f"batches {sel}: {out}: {verdict.message}"
