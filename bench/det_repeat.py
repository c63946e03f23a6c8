"""Bitwise repeatability of the Hopper (sm_90a) backward at training shapes, with its
negative control: each bf16 d 64 / 128 kernel, deterministic and not, runs six times on the
same tensors (16k tokens, hidden 2048, seqlen 4096) and the elements of dQ, dK and dV that
differ from the first run are counted. The deterministic kernels must show 0 everywhere; the
non-deterministic ones show how many dQ elements the unordered adds change (dK and dV are
summed in registers in a fixed order: 0 there too), which is what makes the exact test able
to fail.

    flashgen compile specs/bwd_det.yaml specs/bwd_sm90a.yaml
    python3 -m flashgen.bench.det_repeat --out bench/results/det_repeat_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from flashgen.bench.bwd_bench import flashgen_backward
from flashgen.bench.fwd_bench import write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=["specs/bwd_det.yaml", "specs/bwd_sm90a.yaml"])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from flashgen.generator.load import load_paths
    from flashgen.verify.runner import load_kernel

    specs = [
        s
        for s in load_paths(args.specs)
        if s.kernel.yaml == "backward" and s.target.yaml == "sm_90a" and s.dtype.yaml == "bf16"
        and s.head_dim in (64, 128) and s.plain and s.mask.causal.yaml in ("none", "bottom_right")
    ]  # fmt: skip
    if not specs:
        print("det_repeat: no bf16 dense sm_90a backward spec matches", file=sys.stderr)
        return 2
    rows = []
    for spec in specs:
        kernel = load_kernel(spec)
        causal = spec.mask.causal.yaml != "none"
        n, d = args.seqlen, spec.head_dim
        b, h = max(1, 16384 // n), 2048 // d
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in "qkvd")
        fwd = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False
        )
        o, lse = fwd[0].transpose(1, 2).contiguous(), fwd[1].contiguous()
        launch, dq, dk, dv = flashgen_backward(kernel, q, k, v, o, lse, do, 1 / math.sqrt(d))
        launch()
        torch.cuda.synchronize()
        first = [t.clone() for t in (dq, dk, dv)]
        differ = {"dq": 0, "dk": 0, "dv": 0}
        for _ in range(args.runs - 1):
            launch()
            torch.cuda.synchronize()
            for nm, a, t in zip(differ, first, (dq, dk, dv)):
                differ[nm] += int((a.view(torch.int16) != t.view(torch.int16)).sum())
        row = {
            "kernel": kernel.name, "deterministic": spec.deterministic, "d": d,
            "causal": causal, "shape": [b, n, h, d], "runs": args.runs,
            "elements_differing_from_first_run": differ,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_result(args.out, "elements of dQ, dK, dV (bf16) that differ bitwise from the first "
                 "run, summed over the later runs", rows)  # fmt: skip
    bad = [r["kernel"] for r in rows if r["deterministic"] and any(
        r["elements_differing_from_first_run"].values())]  # fmt: skip
    if bad:
        print(f"det_repeat: deterministic kernels differ between runs: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
