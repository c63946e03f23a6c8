"""flashgen.torch's two copies without a GPU: head dims the kernels do not serve are zero-padded
to the next served one (`selection.padded_head_dim`, asked of the families), and tensors whose
layout the kernels cannot read are copied once (`selection.layout_ok`, `misaligned`,
`kvcache_select.cache_layout_ok`, `merge_layout_ok`, `cache_copy`).

The decisions are pure functions of shapes, strides and the families, tested first without
torch. Then, with a mocked CUDA (CPU tensors taken for CUDA ones on a (9, 0) device) and a
kernel library that emulates the kernels on the CPU from their launch parameters (reading the
tensors at the pointers and strides it is given, in float64), the Python layer end to end:
which head dim and which buffers the kernels get, the output and the gradients against a
float64 reference computed on the caller's unpadded tensors, the default softmax scale of the
caller's head dim, zero-copy for aligned views, the caller's caches left as they were,
torch.compile(fullgraph=True), and the refusals. The GPU side is tests/gpu/test_torch.py and
tests/gpu/test_torch_kvcache.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
from types import SimpleNamespace

import pytest
from flashgen.generator.spec import Causal, KernelKind, Target
from flashgen.torch import kvcache_select as ks
from flashgen.torch import selection
from flashgen.torch.selection import (
    CAPABILITIES,
    MAX_HEAD_DIM,
    PREFERRED,
    AttentionCall,
    Dtype,
    TensorMeta,
    UnsupportedCall,
    check_problem,
    layout_ok,
    misaligned,
    padded_head_dim,
)

F, B, D = KernelKind.FORWARD, KernelKind.BACKWARD, KernelKind.DECODE
H200 = (9, 0)
KINDS = [(F,), (F, B), (D,)]


def contiguous(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.insert(0, acc)
        acc *= max(n, 1)
    return tuple(stride)


def meta(shape, stride=None, dtype="bfloat16") -> TensorMeta:
    shape = tuple(shape)
    return TensorMeta(shape, contiguous(shape) if stride is None else tuple(stride), dtype, "cuda")


@pytest.fixture(autouse=True)
def fresh_padding_memo():
    padded_head_dim.cache_clear()
    yield
    padded_head_dim.cache_clear()


# -- which head dim the kernels run at -------------------------------------------------------------


def _selection_serves(kind: KernelKind, capability, d: int) -> bool:
    """The oracle: the selection derives a spec of `kind` at head dim d for a plain call."""
    try:
        if kind is D:
            ks.decode_spec(ks.DecodeCall(Dtype.BF16, d, capability))
        else:
            call = AttentionCall(dtype=Dtype.BF16, head_dim=d, capability=capability)
            (selection.forward_spec if kind is F else selection.backward_spec)(call)
    except UnsupportedCall:
        return False
    return True


@pytest.mark.parametrize("capability", [(8, 0), H200], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("kinds", KINDS, ids=["forward", "training", "decode"])
def test_the_padded_head_dim_is_the_smallest_one_the_selection_serves(capability, kinds):
    """For every d in 1..256: d' >= d is served by every kind (the selection derives its
    specs), and no head dim in d..d'-1 is; a d no served head dim covers is refused."""
    served = [
        x
        for x in range(1, MAX_HEAD_DIM + 1)
        if all(_selection_serves(kind, capability, x) for kind in kinds)
    ]
    assert served, "no head dim at all is served"
    assert selection.served_head_dims(capability, kinds) == tuple(served)
    for d in range(1, MAX_HEAD_DIM + 1):
        want = next((x for x in served if x >= d), None)
        if want is None:
            with pytest.raises(UnsupportedCall, match=rf"head_dim {d} has no"):
                padded_head_dim(d, capability, kinds)
        else:
            assert padded_head_dim(d, capability, kinds) == want, d
    for d in served:
        assert padded_head_dim(d, capability, kinds) == d  # served: no padding


def test_training_runs_both_kinds_at_one_head_dim_both_serve():
    for d in range(1, MAX_HEAD_DIM + 1):
        both = padded_head_dim(d, H200, (F, B))
        assert selection.head_dim_served(F, H200, both)
        assert selection.head_dim_served(B, H200, both)
        assert both >= padded_head_dim(d, H200, (F,))


class _Serves:
    def __init__(self, dims):
        self.dims = frozenset(dims)

    def head_dim_ok(self, d):
        return d in self.dims


@pytest.fixture
def families(monkeypatch):
    """selection.family answering from a table {(kind, target): served dims}."""

    def install(table):
        def fake(kind, target=None):
            return _Serves(table.get((kind, target), ()))

        monkeypatch.setattr(selection, "family", fake)
        padded_head_dim.cache_clear()

    return install


def test_the_search_goes_up_in_steps_of_one_and_follows_the_families(families):
    """Not a fixed grid: whatever the families serve, the next one up is taken."""
    families({(F, Target.SM80): {24, 100, 201}})
    got = {d: padded_head_dim(d, (8, 0), (F,)) for d in (1, 23, 24, 25, 99, 100, 101, 201)}
    assert got == {1: 24, 23: 24, 24: 24, 25: 100, 99: 100, 100: 100, 101: 201, 201: 201}
    with pytest.raises(UnsupportedCall) as err:
        padded_head_dim(202, (8, 0), (F,))
    msg = str(err.value)
    assert "head_dim 202 has no forward kernel" in msg and "from 202 to 256" in msg
    assert "24, 100, 201" in msg


def test_training_takes_what_both_kinds_serve(families):
    families({(F, Target.SM80): {24, 100, 120}, (B, Target.SM80): {100, 120}})
    assert padded_head_dim(20, (8, 0), (F,)) == 24
    assert padded_head_dim(20, (8, 0), (F, B)) == 100
    assert selection.served_head_dims((8, 0), (F, B)) == (100, 120)
    with pytest.raises(UnsupportedCall, match=r"forward and backward kernels serve head dims 100"):
        padded_head_dim(121, (8, 0), (F, B))


def test_the_preferred_family_or_the_portable_one_serves(families):
    """On a (9, 0) GPU the selection tries the sm_90a family first, then the portable sm_90
    one (`PREFERRED`): a head dim either serves is served."""
    assert PREFERRED[(F, H200)] is Target.SM90A
    families({(F, Target.SM90A): {32}, (F, Target.SM90): {48}, (F, Target.SM80): {64}})
    assert [padded_head_dim(d, H200, (F,)) for d in (1, 33, 48)] == [32, 48, 48]
    assert padded_head_dim(1, (8, 0), (F,)) == 64


