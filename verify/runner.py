"""Run a flashgen forward kernel from Python through PyCUDA.

The public API:

    kernel = load_kernel(spec)                 # the cubin that `flashgen compile` built
    res = kernel.run(q, k, v, causal...)       # NumPy in, NumPy out
    res.o, res.lse, res.keep_mask, res.io, res.score

Inputs are NumPy float arrays of layout `(batch, seqlen, heads, head_dim)` (varlen: packed
`(total, heads, head_dim)` with int32 `cu_seqlens_q/k`). They are rounded to the kernel's dtype
(fp16 or bf16, round to nearest even) on upload; `res.inputs` holds the rounded values, which
are what a reference must be fed. Outputs come back as float32: O in Q's layout, LSE as
`(batch, heads, seqlen_q)` (varlen: `(heads, total_q)`), natural log, `-inf` on empty rows.

Score-stage features (`verify.score_mods`): `softcap` (> 0), `alibi_slopes` (float `(heads,)`
or `(batch, heads)`) and `sinks` (float `(heads,)`) are required for a spec with the feature
and refused for one without it; slopes and sinks are uploaded as fp32 (`res.inputs`
'alibi_slopes' / 'sinks' hold the fp32 values, `res.score` all three as the reference takes
them: `reference.attention_forward(..., **res.score.kwargs())`).

The NumPy arguments are checked for what they mean (shapes, lengths, layouts) before any
buffer is made; the device parameters are then checked by the kernel's own C launcher
(`generator.launch`: the one launch path), and a `RunnerError` says what is wrong and what is
allowed.
Every output buffer is surrounded by poisoned margins (all bits set: NaN in fp16, bf16 and
fp32) that are checked after the launch, and outputs are poisoned too, so a missed or stray
write is caught.

PyCUDA is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

import atexit
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flashgen.generator.naming import kernel_name
from flashgen.runtime import KernelLibrary, LaunchError
from flashgen.verify.io_model import IO_KEYS
from flashgen.verify.numerics import from_dtype_bits, to_dtype_bits
from flashgen.verify.score_mods import ScoreArgs, check_score_args, score_args_problems

MARGIN_BYTES = 512
# the kernel's counter order (docs/conventions.md), the IO model's keys
IO_TENSORS = IO_KEYS


class RunnerError(ValueError):
    """A kernel argument the kernel cannot take; the message names it and what is allowed."""


@dataclass
class FwdResult:
    o: np.ndarray
    lse: np.ndarray
    inputs: dict[str, np.ndarray]
    keep_mask: np.ndarray | None = None
    io: dict[str, int] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    score: ScoreArgs = field(default_factory=ScoreArgs)  # the score-stage values as uploaded


@dataclass
class Problem:
    """The validated, shape-resolved arguments of one forward call."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int  # the maximum over the batch for varlen
    seqlen_k: int
    head_dim: int
    varlen: bool
    scale: float
    window: tuple[int, int]
    cu_seqlens_q: np.ndarray | None
    cu_seqlens_k: np.ndarray | None
    score: ScoreArgs = field(default_factory=ScoreArgs)  # fp32-rounded slopes and sinks


def check_score(
    spec,
    softcap,
    alibi_slopes,
    sinks,
    *,
    batch: int,
    heads: int,
    score_mod=None,
    score_params=None,
    mask_mod=None,
) -> ScoreArgs:
    """The score-stage arguments of a call, validated against the spec: a value the spec has
    no feature for is refused, a feature the spec has must get one (RunnerError naming the
    argument). Slopes and sinks come back rounded to fp32, as the device holds them. A spec's
    score_mod takes `score_params` (its declared parameters' values; `score_mod`, when given,
    must be the spec's own)."""
    mod = getattr(spec, "score_mod", None)
    mask = getattr(spec, "mask_mod", None)  # its parameters share score_params
    if score_mod is not None and score_mod != mod:
        raise RunnerError("score_mod given is not this spec's score_mod")
    if mask_mod is not None and mask_mod != mask:
        raise RunnerError("mask_mod given is not this spec's mask_mod")
    user = mod if mod is not None else mask
    if user is not None and score_params is None:
        decl = ", ".join(f"{n}: {k.value}" for n, k in user.params) or "none declared"
        raise RunnerError(f"this spec has a {user.kind}: pass score_params ({decl})")
    try:
        score = check_score_args(
            0.0 if softcap is None else softcap,
            alibi_slopes,
            sinks,
            batch=batch,
            heads=heads,
            score_mod=mod if score_params is not None else None,
            score_params=score_params,
            mask_mod=mask if score_params is not None else None,
        )
    except ValueError as e:
        raise RunnerError(str(e)) from None
    problems = score_args_problems(spec, score)
    if problems:
        raise RunnerError("; ".join(problems))

    def f32(a):
        return None if a is None else a.astype(np.float32).astype(np.float64)

    return ScoreArgs(
        score.softcap,
        f32(score.alibi_slopes),
        f32(score.sinks),
        score.score_mod,
        score.score_params,  # already as the device holds them (check_user_params)
        score.mask_mod,
    )


