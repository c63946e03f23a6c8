"""The decode family without a GPU: spec rules, names, the split heuristic, the workspace and
IO-model arithmetic, and the float64 decode reference and merge it is judged by."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from flashgen.generator.families import decode
from flashgen.generator.load import load_spec_text
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import SpecError, Tile
from flashgen.verify import io_model_decode, reference_decode


def one(text: str):
    (spec,) = load_spec_text("kernel: decode\n" + text, "spec.yaml")
    return spec


def test_decode_spec_resolves_the_auto_tile_and_names_paged_kernels():
    s = one("dtype: bf16\nhead_dim: 128\ngqa: true\npaged: true\n")
    assert s.tile == Tile(16, 64, 4, 3) and s.tile_auto
    name = kernel_name(s)
    assert name.startswith("fa_dec_d128_bf16_gqa_paged_m16n64w4s3_sm90_")
    assert s.smem_bytes == (16 + 2 * 3 * 64) * (128 + 8) * 2
    # contiguous caches: unpadded, swizzled K/V rows (Q keeps its padding)
    c = one("dtype: bf16\nhead_dim: 128\ngqa: true\n")
    assert c.smem_bytes == (16 * (128 + 8) + 2 * 3 * 64 * 128) * 2
    assert decode.swizzled(64, False) and not decode.swizzled(64, True)
    assert not decode.swizzled(32, False)


@pytest.mark.parametrize(
    "text, field, message",
    [
        ("dtype: bf16\nhead_dim: 100\n", "head_dim", "allowed: multiples of 8 in 8..192"),
        ("dtype: bf16\nhead_dim: 64\nmask: {causal: top_left}\n", "mask.causal", "bottom_right"),
        ("dtype: bf16\nhead_dim: 64\nmask: {varlen: true}\n", "mask.varlen", "cache_seqlens"),
        ("dtype: bf16\nhead_dim: 64\ndropout: true\n", "dropout", "not supported"),
        ("dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n", "target", "has no decode"),
        (
            "dtype: bf16\nhead_dim: 64\ntile: {block_m: 48, block_n: 64, warps: 4, stages: 2}\n",
            "tile.block_m",
            "allowed: 16, 32, 64",
        ),
        (
            "dtype: bf16\nhead_dim: 64\ntile: {block_m: 16, block_n: 32, warps: 4, stages: 2}\n",
            "tile",
            "multiple of 64",
        ),
        (
            "dtype: bf16\nhead_dim: 64\ntile: {block_m: 16, block_n: 64, warps: 4, stages: 1}\n",
            "tile.stages",
            "allowed: 2, 3, 4",
        ),
    ],
)
def test_bad_decode_specs_name_the_field(text, field, message):
    with pytest.raises(SpecError) as info:
        one(text)
    assert info.value.field == field and message in str(info.value)


def test_paged_is_a_decode_only_field():
    with pytest.raises(SpecError, match="applies to kernel: decode only"):
        load_spec_text("dtype: bf16\nhead_dim: 64\npaged: true\n", "spec.yaml")


def test_the_shipped_decode_specs_load():
    from flashgen.generator.load import load_spec_file
    from flashgen.generator.paths import PACKAGE_ROOT

    specs = load_spec_file(PACKAGE_ROOT / "specs" / "decode.yaml")
    assert 8 <= len(specs) <= 12
    assert {s.paged for s in specs} == {False, True}
    assert {s.dtype.yaml for s in specs} == {"bf16", "fp16"}
    assert {64, 128} <= {s.head_dim for s in specs}


# -- split heuristic ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 8])
def test_heuristic_splits_small_batches_to_fill_the_device(batch):
    ctas = batch * 8  # kv_heads 8, one row tile
    s = decode.num_splits(ctas, key_tiles=16384 // 64, sms=132, slots=264)
    assert s > 1 and ctas * s <= 132 < ctas * (s + 1)  # contiguous: one CTA per SM
    s = decode.num_splits(ctas, key_tiles=16384 // 64, sms=132, slots=264, ctas_per_sm=2)
    assert ctas * s <= 264 < ctas * (s + 1)  # contiguous FP8: two per SM
    s = decode.num_splits(ctas, key_tiles=16384 // 64, sms=132, slots=396, ctas_per_sm=0)
    assert ctas * s <= 396 < ctas * (s + 1)  # paged: every resident slot


def test_heuristic_target_never_exceeds_the_slots():
    # two per SM asked, one slot per SM held: the slots are the target
    assert decode.num_splits(8, key_tiles=4096, sms=132, slots=132, ctas_per_sm=2) == 16


def test_heuristic_splits_a_grid_of_one_cta_per_sm_when_the_target_is_every_slot():
    # batch 16 x 8 KV heads = 128 CTAs: 97% of the SMs, but half the slots of a paged kernel
    assert decode.num_splits(128, key_tiles=256, sms=132, slots=264) == 1
    assert decode.num_splits(128, key_tiles=256, sms=132, slots=264, ctas_per_sm=0) == 2


def test_split_ctas_per_sm_by_cache_kind():
    assert decode.split_ctas_per_sm(paged=True, kv_fp8=False) == 0
    assert decode.split_ctas_per_sm(paged=True, kv_fp8=True) == 0
    assert decode.split_ctas_per_sm(paged=False, kv_fp8=True) == 2
    assert decode.split_ctas_per_sm(paged=False, kv_fp8=False) == 1


def test_heuristic_leaves_full_grids_and_short_caches_alone():
    assert decode.num_splits(64 * 8, key_tiles=2048, sms=132, slots=264) == 1
    assert decode.num_splits(64 * 8, key_tiles=2048, sms=132, slots=264, ctas_per_sm=0) == 1
    assert decode.num_splits(8, key_tiles=1, sms=132, slots=264) == 1
    assert decode.num_splits(0, key_tiles=100, sms=132, slots=264) == 1


def test_heuristic_never_exceeds_its_bounds():
    for ctas in (1, 3, 7, 50, 100):
        for tiles in (2, 5, 64, 4096):
            s = decode.num_splits(ctas, tiles, sms=132, slots=264)
            assert 1 <= s <= min(128, tiles)


def test_split_tiles_cover_the_schedule_once():
    for lo, hi, splits in ((0, 10, 3), (5, 6, 4), (2, 2, 3), (0, 129, 128)):
        got = [decode.split_tiles(lo, hi, splits, s) for s in range(splits)]
        covered = [n for a, b in got for n in range(a, b)]
        assert covered == list(range(lo, hi))


def test_workspace_holds_the_error_word_and_the_parts():
    assert decode.workspace_bytes(4, 32, 1, 128, 1) == 256
    got = decode.workspace_bytes(4, 32, 1, 128, 3)
    assert got == 256 + 3 * 4 * 32 * 128 * 4 + ((3 * 4 * 32 * 4 + 255) // 256) * 256


# -- IO model ----------------------------------------------------------------------------------


def test_io_model_counts_one_unsplit_contiguous_call_by_hand():
    s = one("dtype: bf16\nhead_dim: 64\ngqa: true\n")  # tile 16 x 128
    io = io_model_decode.decode_bytes(
        s, batch=2, heads=8, kv_heads=2, seqlen_q=1, seqlen_k=1000, cache_seqlens=[300, 0]
    )
    # sequence 0: 2 KV heads x (Q 4 rows, K and V 300 rows, O 4 rows, LSE 4 rows)
    assert io["Q"] == 2 * 4 * 64 * 2
    assert io["K"] == io["V"] == 2 * 300 * 64 * 2
    # sequence 1 reads nothing but its length and writes zeros / -inf
    assert io["O"] == 2 * 2 * 4 * 64 * 2 and io["LSE"] == 2 * 2 * 4 * 4
    assert io["SEQLENS"] == 4 * 2 * 2 and io["BLOCK_TABLE"] == 0
    assert io["total"] == sum(v for k, v in io.items() if k != "total")


def test_io_model_counts_pages_per_tile_and_the_combine():
    s = one("dtype: bf16\nhead_dim: 128\ngqa: true\npaged: true\n")  # tile 16 x 64
    kw = dict(batch=1, heads=4, kv_heads=1, seqlen_q=1, seqlen_k=0, cache_seqlens=[129])
    small = io_model_decode.decode_bytes(s, page_size=16, **kw)
    large = io_model_decode.decode_bytes(s, page_size=256, **kw)
    assert small["BLOCK_TABLE"] == 4 * 9  # pages 0..8 hold keys < 129
    assert large["BLOCK_TABLE"] == 4 * 1  # every key in page 0, its entry read once
    split = io_model_decode.decode_bytes(s, page_size=16, num_splits=3, **kw)
    assert split["K"] == small["K"] and split["O"] == small["O"]
    assert split["LSE_PARTS"] == 3 * 4 * 4 + 3 * 4 * 4  # written by 3 CTAs, read by 4 rows
    assert split["O_PARTS"] == 2 * 3 * 4 * 128 * 4  # every split sees a key: all read


def test_io_model_counts_one_slope_per_valid_row_of_every_split_cta():
    s = one("dtype: bf16\nhead_dim: 64\ngqa: true\nalibi: true\n")  # tile 16 x 128
    plain = one("dtype: bf16\nhead_dim: 64\ngqa: true\n")
    # 3 queries x group 8 = 24 rows: row tiles of 16 and 8 valid rows, 2 KV heads
    kw = dict(batch=2, heads=16, kv_heads=2, seqlen_q=3, seqlen_k=0, cache_seqlens=[300, 0])
    for splits in (1, 3):
        got = io_model_decode.decode_bytes(s, num_splits=splits, **kw)
        base = io_model_decode.decode_bytes(plain, num_splits=splits, **kw)
        diff = {k: got[k] - base[k] for k in io_model_decode.IO_KEYS if got[k] != base[k]}
        assert diff == {"SEQLENS": 4 * 24 * 2 * 2 * splits}  # rows x KV heads x batch x splits


def test_io_model_counts_each_rows_sink_where_its_lse_is_formed():
    s = one("dtype: bf16\nhead_dim: 64\ngqa: true\nsink: true\n")
    plain = one("dtype: bf16\nhead_dim: 64\ngqa: true\n")
    kw = dict(batch=2, heads=16, kv_heads=2, seqlen_q=3, seqlen_k=0, cache_seqlens=[300, 1])
    for splits in (1, 2, 5):  # the split kernel with one split, else the combine
        got = io_model_decode.decode_bytes(s, num_splits=splits, **kw)
        base = io_model_decode.decode_bytes(plain, num_splits=splits, **kw)
        diff = {k: got[k] - base[k] for k in io_model_decode.IO_KEYS if got[k] != base[k]}
        assert diff == {"SEQLENS": 4 * 3 * 16 * 2}  # one per output row (b, query, head)


def test_io_model_keys_follow_the_family_table():
    assert tuple(io_model_decode.IO_KEYS) == decode.IO_KEYS


# -- reference ---------------------------------------------------------------------------------


def test_decode_reference_of_a_split_cache_merges_to_the_whole():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 4, 16))
    k = rng.standard_normal((2, 50, 2, 16))
    v = rng.standard_normal((2, 50, 2, 16))
    lens = [50, 23]
    whole_o, whole_lse = reference_decode.decode_reference(q, k, v, lens)
    parts = [
        reference_decode.decode_reference(q, k[:, :10], v[:, :10], [10, 10]),
        reference_decode.decode_reference(q, k[:, 10:], v[:, 10:], [40, 13]),
    ]
    o, lse = reference_decode.merge_reference(
        np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    )
    np.testing.assert_allclose(o, whole_o, atol=1e-12)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-12)


def test_decode_reference_sees_bottom_right_causal_queries_and_empty_caches():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 2, 16))
    k = rng.standard_normal((2, 8, 2, 16))
    o, lse = reference_decode.decode_reference(q, k, k, [2, 0], causal="bottom_right")
    assert np.all(lse[0, :, 0] == -np.inf)  # query 0 of 3 sees keys < 2 - 3 + 1 = 0
    assert np.all(np.isfinite(lse[0, :, 1:]))
    assert np.all(lse[1] == -np.inf) and np.all(o[1] == 0.0)


def test_paged_copies_gather_back_to_the_cache():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 40, 2, 16)).astype(np.float32)
    lens = [0, 16, 33]
    pages, table = reference_decode.to_paged(k, lens, 16, rng)
    assert np.all(table[0] == -7) and np.all(table[2, 3:] == -7)
    back = reference_decode.gather_pages(pages, table, lens)
    for b, n in enumerate(lens):
        assert np.array_equal(back[b, :n], k[b, :n])


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_heuristic_mirrors_the_launchers_cpp(tmp_path):
    """generator/families/decode.py:num_splits and split_ctas_per_sm against
    fg::decode_num_splits and fg::decode_split_ctas_per_sm themselves (the C++ launcher's),
    compiled for the host, over a grid of call sizes and the four cache kinds."""
    inc = Path(__file__).resolve().parent.parent / "templates" / "include" / "flashgen"
    grid = [
        (c, t, sms, slots, f)
        for c in (0, 1, 3, 8, 16, 40, 64, 100, 106, 512)
        for t in (1, 2, 5, 64, 2048)
        for sms, slots in ((132, 264), (108, 216), (132, 132), (16, 0), (132, 100))
        for f in (0, 1, 2, -1)
    ]
    kinds = [(p, q) for p in (False, True) for q in (False, True)]
    src = tmp_path / "splits.cpp"
    src.write_text(
        "#include <cstdio>\n"
        # the limits decode_kernel.cuh defines (the launcher's templates name them)
        "namespace fg { constexpr int kDecodeMaxQueries = 16, kDecodeMaxSplits = 128; }\n"
        '#include "decode_launch.cuh"\n'
        + "".join(
            f"struct K{p:d}{q:d} {{ static constexpr bool kPaged = {str(p).lower()}, "
            f"kKvFp8 = {str(q).lower()}; }};\n"
            for p, q in kinds
        )
        + "int main() {\n"
        + "".join(
            f'  printf("%lld\\n", (long long)fg::decode_num_splits({c}, {t}, {s}, {w}, {f}));\n'
            for c, t, s, w, f in grid
        )
        + "".join(
            f'  printf("%lld\\n", (long long)fg::decode_split_ctas_per_sm<K{p:d}{q:d}>());\n'
            for p, q in kinds
        )
        + "  return 0;\n}\n"
    )
    exe = tmp_path / "splits"
    subprocess.run(["g++", "-std=c++17", "-I", str(inc), "-o", str(exe), str(src)], check=True)
    got = [
        int(x)
        for x in subprocess.run(
            [str(exe)], check=True, capture_output=True, text=True
        ).stdout.split()
    ]
    assert got[: len(grid)] == [decode.num_splits(c, t, s, w, f) for c, t, s, w, f in grid]
    assert got[len(grid) :] == [decode.split_ctas_per_sm(p, q) for p, q in kinds]


def test_tiles_whose_rows_do_not_split_evenly_over_the_threads_are_refused():
    """m32n64w8: 128 K and V rows over 256 threads (the kernel's static_assert) is a spec error
    naming the rule, not an nvcc failure."""
    with pytest.raises(SpecError, match="whole rows per thread"):
        one(
            "dtype: bf16\nhead_dim: 128\ngqa: true\n"
            "tile: {block_m: 32, block_n: 64, warps: 8, stages: 2}\n"
        )


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_launchers_check_takes_trap_on_error_0_or_1_only(tmp_path):
    """`<name>_check` of a generated decode kernel (nvcc, no GPU): trap_on_error 0 and 1 pass
    its rule (the next rule, heads >= 1, speaks for the defaults), anything else is named."""
    from flashgen.generator.writer import apply_plan, plan_generate

    spec = one("dtype: bf16\nhead_dim: 64\n")
    apply_plan(plan_generate([spec], tmp_path))  # as `flashgen generate` writes it
    name = kernel_name(spec)
    (tmp_path / "main.cu").write_text(
        f'#include <cstdio>\n#include "{name}.h"\n'
        "int main() {\n"
        "  for (long long t : {0LL, 1LL, 2LL, -1LL}) {\n"
        "    fg_decode_params p = fg_decode_params_default();\n"
        "    p.trap_on_error = t;\n"
        f"    const char* m = {name}_check(&p);\n"
        '    printf("%s\\n", m ? m : "ok");\n'
        "  }\n  return 0;\n}\n"
    )
    exe = tmp_path / "main"
    subprocess.run(["nvcc", "-std=c++17", "-O0", "-arch=sm_90", f"-I{tmp_path}", "-o", str(exe),
                    str(tmp_path / "main.cu"), str(tmp_path / f"{name}.cu")],
                   check=True, capture_output=True, text=True)  # fmt: skip
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    lines = got.splitlines()
    assert lines[0] == lines[1] == "batch must be >= 0, heads and kv_heads >= 1"
    want = "trap_on_error must be 0 (flag bad device values in the error word) or 1 (and trap)"
    assert lines[2] == lines[3] == want
