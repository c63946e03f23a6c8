"""Run a flashgen decode kernel (and its merge_states) from Python.

    kernel = load_decode_kernel(spec)
    res = kernel.run(q, k_cache, v_cache, cache_seqlens)                  # contiguous cache
    res = kernel.run(q, pages_k, pages_v, cache_seqlens, block_table=t)   # paged (spec paged)
    o, lse = kernel.merge_states(o_parts, lse_parts)                      # NumPy merge_states

NumPy in, NumPy out, as `verify.runner`: q `(batch, seqlen_q, heads, d)`; contiguous caches
`(batch, capacity, kv_heads, d)`; paged caches `(num_pages, page_size, kv_heads, d)` with an
int32 `block_table (batch, max_pages)`; `cache_seqlens` int32 `(batch,)`. Inputs are rounded
to the kernel's dtype on upload (`res.inputs` holds what the reference must see); outputs come
back float32: O like q, LSE `(batch, heads, seqlen_q)`. Every buffer has poisoned margins
(checked after the launch), outputs and the workspace's parts are poisoned too, the cache's
padding rows and unused pages hold NaN, so a stray read or write shows.

Score-stage features (`verify.score_mods`): `softcap`, `alibi_slopes` (float `(heads,)` or
`(batch, heads)`) and `sinks` (float `(heads,)`) are required for a spec with the feature and
refused for one without; slopes and sinks are uploaded as fp32 (`res.inputs` and `res.score`
hold what the device saw). `merge_states` takes no score arguments (its parts are finished
partial results).

FP8 caches (`kv_dtype: e4m3` specs): `k_cache`, `v_cache` are rounded to e4m3 on upload
(`verify.fp8.encode`, NaN kept; `res.inputs["k"]` holds the e4m3 values) and `k_descale`,
`v_descale` (float32 `(batch, kv_heads)`, or scalars: per-tensor, uploaded as one element
read with strides 0; default 1) are the scales the kernel applies: the attention is that of
`k_descale * k` and `v_descale * v` (`res.inputs["k_descale"]`, `["v_descale"]`, as
`(batch, kv_heads)` arrays, for `reference_decode`). Row padding of an FP8 cache rounds up to
16 elements (its strides must be multiples of 16).

`DecodeLibrary` is the pointer-level API (torch tensors' `data_ptr()` work): `launch`,
`check`, `workspace_bytes` as every `KernelLibrary`, plus `num_splits(values)` (what a launch
picks) and `merge_states(values, stream)` / `merge_check(values)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flashgen.generator.families.decode import ERR_PAGE_ID, ERR_SEQLEN, IO_KEYS
from flashgen.runtime import LaunchError
from flashgen.runtime.decode import DecodeLibrary
from flashgen.verify import fp8
from flashgen.verify.numerics import from_dtype_bits, to_dtype_bits
from flashgen.verify.runner import (
    DeviceBuffer,
    Gpu,
    RunnerError,
    check_score,
    score_fields,
    score_inputs,
)
from flashgen.verify.score_mods import ScoreArgs

__all__ = [
    "DecResult",
    "DecodeKernel",
    "DecodeLibrary",
    "ERRORS",
    "load_decode_kernel",
]

ERRORS = {ERR_PAGE_ID: "page id out of range", ERR_SEQLEN: "cache_seqlens out of range"}


@dataclass
class DecResult:
    o: np.ndarray
    lse: np.ndarray | None
    inputs: dict[str, np.ndarray]
    num_splits: int
    errors: int  # the workspace's error word
    io: dict[str, int] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    score: ScoreArgs = field(default_factory=ScoreArgs)  # the score-stage values as uploaded


def _upload(gpu: Gpu, arr: np.ndarray, bufs: list) -> DeviceBuffer:
    buf = DeviceBuffer(gpu, arr.nbytes)
    buf.upload(arr)
    bufs.append(buf)
    return buf


class DecodeKernel:
    """One compiled decode kernel plus NumPy buffers."""

    def __init__(self, spec, lib_dir: Path | str | None = None) -> None:
        if spec.kernel.yaml != "decode":
            raise RunnerError(f"{spec.kernel.yaml} spec given to the decode runner")
        self.spec = spec
        try:
            self.library = DecodeLibrary(spec, lib_dir)
        except FileNotFoundError as e:
            raise RunnerError(str(e)) from None
        self.name = self.library.name
        self.gpu = Gpu.get()

    def _bits(self, x: Any) -> np.ndarray:
        return to_dtype_bits(np.asarray(x, dtype=np.float32), self.spec.dtype.yaml)

    def run(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        *,
        block_table=None,
        softmax_scale: float | None = None,
        window=(-1, -1),
        num_splits: int = 0,
        max_seqlen_k: int = 0,
        return_lse: bool = True,
        row_pad: int = 0,
        overrides: dict[str, Any] | None = None,
        softcap: float = 0.0,
        alibi_slopes=None,
        sinks=None,
        score_mod=None,
        score_params=None,
        k_descale=None,
        v_descale=None,
    ) -> DecResult:
        """One decode call. `row_pad` extra elements (a multiple of 8) end every row of q, the
        caches and o (strided layouts); `overrides` replaces launch parameters after they are
        built (hostile-input tests); `softcap`, `alibi_slopes`, `sinks` the score-stage
        features' values (see the module doc)."""
        spec = self.spec
        q = np.asarray(q, dtype=np.float32)
        if q.ndim != 4 or q.shape[-1] != spec.head_dim:
            raise RunnerError(f"q must be (batch, seqlen_q, heads, {spec.head_dim}), got {q.shape}")
        batch, sq, heads, d = q.shape
        kv_heads = k_cache.shape[2]
        lens = np.ascontiguousarray(cache_seqlens, dtype=np.int32)
        if lens.shape != (batch,):
            raise RunnerError(f"cache_seqlens must have {batch} entries, got {lens.shape}")
        if spec.paged and block_table is None:
            raise RunnerError("a paged spec needs block_table")
        if row_pad % 8:
            raise RunnerError("row_pad must be a multiple of 8 elements")
        score = check_score(
            spec,
            softcap,
            alibi_slopes,
            sinks,
            batch=batch,
            heads=heads,
            score_mod=score_mod,
            score_params=score_params,
        )
        dt = spec.dtype.yaml
        fp8_cache = spec.kv_dtype is not None
        if not fp8_cache and (k_descale is not None or v_descale is not None):
            raise RunnerError("k_descale / v_descale are for FP8-cache specs (kv_dtype: e4m3)")
        bits = {"q": self._bits(q)}
        if fp8_cache:
            for nm, x in (("k", k_cache), ("v", v_cache)):
                bits[nm] = fp8.encode(np.asarray(x, dtype=np.float64))
        else:
            bits.update(k=self._bits(k_cache), v=self._bits(v_cache))
        inputs = {
            nm: (fp8.decode(b_) if fp8_cache and nm != "q" else from_dtype_bits(b_, dt))
            for nm, b_ in bits.items()
        }
        inputs.update(score_inputs(score))
        descales = {}
        if fp8_cache:
            for nm, ds in (("k_descale", k_descale), ("v_descale", v_descale)):
                arr = np.asarray(1.0 if ds is None else ds, dtype=np.float32)
                if arr.ndim and arr.shape != (batch, kv_heads):
                    raise RunnerError(
                        f"{nm} must be a scalar or ({batch}, {kv_heads}), got {arr.shape}"
                    )
                descales[nm] = arr
                inputs[nm] = np.broadcast_to(arr, (batch, kv_heads)).copy()
        gpu = self.gpu
        bufs: list[DeviceBuffer] = []
        try:
            params: dict[str, Any] = score_fields(gpu, score, heads, bufs)
            for nm, arr in descales.items():
                params[nm] = _upload(gpu, np.ascontiguousarray(arr.reshape(-1)), bufs).ptr
                bs, hs = (kv_heads, 1) if arr.ndim else (0, 0)
                params.update({f"{nm}_batch_stride": bs, f"{nm}_head_stride": hs})
            for nm in ("q", "k", "v"):
                x = bits[nm]
                pad = -(-row_pad // 16) * 16 if fp8_cache and nm != "q" else row_pad
                fill = 0x7F if x.dtype == np.uint8 else 0xFFFF  # NaN in the row padding
                store = np.full((*x.shape[:-1], d + pad), fill, dtype=x.dtype)
                store[..., :d] = x
                params[nm] = _upload(gpu, store, bufs).ptr
                s0, s1, s2 = (
                    x.shape[1] * x.shape[2] * (d + pad),
                    x.shape[2] * (d + pad),
                    d + pad,
                )
                params.update(
                    {f"{nm}_batch_stride": s0, f"{nm}_row_stride": s1, f"{nm}_head_stride": s2}
                )
            o_buf = DeviceBuffer(gpu, batch * sq * heads * (d + row_pad) * 2)
            bufs.append(o_buf)
            lse_buf = DeviceBuffer(gpu, batch * heads * sq * 4) if return_lse else None
            if lse_buf is not None:
                bufs.append(lse_buf)
            params.update(
                o=o_buf.ptr,
                o_batch_stride=sq * heads * (d + row_pad),
                o_row_stride=heads * (d + row_pad),
                o_head_stride=d + row_pad,
                lse=lse_buf.ptr if lse_buf is not None else 0,
                lse_batch_stride=heads * sq,
                lse_head_stride=sq,
                cache_seqlens=_upload(gpu, lens, bufs).ptr,
                batch=batch,
                heads=heads,
                kv_heads=kv_heads,
                seqlen_q=sq,
                max_seqlen_k=max_seqlen_k,
                head_dim=d,  # <name>_check compares them with the kernel's
                head_dim_v=d,
                softmax_scale=softmax_scale or 1.0 / float(np.sqrt(d)),
                window_left=int(window[0]),
                window_right=int(window[1]),
                num_splits=num_splits,
            )
            if spec.paged:
                table = np.ascontiguousarray(block_table, dtype=np.int32)
                params.update(
                    block_table=_upload(gpu, table, bufs).ptr,
                    page_size=k_cache.shape[1],
                    num_pages=k_cache.shape[0],
                    max_pages=table.shape[1],
                    block_table_stride=table.shape[1],
                )
            else:
                params["seqlen_k"] = k_cache.shape[1]
            io_buf = None
            if spec.instrument_io:
                io_buf = DeviceBuffer(gpu, 8 * len(IO_KEYS), fill=0)
                bufs.append(io_buf)
                params["io_counters"] = io_buf.ptr
            params.update(overrides or {})
            splits = self.library.num_splits(params)
            ws_bytes = max(self.library.workspace_bytes(params), 256)
            ws = DeviceBuffer(gpu, ws_bytes)  # poisoned: parts must be written before read
            bufs.append(ws)
            gpu.cuda.memset_d32(ws.ptr, 0, 1)  # the error word starts clear
            params.setdefault("workspace", ws.ptr)
            params.setdefault("workspace_size", ws_bytes)
            if overrides:
                params.update({k: v for k, v in overrides.items() if k.startswith("workspace")})
            try:
                self.library.launch(params)
            except LaunchError as e:
                raise RunnerError(str(e)) from None
            gpu.context.synchronize()
            outs = [o_buf, ws] + ([lse_buf] if lse_buf is not None else [])
            stats = {"margins_intact": all(b_.margins_intact() for b_ in outs)}
            o = from_dtype_bits(o_buf.download(np.uint16, (batch, sq, heads, d + row_pad)), dt)
            stats["row_pad_intact"] = bool(np.all(np.isnan(o[..., d:]))) if row_pad else True
            lse = lse_buf.download(np.float32, (batch, heads, sq)) if lse_buf is not None else None
            err = int(ws.download(np.uint32, (1,))[0])
            io = None
            if io_buf is not None:
                raw = io_buf.download(np.uint64, (len(IO_KEYS),))
                io = {nm: int(x) for nm, x in zip(IO_KEYS, raw)}
            return DecResult(o[..., :d], lse, inputs, splits, err, io, stats, score)
        finally:
            for b_ in bufs:
                b_.free()

    def merge_states(
        self, o_parts, lse_parts, *, parts_in_dtype: bool = False, return_lse: bool = True
    ):
        """merge_states on NumPy arrays: o_parts `(P, batch, S, heads, d)` (float32, or rounded
        to the kernel's dtype when `parts_in_dtype`), lse_parts float32 `(P, batch, heads, S)`.
        Returns (o float32 `(batch, S, heads, d)`, lse `(batch, heads, S)` or None)."""
        o_parts = np.asarray(o_parts, dtype=np.float32)
        lse_parts = np.ascontiguousarray(lse_parts, dtype=np.float32)
        p_, batch, s, heads, d = o_parts.shape
        dt = self.spec.dtype.yaml
        gpu = self.gpu
        bufs: list[DeviceBuffer] = []
        try:
            host = to_dtype_bits(o_parts, dt) if parts_in_dtype else o_parts
            o_parts_buf = _upload(gpu, np.ascontiguousarray(host), bufs)
            lse_parts_buf = _upload(gpu, lse_parts, bufs)
            o_buf = DeviceBuffer(gpu, batch * s * heads * d * 2)
            bufs.append(o_buf)
            lse_buf = DeviceBuffer(gpu, batch * heads * s * 4) if return_lse else None
            if lse_buf is not None:
                bufs.append(lse_buf)
            values = dict(
                o=o_buf.ptr,
                lse=lse_buf.ptr if lse_buf is not None else 0,
                o_batch_stride=s * heads * d,
                o_row_stride=heads * d,
                o_head_stride=d,
                lse_batch_stride=heads * s,
                lse_head_stride=s,
                batch=batch,
                heads=heads,
                kv_heads=1,
                seqlen_q=s,
                head_dim=d,  # merge_check compares them with the kernel's
                head_dim_v=d,
                o_parts=o_parts_buf.ptr,
                lse_parts=lse_parts_buf.ptr,
                num_parts=p_,
                parts_dtype=1 if parts_in_dtype else 0,
                o_parts_part_stride=batch * s * heads * d,
                o_parts_batch_stride=s * heads * d,
                o_parts_row_stride=heads * d,
                o_parts_head_stride=d,
                lse_parts_part_stride=batch * heads * s,
                lse_parts_batch_stride=heads * s,
                lse_parts_head_stride=s,
            )
            if self.spec.instrument_io:
                io_buf = DeviceBuffer(gpu, 8 * len(IO_KEYS), fill=0)
                bufs.append(io_buf)
                values["io_counters"] = io_buf.ptr
            try:
                self.library.merge_states(values)
            except LaunchError as e:
                raise RunnerError(str(e)) from None
            gpu.context.synchronize()
            o = from_dtype_bits(o_buf.download(np.uint16, (batch, s, heads, d)), dt)
            lse = lse_buf.download(np.float32, (batch, heads, s)) if lse_buf is not None else None
            return o, lse
        finally:
            for b_ in bufs:
                b_.free()


def load_decode_kernel(spec, lib_dir: Path | str | None = None) -> DecodeKernel:
    """The decode kernel of `spec`, from `<lib_dir>/<name>.so` (`flashgen compile` output)."""
    return DecodeKernel(spec, lib_dir)
