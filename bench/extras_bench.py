"""Benchmarks of the FlashAttention paper's extras, side by side in one run (needs a GPU).

    python -m flashgen.bench.extras_bench sparse   --out bench/results/sparse_h200.json
    python -m flashgen.bench.extras_bench blocksize --out bench/results/blocksize_h200.json
    python -m flashgen.bench.extras_bench gpt2     (one forward at the paper's GPT-2-medium
        shape; run under Nsight Compute by bench/ncu_io.sh)

sparse: block-sparse forward at seqlen 8k, d = 64, batch 2 x 32 heads, bf16, a random block
  layout at 128 x 128 granularity with the diagonal kept (shared by all heads), densities
  1 .. 1/8: the flashgen sparse kernel on that layout, the same kernel on the full layout
  ("dense"), and FlexAttention with a block mask of the same layout.
blocksize: the dense d = 64 kernel at several block_n (bench/specs/blocksize.yaml): runtime
  and the IO model's HBM bytes, for the paper's Figure 2 (middle).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flashgen.bench.fwd_bench import environment, flops, make_launcher, torch_params  # noqa: E402


def _layout_params(layout, torch):
    """fg_fwd_params fields (and the tensors that must stay alive) for a CompactLayout."""
    keep, p = [], {}
    for nm in ("full_count", "full_idx", "part_count", "part_idx"):
        t = torch.from_numpy(np.ascontiguousarray(getattr(layout, nm), dtype=np.int32)).cuda()
        keep.append(t)
        p[f"blk_{nm}"] = t.data_ptr()
    p["blk_layout_heads"] = layout.full_count.shape[0]
    p["blk_max_blocks"] = layout.full_idx.shape[-1]
    return p, keep


def sparse(args) -> dict:
    import torch
    from flashgen.verify.blocksparse import compact_layout_for_spec
    from flashgen.verify.runner import load_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    spec = [
        s
        for s in _all("specs/fwd_extras.yaml")
        if s.sparse and not s.instrument_io and s.mask.causal.yaml == "none"
    ][0]
    kernel = load_kernel(spec)
    n, d, batch, heads, blk = args.seqlen, spec.head_dim, 2, 32, 128
    bm, bn = spec.tile.block_m, spec.tile.block_n
    assert blk % bm == 0 and blk % bn == 0
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    o = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    base = torch_params(kernel, q, k, v, o, lse, scale)
    flex = torch.compile(flex_attention)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    rng = np.random.default_rng(1)
    nb = n // blk
    rows = []
    for density in args.densities:
        coarse = rng.random((nb, nb)) < density
        np.fill_diagonal(coarse, True)
        fine = np.repeat(np.repeat(coarse, blk // bm, axis=0), blk // bn, axis=1)[None]
        layout = compact_layout_for_spec(fine, spec, seqlen_q=n, seqlen_k=n)
        lp, keep = _layout_params(layout, torch)
        launch = make_launcher(kernel, {**base, **lp})
        ms_ours = do_bench(launch, warmup=25, rep=100, return_mode="median")
        blocks = torch.from_numpy(coarse).cuda()

        def mask_mod(b, h, qi, kj, blocks=blocks):
            return blocks[qi // blk, kj // blk]

        bmask = create_block_mask(mask_mod, None, None, n, n, device="cuda", BLOCK_SIZE=blk)
        ms_flex = do_bench(
            lambda bmask=bmask: flex(qt, kt, vt, block_mask=bmask),
            warmup=25,
            rep=100,
            return_mode="median",
        )
        if args.check:  # same layout, same function: compare outputs
            launch()
            ref = flex(qt, kt, vt, block_mask=bmask).transpose(1, 2)
            torch.cuda.synchronize()
            diff = float((o.float() - ref.float()).abs().max())
        else:
            diff = None
        rows.append(
            {
                "density": float(density),
                "actual_density": float(coarse.mean()),
                "flashgen_ms": ms_ours,
                "flex_ms": ms_flex,
                "max_abs_diff_vs_flex": diff,
            }
        )
        print(
            f"density {density:.3f} (actual {coarse.mean():.3f}): flashgen {ms_ours:.3f} ms, "
            f"flex {ms_flex:.3f} ms, diff {diff}",
            flush=True,
        )
        del keep
    dense_ms = next(r["flashgen_ms"] for r in rows if r["density"] >= 1.0)
    for r in rows:
        r["speedup_vs_dense"] = dense_ms / r["flashgen_ms"]
        r["ratio_vs_flex"] = r["flex_ms"] / r["flashgen_ms"]
    return {
        "kind": "sparse",
        "kernel": kernel.name,
        "seqlen": n,
        "d": d,
        "batch": batch,
        "heads": heads,
        "block": blk,
        "rows": rows,
    }


def _all(path):
    from flashgen.generator.load import load_paths

    return load_paths([REPO / path])


def blocksize(args) -> dict:
    import torch
    from flashgen.verify import io_model
    from flashgen.verify.runner import load_kernel
    from triton.testing import do_bench

    n, batch, heads = 4096, 4, 16
    rows = []
    for spec in _all("bench/specs/blocksize.yaml"):
        kernel = load_kernel(spec)
        d = spec.head_dim
        q, k, v = (
            torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        o = torch.empty_like(q)
        lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
        launch = make_launcher(kernel, torch_params(kernel, q, k, v, o, lse, d**-0.5))
        ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
        hbm = io_model.forward_bytes(
            spec, batch=batch, heads=heads, kv_heads=heads, seqlen_q=n, seqlen_k=n
        )
        rows.append(
            {
                "kernel": kernel.name,
                "block_m": spec.tile.block_m,
                "block_n": spec.tile.block_n,
                "ms": ms,
                "model_bytes": hbm["total"],
                "tflops": flops(batch, heads, n, d, False) / (ms * 1e-3) / 1e12,
            }
        )
        print(rows[-1], flush=True)
    return {"kind": "blocksize", "seqlen": n, "batch": batch, "heads": heads, "rows": rows}


def gpt2(args) -> dict:
    """One flashgen and one SDPA MATH forward at batch 64, seqlen 1024, 16 heads, d 64, fp16."""
    import torch
    import torch.nn.functional as F
    from flashgen.verify import io_model
    from flashgen.verify.runner import load_kernel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = [
        s
        for s in _all("specs/fwd_dense.yaml")
        if s.head_dim == 64 and s.dtype.yaml == "fp16" and s.mask.causal.yaml == "none"
    ][0]
    kernel = load_kernel(spec)
    b, n, h, d = 64, 1024, 16, 64
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
    launch = make_launcher(kernel, torch_params(kernel, q, k, v, o, lse, d**-0.5))
    launch()
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.cuda.synchronize()
    model = io_model.forward_bytes(spec, batch=b, heads=h, kv_heads=h, seqlen_q=n, seqlen_k=n)
    std = io_model.standard_attention_bytes(b, h, n, n, d, elt=2)
    return {
        "kind": "gpt2",
        "kernel": kernel.name,
        "shape": [b, n, h, d],
        "model_bytes": model,
        "standard_model_bytes": std,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["sparse", "blocksize", "gpt2"])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    result = {"sparse": sparse, "blocksize": blocksize, "gpt2": gpt2}[args.what](args)
    result["environment"] = environment()
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
