"""d_v != d (`head_dim_v`): the spec field, its refusals, the shared-memory formulas, the IO
models, the reference's shapes and the runners' checks. No GPU: the kernels themselves are
checked by tests/gpu (specs/dv.yaml) and compiled by `flashgen compile specs/dv.yaml`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from flashgen.generator.families import backward as bwd
from flashgen.generator.families import family
from flashgen.generator.families import forward_sm90 as fwd90
from flashgen.generator.load import load_spec_file, load_spec_text
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import SpecError, Tile
from flashgen.generator.tiles import smem_bytes as fwd_smem_bytes
from flashgen.verify import baseline, reference
from flashgen.verify.io_model import forward_bytes
from flashgen.verify.io_model_bwd import backward_bytes
from flashgen.verify.runner import RunnerError, validate
from flashgen.verify.runner_bwd import validate_bwd
from hypothesis import given, settings
from hypothesis import strategies as st


def one(text: str):
    (spec,) = load_spec_text(text, "dv.yaml")
    return spec


FWD = "kernel: forward\ndtype: bf16\nhead_dim: 192\nhead_dim_v: 128\n"
BWD = "kernel: backward\ndtype: bf16\nhead_dim: 192\nhead_dim_v: 128\n"


# -- the spec field ------------------------------------------------------------------------------


def test_head_dim_v_names_the_kernel_and_joins_its_canonical_form():
    spec = one(FWD)
    assert (spec.head_dim, spec.head_dim_v, spec.head_dim_vo) == (192, 128, 128)
    assert kernel_name(spec).startswith("fa_fwd_d192_v128_bf16_")
    assert spec.to_canonical()["head_dim_v"] == 128
    assert type(spec).from_canonical(spec.to_canonical()) == spec


def test_without_head_dim_v_the_canonical_form_has_no_such_key():
    spec = one("kernel: forward\ndtype: bf16\nhead_dim: 128\n")
    assert spec.head_dim_v is None and spec.head_dim_vo == 128
    assert "head_dim_v" not in spec.to_canonical()
    assert "_v" not in kernel_name(spec).split("_bf16")[0]


def test_head_dim_v_equal_to_head_dim_is_the_kernel_without_it():
    same = one("kernel: forward\ndtype: bf16\nhead_dim: 128\nhead_dim_v: 128\n")
    plain = one("kernel: forward\ndtype: bf16\nhead_dim: 128\n")
    assert same == plain and kernel_name(same) == kernel_name(plain)


def test_head_dim_v_is_a_family_axis():
    specs = load_spec_text(
        "kernel: forward\ndtype: bf16\nhead_dim: 192\nhead_dim_v: [64, 128, 192]\n", "dv.yaml"
    )
    assert [s.head_dim_vo for s in specs] == [64, 128, 192]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "kernel: backward\ndtype: bf16\nhead_dim: 128\nhead_dim_v: 64\ntarget: sm_90a\n",
            r"dv.yaml:4: head_dim_v: 64 with head_dim 128 is not served by the backward_sm90 "
            r"family on sm_90a \(allowed: head_dim_v = head_dim only",
        ),
        (
            "kernel: decode\ndtype: bf16\nhead_dim: 128\nhead_dim_v: 64\n",
            r"head_dim_v: 64 with head_dim 128 is not served by the decode family on sm_90 "
            r"\(allowed: head_dim_v = head_dim only",
        ),
        (
            "kernel: forward\ndtype: bf16\nhead_dim: 128\nhead_dim_v: 264\n",
            r"head_dim_v: 264 is not allowed \(allowed: multiples of 8 in 8..256\)",
        ),
        (
            "kernel: backward\ndtype: bf16\nhead_dim: 128\nhead_dim_v: 100\n",
            r"head_dim_v: 100 is not allowed \(allowed: multiples of 8 in 8..256\)",
        ),
        (
            "kernel: forward\ndtype: bf16\nhead_dim: 128\nhead_dim_v: 12.0\n",
            r"head_dim_v: 12.0 is a float, expected an integer",
        ),
    ],
)
def test_head_dims_no_family_builds_are_refused_when_the_spec_loads(text, message):
    with pytest.raises(SpecError, match=message):
        load_spec_text(text, "dv.yaml")


def test_the_shipped_specs_cover_both_families_both_dtypes_and_both_masks():
    specs = load_spec_file(Path(__file__).parents[1] / "specs" / "dv.yaml")
    seen = {(s.kernel.yaml, s.target.yaml, s.dtype.yaml, s.mask.causal.yaml) for s in specs}
    assert all((s.head_dim, s.head_dim_vo) == (192, 128) for s in specs)
    for kind, target in (("forward", "sm_90"), ("backward", "sm_90"), ("forward", "sm_90a")):
        for dt in ("fp16", "bf16"):
            for causal in ("none", "bottom_right"):
                assert (kind, target, dt, causal) in seen


# -- shared memory -------------------------------------------------------------------------------


def test_forward_smem_counts_v_tiles_at_d_v():
    tile = Tile(128, 64, 8, 2)
    row = lambda d: (-(-d // 16) * 16 + 8) * 2  # noqa: E731 - bytes of one padded bf16 row
    want = (128 + 2 * 64) * row(192) + 2 * 64 * row(128)
    spec = one(FWD + "target: sm_90\ntile: {block_m: 128, block_n: 64, warps: 8, stages: 2}\n")
    assert spec.smem_bytes == want == fwd_smem_bytes(tile, 192, spec.dtype, 128)
    assert fwd_smem_bytes(tile, 192, spec.dtype, 128) < fwd_smem_bytes(tile, 192, spec.dtype)


def test_sm90_forward_smem_counts_v_tiles_in_d_v_boxes():
    tile = Tile(128, 64, 8, 3)
    spec = one(FWD + "target: sm_90a\ntile: {block_m: 128, block_n: 64, warps: 8, stages: 3}\n")
    assert spec.smem_bytes == ((128 + 3 * 64) * 192 + 3 * 64 * 128) * 2 + 1024
    assert spec.smem_bytes == fwd90.smem_bytes(tile, 192, spec.dtype, 128)


def test_backward_smem_counts_v_and_do_tiles_at_d_v():
    tile = Tile(64, 32, 8, 2)
    spec = one(BWD + "tile: {block_m: 64, block_n: 32, warps: 8, stages: 2}\n")
    rows = 32 + 2 * 64  # K (or V) plus the stages of Q (or dO)
    want = rows * (192 + 8 + 128 + 8) * 2 + 2 * 64 * (32 + 8) * 2 + 2 * 2 * 64 * 4
    assert not bwd.p_scratch(tile, 192, 128)
    assert spec.smem_bytes == want == bwd.smem_bytes(tile, 192, spec.dtype, 128)


def test_backward_dv_warp_layout_must_split_d_v_too():
    # 32 keys on 8 warps: 2 warp rows, so 4 warp columns of 16-column blocks, which split
    # d 128 (the tile serves 128 / 128) but not d_v 96
    tile = Tile(64, 32, 8, 2)
    assert bwd.tile_problems(tile, 128) == []
    out = bwd.tile_problems(tile, 128, 96)
    assert any("dV (32 rows x head_dim_v 96)" in msg for _, msg in out), out
    assert not any("dK" in msg for _, msg in out), out
    assert bwd.tile_problems(Tile(64, 64, 8, 2), 192, 128) == []


def test_auto_tiles_of_192_128_fit_and_take_the_spill_free_backward_tile():
    assert one(BWD).tile == Tile(64, 32, 8, 2)  # 64 x 64 spilled 4 bytes with a causal mask
    for text in (FWD, BWD, FWD + "target: sm_90a\n"):
        spec = one(text)
        assert spec.tile_auto and spec.smem_bytes <= spec.target.info.max_smem_per_block


def test_the_check_macro_names_both_head_dims():
    spec = one(FWD)
    cfg = family(spec).config(spec)
    assert (cfg["head_dim"], cfg["head_dim_v"], cfg["head_dim_v_pad"]) == (192, 128, 128)
    from flashgen.generator.paths import TEMPLATES_DIR
    from flashgen.generator.render import environment

    macro = environment(TEMPLATES_DIR).get_template("common/checks.j2").module.head_dim_check
    text = str(macro(cfg))
    assert "params->head_dim != 192 || params->head_dim_v != 128" in text
    assert "head_dim must be 192 and head_dim_v 128" in text


# -- IO models -----------------------------------------------------------------------------------

SIZES = dict(batch=2, heads=4, kv_heads=4, seqlen_q=300, seqlen_k=200)


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_forward_io_counts_v_and_o_at_d_v(causal):
    dv = one(FWD + f"mask: {{causal: {causal}}}\n")
    same = dv.replace(head_dim_v=None)
    a, b = forward_bytes(dv, **SIZES), forward_bytes(same, **SIZES)
    assert a["Q"] == b["Q"] and a["K"] == b["K"] and a["LSE"] == b["LSE"]
    assert a["V"] * 192 == b["V"] * 128 and a["O"] * 192 == b["O"] * 128
    assert a["O"] == 2 * 4 * 300 * 128 * 2


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_backward_io_counts_v_o_do_dv_at_d_v(causal):
    dv = one(BWD + f"mask: {{causal: {causal}}}\n")
    same = dv.replace(head_dim_v=None)
    a, b = backward_bytes(dv, **SIZES), backward_bytes(same, **SIZES)
    for key in ("Q", "K", "DQ", "DK", "DQ_ACCUM", "LSE", "DSUM"):
        assert a[key] == b[key], key
    for key in ("V", "O", "DO", "DV"):
        assert a[key] * 192 == b[key] * 128, key
    assert a["DV"] == 2 * 4 * 200 * 128 * 2


# -- the reference and the baseline --------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    d=st.sampled_from([8, 24, 64]),
    d_v=st.sampled_from([8, 16, 40]),
    sq=st.integers(1, 9),
    sk=st.integers(1, 9),
    causal=st.sampled_from(["none", "top_left", "bottom_right"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_reference_with_d_v_is_the_first_columns_of_a_wider_v(d, d_v, sq, sk, causal, seed):
    """O and the gradients of a narrow V are those of V with extra columns, restricted: each
    output column of P V depends on its V column only."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, sq, 2, d)), rng.standard_normal((2, sk, 1, d))
    v_wide = rng.standard_normal((2, sk, 1, d_v + 8))
    o_wide, lse_wide = reference.attention_forward(q, k, v_wide, causal=causal)
    o, lse = reference.attention_forward(q, k, v_wide[..., :d_v], causal=causal)
    assert o.shape == (2, sq, 2, d_v)
    np.testing.assert_allclose(o, o_wide[..., :d_v], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(lse, lse_wide)
    do = rng.standard_normal(o.shape)
    do_wide = np.concatenate([do, np.zeros(o.shape[:-1] + (8,))], axis=-1)
    grads = reference.attention_backward(q, k, v_wide[..., :d_v], o, lse, do, causal=causal)
    wide = reference.attention_backward(q, k, v_wide, o_wide, lse_wide, do_wide, causal=causal)
    dq, dk, dv = grads[:3]
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, (2, sk, 1, d_v))
    np.testing.assert_allclose(dq, wide[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(dk, wide[1], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(dv, wide[2][..., :d_v], rtol=1e-9, atol=1e-12)


def test_baseline_gives_o_of_d_v():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 5, 2, 24)), rng.standard_normal((1, 7, 2, 24))
    v = rng.standard_normal((1, 7, 2, 16))
    o, _ = baseline.attention_forward(q, k, v, causal="bottom_right", dtype="bf16")
    assert o.shape == (1, 5, 2, 16)


def test_reference_refuses_k_and_v_of_other_lengths():
    q = np.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="same shape but for the last dim"):
        reference.attention_forward(q, np.zeros((1, 5, 1, 8)), np.zeros((1, 6, 1, 16)))


