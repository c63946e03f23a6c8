"""Decode bandwidth on one GPU: flashgen's decode kernels next to a device-to-device copy of
the same K/V bytes and SDPA's backends on the same call, all measured in one run.

    python -m flashgen.bench.decode_bench [--quick] [--baseline OLD/generated] [--out FILE]
    python -m flashgen.bench.decode_bench --profile [--baseline OLD/generated]   # for ncu

Setup (issue 12): bf16, d 128, kv_heads 8, query heads 32 and 64, batch 1, 8, 64, context 4k
to 128k (combinations whose caches exceed 60% of the device's memory are skipped), one query
per sequence; caches contiguous (page_size 0) and paged with pages of 16 and 256 (block
tables in a random page order). Bandwidth = K/V bytes / time. The copy row is
`2 * bytes / time` (it reads and writes them; CUDA's bandwidthTest convention), so it is the
HBM bandwidth a plain stream achieves; on the H200 a copy's mix of reads and writes reaches
about 2.8 TB/s from 1 GB up, well below a read-only stream, so a "read" column (`bytes / time`
of torch's sum over the same bytes, read-only) stands next to it for reference. SDPA gets q
`(batch, heads, 1, d)` and the cache as a `(batch, kv_heads, context, d)` view (enable_gqa),
per backend: FLASH, EFFICIENT, CUDNN; a backend that refuses the shape is left out of the
row. Timing: CUDA graphs of 20 calls, median of 7 replays (quick: 3 and 3). Rows: {batch,
heads, kv_heads, context, page_size, kernel, num_splits, gbps: {"flashgen": x, "copy": y,
"read": r, BACKEND: z, "old": w}}.

`--baseline DIR` adds an "old" column: DIR is another version's `generated/` folder (e.g.
`git archive <commit> generated | tar -x -C <empty folder>`); its decode kernels with the same
readable names as this version's (the name without the hash) are compiled here with the
same nvcc flags and launched through their own C launchers with the same `fg_decode_params`
(the struct only grows at its end, so an older launcher reads its own prefix), on the same
tensors, in the same graphs, right after this version's.

Issue 20's form (this version): the JSON is `{"rows": [...], "environment": {...}}`; every
row has `q_len` (1 here); a paged row's gbps has `flashgen_paged` (its own kernel) next to
`flashgen` (the contiguous kernel on the same shape, same run, kept under that name in the
page-0 row too); `read` is the faster of two read-only streams over the same bytes, a Triton
kernel (`read_triton`: each program sums a strided share of the bytes in float32 and writes
one float) and torch's sum (`read_torch`). `--chunked` adds rows `{"kind":
"chunked_prefill", batch, heads, kv_heads, context (cached keys), q_len (new tokens),
page_size, "ms": {...}, "tflops": {...}}`: `flash_attn_with_kvcache` over a paged cache
(q_len new queries, causal, bottom-right) against SDPA's CUDNN, FLASH and EFFICIENT on the
same call (the cache as contiguous tensors, `causal_lower_right`), timed eagerly with CUDA
events (flashgen's chunked path syncs once per call, so it cannot be graph-captured).

`--profile` launches each of PROFILE_SHAPES once (after one warm-up call) between
cudaProfilerStart and cudaProfilerStop, new kernel then old, printing each shape before its
launch, for Nsight Compute:
`ncu --clock-control none --profile-from-start off --set full -o decode python -m
flashgen.bench.decode_bench --profile`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

D, KV_HEADS = 128, 8
HEADS = (32, 64)
BATCHES = (1, 8, 64)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
PAGES = (0, 16, 256)  # 0: contiguous
# chunked prefill (--chunked): (batch, heads, cached keys, new tokens, page size)
CHUNKED = ((1, 32, 32768, 512, 256), (4, 32, 32768, 512, 256), (1, 32, 32768, 512, 16))
# (batch, heads, context, page_size): the short batch-1 call (launch and tail bound), the
# batch-1 contexts below the copy bar, a split batch-8 call and an unsplit paged batch-64 one
PROFILE_SHAPES = (
    (1, 32, 4096, 0),
    (1, 32, 16384, 0),
    (1, 64, 65536, 16),
    (8, 32, 32768, 0),
    (64, 32, 16384, 256),
)


def _specs():
    from flashgen.generator.load import load_spec_text

    text = "kernel: decode\ndtype: bf16\nhead_dim: 128\ngqa: true\npaged: {}\n"
    return {p: load_spec_text(text.format(p), "decode_bench")[0] for p in (False, True)}


def _baseline_libraries(generated: Path, libs: dict) -> dict:
    """paged -> (name, ctypes library) of the other version's kernel with the same readable
    name as this version's, compiled into a temporary folder (or `<name>.so` found there)."""
    from flashgen.generator.compile import nvcc_flags

    out = Path(tempfile.mkdtemp(prefix="flashgen-decode-ab-"))
    found = {}
    for paged, lib in libs.items():
        readable = lib.name.rpartition("_")[0]
        cands = [
            cu for cu in generated.glob("fa_dec_*.cu") if cu.stem.rpartition("_")[0] == readable
        ]
        if not cands:
            print(f"decode_bench: no baseline kernel named {readable}_*", file=sys.stderr)
            continue
        cu = cands[0]
        so = generated / f"{cu.stem}.so"
        if not so.is_file():
            so = out / f"{cu.stem}.so"
            cmd = ["nvcc", *nvcc_flags(lib.spec.target), "-o", str(so), cu.name]
            proc = subprocess.run(cmd, cwd=generated, capture_output=True, text=True)
            if proc.returncode != 0:
                print(
                    f"decode_bench: {cu.name} does not build: {proc.stderr[-400:]}", file=sys.stderr
                )
                continue
        found[paged] = (cu.stem, ctypes.CDLL(str(so.resolve())))
    return found


