"""Context parallelism: ring and zigzag attention over `torch.distributed`.

    from flashgen.torch.distributed import ring_flash_attn_func, shard, unshard
    q_local, k_local, v_local = (shard(t, rank, world, "zigzag") for t in (q, k, v))
    out_local = ring_flash_attn_func(q_local, k_local, v_local, causal=True, layout="zigzag")

Each rank of a process group holds one slice of the sequence: q, k and v of the same
positions, `(batch, seqlen_local, heads, head_dim)` (k and v with `kv_heads` heads). K and V
travel once around the ring (rank r sends to r + 1 and receives from r - 1, modulo the world
size), the transfer of the next block overlapped with the attention of the current one; each
rank merges its partial outputs with their natural-log LSEs. The backward sends the dK/dV
accumulators (float32) around the ring behind K and V and accumulates dQ locally (float32).
docs/context_parallel.md has the algorithms, the exact masks of each block, what is merged in
what precision, what is refused and what has run.

Layouts of the global sequence of length `N = world * seqlen_local` over `W = world` ranks:

- "ring": rank r holds positions `[r * n, (r + 1) * n)`, n = seqlen_local (any n >= 0);
- "zigzag": the sequence is cut into 2W chunks of c = seqlen_local / 2 positions (seqlen_local
  even); rank r holds chunk r followed by chunk 2W - 1 - r. With causal=True every rank then
  does the same work (ring-flash-attention's load balancing).

`shard`, `unshard` and `positions` convert between the global sequence and the local slices.

The attention of one block is pluggable (`BlockKernels`): `FlashgenKernels` (the default)
calls the operators `torch.ops.flashgen.fwd` / `bwd` on CUDA; `ReferenceKernels` is plain
torch math in float64 (or float32) on any device, for tests. Partial results are merged with
`flashgen.torch.merge_states` at the end of the forward (fp32 inside; one launch, two for causal
zigzag, whose two halves of rows see different numbers of blocks) on CUDA, and with
`merge_partials` (the same formula in torch) otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist
from flashgen.torch.selection import UnsupportedCall
from torch import Tensor

__all__ = [
    "LAYOUTS",
    "BlockKernels",
    "FlashgenKernels",
    "ReferenceKernels",
    "block_schedule",
    "merge_partials",
    "positions",
    "ring_flash_attn_func",
    "shard",
    "unshard",
    "zigzag_ring_flash_attn_func",
]

LAYOUTS = ("ring", "zigzag")

# Which backend serves the point-to-point transfers of tensors on each device type.
_BACKENDS = {"cuda": ("nccl",), "cpu": ("gloo", "mpi")}

# Block kinds of the schedule (block_schedule): what rank r computes with the K/V of rank s.
DIAG = "diagonal"  # the local block: q x kv, causal (square, both alignments agree)
FULL = "full"  # q x kv, no mask
KV_FIRST = "kv_first_half"  # q x the first half of kv (zigzag, s < r), no mask
Q_SECOND = "q_second_half"  # the second half of q x kv (zigzag, s > r), no mask
SKIP = "skip"  # nothing visible (ring causal, s > r)

Result = Union[Tensor, tuple[Tensor, Tensor, None]]


# --------------------------------------------------------------------------------------------
# Block kernels.
# --------------------------------------------------------------------------------------------


@runtime_checkable
class BlockKernels(Protocol):
    """Attention of one block: the queries of this rank (or half of them) against one K/V
    block. Layouts are flash-attn's: q, out `(batch, seqlen_q, heads, head_dim)`; k, v
    `(batch, seqlen_k, kv_heads, head_dim)`, kv_heads dividing heads (query head h reads kv
    head `h // (heads // kv_heads)`); lse `(batch, heads, seqlen_q)`, natural log, float32
    (float64 from a float64 kernel). `causal` is bottom-right aligned (key j visible from
    query i iff `j <= i + seqlen_k - seqlen_q`); the ring passes causal=True only for square
    blocks. `scale` multiplies q . k before the softmax.
    """

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """(out, lse) of the block alone; rows that see no key: out 0, lse -inf."""
        ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of the block, given the GLOBAL (merged) out and lse of these query
        rows: P = exp(scale q k^T - lse) is then the block's slice of the global softmax and
        D = rowsum(dout * out) the global one. dk and dv are summed over each GQA group."""
        ...