@pytest.mark.parametrize("d", [0, -1, MAX_HEAD_DIM + 1, 300, 1024])
@pytest.mark.parametrize("kinds", KINDS, ids=["forward", "training", "decode"])
def test_head_dims_outside_1_to_256_are_refused_naming_the_value(d, kinds):
    with pytest.raises(UnsupportedCall) as err:
        padded_head_dim(d, H200, kinds)
    msg = str(err.value)
    assert msg.startswith(f"flashgen.torch: head_dim {d}: allowed 1..256")
    served = ", ".join(map(str, selection.served_head_dims(H200, kinds)))
    assert served in msg and "zero-padded" in msg


def test_what_names_the_kernels_and_non_ints_are_refused():
    with pytest.raises(UnsupportedCall, match=r"head_dim 300: .*merge_states kernels serve"):
        padded_head_dim(300, H200, (D,), "merge_states")
    for bad in (True, 64.0, "64"):
        with pytest.raises(UnsupportedCall, match="head_dim must be an int"):
            padded_head_dim(bad, H200, (F,))


def test_an_unsupported_gpu_is_refused_as_by_the_selection():
    with pytest.raises(UnsupportedCall, match=r"compute capability 7\.5"):
        padded_head_dim(59, (7, 5), (F,))


def test_every_capability_serves_some_head_dim_of_every_kind():
    for cap in CAPABILITIES:
        for kinds in KINDS:
            assert selection.served_head_dims(cap, kinds), (cap, kinds)


# -- which tensors are copied --------------------------------------------------------------------


def _layout_refused(t: TensorMeta) -> bool:
    try:
        check_problem(t, meta(t.shape), meta(t.shape))
    except UnsupportedCall as e:
        assert "pass .contiguous()" in str(e)
        return True
    return False


STRIDES = [
    (8192, 512, 64, 1),  # contiguous (2, 16, 8, 64)
    (8192 * 3, 512 * 3, 64, 1),  # qkv.unbind(2) of (2, 16, 3, 8, 64)
    (8192, 64, 1024, 1),  # transposed heads/rows of a (b, h, s, d) buffer
    (4352, 272, 68, 1),  # x[..., :64] of a (2, 16, 4, 68) buffer
    (8192, 512, 1, 8),  # head_dim not contiguous (a transposed (.., d, h) buffer)
    (8192, 512, 64, 2),  # x[..., ::2]
    (8196, 512, 64, 1),  # an odd batch stride
    (8192, 512, 60, 1),  # an odd head stride
]


@pytest.mark.parametrize("stride", STRIDES)
def test_layout_ok_is_check_problems_layout_rule(stride):
    t = meta((2, 16, 8, 64), stride)
    assert layout_ok(stride) == (not _layout_refused(t))


def test_layout_ok_reads_the_strides_of_size_one_dimensions_as_check_problem_does():
    """check_problem (and so the kernels' tensor maps) read every stride: a size-1 batch with
    an odd stride is copied (`clone` gives it the contiguous one; `.contiguous()` would not)."""
    stride = (3, 512, 64, 1)
    assert not layout_ok(stride) and _layout_refused(meta((1, 16, 8, 64), stride))


def test_misaligned_is_the_ops_16_byte_rule_on_the_storage_offset():
    assert not misaligned((2, 16, 4, 64), 0)
    assert not misaligned((2, 16, 4, 64), 8 * 37)  # 16-byte steps of 2-byte elements
    assert misaligned((2, 16, 4, 64), 3)
    assert misaligned((2, 16, 4, 64), 4)  # 8 bytes off
    assert not misaligned((2, 16, 4, 64), 4, itemsize=4)  # float32: 16 bytes
    assert not misaligned((2, 0, 4, 64), 3)  # nothing is read


CACHE_STRIDES = [
    ((2, 64, 2, 128), None, True),
    ((2, 64, 2, 128), (64 * 2 * 132, 2 * 132, 132, 1), False),  # k_cache[..., :128] of 132
    ((2, 64, 2, 128), (64 * 2 * 136, 2 * 136, 136, 1), True),
    ((2, 64, 2, 128), (16384, 256, 128, 2), False),  # strided head_dim
    ((2, 64, 1, 128), (8192, 128, 3, 1), True),  # a size-1 head dimension: its stride is unused
    ((1, 64, 2, 128), (5, 256, 128, 1), True),  # a size-1 batch
    ((2, 0, 2, 128), (7, 5, 3, 2), True),  # no elements
    ((2, 1, 8, 64), (512, 512, 66, 1), False),  # q with an odd head stride
]


@pytest.mark.parametrize(("shape", "stride", "ok"), CACHE_STRIDES)
def test_cache_layout_ok_is_check_kvcaches_rule(shape, stride, ok):
    t = meta(shape, stride)
    assert ks.cache_layout_ok(t.shape, t.stride) is ok
    q = meta((shape[0], 1, 8, shape[-1]))
    try:
        ks.check_kvcache(q, t, t, cache_seqlens=meta((shape[0],), dtype="int32"))
        refused = False
    except UnsupportedCall as e:
        refused = "pass .contiguous()" in str(e)
    assert refused is not ok


@pytest.mark.parametrize("dtype,vec", [("bfloat16", 8), ("float32", 4)])
def test_merge_layout_ok_is_check_merges_rule(dtype, vec):
    shape = (3, 2, 5, 8, 128)
    lse = meta((3, 2, 8, 5), dtype="float32")
    out_dtype = None if dtype == "bfloat16" else "bfloat16"
    for width in (128, 132, 136, 130):
        stride = (2 * 5 * 8 * width, 5 * 8 * width, 8 * width, width, 1)
        t = meta(shape, stride, dtype)
        try:
            ks.check_merge(t, lse, out_dtype)
            refused = False
        except UnsupportedCall:
            refused = True
        assert ks.merge_layout_ok(shape, stride, vec) is not refused, width


def test_a_read_only_cache_is_copied_when_padded_or_unreadable():
    good, odd = meta((2, 64, 2, 64)), meta((2, 64, 2, 64), (64 * 2 * 68, 2 * 68, 68, 1))
    assert ks.cache_copy("k_cache", good, 0, 64, 64, written=False) is False
    assert ks.cache_copy("k_cache", good, 0, 59, 64, written=False) is True
    assert ks.cache_copy("k_cache", odd, 0, 64, 64, written=False) is True
    assert ks.cache_copy("k_cache", good, 4, 64, 64, written=False) is True  # 8 bytes off
    assert ks.cache_copy("k_cache", good, 0, 64, 64, written=True) is False  # in place


