"""Head dims that are not multiples of 16 against the next multiple of 64, in one run.

A head dim of 8 * odd runs on the next multiple of 16 on chip (mma.sync) or 64 (sm_90a, the
TMA box), so d = 72 does the work of 80 (or 128) and d = 200 that of 208 (or 256). The bar
(issue "every shape"): d 72 and d 200 run at >= 0.9x the TFLOP/s of d 128 and d 256 (the next
multiples of 64) in the same run, TFLOP/s counted on the real d. Each row is the forward
benchmark's (bench/fwd_bench.py) or the backward's (bench/bwd_bench.py), with SDPA's backends
and FlexAttention (forward) beside flashgen, plus `pass`, `d_v` and `vs_next64`.

d_qk != d_v: rows of d 192 with d_v 128 (DeepSeek-style prefill, specs/dv.yaml), forward on
both targets and backward on sm_90 (the sm_90a backward takes one head dim), seqlen 4k-16k,
against SDPA's CUDNN backend (which serves d_qk != d_v; FLASH refuses it): the bar is
flashgen >= 1.0x CUDNN (`vs_cudnn`). `--only-dv` times those rows alone and, with `--out`,
replaces the d_v != d rows of an existing file, keeping its others.

    python -m flashgen.bench.shapes_bench --out bench/results/shapes_h200.json

Needs a GPU, PyTorch, Triton and PyCUDA; the kernels come from `flashgen compile specs/`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (pass, target, d, the next multiple of 64): the sm_90a backward serves d <= 128 only, so
# d 200's backward is the mma.sync one (target sm_90) against its own d 256.
PAIRS = (
    ("fwd", "sm_90a", 72, 128),
    ("fwd", "sm_90a", 200, 256),
    ("fwd", "sm_90", 72, 128),
    ("fwd", "sm_90", 200, 256),
    ("bwd", "sm_90a", 72, 128),
    ("bwd", "sm_90", 200, 256),
)
# (pass, target, d, d_v): d_qk != d_v, against SDPA CUDNN
DV_CASES = (
    ("fwd", "sm_90a", 192, 128),
    ("fwd", "sm_90", 192, 128),
    ("bwd", "sm_90", 192, 128),
)


def _plain(spec, kind: str, target: str, d: int, causal: bool, d_v: int | None = None) -> bool:
    return (
        spec.kernel.yaml == kind
        and spec.target.yaml == target
        and spec.head_dim == d
        and spec.head_dim_vo == (d if d_v is None else d_v)
        and spec.dtype.yaml == "bf16"
        and spec.plain
        and not spec.deterministic
        and (spec.mask.causal.yaml != "none") == causal
        and spec.mask.causal.yaml in ("none", "bottom_right")
    )


def find_spec(specs, kind: str, target: str, d: int, causal: bool, d_v: int | None = None):
    for s in specs:
        if _plain(s, kind, target, d, causal, d_v):
            return s
    raise SystemExit(
        f"shapes_bench: no plain bf16 {kind} spec for {target} d={d} d_v={d_v or d} "
        f"causal={causal} in the --specs files (the d_v rows need specs/dv.yaml; default: specs/)"
    )


def dv_rows(specs, args, load_kernel) -> list[dict]:
    """The d_qk != d_v rows (DV_CASES) at `args.dv_seqlens`, each with `vs_cudnn`."""
    from flashgen.bench import bwd_bench, fwd_bench

    rows = []
    for kind, target, d, d_v in DV_CASES:
        for causal in (False, True):
            kind_yaml = {"fwd": "forward", "bwd": "backward"}[kind]
            kernel = load_kernel(find_spec(specs, kind_yaml, target, d, causal, d_v), args.libs)
            fkernel = None
            if kind == "bwd":  # its O and LSE come from the flashgen forward (FLASH refuses d_v)
                fspec = find_spec(specs, "forward", target, d, causal, d_v)
                fkernel = load_kernel(fspec, args.libs)
            for n in args.dv_seqlens:
                if kind == "fwd":
                    row = fwd_bench.bench_case(
                        kernel, d, causal, n, args.tokens, args.hidden, ("CUDNN", "FLASH"),
                        False, False, d_v=d_v,
                    )  # fmt: skip
                else:
                    row = bwd_bench.bench_case(
                        kernel, fkernel, d, causal, n, args.tokens, args.hidden,
                        ("CUDNN", "FLASH"), False, d_v=d_v,
                    )  # fmt: skip
                row.update({"pass": kind, "target": target})
                row["vs_cudnn"] = row["ratio"].get("CUDNN")
                rows.append(row)
                ours, cudnn = row["tflops"].get("flashgen"), row["tflops"].get("CUDNN")
                print(
                    f"{kind} {target} d={d} d_v={d_v} causal={int(causal)} n={n:5d}: "
                    f"{ours or 0:6.1f} TFLOP/s vs SDPA CUDNN {cudnn or 0:6.1f} -> "
                    f"{row['vs_cudnn'] or 0:.3f}",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shapes_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="+", default=["specs/"])
    ap.add_argument("--libs", default=None, help="kernel libraries (default: build/kernels)")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--dv-seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--only-dv", action="store_true", help="the d_qk != d_v rows alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from flashgen.bench import bwd_bench, fwd_bench
    from flashgen.generator.load import load_paths
    from flashgen.verify.runner import load_kernel

    specs = list(load_paths(args.specs))
    rows = []
    for kind, target, d, d64 in () if args.only_dv else PAIRS:
        for causal in (False, True):
            by_d = {}
            for dd in (d, d64):
                spec = find_spec(specs, {"fwd": "forward", "bwd": "backward"}[kind], target, dd,
                                 causal)  # fmt: skip
                kernel = load_kernel(spec, args.libs)
                for n in args.seqlens:
                    if kind == "fwd":
                        row = fwd_bench.bench_case(
                            kernel, dd, causal, n, args.tokens, args.hidden,
                            fwd_bench.BACKENDS, not args.no_flex, False,
                        )  # fmt: skip
                    else:
                        row = bwd_bench.bench_case(
                            kernel, None, dd, causal, n, args.tokens, args.hidden,
                            bwd_bench.BACKENDS, False,
                        )  # fmt: skip
                    row.update({"pass": kind, "target": target, "d_v": dd})
                    by_d[(dd, n)] = row
                    rows.append(row)
            for n in args.seqlens:
                lo, hi = by_d[(d, n)], by_d[(d64, n)]
                a, b = lo["tflops"].get("flashgen"), hi["tflops"].get("flashgen")
                lo["next64"] = d64
                lo["vs_next64"] = a / b if a and b else None
                print(
                    f"{kind} {target} causal={int(causal)} n={n:5d}: d={d} "
                    f"{a or 0:6.1f} vs d={d64} {b or 0:6.1f} TFLOP/s -> {lo['vs_next64'] or 0:.3f}"
                    f"   SDPA CUDNN d={d}: {lo['tflops'].get('CUDNN') or 0:6.1f}",
                    flush=True,
                )
    rows += dv_rows(specs, args, load_kernel)
    result = {
        "environment": fwd_bench.environment(),
        "convention": "TFLOP/s on the real d: forward 4*b*h*n^2*d, backward 2.5x that "
        "(/2 causal); vs_next64 = flashgen TFLOP/s at d / at the next multiple of 64, one run; "
        "d_v != d rows: forward 2*b*h*n^2*(d + d_v), backward 2*b*h*n^2*(3d + 2d_v), "
        "vs_cudnn = flashgen / SDPA CUDNN TFLOP/s",
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        if args.only_dv and out.exists():  # keep the file's d_v = d rows, replace the others
            kept = [
                r for r in json.loads(out.read_text())["rows"] if r.get("d_v", r["d"]) == r["d"]
            ]
            result["rows"] = kept + rows
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
