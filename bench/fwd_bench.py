"""Forward benchmark: flashgen kernels side by side with PyTorch's attention in one run.

For each (head_dim, causal, seqlen) the same bf16 inputs go to the flashgen kernel of the spec
and to SDPA with each backend forced (FLASH = FlashAttention-2, CUDNN, EFFICIENT, MATH) and to
FlexAttention; times are medians of `triton.testing.do_bench`. TFLOP/s count 4*b*h*n^2*d,
halved when causal (the FlashAttention papers' convention). batch * seqlen = 16k tokens,
hidden = heads * head_dim = 2048.

    python -m flashgen.bench.fwd_bench --specs specs/fwd_dense.yaml --out bench/results/fwd.json

Needs a GPU, PyTorch, Triton and PyCUDA; the kernel libraries come from `flashgen compile`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
from pathlib import Path

BACKENDS = ("FLASH", "CUDNN", "EFFICIENT", "MATH")


def flops(batch: int, heads: int, n: int, d: int, causal: bool, d_v: int | None = None) -> float:
    """Forward FLOPs: Q K^T (2 n^2 d) and P V (2 n^2 d_v) per (batch, head), halved when
    causal; d_v (v's head dim) defaults to d, which gives the usual 4 b h n^2 d."""
    d_v = d if d_v is None else d_v
    f = 2.0 * batch * heads * n * n * (d + d_v)
    return f / 2 if causal else f


def torch_params(kernel, q, k, v, o, lse, scale: float) -> dict:
    """fg_fwd_params for contiguous torch tensors q, k, v, o: (b, s, h, d); lse: (b, h, s)."""
    b, s, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    p = {
        "q": q.data_ptr(),
        "k": k.data_ptr(),
        "v": v.data_ptr(),
        "o": o.data_ptr(),
        "lse": lse.data_ptr(),
        "batch": b,
        "heads": h,
        "kv_heads": hk,
        "seqlen_q": s,
        "seqlen_k": sk,
        "head_dim": d,
        "head_dim_v": v.shape[-1],
        "softmax_scale": scale,
        "window_left": -1,
        "window_right": -1,
        "lse_batch_stride": h * s,
        "lse_head_stride": s,
    }
    for nm, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        st = t.stride()
        p[f"{nm}_batch_stride"], p[f"{nm}_row_stride"], p[f"{nm}_head_stride"] = st[0], st[1], st[2]
    return p


def make_launcher(kernel, params: dict):
    """A no-argument callable launching the kernel through its C launcher on the legacy
    default stream (no sync): the same path as the tests."""
    return kernel.library.launcher(params)


def bench_case(
    kernel,
    d: int,
    causal: bool,
    n: int,
    tokens: int,
    hidden: int,
    backends,
    flex: bool,
    check: bool,
    d_v: int | None = None,
) -> dict:
    """One row: flashgen and each backend on the same bf16 inputs of head dim d (q, k) and
    d_v (v and out; default d). SDPA's backends that refuse d_v != d (FLASH) get an error
    entry, CUDNN serves it."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    batch = max(1, tokens // n)
    heads = hidden // d
    scale = 1.0 / math.sqrt(d)
    torch.manual_seed(0)
    d_v = d if d_v is None else d_v
    q, k = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(batch, n, heads, d_v, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(batch, n, heads, d_v, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
    launch = make_launcher(kernel, torch_params(kernel, q, k, v, o, lse, scale))
    fl = flops(batch, heads, n, d, causal, d_v)
    row = {
        "d": d,
        "d_v": d_v,
        "causal": causal,
        "seqlen": n,
        "batch": batch,
        "heads": heads,
        "kernel": kernel.name,
        "ms": {},
        "tflops": {},
    }
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def record(label: str, fn) -> None:
        try:
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this case
            row["ms"][label] = None
            row["tflops"][label] = None
            row.setdefault("errors", {})[label] = f"{type(exc).__name__}: {str(exc)[:120]}"
            return
        row["ms"][label] = ms
        row["tflops"][label] = fl / (ms * 1e-3) / 1e12

    record("flashgen", launch)
    if check and d_v == d:  # (SDPA FLASH refuses d_v != d)
        launch()
        torch.cuda.synchronize()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        row["max_abs_diff_vs_flash"] = float((o.float() - ref.float()).abs().max())
    for be in backends:
        if be == "MATH" and n > 4096:
            continue  # the N^2 score matrix of MATH at 8k+ is pure memory traffic; see anchors
        sel = getattr(
            SDPBackend,
            {
                "FLASH": "FLASH_ATTENTION",
                "CUDNN": "CUDNN_ATTENTION",
                "EFFICIENT": "EFFICIENT_ATTENTION",
                "MATH": "MATH",
            }[be],
        )

        def run_sdpa(sel=sel):
            with sdpa_kernel(sel):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        record(be, run_sdpa)
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        fa = torch.compile(flex_attention)
        bm = None
        if causal:
            bm = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, n, n, device="cuda")
        record("FLEX", lambda: fa(qt, kt, vt, block_mask=bm))
    ours = row["tflops"].get("flashgen")
    row["ratio"] = {
        be: (ours / t if ours and t else None)
        for be, t in row["tflops"].items()
        if be != "flashgen"
    }
    return row


def write_result(out: str | None, convention: str, rows: list) -> dict:
    """The result JSON every bench writes: the environment block, the TFLOP/s (or count)
    convention and the rows; written to `out` when one is given."""
    result = {"environment": environment(), "convention": convention, "rows": rows}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def environment() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    env = {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    try:
        import pycuda.driver as cuda

        env["driver"] = cuda.get_driver_version()
    except Exception:  # noqa: BLE001
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flashgen bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["specs/fwd_dense.yaml"])
    ap.add_argument("--libs", default=None, help="kernel libraries (default: build/kernels)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS))
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument(
        "--flex-min-seqlen",
        type=int,
        default=0,
        help="run FlexAttention only from this seqlen up (each shape compiles)",
    )
    ap.add_argument("--check", action="store_true", help="compare each output with SDPA FLASH")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from flashgen.generator.load import load_paths
    from flashgen.verify.runner import load_kernel

    specs = [
        s
        for s in load_paths(args.specs)
        if s.dtype.yaml == "bf16"
        and s.head_dim in args.head_dims
        and not s.mask.window
        and not s.mask.varlen
        and not s.dropout
        and not s.sparse
        and not s.instrument_io
        and s.mask.causal.yaml in ("none", "bottom_right")
    ]
    if not specs:
        print("flashgen bench: no bf16 dense forward spec matches", file=sys.stderr)
        return 2
    rows = []
    for spec in specs:
        kernel = load_kernel(spec, args.libs)
        causal = spec.mask.causal.yaml != "none"
        for n in args.seqlens:
            row = bench_case(
                kernel,
                spec.head_dim,
                causal,
                n,
                args.tokens,
                args.hidden,
                args.backends,
                not args.no_flex and n >= args.flex_min_seqlen,
                args.check,
                d_v=spec.head_dim_vo,
            )
            rows.append(row)
            cells = "  ".join(f"{be}={t:6.1f}" for be, t in row["tflops"].items() if t)
            print(
                f"d={spec.head_dim:3d} causal={int(causal)} n={n:5d}  {cells}  ({kernel.name})",
                flush=True,
            )
    write_result(args.out, "TFLOP/s = 4*b*h*n^2*d (/2 causal) / time", rows)
    print(format_table(rows))
    return 0


def format_table(rows: list[dict]) -> str:
    cols = ["flashgen", *BACKENDS, "FLEX"]
    head = "| d | causal | seqlen | " + " | ".join(cols) + " | vs FLASH |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for r in rows:
        cells = [f"{r['tflops'][c]:.0f}" if r["tflops"].get(c) else "-" for c in cols]
        ratio = r["ratio"].get("FLASH")
        ratio_s = f"{ratio:.2f}x" if ratio else "-"
        lines.append(
            f"| {r['d']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | "
            + " | ".join(cells)
            + f" | {ratio_s} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