def test_a_cache_the_call_writes_is_never_copied():
    """Appended k, v land in the caller's cache only if the kernel writes that tensor: a
    cache that would need a copy is refused, naming the head dim or with the layout's rule."""
    good, odd = meta((2, 64, 2, 59)), meta((2, 64, 2, 64), (64 * 2 * 68, 2 * 68, 68, 1))
    with pytest.raises(UnsupportedCall) as err:
        ks.cache_copy("v_cache", good, 0, 59, 64, written=True)
    msg = str(err.value)
    assert "v_cache has head_dim 59, which has no decode kernel" in msg
    assert ", ".join(map(str, ks.HEAD_DIMS)) in msg and "head_dim 64" in msg
    with pytest.raises(UnsupportedCall, match=r"k_cache has strides .*multiple of 8 elements"):
        ks.cache_copy("k_cache", odd, 0, 64, 64, written=True)
    with pytest.raises(UnsupportedCall, match=r"k_cache starts at an address that is not 16"):
        ks.cache_copy("k_cache", meta((2, 64, 2, 64)), 3, 64, 64, written=True)


# ================================================================================================
# The Python layer, with a mocked CUDA and an emulating kernel library (needs torch).
# ================================================================================================


def _torch():
    return pytest.importorskip("torch")


def _at(ptr: int, shape, strides, dtype):
    """The tensor of `dtype` at address `ptr` with these sizes and strides (elements)."""
    torch = _torch()
    shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
    if 0 in shape:
        return torch.empty(shape, dtype=dtype)
    n = 1 + sum((a - 1) * s for a, s in zip(shape, strides))
    size = torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_char * (n * size)).from_address(ptr)
    return torch.frombuffer(buf, dtype=dtype, count=n).as_strided(shape, strides)


def reference(q, k, v, *, scale, causal=False, lens=None):
    """float64 attention of one (b, s, h, d) problem (or, with `lens`, per sequence of a
    packed (total, h, d) one): (O, LSE), GQA by repeating k, v; causal bottom-right."""
    torch = _torch()
    if lens is not None:
        outs, lses, (sq, sk) = [], [], lens
        cq = [0, *itertools.accumulate(sq)]
        ck = [0, *itertools.accumulate(sk)]
        for b in range(len(sq)):
            o, lse = reference(q[None, cq[b] : cq[b + 1]], k[None, ck[b] : ck[b + 1]],
                               v[None, ck[b] : ck[b + 1]], scale=scale, causal=causal)  # fmt: skip
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=-1)
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    z = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(sq)[:, None] + (sk - sq)
        z = z.masked_fill(torch.arange(sk)[None, :] > i, -math.inf)
    seen = torch.isfinite(z).any(-1, keepdim=True)  # rows that see no key: O = 0, LSE -inf
    p = torch.softmax(torch.where(seen, z, 0.0), dim=-1) * seen
    return torch.einsum("bhqk,bkhd->bqhd", p, v), torch.logsumexp(z, dim=-1)


def gradients(q, k, v, dout, *, scale, causal=False):
    """float64 dq, dk, dv of one (b, s, h, d) problem from the definition: P = softmax(z),
    dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = scale dS K, dK = scale dS^T Q, GQA
    summed over each k/v head's query heads."""
    torch = _torch()
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    hk, group = k.shape[2], q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    z = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(sq)[:, None] + (sk - sq)
        z = z.masked_fill(torch.arange(sk)[None, :] > i, -math.inf)
    seen = torch.isfinite(z).any(-1, keepdim=True)
    pr = torch.softmax(torch.where(seen, z, 0.0), dim=-1) * seen
    o = torch.einsum("bhqk,bkhd->bqhd", pr, ve)
    dv = torch.einsum("bhqk,bqhd->bkhd", pr, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve)
    rows = (dout * o).sum(-1).transpose(1, 2)[..., None]  # (b, h, sq, 1)
    ds = pr * (dp - rows)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold, fold_v = (k.shape[0], sk, hk, group, k.shape[3]), (v.shape[0], sk, hk, group, v.shape[3])
    return dq, dk.reshape(fold).sum(3), dv.reshape(fold_v).sum(3)


