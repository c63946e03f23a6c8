"""A/B benchmark: this version's kernels against another version's, side by side in one run,
on the same tensors, with SDPA FLASH as the anchor (forwards of every target; with
`--backward`, the backward families too).

The other version is given as its `generated/` folder (a git checkout or `git archive` of an
earlier commit): each of its `.cu` files whose readable name (the name without the hash)
matches one of this version's shipped bf16 dense kernels is compiled here into a host library
with the same nvcc flags (its spec's target), and both are launched through their C
launchers with one parameter struct: the structs only grew at their end (the score
parameters), so an older launcher reads its own prefix of today's.

    git archive <old-commit> generated | tar -x -C /tmp/old
    flashgen compile specs/fwd_dense.yaml
    python3 -m flashgen.bench.ab_bench --baseline /tmp/old/generated --out ab.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from flashgen.bench.bwd_bench import flashgen_backward
from flashgen.bench.fwd_bench import environment, flops, torch_params


def baseline_libraries(generated: Path, names: dict, out: Path) -> dict[str, Path]:
    """readable name -> compiled library of the other version's kernel of that name
    (`names`: readable name -> this version's spec), compiled in parallel."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.generator.compile import nvcc_flags

    jobs = {}
    for cu in sorted(generated.glob("fa_*.cu")):
        readable = cu.stem.rpartition("_")[0]
        if readable in names:
            jobs[readable] = cu

    def build(item: tuple[str, Path]) -> tuple[str, Path | None]:
        readable, cu = item
        prebuilt = generated / f"{cu.stem}.so"  # built beforehand (same command, elsewhere)
        if prebuilt.is_file():
            return readable, prebuilt
        lib = out / f"{cu.stem}.so"
        cmd = ["nvcc", *nvcc_flags(names[readable].target), "-o", str(lib), cu.name]
        proc = subprocess.run(cmd, cwd=generated, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"ab_bench: {cu.name} does not build: {proc.stderr[-400:]}", file=sys.stderr)
            return readable, None
        return readable, lib

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        built = dict(pool.map(build, jobs.items()))
    return {k: v for k, v in built.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ab_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other version's generated/ folder")
    ap.add_argument("--specs", nargs="+", default=["specs/fwd_dense.yaml"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all cases (spread)")
    ap.add_argument("--backward", action="store_true", help="also the backward kernels")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from flashgen.generator.families import family
    from flashgen.generator.load import load_paths
    from flashgen.generator.naming import readable_parts
    from flashgen.runtime import params_struct
    from flashgen.verify.runner import load_kernel
    from flashgen.verify.runner_bwd import load_bwd_kernel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    kinds = ("forward", "backward") if args.backward else ("forward",)
    specs = [
        s for s in load_paths(args.specs)
        if s.kernel.yaml in kinds and s.dtype.yaml == "bf16" and s.head_dim in args.head_dims
        and s.mask.causal.yaml in ("none", "bottom_right") and s.plain
    ]  # fmt: skip
    names = {"_".join(readable_parts(s)): s for s in specs}
    tmp = Path(tempfile.mkdtemp(prefix="flashgen-ab-"))
    libs = baseline_libraries(Path(args.baseline), names, tmp)
    forwards = [s for s in specs if s.kernel.yaml == "forward"]
    rows = []
    for rnd in range(args.repeats):
        for spec in specs:
            readable = "_".join(readable_parts(spec))
            if readable not in libs:
                print(f"ab_bench: no baseline kernel named {readable}_*", file=sys.stderr)
                continue
            old_name = libs[readable].stem
            Params = params_struct(family(spec))
            old = getattr(ctypes.CDLL(str(libs[readable])), f"{old_name}_launch")
            old.argtypes, old.restype = [ctypes.POINTER(Params), ctypes.c_void_p], ctypes.c_int
            bwd = spec.kernel.yaml == "backward"
            kernel = load_bwd_kernel(spec) if bwd else load_kernel(spec)
            causal = spec.mask.causal.yaml != "none"
            for n in args.seqlens:
                d = spec.head_dim
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v = (
                    torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)
                )
                o, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
                scale = 1 / math.sqrt(d)
                if bwd:  # O and LSE from a forward of the same mask, then the backward's call
                    fwd = next(f for f in forwards if f.head_dim == d and f.mask == spec.mask)
                    fk = load_kernel(fwd)
                    fk.library.launch(torch_params(fk, q, k, v, o, lse, scale), 0)
                    do = torch.randn_like(q)
                    new, *_ = flashgen_backward(kernel, q, k, v, o, lse, do, scale)
                    packed = new.params
                    anchor_args = (q, k, v, do)
                else:
                    values = torch_params(kernel, q, k, v, o, lse, scale)
                    new = kernel.library.launcher(values)
                    packed = kernel.library.pack(values)
                    anchor_args = (q, k, v, None)
                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(bwd) for t in (q, k, v))

                def flash(qt=qt, kt=kt, vt=vt, causal=causal, do=anchor_args[3]):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        if do is not None:
                            out.backward(do.transpose(1, 2))

                ms = {
                    "old": do_bench(
                        lambda old=old, packed=packed: old(ctypes.byref(packed), None),
                        warmup=25,
                        rep=100,
                    ),
                    "new": do_bench(new, warmup=25, rep=100),
                    "FLASH": do_bench(flash, warmup=25, rep=100),
                }
                fl = flops(b, h, n, d, causal) * (2.5 if bwd else 1.0)
                tf = {key: fl / (t * 1e-3) / 1e12 for key, t in ms.items()}
                if bwd:  # FLASH timed forward + backward: its backward share is not separable
                    tf["FLASH"] = 3.5 * flops(b, h, n, d, causal) / (ms["FLASH"] * 1e-3) / 1e12
                rows.append({"round": rnd, "kind": spec.kernel.yaml, "target": spec.target.yaml,
                             "d": d, "causal": causal, "seqlen": n,
                             "old": old_name, "new": kernel.name, "tflops": tf,
                             "new_over_old": tf["new"] / tf["old"]})  # fmt: skip
                print(f"round {rnd} {spec.kernel.yaml} {spec.target.yaml} d={d} "
                      f"causal={int(causal)} n={n}: old {tf['old']:.0f} new {tf['new']:.0f} "
                      f"FLASH {tf['FLASH']:.0f} TFLOP/s, new/old "
                      f"{tf['new'] / tf['old']:.3f}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(
            json.dumps({"environment": environment(), "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
