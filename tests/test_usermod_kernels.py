"""A spec's score_mod (issue 26) from the YAML to the kernels' functor and the references:
the spec fields, the parameter slots, the rendered `Spec::UserScore`, the float64 reference
and baseline, the runners' validation and the strategies (no GPU needed; the kernels of
specs/usermod.yaml compile under the nvcc marker)."""

from __future__ import annotations

import numpy as np
import pytest
from flashgen.generator.features import SCORE_PARAMS, USER_PARAMS, USER_SLOTS
from flashgen.generator.features.user import user_score_cpp
from flashgen.generator.load import load_spec_text
from flashgen.generator.naming import kernel_name
from flashgen.generator.render import Renderer
from flashgen.generator.spec import KernelSpec, SpecError
from flashgen.generator.usermod import EXAMPLE_BY_NAME, parse_score_mod
from flashgen.verify import baseline, reference
from flashgen.verify.runner import RunnerError, validate
from flashgen.verify.score_mods import check_score_args
from flashgen.verify.strategies import fixed_score_args, user_params
from hypothesis import given, settings
from hypothesis import strategies as st

BASE = "kernel: forward\ndtype: bf16\nhead_dim: 64\n"
ALIBI = (
    'score_mod: "s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)"\nparams: {slopes: per_head}\n'
)


def one(text: str) -> KernelSpec:
    (spec,) = load_spec_text(text, "u.yaml")
    return spec


# ---- spec fields -----------------------------------------------------------------------------


def test_a_spec_without_score_mod_has_no_score_mod_key_in_its_canonical_form():
    c = one(BASE).to_canonical()
    assert "score_mod" not in c and "params" not in c


def test_a_score_mod_joins_the_canonical_form_and_the_name_by_its_digest():
    spec = one(BASE + ALIBI)
    c = spec.to_canonical()
    assert c["score_mod"] == spec.score_mod.canonical
    assert c["params"] == {"slopes": "per_head"}
    assert f"_um{spec.score_mod.digest()}_" in kernel_name(spec)


def test_every_spelling_of_one_score_mod_names_one_kernel():
    a = one(BASE + ALIBI)
    b = one(BASE + 'score_mod: "(s) - slopes[h]*abs((i+seqlen_k) - seqlen_q - j)"\n'
            "params: {slopes: per_head}\n")  # fmt: skip
    assert a == b and kernel_name(a) == kernel_name(b)


def test_the_canonical_form_of_a_score_mod_reads_back():
    spec = one(BASE + ALIBI)
    assert KernelSpec.from_canonical(spec.to_canonical()) == spec


@pytest.mark.parametrize(
    "extra, where, words",
    [
        ('score_mod: "s + x"\n', "u.yaml:4: score_mod: column 5", "unknown name 'x'"),
        ("params: {a: scalar}\n", "u.yaml:4: params", "give score_mod or mask_mod too"),
        (
            'score_mod: "s * a"\nparams: {a: scalr}\n',
            "u.yaml:5: params.a",
            "did you mean 'scalar'",
        ),
        ('score_mod: "where(s > 0, s, 0.)"\n', "u.yaml:4: score_mod: column 1", "d/ds"),
        ("score_mod: 3\n", "u.yaml:4: score_mod", "expected an expression string"),
        (
            'score_mod: "s + d[i] * 1.0"\nparams: {d: per_token_q}\n',
            "params.d",
            "read by a mask_mod only",
        ),
        ('score_mod: "s"\nparams: {a: scalar}\n', "params.a", "declared but not read"),
        (
            'score_mod: "cap * tanh(s / cap)"\nparams: {cap: scalar}\nsoftcap: true\n',
            "softcap",
            "cannot be combined with score_mod",
        ),
        (ALIBI + "alibi: true\n", "alibi", "cannot be combined with score_mod"),
        (ALIBI + "instrument_io: true\n", "instrument_io", "IO models"),
        (
            'score_mod: "s * a * b2 * c * d2 * e"\n'
            "params: {a: scalar, b2: scalar, c: scalar, d2: scalar, e: scalar}\n",
            "params",
            f"{USER_SLOTS} parameter slots",
        ),
    ],
)
def test_a_score_mod_the_kernels_do_not_serve_is_refused_by_file_line_and_field(
    extra, where, words
):
    with pytest.raises(SpecError) as exc:
        one(BASE + extra)
    assert where in str(exc.value) and words in str(exc.value)


def test_a_family_of_score_mods_is_one_kernel_each():
    specs = load_spec_text(
        BASE + 'score_mod: ["s * 0.5", "s - 1.0"]\n', "u.yaml"
    )  # fmt: skip
    assert [s.score_mod.canonical for s in specs] == ["s * 0.5", "s - 1.0"]


