"""FP8 (e4m3) KV caches for the decode family without a GPU: the spec field and its refusals,
the shared-memory formula, the IO model's bytes, the e4m3 codec (round trips, rounding,
NaN and the range), the float64 reference's dequantisation and descale fold, FA3's FP8 pass
rule, the torch argument checks, and the specs flashgen.torch derives for FP8 calls. The GPU
side is tests/gpu/test_decode.py and tests/gpu/test_torch_kvcache.py (their FP8 parts)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from flashgen.generator.families.decode import smem_bytes
from flashgen.generator.load import load_paths, load_spec_text
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import PACKAGE_ROOT
from flashgen.generator.spec import Dtype, KvDtype, SpecError, Target, Tile
from flashgen.torch.kvcache_fp8 import check_fp8_call, descale_layout
from flashgen.torch.kvcache_select import DecodeCall, decode_spec
from flashgen.torch.selection import TensorMeta, UnsupportedCall
from flashgen.verify import fp8, passrule, reference_decode
from flashgen.verify.io_model_decode import decode_bytes
from flashgen.verify.numerics import round_to
from hypothesis import given, settings
from hypothesis import strategies as st

H200 = (9, 0)
FP8_YAML = PACKAGE_ROOT / "specs" / "decode_fp8.yaml"


def one(text: str):
    (spec,) = load_spec_text(text, "t.yaml")
    return spec


def decode_yaml(**fields) -> str:
    base = {"kernel": "decode", "dtype": "bf16", "head_dim": 128, "gqa": "true"}
    base.update(fields)
    return "\n".join(f"{k}: {v}" for k, v in base.items()) + "\n"


# -- the spec field ------------------------------------------------------------------------------


def test_kv_dtype_e4m3_names_the_kernel_and_halves_the_ring():
    spec = one(decode_yaml(kv_dtype="e4m3"))
    assert spec.kv_dtype is KvDtype.E4M3 and spec.kv_nbytes == 1
    assert "_kve4m3_" in kernel_name(spec)
    assert spec.to_canonical()["kv_dtype"] == "e4m3"
    assert not spec.plain  # a bf16 call never selects it as the plain kernel


def test_absent_kv_dtype_leaves_the_canonical_spec_and_name_alone():
    spec = one(decode_yaml())
    assert spec.kv_dtype is None and spec.kv_nbytes == 2
    assert "kv_dtype" not in spec.to_canonical()
    assert "kve4m3" not in kernel_name(spec)


@pytest.mark.parametrize("target", ["sm_80", "sm_86"])
def test_targets_without_e4m3_conversions_are_refused_naming_the_arch(target):
    with pytest.raises(SpecError) as e:
        one(decode_yaml(kv_dtype="e4m3", target=target))
    msg = str(e.value)
    assert "kv_dtype" in msg and target in msg and "sm_89, sm_90" in msg


@pytest.mark.parametrize("target", ["sm_89", "sm_90"])
def test_sm89_and_sm90_take_fp8_caches(target):
    assert one(decode_yaml(kv_dtype="e4m3", target=target)).target is Target.from_yaml(target)


def test_kv_dtype_belongs_to_decode_only():
    with pytest.raises(SpecError, match="applies to kernel: decode only"):
        one("kernel: forward\ndtype: bf16\nhead_dim: 128\nkv_dtype: e4m3\n")


def test_other_kv_dtype_spellings_are_refused_with_the_allowed_ones():
    with pytest.raises(SpecError, match="allowed: e4m3"):
        one(decode_yaml(kv_dtype="bf16"))


def test_head_dims_of_odd_multiples_of_8_are_refused_for_fp8_rows():
    with pytest.raises(SpecError, match="multiples of 16"):
        one(decode_yaml(kv_dtype="e4m3", head_dim=72))


def test_fp8_smem_is_q_plus_the_e4m3_ring():
    # Q 16 x (128 + 8) x 2 and 4 stages of 64 x 128 e4m3 bytes for each of K and V, read into
    # registers (no 16-bit slot); nvcc reports 69888 dynamic bytes for this tile on sm_90
    tile = Tile(16, 64, 4, 4)
    want = 16 * 136 * 2 + 2 * 4 * 64 * 128
    for paged in (False, True):
        assert smem_bytes(tile, 128, Dtype.BF16, paged, kv_fp8=True) == want == 69888
    # the same tile over a 16-bit cache holds all 4 stages in 16 bits
    assert smem_bytes(tile, 128, Dtype.BF16, False) == 16 * 136 * 2 + 2 * 4 * 64 * 128 * 2


def test_the_fp8_auto_tile_keeps_one_stage_more():
    fp8_spec = one(decode_yaml(kv_dtype="e4m3"))
    plain = one(decode_yaml())
    assert fp8_spec.tile.stages == plain.tile.stages + 1
    assert fp8_spec.tile.block_n == plain.tile.block_n


# -- the IO model ----------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True])
def test_io_model_counts_one_byte_per_cache_element(paged):
    fp8_spec = one(decode_yaml(kv_dtype="e4m3", paged=str(paged).lower(), instrument_io="true"))
    twin = one(decode_yaml(paged=str(paged).lower(), instrument_io="true")).replace(
        tile=fp8_spec.tile
    )
    lens = [0, 1, 300, 257]
    kw = dict(batch=4, heads=8, kv_heads=2, seqlen_q=2, seqlen_k=0, cache_seqlens=lens,
              page_size=64, num_splits=3)  # fmt: skip
    a, b = decode_bytes(fp8_spec, **kw), decode_bytes(twin, **kw)
    for key in ("K", "V"):
        assert a[key] * 2 == b[key] > 0
    # the keys each split reads, once per KV head, at d bytes per key
    assert a["K"] == sum(lens) * 128 * 2
    for key in ("Q", "O", "O_PARTS", "LSE_PARTS", "LSE", "BLOCK_TABLE"):
        assert a[key] == b[key]
    ctas = 4 * 3 * 2  # batch x splits x kv_heads, one row tile (8 heads / 2 KV heads x 2 q)
    assert a["SEQLENS"] - b["SEQLENS"] == 8 * ctas  # the two descales per CTA


# -- the e4m3 codec ------------------------------------------------------------------------------


def test_every_code_round_trips_exactly():
    codes = np.arange(256, dtype=np.uint8)
    vals = fp8.decode(codes)
    finite = np.isfinite(vals)
    assert np.count_nonzero(~finite) == 2  # 0x7F and 0xFF: NaN, no inf
    back = fp8.encode(vals[finite])
    # +0 and -0 keep their codes too
    assert np.array_equal(back, codes[finite])
    assert np.nanmax(vals) == fp8.E4M3_MAX == 448.0 and np.nanmin(np.abs(vals[vals != 0])) == 2**-9


def test_every_e4m3_value_is_exact_in_fp16_and_bf16():
    vals = fp8.values()
    vals = vals[np.isfinite(vals)]
    for dt in ("fp16", "bf16"):
        assert np.array_equal(round_to(vals, dt).astype(np.float64), vals), dt


def test_rounding_is_to_nearest_with_ties_to_even_codes():
    # 1.0 (0x38) and 1.125 (0x39): 1.0625 is the tie, to the even code 1.0; 1.1875 between
    # 1.125 and 1.25 (0x3A) goes to 1.25
    assert fp8.round_trip(np.array([1.0625, 1.0626, 1.1875]))[:3].tolist() == [1.0, 1.125, 1.25]
    # subnormals: 2^-9 steps; 1.5 * 2^-9 is a tie between codes 1 and 2, to 2
    assert fp8.round_trip(np.array([1.5 * 2**-9, 0.49 * 2**-9])).tolist() == [2 * 2**-9, 0.0]


def test_out_of_range_inf_and_nan():
    x = np.array([448.0, 464.0, 464.5, 1e6, np.inf, -np.inf, np.nan, -500.0])
    plain = fp8.round_trip(x)
    assert plain[:2].tolist() == [448.0, 448.0]
    assert np.all(np.isnan(plain[2:]))  # the OCP rule: no saturation, no inf
    sat = fp8.round_trip(x, saturate=True)
    assert sat.tolist()[:6] == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0]
    assert np.isnan(sat[6]) and sat[7] == -448.0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=64))
def test_encoding_matches_torch_float8_e4m3fn(xs):
    torch = pytest.importorskip("torch")
    x = np.array(xs, dtype=np.float32)
    want = torch.tensor(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    # torch's CPU cast saturates finite values beyond the range
    assert np.array_equal(fp8.encode(x, saturate=True), want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-448, 448, allow_nan=False), min_size=1, max_size=64))
def test_round_trip_is_the_nearest_e4m3_value_and_idempotent(xs):
    x = np.array(xs)
    r = fp8.round_trip(x)
    vals = fp8.values()
    vals = vals[np.isfinite(vals)]
    nearest = np.abs(x[:, None] - vals[None]).min(axis=1)
    assert np.array_equal(np.abs(r - x), nearest)
    assert np.array_equal(fp8.round_trip(r), r)


def test_quantize_gives_codes_and_per_head_descales_that_dequantise_within_half_a_step():
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((2, 50, 3, 16)) * np.array([1.0, 10.0, 0.01])[None, None, :, None]
    codes, ds = fp8.quantize(cache)
    assert codes.dtype == np.uint8 and ds.shape == (2, 3) and ds.dtype == np.float32
    deq = reference_decode.dequantize(codes, ds)
    # each slice's amax maps to 448; relative error of e4m3 rounding is at most 2^-4
    rel = np.abs(deq - cache) / np.maximum(np.abs(cache), 2**-6 * ds[:, None, :, None])
    assert rel.max() <= 2.0**-4


# -- the reference --------------------------------------------------------------------------------


def _problem(seed=0, batch=2, kv=2, heads=4, d=16, cap=40):
    rng = np.random.default_rng(seed)
    q = round_to(rng.standard_normal((batch, 1, heads, d)), "bf16")
    k8 = fp8.round_trip(rng.standard_normal((batch, cap, kv, d)))
    v8 = fp8.round_trip(rng.standard_normal((batch, cap, kv, d)))
    return rng, q, k8, v8, [cap, cap // 2]


def test_dequantize_takes_codes_or_values_and_scalar_or_per_head_descales():
    _, _, k8, _, _ = _problem()
    ds = np.array([[0.5, 2.0], [3.0, 0.25]], np.float32)
    got = reference_decode.dequantize(fp8.encode(k8), ds)
    assert np.array_equal(got, k8 * ds[:, None, :, None])
    assert np.array_equal(reference_decode.dequantize(k8, 0.5), k8 * 0.5)
    with pytest.raises(ValueError, match="batch, kv_heads"):
        reference_decode.dequantize(k8, np.ones((3, 2), np.float32))


def test_k_descale_is_the_softmax_scale_and_v_descale_scales_the_output():
    """The fold the kernel makes (decode_kernel.cuh): a per-tensor k_descale c gives the
    attention with softmax_scale * c, and v_descale w multiplies O (the LSE is unchanged)."""
    _, q, k8, v8, lens = _problem()
    d = q.shape[-1]
    c, w = 0.375, 2.5
    o, lse = reference_decode.decode_reference(q, k8, v8, lens, k_descale=c, v_descale=w)
    o1, lse1 = reference_decode.decode_reference(q, k8, v8, lens, scale=c / np.sqrt(d))
    np.testing.assert_allclose(o, w * o1, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, lse1, rtol=1e-13)


def test_per_head_descales_apply_to_their_own_batch_and_kv_head():
    _, q, k8, v8, lens = _problem()
    kd = np.array([[1.0, 0.5], [2.0, 4.0]], np.float32)
    vd = np.array([[3.0, 1.0], [0.5, 1.0]], np.float32)
    o, _ = reference_decode.decode_reference(q, k8, v8, lens, k_descale=kd, v_descale=vd)
    for b in range(2):
        for hk in range(2):
            one_k = k8[b : b + 1, :, hk : hk + 1]
            one_v = v8[b : b + 1, :, hk : hk + 1]
            qs = q[b : b + 1, :, 2 * hk : 2 * hk + 2]  # heads 2hk, 2hk+1 share KV head hk
            want, _ = reference_decode.decode_reference(
                qs, one_k * kd[b, hk], one_v * vd[b, hk], lens[b : b + 1]
            )
            np.testing.assert_array_equal(o[b : b + 1, :, 2 * hk : 2 * hk + 2], want)


def test_reference_wants_both_descales_or_neither():
    _, q, k8, v8, lens = _problem()
    with pytest.raises(ValueError, match="both"):
        reference_decode.decode_reference(q, k8, v8, lens, k_descale=1.0)


# -- the pass rule ---------------------------------------------------------------------------------


def test_fp8_rule_is_fa3s_multiple_of_the_baseline_error():
    ref = np.linspace(-1, 1, 64)
    base = ref + 1e-2
    floor = passrule.noise_floor(ref, "bf16")
    just_over_2 = ref + 2e-2 + floor + 1e-3
    assert not passrule.check_fp8_cache(just_over_2, ref, base, "bf16")
    assert passrule.check_fp8_cache(just_over_2, ref, base, "bf16", softcap=True)
    assert passrule.check_fp8_cache(ref + 1.9e-2, ref, base, "bf16")
    assert passrule.FP8_MULTIPLE == 2.0 and passrule.FP8_MULTIPLE_SOFTCAP == 3.0


# -- the torch arguments --------------------------------------------------------------------


def meta(shape, dtype="bfloat16", device="cuda"):
    stride, acc = [], 1
    for n in reversed(shape):
        stride.insert(0, acc)
        acc *= n
    return TensorMeta(tuple(shape), tuple(stride), dtype, device)


Q = meta((2, 1, 8, 128))
K8 = meta((2, 64, 2, 128), "float8_e4m3fn")
DS = meta((2, 2), "float32")


def test_per_head_and_per_tensor_descales_give_their_strides():
    assert check_fp8_call(Q, K8, K8, DS, DS, batch=2, kv_heads=2) == ((2, 1), (2, 1))
    scalar = meta((), "float32")
    assert check_fp8_call(Q, K8, K8, scalar, 0.5, batch=2, kv_heads=2) == ((0, 0), (0, 0))
    assert descale_layout("k_descale", meta((1,), "float32"), 2, 2, "cuda") == (0, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((Q, K8, K8, None, DS), "needs k_descale"),
        ((Q, K8, K8, DS, None), "needs v_descale"),
        ((Q, K8, K8, DS, meta((2, 2), "float16")), "v_descale has dtype float16"),
        ((Q, K8, K8, meta((2,), "float32"), DS), r"k_descale has shape \(2,\)"),
        ((Q, K8, K8, meta((2, 8), "float32"), DS), r"\(batch, kv_heads\)"),
        ((Q, K8, K8, meta((2, 2), "float32", "cpu"), DS), "is on cpu"),
        ((Q, K8, meta((2, 64, 2, 128)), DS, DS), "mixed caches are not served"),
        ((Q, meta((2, 64, 2, 128)), meta((2, 64, 2, 128)), DS, DS), "are for FP8 caches"),
        ((meta((2, 1, 8, 128), "float8_e4m3fn"), K8, K8, DS, DS), "take q in float16"),
        ((meta((2, 1, 8, 128), "float32"), K8, K8, DS, DS), "allowed with FP8 caches"),
        ((Q, K8, K8, "0.5", DS), "is a str"),
    ],
)
def test_bad_fp8_arguments_are_refused_by_name(args, message):
    with pytest.raises(UnsupportedCall, match=message):
        check_fp8_call(*args, batch=2, kv_heads=2)


def test_either_fp8_cache_or_a_descale_takes_the_fp8_path_and_its_messages():
    torch = pytest.importorskip("torch")
    from flashgen.torch import flash_attn_with_kvcache

    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    k8 = torch.zeros(2, 64, 2, 128).to(torch.float8_e4m3fn)
    kb = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(UnsupportedCall, match="mixed caches"):  # only v_cache FP8
        flash_attn_with_kvcache(q, kb, k8, cache_seqlens=lens, k_descale=1.0, v_descale=1.0)
    with pytest.raises(UnsupportedCall, match="are for FP8 caches"):  # only a descale
        flash_attn_with_kvcache(q, kb, kb, cache_seqlens=lens, v_descale=1.0)


def test_flash_attn_with_kvcache_refuses_fp8_caches_without_descales_before_any_launch():
    torch = pytest.importorskip("torch")
    from flashgen.torch import flash_attn_with_kvcache

    q = torch.zeros(2, 1, 8, 128, dtype=torch.bfloat16)
    k8 = torch.zeros(2, 64, 2, 128).to(torch.float8_e4m3fn)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(UnsupportedCall, match="needs k_descale"):
        flash_attn_with_kvcache(q, k8, k8, cache_seqlens=lens)
    with pytest.raises(UnsupportedCall, match="mixed caches"):
        flash_attn_with_kvcache(q, k8, k8.bfloat16(), cache_seqlens=lens, k_descale=1.0,
                                v_descale=1.0)  # fmt: skip
    new = torch.zeros(2, 1, 2, 128, dtype=torch.float32)
    with pytest.raises(UnsupportedCall, match="k has dtype float32: new rows come in q's"):
        flash_attn_with_kvcache(q, k8, k8, k=new, v=new, cache_seqlens=lens, k_descale=1.0,
                                v_descale=1.0)  # fmt: skip
    with pytest.raises(UnsupportedCall, match="k_descale has shape"):
        flash_attn_with_kvcache(q, k8, k8, cache_seqlens=lens, k_descale=torch.ones(3),
                                v_descale=1.0)  # fmt: skip


# -- the kernels flashgen.torch selects ----------------------------------------------------------


def test_fp8_calls_derive_the_shipped_fp8_specs():
    shipped = [s for s in load_paths([FP8_YAML]) if not s.instrument_io]
    assert len(shipped) >= 8
    for s in shipped:
        call = DecodeCall(
            s.dtype, s.head_dim, H200, s.paged, s.mask.causal, s.mask.window, kv_dtype=s.kv_dtype
        )
        assert kernel_name(decode_spec(call)) == kernel_name(s)


def test_an_fp8_call_on_sm80_is_refused_naming_the_arch():
    with pytest.raises(UnsupportedCall, match="sm_80"):
        decode_spec(DecodeCall(Dtype.BF16, 128, (8, 0), kv_dtype=KvDtype.E4M3))


def test_the_shipped_fp8_specs_cover_both_dtypes_head_dims_and_layouts():
    shipped = load_paths([FP8_YAML])
    kinds = {(s.dtype.yaml, s.head_dim, s.paged) for s in shipped}
    assert {
        (dt, d, p) for dt in ("bf16", "fp16") for d in (64, 128) for p in (False, True)
    } <= kinds
    assert all(s.kv_dtype is KvDtype.E4M3 for s in shipped)


# -- the C launcher's check (host-compiled, no GPU) ----------------------------------------------


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_the_launchers_descale_check_refuses_by_name(tmp_path):
    """fg::check_kv_descale (decode_launch.cuh), compiled for the host with an FP8 and a
    16-bit config: what `<name>_check` says for missing descales, descales given to a 16-bit
    kernel, negative strides and K/V strides that are not whole 16-byte chunks."""
    inc = Path(__file__).resolve().parent.parent / "templates" / "include" / "flashgen"
    src = tmp_path / "descale.cpp"
    src.write_text(
        "#include <cstdio>\n"
        "namespace fg { constexpr int kDecodeMaxQueries = 16, kDecodeMaxSplits = 128; }\n"
        '#include "decode_launch.cuh"\n'
        "struct Fp8 { static constexpr bool kKvFp8 = true; };\n"
        "struct Half { static constexpr bool kKvFp8 = false; };\n"
        "static float ds[4];\n"
        "template <class C> void say(const fg_decode_params& p) {\n"
        '  const char* m = fg::check_kv_descale<C>(p); printf("%s\\n", m ? m : "ok"); }\n'
        "int main() {\n"
        "  fg_decode_params p = fg_decode_params_default();\n"
        "  p.k_row_stride = p.v_row_stride = 128; p.k_head_stride = p.v_head_stride = 128;\n"
        "  say<Fp8>(p);\n"  # no descales
        "  p.k_descale = ds; say<Fp8>(p);\n"  # only k
        "  p.v_descale = ds; say<Fp8>(p);\n"  # both: ok
        "  say<Half>(p);\n"  # descales given to a 16-bit kernel
        "  p.k_descale_head_stride = -1; say<Fp8>(p); p.k_descale_head_stride = 0;\n"
        "  p.v_row_stride = 136; say<Fp8>(p);\n"  # 8-element multiple, not 16
        "  p.k_descale = p.v_descale = 0; say<Half>(p);\n"  # 16-bit kernel, none: ok
        "  return 0;\n}\n"
    )
    exe = tmp_path / "descale"
    subprocess.run(["g++", "-std=c++17", "-I", str(inc), "-o", str(exe), str(src)], check=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = lines.splitlines()
    assert "k_descale and v_descale" in got[0] and "must be non-null" in got[0]
    assert "must be non-null" in got[1]
    assert got[2] == "ok"
    assert "pass NULL" in got[3]
    assert ">= 0" in got[4]
    assert "multiples of 16 elements" in got[5]
    assert got[6] == "ok"


@pytest.mark.parametrize("paged", [False, True])
def test_appended_rows_are_quantised_with_their_descale_and_written_in_place(paged):
    """append_fp8 on CPU tensors: the e4m3 codes of x / descale[b, hk] (float32 division,
    clamped to +-448, nearest-even: verify.fp8 with saturation) land at cache_seqlens[b] + i,
    a row past the capacity is dropped, and nothing else changes."""
    torch = pytest.importorskip("torch")
    from flashgen.torch.kvcache_fp8 import append_fp8

    rng = np.random.default_rng(3)
    b, cap, hk, d, n = 3, 64, 2, 16, 2
    lens = [0, 30, 63]  # the last sequence has room for one of its two rows
    kd = rng.uniform(0.01, 0.1, (b, hk)).astype(np.float32)
    new_k = (rng.standard_normal((b, n, hk, d)) * 30).astype(np.float32)
    new_v = rng.standard_normal((b, n, hk, d)).astype(np.float32)
    new_v[0, 0, 0, 0] = np.nan
    base = rng.integers(0, 256, (b, cap, hk, d)).astype(np.uint8)
    base[(base & 0x7F) == 0x7F] = 0  # no NaN codes in the untouched rows (compared below)
    want_k, want_v = base.copy(), base.copy()
    for i, n0 in enumerate(lens):
        for j in range(n):
            if n0 + j < cap:
                want_k[i, n0 + j] = fp8.encode(new_k[i, j] / kd[i][:, None], saturate=True)
                want_v[i, n0 + j] = fp8.encode(new_v[i, j] / np.float32(0.5), saturate=True)
    kc = torch.tensor(base).view(torch.float8_e4m3fn)
    vc = torch.tensor(base).view(torch.float8_e4m3fn)
    table = None
    if paged:
        page = 16
        perm = torch.randperm(b * cap // page)
        kp = torch.empty(b * cap // page, page, hk, d, dtype=torch.uint8)
        vp = torch.empty_like(kp)
        kp[perm] = kc.view(torch.uint8).reshape(-1, page, hk, d)
        vp[perm] = vc.view(torch.uint8).reshape(-1, page, hk, d)
        kc, vc = kp.view(torch.float8_e4m3fn), vp.view(torch.float8_e4m3fn)
        table = perm.view(b, cap // page).to(torch.int32)
    append_fp8(
        kc, vc, torch.tensor(new_k).bfloat16().float(), torch.tensor(new_v),
        torch.tensor(lens, dtype=torch.int32), table, torch.tensor(kd), 0.5,
    )  # fmt: skip
    got_k, got_v = kc.view(torch.uint8), vc.view(torch.uint8)
    if paged:
        got_k = got_k[perm].reshape(b, cap, hk, d)
        got_v = got_v[perm].reshape(b, cap, hk, d)
    # k went through bf16 (as a caller's bf16 rows do): encode what the kernel is given
    for i, n0 in enumerate(lens):
        for j in range(n):
            if n0 + j < cap:
                kb = torch.tensor(new_k[i, j]).bfloat16().float().numpy()
                want_k[i, n0 + j] = fp8.encode(kb / kd[i][:, None], saturate=True)
    assert np.array_equal(got_k.numpy(), want_k)
    assert np.array_equal(got_v.numpy(), want_v)
    assert got_v.numpy()[0, 0, 0, 0] & 0x7F == 0x7F  # the NaN row element stays NaN


# -- NaN and inf (Hypothesis) ------------------------------------------------------------------

_SPECIAL = st.sampled_from([np.nan, -np.nan, np.inf, -np.inf, 464.0, 464.5, -1e30, 448.0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_SPECIAL, st.floats(-500, 500)), min_size=1, max_size=32))
def test_nan_inf_and_out_of_range_values_quantise_by_the_documented_rule(xs):
    x = np.array(xs, dtype=np.float64)
    plain, sat = fp8.round_trip(x), fp8.round_trip(x, saturate=True)
    big = np.abs(x) > 464.0  # inf included
    assert np.all(np.isnan(plain[np.isnan(x) | big]))
    assert np.all(np.isnan(sat[np.isnan(x)]))
    assert np.array_equal(sat[big], np.sign(x[big]) * 448.0)
    ok = ~np.isnan(x) & ~big
    assert np.array_equal(plain[ok], sat[ok]) and np.all(np.abs(plain[ok]) <= 448.0)


@settings(max_examples=60, deadline=None)
@given(
    seq=st.integers(0, 1),
    hk=st.integers(0, 1),
    key=st.integers(0, 39),
    sq=st.sampled_from([1, 3]),
    cache=st.sampled_from(["k", "v"]),
)
def test_a_nan_code_makes_the_rows_that_see_its_key_nan(seq, hk, key, sq, cache):
    """The float64 reference on an FP8 cache holding one NaN code, as for a 16-bit cache: a
    NaN in a key makes NaN exactly the rows of its KV head that see that key (bottom-right
    causal; a masked score is -inf whatever the key holds); a NaN in a value row within the
    sequence's length also reaches rows of its KV head that do not see it, since P = 0 times
    NaN is NaN (the kernels likewise, for the rows whose CTA loads that tile); rows of other
    sequences and KV heads, and rows past the length, stay finite. The GPU tests hold the
    kernels to the reference's pattern."""
    rng = np.random.default_rng(0)
    b, heads, kvh, d, lens = 2, 4, 2, 16, [40, 25]
    q = round_to(rng.standard_normal((b, sq, heads, d)), "bf16")
    k8 = fp8.round_trip(rng.standard_normal((b, 40, kvh, d)))
    v8 = fp8.round_trip(rng.standard_normal((b, 40, kvh, d)))
    (k8 if cache == "k" else v8)[seq, key, hk, 3] = np.nan
    o, _ = reference_decode.decode_reference(
        q, k8, v8, lens, causal="bottom_right", k_descale=0.5, v_descale=2.0
    )
    got = np.isnan(o).any(axis=-1)  # (batch, sq, heads)
    sees = np.zeros_like(got)
    for i in range(sq):
        if key <= lens[seq] - sq + i:  # query i sees keys j <= len - sq + i
            sees[seq, i, 2 * hk : 2 * hk + 2] = True  # heads 2hk, 2hk+1 share KV head hk
    group = np.zeros_like(got)
    if key < lens[seq]:
        group[seq, :, 2 * hk : 2 * hk + 2] = True
    if cache == "k":
        assert np.array_equal(got, sees)
    else:
        assert np.array_equal(got, group)  # the reference multiplies the whole rows


