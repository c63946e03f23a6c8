"""Context-parallel benchmark: flashgen's ring and zigzag attention on W GPUs against flashgen's
single-GPU kernel.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m flashgen.bench.ring_bench \
        --seqlens-per-rank 32768 65536 --out bench/results/cp_h200x2.json

For each seqlen_local n per rank (the sequence is W * n tokens), d, and mode (ring without a
mask, ring causal, zigzag causal; `--modes`), bf16 inputs of batch 1 and `--heads` heads:

- the ring's forward and forward + backward time (`flashgen.torch.distributed.
  ring_flash_attn_func` with the default kernels; per iteration the slowest rank's CUDA-event
  time, then the median over `--iters`);
- flashgen's single-GPU `flash_attn_func` on the whole sequence (each rank runs it on its
  own GPU at the same time; skipped with `--no-full`), and on the per-rank share (q, k, v of
  n tokens, the same mask).

TFLOP/s count 4*b*h*N^2*d, halved when causal (the FlashAttention papers' convention), and
3.5 x that for forward + backward (the backward 2.5 x, as bench/bwd_bench.py). The ring's
per-rank TFLOP/s is the whole sequence's FLOPs / W / time. `efficiency_fwd` and
`efficiency_fwdbwd` divide it by the single-GPU kernel's TFLOP/s on the whole sequence, i.e.
(time of one GPU on the whole sequence) / (W x the ring's time): 1.0 is the ideal, W GPUs W
times as fast as one (`efficiency_basis` says "single_gpu_per_rank_share" when `--no-full`
left only the share to divide by). `efficiency_*_vs_share` divides by the share's TFLOP/s
(what the blocks' kernel reaches at n tokens). ring-flash-attention reports about 0.85
(forward) and 0.90 (forward + backward) for zigzag on 8 H800s against flash-attn's
single-GPU throughput; that number is cited, not run here.

With `--check`, the gathered ring output of each case is compared with the single-GPU
output of the whole sequence (largest absolute difference). Rank 0 prints a table and writes
`--out`: {"rows": [...], "env": {...}, "convention": ..., "reference": ...}. Needs W >= 2
CUDA GPUs, PyTorch with NCCL, and flashgen's kernels (compiled on first use if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from flashgen.bench.fwd_bench import environment, flops

MODES = ("ring-full", "ring-causal", "zigzag-causal")
FWD_BWD = 3.5  # forward + backward FLOPs / forward FLOPs
REFERENCE = (
    "ring-flash-attention (github.com/zhuzilin/ring-flash-attention) reports zigzag at about "
    "85% of the ideal in the forward and 90% in forward + backward on 8 H800s; not run here"
)


def _timed(fn, warmup: int, iters: int) -> float:
    """Median over `iters` of the slowest rank's CUDA-event time of fn(), in ms."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor(times, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(statistics.median(t.tolist()))


def _fwd_and_fwdbwd(attn, q, k, v, dout, warmup: int, iters: int) -> tuple[float, float]:
    import torch

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwdbwd():
        out = attn(qg, kg, vg)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return _timed(fwd, warmup, iters), _timed(fwdbwd, warmup, iters)


def _tflops(fl: float, ms: float | None) -> float | None:
    return None if not ms else fl / (ms * 1e-3) / 1e12