def test_the_sink_composes_with_a_score_mod():
    assert one(BASE + ALIBI + "sink: true\n").has("sink")


# ---- parameter slots and the functor -----------------------------------------------------------


def test_the_user_slots_close_the_score_params_three_fields_a_slot():
    assert SCORE_PARAMS[-len(USER_PARAMS) :] == USER_PARAMS
    assert [r.name for r in USER_PARAMS[:3]] == ["user_ptr0", "user_f0", "user_i0"]
    assert len(USER_PARAMS) == 3 * USER_SLOTS


def test_a_plain_kernel_names_no_user_score_and_a_user_mod_kernel_renders_its_functor():
    r = Renderer()
    plain = r.render(one(BASE)).files
    user = r.render(one(BASE + ALIBI)).files
    (plain_cu,) = [v.decode() for k, v in plain.items() if k.endswith(".cu")]
    (user_cu,) = [v.decode() for k, v in user.items() if k.endswith(".cu")]
    assert "using UserScore = fg::NoUserScore;" in plain_cu
    assert "struct UserScore {" in user_cu and "NoUserScore" not in user_cu


def test_the_functor_reads_declared_slots_and_refuses_the_rest_at_launch():
    mod = parse_score_mod(
        "s + bias[h, min(abs(i - j) // 8, 31)] * w", {"bias": "table", "w": "scalar"}
    )
    cpp = user_score_cpp(mod)
    # slot 0 is `bias` (by name), slot 1 `w`
    assert "v.v_bias = static_cast<const float*>(sp.user_ptr0) + h * v.n_bias;" in cpp
    assert "v.v_w = static_cast<float>(sp.user_f1);" in cpp
    assert '"score_mod parameter bias (table, slot 0): user_ptr0 must be non-null"' in cpp
    assert "if (sp.user_ptr2)" in cpp and "kHasGrad = false" in cpp


def test_the_functor_s_members_are_distinct_whatever_the_parameter_names():
    """`bias` beside `bias_cols`, or a parameter named like the struct: one member each."""
    import re

    mod = parse_score_mod(
        "s + bias[h, 0] * bias_cols + Vals + b_[b]",
        {"bias": "table", "bias_cols": "scalar", "Vals": "scalar", "b_": "per_batch"},
    )
    cpp = user_score_cpp(mod)
    body = cpp.split("struct Vals {", 1)[1].split("};", 1)[0]
    members = re.findall(r"(\w+);", body.replace("int64_t b, h;", "int64_t b; int64_t h;"))
    assert sorted(members) == sorted(
        ["b", "h", "v_bias", "n_bias", "l_bias", "v_bias_cols", "v_Vals", "v_b_"]
    )


def test_a_derivative_other_than_one_is_rendered_as_grad():
    cpp = user_score_cpp(EXAMPLE_BY_NAME["softcap"].parse())
    assert "kHasGrad = true" in cpp and "static __device__ __forceinline__ float grad(" in cpp


# ---- the references ---------------------------------------------------------------------------


def _problem(seed=0, b=2, sq=37, sk=53, h=3, d=16):
    rng = np.random.default_rng(seed)
    shapes = ((b, sq, h, d), (b, sk, h, d), (b, sk, h, d), (b, sq, h, d))
    return tuple(rng.standard_normal(s) for s in shapes)


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_alibi_written_as_a_score_mod_is_the_built_in_alibi(causal):
    q, k, v, do = _problem()
    slopes = np.array([0.5, 0.25, 0.125])
    mod = EXAMPLE_BY_NAME["alibi"].parse()
    o1, l1 = reference.attention_forward(q, k, v, causal=causal, alibi_slopes=slopes)
    o2, l2 = reference.attention_forward(
        q, k, v, causal=causal, score_mod=mod, score_params={"slopes": slopes}
    )
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    g1 = reference.attention_backward(q, k, v, o1, l1, do, causal=causal, alibi_slopes=slopes)
    g2 = reference.attention_backward(
        q, k, v, o2, l2, do, causal=causal, score_mod=mod, score_params={"slopes": slopes}
    )
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)


