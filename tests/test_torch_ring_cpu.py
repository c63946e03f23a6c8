"""flashgen.torch.distributed (ring and zigzag attention) on CPU, without a GPU.

Rings of 2, 3 and 4 processes (torch.multiprocessing spawn, gloo over a FileStore in a
temporary folder, one spawn per world size shared by its tests) run `ring_flash_attn_func`
with the float64 reference block kernels, and separately with float32 ones, on slices of one
sequence; each rank gathers the outputs and the gradients (all_gather + `unshard`) and
compares them with single-process float64 attention over the whole sequence and its autograd
gradients: forward out and LSE, dq, dk, dv; causal and not, both layouts, GQA/MQA, odd head
dims, odd seqlen_local for "ring", groups of one process and two disjoint rings inside a
world of 4. Float64 must agree to 1e-10. Refusals across ranks (shapes or layouts that differ
between ranks, a process outside the group) must reach every rank as an error, never a hang
(each spawn has a deadline).

In this process: the block schedule against masks built from global positions, `shard` /
`unshard` / `positions` round trips, `merge_partials` against attention over the union of the
key sets, the reference backward against autograd, the backend rule, and every local refusal.
The GPU side (flashgen's kernels over NCCL) is tests/gpu/test_ring.py.
"""

from __future__ import annotations

import datetime
import json
import math
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from flashgen.torch import distributed as cp  # noqa: E402
from flashgen.torch.selection import UnsupportedCall  # noqa: E402

F64_TOL = 1e-10
F32_TOL = 2e-5
DEADLINE_S = 90  # per spawn: a hang fails the tests instead of blocking the suite


# -- the single-process reference ----------------------------------------------------------------


def reference_attention(q, k, v, causal: bool, scale: float):
    """Float64 softmax attention over the whole sequence (autograd-differentiable): out
    (b, n, h, d) and the natural-log LSE (b, h, n). causal: key j visible from query i iff
    j <= i (q and k share positions)."""
    group = q.shape[2] // k.shape[2]
    kr, vr = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kr) * scale
    if causal:
        n = q.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), vr)
    return out, lse


# -- cases run inside the rings ------------------------------------------------------------------

# name -> (layout, causal, batch, seqlen_local, heads, kv_heads, head_dim, kernel dtype, group)
CASES = {
    2: {
        "ring_causal_gqa_odd": ("ring", True, 2, 5, 4, 2, 7, "f64", "world"),
        "ring_full_mqa": ("ring", False, 1, 3, 3, 1, 5, "f64", "world"),
        "zigzag_causal": ("zigzag", True, 2, 6, 2, 2, 8, "f64", "world"),
        "zigzag_full_gqa": ("zigzag", False, 2, 4, 4, 2, 3, "f64", "world"),
        "ring_causal_f32": ("ring", True, 2, 7, 4, 2, 16, "f32", "world"),
        "zigzag_causal_f32": ("zigzag", True, 1, 8, 2, 1, 9, "f32", "world"),
        "self_ring_causal": ("ring", True, 2, 5, 2, 1, 4, "f64", "self"),
        "self_zigzag_causal": ("zigzag", True, 1, 6, 2, 2, 5, "f64", "self"),
    },
    3: {
        "ring_causal_odd": ("ring", True, 2, 5, 2, 1, 4, "f64", "world"),
        "ring_full": ("ring", False, 1, 2, 2, 2, 6, "f64", "world"),
        "zigzag_causal_gqa": ("zigzag", True, 2, 4, 6, 3, 5, "f64", "world"),
        "zigzag_full_one_row_chunks": ("zigzag", False, 1, 2, 1, 1, 4, "f64", "world"),
        "zigzag_causal_f32": ("zigzag", True, 1, 6, 2, 2, 8, "f32", "world"),
    },
    4: {
        "ring_causal": ("ring", True, 1, 3, 2, 2, 4, "f64", "world"),
        "zigzag_causal_mqa": ("zigzag", True, 2, 2, 4, 1, 6, "f64", "world"),
        "pairs_zigzag_causal": ("zigzag", True, 1, 4, 2, 1, 3, "f64", "pairs"),
        "pairs_ring_full": ("ring", False, 2, 3, 2, 2, 5, "f64", "pairs"),
    },
}