class _OldKernel:
    """The other version's decode launcher: launch and workspace_bytes with this version's
    parameter struct (same layout)."""

    def __init__(self, name: str, cdll, params_type) -> None:
        self.name = name
        ptr = ctypes.POINTER(params_type)
        self._launch = getattr(cdll, f"{name}_launch")
        self._launch.argtypes, self._launch.restype = [ptr, ctypes.c_void_p], ctypes.c_int
        self._ws = getattr(cdll, f"{name}_workspace_bytes")
        self._ws.argtypes, self._ws.restype = [ptr], ctypes.c_size_t
        self._splits = getattr(cdll, f"{name}_num_splits")
        self._splits.argtypes, self._splits.restype = [ptr], ctypes.c_int64

    def workspace_bytes(self, packed) -> int:
        return int(self._ws(ctypes.byref(packed)))

    def num_splits(self, packed) -> int:
        return int(self._splits(ctypes.byref(packed)))

    def launch(self, packed, stream: int) -> None:
        err = self._launch(ctypes.byref(packed), ctypes.c_void_p(int(stream) or None))
        if err != 0:
            raise RuntimeError(f"{self.name}: launch failed ({err})")


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


def _triton_read():
    """A read-only stream over a flat bf16 tensor, in Triton (None where Triton is missing):
    `GRID` programs each sum a strided share of the elements in float32 and store one float,
    so the bytes written are negligible."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    def read(x, out):
        _read[(out.numel(),)](x, out, x.numel(), BLOCK=4096, num_warps=8)

    return read


def _time_eager(fn, calls: int, reps: int) -> float:
    """Seconds per call without a graph: `calls` calls between CUDA events, median of
    `reps`, after two warm-up calls (for calls that sync, which a graph cannot capture)."""
    import torch

    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def _chunked_rows(calls: int, reps: int) -> list[dict]:
    """CHUNKED shapes: flash_attn_with_kvcache with q_len new queries over `context` cached
    keys in a paged cache (random page order) against SDPA on the same call."""
    import torch
    from flashgen.torch import flash_attn_with_kvcache
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dev = torch.device("cuda")
    rows = []
    for batch, heads, context, q_len, page in CHUNKED:
        keys = context + q_len
        k = torch.randn(batch, keys, KV_HEADS, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, q_len, heads, D, device=dev, dtype=torch.bfloat16)
        pages_per = -(-keys // page)
        pages = batch * pages_per
        perm = torch.randperm(pages, device=dev)
        kp = torch.zeros(pages, page, KV_HEADS, D, device=dev, dtype=torch.bfloat16)
        vp = torch.zeros_like(kp)
        pad = pages_per * page - keys
        kf = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(pages, page, KV_HEADS, D)
        vf = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(pages, page, KV_HEADS, D)
        kp[perm], vp[perm] = kf, vf
        table = perm.view(batch, pages_per).to(torch.int32).contiguous()
        lens = torch.full((batch,), keys, device=dev, dtype=torch.int32)
        flops = 4 * batch * heads * D * (q_len * context + q_len * (q_len + 1) / 2)
        ms = {}

        def fg(q=q, kp=kp, vp=vp, lens=lens, table=table):
            return flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                           causal=True)  # fmt: skip

        want = None
        ms["flashgen_paged"] = _time_eager(fg, calls, reps) * 1e3
        got = fg()
        qt = q.transpose(1, 2)  # SDPA gets the KV heads repeated (CausalBias takes no GQA)
        kt = k.transpose(1, 2).repeat_interleave(heads // KV_HEADS, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(heads // KV_HEADS, dim=1)
        bias = causal_lower_right(q_len, keys)
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):

                    def run(qt=qt, kt=kt, vt=vt, bias=bias):
                        return sdpa(qt, kt, vt, attn_mask=bias)

                    ms[backend.split("_")[0]] = _time_eager(run, calls, reps) * 1e3
                    if want is None:
                        want = run().transpose(1, 2)
            except (RuntimeError, TypeError, torch.cuda.OutOfMemoryError) as e:
                print(f"chunked: SDPA {backend} refused: {str(e)[:120]}", flush=True)
        err = None if want is None else (got.float() - want.float()).abs().max().item()
        row = {
            "kind": "chunked_prefill",
            "batch": batch,
            "heads": heads,
            "kv_heads": KV_HEADS,
            "context": context,
            "q_len": q_len,
            "page_size": page,
            "ms": ms,
            "tflops": {key: flops / (t / 1e3) / 1e12 for key, t in ms.items()},
            "max_abs_diff_vs_sdpa": err,
        }
        rows.append(row)
        print(
            f"chunked b={batch} h={heads} ctx={context} q_len={q_len} page={page}: "
            + ", ".join(f"{key} {t:.3f} ms" for key, t in ms.items())
            + f" (max |diff| vs SDPA {err})",
            flush=True,
        )
        del k, v, kp, vp, kf, vf, kt, vt
        torch.cuda.empty_cache()
    return rows


def _cache(k, v, batch: int, context: int, page: int):
    """(values, k, v, keep-alive tensors) of the cache: contiguous, or paged in a random page
    order."""
    import torch

    values = {}
    keep = []
    if page == 0:
        kk, vv = k, v
        values.update(seqlen_k=context)
        strides = (context * KV_HEADS * D, KV_HEADS * D, D)
    else:
        pages = batch * context // page
        perm = torch.randperm(pages, device=k.device)
        kk = torch.empty(pages, page, KV_HEADS, D, device=k.device, dtype=k.dtype)
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
        names = (f"{nm}_batch_stride", f"{nm}_row_stride", f"{nm}_head_stride")
        values.update(dict(zip(names, strides)))
    return values, kk, vv, keep


def _call_values(q, o, lens, batch: int, heads: int) -> dict:
    return dict(
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
        head_dim=D,
        head_dim_v=D,
        softmax_scale=D**-0.5,
    )


def _launchers(lib, old, values: dict, dev):
    """(new launch, old launch or None, num_splits, keep-alive): each version with its own
    zeroed workspace, launching on the stream current at call time (`_time` captures a CUDA
    graph on its own stream; a launcher bound to another stream would record nothing)."""
    import torch

    ws = torch.zeros(lib.workspace_bytes(values), device=dev, dtype=torch.uint8)
    new_values = {**values, "workspace": ws.data_ptr(), "workspace_size": ws.numel()}

    def new(lib=lib, values=new_values):
        lib.launch(values, torch.cuda.current_stream().cuda_stream)

    keep = [ws]
    old_launch = None
    if old is not None:
        packed = lib.pack(values)
        ws_old = torch.zeros(max(old.workspace_bytes(packed), 256), device=dev, dtype=torch.uint8)
        packed = lib.pack(
            {**values, "workspace": ws_old.data_ptr(), "workspace_size": ws_old.numel()}
        )
        keep += [ws_old, packed]

        def old_launch(old=old, packed=packed):
            old.launch(packed, torch.cuda.current_stream().cuda_stream)

    return new, old_launch, lib.num_splits(values), keep


def _profile(libs, olds) -> int:
    """PROFILE_SHAPES once each between cudaProfilerStart/Stop (after a warm-up call)."""
    import torch

    dev = torch.device("cuda")
    for batch, heads, context, page in PROFILE_SHAPES:
        k = torch.randn(batch, context, KV_HEADS, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, 1, heads, D, device=dev, dtype=torch.bfloat16)
        o = torch.empty_like(q)
        lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        cache, kk, vv, keep = _cache(k, v, batch, context, page)
        lib = libs[page > 0]
        values = {**_call_values(q, o, lens, batch, heads), **cache}
        new, old, splits, keep2 = _launchers(lib, olds.get(page > 0), values, dev)
        for label, fn in (("new", new), ("old", old)):
            if fn is None:
                continue
            name = lib.name if label == "new" else olds[page > 0].name
            print(
                f"profile: {label} {name} batch={batch} heads={heads} kv_heads={KV_HEADS} "
                f"context={context} page_size={page} splits={splits if label == 'new' else '-'} "
                f"kv_bytes={2 * batch * context * KV_HEADS * D * 2}",
                flush=True,
            )
            fn()  # warm-up, outside the profiled range
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        del k, v, kk, vv, keep, keep2
        torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    import torch
    from flashgen.verify.runner_decode import DecodeLibrary
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset, < 3 minutes")
    ap.add_argument("--baseline", default=None, help="another version's generated/ folder")
    ap.add_argument(
        "--profile", action="store_true", help="PROFILE_SHAPES once each, for Nsight Compute"
    )
    ap.add_argument(
        "--chunked", action="store_true", help="also chunked prefill over a paged cache"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_h200.json"))
    args = ap.parse_args(argv)
    calls, reps = (3, 3) if args.quick else (20, 7)
    heads_set = (32,) if args.quick else HEADS
    contexts = (4096, 16384, 131072) if args.quick else CONTEXTS
    dev = torch.device("cuda")
    free = torch.cuda.get_device_properties(0).total_memory
    libs = {p: DecodeLibrary(s) for p, s in _specs().items()}
    olds = {}
    if args.baseline:
        params_type = libs[False].Params
        olds = {
            p: _OldKernel(nm, cdll, params_type)
            for p, (nm, cdll) in _baseline_libraries(Path(args.baseline), libs).items()
        }
    if args.profile:
        return _profile(libs, olds)
    rows, t0 = [], time.time()
    triton_read = _triton_read()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
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
            read = _time(lambda src=src: src.sum(dtype=torch.float32), calls, reps)
            read_triton = None
            if triton_read is not None:
                partial = torch.empty(8 * sms, device=dev, dtype=torch.float32)
                triton_read(src, partial)
                torch.cuda.synchronize()
                want = src.sum(dtype=torch.float32).item()
                got = partial.sum().item()
                if abs(got - want) > 1e-3 * max(1.0, abs(want)) + 1e-2 * math.sqrt(src.numel()):
                    raise RuntimeError(f"the Triton read sums {got}, torch {want}")
                read_triton = _time(
                    lambda src=src, partial=partial: triton_read(src, partial), calls, reps
                )
            reads = {"read_torch": kv_bytes / read / 1e9}
            if read_triton is not None:
                reads["read_triton"] = kv_bytes / read_triton / 1e9
            reads["read"] = max(reads.values())
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
                contiguous_gbps = None
                for page in PAGES:
                    lib = libs[page > 0]
                    cache, kk, vv, keep = _cache(k, v, batch, context, page)
                    values = {**_call_values(q, o, lens, batch, heads), **cache}
                    new, old, splits, keep2 = _launchers(lib, olds.get(page > 0), values, dev)
                    t = _time(new, calls, reps)
                    extra = {}
                    if old is not None:
                        extra["old"] = kv_bytes / _time(old, calls, reps) / 1e9
                    mine = kv_bytes / t / 1e9
                    if page == 0:
                        contiguous_gbps = mine
                        flashgen = {"flashgen": mine}
                    else:  # the contiguous kernel of this shape (page 0 runs first)
                        flashgen = {"flashgen": contiguous_gbps, "flashgen_paged": mine}
                    row = {
                        "batch": batch,
                        "heads": heads,
                        "kv_heads": KV_HEADS,
                        "context": context,
                        "page_size": page,
                        "q_len": 1,
                        "kernel": lib.name,
                        "num_splits": splits,
                        "gbps": {
                            **flashgen,
                            "copy": 2 * kv_bytes / copy / 1e9,
                            **reads,
                            **sdpa_gbps,
                            **extra,
                        },
                    }
                    if old is not None:
                        row["old_kernel"] = olds[page > 0].name
                    rows.append(row)
                    g = row["gbps"]
                    best = max(sdpa_gbps.values(), default=float("nan"))
                    print(
                        f"b={batch:3d} h={heads} ctx={context:6d} page={page:3d} "
                        f"splits={splits:3d} flashgen {mine:7.0f} GB/s "
                        f"({mine / g['read']:.0%} of read {g['read']:.0f}, "
                        f"{mine / best:.2f}x best SDPA"
                        + (f", {mine / g['old']:.2f}x old" if "old" in g else "")
                        + "); "
                        + ", ".join(f"{b_} {x:.0f}" for b_, x in sdpa_gbps.items()),
                        flush=True,
                    )
                    del kk, vv, keep, keep2
            del k, v, dst
            torch.cuda.empty_cache()
    if args.chunked:
        rows += _chunked_rows(5 if args.quick else 10, reps)
    from flashgen.bench.fwd_bench import environment

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"rows": rows, "environment": environment()}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
