"""FP8-cache decode against the bf16 cache and SDPA's cuDNN on one GPU, in one run (issue 23).

    python -m flashgen.bench.fp8_decode_bench [--quick] [--dims 128,64] [--sweep-splits 1,2,4]
                                              [--out FILE]

Setup: one query per sequence, 32 query heads over 8 KV heads, head dims 128 and 64, batch 8,
16, 32 and 64, context 16k, 32k and 64k (combinations whose bf16 caches exceed 40% of the
device's memory are skipped), contiguous caches and paged ones (pages of 256 in a random
order). Per shape, on the same q and the same cache values:

- `flashgen_fp8`: the `kv_dtype: e4m3` decode kernel (specs/decode_fp8.yaml) over the cache
  quantised to float8_e4m3fn with per-(batch, KV head) descales;
- `flashgen_bf16`: the bf16-cache decode kernel of the same shape (specs/decode.yaml);
- `CUDNN`: SDPA's cuDNN backend on the bf16 cache (q `(batch, heads, 1, d)`, the cache as
  `(batch, kv_heads, context, d)` views, enable_gqa); left out where it refuses the shape.

Timing as bench/decode_bench.py: CUDA graphs of 20 calls, median of 7 replays (quick: 3, 3).
Rows (`bench/results/fp8_h200.json`): `{"kind": "decode", "d", "context", "batch", "heads",
"kv_heads", "page_size", "kernels": {...}, "num_splits": {...}, "tokens_per_s": {...},
"gbps": {...}, "ms": {...}}`, each keyed by `flashgen_fp8`, `flashgen_bf16`, `CUDNN`; with
`--sweep-splits`, also `"split_ms": {kernel key: {split count: ms}}`, each flashgen kernel timed
at each forced split count (how the split heuristic was chosen).
tokens/s = batch / time (one new token per sequence per call); gbps = the bytes of the
cache that implementation reads (1 byte per element for FP8, 2 for bf16) / time, so the
ratio of tokens/s is the speed-up the issue asks for (>= 1.8x) and gbps says how close each
is to the HBM stream. The document also holds `env` (GPU, torch, CUDA, cuDNN, driver, date).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HEADS, KV_HEADS = 32, 8
DIMS = (128, 64)
BATCHES = (8, 16, 32, 64)
CONTEXTS = (16384, 32768, 65536)
PAGES = (0, 256)


def _specs(d: int) -> dict:
    """(kv_dtype, paged) -> the decode spec the bench launches, as flashgen.torch selects it."""
    from flashgen.generator.load import load_spec_text

    text = "kernel: decode\ndtype: bf16\nhead_dim: {d}\ngqa: true\npaged: {p}\n{kv}"
    out = {}
    for kv in ("bf16", "e4m3"):
        for paged in (False, True):
            extra = "kv_dtype: e4m3\n" if kv == "e4m3" else ""
            out[kv, paged] = load_spec_text(
                text.format(d=d, p=str(paged).lower(), kv=extra), "fp8_decode_bench"
            )[0]
    return out


def _cache_values(k, v, batch: int, context: int, page: int, perm) -> tuple[dict, list]:
    """Launch fields of one cache (contiguous, or paged in the page order `perm`) and the
    tensors to keep alive."""
    import torch

    d = k.shape[-1]
    if k.dtype == torch.float8_e4m3fn:  # pages are moved as bytes (no float8 index_put)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    if page == 0:
        values = {"seqlen_k": context}
        kk, vv = k, v
        strides = (context * KV_HEADS * d, KV_HEADS * d, d)
        keep = []
    else:
        pages = batch * context // page
        kk = torch.empty(pages, page, KV_HEADS, d, device=k.device, dtype=k.dtype)
        vv = torch.empty_like(kk)
        kk[perm] = k.view(pages, page, KV_HEADS, d)
        vv[perm] = v.view(pages, page, KV_HEADS, d)
        table = perm.view(batch, context // page).to(torch.int32).contiguous()
        values = dict(
            block_table=table.data_ptr(), page_size=page, num_pages=pages,
            max_pages=context // page, block_table_stride=context // page,
        )  # fmt: skip
        strides = (page * KV_HEADS * d, KV_HEADS * d, d)
        keep = [table]
    for nm, t in (("k", kk), ("v", vv)):
        values[nm] = t.data_ptr()
        values.update(
            dict(zip((f"{nm}_batch_stride", f"{nm}_row_stride", f"{nm}_head_stride"), strides))
        )
    return values, keep + [kk, vv]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before torch is imported (bad values exit with status 2)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8 and 64, context 16k, d 128")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fp8_h200.json"))
    ap.add_argument(
        "--sweep-splits",
        default="",
        help="comma-separated split counts: also time each kernel at each (row key split_ms)",
    )
    ap.add_argument("--dims", default="", help="comma-separated head dims (default 128,64)")
    args = ap.parse_args(argv)
    try:
        sweep = [int(x) for x in args.sweep_splits.split(",") if x.strip()]
        dims_arg = tuple(int(x) for x in args.dims.split(",") if x.strip())
    except ValueError as e:
        ap.error(f"--sweep-splits and --dims take comma-separated integers ({e})")
    for opt, given, got in (
        ("--sweep-splits", args.sweep_splits, sweep),
        ("--dims", args.dims, dims_arg),
    ):
        if given and not got:
            ap.error(f"{opt} was given no values ({given!r})")
        if len(set(got)) != len(got):
            ap.error(f"{opt} repeats a value ({given!r})")
    if any(x < 1 or x > 128 for x in sweep):
        ap.error(f"--sweep-splits takes split counts 1..128, got {args.sweep_splits!r}")
    if any(d not in DIMS for d in dims_arg):
        ap.error(f"--dims takes head dims from {', '.join(map(str, DIMS))}, got {args.dims!r}")
    args.sweep, args.dim_list = sweep, dims_arg
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sweep = args.sweep
    import torch
    from flashgen.bench.decode_bench import _time
    from flashgen.bench.fwd_bench import environment
    from flashgen.torch.kvcache import _library
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    calls, reps = (3, 3) if args.quick else (20, 7)
    dims = (128,) if args.quick else DIMS
    if args.dim_list:
        dims = args.dim_list
    batches = (8, 64) if args.quick else BATCHES
    contexts = (16384,) if args.quick else CONTEXTS
    dev = torch.device("cuda")
    free = torch.cuda.get_device_properties(0).total_memory
    rows, t0 = [], time.time()

    def workspace(lib, values):
        ws = torch.zeros(max(lib.workspace_bytes(values), 256), device=dev, dtype=torch.uint8)
        values.update(workspace=ws.data_ptr(), workspace_size=ws.numel())
        return ws

    for d in dims:
        # found in $FLASHGEN_BUILD_DIR, or compiled into the kernel cache on first use
        libs = {key: _library(spec) for key, spec in _specs(d).items()}
        for batch in batches:
            for context in contexts:
                bf16_bytes = 2 * batch * context * KV_HEADS * d * 2
                if 2.0 * bf16_bytes > 0.4 * free:  # bf16 cache, its paged copy, the FP8 ones
                    continue
                k = torch.randn(batch, context, KV_HEADS, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                # per-(batch, KV head) descales: each slice's amax maps to 448
                kd = (k.float().abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
                vd = (v.float().abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
                k8 = (k.float() / kd[:, None, :, None]).to(torch.float8_e4m3fn)
                v8 = (v.float() / vd[:, None, :, None]).to(torch.float8_e4m3fn)
                lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
                q = torch.randn(batch, 1, HEADS, d, device=dev, dtype=torch.bfloat16)
                o = torch.empty_like(q)
                cudnn = None
                qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        cudnn = _time(
                            lambda qt=qt, kt=kt, vt=vt: sdpa(qt, kt, vt, enable_gqa=True),
                            calls, reps,
                        )  # fmt: skip
                except (RuntimeError, torch.cuda.OutOfMemoryError):
                    pass
                for page in PAGES:
                    perm = torch.randperm(batch * context // page, device=dev) if page else None
                    t, names, splits, split_ms = {}, {}, {}, {}
                    for kv, (kk, vv) in (("bf16", (k, v)), ("e4m3", (k8, v8))):
                        lib = libs[kv, page > 0]
                        cache, keep = _cache_values(kk, vv, batch, context, page, perm)
                        values = dict(
                            q=q.data_ptr(), o=o.data_ptr(), cache_seqlens=lens.data_ptr(),
                            q_batch_stride=HEADS * d, q_row_stride=HEADS * d, q_head_stride=d,
                            o_batch_stride=HEADS * d, o_row_stride=HEADS * d, o_head_stride=d,
                            batch=batch, heads=HEADS, kv_heads=KV_HEADS, seqlen_q=1,
                            head_dim=d, head_dim_v=d, softmax_scale=d**-0.5, **cache,
                        )  # fmt: skip
                        if kv == "e4m3":
                            values.update(
                                k_descale=kd.data_ptr(), v_descale=vd.data_ptr(),
                                k_descale_batch_stride=KV_HEADS, k_descale_head_stride=1,
                                v_descale_batch_stride=KV_HEADS, v_descale_head_stride=1,
                            )  # fmt: skip
                        ws = workspace(lib, values)

                        def launch(lib=lib, values=values):
                            lib.launch(values, torch.cuda.current_stream().cuda_stream)

                        key = "flashgen_fp8" if kv == "e4m3" else "flashgen_bf16"
                        t[key] = _time(launch, calls, reps)
                        names[key] = lib.name
                        splits[key] = lib.num_splits(values)
                        for s in sweep:
                            forced = dict(values, num_splits=s)
                            ws_s = workspace(lib, forced)
                            ms = _time(lambda lib=lib, f=forced: launch(lib, f), calls, reps)
                            split_ms.setdefault(key, {})[str(s)] = ms * 1e3
                            del ws_s
                        del keep, ws
                    if cudnn is not None:
                        t["CUDNN"] = cudnn
                    read = {"flashgen_fp8": bf16_bytes // 2, "flashgen_bf16": bf16_bytes,
                            "CUDNN": bf16_bytes}  # fmt: skip
                    row = {
                        "kind": "decode",
                        "d": d,
                        "context": context,
                        "batch": batch,
                        "heads": HEADS,
                        "kv_heads": KV_HEADS,
                        "page_size": page,
                        "kernels": names,
                        "num_splits": splits,
                        "tokens_per_s": {nm: batch / x for nm, x in t.items()},
                        "gbps": {nm: read[nm] / x / 1e9 for nm, x in t.items()},
                        "ms": {nm: x * 1e3 for nm, x in t.items()},
                    }
                    if split_ms:
                        row["split_ms"] = split_ms
                    rows.append(row)
                    tp = row["tokens_per_s"]
                    print(
                        f"d={d} b={batch:2d} ctx={context:6d} page={page:3d}: fp8 "
                        f"{row['gbps']['flashgen_fp8']:6.0f} GB/s, bf16 "
                        f"{row['gbps']['flashgen_bf16']:6.0f} GB/s, fp8/bf16 tokens/s "
                        f"{tp['flashgen_fp8'] / tp['flashgen_bf16']:.2f}x"
                        + (f", fp8/cuDNN {tp['flashgen_fp8'] / tp['CUDNN']:.2f}x" if cudnn else ""),
                        flush=True,
                    )
                del k, v, k8, v8
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "env": environment()}, indent=1) + "\n")
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
