"""Nsight Compute beside cuDNN: the flashgen sm_90a backward and SDPA CUDNN's backward on the
same bf16 tensors (16k tokens, hidden 2048), one launch each between cudaProfilerStart/Stop,
so that `--profile-from-start off` profiles those calls' kernels and nothing else.

    ncu --clock-control none --set full --profile-from-start off -f -o bwd \\
        python3 bench/ncu_bwd.py run --d 128 --seqlen 4096 [--causal]
    ncu -i bwd.ncu-rep --page raw --csv > bwd_raw.csv
    python3 bench/ncu_bwd.py table bwd_raw.csv [more.csv ...] > rows.json

`run` needs a GPU, PyTorch and the compiled kernels of specs/fwd_sm90a.yaml and
specs/bwd_sm90a.yaml (`flashgen compile`); `table` reads ncu's raw CSV page into one JSON row per
kernel with the metrics docs/benchmarks.md quotes (duration, tensor-pipe and SM throughput,
registers, shared memory, active warps, the warp-stall samples).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path


def _spec(path: str, kind: str, d: int, causal: bool):
    from flashgen.generator.load import load_paths

    for s in load_paths([Path(path)]):
        if (s.kernel.yaml == kind and s.dtype.yaml == "bf16" and s.head_dim == d and s.plain
                and s.mask.causal.yaml == ("bottom_right" if causal else "none")):  # fmt: skip
            return s
    raise SystemExit(f"ncu_bwd: no plain bf16 {kind} spec with head_dim {d} in {path}")


def run(d: int, n: int, causal: bool) -> None:
    import torch
    import torch.nn.functional as F
    from flashgen.bench.bwd_bench import flashgen_backward
    from flashgen.bench.fwd_bench import torch_params
    from flashgen.verify.runner import load_kernel
    from flashgen.verify.runner_bwd import load_bwd_kernel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = max(1, 16384 // n), 2048 // d
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    scale = 1 / math.sqrt(d)
    fk = load_kernel(_spec("specs/fwd_sm90a.yaml", "forward", d, causal))
    fk.library.launch(torch_params(fk, q, k, v, o, lse, scale), 0)
    bk = load_bwd_kernel(_spec("specs/bwd_sm90a.yaml", "backward", d, causal))
    launch, *_ = flashgen_backward(bk, q, k, v, o, lse, do, scale)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    launch()  # warm: module load and tensor-map encoding stay outside the profile
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    launch()
    out.backward(do.transpose(1, 2))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(
        f"ran {bk.name} and SDPA CUDNN's backward: b {b} h {h} n {n} d {d} causal {causal}",
        file=sys.stderr,
    )


def _wanted(name: str) -> bool:
    """The raw metrics a row keeps: time, launch shape, SM and tensor-pipe throughput, and the
    warp-stall samples (PC sampling)."""
    return (
        name in ("gpu__time_duration.sum", "launch__registers_per_thread", "launch__grid_size",
                 "launch__block_size", "launch__shared_mem_per_block_dynamic",
                 "sm__throughput.avg.pct_of_peak_sustained_elapsed",
                 "sm__warps_active.avg.pct_of_peak_sustained_active")
        or name == "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
        or (name.startswith("smsp__pcsamp_warps_issue_stalled_") and "not_issued" not in name)
    )  # fmt: skip


def table(paths: list[str]) -> list[dict]:
    """One row per profiled kernel of ncu's `--page raw --csv` output(s)."""
    rows = []
    for p in paths:
        text = Path(p).read_text()
        start = text.find('"ID"')
        if start < 0:
            continue
        reader = csv.reader(io.StringIO(text[start:]))
        names, units = next(reader), next(reader)
        for values in reader:
            r = dict(zip(names, values))
            row = {"file": Path(p).name, "kernel": r.get("Kernel Name", "")[:160], "metrics": {}}
            for n, u, v in zip(names, units, values):
                if _wanted(n):
                    row["metrics"][n] = f"{v} {u}".strip()
            rows.append(row)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="ncu_bwd")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--d", type=int, default=128)
    r.add_argument("--seqlen", type=int, default=4096)
    r.add_argument("--causal", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("csv", nargs="+")
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.d, a.seqlen, a.causal)
    else:
        print(json.dumps(table(a.csv), indent=1))
