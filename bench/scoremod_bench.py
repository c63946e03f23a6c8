"""Score modifiers against their plain twins, side by side in one run (H200 bar: >= 0.95x).

For every kernel of `specs/scoremod.yaml` with exactly one score-stage feature (softcap,
alibi or sink) at d 64 / 128, bf16, no mask beyond causal, its plain twin (the same spec
without the feature, from the shipped specs) is timed on the same tensors at each sequence
length, forward and backward alike. `--check` first compares each modified kernel with a
float32 PyTorch reference of the modifier on a small odd-length problem (a smoke test beside
the Hypothesis suite, which is the verification).

    flashgen compile specs/
    python3 -m flashgen.bench.scoremod_bench --check --out bench/results/scoremod_h200.json

Rows: {"family", "mod", "d", "causal", "seqlen", "kernel", "plain_kernel",
"tflops": {"flashgen": x, "plain": y}, "ratio"} (backward FLOPs are 2.5x the forward's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from flashgen.bench.bwd_bench import flashgen_backward
from flashgen.bench.fwd_bench import environment, flops, torch_params

SOFTCAP, SINK_SCALE = 30.0, 2.0  # SOFTCAP: the default of --softcap


def alibi_slopes(heads: int):
    """ALiBi's geometric slopes 2^(-8 k / H), k = 1..H."""
    import torch

    return torch.tensor([2.0 ** (-8.0 * (k + 1) / heads) for k in range(heads)],
                        device="cuda", dtype=torch.float32)  # fmt: skip


def score_values(spec, heads: int, softcap: float = SOFTCAP) -> tuple[dict, dict]:
    """(params fields, reference kwargs) for the spec's modifiers."""
    import torch

    fields, ref = {}, {}
    if spec.has("softcap"):
        fields["softcap"] = ref["softcap"] = softcap
    if spec.has("alibi"):
        s = alibi_slopes(heads)
        fields["alibi_slopes"], fields["alibi_batch_stride"] = s.data_ptr(), 0
        ref["slopes"] = s
    if spec.has("sink"):
        s = torch.randn(heads, device="cuda", dtype=torch.float32) * SINK_SCALE
        fields["sinks"] = s.data_ptr()
        ref["sinks"] = s
    return fields, ref


def reference(q, k, v, scale, causal, softcap=0.0, slopes=None, sinks=None):
    """float32 attention with the modifiers: (o (b, s, h, d), lse (b, h, s))."""
    import torch

    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    sq, sk = qf.shape[2], kf.shape[2]
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if slopes is not None:
        s = s - slopes[None, :, None, None] * (i + sk - sq - j).abs()
    if causal:
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ vf).transpose(1, 2), lse


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check(spec, fwd_spec=None, softcap: float = SOFTCAP) -> dict:
    """Relative errors of one modified kernel against `reference` (odd lengths)."""
    import torch
    from flashgen.verify.runner import load_kernel
    from flashgen.verify.runner_bwd import load_bwd_kernel

    torch.manual_seed(1)
    d, causal = spec.head_dim, spec.mask.causal.yaml != "none"
    b, h, sq, sk = 2, 4, 197, 333
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(d)
    fs = spec if spec.kernel.yaml == "forward" else fwd_spec
    fields, ref_kw = score_values(spec, h, softcap)
    fwd = load_kernel(fs)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, sq, device="cuda")
    fwd.library.launch({**torch_params(fwd, q, k, v, o, lse, scale), **fields}, 0)
    torch.cuda.synchronize()
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kw = dict(ref_kw)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_(True)
    o_ref, lse_ref = reference(qr, kr, vr, scale, causal, **kw)
    out = {"o": _rel(o, o_ref), "lse": _rel(lse, lse_ref)}
    if spec.kernel.yaml == "backward":
        do = torch.randn_like(q)
        o_ref.backward(do.float())
        bwd = load_bwd_kernel(spec)
        extra = dict(fields)
        if spec.has("sink"):
            dsinks = torch.full((h,), float("nan"), device="cuda")
            extra["dsinks"] = dsinks.data_ptr()
        launch, dq, dk, dv = flashgen_backward(bwd, q, k, v, o, lse, do, scale, extra)
        launch()
        torch.cuda.synchronize()
        out.update(dq=_rel(dq, qr.grad), dk=_rel(dk, kr.grad), dv=_rel(dv, vr.grad))
        if spec.has("sink"):
            out["dsink"] = _rel(dsinks, kw["sinks"].grad)
    return out