# -- the runners ---------------------------------------------------------------------------------


def _qkv(d=192, d_v=128, sq=8, sk=9):
    return (
        np.zeros((1, sq, 2, d), np.float32),
        np.zeros((1, sk, 2, d), np.float32),
        np.zeros((1, sk, 2, d_v), np.float32),
    )


def test_forward_runner_takes_v_of_d_v_and_refuses_another():
    spec = one(FWD)
    pb = validate(spec, *_qkv())
    assert (pb.head_dim, pb.head_dim_v) == (192, 128)
    with pytest.raises(RunnerError, match="v has head_dim_v 192, the kernel was generated for 128"):
        validate(spec, *_qkv(d_v=192))
    with pytest.raises(RunnerError, match="q has head_dim 128, the kernel was generated for 192"):
        validate(spec, *_qkv(d=128))


def test_backward_runner_wants_o_and_dout_of_d_v():
    spec = one(BWD)
    q, k, v = _qkv()
    o = np.zeros((1, 8, 2, 128), np.float32)
    lse = np.zeros((1, 2, 8), np.float32)
    pb = validate_bwd(spec, q, k, v, o, lse, o)
    assert pb.head_dim_v == 128
    with pytest.raises(RunnerError, match=r"o must have q's shape with v's head dim"):
        validate_bwd(spec, q, k, v, np.zeros(q.shape, np.float32), lse, o)


