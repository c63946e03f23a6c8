"""The backward's caller-carved workspace (fp32 dq_accum, fp32 dsum, int32 dq_sem): the one
layout the runners, flashgen.torch and the C launcher's `<name>_workspace_bytes` agree on."""

from __future__ import annotations

__all__ = ["WORKSPACE_ALIGN", "workspace_layout"]

WORKSPACE_ALIGN = 256  # bytes: each part starts on this boundary


def _round_up(n: int, align: int = WORKSPACE_ALIGN) -> int:
    return -(-int(n) // align) * align


def workspace_layout(
    batch: int,
    seqlen_q: int,
    heads: int,
    head_dim: int,
    *,
    block_m: int = 1,
    deterministic: bool = False,
) -> dict[str, int]:
    """Byte offsets of the caller-carved workspace: fp32 dq_accum at 0, fp32 dsum after it,
    then (deterministic builds) int32 dq_sem, one per (batch, head, query tile of `block_m`
    rows); each part rounded up to 256 bytes. 'bytes' is what `<name>_workspace_bytes` must
    return at least; 'dq_sem' is None without the third part."""
    rows = int(batch) * int(seqlen_q) * int(heads)
    dq_accum = _round_up(rows * int(head_dim) * 4)
    dsum = _round_up(rows * 4)
    sem = 0
    if deterministic:
        tiles = -(-int(seqlen_q) // int(block_m))
        sem = _round_up(int(batch) * int(heads) * tiles * 4)
    return {
        "dq_accum": 0,
        "dsum": dq_accum,
        "dq_sem": dq_accum + dsum if deterministic else None,
        "bytes": dq_accum + dsum + sem,
    }