def test_softcap_written_as_a_score_mod_is_the_built_in_softcap():
    q, k, v, do = _problem(1)
    mod = EXAMPLE_BY_NAME["softcap"].parse()
    o1, l1 = reference.attention_forward(q, k, v, softcap=3.0)
    o2, l2 = reference.attention_forward(q, k, v, score_mod=mod, score_params={"cap": 3.0})
    np.testing.assert_allclose(o1, o2, rtol=0, atol=1e-14)
    g1 = reference.attention_backward(q, k, v, o1, l1, do, softcap=3.0)
    g2 = reference.attention_backward(q, k, v, o2, l2, do, score_mod=mod, score_params={"cap": 3.0})
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", ["softcap", "t5_bias", "bucketed_bias"])
def test_the_reference_backward_of_a_score_mod_is_its_finite_difference(name):
    q, k, v, do = _problem(2, b=1, sq=19, sk=23, h=2, d=8)
    mod = EXAMPLE_BY_NAME[name].parse()
    params = {"cap": 2.0} if name == "softcap" else {"bias": np.linspace(-1, 1, 64).reshape(2, 32)}
    kw = dict(score_mod=mod, score_params=params, causal="none")
    o, lse = reference.attention_forward(q, k, v, **kw)
    dq, dk, _ = reference.attention_backward(q, k, v, o, lse, do, **kw)
    for x, grad, at in ((q, dq, (0, 5, 1, 3)), (k, dk, (0, 7, 0, 2))):
        e = np.zeros_like(x)
        e[at] = 1e-6
        args = [q, k, v]
        idx = 0 if x is q else 1
        plus, minus = list(args), list(args)
        plus[idx], minus[idx] = x + e, x - e
        fd = (
            (reference.attention_forward(*plus, **kw)[0] * do).sum()
            - (reference.attention_forward(*minus, **kw)[0] * do).sum()
        ) / 2e-6
        assert abs(fd - grad[at]) < 1e-6 * max(1.0, abs(fd))