class Emulator:
    """A kernel library that computes what the kernel would (float64, from the tensors at its
    launch parameters' pointers and strides) and records each launch."""

    def __init__(self, spec, launches):
        self.spec, self.launches, self.name = spec, launches, "emulated"

    def workspace_bytes(self, params):
        return 1 << 24

    def launch(self, params, stream=0):
        self.launches.append((self.spec, dict(params)))
        kind = self.spec.kernel
        getattr(self, f"_{kind.yaml}")(params)

    def _dtype(self):
        torch = _torch()
        return torch.float16 if self.spec.dtype is Dtype.FP16 else torch.bfloat16

    def _qkv(self, p, lens, names=("q", "k", "v", "o")):
        """The (b, s, h, d) views (varlen: (1, total, h, d)) of the named tensors (v, o, dout
        and dv of the spec's d_v)."""
        dt = self._dtype()
        out = {}
        for name in names:
            d = self.spec.head_dim_vo if name in ("v", "o", "dout", "dv") else self.spec.head_dim
            kv = name in ("k", "v", "dk", "dv")
            heads = p["kv_heads"] if kv else p["heads"]
            pre = "do" if name == "dout" else name
            if lens is not None:
                shape, batch = (1, sum(lens[1] if kv else lens[0]), heads, d), 0
            else:
                rows = p["seqlen_k"] if kv else p["seqlen_q"]
                shape, batch = (p["batch"], rows, heads, d), p[f"{pre}_batch_stride"]
            stride = (batch, p[f"{pre}_row_stride"], p[f"{pre}_head_stride"], 1)
            out[name] = _at(p[name], shape, stride, dt)
        return out

    def _lens(self, p):
        torch = _torch()
        if not self.spec.mask.varlen:
            return None
        n = p["batch"] + 1
        cq = _at(p["cu_seqlens_q"], (n,), (1,), torch.int32).tolist()
        ck = _at(p["cu_seqlens_k"], (n,), (1,), torch.int32).tolist()
        return [b - a for a, b in zip(cq, cq[1:])], [b - a for a, b in zip(ck, ck[1:])]

    def _lse(self, p, rows):
        torch = _torch()
        if self.spec.mask.varlen:
            return _at(p["lse"], (p["heads"], rows), (p["lse_head_stride"], 1), torch.float32)
        shape = (p["batch"], p["heads"], p["seqlen_q"])
        return _at(p["lse"], shape, (p["lse_batch_stride"], p["lse_head_stride"], 1),
                   torch.float32)  # fmt: skip

    def _run(self, q, k, v, p, lens):
        causal = self.spec.mask.causal is Causal.BOTTOM_RIGHT
        if lens is None:
            return reference(q, k, v, scale=p["softmax_scale"], causal=causal)
        o, lse = reference(q[0], k[0], v[0], scale=p["softmax_scale"], causal=causal, lens=lens)
        return o[None], lse

    def _forward(self, p):
        lens = self._lens(p)
        t = self._qkv(p, lens)
        o, lse = self._run(t["q"], t["k"], t["v"], p, lens)
        t["o"].copy_(o)
        self._lse(p, t["q"].shape[1]).copy_(lse)

    def _backward(self, p):
        """dq, dk, dv in float64 from the definition (the op's real implementation runs
        below autograd, so autograd cannot differentiate here)."""
        lens = self._lens(p)
        t = self._qkv(p, lens, ("q", "k", "v", "o", "dout", "dq", "dk", "dv"))
        causal = self.spec.mask.causal is Causal.BOTTOM_RIGHT
        spans = [(0, t["q"].shape[1], 0, t["k"].shape[1])]
        if lens is not None:
            cq, ck = [0, *itertools.accumulate(lens[0])], [0, *itertools.accumulate(lens[1])]
            spans = [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(lens[0]))]
        for a, b, c, e in spans:
            q, do = t["q"][:, a:b], t["dout"][:, a:b]
            k, v = t["k"][:, c:e], t["v"][:, c:e]
            dq, dk, dv = gradients(q, k, v, do, scale=p["softmax_scale"], causal=causal)
            t["dq"][:, a:b].copy_(dq)
            t["dk"][:, c:e].copy_(dk)
            t["dv"][:, c:e].copy_(dv)

    def _decode(self, p):
        """No mask; contiguous or paged caches: sequence b attends to its cache_seqlens[b]
        keys (paged: key j is row j % page_size of page block_table[b, j // page_size])."""
        torch = _torch()
        assert self.spec.mask.causal is Causal.NONE and not self.spec.mask.window
        dt, d = self._dtype(), self.spec.head_dim
        b, sq, h, hk = p["batch"], p["seqlen_q"], p["heads"], p["kv_heads"]

        def view(name, shape):
            stride = (p[f"{name}_batch_stride"], p[f"{name}_row_stride"],
                      p[f"{name}_head_stride"], 1)  # fmt: skip
            return _at(p[name], shape, stride, dt)

        q, o = view("q", (b, sq, h, d)), view("o", (b, sq, h, d))
        lens = _at(p["cache_seqlens"], (b,), (1,), torch.int32).tolist()
        if p["block_table"]:
            page, pages, cols = p["page_size"], p["num_pages"], p["max_pages"]
            table = _at(p["block_table"], (b, cols), (p["block_table_stride"], 1), torch.int32)
            kp, vp = view("k", (pages, page, hk, d)), view("v", (pages, page, hk, d))

            def keys(x, i, n):  # the used pages only (entries past them are never read)
                used = table[i, : -(-n // page)].long()
                return x[used].reshape(-1, hk, d)[None, :n]
        else:
            kp, vp = view("k", (b, p["seqlen_k"], hk, d)), view("v", (b, p["seqlen_k"], hk, d))

            def keys(x, i, n):
                return x[i : i + 1, :n]

        lse = _at(p["lse"], (b, h, sq), (p["lse_batch_stride"], p["lse_head_stride"], 1),
                  torch.float32)  # fmt: skip
        for i, n in enumerate(lens):
            ob, lb = reference(q[i : i + 1], keys(kp, i, n), keys(vp, i, n),
                               scale=p["softmax_scale"])  # fmt: skip
            o[i].copy_(ob[0])
            lse[i].copy_(lb[0])

    def merge_states(self, p, stream=0):
        torch = _torch()
        self.launches.append((self.spec, dict(p)))
        d = self.spec.head_dim
        n, b, sq, h = p["num_parts"], p["batch"], p["seqlen_q"], p["heads"]
        part_dtype = self._dtype() if p["parts_dtype"] else torch.float32
        po = tuple(p[f"o_parts_{x}_stride"] for x in ("part", "batch", "row", "head")) + (1,)
        parts = _at(p["o_parts"], (n, b, sq, h, d), po, part_dtype).double()
        pl = tuple(p[f"lse_parts_{x}_stride"] for x in ("part", "batch", "head")) + (1,)
        lses = _at(p["lse_parts"], (n, b, h, sq), pl, torch.float32).double()
        lse = torch.logsumexp(lses, dim=0)
        w = torch.exp(lses - lse).permute(0, 1, 3, 2)[..., None]  # (n, b, sq, h, 1)
        out = _at(p["o"], (b, sq, h, d), (p["o_batch_stride"], p["o_row_stride"],
                                          p["o_head_stride"], 1), self._dtype())  # fmt: skip
        out.copy_((w * parts).sum(0))
        _at(p["lse"], (b, h, sq), (p["lse_batch_stride"], p["lse_head_stride"], 1),
            torch.float32).copy_(lse)  # fmt: skip


@pytest.fixture
def gpu(monkeypatch):
    """CPU tensors taken for CUDA ones on a (9, 0) device 0, kernels emulated; yields the
    launches [(spec, params)] and the modules."""
    torch = _torch()
    from flashgen.torch import cache, interface, kvcache, ops

    real_meta = ops._meta

    def as_cuda(t, device=None):
        m = real_meta(t, device)
        return m._replace(device="cuda") if m.device == "cpu" else m

    launches = []
    memos = {"_CALLS": {}, "_BACKWARD_OK": set(), "_SCORES": {}, "_PROBLEMS": {}}
    for name, value in memos.items():
        monkeypatch.setattr(ops, name, value)
    monkeypatch.setattr(ops, "_capability", lambda index: H200)
    monkeypatch.setattr(ops, "_meta", as_cuda)
    monkeypatch.setattr(kvcache, "_meta", as_cuda)
    monkeypatch.setattr(interface, "_on_cuda", lambda t: True)
    monkeypatch.setattr(kvcache, "_on_cuda", lambda t: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cache, "kernel_library", lambda spec: Emulator(spec, launches))
    monkeypatch.setattr(ops, "_stream", lambda device: 0)
    monkeypatch.setattr(ops, "_OnDevice", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kvcache, "_library", lambda spec: Emulator(spec, launches))
    monkeypatch.setattr(kvcache, "_capability", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    stream = SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return SimpleNamespace(launches=launches, ops=ops, interface=interface, kvcache=kvcache)


def _randn(*shape, dtype=None, grad=False, seed=0):
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype or torch.float16)
    return x.requires_grad_(grad)


# fp16: O within its rounding of the float64 reference, gradients a little looser
TOL = {"o": 2e-3, "grad": 1e-2}


def _close(got, want, tol, what):
    torch = _torch()
    err = (got.double() - want).abs().max().item()
    bound = tol * max(1.0, want.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
    assert torch.isfinite(got).all(), what


def _check(q, k, v, out, dout, *, causal, scale=None, lens=None, grads=True):
    """out and (grads) the gradients of out against dout wrt q, k, v, against the float64
    reference on the caller's (unpadded) q, k, v."""
    torch = _torch()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want, _ = reference(qd, kd, vd, scale=scale, causal=causal, lens=lens)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == q.dtype
    _close(out, want.detach(), TOL["o"], "o")
    if grads:
        got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        ref = torch.autograd.grad(want, (qd, kd, vd), dout.double())
        for name, g, r, x in zip(("dq", "dk", "dv"), got, ref, (q, k, v)):
            assert g.shape == x.shape, name
            _close(g, r, TOL["grad"], name)


def _padded_dims(kinds, candidates=(59, 111, 40, 200, 20)):
    """Head dims of `candidates` the kernels do not serve on the H200 (asked of them)."""
    return [d for d in candidates if padded_head_dim(d, H200, kinds) != d]


TRAINING_DIMS = _padded_dims((F, B))
DECODE_DIMS = _padded_dims((D,), (59, 100, 20, 111))


@pytest.mark.parametrize("d", TRAINING_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_an_unserved_head_dim_runs_padded_and_matches_the_reference(gpu, d, causal):
    torch = _torch()
    padded = padded_head_dim(d, H200, (F, B))
    q = _randn(2, 37, 4, d, grad=True, seed=1)
    k, v = (_randn(2, 53, 2, d, grad=True, seed=s) for s in (2, 3))
    dout = _randn(2, 37, 4, d, seed=4)
    out, lse, _ = flash_attn(q, k, v, causal=causal, return_attn_probs=True)
    assert out.is_contiguous() and lse.shape == (2, 4, 37)
    ((fs, fp),) = gpu.launches
    assert fp["q"] != q.data_ptr() and fp["q_head_stride"] == padded  # a padded copy
    padded_q = _at(fp["q"], (2, 37, 4, padded), contiguous((2, 37, 4, padded)), q.dtype)
    assert torch.equal(padded_q[..., :d], q.detach())  # (alive: saved for the backward)
    assert torch.all(padded_q[..., d:] == 0)  # zeros: q . k is unchanged
    _check(q, k, v, out, dout, causal=causal)
    (fs, fp), (bs, bp) = gpu.launches
    assert (fs.kernel, bs.kernel) == (F, B) and fs.head_dim == bs.head_dim == padded
    assert fp["softmax_scale"] == bp["softmax_scale"] == d**-0.5  # the caller's head dim


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_v_of_its_own_head_dim_runs_the_d_v_kernels_unpadded(gpu, causal):
    q = _randn(2, 37, 4, 192, grad=True, seed=1)
    k = _randn(2, 53, 2, 192, grad=True, seed=2)
    v = _randn(2, 53, 2, 128, grad=True, seed=3)
    dout = _randn(2, 37, 4, 128, seed=4)
    out = flash_attn(q, k, v, causal=causal)
    assert out.shape == (2, 37, 4, 128)
    ((fs, fp),) = gpu.launches
    assert (fs.head_dim, fs.head_dim_vo, fs.target) == (192, 128, Target.SM90A)
    assert (fp["q"], fp["v"]) == (q.data_ptr(), v.data_ptr())  # read in place
    assert (fp["head_dim"], fp["head_dim_v"]) == (192, 128)  # what <name>_check compares
    _check(q, k, v, out, dout, causal=causal)
    _, (bs, bp) = gpu.launches
    assert (bs.kernel, bs.head_dim, bs.head_dim_vo, bs.target) == (B, 192, 128, Target.SM90)
    assert (bp["head_dim"], bp["head_dim_v"]) == (192, 128)


def test_unserved_q_and_v_head_dims_are_padded_each_to_its_own(gpu):
    d, d_v = 59, 20
    padded, padded_v = (padded_head_dim(x, H200, (F, B)) for x in (d, d_v))
    assert padded != d and padded_v != d_v
    q = _randn(1, 9, 2, d, grad=True, seed=1)
    k = _randn(1, 11, 2, d, grad=True, seed=2)
    v = _randn(1, 11, 2, d_v, grad=True, seed=3)
    out = flash_attn(q, k, v, causal=True)
    ((fs, fp),) = gpu.launches
    assert (fs.head_dim, fs.head_dim_vo) == (padded, padded_v)
    assert (fp["q_head_stride"], fp["v_head_stride"], fp["o_head_stride"]) == (
        padded, padded_v, padded_v,
    )  # fmt: skip
    assert fp["softmax_scale"] == d**-0.5
    _check(q, k, v, out, _randn(1, 9, 2, d_v, seed=4), causal=True)


def flash_attn(*args, **kw):
    from flashgen.torch import flash_attn_func

    return flash_attn_func(*args, **kw)


def test_without_grad_the_forward_alone_chooses_the_head_dim(gpu):
    torch = _torch()
    dims = [d for d in range(1, 257) if padded_head_dim(d, H200, (F,)) != d]
    differ = [x for x in dims if padded_head_dim(x, H200, (F, B)) != padded_head_dim(x, H200, (F,))]
    d = (differ or dims)[0]
    q, k, v = (_randn(1, 20, 2, d, seed=s) for s in range(3))
    with torch.no_grad():
        out = flash_attn(q, k, v)
    _check(q, k, v, out, None, causal=False, grads=False)
    ((spec, _),) = gpu.launches
    assert spec.head_dim == padded_head_dim(d, H200, (F,)) and spec.kernel is F


def test_softmax_scale_given_is_kept_and_self_attention_pads_once(gpu):
    d = TRAINING_DIMS[0]
    x = _randn(1, 30, 2, d, grad=True, seed=5)
    out = flash_attn(x, x, x, softmax_scale=0.3, causal=True)
    _check(x, x, x, out, _randn(1, 30, 2, d, seed=6), causal=True, scale=0.3, grads=False)
    (_, fp), *_ = gpu.launches
    assert fp["softmax_scale"] == 0.3 and fp["q"] == fp["k"] == fp["v"]


def test_varlen_with_an_unserved_head_dim_matches_the_reference(gpu):
    torch = _torch()
    from flashgen.torch import flash_attn_varlen_func

    d = TRAINING_DIMS[-1]
    lq, lk = [5, 0, 33, 17], [9, 4, 33, 1]
    q = _randn(sum(lq), 4, d, grad=True, seed=7)
    k, v = (_randn(sum(lk), 2, d, grad=True, seed=s) for s in (8, 9))
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True,
                                         return_attn_probs=True)  # fmt: skip
    assert lse.shape == (4, sum(lq))
    _check(q, k, v, out, _randn(sum(lq), 4, d, seed=10), causal=True, lens=(lq, lk))
    assert {s.head_dim for s, _ in gpu.launches} == {padded_head_dim(d, H200, (F, B))}


def _layouts(d: int):
    """(name, make) of views of q's shape (2, 33, 4, d) the kernels cannot read as they are:
    each make(seed) returns (view, the tensor that owns its gradient)."""
    shape = (2, 33, 4, d)

    def wide(seed):  # x[..., :d] of a buffer 4 columns wider (strides not multiples of 8)
        base = _randn(2, 33, 4, d + 4, grad=True, seed=seed)
        return base[..., :d], base

    def transposed(seed):  # head_dim not contiguous: (.., d, h) storage
        base = _randn(2, 33, d, 4, grad=True, seed=seed)
        return base.transpose(-1, -2), base

    def shifted(seed):  # strides fine, first element 6 bytes past a 16-byte boundary
        n = math.prod(shape)
        base = _randn(n + 8, grad=True, seed=seed)
        return base[3 : 3 + n].view(shape), base

    def size_one_odd(seed):  # a size-1 batch with an odd stride (contiguous() keeps it)
        base = _randn(1, 33, 4, d, grad=True, seed=seed)
        view = base.as_strided((1, 33, 4, d), (3, 4 * d, d, 1))
        assert view.is_contiguous() and view.contiguous().stride()[0] == 3
        return view, base

    return [("wide", wide), ("transposed", transposed), ("shifted", shifted),
            ("size-one-odd", size_one_odd)]  # fmt: skip


@pytest.mark.parametrize("layout", range(4), ids=["wide", "transposed", "shifted", "size1"])
def test_views_the_kernels_cannot_read_are_copied_once_and_gradients_flow(gpu, layout):
    torch = _torch()
    d = 64  # served: only the layout needs the copy
    assert padded_head_dim(d, H200, (F, B)) == d
    name, make = _layouts(d)[layout]
    (q, q_base), (k, _), (v, _) = (make(s) for s in (11, 12, 13))
    if name == "size-one-odd":
        k, v = (_randn(1, 33, 4, d, grad=True, seed=s) for s in (12, 13))
    with pytest.raises(UnsupportedCall, match=r"pass \.contiguous\(\)"):
        if name == "shifted":
            gpu.ops._check_aligned(q=q)
        else:
            gpu.ops._check_problem(q, k, v, None, None, 0, 0)
    dout = _randn(*q.shape, seed=14)
    out = flash_attn(q, k, v, causal=True)
    _check(q, k, v, out, dout, causal=True)
    (_, fp), (_, bp) = gpu.launches
    assert fp["q"] != q.data_ptr() and fp["q"] % 16 == 0
    assert fp["q_row_stride"] % 8 == 0 and fp["q_head_stride"] == d
    assert bp["q"] == fp["q"]  # the backward reads the forward's copy, saved by autograd
    grad, want = torch.autograd.grad(out, (q_base, q), dout)
    assert grad.shape == q_base.shape
    if name == "wide":
        assert torch.equal(grad[..., :d], want) and torch.all(grad[..., d:] == 0)


def test_aligned_views_are_read_in_place(gpu):
    """qkv.unbind(2) of a packed projection and a (b, h, s, d) buffer's transpose: no copy."""
    qkv = _randn(2, 40, 3, 4, 64, grad=True, seed=15)
    q, k, v = qkv.unbind(dim=2)
    out = flash_attn(q, k, v, causal=True)
    _check(q, k, v, out, _randn(2, 40, 4, 64, seed=16), causal=True)
    bhsd = _randn(2, 4, 40, 64, seed=17)
    t = bhsd.transpose(1, 2)
    flash_attn(t, t, t)
    (_, fp), (_, bp), (_, tp) = gpu.launches
    assert (fp["q"], fp["k"], fp["v"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert (bp["q"], bp["k"], bp["v"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert tp["q"] == t.data_ptr() and tp["q_row_stride"] == 64 and tp["q_head_stride"] == 2560


def test_an_unserved_head_dim_and_an_unreadable_layout_take_one_copy(gpu):
    d = TRAINING_DIMS[0]
    base = _randn(2, 21, 4, d + 3, grad=True, seed=18)
    q = base[..., :d]
    k, v = (_randn(2, 21, 4, d, grad=True, seed=s) for s in (19, 20))
    out = flash_attn(q, k, v)
    _check(q, k, v, out, _randn(2, 21, 4, d, seed=21), causal=False)
    (spec, fp), _ = gpu.launches
    assert spec.head_dim == padded_head_dim(d, H200, (F, B))
    assert fp["q_head_stride"] == spec.head_dim


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 16, 4, 300),) * 3, r"head_dim 300: allowed 1\.\.256"),
        (((2, 16, 4, 0),) * 3, r"head_dim 0: allowed 1\.\.256"),
        (((2, 16, 4, 59), (2, 16, 4, 59), (2, 17, 4, 59)),
         r"k \(2, 16, 4, 59\) and v \(2, 17, 4, 59\) must have the same shape"),
        (((2, 16, 4, 59), (2, 16, 4, 64), (2, 16, 4, 64)), r"q's head_dim 59 differs from k's 64"),
        (((2, 16, 6, 59), (2, 16, 4, 59), (2, 16, 4, 59)), r"q has 6 heads"),
        (((2, 16, 4, 59), (3, 16, 4, 59), (3, 16, 4, 59)), r"q has batch 2 but k, v have 3"),
    ],
    ids=["d300", "d0", "k-v-shapes", "head-dims-differ", "heads", "batch"],
)  # fmt: skip
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_refusals_name_the_callers_shapes(gpu, shapes, match, grad):
    q, k, v = (_randn(*s, grad=grad, seed=i) for i, s in enumerate(shapes))
    with pytest.raises(UnsupportedCall, match=match):
        flash_attn(q, k, v)
    assert not gpu.launches


@pytest.mark.parametrize("d", [59, 300])
def test_tensors_the_op_refuses_are_passed_on_to_its_message(gpu, monkeypatch, d):
    """Not float16/bfloat16, or not on a CUDA device: no head dim is asked, nothing copied,
    the op's own refusal (not one about the head dim)."""
    q = _randn(2, 16, 4, d).float()
    with pytest.raises(UnsupportedCall, match=r"q has dtype float32; flashgen kernels take"):
        flash_attn(q, q, q)
    monkeypatch.setattr(gpu.interface, "_on_cuda", lambda t: False)
    monkeypatch.setattr(gpu.ops, "_meta", lambda t, device=None: TensorMeta(
        tuple(t.shape), tuple(t.stride()), "float16", "cpu"))  # fmt: skip
    h = _randn(2, 16, 4, d)
    with pytest.raises(UnsupportedCall, match=r"q is on device 'cpu'; flashgen kernels run"):
        flash_attn(h, h, h)
    assert not gpu.launches


def test_torch_compile_fullgraph_traces_the_padding_and_the_copies(gpu):
    """dynamo traces the layer (the head dim is asked once, at trace time); the compiled
    step gives what eager gives, gradients included."""
    torch = _torch()
    d = TRAINING_DIMS[0]
    base = _randn(2, 24, 4, d + 5, grad=True, seed=22)
    k, v = (_randn(2, 24, 2, d, grad=True, seed=s) for s in (23, 24))
    dout = _randn(2, 24, 4, d, seed=25)

    def step(base, k, v):
        return flash_attn(base[..., :d], k, v, causal=True) * 2.0

    want = step(base, k, v)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(base, k, v)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (base, k, v), dout),
                    torch.autograd.grad(want, (base, k, v), dout)):  # fmt: skip
        assert torch.equal(a, b)
    assert {s.head_dim for s, _ in gpu.launches} == {padded_head_dim(d, H200, (F, B))}


