"""flashgen.torch.distributed on 2 GPUs over NCCL: ring and zigzag attention with flashgen's
kernels against the float64 reference and against flashgen's single-GPU flash_attn_func on
the whole sequence, by the FlashAttention pass rule of verify/passrule.py.

This process builds each case's inputs (bf16/fp16 values), runs flash_attn_func on the whole
sequence on GPU 0 (which also compiles every kernel the ring needs into the kernel cache, so
the ranks do not compile concurrently), then spawns 2 ranks (torch.multiprocessing, NCCL over
a FileStore, NVLink multicast off: NCCL_NVLS_ENABLE=0). Each rank runs its slice with the
default kernels (`FlashgenKernels`, merges by `merge_states`), gathers out, LSE and the
gradients (all_gather + `unshard`); rank 0 writes them. Here then, for each case:

- O, LSE, dq, dk, dv of the ring within the pass rule against standard attention in the dtype
  (verify.baseline; the gradients' reference and baseline fed the ring's own O and LSE, with
  tests/gpu/test_backward.py's float32 dS floors), as every flashgen kernel is judged;
- the same outputs within the pass rule with flashgen's single-GPU result as the baseline
  (error at most twice flash_attn_func's on the whole sequence plus the floor);
- with deterministic=True, two identical calls give bitwise equal gradients;
- a gloo group with CUDA tensors, and an NCCL group with CPU tensors, are refused on every
  rank.

Skips unless torch sees at least 2 CUDA devices and NCCL is available (and, like the whole GPU
suite, without PyCUDA). Run: `pytest tests/gpu/test_ring.py` on a machine with 2 GPUs.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("ring attention over NCCL needs 2 CUDA devices", allow_module_level=True)
import torch.distributed as dist  # noqa: E402

if not (dist.is_available() and dist.is_nccl_available()):
    pytest.skip("this torch build has no NCCL backend", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from flashgen.torch import distributed as cp  # noqa: E402

WORLD = 2
DEADLINE_S = 600  # the whole spawn: kernels are compiled beforehand, in this process
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# name -> (layout, causal, batch, seqlen_total, heads, kv_heads, head_dim, dtype, deterministic)
CASES = {
    "ring_causal_gqa_odd_local": ("ring", True, 2, 2 * 257, 4, 2, 64, "bf16", False),
    "ring_full_d128": ("ring", False, 1, 2 * 300, 4, 4, 128, "bf16", False),
    "zigzag_causal_mqa_d128": ("zigzag", True, 2, 4 * 128, 4, 1, 128, "bf16", False),
    "zigzag_causal_odd_chunks_fp16": ("zigzag", True, 1, 4 * 65, 2, 2, 64, "fp16", False),
    "zigzag_full": ("zigzag", False, 1, 4 * 100, 4, 2, 64, "bf16", False),
    "ring_causal_padded_head_dim": ("ring", True, 1, 2 * 200, 2, 2, 59, "bf16", False),
    "zigzag_causal_deterministic": ("zigzag", True, 1, 4 * 96, 4, 2, 64, "bf16", True),
}
OUTPUTS = ("o", "lse", "dq", "dk", "dv")


def _inputs(name: str) -> dict[str, np.ndarray]:
    """Whole-sequence q, k, v, dout: float32 arrays holding values of the case's dtype."""
    _, _, b, n, h, hk, d, dtype, _ = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    shapes = {"q": (b, n, h, d), "k": (b, n, hk, d), "v": (b, n, hk, d), "dout": (b, n, h, d)}
    out = {}
    for key, shape in shapes.items():
        x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        out[key] = x.to(DTYPES[dtype]).float().numpy()
    return out


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


# -- the ranks -----------------------------------------------------------------------------------


def _gather(t, layout: str, dim: int = 1):
    every = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(every, t.contiguous())
    return cp.unshard(every, layout, dim=dim)


