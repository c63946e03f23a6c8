"""Backward benchmark: flashgen backward kernels side by side with PyTorch's attention.

For each (head_dim, causal, seqlen) the same bf16 inputs, output, LSE and dO go to the
flashgen backward of the spec and to the backward of SDPA with each backend forced (FLASH =
FlashAttention-2, CUDNN, EFFICIENT); times are medians of `triton.testing.do_bench`.
TFLOP/s count 2.5 x the forward's 4*b*h*n^2*d (halved when causal), the FlashAttention
papers' convention (with d_v != d: `bwd_flops`, 2*b*h*n^2*(3 d + 2 d_v)). batch * seqlen =
16k tokens, hidden = heads * head_dim = 2048. Also reported: forward + backward (flashgen
forward + backward against each backend's pair), and with --check the largest difference of
dQ, dK, dV from the FLASH backend's.

    python -m flashgen.bench.bwd_bench --specs specs/bwd_dense.yaml --fwd-specs \
        specs/fwd_dense.yaml --out bench/results/bwd_h200.json

Needs a GPU, PyTorch and Triton; the kernel libraries come from `flashgen compile`.
"""

from __future__ import annotations

import argparse
import math
import sys

from flashgen.bench.fwd_bench import flops, torch_params, write_result

BACKENDS = ("FLASH", "CUDNN", "EFFICIENT")
SEL = {"FLASH": "FLASH_ATTENTION", "CUDNN": "CUDNN_ATTENTION", "EFFICIENT": "EFFICIENT_ATTENTION"}


def tensor_params(q, k, v, o, lse, do, dq, dk, dv, packed: bool = False) -> dict:
    """The pointers and strides of fg_bwd_params for torch tensors (b, s, h, d), lse (b, h, s);
    `packed` (varlen): (total, h, d) tensors, which have no batch stride, and lse (h, total)."""
    p = {
        "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(),
        "dout": do.data_ptr(), "lse": lse.data_ptr(), "dq": dq.data_ptr(),
        "dk": dk.data_ptr(), "dv": dv.data_ptr(),
        "lse_batch_stride": 0 if packed else lse.stride(0),
        "lse_head_stride": lse.stride(0 if packed else 1),
    }  # fmt: skip
    for nm, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq), ("dk", dk),
                  ("dv", dv)):  # fmt: skip
        st = (0, *t.stride()) if packed else t.stride()
        p[f"{nm}_batch_stride"], p[f"{nm}_row_stride"], p[f"{nm}_head_stride"] = st[:3]
    return p


def bwd_launcher(kernel, params: dict, batch: int, seqlen_q: int, heads: int, head_dim: int):
    """The kernel's launch callable on `params` plus a workspace sized by its
    `<name>_workspace_bytes` and carved as runtime.workspace lays it out (dq_accum, dsum, then
    dq_sem, which kernels that are not deterministic ignore); the callable keeps it alive."""
    import torch
    from flashgen.runtime.workspace import workspace_layout

    ws = torch.empty(kernel.library.workspace_bytes(params), dtype=torch.uint8, device="cuda")
    carve = workspace_layout(batch, seqlen_q, heads, head_dim, deterministic=True)
    base = ws.data_ptr()
    launch = kernel.library.launcher(
        {**params, **{nm: base + carve[nm] for nm in ("dq_accum", "dsum", "dq_sem")}}
    )
    launch.keep = (ws,)
    return launch


def flashgen_backward(kernel, q, k, v, o, lse, do, scale, extra: dict | None = None):
    """(launch callable, dq, dk, dv) for the flashgen backward on these tensors; `extra`:
    more parameter fields (the score modifiers')."""
    import torch

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    b, s, h, d = q.shape
    params = {
        **tensor_params(q, k, v, o, lse, do, dq, dk, dv),
        "batch": b, "heads": h, "kv_heads": k.shape[2], "seqlen_q": s, "seqlen_k": k.shape[1],
        "head_dim": d, "head_dim_v": v.shape[-1],
        "softmax_scale": scale, "window_left": -1, "window_right": -1,
        **(extra or {}),
    }  # fmt: skip
    return bwd_launcher(kernel, params, b, s, h, d), dq, dk, dv


def bwd_flops(batch: int, heads: int, n: int, d: int, causal: bool, d_v: int | None = None):
    """Backward FLOPs: S = Q K^T again, dQ and dK (2 n^2 d each), dP = dO V^T and dV
    (2 n^2 d_v each) per (batch, head), halved when causal; with d_v = d, 2.5 x the forward's
    4 b h n^2 d (the FlashAttention papers' convention)."""
    d_v = d if d_v is None else d_v
    f = 2.0 * batch * heads * n * n * (3 * d + 2 * d_v)
    return f / 2 if causal else f