# -- the benchmark's FLOP counts -----------------------------------------------------------------


def test_bench_flops_count_each_product_at_its_head_dim():
    from flashgen.bench.bwd_bench import bwd_flops
    from flashgen.bench.fwd_bench import flops

    b, h, n = 2, 3, 1000
    assert flops(b, h, n, 128, False) == 4 * b * h * n * n * 128  # d_v = d: the usual count
    assert bwd_flops(b, h, n, 128, True) == 2.5 * flops(b, h, n, 128, True)
    assert flops(b, h, n, 192, False, 128) == 2 * b * h * n * n * (192 + 128)
    assert bwd_flops(b, h, n, 192, False, 128) == 2 * b * h * n * n * (3 * 192 + 2 * 128)
    assert bwd_flops(b, h, n, 192, True, 128) == bwd_flops(b, h, n, 192, False, 128) / 2


def test_the_shapes_bench_finds_every_d_v_kernel_it_times():
    from flashgen.bench import shapes_bench
    from flashgen.generator.load import load_paths

    specs = list(load_paths([Path(__file__).parents[1] / "specs"]))
    for kind, target, d, d_v in shapes_bench.DV_CASES:
        for causal in (False, True):
            kind_yaml = {"fwd": "forward", "bwd": "backward"}[kind]
            spec = shapes_bench.find_spec(specs, kind_yaml, target, d, causal, d_v)
            assert (spec.head_dim, spec.head_dim_vo, spec.target.yaml) == (d, d_v, target)
            shapes_bench.find_spec(specs, "forward", target, d, causal, d_v)  # bwd's O, LSE


