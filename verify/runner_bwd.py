"""Run a flashgen backward kernel from Python through PyCUDA.

The public API:

    kernel = load_bwd_kernel(spec)                      # the library `flashgen compile` built
    res = kernel.run(q, k, v, o, lse, dout, ...)        # NumPy in, NumPy out
    res.dq, res.dk, res.dv, res.dsinks, res.keep_mask, res.io

Inputs as for the forward runner (`verify.runner`): q, o, dout `(batch, seqlen_q, heads, d)`,
k, v `(batch, seqlen_k, kv_heads, d)` (varlen: packed `(total, heads, d)` with int32
`cu_seqlens_q/k`), lse `(batch, heads, seqlen_q)` (varlen `(heads, total_q)`), natural log,
-inf on rows with no visible key: the forward's O and LSE (e.g. from `verify.reference`, O
rounded to the dtype). q, k, v, o, dout are rounded to the kernel's dtype and lse to float32
on upload; `res.inputs` holds the rounded values, which are what a reference must be fed.
Outputs come back as float32: dq in q's layout, dk and dv in k's (summed over each GQA group).

`memory_layout` ('bshd' or 'bhsd') and `pad` (extra elements ending every row, a multiple of
8) apply to every input and output of head-dim rows, so output strides are exercised too.
Every output buffer, the workspace and the debug keep-mask are poisoned (all bits set: NaN
in fp16, bf16 and fp32; the keep-mask with 2) and surrounded by poisoned margins; after the
launch `res.stats['margins_intact']` says whether the margins and the padding of the output
rows are untouched.

Score-stage features as in the forward runner: `softcap`, `alibi_slopes`, `sinks`, required
for a spec with the feature and refused for one without; pass the values the forward used
(the LSE must be the one they produced). A spec with sink also writes `dsinks`, fp32
`(heads,)`, into a poisoned (NaN) buffer with checked margins: `res.dsinks` (None without
sink).

`layout` is the FORWARD's compact layout (`verify.blocksparse.compact_layout_for_spec` with
this spec's block sizes and the run's window); the runner uploads its transpose
(`verify.blocksparse_bwd.transpose_layout`).

The workspace is carved here as the C ABI says: fp32 dq_accum `(batch * seqlen_q, heads, d)`,
fp32 dsum `(batch * seqlen_q, heads)` and, for `deterministic: true` builds, int32 dq_sem
`(batch, heads, ceil(seqlen_q / block_m))`, each rounded up to 256 bytes (varlen: seqlen_q is
the longest sequence, rows are packed positions); `<name>_workspace_bytes` must return at
least that.

PyCUDA is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flashgen.generator.naming import kernel_name
from flashgen.runtime import KernelLibrary, LaunchError
from flashgen.runtime.workspace import WORKSPACE_ALIGN, workspace_layout  # noqa: F401
from flashgen.verify.blocksparse_bwd import transpose_layout
from flashgen.verify.io_model_bwd import IO_KEYS
from flashgen.verify.numerics import from_dtype_bits, to_dtype_bits
from flashgen.verify.runner import (
    DeviceBuffer,
    Gpu,
    Problem,
    RunnerError,
    score_fields,
    score_inputs,
    strided_upload,
    validate,
)
from flashgen.verify.score_mods import ScoreArgs

__all__ = [
    "IO_TENSORS",
    "BwdKernel",
    "BwdResult",
    "load_bwd_kernel",
    "run_bwd",
    "validate_bwd",
    "workspace_layout",
]

IO_TENSORS = IO_KEYS  # the kernel's counter order (FgBwdIo in bwd_kernel.cuh)


@dataclass
class BwdResult:
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    inputs: dict[str, np.ndarray]
    keep_mask: np.ndarray | None = None
    io: dict[str, int] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    dsinks: np.ndarray | None = None  # fp32 (heads,) for a spec with sink
    score: ScoreArgs = field(default_factory=ScoreArgs)  # the score-stage values as uploaded


def lse_shape(pb: Problem, total_q: int) -> tuple[int, ...]:
    """`(batch, heads, seqlen_q)`, varlen `(heads, total_q)`."""
    return (pb.heads, total_q) if pb.varlen else (pb.batch, pb.heads, pb.seqlen_q)


def validate_bwd(
    spec,
    q,
    k,
    v,
    o,
    lse,
    dout,
    *,
    softmax_scale=None,
    window=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    dropout_p=0.0,
    layout=None,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    score_mod=None,
    score_params=None,
    mask_mod=None,
) -> Problem:
    """`verify.runner.validate` (q, k, v, masks, layout, score-stage features) plus the
    backward's own inputs: o and dout shaped like q with v's head dim (d_v), lse like the
    forward's LSE. Raises RunnerError naming the problem."""
    if getattr(spec.kernel, "yaml", spec.kernel) != "backward":
        raise RunnerError(
            f"{kernel_name(spec)} is a {spec.kernel.yaml} kernel; BwdKernel runs kernel: backward"
        )
    pb = validate(
        spec,
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        dropout_p=dropout_p,
        layout=layout,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )
    o_shape = q.shape[:-1] + (pb.head_dim_v,)  # q's with v's head dim d_v
    for nm, t in (("o", o), ("dout", dout)):
        if not isinstance(t, np.ndarray):
            raise RunnerError(f"{nm} must be a numpy array, got {type(t).__name__}")
        if not np.issubdtype(t.dtype, np.floating):
            raise RunnerError(f"{nm} must be a floating array, got {t.dtype}")
        if t.shape != o_shape:
            raise RunnerError(
                f"{nm} must have q's shape with v's head dim, {o_shape}, got {t.shape}"
            )
    if not isinstance(lse, np.ndarray):
        raise RunnerError(f"lse must be a numpy array, got {type(lse).__name__}")
    if not np.issubdtype(lse.dtype, np.floating):
        raise RunnerError(f"lse must be a floating array, got {lse.dtype}")
    want = lse_shape(pb, q.shape[0])
    if lse.shape != want:
        what = "(heads, total_q)" if pb.varlen else "(batch, heads, seqlen_q)"
        raise RunnerError(f"lse must have shape {what} = {want}, got {lse.shape}")
    if np.any(np.isnan(lse)) or np.any(lse == np.inf):
        raise RunnerError("lse must be finite, or -inf on rows with no visible key (no NaN, +inf)")
    return pb