# -- flash_attn_with_kvcache and merge_states ------------------------------------------------------


def _kvcache(*args, **kw):
    from flashgen.torch import flash_attn_with_kvcache

    return flash_attn_with_kvcache(*args, **kw)


def _decode_check(q, k_cache, v_cache, lens, out, lse=None, scale=None):
    torch = _torch()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    assert out.shape == q.shape and out.is_contiguous()
    for b, n in enumerate(lens):
        o, l_ = reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n],
                          scale=scale)  # fmt: skip
        _close(out[b : b + 1], o, TOL["o"], f"o[{b}]")
        if lse is not None:
            assert torch.allclose(lse[b].double(), l_[0], atol=1e-5)


@pytest.mark.parametrize("d", DECODE_DIMS)
def test_an_unserved_decode_head_dim_reads_padded_copies_of_the_caches(gpu, d):
    torch = _torch()
    padded = padded_head_dim(d, H200, (D,))
    q = _randn(3, 2, 8, d, seed=30)
    k_cache, v_cache = _randn(3, 70, 2, d, seed=31), _randn(3, 70, 2, d, seed=32)
    before = (k_cache.clone(), v_cache.clone())
    lens = [0, 9, 70]
    out, lse = _kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                        return_softmax_lse=True)  # fmt: skip
    _decode_check(q, k_cache, v_cache, lens, out, lse)
    ((spec, p),) = gpu.launches
    assert spec.kernel is D and spec.head_dim == padded and p["softmax_scale"] == d**-0.5
    assert p["k"] != k_cache.data_ptr() and p["k_head_stride"] == padded
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # read only
    # an int cache_seqlens (checked on the host against the caches) takes the same path
    again = _kvcache(q, k_cache, v_cache, cache_seqlens=70)
    _decode_check(q, k_cache, v_cache, [70] * 3, again)
    _kvcache(q, k_cache, k_cache, cache_seqlens=70)  # one tensor for both caches: one copy
    assert gpu.launches[-1][1]["k"] == gpu.launches[-1][1]["v"]