def bench_case(args, n: int, mode: str, rank: int, world: int, full_cache: dict) -> dict:
    import torch
    import torch.distributed as dist
    from flashgen.torch import flash_attn_func
    from flashgen.torch.distributed import ring_flash_attn_func, shard, unshard

    layout, mask = mode.split("-")
    causal = mask == "causal"
    b, h, d = args.batch, args.heads, args.head_dim
    total = world * n
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(1234 + n)
    full = [
        torch.randn((b, total, h, d), generator=gen, device="cuda", dtype=dtype) for _ in range(4)
    ]
    q, k, v, dout = (shard(t, rank, world, layout) for t in full)

    def ring(q_, k_, v_):
        return ring_flash_attn_func(q_, k_, v_, causal=causal, layout=layout)

    def single(q_, k_, v_):
        return flash_attn_func(q_, k_, v_, causal=causal)

    row = {
        "world": world,
        "seqlen_local": n,
        "seqlen_total": total,
        "batch": b,
        "heads": h,
        "d": d,
        "dtype": args.dtype,
        "causal": causal,
        "mode": mode,
    }
    row["ms_fwd"], row["ms_fwdbwd"] = _fwd_and_fwdbwd(ring, q, k, v, dout, args.warmup, args.iters)
    share = [t[:, :n].contiguous() for t in full]
    row["ms_share_fwd"], row["ms_share_fwdbwd"] = _fwd_and_fwdbwd(
        single, *share, args.warmup, args.iters
    )
    key = (n, causal)
    if not args.no_full and key not in full_cache:
        full_cache[key] = _fwd_and_fwdbwd(single, *full, args.warmup, args.iters)
    row["ms_full_fwd"], row["ms_full_fwdbwd"] = full_cache.get(key, (None, None))

    fl, fl_share = flops(b, h, total, d, causal), flops(b, h, n, d, causal)
    per_rank = {
        "fwd": _tflops(fl / world, row["ms_fwd"]),
        "fwdbwd": _tflops(FWD_BWD * fl / world, row["ms_fwdbwd"]),
    }
    share_t = {
        "fwd": _tflops(fl_share, row["ms_share_fwd"]),
        "fwdbwd": _tflops(FWD_BWD * fl_share, row["ms_share_fwdbwd"]),
    }
    full_t = {
        "fwd": _tflops(fl, row["ms_full_fwd"]),
        "fwdbwd": _tflops(FWD_BWD * fl, row["ms_full_fwdbwd"]),
    }
    row["efficiency_basis"] = "single_gpu_full_sequence"
    if full_t["fwd"] is None:
        row["efficiency_basis"] = "single_gpu_per_rank_share"
    for part in ("fwd", "fwdbwd"):
        row[f"tflops_per_rank_{part}"] = per_rank[part]
        row[f"tflops_share_{part}"] = share_t[part]
        row[f"tflops_full_{part}"] = full_t[part]
        basis = full_t[part] if full_t[part] is not None else share_t[part]
        row[f"efficiency_{part}"] = per_rank[part] / basis
        row[f"efficiency_{part}_vs_share"] = per_rank[part] / share_t[part]
        row[f"tokens_per_s_{part}"] = b * total / (row[f"ms_{part}"] * 1e-3)
    if args.check:
        with torch.no_grad():
            out = ring(q, k, v)
            every = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(every, out)
            ref = single(*full[:3])
            row["max_abs_diff_vs_single"] = float((unshard(every, layout) - ref).abs().max())
    return row


def _nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()  # a tuple (major, minor, patch), an int in older torch
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def format_table(rows: list[dict]) -> str:
    head = (
        "| mode | world | n/rank | total | ms fwd | ms fwd+bwd | TFLOP/s/rank fwd | "
        "fwd+bwd | eff fwd | eff fwd+bwd | eff vs share fwd | fwd+bwd |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        cells = [
            r["mode"],
            str(r["world"]),
            str(r["seqlen_local"]),
            str(r["seqlen_total"]),
            f"{r['ms_fwd']:.2f}",
            f"{r['ms_fwdbwd']:.2f}",
            f"{r['tflops_per_rank_fwd']:.0f}",
            f"{r['tflops_per_rank_fwdbwd']:.0f}",
            f"{r['efficiency_fwd']:.2f}",
            f"{r['efficiency_fwdbwd']:.2f}",
            f"{r['efficiency_fwd_vs_share']:.2f}",
            f"{r['efficiency_fwdbwd_vs_share']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens-per-rank", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--no-full", action="store_true", help="skip the single-GPU whole-sequence baseline"
    )
    ap.add_argument("--check", action="store_true", help="compare outputs with the single GPU's")
    ap.add_argument("--out", help="write the results as JSON here (rank 0)")
    args = ap.parse_args(argv)

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before the communicator exists
    import torch
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        ap.error("run it with torchrun --nproc-per-node W (W >= 2 GPUs), see --help")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        rows, full_cache = [], {}
        for n in args.seqlens_per_rank:
            for mode in args.modes:
                if mode.startswith("zigzag") and n % 2:
                    continue
                row = bench_case(args, n, mode, rank, world, full_cache)
                rows.append(row)
                if rank == 0:
                    print(
                        f"{mode:14s} n/rank={n:7d} fwd {row['ms_fwd']:9.2f} ms "
                        f"(eff {row['efficiency_fwd']:.2f})  fwd+bwd {row['ms_fwdbwd']:9.2f} "
                        f"ms (eff {row['efficiency_fwdbwd']:.2f})",
                        flush=True,
                    )
        if rank == 0:
            env = environment()
            env.update(
                world=world,
                nccl=_nccl_version(),
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            )
            result = {
                "rows": rows,
                "env": env,
                "convention": (
                    "TFLOP/s = 4*b*h*N^2*d (/2 causal) / time, x3.5 for fwd+bwd; per rank: "
                    "/ world; efficiency = per-rank TFLOP/s / single-GPU TFLOP/s "
                    "(efficiency_basis)"
                ),
                "reference": REFERENCE,
            }
            print(format_table(rows))
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