def _run_case(name: str, rank: int, dev, in_dir: Path) -> dict:
    layout, causal, *_, dtype, deterministic = CASES[name]
    arrays = np.load(in_dir / f"{name}.npz")
    local = {
        key: cp.shard(torch.from_numpy(arrays[key]), rank, WORLD, layout).to(dev, DTYPES[dtype])
        for key in ("q", "k", "v", "dout")
    }
    q, k, v = (local[key].requires_grad_() for key in ("q", "k", "v"))
    kw = dict(causal=causal, layout=layout, deterministic=deterministic)
    out, lse, _ = cp.ring_flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), local["dout"])
    result = {"repeat_bitwise": None}
    if deterministic:
        out2 = cp.ring_flash_attn_func(q, k, v, **kw)
        grads2 = torch.autograd.grad(out2, (q, k, v), local["dout"])
        same = all(torch.equal(a, b) for a, b in zip((out, *grads), (out2, *grads2)))
        result["repeat_bitwise"] = bool(same)
    gathered = [_gather(out, layout), _gather(lse, layout, dim=2)]
    gathered += [_gather(g, layout) for g in grads]
    result["arrays"] = {key: _np(t) for key, t in zip(OUTPUTS, gathered)}
    return result


def _refusals(rank: int, dev) -> dict:
    """Messages of the calls whose backend cannot move their tensors (every rank)."""
    gloo = dist.new_group(backend="gloo")
    x = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device=dev)
    found = {}
    for what, args, group in (
        ("cuda_on_gloo", (x, x, x), gloo),
        ("cpu_on_nccl", (x.cpu(),) * 3, None),
    ):
        try:
            cp.ring_flash_attn_func(*args, group=group)
            found[what] = "no error"
        except ValueError as e:
            found[what] = str(e)
    return found


def _worker(rank: int, store: str, in_dir: str, out_dir: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=DEADLINE_S // 2),
    )
    summary: dict = {"cases": {}, "refusals": {}}
    try:
        for name in CASES:
            try:
                res = _run_case(name, rank, dev, Path(in_dir))
                if rank == 0:
                    np.savez(Path(out_dir) / f"{name}.npz", **res.pop("arrays"))
                summary["cases"][name] = {k: v for k, v in res.items() if k != "arrays"}
            except Exception:  # noqa: BLE001 - reported by the case's test
                summary["cases"][name] = {"exception": traceback.format_exc()}
        summary["refusals"] = _refusals(rank, dev)
        dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))
        dist.destroy_process_group()


# -- this process --------------------------------------------------------------------------------