class ReferenceKernels:
    """Block attention in plain torch at `dtype` (float64 by default; float32 also), on the
    inputs' device: scores, softmax and products all in `dtype`. Outputs are in `dtype`
    (out, lse, dq, dk, dv). Slow and memory-hungry (it materialises the scores); for tests."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"ReferenceKernels: dtype must be torch.float32 or float64, got {dtype}"
            )
        self.dtype = dtype

    def _scores(self, q: Tensor, k: Tensor, causal: bool, scale: float):
        group = q.shape[2] // k.shape[2]
        qf = q.to(self.dtype)
        kf = k.to(self.dtype).repeat_interleave(group, dim=2)
        s = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
        visible = None
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            i = torch.arange(sq, device=q.device)[:, None]
            j = torch.arange(sk, device=q.device)[None, :]
            visible = j <= i + (sk - sq)
            s = s.masked_fill(~visible, -math.inf)
        return qf, kf, s, group

    def _probabilities(self, s: Tensor, lse: Tensor) -> Tensor:
        # exp(s - lse); 0 where the row sees no key (lse -inf) or the key is masked (s -inf)
        finite = torch.isfinite(lse)[..., None]
        return torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        _, _, s, group = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # -inf on rows that see no key
        p = self._probabilities(s, lse)
        vf = v.to(self.dtype).repeat_interleave(group, dim=2)
        out = torch.einsum("bhij,bjhd->bihd", p, vf)
        return out, lse

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        qf, kf, s, group = self._scores(q, k, causal, scale)
        p = self._probabilities(s, lse.to(self.dtype))
        do = dout.to(self.dtype)
        vf = v.to(self.dtype).repeat_interleave(group, dim=2)
        dv = torch.einsum("bhij,bihd->bjhd", p, do)
        dp = torch.einsum("bihd,bjhd->bhij", do, vf)
        d_row = (do * out.to(self.dtype)).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
        ds = p * (dp - d_row[..., None])
        dq = torch.einsum("bhij,bjhd->bihd", ds, kf) * scale
        dk = torch.einsum("bhij,bihd->bjhd", ds, qf) * scale
        b, sk, hk, d = k.shape
        dk = dk.reshape(b, sk, hk, group, d).sum(3)
        dv = dv.reshape(b, sk, hk, group, v.shape[-1]).sum(3)
        return dq, dk, dv


class FlashgenKernels:
    """Block attention with flashgen's operators `torch.ops.flashgen.fwd` / `bwd` (CUDA,
    float16/bfloat16; flashgen.torch.flash_attn_func's rules). A head dim the kernels do not
    serve is zero-padded per block (a copy of the block's inputs) to the head dim
    flash_attn_func would pick: one that the forward and backward kernels both serve when
    `training` (the backward will run), else one the forward kernels serve. Views the kernels
    cannot read are copied. out and the gradients are in q's dtype, lse is float32.
    `deterministic` selects the deterministic backward kernel."""

    def __init__(self, deterministic: bool = False, training: bool = True) -> None:
        self.deterministic = bool(deterministic)
        self.training = bool(training)
        self._zero: Optional[Tensor] = None

    def _prepare(self, tensors: Sequence[Tensor], backward: bool) -> tuple[list[Tensor], int]:
        from flashgen.generator.spec import KernelKind
        from flashgen.torch import interface, ops, selection

        d = tensors[0].shape[-1]
        kinds = (KernelKind.FORWARD,)
        if backward or self.training:
            kinds = (KernelKind.FORWARD, KernelKind.BACKWARD)
        padded = d
        if tensors[0].device.type == "cuda":
            index = tensors[0].device.index
            if index is None:
                index = torch.cuda.current_device()
            padded = selection.padded_head_dim(int(d), ops._capability(index), kinds)
        out = []
        for t in tensors:
            if padded != d:
                t = torch.nn.functional.pad(t, (0, padded - d))
            out.append(interface._readable(t))
        return out, d

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        (q, k, v), d = self._prepare((q, k, v), backward=False)
        out, lse, _, _ = torch.ops.flashgen.fwd.default(
            q, k, v, None, None, 0, 0, 0.0, float(scale), bool(causal), -1, -1,
            self.deterministic,
        )  # fmt: skip
        return (out if out.shape[-1] == d else out[..., :d]), lse

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self._zero is None:
            self._zero = torch.zeros((), dtype=torch.int64)  # Philox seed and offset: no dropout
        (dout, q, k, v, out), d = self._prepare((dout, q, k, v, out), backward=True)
        dq, dk, dv, _ = torch.ops.flashgen.bwd.default(
            dout, q, k, v, out, lse.contiguous(), self._zero, self._zero, None, None, 0, 0,
            0.0, float(scale), bool(causal), -1, -1, self.deterministic,
        )  # fmt: skip
        if dq.shape[-1] != d:
            dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
        return dq, dk, dv


def _check_kernels(kernels: object) -> None:
    for name in ("forward", "backward"):
        if not callable(getattr(kernels, name, None)):
            raise TypeError(
                f"kernels must provide forward(q, k, v, causal, scale) and backward(dout, q, k, "
                f"v, out, lse, causal, scale) (flashgen.torch.distributed.BlockKernels); "
                f"{type(kernels).__name__} has no callable {name}"
            )


# --------------------------------------------------------------------------------------------
# Merging partial results.
# --------------------------------------------------------------------------------------------


def merge_partials(
    o_parts: Tensor, lse_parts: Tensor, out_dtype: Optional[torch.dtype] = None
) -> tuple[Tensor, Tensor]:
    """`flashgen.torch.merge_states`' formula in torch, on any device and dtype.

    `o_parts` `(parts, batch, seqlen_q, heads, head_dim)`, `lse_parts` `(parts, batch, heads,
    seqlen_q)` (natural log). Computes, in the wider of float32 and the inputs' dtypes,
    `lse = log sum_s exp(lse_s)` and `out = sum_s exp(lse_s - lse) o_s`; parts whose lse is
    -inf are skipped (their o is not read), a row that no part sees gives out 0 and lse -inf.
    Returns `(out, lse)`: out `(batch, seqlen_q, heads, head_dim)` in `out_dtype` (default
    o_parts' dtype), lse `(batch, heads, seqlen_q)` in the computation's dtype.
    """
    if o_parts.dim() != 5 or lse_parts.dim() != 4:
        raise ValueError(
            "o_parts must be (parts, batch, seqlen_q, heads, head_dim) and lse_parts (parts, "
            f"batch, heads, seqlen_q); got {tuple(o_parts.shape)} and {tuple(lse_parts.shape)}"
        )
    p, b, s, h, _ = o_parts.shape
    if tuple(lse_parts.shape) != (p, b, h, s):
        raise ValueError(
            f"lse_parts must be (parts, batch, heads, seqlen_q) = {(p, b, h, s)} for o_parts "
            f"{tuple(o_parts.shape)}; got {tuple(lse_parts.shape)}"
        )
    acc = torch.promote_types(torch.promote_types(o_parts.dtype, lse_parts.dtype), torch.float32)
    lse_p = lse_parts.to(acc)
    top = lse_p.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows no part sees
    w = torch.exp(lse_p - top)  # 0 for parts with lse -inf
    total = w.sum(dim=0)
    lse = top + torch.log(total)  # -inf where total is 0
    w = torch.where(total > 0, w / torch.where(total > 0, total, 1.0), 0.0)
    w = w.permute(0, 1, 3, 2)[..., None]  # (parts, batch, seqlen_q, heads, 1)
    out = torch.where(w > 0, w * o_parts.to(acc), 0.0).sum(dim=0)
    return out.to(out_dtype or o_parts.dtype), lse


def _merge(o_parts: Tensor, lse_parts: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """flashgen's merge_states kernel where it serves the call (CUDA, fp16/bf16/fp32 parts,
    float32 lse, an fp16/bf16 output), else merge_partials."""
    if (
        o_parts.device.type == "cuda"
        and o_parts.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and lse_parts.dtype == torch.float32
        and out_dtype in (torch.float16, torch.bfloat16)
    ):
        from flashgen.torch.kvcache import merge_states

        return merge_states(o_parts, lse_parts, out_dtype)
    return merge_partials(o_parts, lse_parts, out_dtype)


class _Merger:
    """Collects the forward's partial (out, lse) per row segment into one buffer each (the
    number of parts per segment is known from the schedule) and merges each once."""

    def __init__(self, segments: Sequence[tuple[int, int, int]]) -> None:
        self.segments = list(segments)  # (first row, end row, parts)
        self.bufs: list = [None] * len(self.segments)
        self.filled = [0] * len(self.segments)

    def add(self, out: Tensor, lse: Tensor, row0: int) -> None:
        for i, (start, stop, count) in enumerate(self.segments):
            if start < row0 or stop > row0 + out.shape[1]:
                continue
            o_seg = out[:, start - row0 : stop - row0]
            l_seg = lse[:, :, start - row0 : stop - row0]
            if count == 1:  # one part: it is the result (no buffer, no merge)
                self.bufs[i] = (o_seg, l_seg)
            else:
                if self.bufs[i] is None:
                    lse_dtype = torch.promote_types(lse.dtype, torch.float32)
                    self.bufs[i] = (
                        torch.empty((count, *o_seg.shape), dtype=out.dtype, device=out.device),
                        torch.empty((count, *l_seg.shape), dtype=lse_dtype, device=lse.device),
                    )
                o_buf, l_buf = self.bufs[i]
                o_buf[self.filled[i]].copy_(o_seg)
                l_buf[self.filled[i]].copy_(l_seg)
            self.filled[i] += 1

    def result(self, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        outs, lses = [], []
        for i, (start, stop, count) in enumerate(self.segments):
            if self.filled[i] != count:
                raise RuntimeError(
                    f"internal error: rows {start}..{stop} got {self.filled[i]} parts, "
                    f"expected {count}"
                )
            o, lse = self.bufs[i]
            if count == 1:
                o, lse = o.to(out_dtype), lse.to(torch.promote_types(lse.dtype, torch.float32))
            else:
                o, lse = _merge(o, lse, out_dtype)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0].contiguous(), lses[0].contiguous()
        return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


# --------------------------------------------------------------------------------------------
# Layouts and the schedule.
# --------------------------------------------------------------------------------------------


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout  # type: ignore[return-value]


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")


def positions(
    rank: int,
    world_size: int,
    seqlen_local: int,
    layout: str = "ring",
    device: Union[torch.device, str, None] = None,
) -> Tensor:
    """The global positions (int64 `(seqlen_local,)`, in order) of the tokens rank `rank`
    holds in `layout` (e.g. for rotary embeddings): "ring" `r*n .. r*n + n - 1`; "zigzag" chunk
    r then chunk 2W - 1 - r of c = n / 2 positions each (n even)."""
    _check_rank(rank, world_size)
    layout = _check_layout(layout)
    n = int(seqlen_local)
    if n < 0:
        raise ValueError(f"seqlen_local must be >= 0, got {seqlen_local}")
    if layout == "ring":
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    if n % 2:
        raise ValueError(f"layout 'zigzag' needs an even seqlen_local (two chunks), got {n}")
    c = n // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange(
        (2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c, device=device
    )
    return torch.cat([first, second])


def shard(x: Tensor, rank: int, world_size: int, layout: str = "ring", dim: int = 1) -> Tensor:
    """Rank `rank`'s slice of the global sequence `x` along `dim` (default 1, flash-attn's
    seqlen dimension), as a new contiguous tensor (differentiable). "ring": x's length along
    dim must be divisible by world_size; "zigzag": by 2 * world_size."""
    _check_rank(rank, world_size)
    layout = _check_layout(layout)
    n = x.shape[dim]
    parts = world_size if layout == "ring" else 2 * world_size
    if n % parts:
        raise ValueError(
            f"shard: layout {layout!r} over {world_size} ranks needs x.shape[{dim}] divisible by "
            f"{parts}, got {n}"
        )
    c = n // parts
    if layout == "ring":
        return x.narrow(dim, rank * c, c).clone(memory_format=torch.contiguous_format)
    second = (2 * world_size - 1 - rank) * c
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, second, c)], dim=dim)


def unshard(shards: Sequence[Tensor], layout: str = "ring", dim: int = 1) -> Tensor:
    """The global sequence from every rank's slice, `shards[r]` rank r's (what
    `torch.distributed.all_gather` returns): the inverse of `shard`. All shards must have one
    shape; "zigzag" needs an even length along `dim`."""
    layout = _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("unshard: shards is empty (one tensor per rank expected)")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"unshard: every shard must have one shape, got {sorted(shapes)}")
    if layout == "ring":
        return torch.cat(shards, dim=dim)
    n = shards[0].shape[dim]
    if n % 2:
        raise ValueError(f"unshard: layout 'zigzag' needs an even shard length, got {n}")
    firsts = [s.narrow(dim, 0, n // 2) for s in shards]
    seconds = [s.narrow(dim, n // 2, n // 2) for s in reversed(shards)]
    return torch.cat(firsts + seconds, dim=dim)


def block_schedule(rank: int, world_size: int, layout: str, causal: bool) -> list[tuple[int, str]]:
    """What rank `rank` computes at each ring step: `[(source, kind)]`, step i holding the
    K/V of rank `source = (rank - i) mod world_size`. Kinds: "diagonal" (step 0: q against
    its own kv, causal if `causal`; with causal=False the same as "full"), "full" (no mask),
    "skip" (nothing visible), and for zigzag "kv_first_half" (q against the first chunk of
    kv) and "q_second_half" (the second chunk of q against kv), both without a mask.

    ring, causal: source < rank is entirely in the past (full), source > rank entirely in the
    future (skip). zigzag, causal (chunks r, 2W-1-r against s, 2W-1-s): s < r sees chunk s
    from both of its chunks and chunk 2W-1-s from neither; s > r sees both chunks of s from
    chunk 2W-1-r only.
    """
    _check_rank(rank, world_size)
    layout = _check_layout(layout)
    steps = []
    for step in range(world_size):
        src = (rank - step) % world_size
        if step == 0:
            kind = DIAG if causal else FULL
        elif not causal:
            kind = FULL
        elif layout == "ring":
            kind = FULL if src < rank else SKIP
        else:
            kind = KV_FIRST if src < rank else Q_SECOND
        steps.append((src, kind))
    return steps


# --------------------------------------------------------------------------------------------
# The ring.
# --------------------------------------------------------------------------------------------

_KV_TAG, _DKV_TAG = 0, 1


class _Ring:
    """Point-to-point transfers to the next rank and from the previous one of `group`."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group = group
        self.world = world
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def start(self, tensors: Sequence[Tensor], tag: int):
        """Send `tensors` to the next rank and receive same-shaped ones from the previous;
        returns (received, works): the received tensors are valid after `wait(works)`."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag))
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


@dataclass(frozen=True)
class _Plan:
    ring: Optional[_Ring]  # None for a world of one
    rank: int
    world: int
    layout: str
    causal: bool
    scale: float
    steps: tuple[tuple[int, str], ...]
    segments: tuple[tuple[int, int, int], ...]  # (first row, end row, parts) of the merge
    half: int  # zigzag: the chunk length c (rows of one half)


def _segments(steps, seqlen: int, half: int) -> tuple[tuple[int, int, int], ...]:
    kinds = [kind for _, kind in steps]
    if Q_SECOND not in kinds:
        return ((0, seqlen, sum(kind != SKIP for kind in kinds)),)
    whole = sum(kind in (DIAG, FULL, KV_FIRST) for kind in kinds)
    return ((0, half, whole), (half, seqlen, whole + kinds.count(Q_SECOND)))


def _run_forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, kernels) -> tuple[Tensor, Tensor]:
    merger = _Merger(plan.segments)
    c, scale = plan.half, plan.scale
    for step, (_, kind) in enumerate(plan.steps):
        pending = None
        if step + 1 < plan.world:
            pending = plan.ring.start((k, v), _KV_TAG)
        if kind in (DIAG, FULL):
            merger.add(*_fwd_block(kernels, q, k, v, kind == DIAG, scale), 0)
        elif kind == KV_FIRST:
            merger.add(*_fwd_block(kernels, q, k[:, :c], v[:, :c], False, scale), 0)
        elif kind == Q_SECOND:
            merger.add(*_fwd_block(kernels, q[:, c:], k, v, False, scale), c)
        if pending is not None:
            (k, v), works = pending
            _Ring.wait(works)
    return merger.result(q.dtype)


def _fwd_block(kernels, q, k, v, causal, scale) -> tuple[Tensor, Tensor]:
    out, lse = kernels.forward(q, k, v, causal, scale)
    b, sq, h, _ = q.shape
    want_o, want_l = (b, sq, h, v.shape[-1]), (b, h, sq)
    if tuple(out.shape) != want_o or tuple(lse.shape) != want_l:
        raise ValueError(
            f"{type(kernels).__name__}.forward must return out {want_o} and lse {want_l} "
            f"(batch, heads, seqlen_q); got {tuple(out.shape)} and {tuple(lse.shape)}"
        )
    return out, lse


def _run_backward(plan: _Plan, dout, q, k, v, out, lse, kernels) -> tuple[Tensor, Tensor, Tensor]:
    c, scale = plan.half, plan.scale
    halves = None
    if any(kind == Q_SECOND for _, kind in plan.steps):
        halves = (dout[:, c:], q[:, c:], out[:, c:], lse[:, :, c:].contiguous())
    dq = dk = dv = None
    pending_dkv = None
    for step, (_, kind) in enumerate(plan.steps):
        pending_kv = None
        if step + 1 < plan.world:
            pending_kv = plan.ring.start((k, v), _KV_TAG)
        grads = None
        if kind in (DIAG, FULL):
            grads = kernels.backward(dout, q, k, v, out, lse, kind == DIAG, scale)
        elif kind == KV_FIRST:
            grads = kernels.backward(dout, q, k[:, :c], v[:, :c], out, lse, False, scale)
        elif kind == Q_SECOND:
            d1, q1, o1, l1 = halves
            grads = kernels.backward(d1, q1, k, v, o1, l1, False, scale)
        if step == 0:  # always a whole block: it starts the accumulators (float32 or wider)
            acc = torch.promote_types(grads[0].dtype, torch.float32)
            dq, dk, dv = (
                torch.empty(g.shape, dtype=acc, device=g.device).copy_(g) for g in grads
            )  # contiguous copies: dk, dv travel
        else:
            (dk, dv), works = pending_dkv  # the accumulators of this kv, from the previous rank
            _Ring.wait(works)
            if kind in (DIAG, FULL):
                dq += grads[0]
                dk += grads[1]
                dv += grads[2]
            elif kind == KV_FIRST:
                dq += grads[0]
                dk[:, :c] += grads[1]
                dv[:, :c] += grads[2]
            elif kind == Q_SECOND:
                dq[:, c:] += grads[0]
                dk += grads[1]
                dv += grads[2]
        if plan.world > 1:  # pass them on (after the last step: home, to the kv's owner)
            pending_dkv = plan.ring.start((dk, dv), _DKV_TAG)
        if pending_kv is not None:
            (k, v), works = pending_kv
            _Ring.wait(works)
    if pending_dkv is not None:
        (dk, dv), works = pending_dkv
        _Ring.wait(works)
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, kernels):
        out, lse = _run_forward(plan, q, k, v, kernels)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.kernels = plan, kernels
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _run_backward(ctx.plan, dout.contiguous(), q, k, v, out, lse, ctx.kernels)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


# --------------------------------------------------------------------------------------------
# Argument checks.
# --------------------------------------------------------------------------------------------


def _backend_names(group) -> dict[str, str]:
    """{device type: backend name} of a process group ("nccl" alone serves every device)."""
    text = str(dist.get_backend(group)).lower()
    if ":" not in text:
        return {"*": text}
    names = {}
    for item in text.split(","):
        device, _, backend = item.partition(":")
        names[device.strip()] = backend.strip()
    return names


def _check_backend(backends: dict[str, str], device_type: str) -> None:
    """Refuses a process group whose backend cannot move tensors of `device_type`: CUDA
    tensors need NCCL, CPU tensors gloo (or MPI). `backends`: {device type or "*": name}."""
    allowed = _BACKENDS.get(device_type)
    if allowed is None:
        raise UnsupportedCall(
            f"ring attention runs on {', '.join(sorted(_BACKENDS))} tensors; got a tensor on "
            f"{device_type}"
        )
    name = backends.get(device_type, backends.get("*"))
    if name not in allowed:
        raise UnsupportedCall(
            f"group: {device_type} tensors need a process group with the "
            f"{' or '.join(allowed)} backend for their transfers, got {name or 'none'} "
            f"(backends {backends})"
        )


_CHECKED: set = set()  # (group, signature) pairs every rank agreed on
_CHECKED_LIMIT = 1024
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _check_ranks_agree(group, signature: tuple[int, ...], device: torch.device, world: int) -> None:
    """One all_gather of this call's shapes and options (first call of each signature and
    group): every rank must call with the same ones, else all of them raise ValueError."""
    key = (group, signature)
    if key in _CHECKED:
        return
    mine = torch.tensor(signature, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [tuple(int(x) for x in t.tolist()) for t in every]
    if any(row != rows[0] for row in rows):
        dtypes = {code: str(t).removeprefix("torch.") for t, code in _DTYPE_CODES.items()}
        table = "; ".join(
            f"rank {r}: batch={b}, seqlen_local={n}, heads={h}, kv_heads={hk}, head_dim={d}, "
            f"dtype={dtypes.get(dt, 'other')}, layout={LAYOUTS[lay]}, causal={bool(c)}"
            for r, (b, n, h, hk, d, dt, lay, c) in enumerate(rows)
        )
        raise ValueError(
            "every rank of the group must call ring attention with the same shapes, dtype, "
            "layout and causal flag (each holds seqlen_local positions of one sequence); got "
            f"{table}"
        )
    if len(_CHECKED) >= _CHECKED_LIMIT:
        _CHECKED.clear()
    _CHECKED.add(key)


def _check_local(q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, seqlen_local, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    b, n, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[1] != n or k.shape[3] != d:
        raise ValueError(
            "k and v must be (batch, seqlen_local, kv_heads, head_dim) with q's batch, "
            f"seqlen_local and head_dim (each rank holds q, k, v of the same positions); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}"
        )
    hk = k.shape[2]
    if hk < 1 or h % hk:
        raise ValueError(f"kv_heads must divide heads (GQA/MQA), got heads {h}, kv_heads {hk}")
    if dropout_p != 0.0:
        raise UnsupportedCall(
            f"dropout_p: only 0.0 is supported by ring attention, got {dropout_p}"
        )
    if tuple(window_size) != (-1, -1):
        raise UnsupportedCall(
            f"window_size: only (-1, -1) (no sliding window) is supported by ring attention, "
            f"got {tuple(window_size)}"
        )
    if softcap != 0.0:
        raise UnsupportedCall(f"softcap: only 0.0 is supported by ring attention, got {softcap}")
    if alibi_slopes is not None:
        raise UnsupportedCall(
            "alibi_slopes: only None is supported by ring attention (the bias depends on global "
            "positions, which the block kernels do not take)"
        )
    layout = _check_layout(layout)
    if layout == "zigzag" and n % 2:
        raise ValueError(
            f"layout 'zigzag' needs an even seqlen_local (chunks r and 2W-1-r of equal length), "
            f"got {n}"
        )
    if softmax_scale is None:
        softmax_scale = d**-0.5 if d > 0 else 1.0
    softmax_scale = float(softmax_scale)
    if not (softmax_scale > 0.0) or math.isinf(softmax_scale):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return layout, softmax_scale


def _group_of(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring attention needs torch.distributed: call torch.distributed.init_process_group "
            "first (a group of one process is fine)"
        )
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group it was given")
    return group, rank, dist.get_world_size(group)


# --------------------------------------------------------------------------------------------
# The front end.
# --------------------------------------------------------------------------------------------


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    group=None,
    layout: str = "ring",
    kernels: Optional[BlockKernels] = None,
) -> Result:
    """Attention over a sequence split across the ranks of `group`, as flash_attn_func.

    Arguments:
        q: `(batch, seqlen_local, heads, head_dim)`, this rank's positions of the sequence
            (see `layout`); float16/bfloat16 on CUDA for the default kernels.
        k, v: `(batch, seqlen_local, kv_heads, head_dim)` of the same positions; kv_heads
            divides heads. Every rank passes the same shapes, dtype, layout and causal flag
            (checked with one all_gather at the first call of each signature).
        dropout_p: 0.0 only (refused otherwise).
        softmax_scale: scale of q . k before the softmax; default `1 / sqrt(head_dim)`.
        causal: key at global position j visible from the query at global position i iff
            `j <= i` (q and k share positions, so this is flash-attn's bottom-right mask of
            the whole sequence).
        window_size, softcap, alibi_slopes: only their defaults (-1, -1), 0.0, None.
        deterministic: the default kernels' deterministic backward; the order of the ring's
            accumulation is fixed, so with deterministic kernels the gradients are bitwise
            repeatable. Ignored when `kernels` is given (its kernels decide).
        return_attn_probs: also return the global LSE of this rank's rows, `(out, lse,
            None)` (as flashgen's flash_attn_func: the attention matrix is never built).
        group: the process group (default: the world); a CUDA tensor needs NCCL, a CPU one
            gloo. A group of one process computes plain attention.
        layout: "ring" (contiguous slices) or "zigzag" (chunks r and 2W-1-r of 2W; seqlen_local
            even). See `shard`.
        kernels: a `BlockKernels` (default `FlashgenKernels(deterministic, training)`,
            training when grad mode is on and q, k or v requires grad).

    Returns:
        out `(batch, seqlen_local, heads, head_dim)` in q's dtype; with return_attn_probs,
        `(out, lse, None)`, lse `(batch, heads, seqlen_local)` float32 (the natural-log LSE
        over every visible key of the whole sequence; float64 with float64 kernels), not
        differentiable. Differentiable in q, k and v (each rank gets the gradients of its
        own slices).

    Raises:
        UnsupportedCall (a ValueError) for dropout, a window, softcap, ALiBi, or a group whose
        backend cannot move the tensors; ValueError for mismatched shapes, dtypes or devices,
        kv_heads not dividing heads, an unknown layout, an odd seqlen_local with "zigzag",
        ranks whose calls differ; RuntimeError when torch.distributed is not initialised.
    """
    layout, scale = _check_local(
        q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes, layout
    )
    if kernels is None:
        training = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        )
        kernels = FlashgenKernels(deterministic, training)
    else:
        _check_kernels(kernels)
    group, rank, world = _group_of(group)
    _check_backend(_backend_names(group), q.device.type)
    b, n, h, d = q.shape
    signature = (b, n, h, k.shape[2], d, _DTYPE_CODES.get(q.dtype, 0), LAYOUTS.index(layout),
                 int(bool(causal)))  # fmt: skip
    if world > 1:
        _check_ranks_agree(group, signature, q.device, world)
    steps = tuple(block_schedule(rank, world, layout, bool(causal)))
    half = n // 2 if layout == "zigzag" else 0
    plan = _Plan(
        ring=_Ring(group, rank, world) if world > 1 else None,
        rank=rank,
        world=world,
        layout=layout,
        causal=bool(causal),
        scale=scale,
        steps=steps,
        segments=_segments(steps, n, half),
        half=half,
    )
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), plan, kernels)
    if return_attn_probs:
        return out, lse, None
    return out


def zigzag_ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    group=None,
    kernels: Optional[BlockKernels] = None,
) -> Result:
    """`ring_flash_attn_func(..., layout="zigzag")` (ring-flash-attention's name)."""
    return ring_flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, group=group, layout="zigzag", kernels=kernels,
    )  # fmt: skip