def test_a_paged_cache_of_an_unserved_head_dim_reads_padded_pages(gpu):
    torch = _torch()
    d = DECODE_DIMS[0]
    q = _randn(2, 3, 4, d, seed=48)
    pages = _randn(5, 16, 2, d, seed=49)
    table = torch.tensor([[3, 0, 4], [1, 2, 0]], dtype=torch.int32)
    lens = [40, 17]
    out = _kvcache(q, pages, pages, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                   block_table=table)  # fmt: skip
    flat = torch.stack([pages[table[i]].reshape(48, 2, d) for i in range(2)])
    _decode_check(q, flat, flat, lens, out)
    ((spec, p),) = gpu.launches
    assert spec.paged and spec.head_dim == padded_head_dim(d, H200, (D,))
    assert p["k"] == p["v"] != pages.data_ptr() and p["num_pages"] == 5


def test_unreadable_caches_are_read_through_one_copy_and_aligned_ones_in_place(gpu):
    torch = _torch()
    d = 64
    assert padded_head_dim(d, H200, (D,)) == d
    q = _randn(2, 1, 4, d, seed=33)
    k_cache = _randn(2, 50, 2, d + 4, seed=34)[..., :d]  # strides not multiples of 8
    v_cache = _randn(2, 50, 2, d, seed=35)
    lens = torch.tensor([50, 7], dtype=torch.int32)
    with pytest.raises(UnsupportedCall, match=r"k_cache has strides"):
        m = gpu.kvcache._meta
        ks.check_kvcache(m(q), m(k_cache), m(v_cache), cache_seqlens=m(lens))
    out = _kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    _decode_check(q, k_cache, v_cache, [50, 7], out)
    ((_, p),) = gpu.launches
    assert p["k"] != k_cache.data_ptr() and p["k_row_stride"] == 2 * d
    assert p["v"] == v_cache.data_ptr() and p["q"] == q.data_ptr()  # aligned: in place