# refusals run inside the ring of 2: name -> what every rank's error message must contain
REFUSALS = {
    "seqlen_differs_across_ranks": "same shapes",
    "layout_differs_across_ranks": "same shapes, dtype, layout",
    "not_a_member_of_the_group": "not a member",
}


def _groups(rank: int, world: int) -> dict:
    """Every group any case uses (all ranks create all of them, in one order)."""
    selfs = [dist.new_group([r]) for r in range(world)]
    groups = {"world": (dist.group.WORLD, rank, world, 0), "self": (selfs[rank], 0, 1, rank)}
    if world == 4:
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        # (group, rank in it, its size, which sequence: each ring has its own)
        groups["pairs"] = (pairs[rank % 2], rank // 2, 2, rank % 2)
    groups["rank0_only"] = selfs[0]
    return groups


def _gather(t, group, size: int, layout: str, dim: int = 1):
    if size == 1:
        return t
    every = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(every, t.contiguous(), group=group)
    return cp.unshard(every, layout, dim=dim)


def _run_case(spec, groups) -> dict:
    layout, causal, b, n, h, hk, d, kdt, which = spec
    group, rank, size, seq = groups[which]
    dtype = torch.float64 if kdt == "f64" else torch.float32
    gen = torch.Generator().manual_seed(1000 * seq + 17 * n + d)
    shape_q, shape_k = (b, n * size, h, d), (b, n * size, hk, d)
    full = [torch.randn(s, generator=gen, dtype=torch.float64) for s in (shape_q, shape_k, shape_k)]
    dout = torch.randn(shape_q, generator=gen, dtype=torch.float64)
    scale = 0.7 / math.sqrt(d)  # not the default: the scale must reach every block

    ref = [t.clone().requires_grad_() for t in full]
    o64, lse64 = reference_attention(*ref, causal, scale)
    g64 = torch.autograd.grad(o64, ref, dout)

    local = [cp.shard(t, rank, size, layout).to(dtype).requires_grad_() for t in full]
    before = [t.detach().clone() for t in local]
    kernels = cp.ReferenceKernels(dtype)
    kw = dict(causal=causal, softmax_scale=scale, group=group, layout=layout, kernels=kernels)
    out, lse, none = cp.ring_flash_attn_func(*local, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, local, cp.shard(dout, rank, size, layout).to(dtype))
    again = cp.ring_flash_attn_func(*local, **kw)  # same call: bitwise the same output

    errors = {
        "out": (_gather(out, group, size, layout) - o64).abs().max().item(),
        "lse": (_gather(lse, group, size, layout, dim=2) - lse64).abs().max().item(),
    }
    for name, g, r in zip(("dq", "dk", "dv"), grads, g64):
        errors[name] = (_gather(g, group, size, layout) - r).abs().max().item()
    return {
        "errors": errors,
        "repeat_equal": bool(torch.equal(again, out)),
        "inputs_untouched": all(torch.equal(a, b_) for a, b_ in zip(local, before)),
        "dtypes": [str(t.dtype) for t in (out, *grads)],
        "lse_dtype": str(lse.dtype),
        "third": none is None,
    }


def _refusal(name: str, rank: int, groups) -> str:
    """The message of the error this rank got (or 'no error')."""
    x = torch.randn(1, 4, 2, 4, dtype=torch.float64)
    kernels = cp.ReferenceKernels()
    try:
        if name == "seqlen_differs_across_ranks":
            y = torch.randn(1, 4 + 2 * rank, 2, 3, dtype=torch.float64)  # head_dim 3: unseen
            cp.ring_flash_attn_func(y, y, y, causal=True, kernels=kernels)
        elif name == "layout_differs_across_ranks":
            layout = "ring" if rank == 0 else "zigzag"
            y = torch.randn(1, 4, 2, 6, dtype=torch.float64)  # head_dim 6: unseen
            cp.ring_flash_attn_func(y, y, y, causal=True, layout=layout, kernels=kernels)
        elif name == "not_a_member_of_the_group":
            group = groups["rank0_only"]
            out = cp.ring_flash_attn_func(x, x, x, group=group, kernels=kernels)
            if rank == 0:  # the member computes plain attention of its own slice
                want, _ = reference_attention(x, x, x, False, 0.5)
                return "member ok" if (out - want).abs().max() < F64_TOL else "member wrong"
        else:
            return f"unknown refusal {name}"
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=DEADLINE_S // 3),
    )
    results: dict = {"cases": {}, "refusals": {}}
    try:
        groups = _groups(rank, world)
        for name, spec in CASES[world].items():
            try:
                results["cases"][name] = _run_case(spec, groups)
            except Exception:  # noqa: BLE001 - reported by the test of this case
                results["cases"][name] = {"exception": traceback.format_exc()}
        if world == 2:
            for name in REFUSALS:
                results["refusals"][name] = _refusal(name, rank, groups)
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _spawn(world: int, tmp: Path) -> list[dict]:
    ctx = mp.start_processes(
        _worker,
        args=(world, str(tmp / "store"), str(tmp)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            deadline -= 1
            if deadline <= 0:
                raise AssertionError(f"the ring of {world} did not finish in {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


_RESULTS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def rings(tmp_path_factory):
    def get(world: int) -> list[dict]:
        if world not in _RESULTS:
            _RESULTS[world] = _spawn(world, tmp_path_factory.mktemp(f"ring{world}"))
        return _RESULTS[world]

    return get


CASE_IDS = [(w, name) for w, cases in CASES.items() for name in cases]


@pytest.mark.parametrize(("world", "name"), CASE_IDS, ids=[f"w{w}-{n}" for w, n in CASE_IDS])
def test_forward_lse_and_gradients_match_full_sequence_attention(rings, world, name):
    tol = F64_TOL if CASES[world][name][7] == "f64" else F32_TOL
    dtype = "torch.float64" if CASES[world][name][7] == "f64" else "torch.float32"
    for rank, res in enumerate(rings(world)):
        got = res["cases"][name]
        assert "exception" not in got, f"rank {rank}:\n{got['exception']}"
        for what, err in got["errors"].items():
            assert err <= tol, f"rank {rank}: {what} differs by {err:.3g} (> {tol})"
        assert got["repeat_equal"], f"rank {rank}: a second identical call differs"
        assert got["inputs_untouched"], f"rank {rank}: q, k or v was modified"
        assert got["dtypes"] == [dtype] * 4 and got["lse_dtype"] == dtype and got["third"]


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_across_ranks_reach_every_rank(rings, name):
    messages = [res["refusals"][name] for res in rings(2)]
    if name == "not_a_member_of_the_group":
        assert messages[0] == "member ok"
        assert REFUSALS[name] in messages[1], messages[1]
        return
    for rank, msg in enumerate(messages):
        assert REFUSALS[name] in msg, f"rank {rank}: {msg}"
        assert "rank 0:" in msg and "rank 1:" in msg  # the table of what each rank passed


# -- in this process -----------------------------------------------------------------------------


def _visible(rank, src, world, n, layout, causal):
    qp = cp.positions(rank, world, n, layout)
    kp = cp.positions(src, world, n, layout)
    if not causal:
        return torch.ones(n, n, dtype=torch.bool)
    return kp[None, :] <= qp[:, None]


def _kind_mask(kind, n):
    c = n // 2
    m = torch.zeros(n, n, dtype=torch.bool)
    if kind == "diagonal":
        return torch.ones(n, n, dtype=torch.bool).tril()
    if kind == "full":
        m[:] = True
    elif kind == "kv_first_half":
        m[:, :c] = True
    elif kind == "q_second_half":
        m[c:, :] = True
    return m


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_block_schedule_is_the_mask_of_global_positions(layout, causal):
    """Every (rank, step) block's kind is exactly the visibility of the global positions of
    the rank's queries against the source's keys, and every source appears once."""
    for world in range(1, 7):
        for n in (2, 4, 6):
            for rank in range(world):
                steps = cp.block_schedule(rank, world, layout, causal)
                assert sorted(s for s, _ in steps) == list(range(world))
                for step, (src, kind) in enumerate(steps):
                    assert src == (rank - step) % world
                    want = _visible(rank, src, world, n, layout, causal)
                    if kind == "diagonal" and not causal:
                        raise AssertionError("diagonal without causal")
                    assert torch.equal(_kind_mask(kind, n), want), (world, n, rank, step, kind)


def _work(layout: str, rank: int, world: int, n: int = 4) -> int:
    """Visible (query, key) pairs rank `rank` computes over the whole ring."""
    steps = cp.block_schedule(rank, world, layout, True)
    return sum(int(_kind_mask(kind, n).sum()) for _, kind in steps)


def test_zigzag_balances_the_causal_work_and_ring_does_not():
    for world in (2, 3, 4, 8):
        assert len({_work("zigzag", r, world) for r in range(world)}) == 1
        assert _work("ring", world - 1, world) > _work("ring", 0, world)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_shard_unshard_round_trip_exactly_and_match_positions(layout):
    for world in range(1, 6):
        for dim in (1, 2):
            shape = [2, 3, 4, 5]
            shape[dim] = 2 * world * 3
            x = torch.randn(shape, dtype=torch.float64)
            shards = [cp.shard(x, r, world, layout, dim=dim) for r in range(world)]
            assert all(s.is_contiguous() for s in shards)
            assert torch.equal(cp.unshard(shards, layout, dim=dim), x)
            n = shards[0].shape[dim]
            pos = torch.arange(shape[dim])
            for r, s in enumerate(shards):
                p = cp.positions(r, world, n, layout)
                assert torch.equal(s, x.index_select(dim, p))
                assert torch.equal(cp.shard(pos, r, world, layout, dim=0), p)


def test_zigzag_positions_are_chunks_r_and_2w_minus_1_minus_r():
    assert cp.positions(0, 2, 4, "zigzag").tolist() == [0, 1, 6, 7]
    assert cp.positions(1, 2, 4, "zigzag").tolist() == [2, 3, 4, 5]
    assert cp.positions(1, 3, 2, "zigzag").tolist() == [1, 4]
    assert cp.positions(2, 3, 3, "ring").tolist() == [6, 7, 8]


def test_shard_unshard_and_positions_refuse_what_they_cannot_split():
    x = torch.zeros(1, 6, 1, 1)
    with pytest.raises(ValueError, match=r"divisible by 4, got 6"):
        cp.shard(x, 0, 2, "zigzag")
    with pytest.raises(ValueError, match=r"divisible by 4, got 6"):
        cp.shard(x, 0, 4, "ring")
    with pytest.raises(ValueError, match="rank must be an int in 0..1"):
        cp.shard(x, 2, 2)
    with pytest.raises(ValueError, match="layout must be one of 'ring', 'zigzag'"):
        cp.shard(x, 0, 2, "stripe")
    with pytest.raises(ValueError, match="one shape"):
        cp.unshard([torch.zeros(1, 2), torch.zeros(1, 4)])
    with pytest.raises(ValueError, match="even shard length"):
        cp.unshard([torch.zeros(1, 3)] * 2, "zigzag")
    with pytest.raises(ValueError, match="even seqlen_local"):
        cp.positions(0, 2, 3, "zigzag")


def test_merge_partials_of_key_subsets_is_attention_over_their_union():
    torch.manual_seed(0)
    ref = cp.ReferenceKernels()
    q = torch.randn(2, 5, 4, 6, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 6, dtype=torch.float64) * 3  # sharp scores
    v = torch.randn(2, 9, 2, 6, dtype=torch.float64)
    whole_o, whole_l = ref.forward(q, k, v, False, 0.4)
    cuts = [(0, 2), (2, 3), (3, 9)]
    parts = [ref.forward(q, k[:, a:b], v[:, a:b], False, 0.4) for a, b in cuts]
    o, lse = cp.merge_partials(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    )
    assert (o - whole_o).abs().max() < 1e-13 and (lse - whole_l).abs().max() < 1e-13
    assert o.dtype == torch.float64 and lse.dtype == torch.float64


def test_merge_partials_skips_parts_with_minus_inf_lse_and_empty_rows_give_zero():
    o = torch.randn(3, 1, 2, 1, 4)
    lse = torch.full((3, 1, 1, 2), -math.inf)
    lse[1, 0, 0, 0] = 0.5
    o[0] = math.nan  # never read: its lse is -inf everywhere
    out, merged = cp.merge_partials(o, lse)
    assert torch.equal(out[0, 0, 0], o[1, 0, 0, 0]) and merged[0, 0, 0] == 0.5
    assert torch.equal(out[0, 1], torch.zeros(1, 4)) and merged[0, 0, 1] == -math.inf
    out16, l32 = cp.merge_partials(o.to(torch.bfloat16), lse)
    assert out16.dtype == torch.bfloat16 and l32.dtype == torch.float32
    with pytest.raises(ValueError, match=r"lse_parts must be \(parts, batch, heads, seqlen_q\)"):
        cp.merge_partials(o, lse.transpose(2, 3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(4, 4), (6, 3), (3, 6)])
def test_reference_backward_is_autograd_of_the_reference_forward(causal, sq, sk):
    """With its own lse (one block holds every key) the block backward is the gradient;
    bottom-right causal with sq > sk has rows that see no key (out 0, lse -inf)."""
    torch.manual_seed(1)
    ref = cp.ReferenceKernels()
    q = torch.randn(2, sq, 4, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, 2, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, 2, 5, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, sq, 4, 5, dtype=torch.float64)
    out, lse = ref.forward(q, k, v, causal, 0.6)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mine = ref.backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal, 0.6)
    for g, m in zip(grads, mine):
        assert (g - m).abs().max() < 1e-12
    if causal and sq > sk:
        assert torch.isneginf(lse[:, :, : sq - sk]).all()
        assert torch.equal(out[:, : sq - sk], torch.zeros_like(out[:, : sq - sk]))


def test_backend_rule_cuda_needs_nccl_and_cpu_gloo():
    check = cp._check_backend
    check({"*": "nccl"}, "cuda")
    check({"*": "gloo"}, "cpu")
    check({"cpu": "gloo", "cuda": "nccl"}, "cuda")
    check({"cpu": "gloo", "cuda": "nccl"}, "cpu")
    with pytest.raises(UnsupportedCall, match="cuda tensors need a process group with the nccl"):
        check({"*": "gloo"}, "cuda")
    with pytest.raises(UnsupportedCall, match="cpu tensors need .* gloo or mpi backend"):
        check({"*": "nccl"}, "cpu")
    with pytest.raises(UnsupportedCall, match="got a tensor on xpu"):
        check({"*": "xccl"}, "xpu")


def _x(*shape, dtype=torch.float64):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((_x(1, 4, 2, 8),) * 3, {"dropout_p": 0.1}, UnsupportedCall, "dropout_p: only 0.0"),
        ((_x(1, 4, 2, 8),) * 3, {"window_size": (3, 0)}, UnsupportedCall, r"window_size: only"),
        ((_x(1, 4, 2, 8),) * 3, {"softcap": 30.0}, UnsupportedCall, "softcap: only 0.0"),
        ((_x(1, 4, 2, 8),) * 3, {"alibi_slopes": _x(2)}, UnsupportedCall, "alibi_slopes: only"),
        ((_x(1, 4, 2, 8),) * 3, {"layout": "stripe"}, ValueError, "layout must be one of"),
        ((_x(1, 5, 2, 8),) * 3, {"layout": "zigzag"}, ValueError, "even seqlen_local.*got 5"),
        ((_x(1, 4, 3, 8), _x(1, 4, 2, 8), _x(1, 4, 2, 8)), {}, ValueError, "kv_heads must divide"),
        (
            (_x(1, 4, 2, 8), _x(1, 4, 2, 8, dtype=torch.float32), _x(1, 4, 2, 8)),
            {},
            ValueError,
            "one dtype",
        ),
        ((_x(1, 4, 2, 8), _x(1, 6, 2, 8), _x(1, 6, 2, 8)), {}, ValueError, "seqlen_local"),
        ((_x(1, 4, 2, 8), _x(1, 4, 2, 4), _x(1, 4, 2, 4)), {}, ValueError, "head_dim"),
        ((_x(4, 2, 8),) * 3, {}, ValueError, r"\(batch, seqlen_local, heads, head_dim\)"),
        ((_x(1, 4, 2, 8),) * 3, {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ((_x(1, 4, 2, 8),) * 3, {"kernels": object()}, TypeError, "no callable forward"),
    ],
)
def test_local_refusals_name_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        cp.ring_flash_attn_func(*args, **kwargs)


def test_without_init_process_group_the_call_says_so():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    x = _x(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.ring_flash_attn_func(x, x, x, kernels=cp.ReferenceKernels())


def test_default_kernels_refuse_cpu_tensors_with_flashgens_message():
    x = _x(1, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedCall, match="CUDA devices only"):
        cp.FlashgenKernels().forward(x, x, x, True, 0.3)