def time_forward(kernel, spec, n: int, tokens: int, hidden: int, softcap: float = SOFTCAP) -> float:
    import torch
    from triton.testing import do_bench

    d = spec.head_dim
    batch, heads = max(1, tokens // n), hidden // d
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    o, lse = torch.empty_like(q), torch.empty(batch, heads, n, device="cuda")
    fields, ref_kw = score_values(spec, heads, softcap)  # ref_kw: the tensors behind the pointers
    launch = kernel.library.launcher(
        {**torch_params(kernel, q, k, v, o, lse, 1 / math.sqrt(d)), **fields}
    )
    ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
    del ref_kw
    return flops(batch, heads, n, d, spec.mask.causal.yaml != "none") / (ms * 1e-3) / 1e12


def time_backward(
    kernel, fwd_kernel, spec, n: int, tokens: int, hidden: int, softcap: float = SOFTCAP
) -> float:
    import torch
    from triton.testing import do_bench

    d = spec.head_dim
    batch, heads = max(1, tokens // n), hidden // d
    scale = 1 / math.sqrt(d)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    o, lse = torch.empty_like(q), torch.empty(batch, heads, n, device="cuda")
    fields, ref_kw = score_values(spec, heads, softcap)
    fwd_kernel.library.launch({**torch_params(fwd_kernel, q, k, v, o, lse, scale), **fields}, 0)
    do = torch.randn_like(q)
    extra = dict(fields)
    if spec.has("sink"):
        dsinks = torch.empty(heads, device="cuda")
        extra["dsinks"] = dsinks.data_ptr()
    run, *_ = flashgen_backward(kernel, q, k, v, o, lse, do, scale, extra)
    run.keep2 = (ref_kw, extra, q, k, v, o, lse, do)
    ms = do_bench(run, warmup=25, rep=100, return_mode="median")
    return 2.5 * flops(batch, heads, n, d, spec.mask.causal.yaml != "none") / (ms * 1e-3) / 1e12


def forward_for(specs, bwd):
    """A shipped forward of the backward's dtype, head dim, mask and features (its target's
    if there is one, else any)."""
    found = [
        s for s in specs
        if s.kernel.yaml == "forward" and s.dtype == bwd.dtype and s.head_dim == bwd.head_dim
        and s.mask == bwd.mask and s.features == bwd.features and s.gqa == bwd.gqa
        and not (s.dropout or s.sparse or s.instrument_io)
    ]  # fmt: skip
    if not found:
        raise LookupError(f"no shipped forward for {bwd}")
    return next((s for s in found if s.target == bwd.target), found[0])


def plain_twin(shipped, twin):
    """The shipped plain kernel of the twin's kind, target, dtype, head dim and mask, whatever
    its tile and allow_spills (a modifier's tile rule may differ, e.g. softcap's on sm_90a),
    and deterministic when the twin is (a deterministic backward is `plain` too)."""
    for s in shipped:
        if (s.kernel, s.target, s.dtype, s.head_dim, s.mask, s.gqa, s.deterministic) == (
            twin.kernel,
            twin.target,
            twin.dtype,
            twin.head_dim,
            twin.mask,
            twin.gqa,
            twin.deterministic,
        ) and s.tile_auto:
            return s
    return None


def single_mod(spec) -> str | None:
    """The one score modifier of a spec that is otherwise plain (`KernelSpec.plain` of its
    twin without the modifier), else None."""
    if len(spec.features) != 1 or not spec.replace(features=frozenset()).plain:
        return None
    return next(iter(spec.features))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scoremod_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["specs/scoremod.yaml"])
    ap.add_argument("--plain-specs", nargs="+", default=["specs/"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--check", action="store_true")
    ap.add_argument(
        "--softcap",
        type=float,
        default=SOFTCAP,
        help="c of the softcap kernels (default %(default)s)",
    )
    ap.add_argument("--match", default="", help="only kernels whose name matches this regex")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import re

    from flashgen.generator.load import load_paths
    from flashgen.generator.naming import kernel_name
    from flashgen.verify.runner import load_kernel
    from flashgen.verify.runner_bwd import load_bwd_kernel

    mods = [
        s for s in load_paths(args.specs)
        if single_mod(s) and s.dtype.yaml == "bf16" and re.search(args.match, kernel_name(s))
    ]  # fmt: skip
    every = load_paths(args.plain_specs)
    shipped = {s: s for s in every if s.plain}
    rows, checks = [], []
    for spec in mods:
        mod = single_mod(spec)
        twin = spec.replace(features=frozenset())
        plain = shipped.get(twin) or plain_twin(shipped, twin)
        fwd_spec = fwd_plain = None
        if spec.kernel.yaml == "backward":  # the forwards that make O and LSE for it
            fwd_spec, fwd_plain = forward_for(every, spec), forward_for(every, twin)
        if args.check:
            err = check(spec, fwd_spec, args.softcap)
            checks.append({"kernel": kernel_name(spec), **err})
            print(f"check {kernel_name(spec)}: " + " ".join(f"{a}={b:.2e}" for a, b in err.items()),
                  flush=True)  # fmt: skip
        if plain is None:
            print(f"scoremod_bench: no shipped plain twin for {kernel_name(spec)}", file=sys.stderr)
            continue
        causal = spec.mask.causal.yaml != "none"
        for n in args.seqlens:
            if spec.kernel.yaml == "forward":
                tf = {
                    "flashgen": time_forward(
                        load_kernel(spec), spec, n, args.tokens, args.hidden, args.softcap
                    ),
                    "plain": time_forward(load_kernel(plain), plain, n, args.tokens, args.hidden),
                }
            else:
                fk_mod, fk_plain = load_kernel(fwd_spec), load_kernel(fwd_plain)
                tf = {"flashgen": time_backward(load_bwd_kernel(spec), fk_mod, spec, n, args.tokens,
                                                args.hidden, args.softcap),
                      "plain": time_backward(load_bwd_kernel(plain), fk_plain, plain, n,
                                             args.tokens, args.hidden)}  # fmt: skip
            row = {"family": f"{spec.kernel.yaml}_{spec.target.yaml}", "mod": mod,
                   "d": spec.head_dim, "causal": causal, "seqlen": n, "kernel": kernel_name(spec),
                   **({"softcap": args.softcap} if mod == "softcap" else {}),
                   "plain_kernel": kernel_name(plain), "tflops": tf,
                   "ratio": tf["flashgen"] / tf["plain"]}  # fmt: skip
            rows.append(row)
            print(f"{row['family']:18s} {mod:8s} d={spec.head_dim:3d} causal={int(causal)} "
                  f"n={n:5d}: {tf['flashgen']:6.1f} vs plain {tf['plain']:6.1f} TFLOP/s "
                  f"= {row['ratio']:.3f}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"environment": environment(), "command": "python3 -m flashgen.bench.scoremod_bench "
             + " ".join(argv if argv is not None else sys.argv[1:]), "checks": checks,
             "rows": rows}, indent=2) + "\n")  # fmt: skip
    if rows:
        worst = min(r["ratio"] for r in rows)
        print(
            f"worst ratio {worst:.3f} ({sum(r['ratio'] >= 0.95 for r in rows)}/{len(rows)} >= 0.95)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
