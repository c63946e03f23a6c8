"""Varlen backward benchmark: packed sequences (flash_attn_varlen_func's layout) through the
sm_90a backward, side by side in one run with the mma.sync backward that served varlen before
it, the sm_90a dense kernel on the same tokens as one batch, and SDPA's backward (CUDNN,
FLASH) on that batch.

Two packings of `--tokens` tokens (bf16, hidden = heads * head_dim = `--hidden`): `equal`,
`--tokens / 2048` sequences of 2048 (where the dense kernel and SDPA run the same work as a
batch), and `mixed`, seeded lengths in 128..4096 (a packed training batch; only the varlen
kernels run it). O and LSE come from SDPA FLASH's forward, sequence by sequence. TFLOP/s
count each sequence's 2.5 x 4 * h * n^2 * d (halved when causal), as bwd_bench does; times
are medians of `triton.testing.do_bench`. Each row also gives the largest difference of the
two varlen kernels' dQ, dK and dV (`max_abs_diff_sm90a_vs_sm90`).

    python -m flashgen.bench.varlen_bench --specs specs/bwd_sm90a.yaml \
        bench/specs/varlen_bwd.yaml --out bench/results/varlen_bwd_h100.json

Needs a GPU, PyTorch and Triton; the kernel libraries come from `flashgen compile`.
"""

from __future__ import annotations

import argparse
import math
import random
import sys

from flashgen.bench.bwd_bench import (
    SEL,
    bwd_flops,
    bwd_launcher,
    flashgen_backward,
    tensor_params,
)
from flashgen.bench.fwd_bench import write_result

BACKENDS = ("FLASH", "CUDNN")


