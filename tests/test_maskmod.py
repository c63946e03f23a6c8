"""mask_mod in the kernels (issue 26): the spec field and its refusals, and the rendered
`Spec::UserMask` (generator/features/user_mask.py) compiled for the host and checked on every
tile box of small shapes against the Python classifier (generator/usermod/blocks.py) and the
element-wise mask (the float32 and float64 evaluators), for the shipped masks and random mask
trees; and every kernel of specs/maskmod.yaml compiled with nvcc without spills."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flashgen.generator import usermod as U
from flashgen.generator.features.user_mask import user_mask_cpp
from flashgen.generator.spec import SpecError
from flashgen.generator.usermod import Binary, Call, Type, walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_usermod import PARAMS, VALUES, random_trees, trees

REPO = Path(__file__).resolve().parent.parent
INCLUDE = REPO / "templates" / "include" / "flashgen"
CXX = shutil.which("g++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")


# ---------------------------------------------------------------------------------------------
# the spec field
# ---------------------------------------------------------------------------------------------


def build(**values):
    from flashgen.generator.load import load_spec_text

    lines = ["kernels:", "  - kernel: forward", "    dtype: bf16", "    head_dim: 64"]
    lines += [f"    {k}: {v}" for k, v in values.items()]
    return load_spec_text("\n".join(lines) + "\n", "t.yaml")


def test_mask_mod_joins_the_name_and_shares_params_with_score_mod():
    (spec,) = build(mask_mod='"i // c == j // c"', params="{c: scalar_int}")
    assert spec.mask_mod.canonical == "i // c == j // c"
    from flashgen.generator.naming import kernel_name

    assert f"_mm{spec.mask_mod.digest()}_" in kernel_name(spec)
    (both,) = build(
        mask_mod='"i // c == j // c"',
        score_mod='"cap * tanh(s / cap)"',
        params="{c: scalar_int, cap: scalar}",
    )
    assert both.params == {"c": U.ParamKind.SCALAR_INT, "cap": U.ParamKind.SCALAR}
    assert "mask_mod" in both.to_canonical()


@pytest.mark.parametrize(
    "values, field, words",
    [
        ({"mask_mod": '"i - j"'}, "mask_mod", "must give a bool"),
        ({"mask_mod": '"s > 0"'}, "mask_mod", "not available in a mask_mod"),
        ({"mask_mod": '"j <= q"'}, "mask_mod", "unknown"),
        ({"mask_mod": '"j <= i"', "params": "{c: scalar_int}"}, "params.c", "not read"),
        ({"mask_mod": '"j <= i"', "kernel": "decode"}, "mask_mod", "applies to kernel"),
        ({"mask_mod": '"j <= i"', "sparsity": "block"}, "sparsity", "cannot be combined"),
        ({"mask_mod": '"j <= i"', "instrument_io": "true"}, "instrument_io", "cannot be"),
        (
            {"mask_mod": '"j <= i"', "dropout": "true", "debug_keep_mask": "true"},
            "debug_keep_mask",
            "cannot be",
        ),
        ({"score_mod": '"s + doc[i]"', "params": "{doc: per_token}"}, "params.doc", "mask_mod"),
    ],
)
def test_mask_mod_refusals_name_the_field_and_what_is_allowed(values, field, words):
    values = dict(values)
    lines = {k: v for k, v in values.items() if k != "kernel"}
    from flashgen.generator.load import load_spec_text

    kernel = values.get("kernel", "forward")
    text = "kernels:\n  - kernel: " + kernel + "\n    dtype: bf16\n    head_dim: 64\n"
    text += "".join(f"    {k}: {v}\n" for k, v in lines.items())
    with pytest.raises(SpecError) as e:
        load_spec_text(text, "t.yaml")
    msg = str(e.value)
    assert "t.yaml:" in msg and field in msg and words in msg, msg


def test_the_sm90a_backward_is_refused():
    from flashgen.generator.load import load_spec_text

    text = (
        "kernels:\n  - kernel: backward\n    target: sm_90a\n    dtype: bf16\n"
        '    head_dim: 128\n    mask_mod: "j <= i"\n'
    )
    with pytest.raises(SpecError, match="backward, target: sm_90a"):
        load_spec_text(text, "t.yaml")


# ---------------------------------------------------------------------------------------------
# the rendered functor on the host
# ---------------------------------------------------------------------------------------------

_PRELUDE = """#include <cstdio>
#include <cstdint>
#define __device__
#define __forceinline__ inline
#define __ldg(p) (*(p))
#include "usermod_helpers.h"
#include "mask_mod_iv.h"
struct fg_score_params {
%s};
"""


def _slots(n: int) -> str:
    return "".join(
        f"  const void* user_ptr{k}; double user_f{k}; int64_t user_i{k};\n" for k in range(n)
    )


def _c_array(name: str, ctype: str, values: np.ndarray) -> str:
    items = ", ".join(repr(float(v)) if ctype == "float" else str(int(v)) for v in values.ravel())
    return f"static const {ctype} {name}[] = {{{items}}};\n"


def run_host(mods: list[U.UserMod], values: dict, cases, tmp_path: Path) -> list:
    """For each mod and each case (b, h, sq, sk): the C++ classes of every box (i0 <= i1 <
    sq, j0 <= j1 < sk, in that loop order) and the visibility of every (i, j)."""
    params = dict(mods[0].params)
    n = len(params)
    structs, arrays, sets = [], [], []
    for k, mod in enumerate(mods):
        structs.append(user_mask_cpp(mod, indent="").replace("struct UserMask", f"struct M{k}"))
    for slot, (name, kind) in enumerate(sorted(params.items())):
        v = values[name]
        if kind in (U.ParamKind.SCALAR_INT,):
            sets.append(f"sp.user_i{slot} = {int(v)};")
        elif kind is U.ParamKind.SCALAR:
            sets.append(f"sp.user_f{slot} = {float(v)!r};")
        else:
            ctype = "float" if U.KIND_INFO[kind].type is Type.FLOAT else "int32_t"
            arrays.append(_c_array(f"a_{name}", ctype, np.asarray(v)))
            sets.append(f"sp.user_ptr{slot} = a_{name};")
            if kind is U.ParamKind.TABLE:
                sets.append(f"sp.user_i{slot} = {np.asarray(v).shape[1]};")
    body = []
    for k in range(len(mods)):
        for b, h, sq, sk in cases:
            body.append(
                f"  {{ M{k}::Vals v; M{k}::load(sp, {b}, {h}, 0, 0, v);\n"
                f"    for (int i0 = 0; i0 < {sq}; ++i0) for (int i1 = i0; i1 < {sq}; ++i1)\n"
                f"    for (int j0 = 0; j0 < {sk}; ++j0) for (int j1 = j0; j1 < {sk}; ++j1)\n"
                f"      putchar('0' + M{k}::classify(v, i0, i1, j0, j1, {sq}, {sk}));\n"
                f"    putchar(' ');\n"
                f"    for (int i = 0; i < {sq}; ++i) for (int j = 0; j < {sk}; ++j)\n"
                f"      putchar('0' + M{k}::visible(v, i, j, {sq}, {sk}));\n"
                f"    putchar('\\n'); }}\n"
            )
    source = (
        _PRELUDE % _slots(max(n, 4))
        + "".join(arrays)
        + "\n".join(structs)
        + "\nint main() {\n  fg_score_params sp{};\n  "
        + "\n  ".join(sets)
        + "\n"
        + "".join(body)
        + "  return 0;\n}\n"
    )
    (tmp_path / "mask.cpp").write_text(source)
    proc = subprocess.run(
        [CXX, "-std=c++17", "-O1", "-I", str(INCLUDE), "-o", "mask", "mask.cpp"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = subprocess.run(["./mask"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(mods) * len(cases)
    out, it = [], iter(lines)
    for _ in mods:
        row = []
        for _b, _h, sq, sk in cases:
            cls, vis = next(it).split(" ")
            row.append(([int(c) for c in cls], np.array([int(c) for c in vis]).reshape(sq, sk)))
        out.append(row)
    return out


def boxes(sq: int, sk: int):
    for i0 in range(sq):
        for i1 in range(i0, sq):
            for j0 in range(sk):
                for j1 in range(j0, sk):
                    yield i0, i1, j0, j1


def floats_decide(tree: U.Expr) -> bool:
    """Whether a comparison of floats (or a floor of one) occurs: the C++ classifier does not
    bound floats and may say PARTIAL where blocks.py decides."""
    for n in walk(tree):
        if isinstance(n, Binary) and n.op in ("<", "<=", ">", ">=", "==", "!="):
            if n.left.type is not Type.INT or n.right.type is not Type.INT:
                return True
        if isinstance(n, Call) and n.func == "floor" and n.args[0].type is Type.FLOAT:
            return True
    return False


def check(mods, values, cases, told, tmp_path):
    """C++ against blocks.py (equal where no float decides, else equal or PARTIAL), against
    the element-wise mask in float32 and float64 (sound), and visible() against the
    float32 evaluator (equal)."""
    got = run_host(mods, values, cases, tmp_path)
    for mod, row in zip(mods, got):
        tree, exact = mod.tree, not floats_decide(mod.tree)
        for (b, h, sq, sk), (cls, vis) in zip(cases, row):
            env = {"b": b, "h": h, "i": np.arange(sq)[:, None], "j": np.arange(sk)[None, :]}
            env.update(seqlen_q=sq, seqlen_k=sk)
            m32 = np.broadcast_to(U.evaluate(tree, env, values, dtype=np.float32), (sq, sk))
            m64 = np.broadcast_to(U.evaluate(tree, env, values, dtype=np.float64), (sq, sk))
            assert (vis == m32).all(), (mod.canonical, b, h)
            for c, (i0, i1, j0, j1) in zip(cls, boxes(sq, sk)):
                for m in (m32, m64):
                    block = m[i0 : i1 + 1, j0 : j1 + 1]
                    assert c != 2 or block.all(), (mod.canonical, i0, i1, j0, j1)
                    assert c != 0 or not block.any(), (mod.canonical, i0, i1, j0, j1)
                py = U.classify_block(
                    tree, i=(i0, i1), j=(j0, j1), b=b, h=h, seqlen_q=sq, seqlen_k=sk, params=told
                )
                ok = c == int(py) or (not exact and c == 1)
                assert ok, (mod.canonical, (i0, i1, j0, j1), c, int(py))


def _mask(tree: U.Expr) -> U.UserMod:
    return U.UserMod("mask_mod", tree, tuple(sorted(U.check_params(PARAMS).items())))


# what blocks.py is told: every value (the kernel bounds per-token vectors over each tile too)
_TOLD = dict(VALUES)
_CASES = [(0, 0, 6, 7), (1, 2, 6, 7), (1, 1, 5, 3)]


@needs_cxx
def test_host_classifier_matches_blocks_py_on_random_mask_trees(tmp_path):
    mods = [_mask(t) for t in random_trees(31, 40, Type.BOOL, s=False, transcendental=False)]
    mods += [_mask(t) for t in random_trees(32, 20, Type.BOOL, s=False, pure_ints=True)]
    check(mods, VALUES, _CASES, _TOLD, tmp_path)


@needs_cxx
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(trees(Type.BOOL, depth=4, s=False, transcendental=False), min_size=4, max_size=8))
def test_host_classifier_matches_blocks_py_on_drawn_mask_trees(tmp_path, drawn):
    check([_mask(t) for t in drawn], VALUES, _CASES[:2], _TOLD, tmp_path)


def _example(name: str) -> U.UserMod:
    return U.EXAMPLE_BY_NAME[name].parse()


@needs_cxx
@pytest.mark.parametrize(
    "name, values",
    [
        ("causal", {}),
        ("causal_bottom_right", {}),
        ("sliding_window", {"window": 3}),
        ("chunked", {"chunk": 4}),
        ("prefix_lm", {"prefix": np.array([5, 2])}),
        ("document", {"doc": np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3])}),
    ],
)
def test_host_classifier_of_the_shipped_masks(tmp_path, name, values):
    mod = _example(name)
    cases = [(0, 0, 12, 12), (1, 0, 9, 12), (1, 1, 12, 7)]
    check([mod], values, cases, values, tmp_path)
    # exact (document ids consecutive): equal to the truth on every box
    got = run_host([mod], values, cases, tmp_path)[0]
    for (b, _h, sq, sk), (cls, _) in zip(cases, got):
        env = {"b": b, "i": np.arange(sq)[:, None], "j": np.arange(sk)[None, :]}
        env.update(seqlen_q=sq, seqlen_k=sk)
        m = np.broadcast_to(U.evaluate(mod.tree, env, values), (sq, sk))
        for c, (i0, i1, j0, j1) in zip(cls, boxes(sq, sk)):
            block = m[i0 : i1 + 1, j0 : j1 + 1]
            want = 2 if block.all() else 0 if not block.any() else 1
            assert c == want, (name, i0, i1, j0, j1)


# ---------------------------------------------------------------------------------------------
# the shipped kernels compile without spills
# ---------------------------------------------------------------------------------------------


@pytest.mark.nvcc
@pytest.mark.nvcc_sweep
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_every_maskmod_kernel_compiles_without_spills(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashgen.generator",
            "compile",
            str(REPO / "specs" / "maskmod.yaml"),
            "-o",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SPILLS" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# the references
# ---------------------------------------------------------------------------------------------


def _qkv(rng, b, sq, sk, h, d=8):
    return (rng.standard_normal(shape) for shape in ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d)))


@pytest.mark.parametrize(
    "name, values, builtin",
    [
        ("causal", {}, {"causal": "top_left"}),
        ("causal_bottom_right", {}, {"causal": "bottom_right"}),
        ("sliding_window", {"window": 3}, {"causal": "top_left", "window": (3, 0)}),
    ],
)
def test_reference_mask_mod_is_the_built_in_mask(name, values, builtin):
    from flashgen.verify import baseline, reference

    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 2, 13, 9, 2)
    mod = _example(name)
    from functools import partial

    for attention in (
        reference.attention_forward,
        partial(baseline.attention_forward, dtype="bf16"),
    ):
        o, lse = attention(q, k, v, mask_mod=mod, score_params=values)
        o2, lse2 = attention(q, k, v, **builtin)
        np.testing.assert_array_equal(o, o2)
        np.testing.assert_array_equal(lse, lse2)


def test_reference_document_mask_is_attention_within_each_document_and_composes():
    from flashgen.verify import reference

    rng = np.random.default_rng(4)
    lens = [9, 6]
    cu = np.array([0, 9, 15], dtype=np.int32)
    doc = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4])
    q, k, v = (rng.standard_normal((15, 2, 8)) for _ in range(3))
    mod = _example("document")
    kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "mask_mod": mod, "score_params": {"doc": doc}}
    o, lse = reference.attention_forward(q, k, v, **kw)
    for lo, hi in ((0, 3), (3, 7), (7, 9), (9, 12), (12, 15)):
        o1, _ = reference.attention_forward(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi])
        np.testing.assert_allclose(o[lo:hi], o1[0], rtol=0, atol=1e-12)
    # with causal: ANDed
    oc, _ = reference.attention_forward(q, k, v, causal="top_left", **kw)
    o1, _ = reference.attention_forward(q[None, 3:7], k[None, 3:7], v[None, 3:7], causal="top_left")
    np.testing.assert_allclose(oc[3:7], o1[0], rtol=0, atol=1e-12)
    # a per_token vector needs queries and keys to be the same tokens
    bad = dict(kw, cu_seqlens_k=np.array([0, 8, 15], dtype=np.int32))
    with pytest.raises(ValueError, match="same tokens"):
        reference.attention_forward(q, k, v, **bad)
    assert sum(lens) == 15


def test_rows_that_see_nothing_give_zero_minus_inf_and_zero_gradients():
    from flashgen.verify import reference

    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 8, 8, 1)
    mod = U.parse_mask_mod("i >= 4 and j <= i")
    o, lse = reference.attention_forward(q, k, v, mask_mod=mod, score_params={})
    assert (o[0, :4] == 0).all() and np.isneginf(lse[0, 0, :4]).all()
    do = rng.standard_normal(o.shape)
    dq, dk, dv = reference.attention_backward(q, k, v, o, lse, do, mask_mod=mod, score_params={})
    assert (dq[0, :4] == 0).all() and np.isfinite(dq).all() and np.isfinite(dk).all()
    assert np.isfinite(dv).all()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_drawn_mask_mod_specs_build_and_their_params_are_drawn(data):
    from flashgen.generator.spec import KernelKind, Target
    from flashgen.verify import reference
    from flashgen.verify.strategies import mask_mods, score_args, valid_specs

    mod = data.draw(mask_mods())
    spec = data.draw(
        valid_specs(
            head_dims=[64],
            target=Target.SM90,
            kernel=KernelKind.FORWARD,
            dropout=False,
            debug_keep_mask=False,
        )
    )
    from flashgen.generator.spec import Mask, Sparsity

    spec = spec.replace(
        mask_mod=mod, sparsity=Sparsity.NONE, instrument_io=False, mask=Mask(spec.mask.causal)
    )
    tokens = (2 * 11, 2 * 11)
    score = data.draw(score_args(spec, 2, 2, tokens))
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 11, 11, 2)
    o, lse = reference.attention_forward(q, k, v, causal=spec.mask.causal.yaml, **score.kwargs())
    assert np.isfinite(o).all()


# -- the GPU tests' inputs against the runners' validation -------------------------------------


def test_the_gpu_tests_inputs_for_every_maskmod_kernel_pass_the_runners_validation():
    """What tests/gpu/test_forward.py and test_backward.py hand the runners for each shipped
    mask_mod kernel (their own input builders, drawn by their own strategies) is accepted by
    the runners' validation, which runs before anything touches a GPU. On an H200 the whole
    mask_mod suite once failed at this step (a keyword the runners did not take)."""
    from flashgen.generator.load import load_paths
    from flashgen.generator.paths import PACKAGE_ROOT
    from flashgen.tests.gpu import test_backward as tb
    from flashgen.tests.gpu import test_forward as tf
    from flashgen.verify import runner, runner_bwd

    specs = load_paths([PACKAGE_ROOT / "specs" / "maskmod.yaml"])
    assert specs and all(s.mask_mod is not None for s in specs)

    def check(spec):
        backward = spec.kernel.yaml == "backward"

        @settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=tb.bwd_case(spec) if backward else tf.runtime_case(spec))
        def prop(case):
            if backward:
                q, k, v, dout, run_kw, _ = tb.make_inputs(spec, case)
                lse_shape = (
                    (q.shape[1], q.shape[0])
                    if q.ndim == 3
                    else (q.shape[0], q.shape[2], q.shape[1])
                )
                o, lse = np.zeros_like(q), np.zeros(lse_shape, np.float32)
                runner_bwd.validate_bwd(spec, q, k, v, o, lse, dout, **run_kw)
            else:
                q, k, v, kwargs = tf.make_inputs(spec, case)
                runner.validate(spec, q, k, v, **kwargs)

        prop()

    for spec in specs:
        check(spec)