def test_a_cache_the_call_would_write_is_refused_not_copied(gpu):
    """The guard for a kernel that would write the caches itself (`written`), exercised
    directly; flash_attn_with_kvcache appends with torch operations on the caller's caches
    before the kernel reads them, so it passes written=False and such caches are written in
    place, then read through a copy."""
    torch = _torch()
    lens = torch.tensor([5, 5], dtype=torch.int32)
    q = _randn(2, 1, 4, 64, seed=36)
    cache = _randn(2, 16, 2, 64, seed=37)
    same = gpu.kvcache._decode_inputs(q, cache, cache, lens, None, 0, 0.1, True)
    assert same[1].data_ptr() == cache.data_ptr() and same[3] == 64  # nothing to copy
    odd = _randn(2, 16, 2, 68, seed=38)[..., :64]
    with pytest.raises(UnsupportedCall, match=r"k_cache has strides .*pass \.contiguous"):
        gpu.kvcache._decode_inputs(q, odd, cache, lens, None, 0, 0.1, True)
    if DECODE_DIMS:
        d = DECODE_DIMS[0]
        qd, cd = _randn(2, 1, 4, d, seed=39), _randn(2, 16, 2, d, seed=40)
        with pytest.raises(UnsupportedCall, match=rf"k_cache has head_dim {d}, which has no"):
            gpu.kvcache._decode_inputs(qd, cd, cd, lens, None, 0, 0.1, True)
    assert not gpu.launches
    before = odd.clone()
    v_cache = cache.clone()
    new_k, new_v = _randn(2, 1, 2, 64, seed=43), _randn(2, 1, 2, 64, seed=44)
    out = _kvcache(q, odd, v_cache, k=new_k, v=new_v, cache_seqlens=lens)
    assert torch.equal(odd[:, 5], new_k[:, 0]) and torch.equal(v_cache[:, 5], new_v[:, 0])
    assert torch.equal(odd[:, :5], before[:, :5]) and torch.equal(odd[:, 6:], before[:, 6:])
    ((_, p),) = gpu.launches
    assert p["k"] != odd.data_ptr() and p["v"] == v_cache.data_ptr()  # a copy of odd only
    _decode_check(q, odd, v_cache, [6, 6], out)
    if DECODE_DIMS:  # an unserved head dim: written at d, read through copies padded to d'
        d = DECODE_DIMS[0]
        qd, kd, vd = (_randn(2, 1, 4, d, seed=45 + i) for i in range(3))
        cd, vcd = _randn(2, 16, 2, d, seed=48), _randn(2, 16, 2, d, seed=49)
        out = _kvcache(qd, cd, vcd, k=kd[:, :, :2], v=vd[:, :, :2], cache_seqlens=lens)
        assert torch.equal(cd[:, 5], kd[:, 0, :2]) and torch.equal(vcd[:, 5], vd[:, 0, :2])
        spec, p = gpu.launches[-1]
        assert spec.head_dim == padded_head_dim(d, H200, (D,)) and p["k"] != cd.data_ptr()
        _decode_check(qd, cd, vcd, [6, 6], out)


