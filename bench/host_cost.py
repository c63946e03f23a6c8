"""Host cost of flashgen.torch's layers without a GPU: CPU tensors, mocked kernels.

    python -m flashgen.bench.host_cost            # the ctypes path, then the binding

Times `torch.ops.flashgen.fwd`, `flash_attn_func` (no grad, with grad, forward +
backward), `flash_attn_varlen_func`, `flash_attn_with_kvcache` (one query) and `merge_states`
(two bf16 parts, and the raw `torch.ops.flashgen.merge_states`) on CPU tensors described as
CUDA ones, with the kernels replaced by C functions that return
(`flashgen.bench.mock_kernels`). It leaves out the CUDA allocator and driver, so it compares
the Python and C++ layers of the two paths (`FLASHGEN_TORCH_BINDING`); what a GPU call costs
is `flashgen.bench.torch_overhead`'s to measure. Each path runs in its own process (the ops
are defined once per process). Median of `--repeats` means of `--iters` calls; shape
(2, 64, 4, 64) bf16, causal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from flashgen.bench.torch_overhead import median_us


def _child(iters: int, repeats: int) -> dict:
    import torch
    from flashgen.bench import mock_kernels
    from flashgen.torch import (
        flash_attn_func,
        flash_attn_varlen_func,
        flash_attn_with_kvcache,
        interface,
        kvcache,
        merge_states,
        ops,
    )

    mock_kernels.mock_cuda(setattr, mock_kernels.build(tempfile.mkdtemp()))
    interface._on_cuda = lambda t: True
    interface._kernel_head_dim = lambda d, index, backward: d
    kvcache._on_cuda = lambda t: True  # merge_states' padding and layout checks run as on a GPU
    q, k, v = (torch.randn(2, 64, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)
    cu = torch.arange(0, 3 * 64, 64, dtype=torch.int32)
    pq, pk, pv = (t.reshape(2 * 64, 4, 64) for t in (q, k, v))
    q1, lens = q[:, :1].contiguous(), torch.full((2,), 64, dtype=torch.int32)
    parts = torch.randn(2, 2, 64, 4, 64, dtype=torch.bfloat16)  # (parts, batch, sq, heads, d)
    lse_parts = torch.randn(2, 2, 4, 64)

    def op_no_grad():
        with torch.no_grad():
            torch.ops.flashgen.fwd.default(q, k, v, None, None, 0, 0, 0.0, 0.125, True, -1, -1,
                                           False)  # fmt: skip

    def no_grad():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=True)

    def no_grad_of(f):
        def run():
            with torch.no_grad():
                f()

        return run

    cases = {
        "op_no_grad": op_no_grad,
        "no_grad": no_grad,
        "fwd_grad": lambda: flash_attn_func(qg, kg, vg, causal=True),
        "fwd_bwd": lambda: flash_attn_func(qg, kg, vg, causal=True).backward(g),
        "varlen": no_grad_of(
            lambda: flash_attn_varlen_func(pq, pk, pv, cu, cu, 64, 64, causal=True)
        ),
        "kvcache": no_grad_of(lambda: flash_attn_with_kvcache(q1, k, v, cache_seqlens=lens)),
        "merge": lambda: merge_states(parts, lse_parts),
        "merge_op": lambda: torch.ops.flashgen.merge_states.default(parts, lse_parts, "bfloat16"),
        "empty_floor": lambda: (torch.empty_like(q), torch.empty(2, 4, 64)),
    }
    path = "binding" if ops.BINDING is not None else "ctypes"
    times = {c: median_us(fn, iters, 30, repeats, sync=lambda: None) for c, fn in cases.items()}
    return {"path": path, **times}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.iters, args.repeats)))
        return {}
    results = []
    for on in ("0", "1"):
        env = dict(os.environ, FLASHGEN_TORCH_BINDING=on, FLASHGEN_TORCH_BINDING_CPU_TESTS=on)
        cmd = [sys.executable, "-m", "flashgen.bench.host_cost", "--child",
               f"--iters={args.iters}", f"--repeats={args.repeats}"]  # fmt: skip
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(res.stdout))
    print(f"{'case':12s} " + " ".join(f"{r['path']:>9s}" for r in results) + "  (us per call)")
    for case in results[0]:
        if case != "path":
            print(f"{case:12s} " + " ".join(f"{r[case]:9.1f}" for r in results))
    report = {"note": "CPU tensors, mocked kernels: relative host cost", "results": results}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