def score_fields(gpu, score: ScoreArgs, heads: int, bufs: list) -> dict[str, Any]:
    """The `fg_score_params` fields of a call: softcap, and the fp32 slopes and sinks uploaded
    into poisoned-margin buffers (appended to `bufs`); unused fields stay 0 (NULL)."""
    params: dict[str, Any] = {"softcap": float(score.softcap)}
    for nm, arr in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
        if arr is None:
            continue
        host = np.ascontiguousarray(arr, dtype=np.float32)
        buf = DeviceBuffer(gpu, host.nbytes)
        buf.upload(host)
        bufs.append(buf)
        params[nm] = buf.ptr
    if score.alibi_slopes is not None:
        params["alibi_batch_stride"] = 0 if score.alibi_slopes.ndim == 1 else int(heads)
    if score.user_mod is not None:
        params.update(user_slot_params(gpu, score, bufs))
    return params


def user_slot_params(gpu, score: ScoreArgs, bufs: list) -> dict[str, Any]:
    """The `fg_score_params.user_*` fields of a score_mod's parameters (slot k: the k-th by
    name, generator/features/__init__.py): scalars as user_f / user_i, vectors and tables
    uploaded (fp32, or int32 for int vectors) into poisoned-margin buffers, a table's columns
    in user_i."""
    from flashgen.generator.features.user import SLOT_FIELDS, user_slots
    from flashgen.generator.usermod import KIND_INFO, Type

    params: dict[str, Any] = {}
    for k, name, kind in user_slots(score.user_mod):
        value = score.score_params[name]
        fields = SLOT_FIELDS[kind]
        if "ptr" in fields:
            info = KIND_INFO[kind]
            host = np.ascontiguousarray(
                value, dtype=np.int32 if info.type is Type.INT else np.float32
            )
            buf = DeviceBuffer(gpu, max(host.nbytes, 4))
            buf.upload(host)
            bufs.append(buf)
            params[f"user_ptr{k}"] = buf.ptr
            if "i" in fields:  # a table: its columns
                params[f"user_i{k}"] = int(host.shape[1])
        elif "f" in fields:
            params[f"user_f{k}"] = float(value)
        else:
            params[f"user_i{k}"] = int(value)
    return params


def score_inputs(score: ScoreArgs) -> dict[str, np.ndarray]:
    """`res.inputs` entries of the slopes and sinks a call uploaded (float32), and of a
    score_mod's array parameters as `score_params.<name>` (a parameter may be named `k` or
    `lse`: under its bare name it would replace the input the references read)."""
    out = {}
    for nm, arr in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
        if arr is not None:
            out[nm] = arr.astype(np.float32)
    for nm, value in (score.score_params or {}).items():
        if isinstance(value, np.ndarray):
            out[f"score_params.{nm}"] = value
    return out