def _single_gpu(name: str, arrays: dict) -> dict[str, np.ndarray]:
    """flashgen's flash_attn_func on the whole sequence on GPU 0: O, LSE and gradients. Also
    compiles (or finds) the kernels the ring's blocks use: causal and not, this dtype, head
    dim and GQA, deterministic or not, and the merge kernel."""
    from flashgen.torch import flash_attn_func, merge_states

    _, causal, b, _, h, hk, d, dtype, deterministic = CASES[name]
    dev = torch.device("cuda", 0)
    q, k, v, dout = (
        torch.from_numpy(arrays[key]).to(dev, DTYPES[dtype]) for key in ("q", "k", "v", "dout")
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, _ = flash_attn_func(
        q, k, v, causal=causal, deterministic=deterministic, return_attn_probs=True
    )
    grads = torch.autograd.grad(out, (q, k, v), dout)
    small = [t.detach()[:, :16].contiguous().requires_grad_() for t in (q, k, v)]
    for c in (True, False):  # the ring's block kinds: the diagonal causal, the rest full
        o = flash_attn_func(*small, causal=c, deterministic=deterministic)
        torch.autograd.grad(o, small, torch.ones_like(o))
    merge_states(
        torch.zeros(2, b, 8, h, d, dtype=DTYPES[dtype], device=dev),
        torch.zeros(2, b, h, 8, device=dev),
    )
    torch.cuda.synchronize()
    return {key: _np(t) for key, t in zip(OUTPUTS, (out, lse, *grads))}


def _spawn(tmp: Path) -> list[dict]:
    ctx = mp.start_processes(
        _worker,
        args=(str(tmp / "store"), str(tmp), str(tmp)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    left = DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            left -= 1
            if left <= 0:
                raise AssertionError(f"the ring of {WORLD} GPUs did not finish in {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ring_gpu")
    inputs, single = {}, {}
    for name in CASES:
        inputs[name] = _inputs(name)
        np.savez(tmp / f"{name}.npz", **inputs[name])
        single[name] = _single_gpu(name, inputs[name])
    ranks = _spawn(tmp)
    return {"tmp": tmp, "inputs": inputs, "single": single, "ranks": ranks}


def _ring_arrays(ring, name: str) -> dict[str, np.ndarray]:
    for rank, res in enumerate(ring["ranks"]):
        got = res["cases"][name]
        assert "exception" not in got, f"rank {rank}:\n{got['exception']}"
    with np.load(ring["tmp"] / f"{name}.npz") as f:
        return {key: f[key] for key in OUTPUTS}


def _judge(name: str, inputs: dict, ours: dict, against: str, single=None) -> dict:
    """Pass-rule verdicts of O, LSE, dq, dk, dv; `against` "baseline" (standard attention in
    the dtype, gradients fed ours' O and LSE) or "single" (flashgen's single-GPU result,
    gradients against the reference fed the exact O and LSE)."""
    from flashgen.verify import baseline, passrule, reference

    from .test_backward import gradient_floors

    _, causal, *_, dtype, _ = CASES[name]
    kw = {"causal": "bottom_right" if causal else "none"}
    q, k, v, dout = (inputs[key] for key in ("q", "k", "v", "dout"))
    o64, lse64 = reference.attention_forward(q, k, v, **kw)
    lse_floor = passrule.score_floor(q, k, 1.0 / float(np.sqrt(q.shape[-1])))
    if against == "baseline":
        ob, lseb = baseline.attention_forward(q, k, v, dtype=dtype, **kw)
        args = (q, k, v, ours["o"], ours["lse"], dout)
        grads64 = reference.attention_backward(*args, **kw)
        base = baseline.attention_backward(*args, dtype=dtype, **kw)
    else:
        ob, lseb = single["o"], single["lse"]
        args = (q, k, v, o64, lse64, dout)
        grads64 = reference.attention_backward(*args, **kw)
        base = (single["dq"], single["dk"], single["dv"])
    floors = gradient_floors(args, **kw)
    found = {
        "o": passrule.check(ours["o"], o64, ob, dtype),
        "lse": passrule.check(ours["lse"], lse64, lseb, "fp32", extra_floor=lse_floor),
    }
    for key, r, b_ in zip(("dq", "dk", "dv"), grads64, base):
        found[key] = passrule.check(ours[key], r, b_, dtype, extra_floor=floors[key])
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_ring_is_within_the_pass_rule_of_standard_attention(ring, name):
    ours = _ring_arrays(ring, name)
    for key, verdict in _judge(name, ring["inputs"][name], ours, "baseline").items():
        assert verdict.passed, f"{name} {key}: {verdict.message}"


@pytest.mark.parametrize("name", list(CASES))
def test_ring_error_is_at_most_twice_the_single_gpu_kernels(ring, name):
    ours = _ring_arrays(ring, name)
    found = _judge(name, ring["inputs"][name], ours, "single", ring["single"][name])
    for key, verdict in found.items():
        assert verdict.passed, f"{name} {key} against flash_attn_func: {verdict.message}"


def test_deterministic_ring_gradients_are_bitwise_repeatable(ring):
    for name, case in CASES.items():
        if case[-1]:
            for rank, res in enumerate(ring["ranks"]):
                assert res["cases"][name].get("repeat_bitwise") is True, (name, rank, res)


def test_a_group_whose_backend_cannot_move_the_tensors_is_refused_on_every_rank(ring):
    for rank, res in enumerate(ring["ranks"]):
        found = res["refusals"]
        assert "cuda tensors need a process group with the nccl backend" in found["cuda_on_gloo"]
        assert "cpu tensors need a process group with the gloo or mpi" in found["cpu_on_nccl"], (
            rank,
            found,
        )