def packings(tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """Sequence lengths per packing: `equal` (2048 each) and `mixed` (seeded, 128..4096, the
    last one trimmed so that they sum to `tokens`)."""
    rng = random.Random(seed)
    mixed: list[int] = []
    while sum(mixed) < tokens:
        mixed.append(min(rng.randint(128, 4096), tokens - sum(mixed)))
    return {"equal": [2048] * max(1, tokens // 2048), "mixed": mixed}


def varlen_backward(kernel, q, k, v, o, lse, do, cu, max_len: int, scale: float):
    """(launch callable, dq, dk, dv) of a varlen backward kernel on packed (total, heads, d)
    tensors, lse (heads, total) and int32 `cu` (batch + 1 offsets, the same for queries and
    keys)."""
    import torch

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    total, h, d = q.shape
    params = {
        **tensor_params(q, k, v, o, lse, do, dq, dk, dv, packed=True),
        "batch": cu.numel() - 1, "heads": h, "kv_heads": k.shape[1],
        "seqlen_q": max_len, "seqlen_k": max_len, "total_q": total, "total_k": k.shape[0],
        "cu_seqlens_q": cu.data_ptr(), "cu_seqlens_k": cu.data_ptr(),
        "head_dim": d, "head_dim_v": v.shape[-1], "softmax_scale": scale,
        "window_left": -1, "window_right": -1,
    }  # fmt: skip
    return bwd_launcher(kernel, params, cu.numel() - 1, max_len, h, d), dq, dk, dv


def bench_case(kernels: dict, d: int, causal: bool, packing: str, lens: list[int], hidden: int,
               backends) -> dict:  # fmt: skip
    """One row: `kernels` maps sm90a_varlen, sm90_varlen and (optional) sm90a_dense to
    (spec, kernel)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    heads, total, max_len = hidden // d, sum(lens), max(lens)
    scale = 1.0 / math.sqrt(d)
    torch.manual_seed(0)
    q, k, v, do = (
        torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    o = torch.empty_like(q)
    lse = torch.empty(heads, total, device="cuda", dtype=torch.float32)
    for b, n in enumerate(lens):  # O and LSE of each sequence from SDPA FLASH's forward
        s0 = int(cu[b])
        qs, ks, vs = (t[s0 : s0 + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(qs, ks, vs, 0.0, causal, False)
        o[s0 : s0 + n] = out[0][0].transpose(0, 1)
        lse[:, s0 : s0 + n] = out[1][0]
    fl = sum(bwd_flops(1, heads, n, d, causal) for n in lens)
    row = {"d": d, "causal": causal, "packing": packing, "lens": lens, "tokens": total,
           "heads": heads, "kernels": {}, "ms": {}, "tflops": {}}  # fmt: skip

    def timed(name, fn):
        try:
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run this case
            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            return
        row["ms"][name] = ms
        row["tflops"][name] = fl / (ms * 1e-3) / 1e12

    grads = {}
    for name in ("sm90a_varlen", "sm90_varlen"):
        _, kernel = kernels[name]
        row["kernels"][name] = kernel.name
        launch, *g = varlen_backward(kernel, q, k, v, o, lse, do, cu, max_len, scale)
        timed(name, launch)
        launch()
        torch.cuda.synchronize()
        grads[name] = g
    row["max_abs_diff_sm90a_vs_sm90"] = {
        nm: float((a.float() - b_.float()).abs().max())
        for nm, a, b_ in zip(("dq", "dk", "dv"), grads["sm90a_varlen"], grads["sm90_varlen"])
    }
    if packing == "equal":  # the same tokens as one batch (b, 2048, h, d)
        b, n = len(lens), lens[0]
        qb, kb, vb, ob, dob = (t.view(b, n, heads, d) for t in (q, k, v, o, do))
        lseb = lse.view(heads, b, n).transpose(0, 1).contiguous()
        if kernels.get("sm90a_dense"):
            _, kernel = kernels["sm90a_dense"]
            row["kernels"]["sm90a_dense"] = kernel.name
            timed("sm90a_dense", flashgen_backward(kernel, qb, kb, vb, ob, lseb, dob, scale)[0])
        qt, kt, vt, dot = (t.transpose(1, 2) for t in (qb, kb, vb, dob))
        for be in backends:
            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (qt, kt, vt))
            try:
                with sdpa_kernel(getattr(SDPBackend, SEL[be])):
                    res = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            except Exception as exc:  # noqa: BLE001
                row.setdefault("errors", {})[be] = f"{type(exc).__name__}: {str(exc)[:120]}"
                continue

            def bwd(res=res, qg=qg, kg=kg, vg=vg, dot=dot):
                torch.autograd.grad(res, (qg, kg, vg), dot, retain_graph=True)

            timed(be, bwd)
    ours = row["tflops"].get("sm90a_varlen")
    row["ratio"] = {
        nm: ours / t for nm, t in row["tflops"].items() if nm != "sm90a_varlen" and ours and t
    }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="varlen_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["specs/bwd_sm90a.yaml",
                                                   "bench/specs/varlen_bwd.yaml"])  # fmt: skip
    ap.add_argument("--libs", default=None, help="kernel libraries (default: build/kernels)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from flashgen.generator.load import load_paths
    from flashgen.verify.runner import load_kernel

    found: dict[tuple, tuple] = {}
    for s in load_paths(args.specs):
        if (
            s.kernel.yaml != "backward" or s.dtype.yaml != "bf16"
            or s.head_dim not in args.head_dims
            or s.gqa or s.mask.window or s.deterministic or s.features or s.dropout or s.sparse
            or s.instrument_io or s.score_mod is not None or s.mask_mod is not None
            or s.mask.causal.yaml not in ("none", "bottom_right")
        ):  # fmt: skip
            continue
        role = {(True, "sm_90a"): "sm90a_varlen", (True, "sm_90"): "sm90_varlen",
                (False, "sm_90a"): "sm90a_dense"}.get((s.mask.varlen, s.target.yaml))  # fmt: skip
        if role:
            found.setdefault((s.head_dim, s.mask.causal.yaml != "none", role), s)
    rows = []
    for d in args.head_dims:
        for causal in (False, True):
            kernels = {
                role: (spec, load_kernel(spec, args.libs))
                for (dd, cc, role), spec in found.items() if dd == d and cc == causal
            }  # fmt: skip
            if "sm90a_varlen" not in kernels or "sm90_varlen" not in kernels:
                print(f"varlen_bench: no sm_90a and sm_90 varlen pair at d {d}, "
                      f"causal {causal}, in {args.specs}", file=sys.stderr)  # fmt: skip
                return 2
            for packing, lens in packings(args.tokens).items():
                row = bench_case(kernels, d, causal, packing, lens, args.hidden, args.backends)
                rows.append(row)
                cells = "  ".join(f"{nm}={t:6.1f}" for nm, t in row["tflops"].items())
                print(f"d={d:3d} causal={int(causal)} {packing:6s} {cells}  "
                      f"diff={row['max_abs_diff_sm90a_vs_sm90']}", flush=True)  # fmt: skip
    convention = ("TFLOP/s = sum over sequences of 2.5 * 4*h*n^2*d (/2 causal) / time "
                  "(backward only); ratio = sm90a_varlen's TFLOP/s / each other's")  # fmt: skip
    write_result(args.out, convention, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
