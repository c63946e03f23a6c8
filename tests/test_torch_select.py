"""flashgen.torch without torch or a GPU: the spec a call derives, the errors of calls no
kernel serves, and the kernel cache (lookup order, one compile under concurrent processes,
atomic publication) with a fake compiler."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from flashgen.generator.families.backward import HEAD_DIMS as BACKWARD_HEAD_DIMS
from flashgen.generator.families.forward import HEAD_DIMS as FORWARD_HEAD_DIMS
from flashgen.generator.features import FEATURES
from flashgen.generator.load import load_paths, load_spec_file
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import Causal, Dtype, KernelKind, Target
from flashgen.torch import cache, selection
from flashgen.torch.selection import (
    NO_FEATURES,
    SCORE_ARGS,
    AttentionCall,
    TensorMeta,
    UnsupportedCall,
    backward_spec,
    check_problem,
    forward_spec,
    resolve_mask,
    score_features,
    target_for,
)

REPO = Path(__file__).resolve().parent.parent
H200 = (9, 0)


def call(**kw) -> AttentionCall:
    base = {"dtype": Dtype.BF16, "head_dim": 64, "capability": H200}
    return AttentionCall(**{**base, **kw})


def meta(shape, dtype="bfloat16", device="cuda", stride=None) -> TensorMeta:
    if stride is None:
        stride, acc = [], 1
        for n in reversed(shape):
            stride.insert(0, acc)
            acc *= n
    return TensorMeta(tuple(shape), tuple(stride), dtype, device)


# -- the call -> its spec ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("causal", "window", "want"),
    [
        (False, (-1, -1), (Causal.NONE, False, (-1, -1))),
        (True, (-1, -1), (Causal.BOTTOM_RIGHT, False, (-1, -1))),
        (False, (-1, 0), (Causal.BOTTOM_RIGHT, False, (-1, -1))),  # flash-attn: that is causal
        (True, (-1, 7), (Causal.BOTTOM_RIGHT, False, (-1, -1))),  # causal forces right = 0
        (True, (16, -1), (Causal.NONE, True, (16, 0))),
        (False, (16, 4), (Causal.NONE, True, (16, 4))),
        (False, (-1, 4), (Causal.NONE, True, (-1, 4))),
    ],
)
def test_flash_attn_mask_arguments_resolve_to_one_spec_mask(causal, window, want):
    assert resolve_mask(causal, window) == want


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (1,), "ab"])
def test_malformed_windows_are_refused(window):
    with pytest.raises(UnsupportedCall, match="window_size"):
        resolve_mask(False, window)


def test_each_supported_capability_has_its_target_and_others_are_refused():
    assert target_for((8, 0)) is Target.SM80
    assert target_for((8, 6)) is Target.SM86
    assert target_for((8, 9)) is Target.SM89
    assert target_for((9, 0)) is Target.SM90
    for cap in [(7, 5), (8, 7), (10, 0), (12, 0)]:
        with pytest.raises(UnsupportedCall) as err:
            target_for(cap)
        msg = str(err.value)
        assert f"{cap[0]}.{cap[1]}" in msg and "9.0 (sm_90)" in msg


def test_dense_calls_select_the_shipped_kernels():
    """A plain or causal call derives exactly a spec of specs/ (so its AOT build is used)."""
    shipped = {kernel_name(s) for s in load_paths([REPO / "specs"])}
    for dtype in Dtype:
        for d in (32, 64, 96, 128, 192, 256):
            for causal in (Causal.NONE, Causal.BOTTOM_RIGHT):
                c = call(dtype=dtype, head_dim=d, causal=causal)
                assert kernel_name(forward_spec(c)) in shipped
                assert kernel_name(backward_spec(c)) in shipped


def test_derived_spec_carries_every_feature_of_the_call():
    c = call(causal=Causal.BOTTOM_RIGHT, varlen=True, gqa=True, dropout=True, deterministic=True)
    f, b = forward_spec(c), backward_spec(c)
    assert f.kernel is KernelKind.FORWARD and b.kernel is KernelKind.BACKWARD
    assert (f.dtype, f.head_dim, f.target) == (Dtype.BF16, 64, Target.SM90A)  # wgmma forward
    assert (b.dtype, b.head_dim, b.target) == (Dtype.BF16, 64, Target.SM90)
    for s in (f, b):
        assert s.mask.causal is Causal.BOTTOM_RIGHT and s.mask.varlen and not s.mask.window
        assert s.gqa and s.dropout and s.tile_auto
    assert b.deterministic and not f.deterministic  # a forward is deterministic anyway
    assert forward_spec(call(capability=(8, 0))).target is Target.SM80


def test_hopper_prefers_the_wgmma_forward_where_it_serves_the_call():
    assert forward_spec(call()).target is Target.SM90A
    assert forward_spec(call(causal=Causal.BOTTOM_RIGHT, gqa=True, dropout=True)).target is (
        Target.SM90A
    )
    assert forward_spec(call(varlen=True)).target is Target.SM90A


def test_hopper_prefers_the_wgmma_backward_where_it_serves_the_call():
    assert backward_spec(call()).target is Target.SM90A
    assert backward_spec(call(causal=Causal.BOTTOM_RIGHT, gqa=True)).target is Target.SM90A
    assert backward_spec(call(head_dim=128, window=True)).target is Target.SM90A
    assert backward_spec(call(deterministic=True)).target is Target.SM90A
    assert backward_spec(call(varlen=True, causal=Causal.BOTTOM_RIGHT)).target is Target.SM90A
    # what the sm_90a backward does not take falls back to the portable family
    for kw in ({"dropout": True}, {"head_dim": 192}):
        assert backward_spec(call(**kw)).target is Target.SM90, kw


def _unserved(kind: KernelKind, *, but: KernelKind | None = None) -> int:
    """A head dim in 1..256 no family of `kind` serves on the H200 (served by `but`'s, when
    one is), asked of the families: the first such, else any `kind` does not serve."""

    def ok(k, d):
        return selection.head_dim_served(k, H200, d)

    dims = [d for d in range(1, 257) if not ok(kind, d)]
    preferred = [d for d in dims if but is not None and ok(but, d)]
    return (preferred or dims)[0]


def test_backward_head_dims_without_a_kernel_name_the_supported_ones():
    d = _unserved(KernelKind.BACKWARD, but=KernelKind.FORWARD)
    with pytest.raises(UnsupportedCall) as err:
        backward_spec(call(head_dim=d))
    msg = str(err.value)
    dims = ", ".join(map(str, BACKWARD_HEAD_DIMS))
    assert f"head_dim {d} has no backward kernel" in msg and dims in msg
    assert "torch.no_grad()" in msg and "zero-pad" in msg


def test_forward_head_dims_off_the_grid_are_refused():
    d = _unserved(KernelKind.FORWARD)
    dims = ", ".join(map(str, FORWARD_HEAD_DIMS))
    with pytest.raises(UnsupportedCall, match=rf"head_dim {d} has no forward kernel .*{dims}"):
        forward_spec(call(head_dim=d))


def test_the_gpu_tests_and_example_kernels_are_listed_for_building_ahead():
    """examples/torch_kernels.yaml holds exactly the specs of the calls that
    tests/gpu/test_torch.py and examples/train_gpt.py make on an H200."""
    calls = [
        call(dtype=dt, head_dim=d, causal=c)
        for dt in Dtype
        for d in (64, 128)
        for c in (Causal.NONE, Causal.BOTTOM_RIGHT)
    ]
    calls += [  # d_qk 192 with d_v 128 (test_head_dim_v_192_128_matches_the_float64_reference)
        call(dtype=dt, head_dim=192, head_dim_v=128, causal=c)
        for dt in Dtype
        for c in (Causal.NONE, Causal.BOTTOM_RIGHT)
    ]
    calls += [
        call(causal=Causal.BOTTOM_RIGHT, gqa=True),
        call(causal=Causal.BOTTOM_RIGHT, varlen=True),
        call(window=True),
        call(dropout=True),
    ]
    derived = {forward_spec(c) for c in calls} | {backward_spec(c) for c in calls}
    derived.add(backward_spec(call(causal=Causal.BOTTOM_RIGHT, deterministic=True)))
    listed = set(load_spec_file(REPO / "examples" / "torch_kernels.yaml"))
    assert {kernel_name(s) for s in listed} == {kernel_name(s) for s in derived}


# -- tensors --------------------------------------------------------------------------------------


def test_dense_and_varlen_problems():
    pb = check_problem(meta((2, 100, 8, 64)), meta((2, 50, 2, 64)), meta((2, 50, 2, 64)))
    assert (pb.batch, pb.heads, pb.kv_heads, pb.seqlen_q, pb.seqlen_k, pb.head_dim) == (
        2, 8, 2, 100, 50, 64,
    )  # fmt: skip
    assert pb.gqa and not pb.varlen and pb.dtype is Dtype.BF16
    cu = meta((4,), dtype="int32")
    pb = check_problem(
        meta((300, 4, 128), "float16"),
        meta((200, 4, 128), "float16"),
        meta((200, 4, 128), "float16"),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=150,
        max_seqlen_k=90,
    )
    assert (pb.batch, pb.seqlen_q, pb.seqlen_k, pb.varlen, pb.gqa) == (3, 150, 90, True, False)


def test_packed_qkv_views_are_accepted():
    """q = qkv[:, :, 0] of a (b, s, 3, h, d) projection: strides (s*3*h*d, 3*h*d, d, 1)."""
    b, s, h, d = 2, 10, 4, 64
    view = meta((b, s, h, d), stride=(s * 3 * h * d, 3 * h * d, d, 1))
    check_problem(view, view, view)


DENSE = (2, 16, 4, 64)


@pytest.mark.parametrize(
    ("q", "k", "v", "match"),
    [
        (meta(DENSE, device="cpu"), meta(DENSE), meta(DENSE), "CUDA devices only"),
        (meta(DENSE, "float32"), meta(DENSE, "float32"), meta(DENSE, "float32"), "float16 or"),
        (meta(DENSE), meta(DENSE, "float16"), meta(DENSE), "k has dtype float16 but q has"),
        (meta((16, 4, 64)), meta((16, 4, 64)), meta((16, 4, 64)), "3 dimensions"),
        (meta(DENSE, stride=(8192, 512, 64, 2)), meta(DENSE), meta(DENSE), "stride 1"),
        (meta(DENSE, stride=(4100, 260, 65, 1)), meta(DENSE), meta(DENSE), "multiple of 8"),
        (meta(DENSE), meta(DENSE), meta((2, 17, 4, 64)), "same shape but for the last"),
        (meta(DENSE), meta((2, 16, 4, 128)), meta((2, 16, 4, 128)), "head_dim 64 differs"),
        (meta((2, 16, 6, 64)), meta(DENSE), meta(DENSE), "must divide"),
        (meta((3, 16, 4, 64)), meta(DENSE), meta(DENSE), "batch 3"),
    ],
    ids=[
        "cpu",
        "fp32",
        "mixed-dtypes",
        "ndim",
        "strided-head-dim",
        "odd-stride",
        "k-v-shapes",
        "head-dims",
        "kv-heads",
        "batch",
    ],
)
def test_tensors_no_kernel_can_read_are_refused(q, k, v, match):
    with pytest.raises(UnsupportedCall, match=match) as err:
        check_problem(q, k, v)
    assert str(err.value).startswith("flashgen.torch: ")


def test_varlen_needs_both_int32_cu_seqlens_and_max_seqlens():
    t = meta((30, 4, 64))
    with pytest.raises(UnsupportedCall, match="both cu_seqlens"):
        check_problem(t, t, t, cu_seqlens_q=meta((3,), "int32"))
    with pytest.raises(UnsupportedCall, match="int32 CUDA tensor"):
        check_problem(
            t, t, t, cu_seqlens_q=meta((3,), "int64"), cu_seqlens_k=meta((3,), "int32"),
            max_seqlen_q=10, max_seqlen_k=10,
        )  # fmt: skip
    with pytest.raises(UnsupportedCall, match="max_seqlen_k"):
        cu = meta((3,), "int32")
        check_problem(t, t, t, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=10)


def test_v_may_have_its_own_head_dim_and_out_then_has_it():
    q, k, v = meta((2, 16, 4, 192)), meta((2, 20, 2, 192)), meta((2, 20, 2, 128))
    out = meta((2, 16, 4, 128))
    pb = check_problem(q, k, v, extra=[("out", out, "o"), ("dout", out, "o")])
    assert (pb.head_dim, pb.head_dim_v, pb.d_v) == (192, 128, 128)
    assert check_problem(q, k, k).head_dim_v is None
    with pytest.raises(UnsupportedCall, match=r"out has shape .* q's shape with v's head_dim"):
        check_problem(q, k, v, extra=[("out", q, "o")])


def test_a_d_v_call_derives_specs_with_head_dim_v():
    c = call(head_dim=192, head_dim_v=128, causal=Causal.BOTTOM_RIGHT)
    f, b = forward_spec(c), backward_spec(c)
    assert (f.head_dim, f.head_dim_vo, f.target) == (192, 128, Target.SM90A)
    # the sm_90a backward refuses d_v != d: the portable family serves it
    assert (b.head_dim, b.head_dim_vo, b.target) == (192, 128, Target.SM90)
    shipped = {kernel_name(s) for s in load_paths([REPO / "specs"])}
    assert kernel_name(f) in shipped and kernel_name(b) in shipped


def test_a_v_head_dim_no_kernel_takes_is_refused_naming_it():
    with pytest.raises(UnsupportedCall, match="v's head_dim 100 has no forward kernel"):
        forward_spec(call(head_dim=128, head_dim_v=100))


def test_the_backwards_extra_tensors_must_match_q():
    q = meta(DENSE)
    with pytest.raises(UnsupportedCall, match="dout has shape"):
        check_problem(q, q, q, extra=[("dout", meta((2, 17, 4, 64)), "q")])


# -- score-stage features ----------------------------------------------------------------------

EVERY = frozenset(f.name for f in FEATURES)
HEADS, BATCH = 8, 2
# a value of each argument that switches its feature on, for a call of (BATCH, HEADS)
ON = {
    "softcap": 30.0,
    "alibi_slopes": meta((HEADS,), "float32"),
    "learnable_sink": meta((HEADS,), "float32"),
}


def features(**args) -> frozenset:
    return score_features(args, batch=BATCH, heads=HEADS)


def test_the_score_arguments_are_the_registrys():
    assert SCORE_ARGS == tuple(f.torch_arg for f in FEATURES)
    assert set(SCORE_ARGS) == set(ON) == {"softcap", "alibi_slopes", "learnable_sink"}


def test_defaults_switch_nothing_on():
    assert features() is NO_FEATURES
    assert features(softcap=0.0, alibi_slopes=None, learnable_sink=None) is NO_FEATURES
    assert features(softcap=-0.0) is NO_FEATURES
    assert call().features == NO_FEATURES


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
def test_each_argument_switches_on_its_feature(feature):
    assert features(**{feature.torch_arg: ON[feature.torch_arg]}) == {feature.name}


def test_every_argument_together_and_one_set_object_per_combination():
    assert features(**ON) == EVERY
    assert features(**ON) is features(**dict(ON))  # hashed once, whatever the call
    assert features(softcap=1e-3) == {"softcap"} and features(softcap=7) == {"softcap"}


def test_slopes_of_shape_heads_or_batch_heads_and_strides_that_do_not_matter():
    assert features(alibi_slopes=meta((BATCH, HEADS), "float32")) == {"alibi"}
    rows = meta((BATCH, HEADS), "float32", stride=(16, 1))  # a view of wider rows
    assert features(alibi_slopes=rows) == {"alibi"}
    one = dict(batch=1, heads=1)  # one head: the last stride is never used
    assert score_features({"alibi_slopes": meta((1,), "float32", stride=(4,))}, **one)
    assert score_features({"learnable_sink": meta((1,), "float32", stride=(4,))}, **one)
    # varlen: `batch` is the number of sequences
    assert score_features({"alibi_slopes": meta((5, 3), "float32")}, batch=5, heads=3)


SCORE_REFUSALS = [
    ({"softcap": -1.0}, r"softcap=-1.0: allowed 0.0 \(off\) or a finite c > 0"),
    ({"softcap": float("nan")}, r"softcap=nan: allowed 0.0 \(off\) or a finite c > 0"),
    ({"softcap": float("inf")}, r"softcap=inf: allowed"),
    ({"softcap": -float("inf")}, r"softcap=-inf: allowed"),
    ({"softcap": "30"}, r"softcap must be a float \(0.0: off"),
    ({"softcap": True}, r"softcap must be a float \(0.0: off"),
    (
        {"alibi_slopes": meta((8,), "float16")},
        r"alibi_slopes has dtype float16; it must be float32",
    ),
    ({"alibi_slopes": meta((8,), "bfloat16")}, r"alibi_slopes has dtype bfloat16; it must be"),
    ({"alibi_slopes": meta((8,), "float64")}, r"alibi_slopes has dtype float64; it must be"),
    ({"alibi_slopes": meta((8,), "float32", "cpu")}, r"alibi_slopes is on device 'cpu'; it must"),
    (
        {"alibi_slopes": meta((9,), "float32")},
        r"alibi_slopes has shape \(9,\); it must be \(nheads,\) = \(8,\) or "
        r"\(batch, nheads\) = \(2, 8\)",
    ),
    ({"alibi_slopes": meta((3, 8), "float32")}, r"alibi_slopes has shape \(3, 8\); it must be"),
    ({"alibi_slopes": meta((8, 2), "float32")}, r"alibi_slopes has shape \(8, 2\)"),
    ({"alibi_slopes": meta((2, 8, 1), "float32")}, r"alibi_slopes has shape \(2, 8, 1\)"),
    ({"alibi_slopes": meta((), "float32")}, r"alibi_slopes has shape \(\)"),
    (
        {"alibi_slopes": meta((8,), "float32", stride=(2,))},
        r"alibi_slopes's last dimension has stride 2; it must be contiguous",
    ),
    ({"alibi_slopes": meta((2, 8), "float32", stride=(1, 2))}, r"alibi_slopes's last dimension"),
    ({"alibi_slopes": [0.5] * 8}, r"alibi_slopes must be a float32 tensor .* got list"),
    (
        {"learnable_sink": meta((2, 8), "float32")},
        r"learnable_sink has shape \(2, 8\); it must be \(nheads,\) = \(8,\)",
    ),
    ({"learnable_sink": meta((4,), "float32")}, r"learnable_sink has shape \(4,\)"),
    ({"learnable_sink": meta((8,), "bfloat16")}, r"learnable_sink has dtype bfloat16; it must be"),
    ({"learnable_sink": meta((8,), "float32", "cpu")}, r"learnable_sink is on device 'cpu'"),
    ({"learnable_sink": meta((8,), "float32", stride=(3,))}, r"learnable_sink's last dimension"),
    ({"learnable_sink": 0.5}, r"learnable_sink must be a float32 tensor .* got float"),
]


@pytest.mark.parametrize(("args", "match"), SCORE_REFUSALS)
def test_score_arguments_no_kernel_takes_are_refused(args, match):
    with pytest.raises(UnsupportedCall, match=match) as err:
        features(**args)
    assert str(err.value).startswith("flashgen.torch: ")
    with pytest.raises(UnsupportedCall, match=match):  # also beside valid ones
        features(**{**ON, **args})


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: f.name)
@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), H200])
def test_the_derived_specs_carry_the_calls_features(feature, capability):
    plain = call(capability=capability)
    c = call(capability=capability, features=frozenset({feature.name}))
    for kind in (forward_spec, backward_spec):
        spec = kind(c)
        assert spec.features == {feature.name} and spec.has(feature.name)
        assert spec.tile_auto and kind(plain).features == NO_FEATURES
        assert kernel_name(spec) != kernel_name(kind(plain))
        assert spec.target is kind(plain).target  # a feature does not move the call's family


def test_every_feature_with_every_other_feature_of_a_call():
    c = call(causal=Causal.BOTTOM_RIGHT, varlen=True, gqa=True, dropout=True,
             deterministic=True, features=EVERY)  # fmt: skip
    for spec in (forward_spec(c), backward_spec(c)):
        assert spec.features == EVERY and spec.mask.varlen and spec.gqa and spec.dropout
    w = call(window=True, features=EVERY)
    assert forward_spec(w).mask.window and backward_spec(w).features == EVERY


def test_single_feature_calls_select_the_shipped_scoremod_kernels():
    """bf16 calls with one feature at d = 64 and 128 on an H200 derive specs of
    specs/scoremod.yaml (so its AOT builds serve them), but the d = 128 softcap backward: the
    file builds that one with allow_spills, which the derived spec does not set."""
    shipped = {kernel_name(s) for s in load_paths([REPO / "specs" / "scoremod.yaml"])}
    for f in FEATURES:
        for d in (64, 128):
            for causal in (Causal.NONE, Causal.BOTTOM_RIGHT):
                c = call(head_dim=d, causal=causal, features=frozenset({f.name}))
                assert kernel_name(forward_spec(c)) in shipped, (f.name, d, causal)
                if not (f.name == "softcap" and d == 128):
                    assert kernel_name(backward_spec(c)) in shipped, (f.name, d, causal)


def test_hopper_keeps_the_wgmma_families_with_the_features():
    assert forward_spec(call(features=EVERY)).target is Target.SM90A
    assert backward_spec(call(features=EVERY)).target is Target.SM90A
    assert backward_spec(call(dropout=True, features=EVERY)).target is Target.SM90


# -- the cache ------------------------------------------------------------------------------------


class FakeCompiler:
    """compile_specs' signature; writes `<out>/<name>.so` and its report, counts calls."""

    def __init__(self, ok: bool = True) -> None:
        self.calls: list[Path] = []
        self.ok = ok

    def __call__(self, specs, out_dir, *, jobs=None, progress=True):
        out = Path(out_dir)
        self.calls.append(out)
        results = []
        for s in specs:
            if self.ok:
                (out / f"{kernel_name(s)}.so").write_bytes(b"\x7fELF fake")
                (out / f"{kernel_name(s)}.json").write_text("{}")
            results.append(SimpleNamespace(ok=self.ok, error="" if self.ok else "ptxas: boom"))
        return results


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    build, cdir = tmp_path / "build", tmp_path / "cache"
    build.mkdir()
    monkeypatch.setenv("FLASHGEN_BUILD_DIR", str(build))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(cdir))
    return SimpleNamespace(build=build, cache=cdir)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("FLASHGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from flashgen.generator import __version__

    assert cache.cache_dir() == tmp_path / "xdg" / "flashgen" / __version__


def test_a_shipped_build_is_used_before_the_cache_and_nothing_compiles(dirs, capsys):
    spec = forward_spec(call())
    (dirs.build / f"{kernel_name(spec)}.so").write_bytes(b"built")
    compiler = FakeCompiler()
    assert cache.library_for(spec, compiler=compiler) == dirs.build / f"{kernel_name(spec)}.so"
    assert compiler.calls == [] and capsys.readouterr().err == ""


def test_first_use_compiles_once_into_the_cache_with_one_line_of_progress(dirs, capsys):
    spec = forward_spec(call(head_dim=96))
    name = kernel_name(spec)
    compiler = FakeCompiler()
    path = cache.library_for(spec, compiler=compiler)
    assert path == dirs.cache / f"{name}.so" and path.read_bytes() == b"\x7fELF fake"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flashgen: compiling {name} (sm_90")
    assert "done in" in err
    # it compiled in a private directory under the cache, which is gone again
    assert len(compiler.calls) == 1 and compiler.calls[0].parent == dirs.cache
    assert not compiler.calls[0].exists()
    assert sorted(p.name for p in dirs.cache.iterdir()) == sorted(
        [f"{name}.so", f"{name}.json", f"{name}.lock"]
    )
    assert cache.library_for(spec, compiler=compiler) == path  # reused
    assert len(compiler.calls) == 1 and capsys.readouterr().err == ""


def test_a_failed_compile_raises_with_the_compilers_output_and_leaves_nothing(dirs, capsys):
    spec = forward_spec(call(head_dim=112))
    with pytest.raises(cache.CompileFailed, match="ptxas: boom"):
        cache.library_for(spec, compiler=FakeCompiler(ok=False))
    assert capsys.readouterr().err.rstrip().endswith("failed")
    assert [p.name for p in dirs.cache.iterdir()] == [f"{kernel_name(spec)}.lock"]


def test_no_nvcc_says_how_to_build_ahead(dirs):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvcc not found on PATH")

    with pytest.raises(cache.CompileFailed, match="flashgen compile"):
        cache.library_for(forward_spec(call(head_dim=80)), compiler=missing)


def test_concurrent_processes_compile_a_kernel_once(dirs, tmp_path):
    """Four processes ask for one missing kernel at once: one compiles (under the lock), the
    others wait and take its library."""
    counter = tmp_path / "compiles.txt"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        from types import SimpleNamespace
        from flashgen.generator.naming import kernel_name
        from flashgen.torch import cache, selection
        from flashgen.generator.spec import Dtype

        def compiler(specs, out_dir, *, jobs=None, progress=True):
            with open({str(counter)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(0.5)
            name = kernel_name(specs[0])
            (Path(out_dir) / f"{{name}}.so").write_bytes(b"lib")
            return [SimpleNamespace(ok=True, error="")]

        call = selection.AttentionCall(dtype=Dtype.FP16, head_dim=48, capability=(9, 0))
        spec = selection.forward_spec(call)
        print(cache.library_for(spec, compiler=compiler, log=sys.stdout))
        """
    )
    env = {**os.environ}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {out.strip().splitlines()[-1] for out in outs}
    assert len(paths) == 1 and Path(paths.pop()).parent == dirs.cache
    assert len(counter.read_text().split()) == 1


# -- torch stays optional --------------------------------------------------------------------------


def test_selection_and_cache_import_no_torch():
    code = (
        "import sys, flashgen.torch.selection, flashgen.torch.cache; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_without_torch_the_functions_say_how_to_install_it():
    with pytest.raises(
        ImportError, match=r"pip install '\.\[torch\]' \(from a flashgen checkout\)"
    ):
        from flashgen.torch import flash_attn_func  # noqa: F401


def test_unsupported_call_is_a_value_error_naming_the_package():
    err = UnsupportedCall("x")
    assert isinstance(err, ValueError) and str(err) == "flashgen.torch: x"
    assert selection.SOURCE == "flashgen.torch"