# -- the C ABI: <name>_check compares the caller's head dims with the kernel's ----------------

CHECK_MAIN = r"""
#include <cstdio>
#include "NAME.h"

alignas(16) static unsigned char buf[1 << 12];

static void show(const char* what, const fg_fwd_params& p) {
  const char* m = NAME_check(&p);
  std::printf("%s: %s\n", what, m ? m : "OK");
}

int main() {
  fg_fwd_params p = fg_fwd_params_default();
  p.q = buf; p.k = buf; p.v = buf; p.o = buf; p.lse = reinterpret_cast<float*>(buf);
  p.batch = 1; p.heads = 2; p.kv_heads = 2; p.seqlen_q = 5; p.seqlen_k = 7;
  p.softmax_scale = 0.125;
  p.q_row_stride = p.k_row_stride = 384; p.v_row_stride = p.o_row_stride = 256;
  p.q_head_stride = p.k_head_stride = 192; p.v_head_stride = p.o_head_stride = 128;
  p.head_dim = 192; p.head_dim_v = 128; show("192/128", p);
  fg_fwd_params bad = p; bad.head_dim_v = 192; show("192/192", bad);
  bad = p; bad.head_dim = 128; show("128/128", bad);
  bad = p; bad.head_dim = 128; bad.head_dim_v = 192; show("swapped", bad);
  return 0;
}
"""


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_a_d_v_kernels_check_refuses_head_dims_it_was_not_built_for(tmp_path):
    """The shipped 192/128 forward (generated/, as vendored) built with nvcc; its
    `<name>_check` runs on the host, so no GPU is needed."""
    repo = Path(__file__).resolve().parents[1]
    spec = next(
        s
        for s in load_spec_file(repo / "specs" / "dv.yaml")
        if s.kernel.yaml == "forward" and s.target.yaml == "sm_90" and s.dtype.yaml == "bf16"
        and s.mask.causal.yaml == "none"
    )  # fmt: skip
    name = kernel_name(spec)
    src = tmp_path / "main.cu"
    src.write_text(CHECK_MAIN.replace("NAME", name))
    exe = tmp_path / "main"
    gen = repo / "generated"
    cmd = ["nvcc", "-std=c++17", "-O1", "-arch=sm_90", f"-I{gen}", str(src),
           str(gen / f"{name}.cu"), "-o", str(exe)]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = dict(line.split(": ", 1) for line in out.strip().splitlines())
    want = "head_dim must be 192 and head_dim_v 128: the head dims this kernel was generated for"
    assert got == {"192/128": "OK", "192/192": want, "128/128": want, "swapped": want}


def test_decode_in_flashgen_torch_refuses_caches_of_two_head_dims():
    from flashgen.torch.kvcache_select import _cache_shapes
    from flashgen.torch.selection import TensorMeta, UnsupportedCall

    def meta(shape):
        stride, acc = [], 1
        for n in reversed(shape):
            stride.insert(0, acc)
            acc *= n
        return TensorMeta(tuple(shape), tuple(stride), "bfloat16", "cuda")

    q, k_cache, v_cache = meta((2, 1, 8, 192)), meta((2, 64, 8, 192)), meta((2, 64, 8, 128))
    with pytest.raises(UnsupportedCall, match="one head dim for k and v: no head_dim_v"):
        _cache_shapes(q, k_cache, v_cache)


def test_show_and_the_kernel_table_name_both_head_dims():
    from flashgen.generator.writer import readme_table

    spec = one(FWD)
    table = readme_table([{"name": "k", "spec": spec.to_canonical(), "status": "unverified"}])
    assert "| 192 / 128 |" in table
    plain = one("kernel: forward\ndtype: bf16\nhead_dim: 128\n")
    table = readme_table([{"name": "k", "spec": plain.to_canonical(), "status": "unverified"}])
    assert "| 128 |" in table