def _fd_check(q, k, v, do, kw, rng, points=5, tol=1e-6):
    """dQ, dK, dV of the reference backward against central differences of sum(O * dO)."""
    o, lse = reference.attention_forward(q, k, v, **kw)
    grads = reference.attention_backward(q, k, v, o, lse, do, **kw)
    for idx, (x, grad) in enumerate(zip((q, k, v), grads)):
        assert np.isfinite(grad).all()
        for _ in range(points):
            at = tuple(int(rng.integers(0, n)) for n in x.shape)
            e = np.zeros_like(x)
            e[at] = 1e-6
            plus, minus = [q, k, v], [q, k, v]
            plus[idx], minus[idx] = x + e, x - e
            fd = (
                (reference.attention_forward(*plus, **kw)[0] * do).sum()
                - (reference.attention_forward(*minus, **kw)[0] * do).sum()
            ) / 2e-6
            assert abs(fd - grad[at]) < tol * max(1.0, abs(fd)), (idx, at, fd, grad[at])


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_the_reference_backward_with_gqa_varlen_and_positions_is_its_finite_difference(causal):
    """An asymmetric, position-dependent derivative (i and j not interchangeable, b and h
    read): GQA sums dK and dV over the group, varlen restarts i and j per sequence."""
    rng = np.random.default_rng(4)
    lq, lk = [5, 9], [7, 12]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, do = (rng.standard_normal((sum(lq), 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((sum(lk), 2, 8)) for _ in range(2))
    mod = parse_score_mod(
        "s * (1 + 0.25 * tanh((i - 2 * j + seqlen_k - seqlen_q) / 4)) * w[h] + t[b]",
        {"w": "per_head", "t": "per_batch"},
    )
    params = {"w": np.array([0.5, 1.0, 1.5, 2.0]), "t": np.array([0.3, -0.2])}
    kw = dict(score_mod=mod, score_params=params, causal=causal, cu_seqlens_q=cu_q)
    _fd_check(q, k, v, do, dict(kw, cu_seqlens_k=cu_k), rng)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_a_derivative_that_is_nan_where_the_mask_hides_the_score_gives_finite_gradients(causal):
    """d/ds = log(i - j + 2) is -inf or NaN above a causal diagonal, where P = 0: dS is 0
    there (0 * NaN would poison dQ and dK), in the reference and the baseline alike."""
    rng = np.random.default_rng(5)
    q, k, v, do = _problem(6, b=1, sq=9, sk=13, h=2, d=8)
    shift = " + seqlen_k - seqlen_q" if causal == "bottom_right" else ""
    mod = parse_score_mod(f"s * log(i{shift} - j + 2)", {})
    kw = dict(score_mod=mod, score_params={}, causal=causal)
    with np.errstate(all="raise"):
        _fd_check(q, k, v, do, kw, rng)
        ob, lb = baseline.attention_forward(q, k, v, dtype="bf16", **kw)
        grads = baseline.attention_backward(q, k, v, ob, lb, do, dtype="bf16", **kw)
    assert all(np.isfinite(g).all() for g in grads)


def test_the_gpu_suite_s_gradient_floors_take_a_score_mod_and_scale_by_its_derivative():
    """tests/gpu/test_backward.py passes the reference's keywords, a score_mod's included,
    to gradient_floors: every backward check of a score_mod kernel goes through it."""
    from flashgen.tests.gpu.test_backward import gradient_floors

    q, k, v, do = _problem(7, b=1, sq=11, sk=17, h=2, d=8)
    plain = dict(causal="bottom_right")
    o, lse = reference.attention_forward(q, k, v, **plain)
    base = gradient_floors((q, k, v, o, lse, do), **plain)
    twice = dict(plain, score_mod=parse_score_mod("2 * s", {}), score_params={})
    o2, lse2 = reference.attention_forward(q / 2, k, v, **twice)  # the same logits
    scaled = gradient_floors((q / 2, k, v, o2, lse2, do), **twice)
    # dS doubles through d(mod)/ds = 2: dQ = dS K doubles, dK = dS^T Q with Q halved does not
    assert scaled["dq"] == pytest.approx(2 * base["dq"], rel=1e-12)
    assert scaled["dk"] == pytest.approx(base["dk"], rel=1e-12)


def test_the_baseline_applies_a_score_mod_in_float32():
    q, k, v, do = _problem(3)
    mod = EXAMPLE_BY_NAME["t5_bias"].parse()
    bias = np.linspace(-2, 2, 96).reshape(3, 32)
    kw = dict(score_mod=mod, score_params={"bias": bias})
    o64, _ = reference.attention_forward(q, k, v, **kw)
    ob, lb = baseline.attention_forward(q, k, v, dtype="bf16", **kw)
    assert ob.dtype == np.float32 and np.abs(ob - o64).max() < 0.05
    grads = baseline.attention_backward(q, k, v, ob, lb, do, dtype="bf16", **kw)
    assert all(np.isfinite(g).all() for g in grads)


# ---- runners and strategies ---------------------------------------------------------------------


def test_the_runner_refuses_a_score_mod_kernel_without_its_params():
    spec = one(BASE + ALIBI)
    q, k, v, _ = _problem(d=64)
    with pytest.raises(RunnerError, match="pass score_params \\(slopes: per_head\\)"):
        validate(spec, q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(RunnerError, match="must have shape \\(3,\\)"):
        validate(spec, q, k, v, score_params={"slopes": np.ones(4)})


def test_the_runner_takes_the_params_rounded_to_float32_as_the_device_holds_them():
    spec = one(BASE + ALIBI)
    q, k, v, _ = _problem(d=64)
    pb = validate(spec, q, k, v, score_params={"slopes": np.array([0.1, 0.2, 0.3])})
    s = pb.score.score_params["slopes"]
    np.testing.assert_array_equal(s, np.float32([0.1, 0.2, 0.3]).astype(np.float64))
    assert pb.score.kwargs()["score_mod"] == spec.score_mod


def test_array_params_named_like_the_inputs_do_not_replace_them_in_res_inputs():
    from flashgen.verify.runner import score_inputs

    mod = parse_score_mod("s + k[h, 0] + lse[h]", {"k": "table", "lse": "per_head"})
    table, slopes = np.ones((3, 2)), np.zeros(3)
    args = check_score_args(
        0.0, None, None, batch=2, heads=3, score_mod=mod, score_params={"k": table, "lse": slopes}
    )
    assert set(score_inputs(args)) == {"score_params.k", "score_params.lse"}


def test_a_plain_spec_refuses_score_params():
    q, k, v, _ = _problem(d=64)
    with pytest.raises(RunnerError):
        validate(one(BASE), q, k, v, score_params={"slopes": np.ones(3)})


def test_fixed_score_args_give_every_declared_parameter():
    spec = one(BASE + ALIBI)
    args = fixed_score_args(spec, 2, 3)
    assert set(args.score_params) == {"slopes"} and args.score_mod == spec.score_mod


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_drawn_params_are_valid_for_the_shipped_score_mods(data):
    name = data.draw(st.sampled_from(["alibi", "softcap", "bucketed_bias", "t5_bias"]))
    mod = EXAMPLE_BY_NAME[name].parse()
    values = data.draw(user_params(mod, 2, 3))
    args = check_score_args(0.0, None, None, batch=2, heads=3, score_mod=mod, score_params=values)
    q, k, v, _ = _problem(d=8)
    o, lse = reference.attention_forward(q, k, v, **args.kwargs())
    assert np.isfinite(o).all()


@pytest.mark.nvcc
def test_every_kernel_of_specs_usermod_compiles_without_unallowed_spills(tmp_path):
    import shutil
    from pathlib import Path

    from flashgen.generator.compile import compile_specs
    from flashgen.generator.load import load_paths

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    specs = load_paths([Path(__file__).resolve().parents[1] / "specs" / "usermod.yaml"])
    results = compile_specs(specs, tmp_path, jobs=2, progress=False)
    bad = [(r.kernel, r.error) for r in results if not r.ok or r.spill_error]
    assert bad == []


class _StubGpu:
    """Enough of verify.runner.Gpu for the runners' uploads (addresses only, no device)."""

    class cuda:  # noqa: N801 - PyCUDA's module name
        _next = [0x10000]

        @classmethod
        def mem_alloc(cls, n):
            class Alloc(int):
                def free(self):
                    pass

            cls._next[0] += 1 << 20
            return Alloc(cls._next[0])

        @staticmethod
        def memset_d8(*args):
            pass

        @staticmethod
        def memcpy_htod(*args):
            pass


@pytest.mark.nvcc
def test_the_c_launch_check_accepts_the_runner_s_slots_and_refuses_bad_ones(tmp_path):
    """The slots as verify.runner fills them (the Python tables) pass the kernel's C check
    (Spec::UserScore::check, host code: no GPU), and a NULL, misaligned or stray slot is
    refused by name."""
    import shutil

    from flashgen.generator.compile import compile_specs
    from flashgen.runtime import KernelLibrary
    from flashgen.verify.runner import user_slot_params

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    spec = one(
        "kernel: forward\ndtype: bf16\nhead_dim: 32\n"
        'score_mod: "s * w + bias[h, min(abs(i - j) // 8, 31)] + p[b] + n"\n'
        "params: {bias: table, w: scalar, p: per_batch_int, n: scalar_int}\n"
    )
    plain = one("kernel: forward\ndtype: bf16\nhead_dim: 32\n")
    results = compile_specs([spec, plain], tmp_path, jobs=2, progress=False)
    assert all(r.ok for r in results), [r.error for r in results]
    lib = KernelLibrary(spec, tmp_path)
    good = {
        **dict(q=0x1000, k=0x2000, v=0x3000, o=0x4000, lse=0x5000, q_row_stride=96),
        **dict(batch=2, heads=3, kv_heads=3, seqlen_q=3, seqlen_k=4, softmax_scale=0.125),
        **dict(window_left=-1, window_right=-1, head_dim=32, head_dim_v=32),
    }
    values = {"bias": np.ones((3, 5)), "w": 0.5, "p": np.array([1, 2]), "n": 0}
    args = check_score_args(
        0.0, None, None, batch=2, heads=3, score_mod=spec.score_mod, score_params=values
    )
    slots = user_slot_params(_StubGpu(), args, [])
    # slot k is the k-th name: bias 0, n 1, p 2, w 3
    assert set(slots) == {"user_ptr0", "user_i0", "user_i1", "user_ptr2", "user_f3"}
    assert slots["user_i0"] == 5 and slots["user_f3"] == 0.5
    assert lib.check({**good, **slots}) is None
    for change, words in (
        ({"user_ptr0": 0}, "bias (table, slot 0): user_ptr0 must be non-null"),
        ({"user_ptr2": slots["user_ptr2"] + 2}, "user_ptr2 must be 4-byte aligned"),
        ({"user_i0": 0}, "user_i0 (its columns) must be >= 1"),
        ({"user_f3": float("inf")}, "user_f3 must be finite"),
        ({"user_f1": 1.0}, "user_f1 is set but slot 1 is n"),
    ):
        assert words in (lib.check({**good, **slots, **change}) or "")
    # a kernel without a score_mod refuses any user slot
    refused = KernelLibrary(plain, tmp_path).check({**good, "user_i3": 1})
    assert "generated without score_mod" in (refused or "")


def test_the_helpers_header_is_the_front_end_s_cpp_helpers():
    """templates/include/flashgen/usermod_helpers.h is `usermod.CPP_HELPERS` (the helpers the
    emitted expressions call) under one banner line."""
    from flashgen.generator.paths import TEMPLATES_DIR
    from flashgen.generator.usermod import CPP_HELPERS

    text = (TEMPLATES_DIR / "include" / "flashgen" / "usermod_helpers.h").read_text()
    banner, rest = text.split("\n", 1)
    assert banner.startswith("// generated from generator/usermod/emit.py (CPP_HELPERS)")
    assert rest == CPP_HELPERS.lstrip("\n")