@pytest.mark.parametrize(
    ("q_shape", "cache_shape", "kw", "match"),
    [
        ((2, 1, 4, 300), (2, 16, 2, 300), {}, r"head_dim 300: allowed 1\.\.256"),
        ((2, 1, 4, 59), (2, 16, 3, 59), {}, r"q has 4 heads and k_cache, v_cache have 3"),
        ((2, 1, 4, 59), (2, 16, 2, 59), {"cache_seqlens": 17},
         r"cache_seqlens=17 is outside 0\.\.16"),
        ((2, 1, 4, 59), (3, 16, 2, 59), {"cache_seqlens": 3}, r"q has batch 2 but k_cache has 3"),
    ],
    ids=["d300", "heads", "seqlens", "batch"],
)  # fmt: skip
def test_decode_refusals_name_the_callers_shapes(gpu, q_shape, cache_shape, kw, match):
    q, cache = _randn(*q_shape, seed=41), _randn(*cache_shape, seed=42)
    with pytest.raises(UnsupportedCall, match=match):
        _kvcache(q, cache, cache, **kw)
    assert not gpu.launches


def test_merge_states_pads_an_unserved_head_dim_and_copies_unreadable_parts(gpu):
    torch = _torch()
    from flashgen.torch import merge_states

    d = DECODE_DIMS[0] if DECODE_DIMS else 64
    parts = _randn(2, 3, 5, 4, d + 4, seed=43).float()[..., :d]  # float32: 4-element rule
    lse = _randn(2, 3, 4, 5, seed=44).float()
    out, out_lse = merge_states(parts, lse, out_dtype=torch.bfloat16)
    want_lse = torch.logsumexp(lse.double(), 0)
    w = torch.exp(lse.double() - want_lse).permute(0, 1, 3, 2)[..., None]
    want = (w * parts.double()).sum(0)
    assert out.shape == (3, 5, 4, d) and out.dtype == torch.bfloat16
    _close(out, want, 1e-2, "merged o")
    assert torch.allclose(out_lse.double(), want_lse, atol=1e-5)
    ((spec, p),) = gpu.launches
    assert spec.head_dim == padded_head_dim(d, H200, (D,)) and p["o_parts"] != parts.data_ptr()


def test_torch_compile_fullgraph_traces_the_padded_decode_call(gpu):
    torch = _torch()
    d = DECODE_DIMS[0]
    q = _randn(2, 1, 4, d, seed=45)
    k_cache, v_cache = _randn(2, 40, 2, d, seed=46), _randn(2, 40, 2, d + 6, seed=47)[..., :d]
    lens = torch.tensor([40, 3], dtype=torch.int32)

    def step(q, k_cache, v_cache, lens):
        return _kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True)

    want = step(q, k_cache, v_cache, lens)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _decode_check(q, k_cache, v_cache, [40, 3], got[0], got[1])
    assert {s.head_dim for s, _ in gpu.launches} == {padded_head_dim(d, H200, (D,))}