def test_the_fp8_bench_launches_the_shipped_fp8_kernels():
    from flashgen.bench.fp8_decode_bench import _specs

    shipped = {kernel_name(s) for s in load_paths([FP8_YAML, FP8_YAML.parent / "decode.yaml"])}
    for d in (128, 64):
        for (kv, _paged), spec in _specs(d).items():
            assert (spec.kv_dtype is KvDtype.E4M3) == (kv == "e4m3")
            if kv == "e4m3" or d == 128:  # (bf16 d 64 without a mask compiles on first use)
                assert kernel_name(spec) in shipped


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--dims", "96"], "--dims takes head dims from 128, 64"),
        (["--dims", "64,x"], "comma-separated integers"),
        (["--sweep-splits", "0,2"], "split counts 1..128"),
        (["--sweep-splits", "129"], "split counts 1..128"),
        (["--dims", "64,64"], "--dims repeats a value"),
        (["--sweep-splits", "2,2"], "--sweep-splits repeats a value"),
        (["--dims", ","], "--dims was given no values"),
    ],
)
def test_the_fp8_bench_refuses_bad_options(argv, says, capsys):
    from flashgen.bench.fp8_decode_bench import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_fp8_bench_options_parse():
    from flashgen.bench.fp8_decode_bench import parse_args

    args = parse_args(["--dims", "64", "--sweep-splits", "1, 2,16"])
    assert args.dim_list == (64,) and args.sweep == [1, 2, 16]
    assert parse_args([]).dim_list == () and parse_args([]).sweep == []
