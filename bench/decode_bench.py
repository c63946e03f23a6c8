"""Decode bandwidth on one GPU: flashgen's decode kernels next to a device-to-device copy of
the same K/V bytes and SDPA's backends on the same call, all measured in one run.

    python -m flashgen.bench.decode_bench [--quick] [--out bench/results/decode_h200.json]

Setup (issue 12): bf16, d 128, kv_heads 8, query heads 32 and 64, batch 1, 8, 64, context 4k
to 128k (combinations whose caches exceed 60% of the device's memory are skipped), one query
per sequence; caches contiguous (page_size 0) and paged with pages of 16 and 256 (block
tables in a random page order). Bandwidth = K/V bytes / time. The copy row is
`2 * bytes / time` (it reads and writes them; CUDA's bandwidthTest convention), so it is the
HBM bandwidth a plain stream achieves. SDPA gets q `(batch, heads, 1, d)` and the cache as a
`(batch, kv_heads, context, d)` view (enable_gqa), per backend: FLASH, EFFICIENT, CUDNN; a
backend that refuses the shape is left out of the row. Timing: CUDA graphs of 20 calls,
median of 7 replays (quick: 3 and 3). Rows: {batch, heads, kv_heads, context, page_size,
kernel, gbps: {"flashgen": x, "copy": y, BACKEND: z}}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

D, KV_HEADS = 128, 8
HEADS = (32, 64)
BATCHES = (1, 8, 64)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
PAGES = (0, 16, 256)  # 0: contiguous


def _specs():
    from flashgen.generator.load import load_spec_text

    text = "kernel: decode\ndtype: bf16\nhead_dim: 128\ngqa: true\npaged: {}\n"
    return {p: load_spec_text(text.format(p), "decode_bench")[0] for p in (False, True)}


def _time(fn, calls: int, reps: int) -> float:
    """Seconds per call: a CUDA graph of `calls` launches, median of `reps` replays."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm up (and lazy initialisation) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    import torch
    from flashgen.verify.runner_decode import DecodeLibrary
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset, < 3 minutes")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_h200.json"))
    args = ap.parse_args(argv)
    calls, reps = (3, 3) if args.quick else (20, 7)
    heads_set = (32,) if args.quick else HEADS
    contexts = (4096, 16384, 131072) if args.quick else CONTEXTS
    dev = torch.device("cuda")
    free = torch.cuda.get_device_properties(0).total_memory
    libs = {p: DecodeLibrary(s) for p, s in _specs().items()}
    name = {p: lib.name for p, lib in libs.items()}
    rows, t0 = [], time.time()
    for batch in BATCHES:
        for context in contexts:
            kv_bytes = 2 * batch * context * KV_HEADS * D * 2
            if 2.2 * kv_bytes > 0.6 * free:  # caches, paged copy, copy target
                continue
            k = torch.randn(batch, context, KV_HEADS, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            dst = torch.empty(2 * k.numel(), device=dev, dtype=torch.bfloat16)
            src = torch.cat([k.view(-1), v.view(-1)])
            copy = _time(lambda dst=dst, src=src: dst.copy_(src), calls, reps)
            del src
            lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
            for heads in heads_set:
                q = torch.randn(batch, 1, heads, D, device=dev, dtype=torch.bfloat16)
                o = torch.empty_like(q)
                sdpa_gbps = {}
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
                    try:
                        with sdpa_kernel(getattr(SDPBackend, backend)):
                            t = _time(
                                lambda qt=qt, kt=kt, vt=vt: sdpa(qt, kt, vt, enable_gqa=True),
                                calls,
                                reps,
                            )
                        sdpa_gbps[backend.split("_")[0]] = kv_bytes / t / 1e9
                    except (RuntimeError, torch.cuda.OutOfMemoryError):
                        pass
                for page in PAGES:
                    lib = libs[page > 0]
                    values = dict(
                        q=q.data_ptr(),
                        o=o.data_ptr(),
                        cache_seqlens=lens.data_ptr(),
                        q_batch_stride=heads * D,
                        q_row_stride=heads * D,
                        q_head_stride=D,
                        o_batch_stride=heads * D,
                        o_row_stride=heads * D,
                        o_head_stride=D,
                        batch=batch,
                        heads=heads,
                        kv_heads=KV_HEADS,
                        seqlen_q=1,
                        softmax_scale=D**-0.5,
                    )
                    keep = []
                    if page == 0:
                        kk, vv = k, v
                        values.update(seqlen_k=context)
                        strides = (context * KV_HEADS * D, KV_HEADS * D, D)
                    else:
                        pages = batch * context // page
                        perm = torch.randperm(pages, device=dev)
                        kk = torch.empty(pages, page, KV_HEADS, D, device=dev, dtype=k.dtype)
                        vv = torch.empty_like(kk)
                        kk[perm] = k.view(pages, page, KV_HEADS, D)
                        vv[perm] = v.view(pages, page, KV_HEADS, D)
                        table = perm.view(batch, context // page).to(torch.int32).contiguous()
                        keep.append(table)
                        values.update(
                            block_table=table.data_ptr(),
                            page_size=page,
                            num_pages=pages,
                            max_pages=context // page,
                            block_table_stride=context // page,
                        )
                        strides = (page * KV_HEADS * D, KV_HEADS * D, D)
                    for nm, t in (("k", kk), ("v", vv)):
                        values[nm] = t.data_ptr()
                        values.update(
                            dict(
                                zip(
                                    (f"{nm}_batch_stride", f"{nm}_row_stride", f"{nm}_head_stride"),
                                    strides,
                                )
                            )
                        )
                    ws = torch.zeros(lib.workspace_bytes(values), device=dev, dtype=torch.uint8)
                    values.update(workspace=ws.data_ptr(), workspace_size=ws.numel())

                    # Launched on the stream current at call time: `_time` captures a CUDA
                    # graph on its own stream (a launcher bound to another stream would
                    # record nothing and time an empty graph).
                    def launch(lib=lib, values=values):
                        lib.launch(values, torch.cuda.current_stream().cuda_stream)

                    t = _time(launch, calls, reps)
                    row = {
                        "batch": batch,
                        "heads": heads,
                        "kv_heads": KV_HEADS,
                        "context": context,
                        "page_size": page,
                        "kernel": name[page > 0],
                        "num_splits": lib.num_splits(values),
                        "gbps": {
                            "flashgen": kv_bytes / t / 1e9,
                            "copy": 2 * kv_bytes / copy / 1e9,
                            **sdpa_gbps,
                        },
                    }
                    rows.append(row)
                    g = row["gbps"]
                    print(
                        f"b={batch:3d} h={heads} ctx={context:6d} page={page:3d} "
                        f"splits={row['num_splits']:3d} flashgen {g['flashgen']:7.0f} GB/s "
                        f"({g['flashgen'] / g['copy']:.0%} of copy {g['copy']:.0f}); "
                        + ", ".join(f"{b_} {x:.0f}" for b_, x in sdpa_gbps.items()),
                        flush=True,
                    )
                    if page > 0:
                        del kk, vv
            del k, v, dst
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
