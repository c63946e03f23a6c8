"""Host (CPU) time per call of `flashgen.torch.flash_attn_func` against SDPA: what a small
model's training loop pays in Python and dispatch before any kernel runs.

    python -m flashgen.bench.torch_overhead [--batch 16 --seqlen 1024 --heads 12
        --head-dim 64 --dtype bf16 --iters 200 --out overhead.json]

For each implementation (flashgen; SDPA on (batch, heads, seqlen, d) transposes, is_causal)
and case (forward under no_grad; forward of inputs that require grad; forward + backward with
`o.backward(g)`): `iters` calls after a warm-up, timed with time.perf_counter. `host_us` is
the loop alone (the calls return before their kernels finish), `wall_us` adds the
torch.cuda.synchronize that ends it: host_us near wall_us means the GPU queue was full and the
host waited, so host_us is then an upper bound. Causal (bottom-right and top-left agree at
seqlen_q == seqlen_k).
"""

from __future__ import annotations

import argparse
import json
import time


def _time(fn, iters: int, warmup: int) -> dict[str, float]:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"host_us": host / iters * 1e6, "wall_us": wall / iters * 1e6}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("batch", 16), ("seqlen", 1024), ("heads", 12), ("head-dim", 64)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from flashgen.torch import flash_attn_func

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v, g = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def flashgen(a, b, c):
        return flash_attn_func(a, b, c, causal=True)

    def sdpa(a, b, c):
        a, b, c = (t.transpose(1, 2) for t in (a, b, c))
        return F.scaled_dot_product_attention(a, b, c, is_causal=True).transpose(1, 2)

    results: dict[str, dict] = {}
    for name, f in (("flashgen", flashgen), ("sdpa", sdpa)):

        def no_grad(f=f):
            with torch.no_grad():
                f(q, k, v)

        def fwd_bwd(f=f):
            f(qg, kg, vg).backward(g)

        cases = {"no_grad": no_grad, "fwd_grad": lambda f=f: f(qg, kg, vg), "fwd_bwd": fwd_bwd}
        results[name] = {case: _time(fn, args.iters, args.warmup) for case, fn in cases.items()}

    print(f"{'impl':10s} {'case':10s} {'host us/call':>13s} {'wall us/call':>13s}")
    for name, cases in results.items():
        for case, r in cases.items():
            print(f"{name:10s} {case:10s} {r['host_us']:13.1f} {r['wall_us']:13.1f}")
    report = {
        "shape": dict(zip(("batch", "seqlen", "heads", "head_dim"), shape)),
        "dtype": args.dtype,
        "causal": True,
        "iters": args.iters,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
