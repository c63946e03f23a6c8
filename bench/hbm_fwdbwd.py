"""DRAM bytes of attention forward + backward (Nsight Compute) at the paper's GPT-2-medium
shape (batch 64, seqlen 1024, 16 heads, d 64, fp16; FlashAttention paper, Figure 2): flashgen
against SDPA's MATH (standard attention), FLASH (FlashAttention-2) and CUDNN backends.

Each implementation runs in its own process under ncu; only the kernels between
cudaProfilerStart and cudaProfilerStop (one forward and one backward, after a warm-up
outside) are profiled, so input generation and warm-up are never counted. (Not an NVTX
range: autograd runs the backward on its own thread, which a thread-local range misses.)

    for impl in flashgen math flash cudnn; do
      ncu --clock-control none --profile-from-start off --csv \\
          --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
          python3 -m flashgen.bench.hbm_fwdbwd run --impl $impl > $impl.csv
    done
    python3 -m flashgen.bench.hbm_fwdbwd summarize --out hbm_fwdbwd_h200.json *.csv

`summarize` adds the exact IO models (verify/io_model.py, verify/io_model_bwd.py) of the
flashgen kernels it ran, next to the measured bytes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

SHAPE = {"batch": 64, "seqlen": 1024, "heads": 16, "head_dim": 64}
IMPLS = ("flashgen", "math", "flash", "cudnn")


def _specs(spec_dir: str):
    """The shipped fp16 d64 non-causal dense forward and backward kernels (sm_90a first)."""
    from flashgen.generator.load import load_paths

    def dense(s):
        return (
            s.dtype.yaml == "fp16"
            and s.head_dim == SHAPE["head_dim"]
            and s.mask.causal.yaml == "none"
            and s.plain
            and not s.deterministic
        )

    # the kernels an H100/H200 runs by default: the sm_90a families first where shipped
    specs = sorted((s for s in load_paths([spec_dir]) if dense(s)),
                   key=lambda s: not s.target.value.suffix)  # fmt: skip
    fwd = next(s for s in specs if s.kernel.yaml == "forward")
    bwd = next(s for s in specs if s.kernel.yaml == "backward")
    return fwd, bwd


def run(impl: str, spec_dir: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, n, h, d = (SHAPE[k] for k in ("batch", "seqlen", "heads", "head_dim"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(b, n, h, d, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4)
    )
    scale = d**-0.5
    if impl == "flashgen":
        from flashgen.bench.bwd_bench import flashgen_backward
        from flashgen.bench.fwd_bench import torch_params
        from flashgen.verify.runner import load_kernel

        fwd_spec, bwd_spec = _specs(spec_dir)
        fwd_k, bwd_k = load_kernel(fwd_spec), load_kernel(bwd_spec)
        o = torch.empty_like(q)
        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
        fwd = fwd_k.library.launcher(torch_params(fwd_k, q, k, v, o, lse, scale))
        bwd, *_ = flashgen_backward(bwd_k, q, k, v, o, lse, do, scale)

        def step():
            fwd()
            bwd()
    else:
        backend = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}[impl]  # fmt: skip
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2)

        def step():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
            out.backward(dot)

    step()  # warm-up (workspace allocation, autotuning), outside the profiled window
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _ncu_bytes(text: str) -> dict[str, float]:
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV table in the file")
    out = {"read": 0.0, "write": 0.0, "kernels": 0}
    ids = set()
    scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    for r in csv.DictReader(io.StringIO(text[start:])):
        try:
            val = float(r["Metric Value"].replace(",", "")) * scale[r.get("Metric Unit", "byte")]
        except (KeyError, ValueError):
            continue
        ids.add(r["ID"])
        if r["Metric Name"] == "dram__bytes_read.sum":
            out["read"] += val
        elif r["Metric Name"] == "dram__bytes_write.sum":
            out["write"] += val
    out["kernels"] = len(ids)
    return out


def summarize(csvs: list[str], spec_dir: str, out_path: str | None) -> dict:
    from flashgen.generator.naming import kernel_name
    from flashgen.verify.io_model import forward_bytes
    from flashgen.verify.io_model_bwd import backward_bytes

    b, n, h = SHAPE["batch"], SHAPE["seqlen"], SHAPE["heads"]
    rows = {}
    for path in csvs:
        impl = Path(path).stem
        m = _ncu_bytes(Path(path).read_text())
        rows[impl] = {
            "read_GB": m["read"] / 1e9,
            "write_GB": m["write"] / 1e9,
            "total_GB": (m["read"] + m["write"]) / 1e9,
            "kernels": m["kernels"],
        }
    fwd_spec, bwd_spec = _specs(spec_dir)
    kw = dict(batch=b, heads=h, kv_heads=h, seqlen_q=n, seqlen_k=n)
    model = forward_bytes(fwd_spec, **kw)["total"] + backward_bytes(bwd_spec, **kw)["total"]
    result = {
        "shape": SHAPE,
        "dtype": "fp16",
        "causal": False,
        "kernels": [kernel_name(fwd_spec), kernel_name(bwd_spec)],
        "model_GB_flashgen": model / 1e9,
        "measured": rows,
        "paper_figure2_GB": {"standard": 40.3, "flashattention": 4.4},
    }
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hbm_fwdbwd", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one forward + backward inside the profiled NVTX range")
    r.add_argument("--impl", choices=IMPLS, required=True)
    r.add_argument("--specs", default="specs")
    s = sub.add_parser("summarize", help="ncu CSVs (named <impl>.csv) to one JSON")
    s.add_argument("csvs", nargs="+")
    s.add_argument("--specs", default="specs")
    s.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.impl, args.specs)
    else:
        res = summarize(args.csvs, args.specs, args.out)
        print(f"model (flashgen): {res['model_GB_flashgen']:.2f} GB")
        for impl, row in res["measured"].items():
            print(f"{impl:10s} {row['total_GB']:8.2f} GB over {row['kernels']} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