def _output_buffer(gpu, shape: tuple[int, ...], memory_layout: str, pad: int):
    """A poisoned output in the chosen memory layout: (buffer, strides in elements)."""
    return strided_upload(gpu, np.full(shape, 0xFFFF, dtype=np.uint16), memory_layout, pad)


def _strided_download(
    buf: DeviceBuffer, shape: tuple[int, ...], memory_layout: str, pad: int, dt: str
) -> tuple[np.ndarray, bool]:
    """Read back an output written through `_output_buffer`: (float32 values of `shape`,
    whether the row padding still holds the poison)."""
    varlen = len(shape) == 3
    b, s, h, d = (1, *shape) if varlen else shape
    da = d + pad
    store_shape = (b, s, h, da) if memory_layout == "bshd" else (b, h, s, da)
    if int(np.prod(store_shape)) == 0:
        return np.zeros(shape, dtype=np.float32), True
    store = buf.download(np.uint16, store_shape)
    pad_ok = bool(np.all(store[..., d:] == 0xFFFF))
    x = store if memory_layout == "bshd" else store.transpose(0, 2, 1, 3)
    vals = from_dtype_bits(np.ascontiguousarray(x[..., :d]), dt)
    return (vals[0] if varlen else vals), pad_ok


class BwdKernel:
    """One compiled backward kernel: its host library (`generator.launch`) plus buffers."""

    def __init__(self, spec, lib_dir: Path | str | None = None) -> None:
        if getattr(spec.kernel, "yaml", spec.kernel) != "backward":
            raise RunnerError(
                f"{kernel_name(spec)} is a {spec.kernel.yaml} kernel; use verify.runner for it"
            )
        self.spec = spec
        self.name = kernel_name(spec)
        try:
            self.library = KernelLibrary(spec, lib_dir)
        except FileNotFoundError as e:
            raise RunnerError(str(e)) from None
        self.gpu = Gpu.get()

    def workspace_bytes(self, params: dict[str, Any]) -> int:
        """What the kernel's `<name>_workspace_bytes` asks for with these parameters."""
        return self.library.workspace_bytes(params)

    def launch_raw(self, params: dict[str, Any], stream: int = 0) -> None:
        """Launch with explicit device pointers (fg_bwd_params fields) through the C
        launcher, which checks them, and wait for it."""
        try:
            self.library.launch(params, stream)
        except LaunchError as e:
            raise RunnerError(str(e)) from None
        self.gpu.context.synchronize()

    def run(
        self,
        q,
        k,
        v,
        o,
        lse,
        dout,
        *,
        softmax_scale=None,
        window=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        dropout_p=0.0,
        seed=0,
        offset=0,
        layout=None,
        memory_layout: str = "bshd",
        pad: int = 0,
        softcap=0.0,
        alibi_slopes=None,
        sinks=None,
        score_mod=None,
        score_params=None,
        mask_mod=None,
    ) -> BwdResult:
        spec = self.spec
        pb = validate_bwd(
            spec,
            q,
            k,
            v,
            o,
            lse,
            dout,
            softmax_scale=softmax_scale,
            window=window,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            dropout_p=dropout_p,
            layout=layout,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            score_mod=score_mod,
            score_params=score_params,
            mask_mod=mask_mod,
        )
        if not 0 <= int(seed) < 2**64:
            raise RunnerError(f"seed must be in [0, 2^64), got {seed}")
        if not 0 <= int(offset) < 2**32:
            raise RunnerError(
                f"offset must be in [0, 2^32) (the Philox counter's word), got {offset}"
            )
        if memory_layout not in ("bshd", "bhsd"):
            raise RunnerError(f"memory_layout must be 'bshd' or 'bhsd', got {memory_layout!r}")
        if pad % 8 or pad < 0:
            raise RunnerError(f"pad must be a non-negative multiple of 8 elements, got {pad}")
        bwd_layout = transpose_layout(layout) if layout is not None else None
        dt = spec.dtype.yaml
        bits = {
            nm: to_dtype_bits(np.asarray(t, dtype=np.float32), dt)
            for nm, t in (("q", q), ("k", k), ("v", v), ("o", o), ("dout", dout))
        }
        inputs = {nm: from_dtype_bits(b_, dt) for nm, b_ in bits.items()}
        lse32 = np.ascontiguousarray(lse, dtype=np.float32)
        inputs["lse"] = lse32.copy()
        inputs.update(score_inputs(pb.score))
        gpu = self.gpu
        bufs: list[DeviceBuffer] = []

        def upload(arr: np.ndarray) -> int:
            buf = DeviceBuffer(gpu, arr.nbytes)
            bufs.append(buf)
            if arr.nbytes:
                buf.upload(arr)
            return buf.ptr

        try:
            params: dict[str, Any] = score_fields(gpu, pb.score, pb.heads, bufs)
            dsinks_buf = None
            if pb.score.sinks is not None:  # poisoned: NaN until the dsink kernel writes it
                dsinks_buf = DeviceBuffer(gpu, 4 * pb.heads)
                bufs.append(dsinks_buf)
                params["dsinks"] = dsinks_buf.ptr
            prefix = {"q": "q", "k": "k", "v": "v", "o": "o", "dout": "do"}
            for nm, pre in prefix.items():
                buf, strides = strided_upload(gpu, bits[nm], memory_layout, pad)
                bufs.append(buf)
                params[nm] = buf.ptr
                params[f"{pre}_batch_stride"], params[f"{pre}_row_stride"] = strides[:2]
                params[f"{pre}_head_stride"] = strides[2]
            outs: dict[str, tuple[DeviceBuffer, tuple[int, ...]]] = {}
            for nm, shape in (("dq", q.shape), ("dk", k.shape), ("dv", v.shape)):
                buf, strides = _output_buffer(gpu, tuple(shape), memory_layout, pad)
                bufs.append(buf)
                outs[nm] = (buf, tuple(shape))
                params[nm] = buf.ptr
                params[f"{nm}_batch_stride"], params[f"{nm}_row_stride"] = strides[:2]
                params[f"{nm}_head_stride"] = strides[2]
            params["lse"] = upload(lse32)
            if pb.varlen:
                params["lse_batch_stride"], params["lse_head_stride"] = 0, q.shape[0]
            else:
                params["lse_batch_stride"] = pb.heads * pb.seqlen_q
                params["lse_head_stride"] = pb.seqlen_q
            params.update(
                batch=pb.batch,
                heads=pb.heads,
                kv_heads=pb.kv_heads,
                seqlen_q=pb.seqlen_q,
                seqlen_k=pb.seqlen_k,
                head_dim=pb.head_dim,  # <name>_check compares them with the kernel's
                head_dim_v=pb.head_dim_v,
                softmax_scale=pb.scale,
                window_left=pb.window[0],
                window_right=pb.window[1],
                dropout_p=dropout_p,
                seed=int(seed) & (2**64 - 1),
                offset=int(offset),
                blk_layout_heads=1,
            )
            if pb.varlen:
                params["cu_seqlens_q"] = upload(pb.cu_seqlens_q)
                params["cu_seqlens_k"] = upload(pb.cu_seqlens_k)
                # rows of the packed tensors (the sm_90a backward's tensor maps span them)
                params["total_q"], params["total_k"] = q.shape[0], k.shape[0]
            keep_buf = None
            keep_shape = (pb.batch, pb.heads, pb.seqlen_q, pb.seqlen_k)
            if spec.debug_keep_mask:
                keep_buf = DeviceBuffer(gpu, int(np.prod(keep_shape)), fill=2)
                bufs.append(keep_buf)
                params["keep_mask"] = keep_buf.ptr
            if bwd_layout is not None:
                for nm in ("full_count", "full_idx", "part_count", "part_idx"):
                    arr = np.ascontiguousarray(getattr(bwd_layout, nm), dtype=np.int32)
                    params[f"blk_{nm}"] = upload(arr)
                params["blk_layout_heads"] = bwd_layout.layout_heads
                params["blk_max_blocks"] = bwd_layout.max_blocks
            io_buf = None
            if spec.instrument_io:
                io_buf = DeviceBuffer(gpu, 8 * len(IO_TENSORS), fill=0)
                bufs.append(io_buf)
                params["io_counters"] = io_buf.ptr
            # workspace: sized by the kernel, carved here (dq_accum, then dsum)
            deterministic = bool(getattr(spec, "deterministic", False))
            carve = workspace_layout(
                pb.batch,
                pb.seqlen_q,
                pb.heads,
                pb.head_dim,
                block_m=spec.tile.block_m,
                deterministic=deterministic,
            )
            asked = self.workspace_bytes(params)
            if asked < carve["bytes"]:
                raise RunnerError(
                    f"{self.name}_workspace_bytes returned {asked} bytes, less than the "
                    f"{carve['bytes']} the dq_accum + dsum (+ dq_sem) carve needs"
                )
            ws_buf = DeviceBuffer(gpu, asked)  # poisoned: unwritten dsum reads as NaN
            bufs.append(ws_buf)
            params["dq_accum"] = ws_buf.ptr + carve["dq_accum"]
            params["dsum"] = ws_buf.ptr + carve["dsum"]
            if deterministic:
                params["dq_sem"] = ws_buf.ptr + carve["dq_sem"]

            self.launch_raw(params)

            stats: dict[str, Any] = {"workspace_bytes": asked}
            grads = {}
            pads_ok = True
            for nm, (buf, shape) in outs.items():
                grads[nm], ok = _strided_download(buf, shape, memory_layout, pad, dt)
                pads_ok &= ok
            stats["pads_intact"] = pads_ok
            margin_bufs = [buf for buf, _ in outs.values()] + [ws_buf]
            keep = None
            if keep_buf is not None:
                margin_bufs.append(keep_buf)
                if keep_buf.nbytes:
                    keep = keep_buf.download(np.uint8, keep_shape)
                else:
                    keep = np.zeros(keep_shape, dtype=np.uint8)
            if io_buf is not None:
                margin_bufs.append(io_buf)
            dsinks = None
            if dsinks_buf is not None:
                margin_bufs.append(dsinks_buf)
                dsinks = dsinks_buf.download(np.float32, (pb.heads,))
            stats["margins_intact"] = pads_ok and all(b_.margins_intact() for b_ in margin_bufs)
            io = None
            if io_buf is not None:
                raw = io_buf.download(np.uint64, (len(IO_TENSORS),))
                io = {nm: int(x) for nm, x in zip(IO_TENSORS, raw)}
            return BwdResult(
                dq=grads["dq"],
                dk=grads["dk"],
                dv=grads["dv"],
                inputs=inputs,
                keep_mask=keep,
                io=io,
                stats=stats,
                dsinks=dsinks,
                score=pb.score,
            )
        finally:
            for b_ in bufs:
                b_.free()


def load_bwd_kernel(spec, lib_dir: Path | str | None = None) -> BwdKernel:
    """The backward kernel of `spec`, from `<lib_dir>/<name>.so` (`flashgen compile` output)."""
    return BwdKernel(spec, lib_dir)


def run_bwd(spec, q, k, v, o, lse, dout, **kwargs) -> BwdResult:
    """One-shot convenience: load the spec's kernel and run it (see BwdKernel.run)."""
    return load_bwd_kernel(spec).run(q, k, v, o, lse, dout, **kwargs)