def bench_case(
    kernel, fwd_kernel, d, causal, n, tokens, hidden, backends, check, d_v=None, twin=None
) -> dict:
    """One row: the flashgen backward and each backend's on the same bf16 inputs, q and k of
    head dim d, v, out and dO of d_v (default d). O and LSE come from SDPA FLASH's forward,
    or with d_v != d (which FLASH refuses) from the flashgen forward `fwd_kernel`. `twin`: a
    second flashgen backward timed on the same tensors (a deterministic kernel's
    non-deterministic twin: row["twin"], and row["vs_twin"] = kernel's TFLOP/s / twin's)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    batch, heads = max(1, tokens // n), hidden // d
    d_v = d if d_v is None else d_v
    scale = 1.0 / math.sqrt(d)
    torch.manual_seed(0)
    q, k = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, do = (
        torch.randn(batch, n, heads, d_v, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if d_v == d:  # O and LSE from SDPA FLASH's forward (the backward takes the caller's)
        out = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False)
        o = out[0].transpose(1, 2).contiguous()
        lse = out[1].contiguous()  # (b, h, n) natural log, fp32
    else:
        if fwd_kernel is None:
            raise ValueError("d_v != d: give the flashgen forward kernel for O and LSE")
        o = torch.empty(batch, n, heads, d_v, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
        fwd_kernel.library.launcher(torch_params(fwd_kernel, q, k, v, o, lse, scale))()
    fl_bwd = bwd_flops(batch, heads, n, d, causal, d_v)
    fl_fwd = flops(batch, heads, n, d, causal, d_v)
    row = {"d": d, "d_v": d_v, "causal": causal, "seqlen": n, "batch": batch, "heads": heads,
           "kernel": kernel.name, "ms": {}, "tflops": {}, "fwd_bwd_ms": {}}  # fmt: skip

    def timed(fn):
        try:
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this case
            row.setdefault("errors", {})[str(fn)] = f"{type(exc).__name__}: {str(exc)[:120]}"
            return None

    launch, dq, dk, dv = flashgen_backward(kernel, q, k, v, o, lse, do, scale)
    ms = timed(launch)
    row["ms"]["flashgen"] = ms
    row["tflops"]["flashgen"] = fl_bwd / (ms * 1e-3) / 1e12 if ms else None
    if twin is not None:
        twin_launch, *_ = flashgen_backward(twin, q, k, v, o, lse, do, scale)
        ms_twin = timed(twin_launch)
        row["twin"] = {"kernel": twin.name, "ms": ms_twin,
                       "tflops": fl_bwd / (ms_twin * 1e-3) / 1e12 if ms_twin else None}  # fmt: skip
        row["vs_twin"] = ms_twin / ms if ms and ms_twin else None
    if fwd_kernel is not None:
        o2, lse2 = torch.empty_like(o), torch.empty(batch, heads, n, device="cuda")
        fwd = fwd_kernel.library.launcher(torch_params(fwd_kernel, q, k, v, o2, lse2, scale))
        launch2, *_ = flashgen_backward(kernel, q, k, v, o2, lse2, do, scale)

        def both():
            fwd()
            launch2()

        row["fwd_bwd_ms"]["flashgen"] = timed(both)
    dot = do.transpose(1, 2)
    for be in backends:
        sel = getattr(SDPBackend, SEL[be])
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (qt, kt, vt))
        try:
            with sdpa_kernel(sel):
                res = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        except Exception as exc:  # noqa: BLE001
            row.setdefault("errors", {})[be] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue

        def bwd(res=res, qg=qg, kg=kg, vg=vg):
            torch.autograd.grad(res, (qg, kg, vg), dot, retain_graph=True)

        ms = timed(bwd)
        row["ms"][be] = ms
        row["tflops"][be] = fl_bwd / (ms * 1e-3) / 1e12 if ms else None

        def fwd_bwd(sel=sel, qg=qg, kg=kg, vg=vg):
            with sdpa_kernel(sel):
                r = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            torch.autograd.grad(r, (qg, kg, vg), dot)

        row["fwd_bwd_ms"][be] = timed(fwd_bwd)
        if check and be == "FLASH":
            launch()
            torch.cuda.synchronize()
            gq, gk, gv = torch.autograd.grad(res, (qg, kg, vg), dot, retain_graph=True)
            row["max_abs_diff_vs_flash"] = {
                nm: float((a.float() - b_.transpose(1, 2).float()).abs().max())
                for nm, a, b_ in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv))
            }
    ours = row["tflops"].get("flashgen")
    row["ratio"] = {
        be: (ours / t if ours and t else None)
        for be, t in row["tflops"].items()
        if be != "flashgen"
    }
    row["fwd_bwd_tflops"] = {
        be: (fl_fwd + fl_bwd) / (t * 1e-3) / 1e12 for be, t in row["fwd_bwd_ms"].items() if t
    }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bwd_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["specs/bwd_dense.yaml"])
    ap.add_argument("--fwd-specs", nargs="*", default=[], help="forward specs for fwd+bwd rows")
    ap.add_argument("--libs", default=None, help="kernel libraries (default: build/kernels)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS))
    ap.add_argument("--check", action="store_true", help="compare dQ, dK, dV with SDPA FLASH")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="benchmark the deterministic kernels only, each beside its non-deterministic "
        "twin (same head dim, mask and target) when --specs holds one",
    )
    ap.add_argument("--target", default=None, help="only kernels of this target (e.g. sm_90a)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from flashgen.generator.load import load_paths
    from flashgen.verify.runner import load_kernel

    def dense(s):
        return (
            s.dtype.yaml == "bf16" and s.head_dim in args.head_dims and s.plain
            and s.mask.causal.yaml in ("none", "bottom_right")
        )  # fmt: skip

    loaded = [s for s in load_paths(args.specs) if s.kernel.yaml == "backward" and dense(s)]
    specs = [
        s for s in loaded
        if s.deterministic == args.deterministic and args.target in (None, s.target.yaml)
    ]  # fmt: skip
    twins = {
        (s.head_dim, s.mask.causal, s.target): s for s in loaded if not s.deterministic
    } if args.deterministic else {}  # fmt: skip
    fwd = {
        (s.head_dim, s.head_dim_vo, s.mask.causal): s
        for s in load_paths(args.fwd_specs) if s.kernel.yaml == "forward" and dense(s)
    } if args.fwd_specs else {}  # fmt: skip
    if not specs:
        print("bwd_bench: no bf16 dense backward spec matches", file=sys.stderr)
        return 2
    rows = []
    for spec in specs:
        kernel = load_kernel(spec, args.libs)
        fspec = fwd.get((spec.head_dim, spec.head_dim_vo, spec.mask.causal))
        fkernel = load_kernel(fspec, args.libs) if fspec is not None else None
        causal = spec.mask.causal.yaml != "none"
        tspec = twins.get((spec.head_dim, spec.mask.causal, spec.target))
        twin = load_kernel(tspec, args.libs) if tspec is not None else None
        for n in args.seqlens:
            row = bench_case(
                kernel, fkernel, spec.head_dim, causal, n, args.tokens, args.hidden,
                args.backends, args.check, d_v=spec.head_dim_vo, twin=twin,
            )  # fmt: skip
            rows.append(row)
            cells = "  ".join(f"{be}={t:6.1f}" for be, t in row["tflops"].items() if t)
            if row.get("vs_twin"):
                cells += f"  vs_twin={row['vs_twin']:.3f}"
            extra = f"  diff={row.get('max_abs_diff_vs_flash')}" if args.check else ""
            print(f"d={spec.head_dim:3d} causal={int(causal)} n={n:5d}  {cells}{extra}", flush=True)
    convention = ("TFLOP/s = 2.5 * 4*b*h*n^2*d (/2 causal) / time (backward only); "
                  "with d_v != d, 2*b*h*n^2*(3d + 2d_v)")  # fmt: skip
    write_result(args.out, convention, rows)
    print(format_table(rows))
    return 0


def format_table(rows: list[dict]) -> str:
    cols = ["flashgen", *BACKENDS]
    ratios = " | vs FLASH | vs CUDNN | fwd+bwd vs FLASH |"
    head = "| d | causal | seqlen | " + " | ".join(cols) + ratios
    lines = [head, "|" + "---|" * (len(cols) + 6)]
    for r in rows:
        cells = [f"{r['tflops'][c]:.0f}" if r["tflops"].get(c) else "-" for c in cols]
        ratio = [r["ratio"].get(b) for b in ("FLASH", "CUDNN")]
        fb = r["fwd_bwd_tflops"]
        fbr = fb.get("flashgen") / fb["FLASH"] if fb.get("flashgen") and fb.get("FLASH") else None
        rs = [f"{x:.2f}x" if x else "-" for x in (*ratio, fbr)]
        lines.append(
            f"| {r['d']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | "
            + " | ".join(cells) + " | " + " | ".join(rs) + " |"
        )  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