def validate(
    spec,
    q,
    k,
    v,
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
    """Check the arguments against the spec; raise RunnerError naming the first problem.

    `softcap`, `alibi_slopes`, `sinks`: the score-stage features' values (`check_score`)."""
    d = spec.head_dim
    varlen = spec.mask.varlen
    want_ndim = 3 if varlen else 4
    for nm, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, np.ndarray):
            raise RunnerError(f"{nm} must be a numpy array, got {type(t).__name__}")
        if t.ndim != want_ndim:
            shape = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
            raise RunnerError(f"{nm} must have shape {shape} for this spec, got {t.shape}")
        if t.shape[-1] != d:
            raise RunnerError(f"{nm} has head_dim {t.shape[-1]}, the kernel was generated for {d}")
        if not np.issubdtype(t.dtype, np.floating):
            raise RunnerError(f"{nm} must be a floating array, got {t.dtype}")
    if k.shape != v.shape:
        raise RunnerError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads < 1 or kv_heads < 1:
        raise RunnerError("heads and kv_heads must be >= 1")
    if spec.gqa:
        if heads % kv_heads:
            raise RunnerError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    elif kv_heads != heads:
        raise RunnerError(
            f"k/v have {kv_heads} heads but q has {heads}; this spec has gqa: false "
            "(generate one with gqa: true for grouped-query attention)"
        )
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise RunnerError("this spec has mask.varlen: true: pass cu_seqlens_q and cu_seqlens_k")
        cu_q = np.asarray(cu_seqlens_q)
        cu_k = np.asarray(cu_seqlens_k)
        for nm, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if not np.issubdtype(cu.dtype, np.integer):
                raise RunnerError(f"{nm} must hold integers, got {cu.dtype}")
        for nm, cu, total in (
            ("cu_seqlens_q", cu_q, q.shape[0]),
            ("cu_seqlens_k", cu_k, k.shape[0]),
        ):
            if cu.ndim != 1 or cu.size < 2:
                raise RunnerError(f"{nm} must be 1-D with batch + 1 >= 2 entries, got {cu.shape}")
            if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != total:
                raise RunnerError(
                    f"{nm} must start at 0, not decrease, and end at {total}; got {cu}"
                )
        if cu_q.size != cu_k.size:
            raise RunnerError("cu_seqlens_q and cu_seqlens_k must have the same length")
        if cu_q[-1] > np.iinfo(np.int32).max or cu_k[-1] > np.iinfo(np.int32).max:
            raise RunnerError("varlen totals must fit in int32")
        batch = cu_q.size - 1
        sq = int(np.max(np.diff(cu_q))) if batch else 0
        sk = int(np.max(np.diff(cu_k))) if batch else 0
        cu_q = cu_q.astype(np.int32)
        cu_k = cu_k.astype(np.int32)
    else:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise RunnerError("cu_seqlens given but this spec has mask.varlen: false")
        if q.shape[0] != k.shape[0]:
            raise RunnerError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu_q = cu_k = None
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise RunnerError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if window is not None and not spec.mask.window:
        raise RunnerError("window given but this spec has mask.window: false")
    win = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if win[0] < -1 or win[1] < -1:
        raise RunnerError(f"window sizes must be >= 0 or -1 (unbounded), got {win}")
    if dropout_p and not spec.dropout:
        raise RunnerError("dropout_p given but this spec has dropout: false")
    if not (0.0 <= dropout_p < 1.0):
        raise RunnerError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if spec.sparse and layout is None:
        raise RunnerError(
            "this spec has sparsity: block: pass layout= (verify.blocksparse.compact_layout)"
        )
    if layout is not None and not spec.sparse:
        raise RunnerError("layout given but this spec has sparsity: none")
    if layout is not None:
        lens_q = np.diff(cu_q) if varlen else [sq]
        lens_k = np.diff(cu_k) if varlen else [sk]
        check_layout(
            spec,
            layout,
            heads=heads,
            seqlen_q=sq,
            seqlen_k=sk,
            lens_q=lens_q,
            lens_k=lens_k,
        )
    score = check_score(
        spec,
        softcap,
        alibi_slopes,
        sinks,
        batch=batch,
        heads=heads,
        score_mod=score_mod,
        score_params=score_params,
        mask_mod=mask_mod,
    )
    return Problem(batch, heads, kv_heads, sq, sk, d, varlen, scale, win, cu_q, cu_k, score)


