"""Spec model, YAML loading and validation: what a spec file means and how it is rejected."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from flashgen.generator.families.forward import HEAD_DIMS, tile_problems
from flashgen.generator.load import load_paths, load_spec_file, load_spec_text
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import (
    ELEMENTS,
    Causal,
    Dtype,
    KernelKind,
    KernelSpec,
    KvDtype,
    Mask,
    Sparsity,
    SpecError,
    Target,
    Tile,
)
from flashgen.generator.tiles import MEASURED_DEFAULTS, auto_tile, fit_tile, paper_tile, tile_fits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent


def load(text: str, file: str = "spec.yaml") -> list[KernelSpec]:
    return load_spec_text(textwrap.dedent(text), file)


def one(text: str) -> KernelSpec:
    (spec,) = load(text)
    return spec


# --------------------------------------------------------------------------------------------
# Enum tables
# --------------------------------------------------------------------------------------------


def test_dtype_table_holds_yaml_cpp_size_and_numpy_spellings():
    assert [(d.yaml, d.cpp, d.nbytes, d.numpy_name) for d in Dtype] == [
        ("fp16", "__half", 2, "float16"),
        ("bf16", "__nv_bfloat16", 2, "bfloat16"),
    ]


def test_dtypes_are_views_of_the_element_table():
    assert [(e.ptx, e.cpp, e.nbytes, e.mma_k, e.rounding, e.min_cc) for e in ELEMENTS.values()] == [
        ("f16", "__half", 2, 16, "rn", 80),
        ("bf16", "__nv_bfloat16", 2, 16, "rn", 80),
        ("e4m3", "__nv_fp8_e4m3", 1, 32, "rn.satfinite", 89),
    ]
    for e in ELEMENTS.values():
        assert e.mma_k * e.nbytes == 32  # one MMA reduces 32 bytes of each row
    for d in Dtype:
        assert d.k_element is d.v_element is d.out_element is d.element
        assert d.short == d.yaml and d.torch_name == d.numpy_name == d.element.array_name
    (kv,) = KvDtype
    assert (kv.yaml, kv.short, kv.cpp, kv.nbytes, kv.torch_name, kv.min_cc) == (
        "e4m3",
        "kve4m3",
        "__nv_fp8_e4m3",
        1,
        "float8_e4m3fn",
        89,
    )
    assert kv.k_element is kv.v_element is ELEMENTS["e4m3"] and kv.out_element is None


def test_causal_table_holds_yaml_short_and_cpp_spellings():
    assert [(c.yaml, c.short, c.cpp) for c in Causal] == [
        ("none", "", "fg::Causal::kNone"),
        ("top_left", "causaltl", "fg::Causal::kTopLeft"),
        ("bottom_right", "causalbr", "fg::Causal::kBottomRight"),
    ]


def test_kind_and_sparsity_tables():
    assert [(k.yaml, k.short) for k in KernelKind] == [
        ("forward", "fwd"), ("backward", "bwd"), ("decode", "dec"),
    ]  # fmt: skip
    assert [(s.yaml, s.short) for s in Sparsity] == [("none", ""), ("block", "sparse")]


def test_target_table_holds_arch_cc_and_hardware_limits():
    rows = [(t.arch, t.short, t.cc, t.info.max_smem_per_block, t.info.sm_count) for t in Target]
    assert rows == [
        ("sm_80", "sm80", 80, 166912, 108),
        ("sm_86", "sm86", 86, 101376, 84),
        ("sm_89", "sm89", 89, 101376, 128),
        ("sm_90", "sm90", 90, 232448, 132),
        ("sm_90a", "sm90a", 90, 232448, 132),
    ]
    assert Target.SM90A.gencode == "arch=compute_90a,code=[sm_90a,compute_90a]"
    for t in Target:
        assert (t.info.regs_per_sm, t.info.max_regs_per_thread) == (65536, 255)
        assert t.info.max_threads_per_block == 1024


@pytest.mark.parametrize("cls", [KernelKind, Dtype, Causal, Sparsity, Target])
def test_every_enum_round_trips_through_its_yaml_spelling(cls):
    for member in cls:
        assert cls.from_yaml(member.yaml) is member
        assert str(member) == member.yaml


# --------------------------------------------------------------------------------------------
# Defaults, derived values, canonical form
# --------------------------------------------------------------------------------------------


def test_minimal_spec_takes_documented_defaults():
    s = one("dtype: bf16\nhead_dim: 128\n")
    assert s.kernel is KernelKind.FORWARD
    assert s.target is Target.SM90
    assert s.tile_auto and s.tile == auto_tile(Target.SM90, Dtype.BF16, 128)
    assert s.mask == Mask(Causal.NONE, False, False)
    assert s.sparsity is Sparsity.NONE and not s.sparse
    assert not (s.dropout or s.debug_keep_mask or s.gqa or s.instrument_io or s.allow_spills)


def test_full_example_from_docs_loads():
    s = one(
        """
        kernel: forward
        dtype: bf16
        head_dim: 128
        tile: {block_m: 128, block_n: 64, warps: 4, stages: 2}
        mask: {causal: top_left, window: true, varlen: true}
        dropout: true
        debug_keep_mask: true
        sparsity: block
        gqa: true
        target: sm_80
        instrument_io: true
        allow_spills: true
        """
    )
    assert s.tile == Tile(128, 64, 4, 2) and not s.tile_auto
    assert s.mask == Mask(Causal.TOP_LEFT, True, True)
    assert s.sparse and s.gqa and s.dropout and s.debug_keep_mask and s.target is Target.SM80


def test_threads_and_smem_follow_the_padded_row_formula():
    s = one("dtype: fp16\nhead_dim: 64\ntile: {block_m: 64, block_n: 32, warps: 2, stages: 3}\n")
    assert s.threads == 64
    assert s.smem_bytes == (64 + 2 * 3 * 32) * (64 + 8) * 2


def test_canonical_form_has_fixed_key_order_and_yaml_spellings():
    s = one("dtype: bf16\nhead_dim: 64\nmask: {causal: bottom_right}\n")
    c = s.to_canonical()
    assert list(c) == [
        "kernel", "head_dim", "dtype", "mask", "gqa", "dropout", "debug_keep_mask",
        "sparsity", "deterministic", "paged", "softcap", "alibi", "sink", "instrument_io",
        "tile", "tile_auto", "target", "allow_spills",
    ]  # fmt: skip
    assert c["mask"] == {"causal": "bottom_right", "window": False, "varlen": False}
    assert c["tile_auto"] is True and c["target"] == "sm_90"


def test_canonical_form_round_trips():
    s = one("dtype: fp16\nhead_dim: 96\ngqa: true\nsparsity: block\n")
    assert KernelSpec.from_canonical(s.to_canonical()) == s


def test_source_is_file_and_line_but_not_part_of_identity():
    a = one("dtype: bf16\nhead_dim: 64\n")
    b = load("\n\ndtype: bf16\nhead_dim: 64\n", "other.yaml")[0]
    assert a.source == "spec.yaml:1" and b.source == "other.yaml:3"
    assert a == b and hash(a) == hash(b) and kernel_name(a) == kernel_name(b)
    assert "source" not in a.to_canonical()


def test_specs_are_frozen():
    s = one("dtype: bf16\nhead_dim: 64\n")
    with pytest.raises(AttributeError):
        s.head_dim = 128  # type: ignore[misc]


def test_direct_construction_validates_too():
    with pytest.raises(SpecError, match="head_dim: 68 is not allowed"):
        KernelSpec(KernelKind.FORWARD, Dtype.BF16, 68, Tile(64, 64, 4, 2))
    with pytest.raises(SpecError, match="dtype: 'bf16' is not a Dtype"):
        KernelSpec(KernelKind.FORWARD, "bf16", 64, Tile(64, 64, 4, 2))  # type: ignore[arg-type]


def test_booleans_are_only_true_and_false():
    assert one("dtype: bf16\nhead_dim: 64\ngqa: True\n").gqa is True
    with pytest.raises(SpecError, match="gqa: 'on' is a string, expected true or false"):
        load("dtype: bf16\nhead_dim: 64\ngqa: on\n")


# --------------------------------------------------------------------------------------------
# Families and multi-entry files
# --------------------------------------------------------------------------------------------


def test_family_is_the_cross_product_in_field_order():
    specs = load(
        """
        dtype: [fp16, bf16]
        head_dim: [64, 128]
        mask: {causal: [none, bottom_right]}
        """
    )
    got = [(s.head_dim, s.dtype.yaml, s.mask.causal.yaml) for s in specs]
    assert got == [  # spec.FIELDS order: head_dim before dtype
        (64, "fp16", "none"), (64, "fp16", "bottom_right"),
        (64, "bf16", "none"), (64, "bf16", "bottom_right"),
        (128, "fp16", "none"), (128, "fp16", "bottom_right"),
        (128, "bf16", "none"), (128, "bf16", "bottom_right"),
    ]  # fmt: skip


def test_tile_and_tile_fields_may_be_lists():
    specs = load(
        """
        dtype: bf16
        head_dim: 64
        tile: [auto, {block_m: 64, block_n: [32, 64], warps: 4, stages: 2}]
        """
    )
    assert [(s.tile_auto, s.tile.block_n) for s in specs] == [
        (True, auto_tile(Target.SM90, Dtype.BF16, 64).block_n),
        (False, 32),
        (False, 64),
    ]


def test_kernels_list_with_defaults_merges_mask_key_by_key():
    specs = load(
        """
        defaults:
          dtype: bf16
          mask: {causal: bottom_right}
        kernels:
          - head_dim: 64
          - head_dim: 128
            mask: {window: true}
          - head_dim: 128
            dtype: fp16
        """
    )
    assert [(s.dtype.yaml, s.head_dim, s.mask.causal.yaml, s.mask.window) for s in specs] == [
        ("bf16", 64, "bottom_right", False),
        ("bf16", 128, "bottom_right", True),
        ("fp16", 128, "bottom_right", False),
    ]
    assert [s.source for s in specs] == ["spec.yaml:6", "spec.yaml:7", "spec.yaml:9"]


def test_shipped_dense_family_declares_24_sm90_kernels():
    specs = load_spec_file(REPO / "specs" / "fwd_dense.yaml")
    assert len(specs) == 24 and len(set(specs)) == 24
    assert {s.target for s in specs} == {Target.SM90}
    assert {s.head_dim for s in specs} == {32, 64, 96, 128, 192, 256}
    assert all(s.tile_auto for s in specs)
    assert specs[0].source == "specs/fwd_dense.yaml:3"


def test_a_kernel_declared_in_two_files_is_rejected(tmp_path):
    (tmp_path / "a.yaml").write_text("dtype: bf16\nhead_dim: 64\n")
    (tmp_path / "b.yaml").write_text("# same\ndtype: bf16\nhead_dim: 64\n")
    with pytest.raises(SpecError, match=r"b\.yaml:2: duplicate kernel.*a\.yaml:1"):
        load_paths([tmp_path])


def test_directory_means_its_yaml_files_sorted(tmp_path):
    (tmp_path / "b.yml").write_text("dtype: bf16\nhead_dim: 64\n")
    (tmp_path / "a.yaml").write_text("dtype: fp16\nhead_dim: 64\n")
    (tmp_path / "notes.txt").write_text("not a spec")
    assert [s.dtype.yaml for s in load_paths([tmp_path])] == ["fp16", "bf16"]


# --------------------------------------------------------------------------------------------
# Rejections: each message names file, line, field, the bad value and what is allowed
# --------------------------------------------------------------------------------------------

BAD_SPECS = [
    pytest.param(
        "dtype: bf16\nhead_dim: 128\nmask: {causal: bottomright}\n",
        [
            "spec.yaml:3:",
            "mask.causal:",
            "'bottomright'",
            "none, top_left, bottom_right",
            "did you mean 'bottom_right'",
        ],
        id="bad-enum-value-with-suggestion",
    ),
    pytest.param(
        "dtype: bf16\nhead_dims: 128\n",
        ["spec.yaml:2:", "unknown key 'head_dims'", "did you mean 'head_dim'"],
        id="unknown-key",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\nmask: {causal: none, windw: true}\n",
        ["spec.yaml:3:", "mask.windw:", "allowed: causal, window, varlen", "did you mean 'window'"],
        id="unknown-mask-key",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile: {block_m: 64, blockn: 64, warps: 4, stages: 2}\n",
        ["spec.yaml:3:", "tile.blockn:", "did you mean 'block_n'"],
        id="unknown-tile-key",
    ),
    pytest.param(
        'dtype: bf16\nhead_dim: "128"\n',
        ["spec.yaml:2:", "head_dim:", "'128' is a string, expected an integer"],
        id="head-dim-as-string",
    ),
    pytest.param(
        'dtype: bf16\nhead_dim: 128\ndropout: "yes"\n',
        ["spec.yaml:3:", "dropout:", "'yes' is a string, expected true or false"],
        id="bool-as-string",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64.0\n",
        ["spec.yaml:2:", "head_dim:", "64.0 is a float"],
        id="head-dim-as-float",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 68\n",
        ["spec.yaml:2:", "head_dim:", "68 is not allowed", "multiples of 8 in 8..256"],
        id="head-dim-not-multiple-of-16",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 272\n",
        ["spec.yaml:2:", "head_dim: 272 is not allowed"],
        id="head-dim-too-large",
    ),
    pytest.param(
        "head_dim: 64\n",
        ["spec.yaml:1:", "dtype: required field is missing"],
        id="missing-required-field",
    ),
    pytest.param("", ["spec.yaml:", "file is empty"], id="empty-file"),
    pytest.param(
        "- dtype: bf16\n",
        ["spec.yaml:1:", "top level must be a mapping", "got a list"],
        id="top-level-list",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: []\n",
        ["spec.yaml:2:", "head_dim:", "empty list"],
        id="empty-family-list",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: [64,\n  64]\n",
        ["spec.yaml:3:", "duplicate kernel in family", "head_dim=64"],
        id="duplicate-in-family",
    ),
    pytest.param(
        "kernels:\n  - {dtype: bf16, head_dim: 64}\n  - {dtype: bf16, head_dim: 64}\n",
        ["spec.yaml:3:", "kernels[1]", "duplicate kernel", "spec.yaml:2"],
        id="duplicate-entries",
    ),
    pytest.param(
        "kernel: decode\ndtype: bf16\nhead_dim: 100\n",
        ["spec.yaml:3:", "head_dim:", "100 is not allowed (allowed: multiples of 8 in 8..192)"],
        id="decode-head-dim",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\npaged: true\n",
        ["spec.yaml:3:", "paged:", "applies to kernel: decode only, not forward"],
        id="paged-forward",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntarget: sm_100\n",
        ["spec.yaml:3:", "target:", "'sm_100'", "sm_80, sm_86, sm_89, sm_90"],
        id="unknown-target",
    ),
    pytest.param(
        "dtype: fp32\nhead_dim: 64\n",
        ["spec.yaml:1:", "dtype:", "'fp32'", "allowed: fp16, bf16"],
        id="unknown-dtype",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ndebug_keep_mask: true\n",
        ["spec.yaml:3:", "debug_keep_mask:", "requires dropout: true"],
        id="keep-mask-without-dropout",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile:\n  block_m: 96\n  block_n: 64\n  warps: 4\n  stages: 2\n",
        ["spec.yaml:4:", "tile.block_m:", "96", "allowed with warps=4: 64, 128"],
        id="block-m-not-matching-warps",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile: {block_m: 64, block_n: 64, warps: 3, stages: 2}\n",
        ["spec.yaml:3:", "tile.warps:", "3 is not allowed (allowed: 1, 2, 4, 8)"],
        id="bad-warps",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile: {block_m: 64, block_n: 40, warps: 4, stages: 2}\n",
        ["spec.yaml:3:", "tile.block_n:", "40 is not allowed", "multiples of 16 in 16..256"],
        id="bad-block-n",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile: {block_m: 64, block_n: 64, warps: 4, stages: 4}\n",
        ["spec.yaml:3:", "tile.stages:", "4 is not allowed (allowed: 1, 2, 3)"],
        id="bad-stages",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 256\ntile: {block_m: 128, block_n: 128, warps: 4, stages: 3}\n",
        ["spec.yaml:3:", "tile:", "473088 bytes of shared memory", "sm_90 allows 232448"],
        id="smem-over-target-limit",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntarget: [sm_90, sm_86]\n"
        "tile: {block_m: 128, block_n: 128, warps: 4, stages: 3}\n",
        ["spec.yaml:4:", "sm_86 allows 101376", "in family member target=sm_86"],
        id="family-member-over-limit",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile: {block_m: 64, block_n: 64, warps: 4}\n",
        ["spec.yaml:3:", "tile.stages:", "missing stages"],
        id="incomplete-tile",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\ntile: automatic\n",
        ["spec.yaml:3:", "tile:", "'automatic' is not allowed (allowed: auto, or a mapping"],
        id="bad-tile-word",
    ),
    pytest.param(
        "dtype: bf16\ndtype: fp16\nhead_dim: 64\n",
        ["spec.yaml:2:", "dtype: duplicate key (first given on line 1)"],
        id="duplicate-yaml-key",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\n  oops: 1\n",
        ["spec.yaml:3:", "invalid YAML"],
        id="yaml-syntax-error",
    ),
    pytest.param(
        "dtype: bf16\nkernels:\n  - {head_dim: 64}\n",
        ["spec.yaml:1:", "dtype: unexpected top-level key next to `kernels:`"],
        id="field-next-to-kernels",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: 64\nmask: [none]\n",
        ["spec.yaml:3:", "mask: expected a mapping"],
        id="mask-as-list",
    ),
    pytest.param(
        "dtype: bf16\nhead_dim: [[64]]\n",
        ["spec.yaml:2:", "head_dim[0]:", "nested list"],
        id="nested-list",
    ),
]


@pytest.mark.parametrize("text, expected", BAD_SPECS)
def test_bad_spec_is_rejected_with_a_precise_message(text, expected):
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "spec.yaml")
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_error_exposes_file_line_and_field():
    with pytest.raises(SpecError) as info:
        load_spec_text("dtype: bf16\nhead_dim: 64\nsparsity: dense\n", "x.yaml")
    e = info.value
    assert (e.file, e.line, e.field) == ("x.yaml", 3, "sparsity")


def test_family_error_points_at_the_bad_item_line():
    text = "dtype: bf16\nhead_dim:\n  - 64\n  - 80\n  - 100\n"
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "x.yaml")
    assert info.value.line == 5 and "100" in str(info.value)


# --------------------------------------------------------------------------------------------
# Auto tiles
# --------------------------------------------------------------------------------------------


def test_measured_defaults_take_priority_when_they_fit():
    for (target, d), tile in MEASURED_DEFAULTS.items():
        for dtype in Dtype:
            if tile_fits(tile, target, dtype, d):
                assert auto_tile(target, dtype, d) == tile


def test_a_measured_entry_overrides_the_paper_rule(monkeypatch):
    assert (Target.SM80, 64) not in MEASURED_DEFAULTS
    monkeypatch.setitem(MEASURED_DEFAULTS, (Target.SM80, 64), Tile(64, 32, 4, 1))
    assert auto_tile(Target.SM80, Dtype.BF16, 64) == Tile(64, 32, 4, 1)


def test_a_measured_entry_that_does_not_fit_is_shrunk(monkeypatch):
    monkeypatch.setitem(MEASURED_DEFAULTS, (Target.SM86, 256), Tile(128, 128, 8, 3))
    t = auto_tile(Target.SM86, Dtype.BF16, 256)
    assert tile_fits(t, Target.SM86, Dtype.BF16, 256)


def test_paper_rule_from_shared_memory_size():
    # sm_80: M = 166912 / 2 = 83456 elements; d = 128: B_c = ceil(83456 / 512) = 163 -> 128
    assert paper_tile(Target.SM80, Dtype.BF16, 128) == Tile(128, 128, 4, 2)
    # sm_86, d = 128: B_c = 99 -> 96, B_r = 96 < 128 -> block_m 64
    assert paper_tile(Target.SM86, Dtype.BF16, 128) == Tile(64, 96, 4, 2)


def test_paper_tile_is_shrunk_until_it_fits():
    # sm_86 d=128 paper tile needs (64 + 4*96) * 136 * 2 = 121856 > 101376 bytes
    t = fit_tile(paper_tile(Target.SM86, Dtype.BF16, 128), Target.SM86, Dtype.BF16, 128)
    assert tile_fits(t, Target.SM86, Dtype.BF16, 128)
    assert t == Tile(64, 64, 4, 2)


def test_the_register_safe_tile_shrinks_its_keys_not_its_rows_to_fit():
    # sm_86 d=128: the measured 128x64 on 8 warps needs 104448 > 101376 bytes; block_n goes
    # down (fewer registers), rows per warp stay (docs/tiles.md)
    t = auto_tile(Target.SM86, Dtype.BF16, 128)
    assert tile_fits(t, Target.SM86, Dtype.BF16, 128)
    assert t == Tile(128, 48, 8, 2)


FORWARD_TARGETS = [t for t in Target if t is not Target.SM90A]


@pytest.mark.parametrize("target", FORWARD_TARGETS)
@pytest.mark.parametrize("dtype", list(Dtype))
def test_auto_tile_is_valid_for_every_head_dim(target, dtype):
    for d in HEAD_DIMS:
        spec = KernelSpec(
            KernelKind.FORWARD, dtype, d, auto_tile(target, dtype, d), True, target=target
        )
        assert spec.smem_bytes <= target.info.max_smem_per_block


def test_measured_table_entries_are_legal_tiles():
    for (target, d), tile in MEASURED_DEFAULTS.items():
        assert not tile_problems(tile), (target, d, tile)


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------

MUTATIONS = [
    ("dtype", "fp8"),
    ("dtype", 16),
    ("head_dim", 100),
    ("head_dim", 0),
    ("head_dim", "64"),
    ("head_dim", True),
    ("dropout", "false"),
    ("gqa", 1),
    ("target", "sm_75"),
    ("sparsity", "blocks"),
    ("kernel", "prefill"),  # not a kind (decode accepts some of these mappings since d 8)
    ("kernel", "fwd"),
    ("heads", 8),
    ("mask", {"causal": "bottom-right"}),
    ("mask", {"windows": True}),
    ("tile", {"block_m": 64, "block_n": 64, "warps": 5, "stages": 2}),
    ("tile", {"block_m": 48, "block_n": 64, "warps": 1, "stages": 2}),
    ("tile", {"block_m": 64, "block_n": 24, "warps": 4, "stages": 2}),
    ("tile", {"block_m": 64, "block_n": 64, "warps": 4, "stages": 0}),
    ("tile", {"block_m": 64, "block_n": 64, "warps": 4}),
    ("tile", "fixed"),
    ("debug_keep_mask", True),
    ("head_dim", []),
]


@st.composite
def valid_mappings(draw):
    d = {
        "dtype": draw(st.sampled_from(Dtype.allowed())),
        "head_dim": draw(st.sampled_from(HEAD_DIMS)),
        "mask": {
            "causal": draw(st.sampled_from(Causal.allowed())),
            "window": draw(st.booleans()),
            "varlen": draw(st.booleans()),
        },
        "target": draw(st.sampled_from([t.yaml for t in FORWARD_TARGETS])),
        "gqa": draw(st.booleans()),
        "sparsity": draw(st.sampled_from(Sparsity.allowed())),
    }
    d["dropout"] = draw(st.booleans())
    d["debug_keep_mask"] = d["dropout"] and draw(st.booleans())
    return d


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_mappings(), st.sampled_from(MUTATIONS))
def test_any_invalid_field_raises_spec_error(mapping, mutation):
    key, value = mutation
    mapping = dict(mapping)
    if key == "debug_keep_mask":
        mapping["dropout"] = False
    mapping[key] = value
    with pytest.raises(SpecError) as info:
        load_spec_text(yaml.safe_dump(mapping), "p.yaml")
    assert str(info.value).startswith("p.yaml:")


@settings(max_examples=60, deadline=None)
@given(valid_mappings())
def test_valid_mappings_load_to_one_valid_spec(mapping):
    (spec,) = load_spec_text(yaml.safe_dump(mapping), "p.yaml")
    assert spec.smem_bytes <= spec.target.info.max_smem_per_block
    assert spec.dtype.yaml == mapping["dtype"] and spec.head_dim == mapping["head_dim"]


def test_sm90a_forward_is_served_by_the_hopper_family():
    from flashgen.generator.families import family

    spec = one("dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n")
    assert family(spec).templates == "forward_sm90" and spec.threads == (spec.tile.warps + 4) * 32
    assert family(one("dtype: bf16\nhead_dim: 64\n")).templates == "forward"
    # the portable mma.sync family refuses sm_90a, naming the targets it takes
    from flashgen.generator.families.forward import FAMILY as MMA_SYNC

    problems = dict(MMA_SYNC.problems(spec))
    assert "not served by the mma.sync forward" in problems["target"]


@pytest.mark.parametrize(
    "text",
    [
        "mask: {causal: bottom_right, varlen: true}",
        "sparsity: block",
        "instrument_io: true",
        "mask: {varlen: true, window: true}\ngqa: true\nsparsity: block\ninstrument_io: true",
    ],
)
def test_hopper_forward_serves_varlen_sparsity_and_instrument_io(text):
    from flashgen.generator.families import family

    spec = one(f"dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n{text}\n")
    assert family(spec).templates == "forward_sm90" and spec.tile_auto


def test_decode_refuses_sm90a():
    with pytest.raises(SpecError, match="sm_90a"):
        load("kernel: decode\ndtype: bf16\nhead_dim: 128\ntarget: sm_90a\n")


def test_the_sm90a_backward_names_what_it_does_not_take_and_where_it_is():
    base = "kernel: backward\ndtype: bf16\ntarget: sm_90a\n"
    spec = one(base + "head_dim: 64\n")
    assert spec.tile.block_n == 128 and spec.threads == 384  # two consumer + one producer WG
    for extra, field in (
        ("head_dim: 64\ndropout: true\n", "dropout"),
        ("head_dim: 64\nsparsity: block\n", "sparsity"),
        ("head_dim: 64\ninstrument_io: true\n", "instrument_io"),
    ):
        with pytest.raises(SpecError, match=rf"{field}: not on the sm_90a .*target: sm_90"):
            load(base + extra)
    # varlen with a score_mod is taken (a sequence's own positions): served here, not refused
    spec = one(base + 'head_dim: 64\nmask: {varlen: true}\nscore_mod: "s * 0.5"\n')
    assert spec.mask.varlen and spec.score_mod is not None and spec.tile.block_n == 128
    with pytest.raises(SpecError, match=r"head_dim: 192 is not allowed on the sm_90a backward"):
        load(base + "head_dim: 192\n")
    with pytest.raises(SpecError, match=r"tile.warps: 4 is not allowed on the sm_90a backward"):
        load(base + "head_dim: 64\ntile: {block_m: 64, block_n: 128, warps: 4, stages: 2}\n")


def test_the_sm90a_backward_takes_varlen():
    from flashgen.generator.families import family
    from flashgen.generator.render import Renderer

    spec = one(
        "kernel: backward\ndtype: bf16\ntarget: sm_90a\nhead_dim: 128\n"
        "mask: {causal: bottom_right, varlen: true}\ndeterministic: true\n"
    )
    assert family(spec).templates == "backward_sm90" and spec.mask.varlen
    cu = next(t.decode() for n, t in Renderer().render(spec).files.items() if n.endswith(".cu"))
    assert "kVarlen = true" in cu


def test_the_sm90a_backward_takes_deterministic_with_its_counters_and_tile_rule():
    """deterministic on sm_90a: the kernel gets kDeterministic, the launcher zeroes dq_sem
    (sized per query tile of the spec's block_m), and a window keeps 64 query rows at 64
    padded columns (its turn's search spilled at 128)."""
    from flashgen.generator.render import Renderer

    def cu_of(spec):
        files = Renderer().render(spec).files
        return next(text.decode() for name, text in files.items() if name.endswith(".cu"))

    base = "kernel: backward\ndtype: bf16\ntarget: sm_90a\ndeterministic: true\n"
    spec = one(base + "head_dim: 64\n")
    assert spec.deterministic and spec.tile.block_m == 128
    assert "_det_" in Renderer().name(spec)
    windowed = one(base + "head_dim: 64\nmask: {causal: top_left, window: true}\ngqa: true\n")
    assert windowed.tile.block_m == 64
    assert one(base.replace("deterministic: true\n", "") + "head_dim: 64\n").tile.block_m == 128
    # ALiBi without a mask takes 64 rows at 64 columns (128 spill); with causal or a window 128
    alibi = "kernel: backward\ndtype: bf16\ntarget: sm_90a\nhead_dim: 64\nalibi: true\n"
    assert one(alibi).tile.block_m == 64
    assert one(alibi + "mask: {causal: bottom_right}\n").tile.block_m == 128
    assert one(alibi + "mask: {causal: none, window: true}\n").tile.block_m == 128
    assert one(alibi.replace("64", "128") + "mask: {causal: bottom_right}\n").tile.block_m == 64
    cu = cu_of(spec)
    assert "kDeterministic = true" in cu
    assert "cudaMemsetAsync(p.dq_sem, 0, fg::bwd_sem_used<Cfg>(p), stream)" in cu
    plain_cu = cu_of(one(base.replace("deterministic: true\n", "") + "head_dim: 64\n"))
    assert "kDeterministic = false" in plain_cu and "dq_sem" not in plain_cu


def test_a_field_of_another_family_is_rejected_naming_where_it_applies():
    with pytest.raises(SpecError, match="deterministic: applies to kernel: backward only"):
        load("dtype: bf16\nhead_dim: 64\ndeterministic: true\n")


def test_every_field_of_the_table_is_in_the_canonical_form():
    from flashgen.generator.spec import FIELDS

    c = one("dtype: bf16\nhead_dim: 64\n").to_canonical()
    for f in FIELDS:
        if f.optional:  # absent by default: left out (score_mod, params)
            assert f.path not in c
            continue
        assert (c[f.top][f.sub] if f.sub else c[f.path]) is not None


@pytest.mark.parametrize("tile", ["auto", {"block_m": 64}, None])
def test_a_malformed_canonical_tile_is_a_spec_error(tile):
    c = one("dtype: bf16\nhead_dim: 64\n").to_canonical()
    with pytest.raises(SpecError, match="canonical tile must be a mapping"):
        KernelSpec.from_canonical({**c, "tile": tile})
