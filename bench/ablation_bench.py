"""Ablation of the Hopper forward (sm_90a), like FlashAttention-3's Table 2: the shipped
auto-tile kernel next to builds of the same generated source with one feature turned off, in
one run, on the same inputs, timed like `fwd_bench` (its `bench_case`), with SDPA CUDNN beside.

    python -m flashgen.bench.ablation_bench [--out FILE] [--seqlens ...] [--head-dims 64 128]
    python -m flashgen.bench.ablation_bench --build-only   # no GPU: registers and spills

Variants (`VARIANTS`): `full` (the shipped kernel: 3 stages, intra-warpgroup overlap,
ping-pong, setmaxnreg), `no_pingpong`, `no_overlap` (the plain loop at 3 stages, hence no
ping-pong either), `no_setmaxnreg` (no register reallocation; the TMA producer warpgroup
stays, so this is NOT "no warp specialisation", which the kernel has no path for) through the
`FG_SM90_ABLATE_*` macros of include/flashgen/fwd_sm90_kernel.cuh, and `stages2` / `stages1`
(the spec's tile with 2 or 1 K/V stages: both run the plain loop). Every variant is compiled
up front, in parallel, with generator/compile.py's nvcc flags, each into its own folder (the
exported symbols are named by the kernel, so a -D variant shares its name with `full`).
bf16, 16k tokens, hidden 2048, causal and not. Rows: {head_dim, causal, seqlen, variant,
kernel, tflops, ms, max_abs_diff (vs SDPA FLASH; null for CUDNN), registers, spills}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

MACRO = "FG_SM90_ABLATE_"
# label -> (K/V stages, None: the auto tile's; the FG_SM90_ABLATE_* switches set to 1)
VARIANTS = {
    "full": (None, ()),
    "no_pingpong": (None, ("NO_PINGPONG",)),
    "no_overlap": (None, ("NO_OVERLAP",)),
    "no_setmaxnreg": (None, ("NO_SETMAXNREG",)),
    "stages2": (2, ()),
    "stages1": (1, ()),
}


def auto_spec(head_dim: int, causal: bool):
    """The shipped auto-tile sm_90a forward (the kernel of specs/fwd_sm90a.yaml: same name,
    same generated source)."""
    from flashgen.generator.load import load_spec_text

    mask = "bottom_right" if causal else "none"
    text = f"kernel: forward\ntarget: sm_90a\ndtype: bf16\nhead_dim: {head_dim}\n"
    return load_spec_text(text + f"mask: {{causal: {mask}}}\n", "specs/fwd_sm90a.yaml")[0]


def variants(spec) -> list[tuple[str, object, list[str]]]:
    """(label, spec, extra nvcc flags) per variant; a stage count equal to the spec's is left
    out (it would be `full`)."""
    out = []
    for label, (stages, macros) in VARIANTS.items():
        if stages == spec.tile.stages:
            continue
        s = spec
        if stages is not None:
            s = spec.replace(tile=dataclasses.replace(spec.tile, stages=stages), tile_auto=False)
        out.append((label, s, [f"-D{MACRO}{m}=1" for m in macros]))
    return out


def build(jobs: list, out: Path, workers: int | None = None) -> list[dict]:
    """Renders and compiles each (label, spec, flags) into `out/<label>/<name>.so` in
    parallel (nvcc processes), with ptxas's registers and spills of each."""
    from flashgen.generator.compile import nvcc_flags, parse_ptxas
    from flashgen.generator.render import Renderer
    from flashgen.generator.writer import write_if_different

    renderer, src = Renderer(), out / "src"
    files = dict(renderer.include_files())
    names = {}
    for _, spec, _ in jobs:
        r = renderer.render(spec)
        names[spec] = r.name
        files.update(r.files)
    for rel, data in files.items():
        write_if_different(src / rel, data)

    def one(job) -> dict:
        label, spec, flags = job
        name, lib_dir = names[spec], out / label
        lib_dir.mkdir(parents=True, exist_ok=True)
        cmd = ["nvcc", *nvcc_flags(spec.target), *flags, "-o", str(lib_dir / f"{name}.so")]
        proc = subprocess.run([*cmd, f"{name}.cu"], cwd=src, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        funcs = list(parse_ptxas(text).values())
        entry = next((f for f in funcs if f.name == f"{name}_kernel"), None)
        return {
            "variant": label, "kernel": name, "flags": flags, "spec": spec, "lib_dir": lib_dir,
            "head_dim": spec.head_dim, "causal": spec.mask.causal.yaml != "none",
            "ok": proc.returncode == 0, "error": "" if proc.returncode == 0 else text[-2000:],
            "registers": entry.registers if entry else 0,
            "spill_stores": sum(f.spill_stores for f in funcs),
            "spill_loads": sum(f.spill_loads for f in funcs),
            "stack_frame": max((f.stack_frame for f in funcs), default=0),
        }  # fmt: skip

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(one, jobs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ablation_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--build-dir", default=None, help="default: a temporary folder")
    ap.add_argument("--build-only", action="store_true", help="compile and report; no GPU")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    specs = [auto_spec(d, c) for d in args.head_dims for c in (False, True)]
    jobs = [j for s in specs for j in variants(s) if j[0] in args.variants]
    built = build(jobs, Path(args.build_dir or tempfile.mkdtemp(prefix="flashgen-ablation-")))
    for b in built:
        spill = f"spill {b['spill_stores']}/{b['spill_loads']} B, stack {b['stack_frame']} B"
        state = f"{b['registers']} regs, {spill}" if b["ok"] else "FAILED\n" + b["error"]
        case = f"d={b['head_dim']:3d} causal={b['causal']:d} {b['variant']:13s}"
        print(f"{case} {b['kernel']}: {state}")
    if not all(b["ok"] for b in built):
        return 1
    if args.build_only:
        return 0

    from flashgen.bench.fwd_bench import bench_case, environment
    from flashgen.runtime import KernelLibrary

    keep = ("variant", "kernel", "flags", "registers", "spill_stores", "spill_loads")
    rows = []
    for d, c in dict.fromkeys((b["head_dim"], b["causal"]) for b in built):
        group = [b for b in built if (b["head_dim"], b["causal"]) == (d, c)]
        for b in group:  # each variant's own library: the same symbol names, another file
            b["lib"] = SimpleNamespace(
                name=b["kernel"], library=KernelLibrary(b["spec"], b["lib_dir"])
            )
        for n in args.seqlens:
            case = {"head_dim": d, "causal": c, "seqlen": n}
            for i, b in enumerate(group):  # bench_case seeds: the same inputs for each variant
                cudnn = ["CUDNN"] if i == 0 else []  # SDPA CUDNN once per case, beside `full`
                r = bench_case(b["lib"], d, c, n, args.tokens, args.hidden, cudnn, False, True)
                t, ms, diff = r["tflops"], r["ms"], r.get("max_abs_diff_vs_flash")
                rows.append({**case, **{k: b[k] for k in keep}, "max_abs_diff": diff,
                             "tflops": t["flashgen"], "ms": ms["flashgen"]})  # fmt: skip
                if cudnn:
                    rows.append({**case, "variant": "sdpa_cudnn", "kernel": "SDPA CUDNN",
                                 "tflops": t.get("CUDNN"), "ms": ms.get("CUDNN")})  # fmt: skip
            cells = [f"{x['variant']}={x['tflops'] or 0:.0f}" for x in rows[-len(group) - 1 :]]
            print(f"d={d:3d} causal={c:d} n={n:5d}  " + "  ".join(cells), flush=True)
    print(format_table(rows))
    if args.out:
        doc = {"environment": environment(), "convention": "TFLOP/s = 4*b*h*n^2*d (/2 causal)"}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**doc, "rows": rows}, indent=2) + "\n")
    return 0


def format_table(rows: list[dict]) -> str:
    """One line per (head_dim, causal, seqlen), one column per variant (TFLOP/s)."""
    cols = list(dict.fromkeys(r["variant"] for r in rows))
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["head_dim"], r["causal"], r["seqlen"]), {})[r["variant"]] = r["tflops"]
    lines = ["| d | causal | seqlen | " + " | ".join(cols) + " |", "|---" * (len(cols) + 3) + "|"]
    for (d, c, n), v in cells.items():
        vals = " | ".join(f"{v[x]:.0f}" if v.get(x) else "-" for x in cols)
        lines.append(f"| {d} | {'yes' if c else 'no'} | {n} | {vals} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