def check_layout(spec, layout, *, heads, seqlen_q, seqlen_k, lens_q, lens_k) -> None:
    """A CompactLayout is only valid for the tile sizes and lengths it was built for (its
    full/partial split depends on them, and on the mask and window, which it does not record:
    build it with the run's window) and its indices must name real K/V tiles."""
    bm, bn = spec.tile.block_m, spec.tile.block_n
    if (getattr(layout, "block_m", bm), getattr(layout, "block_n", bn)) != (bm, bn):
        raise RunnerError(
            f"layout was built for {layout.block_m}x{layout.block_n} tiles; this "
            f"kernel's are {bm}x{bn}"
        )
    for sq_i, sk_i in zip(lens_q, lens_k):
        if (int(sq_i), int(sk_i)) != (layout.seqlen_q, layout.seqlen_k):
            raise RunnerError(
                f"layout was built for (seqlen_q, seqlen_k) = ({layout.seqlen_q}, "
                f"{layout.seqlen_k}) but a sequence has ({int(sq_i)}, {int(sk_i)}); build one "
                "with verify.blocksparse.compact_layout_for_spec for these lengths (varlen: every "
                "sequence must have the layout's lengths)"
            )
    n_qt, n_kt = -(-seqlen_q // bm), -(-seqlen_k // bn)
    fc, fi = np.asarray(layout.full_count), np.asarray(layout.full_idx)
    pc, pi = np.asarray(layout.part_count), np.asarray(layout.part_idx)
    lh = fc.shape[0]
    if lh not in (1, heads) or fc.shape != (lh, n_qt) or pc.shape != fc.shape:
        raise RunnerError(f"layout counts have shape {fc.shape}; expected (1 or {heads}, {n_qt})")
    if fi.shape != pi.shape or fi.shape[:2] != fc.shape or fi.ndim != 3:
        raise RunnerError(
            f"layout index arrays have shapes {fi.shape} and {pi.shape}; expected "
            f"({lh}, {n_qt}, max_blocks) each"
        )
    width = fi.shape[2]
    for nm, cnt, idx in (("full", fc, fi), ("part", pc, pi)):
        if np.any(cnt < 0) or np.any(cnt > width):
            raise RunnerError(f"layout {nm}_count entries must lie in [0, {width}]")
        listed = np.arange(width)[None, None, :] < cnt[..., None]
        bad = listed & ((idx < 0) | (idx >= n_kt))
        if np.any(bad):
            raise RunnerError(f"layout {nm}_idx names K/V tiles outside [0, {n_kt})")


class Gpu:
    """PyCUDA on the device's primary context (shared with PyTorch when both are loaded)."""

    _instance: Gpu | None = None

    def __init__(self) -> None:
        import pycuda.driver as cuda

        cuda.init()
        self.cuda = cuda
        self.device = cuda.Device(0)
        self.context = self.device.retain_primary_context()
        self.context.push()
        self.modules: dict[str, Any] = {}
        atexit.register(self._close)

    def _close(self) -> None:
        self.modules.clear()
        try:
            self.cuda.Context.pop()
        except Exception:  # noqa: BLE001 - already gone at interpreter exit
            pass

    @classmethod
    def get(cls) -> Gpu:
        if cls._instance is None:
            cls._instance = Gpu()
        return cls._instance


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when PyCUDA can open a GPU, else (False, why not)."""
    try:
        gpu = Gpu.get()
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable GPU"
        return False, f"{type(exc).__name__}: {exc}"
    return True, gpu.device.name()


class DeviceBuffer:
    """A device allocation with poisoned margins on both sides."""

    def __init__(self, gpu: Gpu, nbytes: int, fill: int = 0xFF) -> None:
        self.gpu = gpu
        self.nbytes = nbytes
        self.alloc = gpu.cuda.mem_alloc(max(nbytes, 1) + 2 * MARGIN_BYTES)
        self.fill = fill
        gpu.cuda.memset_d8(self.alloc, 0xFF, max(nbytes, 1) + 2 * MARGIN_BYTES)
        if fill != 0xFF:
            gpu.cuda.memset_d8(int(self.alloc) + MARGIN_BYTES, fill, max(nbytes, 1))

    @property
    def ptr(self) -> int:
        return int(self.alloc) + MARGIN_BYTES

    def upload(self, host: np.ndarray) -> None:
        assert host.nbytes <= self.nbytes
        self.gpu.cuda.memcpy_htod(self.ptr, np.ascontiguousarray(host))

    def download(self, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.gpu.cuda.memcpy_dtoh(out, self.ptr)
        return out

    def margins_intact(self) -> bool:
        raw = np.empty(max(self.nbytes, 1) + 2 * MARGIN_BYTES, dtype=np.uint8)
        self.gpu.cuda.memcpy_dtoh(raw, self.alloc)
        return bool(np.all(raw[:MARGIN_BYTES] == 0xFF) and np.all(raw[-MARGIN_BYTES:] == 0xFF))

    def free(self) -> None:
        self.alloc.free()


def strided_upload(gpu, bits: np.ndarray, layout: str, pad: int):
    """Upload (b, s, h, d) or (t, h, d) element bits in a chosen memory layout.

    layout 'bshd' stores rows as given; 'bhsd' stores heads outermost (non-contiguous view);
    `pad` extra elements (a multiple of 8) end every row. Returns (buffer, strides in
    elements as (batch, row, head))."""
    if pad % 8:
        raise RunnerError("pad must be a multiple of 8 elements")
    varlen = bits.ndim == 3
    x = bits[None] if varlen else bits
    b, s, h, d = x.shape
    da = d + pad
    if layout == "bshd":
        store = np.full((b, s, h, da), 0xFFFF, dtype=np.uint16)
        store[..., :d] = x
        strides = (s * h * da, h * da, da)
    elif layout == "bhsd":
        store = np.full((b, h, s, da), 0xFFFF, dtype=np.uint16)
        store[..., :d] = x.transpose(0, 2, 1, 3)
        strides = (h * s * da, da, s * da)
    else:
        raise RunnerError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    buf = DeviceBuffer(gpu, store.nbytes)
    buf.upload(store)
    return buf, strides


class FwdKernel:
    """One compiled forward kernel: its host library (`generator.launch`) plus buffers."""

    def __init__(self, spec, lib_dir: Path | str | None = None) -> None:
        self.spec = spec
        self.name = kernel_name(spec)
        try:
            self.library = KernelLibrary(spec, lib_dir)
        except FileNotFoundError as e:
            raise RunnerError(str(e)) from None
        self.gpu = Gpu.get()
        self.smem = spec.smem_bytes
        self.threads = spec.threads

    def launch_raw(self, params: dict[str, Any], stream: int = 0) -> None:
        """Launch with explicit device pointers (fg_fwd_params fields) through the C
        launcher, which checks them and derives the grid, and wait for it."""
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
        philox_pointers: bool = False,
    ) -> FwdResult:
        """`philox_pointers`: pass seed and offset the graph-safe way (fg_fwd_params'
        philox_seed_ptr / philox_offset_ptr, part of the offset as philox_offset_add) and
        read back the pair the kernel recorded (`stats["philox_recorded"]`)."""
        spec = self.spec
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
        if not 0 <= int(seed) < 2**64:
            raise RunnerError(f"seed must be in [0, 2^64), got {seed}")
        if not 0 <= int(offset) < 2**32:
            raise RunnerError(
                f"offset must be in [0, 2^32) (the Philox counter's word), got {offset}"
            )
        dt = spec.dtype.yaml
        bits = {
            nm: to_dtype_bits(np.asarray(t, dtype=np.float32), dt)
            for nm, t in (("q", q), ("k", k), ("v", v))
        }
        inputs = {nm: from_dtype_bits(b_, dt) for nm, b_ in bits.items()}
        inputs.update(score_inputs(pb.score))
        gpu = self.gpu
        bufs: list[DeviceBuffer] = []
        try:
            params: dict[str, Any] = score_fields(gpu, pb.score, pb.heads, bufs)
            for nm in ("q", "k", "v"):
                buf, strides = strided_upload(gpu, bits[nm], memory_layout, pad)
                bufs.append(buf)
                params[nm] = buf.ptr
                (
                    params[f"{nm}_batch_stride"],
                    params[f"{nm}_row_stride"],
                    params[f"{nm}_head_stride"],
                ) = strides
            o_shape = q.shape
            o_buf = DeviceBuffer(gpu, int(np.prod(o_shape)) * 2)
            bufs.append(o_buf)
            params["o"] = o_buf.ptr
            if pb.varlen:
                params["o_batch_stride"] = 0
                params["o_row_stride"], params["o_head_stride"] = (
                    pb.heads * pb.head_dim,
                    pb.head_dim,
                )
                lse_shape = (pb.heads, q.shape[0])
                params["lse_batch_stride"], params["lse_head_stride"] = 0, q.shape[0]
            else:
                s = q.shape[1]
                params["o_batch_stride"] = s * pb.heads * pb.head_dim
                params["o_row_stride"], params["o_head_stride"] = (
                    pb.heads * pb.head_dim,
                    pb.head_dim,
                )
                lse_shape = (pb.batch, pb.heads, s)
                params["lse_batch_stride"], params["lse_head_stride"] = pb.heads * s, s
            lse_buf = DeviceBuffer(gpu, int(np.prod(lse_shape)) * 4)
            bufs.append(lse_buf)
            params["lse"] = lse_buf.ptr
            params.update(
                batch=pb.batch,
                heads=pb.heads,
                kv_heads=pb.kv_heads,
                seqlen_q=pb.seqlen_q,
                seqlen_k=pb.seqlen_k,
                head_dim=pb.head_dim,  # <name>_check compares them with the kernel's
                head_dim_v=pb.head_dim,
                softmax_scale=pb.scale,
                window_left=pb.window[0],
                window_right=pb.window[1],
                dropout_p=dropout_p,
                seed=int(seed) & (2**64 - 1),
                offset=int(offset),
            )
            rng_buf = None
            if philox_pointers:  # words: seed, offset - add (read); then the recorded pair
                add = int(offset) // 3
                rng_buf = DeviceBuffer(gpu, 32)
                rng_buf.upload(np.array([int(seed), int(offset) - add, 0, 0], dtype=np.uint64))
                bufs.append(rng_buf)
                params.update(
                    seed=0,
                    offset=0,
                    philox_seed_ptr=rng_buf.ptr,
                    philox_offset_ptr=rng_buf.ptr + 8,
                    philox_offset_add=add,
                    philox_seed_out=rng_buf.ptr + 16,
                    philox_offset_out=rng_buf.ptr + 24,
                )
            if pb.varlen:
                for nm, cu in (
                    ("cu_seqlens_q", pb.cu_seqlens_q),
                    ("cu_seqlens_k", pb.cu_seqlens_k),
                ):
                    buf = DeviceBuffer(gpu, cu.nbytes)
                    buf.upload(cu)
                    bufs.append(buf)
                    params[nm] = buf.ptr
                # rows of the packed tensors (the sm_90a forward's tensor maps span them)
                params["total_q"], params["total_k"] = q.shape[0], k.shape[0]
            keep_buf = None
            keep_shape = (pb.batch, pb.heads, pb.seqlen_q, pb.seqlen_k)
            if spec.debug_keep_mask:
                keep_buf = DeviceBuffer(gpu, int(np.prod(keep_shape)), fill=2)
                bufs.append(keep_buf)
                params["keep_mask"] = keep_buf.ptr
            if spec.sparse:
                lh = layout.full_count.shape[0]
                for nm in ("full_count", "full_idx", "part_count", "part_idx"):
                    arr = np.ascontiguousarray(getattr(layout, nm), dtype=np.int32)
                    buf = DeviceBuffer(gpu, arr.nbytes)
                    buf.upload(arr)
                    bufs.append(buf)
                    params[f"blk_{nm}"] = buf.ptr
                params["blk_layout_heads"] = lh
                params["blk_max_blocks"] = layout.full_idx.shape[-1]
            io_buf = None
            if spec.instrument_io:
                io_buf = DeviceBuffer(gpu, 8 * len(IO_TENSORS), fill=0)
                bufs.append(io_buf)
                params["io_counters"] = io_buf.ptr
            self.launch_raw(params)
            stats = {"margins_intact": all(b_.margins_intact() for b_ in (o_buf, lse_buf))}
            o = from_dtype_bits(o_buf.download(np.uint16, o_shape), dt)
            lse = lse_buf.download(np.float32, lse_shape)
            keep = keep_buf.download(np.uint8, keep_shape) if keep_buf is not None else None
            if keep_buf is not None:
                stats["margins_intact"] &= keep_buf.margins_intact()
            if rng_buf is not None:
                words = rng_buf.download(np.uint64, (4,))
                stats["philox_recorded"] = (int(words[2]), int(words[3]))
                stats["margins_intact"] &= rng_buf.margins_intact()
            io = None
            if io_buf is not None:
                raw = io_buf.download(np.uint64, (len(IO_TENSORS),))
                io = {nm: int(x) for nm, x in zip(IO_TENSORS, raw)}
            return FwdResult(
                o=o, lse=lse, inputs=inputs, keep_mask=keep, io=io, stats=stats, score=pb.score
            )
        finally:
            for b_ in bufs:
                b_.free()


def load_kernel(spec, lib_dir: Path | str | None = None) -> FwdKernel:
    """The kernel of `spec`, from `<lib_dir>/<name>.so` (`flashgen compile` output)."""
    return FwdKernel(spec, lib_dir)


def run(spec, q, k, v, **kwargs) -> FwdResult:
    """One-shot convenience: load the spec's kernel and run it (see FwdKernel.run)."""
    return load_kernel(spec).run(q, k, v, **kwargs)
