"""Host (CPU) enqueue time per call of flashgen.torch against SDPA's FLASH and CUDNN backends:
what a training or serving loop pays in Python and dispatch before any kernel runs.

    python -m flashgen.bench.torch_overhead [--iters 200 --repeats 7 --out result.json]

Rows (issue 22's table): for each shape (batch, seqlen, heads, head_dim), bf16, causal, and
each case:

- `no_grad`: a forward under torch.no_grad();
- `fwd_grad`: a forward of inputs that require grad (the autograd graph is built);
- `fwd_bwd`: forward + `out.backward(g)`;
- `varlen`: `flash_attn_varlen_func` under no_grad over the same tokens packed as `batch`
  equal sequences (SDPA has no varlen: its columns are the dense no_grad call);
- `kvcache`: `flash_attn_with_kvcache` with one new query per sequence over a cache of
  `seqlen` keys (SDPA: a one-query attention over the same cache, `is_causal=False`);
- `merge_states` (optional, not in the default rows: `--cases merge_states`): `merge_states`
  of two bf16 parts of the shape with their float32 LSEs. SDPA has no merge: its SDPA columns
  are null (`meets_bar` too) and `torch_merge_us` times the same merge in torch operations
  (`flashgen.torch.distributed.merge_partials`).

Each cell is the median over `repeats` rounds of the mean host time of `iters` back-to-back
calls (time.perf_counter around the loop, the calls return before their kernels finish; a
torch.cuda.synchronize ends each loop, outside the timing), after a warm-up and one unrecorded
round. flashgen and the SDPA backends of a row are timed side by side: each round times every
one of them in turn (the order rotated from round to round), so a drift of the host's speed
(one H100 host's SDPA FLASH call moved 30-62 us between two runs of one device call, the
eighteenth session) lands on all of them alike, and the row's `ratio_flash` / `ratio_cudnn`
are medians of same-round ratios. The bar is `ratio_flash <= 1`. Rows stay below the CUDA
launch queue's depth, so the host never waits for the GPU.

flashgen's ops are defined once per process (the compiled binding or the ctypes path,
`FLASHGEN_TORCH_BINDING`), so the script runs itself twice, once per path, each child
timing SDPA in its own process beside flashgen; the rows carry both paths
(`flashgen_us`: the binding, `flashgen_ctypes_us`: the ctypes path) and the SDPA columns of
the binding's child. The JSON holds an environment block and the bar (`flashgen_us <=
sdpa_flash_us`, issue 22) per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = ((1, 128, 16, 64), (4, 512, 16, 128), (16, 1024, 12, 64), (2, 4096, 16, 128))
CASES = ("no_grad", "fwd_grad", "fwd_bwd", "varlen", "kvcache")
OPTIONAL_CASES = ("merge_states",)  # rows only when asked for (the default table keeps its rows)


def median_us(fn, iters: int, warmup: int, repeats: int, sync=None) -> float:
    """Median over `repeats` of the mean host microseconds per call of `iters` calls, after
    `warmup` calls; `sync` (default torch.cuda.synchronize) ends the warm-up and each
    repeat, outside the timed loop."""
    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
        sync()
    return statistics.median(samples)


def paired_us(fns: dict, iters: int, warmup: int, repeats: int, sync=None, contexts=None,
              clock=time.perf_counter) -> dict[str, list[float]]:  # fmt: skip
    """Host microseconds per call of several callables measured side by side: after `warmup`
    calls of each and one unrecorded round, `repeats` rounds, each timing `iters` back-to-back
    calls of every callable in turn, the order rotated by one from round to round. Returns the
    per-round samples by name (round i of every callable in element i). `contexts[name]`: a
    factory of the context manager entered around each of that callable's loops, outside the
    timing (a generator-based manager is good for one `with` only); `sync` (default
    torch.cuda.synchronize) ends the warm-up and every loop, outside the timing."""
    import contextlib

    if sync is None:
        import torch

        sync = torch.cuda.synchronize
    names = list(fns)
    contexts = contexts or {}
    samples: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        with contexts.get(n, contextlib.nullcontext)():
            for _ in range(warmup):
                fns[n]()
            sync()
    for rnd in range(repeats + 1):
        k = rnd % len(names)
        for n in names[k:] + names[:k]:
            with contexts.get(n, contextlib.nullcontext)():
                start = clock()
                for _ in range(iters):
                    fns[n]()
                elapsed = clock() - start
                sync()
            if rnd > 0:  # round 0 is the unrecorded one
                samples[n].append(elapsed / iters * 1e6)
    return samples


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a's time over b's in the same round."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def meets_bar(case: str, path: str, ratio_flash: float | None) -> bool | None:
    """Issue 22's bar for one row: the binding's call at most SDPA FLASH's host time, by the
    median same-round ratio; None for cases without an SDPA counterpart."""
    if case in OPTIONAL_CASES:
        return None
    return ratio_flash is not None and path == "binding" and ratio_flash <= 1.0


def _child(args) -> list[dict]:
    from flashgen.torch import ops

    binding = ops.BINDING is not None
    rows = []
    for shape in args.shapes:
        for row in _shape_rows(args, tuple(shape)):
            row["path"] = "binding" if binding else "ctypes"
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def _shape_rows(args, shape: tuple[int, int, int, int]) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from flashgen.torch import (
        flash_attn_func,
        flash_attn_varlen_func,
        flash_attn_with_kvcache,
        merge_states,
    )
    from flashgen.torch.distributed import merge_partials
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, seqlen, heads, d = shape
    q, k, v, g = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
    pq, pk, pv = (t.reshape(batch * seqlen, heads, d) for t in (q, k, v))
    q1 = q[:, :1].contiguous()
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    parts = torch.stack([q, k])  # (2, batch, seqlen, heads, d)
    lse_parts = torch.randn(2, batch, heads, seqlen, device="cuda")

    def fg_dense(a, b, c):
        return flash_attn_func(a, b, c, causal=True)

    def sdpa_dense(a, b, c, causal=True):
        a, b, c = (t.transpose(1, 2) for t in (a, b, c))
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal).transpose(1, 2)

    def no_grad(f):
        def run():
            with torch.no_grad():
                f()

        return run

    ours = {
        "no_grad": no_grad(lambda: fg_dense(q, k, v)),
        "fwd_grad": lambda: fg_dense(qg, kg, vg),
        "fwd_bwd": lambda: fg_dense(qg, kg, vg).backward(g),
        "varlen": no_grad(
            lambda: flash_attn_varlen_func(pq, pk, pv, cu, cu, seqlen, seqlen, causal=True)
        ),
        "kvcache": no_grad(lambda: flash_attn_with_kvcache(q1, k, v, cache_seqlens=lens)),
        "merge_states": lambda: merge_states(parts, lse_parts),
    }
    torch_only = {"merge_states": lambda: merge_partials(parts, lse_parts)}
    sdpa = {
        "no_grad": no_grad(lambda: sdpa_dense(q, k, v)),
        "fwd_grad": lambda: sdpa_dense(qg, kg, vg),
        "fwd_bwd": lambda: sdpa_dense(qg, kg, vg).backward(g),
        "varlen": no_grad(lambda: sdpa_dense(q, k, v)),
        "kvcache": no_grad(lambda: sdpa_dense(q1, k, v, causal=False)),
    }
    rows = []
    for case in args.cases:
        row = {"case": case, "shape": list(shape)}
        fns, contexts = {"flashgen": ours[case]}, {}
        if case in torch_only:  # no SDPA counterpart: the same work in torch operations
            row["sdpa_flash_us"] = row["sdpa_cudnn_us"] = None
            fns["torch_merge"] = torch_only[case]
        else:
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip
                try:
                    with sdpa_kernel(backend):
                        sdpa[case]()
                except RuntimeError as e:  # the backend refuses the shape
                    row[f"sdpa_{name}_us"] = None
                    row[f"sdpa_{name}_error"] = str(e).splitlines()[0]
                    continue
                fns[name] = sdpa[case]
                contexts[name] = lambda backend=backend: sdpa_kernel(backend)
        samples = paired_us(fns, args.iters, args.warmup, args.repeats, contexts=contexts)
        row["flashgen_us"] = statistics.median(samples["flashgen"])
        for name in ("flash", "cudnn", "torch_merge"):
            if name in samples:
                key = "torch_merge_us" if name == "torch_merge" else f"sdpa_{name}_us"
                row[key] = statistics.median(samples[name])
                if name != "torch_merge":
                    row[f"ratio_{name}"] = paired_ratio(samples, "flashgen", name)
        rows.append(row)
    return rows


def _run_child(argv: list[str], binding: bool) -> list[dict]:
    env = dict(os.environ, FLASHGEN_TORCH_BINDING="1" if binding else "0")
    cmd = [sys.executable, "-m", "flashgen.bench.torch_overhead", "--child", *argv]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"the {'binding' if binding else 'ctypes'} child failed")
    return json.loads(res.stdout)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", nargs="+", choices=CASES + OPTIONAL_CASES, default=list(CASES))
    ap.add_argument("--shape", dest="shapes", action="append", type=lambda s: tuple(
        int(x) for x in s.split(",")), help="batch,seqlen,heads,head_dim (repeatable)")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.shapes = args.shapes or list(SHAPES)
    if args.child:
        print(json.dumps(_child(args)))
        return {}

    from flashgen.bench.fwd_bench import environment

    passthrough = [f"--iters={args.iters}", f"--warmup={args.warmup}",
                   f"--repeats={args.repeats}", "--cases", *args.cases]  # fmt: skip
    for s in args.shapes:
        passthrough.append("--shape=" + ",".join(map(str, s)))
    fast = _run_child(passthrough, binding=True)
    slow = _run_child(passthrough, binding=False)
    rows = []
    for a, b in zip(fast, slow):
        assert (a["case"], a["shape"]) == (b["case"], b["shape"])
        row = dict(a, flashgen_ctypes_us=b["flashgen_us"])
        row.pop("path")
        if a["path"] != "binding":
            row["binding_error"] = "the binding child fell back to the ctypes path"
        row["meets_bar"] = meets_bar(a["case"], a["path"], row.get("ratio_flash"))
        rows.append(row)
    print(f"{'case':9s} {'shape':18s} {'binding':>8s} {'ctypes':>8s} {'FLASH':>8s} {'CUDNN':>8s}"
          f" {'/FLASH':>7s}")  # fmt: skip
    for r in rows:
        cells = [r["flashgen_us"], r["flashgen_ctypes_us"], r.get("sdpa_flash_us"),
                 r.get("sdpa_cudnn_us")]  # fmt: skip
        text = " ".join(f"{c:8.1f}" if c is not None else f"{'-':>8s}" for c in cells)
        ratio = r.get("ratio_flash")
        text += f" {ratio:7.3f}" if ratio is not None else f" {'-':>7s}"
        print(f"{r['case']:9s} {str(tuple(r['shape'])):18s} {text}")
    report = {
        "environment": environment(),
        "method": "host us per call: median of repeats of the mean over iters calls, bf16, "
        "causal; flashgen and SDPA timed in turn within each round, ratio_* = median of "
        "same-round ratios",
        "iters": args.iters,
        "repeats": args.repeats,
        "bar": "ratio_flash <= 1 on every row (issue 22)",
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    return report


if __name__ == "__main__":
    main()
