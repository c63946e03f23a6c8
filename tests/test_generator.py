"""Rendering, naming, writing, manifest, --check plans and nvcc compilation."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import jinja2
import pytest
import yaml
from flashgen.generator import __version__
from flashgen.generator.compile import compile_specs, parse_ptxas
from flashgen.generator.families.forward import HEAD_DIMS, smem_bytes
from flashgen.generator.load import load_spec_text
from flashgen.generator.naming import kernel_name, readable_parts, spec_hash
from flashgen.generator.render import Renderer, banner_lines, render_context
from flashgen.generator.spec import Causal, Dtype, KernelSpec, Sparsity, SpecError, Target, Tile
from flashgen.generator.writer import (
    MANIFEST_NAME,
    README_BEGIN,
    README_END,
    apply_plan,
    check_plan,
    plan_generate,
    replace_readme_table,
    verification_status,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
REAL_TEMPLATES = REPO / "templates"
HAVE_REAL_TEMPLATES = (REAL_TEMPLATES / "forward" / "kernel.cu.j2").is_file()

TINY_CU = """\
// {{ banner | join("\\n// ") }}
#include "{{ header_name }}"
#include "include/flashgen/params.h"
// {{ cfg.dtype_cpp }} d={{ cfg.head_dim }} m={{ cfg.block_m }} n={{ cfg.block_n }}
// warps={{ cfg.warps }} threads={{ cfg.threads }} stages={{ cfg.stages }}
// smem={{ cfg.smem_bytes }} {{ cfg.causal_cpp }} sm={{ cfg.sm }}
// window={{ cfg.window }} varlen={{ cfg.varlen }} gqa={{ cfg.gqa }} dropout={{ cfg.dropout }}
// keep={{ cfg.debug_keep_mask }} sparse={{ cfg.sparse }} io={{ cfg.instrument_io }}
// spec.head_dim={{ spec.head_dim }}
extern "C" __global__ void {{ name }}_kernel(fg_fwd_params p) {}
"""
TINY_H = """\
// {{ banner | join("\\n// ") }}
#pragma once
void {{ name }}_launch(const void* params, void* stream);
"""


def make_templates(root: Path) -> Path:
    (root / "include" / "flashgen").mkdir(parents=True)
    (root / "forward").mkdir(parents=True)
    (root / "forward" / "kernel.cu.j2").write_text(TINY_CU)
    (root / "forward" / "kernel.h.j2").write_text(TINY_H)
    (root / "include" / "flashgen" / "params.h").write_text(
        "typedef struct {int x;} fg_fwd_params;\n"
    )
    return root


@pytest.fixture
def templates(tmp_path: Path) -> Path:
    return make_templates(tmp_path / "templates")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "generated"


def specs_of(text: str, file: str = "specs/t.yaml") -> list[KernelSpec]:
    return load_spec_text(textwrap.dedent(text), file)


def spec_of(text: str, file: str = "specs/t.yaml") -> KernelSpec:
    (s,) = specs_of(text, file)
    return s


def generate(specs, out, templates, **kw):
    plan = plan_generate(specs, out, templates_dir=templates, records_dir=out.parent / "rec", **kw)
    apply_plan(plan)
    return plan


def snapshot(d: Path) -> dict[str, bytes]:
    return {
        p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
    }


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

NAME_CASES = [
    ("dtype: bf16\nhead_dim: 128\nmask: {causal: bottom_right}\n"
     "tile: {block_m: 128, block_n: 64, warps: 4, stages: 2}\n",
     "fa_fwd_d128_bf16_causalbr_m128n64w4s2_sm90"),
    ("dtype: fp16\nhead_dim: 64\ntile: {block_m: 64, block_n: 32, warps: 2, stages: 1}\n"
     "target: sm_80\n",
     "fa_fwd_d64_fp16_m64n32w2s1_sm80"),
    ("dtype: fp16\nhead_dim: 32\nmask: {causal: top_left, window: true, varlen: true}\n"
     "gqa: true\ndropout: true\ndebug_keep_mask: true\nsparsity: block\ninstrument_io: true\n"
     "tile: {block_m: 64, block_n: 64, warps: 4, stages: 2}\ntarget: sm_86\n",
     "fa_fwd_d32_fp16_causaltl_win_varlen_gqa_drop_dropdbg_sparse_io_m64n64w4s2_sm86"),
    ("dtype: bf16\nhead_dim: 256\ntile: {block_m: 64, block_n: 32, warps: 4, stages: 2}\n",
     "fa_fwd_d256_bf16_m64n32w4s2_sm90"),
]  # fmt: skip


@pytest.mark.parametrize("text, readable", NAME_CASES)
def test_name_is_readable_parts_then_8_hex_hash(text, readable, templates):
    spec = spec_of(text)
    name = kernel_name(spec, templates)
    assert "_".join(readable_parts(spec)) == readable
    head, _, digest = name.rpartition("_")
    assert head == readable
    assert len(digest) == 8 and int(digest, 16) >= 0


def test_golden_name_with_fixed_templates(templates):
    spec = spec_of(NAME_CASES[0][0])
    # The hash covers canonical spec + template bytes + generator version: update this golden
    # value deliberately when the version or the tiny templates above change.
    assert kernel_name(spec, templates) == "fa_fwd_d128_bf16_causalbr_m128n64w4s2_sm90_" + (
        spec_hash(spec, templates)
    )
    assert spec_hash(spec, templates) == GOLDEN_HASH


GOLDEN_HASH = "cde09ef5"  # generator 0.1.0, the tiny templates above, hash over included files
# (changed with the score-stage feature fields of the canonical spec, then with head_dim_pad,
# then with the render context's `user_score`, then with its `user_mask`, then with its
# `head_dim_v` and `head_dim_v_pad`)


def test_editing_an_included_header_renames_the_kernel(templates):
    spec = spec_of(NAME_CASES[0][0])
    before = kernel_name(spec, templates)
    p = templates / "include" / "flashgen" / "params.h"
    p.write_text(p.read_text() + "// comment\n")
    os.utime(p, ns=(1, 1))  # even with an old mtime the content change is seen
    assert kernel_name(spec, templates) != before


def test_headers_included_transitively_are_hashed_and_others_are_not(templates):
    spec = spec_of(NAME_CASES[0][0])
    inc = templates / "include" / "flashgen"
    (inc / "params.h").write_text('#include "deep.h"\ntypedef struct {int x;} fg_fwd_params;\n')
    (inc / "deep.h").write_text("// v1\n")
    (inc / "other_family.cuh").write_text("// v1\n")
    before = kernel_name(spec, templates)
    (inc / "other_family.cuh").write_text("// v2: a header the forward does not include\n")
    assert kernel_name(spec, templates) == before
    (inc / "deep.h").write_text("// v2\n")
    assert kernel_name(spec, templates) != before


def test_editing_another_familys_templates_keeps_forward_names(templates):
    spec = spec_of(NAME_CASES[0][0])
    before = kernel_name(spec, templates)
    (templates / "backward").mkdir()
    (templates / "backward" / "kernel.cu.j2").write_text("// backward only\n")
    assert kernel_name(spec, templates) == before


def test_allow_spills_and_tile_auto_change_the_hash_but_not_the_readable_parts(templates):
    auto = spec_of("dtype: bf16\nhead_dim: 128\n")
    explicit = auto.replace(tile_auto=False)
    spills = auto.replace(allow_spills=True)
    names = {kernel_name(s, templates) for s in (auto, explicit, spills)}
    assert len(names) == 3
    assert {n.rpartition("_")[0] for n in names} == {"_".join(readable_parts(auto))}


def test_kernel_spec_is_a_value_object_without_a_file_reading_name():
    spec = spec_of("dtype: bf16\nhead_dim: 64\n")
    assert not hasattr(spec, "name") and not hasattr(spec, "hash")
    assert kernel_name(spec).endswith("_" + spec_hash(spec))


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def test_context_has_exactly_the_documented_keys():
    spec = spec_of(
        "dtype: bf16\nhead_dim: 128\nmask: {causal: bottom_right}\n"
        "tile: {block_m: 128, block_n: 64, warps: 4, stages: 2}\n"
    )
    ctx = render_context(spec, "k")
    assert set(ctx) == {"spec", "name", "header_name", "banner", "cfg"}
    assert ctx["header_name"] == "k.h"
    assert ctx["cfg"] == {
        "dtype_cpp": "__nv_bfloat16", "head_dim": 128, "head_dim_pad": 128,
        "head_dim_v": 128, "head_dim_v_pad": 128, "block_m": 128, "block_n": 64,
        "warps": 4, "threads": 128, "stages": 2, "smem_bytes": (128 + 4 * 64) * 136 * 2,
        "causal_cpp": "fg::Causal::kBottomRight", "window": False, "varlen": False,
        "gqa": False, "dropout": False, "debug_keep_mask": False, "sparse": False,
        "instrument_io": False, "sm": 90,
        "score_features": {"kSoftcap": False, "kAlibi": False, "kSink": False},
        "user_score": "",
        "user_mask": "",
    }  # fmt: skip


def test_banner_says_do_not_edit_how_to_regenerate_and_the_full_spec():
    spec = spec_of("dtype: fp16\nhead_dim: 64\n", "specs/dense.yaml")
    lines = banner_lines(spec)
    assert lines[0] == f"generated by flashgen {__version__}, do not edit"
    assert lines[1] == "regenerate with: flashgen generate specs/dense.yaml"
    assert yaml.safe_load("\n".join(lines[2:])) == spec.to_canonical()


def test_render_produces_cu_and_h_named_after_the_kernel(templates):
    spec = spec_of("dtype: fp16\nhead_dim: 64\n")
    r = Renderer(templates).render(spec)
    assert sorted(r.files) == [f"{r.name}.cu", f"{r.name}.h"]
    cu = r.files[f"{r.name}.cu"].decode()
    assert cu.startswith("// generated by flashgen")
    assert f'#include "{r.name}.h"' in cu and f"{r.name}_kernel" in cu
    assert "__half d=64 m=128 n=64" in cu


def test_missing_template_variable_is_an_error(templates):
    (templates / "forward" / "kernel.h.j2").write_text("{{ cfg.no_such_key }}\n")
    with pytest.raises(jinja2.UndefinedError):
        Renderer(templates).render(spec_of("dtype: fp16\nhead_dim: 64\n"))


def test_include_files_are_copied_verbatim(templates, out):
    extra = templates / "include" / "flashgen" / "sub" / "x.cuh"
    extra.parent.mkdir()
    extra.write_bytes(b"// \xe2\x9c\x93 verbatim {{ not jinja }}\n")
    generate([spec_of("dtype: fp16\nhead_dim: 64\n")], out, templates)
    assert (out / "include/flashgen/sub/x.cuh").read_bytes() == extra.read_bytes()
    assert (out / "include/flashgen/params.h").is_file()


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def test_generate_twice_is_byte_identical_and_rewrites_nothing(templates, out):
    specs = specs_of("dtype: [fp16, bf16]\nhead_dim: [64, 128]\n")
    generate(specs, out, templates)
    first = snapshot(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    plan = plan_generate(specs, out, templates_dir=templates, records_dir=out.parent / "rec")
    assert apply_plan(plan) == []
    assert snapshot(out) == first
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def test_failure_mid_render_leaves_previous_outputs_intact(templates, out):
    generate(specs_of("dtype: fp16\nhead_dim: [64, 128]\n"), out, templates)
    before = snapshot(out)
    # a template that fails for the second kernel only
    (templates / "forward" / "kernel.cu.j2").write_text(
        TINY_CU + "{% if cfg.head_dim == 128 %}{{ cfg.missing }}{% endif %}\n"
    )
    with pytest.raises(jinja2.UndefinedError):
        plan_generate(specs_of("dtype: fp16\nhead_dim: [64, 128]\n"), out, templates_dir=templates)
    assert snapshot(out) == before


def test_failure_while_writing_leaves_no_partial_file(templates, out, monkeypatch):
    specs = specs_of("dtype: fp16\nhead_dim: 64\n")
    generate(specs, out, templates)
    before = snapshot(out)
    (templates / "forward" / "kernel.cu.j2").write_text(TINY_CU + "// changed\n")
    plan = plan_generate(specs, out, templates_dir=templates)

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        apply_plan(plan)
    monkeypatch.undo()
    assert snapshot(out) == before  # old files intact, no temp files left behind


def test_manifest_lists_every_kernel_with_entry_points_launch_and_status(templates, out):
    specs = specs_of(
        "dtype: bf16\nhead_dim: [64, 128]\nmask: {causal: bottom_right}\n"
        "tile: {block_m: 128, block_n: 64, warps: 4, stages: 2}\n"
    )
    plan = generate(specs, out, templates)
    raw = (out / MANIFEST_NAME).read_text()
    assert raw.endswith("}\n")
    doc = json.loads(raw)
    assert raw == json.dumps(doc, sort_keys=True, indent=2) + "\n"
    names = [e["name"] for e in doc["kernels"]]
    assert names == sorted(names) == plan.names
    e = doc["kernels"][0]
    spec = next(s for s in specs if kernel_name(s, templates) == e["name"])
    assert e["spec"] == spec.to_canonical()
    assert e["source"] == "specs/t.yaml"
    assert e["hash"] == e["name"][-8:]
    assert e["entry_points"] == {
        "kernel": f"{e['name']}_kernel",
        "check": f"{e['name']}_check",
        "launch": f"{e['name']}_launch",
    }
    assert e["launch"] == {
        "threads": 128,
        "block_m": 128,
        "grid": "ceil(max_seqlen_q/block_m) * heads * batch",
    }
    assert e["smem_bytes"] == spec.smem_bytes
    assert e["status"] == "unverified"
    # score_params.h is rendered from the feature registry, whatever the templates hold
    assert doc["include_files"] == ["include/flashgen/params.h", "include/flashgen/score_params.h"]


def test_verification_status_comes_from_the_record_with_the_exact_name(tmp_path):
    rec = tmp_path / "records"
    rec.mkdir()
    record = {"kernel": "k1", "passed": True, "gpu": "NVIDIA H100", "date": "2025-01-02",
              "examples": 200, "worst_ratio": 0.8}  # fmt: skip
    (rec / "k1.json").write_text(json.dumps(record))
    (rec / "k2.json").write_text(json.dumps(dict(record, kernel="k2", passed=False)))
    (rec / "k3.json").write_text("{not json")
    assert verification_status("k1", rec) == "verified (NVIDIA H100, 2025-01-02)"
    assert verification_status("k2", rec) == "failed"
    assert verification_status("k3", rec) == "unverified"
    assert verification_status("k4", rec) == "unverified"


def test_stale_generated_files_are_removed_but_foreign_files_kept(templates, out):
    generate(specs_of("dtype: fp16\nhead_dim: [64, 128]\n"), out, templates)
    (out / "mine.cu").write_text("// hand written, no banner\n")
    (out / "notes.txt").write_text("keep me\n")
    plan = generate(specs_of("dtype: fp16\nhead_dim: 64\n"), out, templates)
    (name,) = plan.names
    left = sorted(p.name for p in out.iterdir() if p.is_file())
    assert left == sorted([f"{name}.cu", f"{name}.h", MANIFEST_NAME, "mine.cu", "notes.txt"])


def test_removed_include_file_is_removed(templates, out):
    extra = templates / "include" / "flashgen" / "old.cuh"
    extra.write_text("// old\n")
    specs = specs_of("dtype: fp16\nhead_dim: 64\n")
    generate(specs, out, templates)
    assert (out / "include/flashgen/old.cuh").is_file()
    extra.unlink()
    generate(specs, out, templates)
    assert not (out / "include/flashgen/old.cuh").exists()


def test_generating_one_spec_file_keeps_kernels_of_other_existing_files(templates, out, tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("dtype: fp16\nhead_dim: 64\n")
    b.write_text("dtype: bf16\nhead_dim: 64\n")
    from flashgen.generator.load import load_paths

    generate(load_paths([a, b]), out, templates, spec_files=[a, b])
    both = plan_generate(load_paths([a, b]), out, templates_dir=templates).names
    plan = generate(load_paths([a]), out, templates, spec_files=[a])
    assert plan.names == both
    b.unlink()  # the spec file is gone: its kernels go too
    plan = generate(load_paths([a]), out, templates, spec_files=[a])
    assert len(plan.names) == 1 and "_fp16_" in plan.names[0]
    assert len(list(out.glob("*.cu"))) == 1


# --------------------------------------------------------------------------------------------
# --check and the README table
# --------------------------------------------------------------------------------------------


def test_check_is_clean_right_after_generate(templates, out):
    specs = specs_of("dtype: fp16\nhead_dim: [64, 128]\n")
    generate(specs, out, templates)
    assert check_plan(plan_generate(specs, out, templates_dir=templates)) == []


def test_check_reports_an_edited_file_as_a_unified_diff(templates, out):
    specs = specs_of("dtype: fp16\nhead_dim: 64\n")
    plan = generate(specs, out, templates)
    cu = out / f"{plan.names[0]}.cu"
    cu.write_text(cu.read_text().replace("sm=90", "sm=80"))
    before = snapshot(out)
    diffs = check_plan(plan_generate(specs, out, templates_dir=templates))
    assert len(diffs) == 1
    assert "-// smem=" in diffs[0] and "+// smem=" in diffs[0] and "sm=80" in diffs[0]
    assert diffs[0].startswith("--- a/")
    assert snapshot(out) == before  # check writes nothing


def test_check_reports_stale_and_missing_files(templates, out):
    generate(specs_of("dtype: fp16\nhead_dim: [64, 128]\n"), out, templates)
    diffs = check_plan(plan_generate(specs_of("dtype: fp16\nhead_dim: [64, 256]\n"), out,
                                     templates_dir=templates))  # fmt: skip
    text = "".join(diffs)
    assert "stale file (would be removed)" in text and "_d128_" in text
    assert "--- /dev/null" in text and "_d256_" in text


def test_check_detects_a_template_change(templates, out):
    specs = specs_of("dtype: fp16\nhead_dim: 64\n")
    generate(specs, out, templates)
    (templates / "forward" / "kernel.h.j2").write_text(TINY_H + "// new line\n")
    assert check_plan(plan_generate(specs, out, templates_dir=templates))


def test_readme_table_is_rewritten_between_markers_and_checked(templates, out, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nold junk\n{README_END}\n\n## After\n")
    specs = specs_of("dtype: bf16\nhead_dim: 64\nmask: {causal: bottom_right, window: true}\n")
    plan = generate(specs, out, templates, readme=readme)
    text = readme.read_text()
    assert "old junk" not in text and text.endswith(f"{README_END}\n\n## After\n")
    row = next(ln for ln in text.splitlines() if plan.names[0] in ln)
    assert "| bf16 | 64 | causal bottom_right, window |" in row and "| unverified |" in row
    assert check_plan(plan_generate(specs, out, templates_dir=templates, readme=readme)) == []
    readme.write_text(text.replace("unverified", "verified"))
    assert check_plan(plan_generate(specs, out, templates_dir=templates, readme=readme))


def test_readme_without_markers_is_left_alone_with_a_warning(templates, out, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    plan = generate(specs_of("dtype: bf16\nhead_dim: 64\n"), out, templates, readme=readme)
    assert readme.read_text() == "# no markers\n" and plan.warnings
    assert replace_readme_table("no markers", []) is None


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@st.composite
def valid_specs(draw) -> KernelSpec:
    dtype = draw(st.sampled_from(list(Dtype)))
    d = draw(st.sampled_from(HEAD_DIMS))
    target = draw(st.sampled_from([t for t in Target if t is not Target.SM90A]))
    dropout = draw(st.booleans())
    mapping = {
        "dtype": dtype.yaml,
        "head_dim": d,
        "target": target.yaml,
        "mask": {
            "causal": draw(st.sampled_from(Causal.allowed())),
            "window": draw(st.booleans()),
            "varlen": draw(st.booleans()),
        },
        "dropout": dropout,
        "debug_keep_mask": dropout and draw(st.booleans()),
        "sparsity": draw(st.sampled_from(Sparsity.allowed())),
        "gqa": draw(st.booleans()),
        "instrument_io": draw(st.booleans()),
        "allow_spills": draw(st.booleans()),
    }
    if draw(st.booleans()):
        warps = draw(st.sampled_from([1, 2, 4, 8]))
        tile = Tile(16 * warps * draw(st.sampled_from([1, 2])),
                    16 * draw(st.integers(1, 16)), warps, draw(st.integers(1, 3)))  # fmt: skip
        if smem_bytes(tile, d, dtype) <= target.info.max_smem_per_block:
            mapping["tile"] = {"block_m": tile.block_m, "block_n": tile.block_n,
                               "warps": tile.warps, "stages": tile.stages}  # fmt: skip
    (spec,) = load_spec_text(yaml.safe_dump(mapping), "specs/p.yaml")
    return spec


PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(valid_specs())
def test_valid_specs_render_identically_twice(spec):
    templates = REAL_TEMPLATES if HAVE_REAL_TEMPLATES else None
    if templates is None:
        pytest.skip("templates/forward/kernel.cu.j2 not written yet")
    a = Renderer(templates).render(spec)
    b = Renderer(templates).render(spec)
    assert a.files == b.files and a.name == b.name
    for data in a.files.values():
        assert data.decode().startswith("// generated by flashgen")


@PROPERTY
@given(valid_specs(), valid_specs())
def test_distinct_specs_get_distinct_names(a, b):
    if a == b:
        assert kernel_name(a) == kernel_name(b)
    else:
        assert kernel_name(a) != kernel_name(b)


# --------------------------------------------------------------------------------------------
# Compilation
# --------------------------------------------------------------------------------------------

PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_kernel' for 'sm_90'
ptxas info    : Function properties for k_kernel
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Function properties for helper
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_ptxas_report_is_parsed_per_function():
    funcs = parse_ptxas(PTXAS)
    k = funcs["k_kernel"]
    assert (k.entry, k.registers, k.smem_static) == (True, 168, 1024)
    assert (k.stack_frame, k.spill_stores, k.spill_loads) == (16, 8, 4) and k.spills
    assert not funcs["helper"].entry and not funcs["helper"].spills


def fake_nvcc(tmp_path: Path, ptxas: str, rc: int = 0) -> Path:
    """A stand-in nvcc that writes `-o` and prints `ptxas` (with k_kernel renamed)."""
    log = tmp_path / "nvcc.log"
    script = tmp_path / "fake-nvcc"
    script.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env python3
        import sys
        args = sys.argv[1:]
        if args == ["--version"]:
            print("Cuda compilation tools, release 99.9\\nBuild fake_0"); sys.exit(0)
        open({str(log)!r}, "a").write(" ".join(args) + "\\n")
        src = args[-1]; name = src[:-3]
        if {rc}:
            sys.stderr.write(src + "(3): error: identifier \\"x\\" is undefined\\n"); sys.exit({rc})
        open(args[args.index("-o") + 1], "wb").write(b"cubin")
        sys.stderr.write({ptxas!r}.replace("k_kernel", name + "_kernel"))
    """))  # fmt: skip
    script.chmod(0o755)
    return script


CLEAN = PTXAS.replace("16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
                      "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")  # fmt: skip


def test_compile_writes_library_and_report_and_caches_by_stamp(tmp_path, templates):
    nvcc = fake_nvcc(tmp_path, CLEAN)
    specs = specs_of("dtype: fp16\nhead_dim: [64, 128]\n")
    build = tmp_path / "build"
    results = compile_specs(specs, build, templates_dir=templates, nvcc=str(nvcc), jobs=2,
                            progress=False)  # fmt: skip
    assert [r.ok and not r.cached and not r.spill_error for r in results] == [True, True]
    for r in results:
        assert (build / f"{r.kernel}.so").is_file()
        report = json.loads((build / f"{r.kernel}.json").read_text())
        assert report["registers"] == 168 and report["spills"] is False
        assert report["kernel"] == r.kernel and report["nvcc"] == "Build fake_0"
        assert "-gencode arch=compute_90,code=[sm_90,compute_90]" in " ".join(report["command"])
        assert str(tmp_path) not in json.dumps(report)
    again = compile_specs(specs, build, templates_dir=templates, nvcc=str(nvcc), progress=False)
    assert all(r.cached for r in again)
    assert len((tmp_path / "nvcc.log").read_text().splitlines()) == 2
    # a different arch is a different stamp: rebuilt
    third = compile_specs(specs[:1], build, arch=Target.SM80, templates_dir=templates,
                          nvcc=str(nvcc), progress=False)  # fmt: skip
    assert not third[0].cached and third[0].arch == "sm_80"


def test_a_changed_rendered_source_under_the_same_name_is_rebuilt(tmp_path, templates, monkeypatch):
    from flashgen.generator.families import forward

    nvcc = fake_nvcc(tmp_path, CLEAN)
    specs = specs_of("dtype: fp16\nhead_dim: 64\n")
    build = tmp_path / "build"
    compile_specs(specs, build, templates_dir=templates, nvcc=str(nvcc), progress=False)
    config = forward.FAMILY.config
    monkeypatch.setattr(forward.FAMILY, "config", lambda s: {**config(s), "warps": 99})
    (again,) = compile_specs(specs, build, templates_dir=templates, nvcc=str(nvcc), progress=False)
    assert not again.cached  # different text: never a stale library


def test_a_changed_render_context_renames_the_kernel(monkeypatch):
    from flashgen.generator.families import forward

    (spec,) = specs_of("dtype: fp16\nhead_dim: 64\n")
    before = kernel_name(spec)
    config = forward.FAMILY.config
    monkeypatch.setattr(forward.FAMILY, "config", lambda s: {**config(s), "warps": 99})
    after = kernel_name(spec)
    assert before != after and before.rsplit("_", 1)[0] == after.rsplit("_", 1)[0]


def test_compile_flags_spills_unless_allowed(tmp_path, templates):
    nvcc = fake_nvcc(tmp_path, PTXAS)
    specs = specs_of("dtype: fp16\nhead_dim: 64\nallow_spills: [false, true]\n")
    res = compile_specs(specs, tmp_path / "b", templates_dir=templates, nvcc=str(nvcc),
                        progress=False)  # fmt: skip
    assert [(r.spills, r.spill_error) for r in res] == [(True, True), (True, False)]


def test_compile_failure_carries_the_nvcc_error(tmp_path, templates):
    nvcc = fake_nvcc(tmp_path, CLEAN, rc=2)
    (r,) = compile_specs(specs_of("dtype: fp16\nhead_dim: 64\n"), tmp_path / "b",
                         templates_dir=templates, nvcc=str(nvcc), progress=False)  # fmt: skip
    assert not r.ok and 'identifier "x" is undefined' in r.error
    assert not (tmp_path / "b" / f"{r.kernel}.so").exists()


@pytest.mark.nvcc
@pytest.mark.skipif(
    not HAVE_REAL_TEMPLATES, reason="templates/forward/kernel.cu.j2 not written yet"
)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@settings(max_examples=2, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(spec=valid_specs())
def test_rendered_kernels_compile_with_nvcc(spec, tmp_path_factory):
    build = tmp_path_factory.mktemp("nvcc")
    (r,) = compile_specs([spec], build, jobs=1, progress=False)
    assert r.ok, f"{r.kernel} ({spec.to_canonical()}) failed to compile:\n{r.error}"


INVALID_FIELDS = [
    ("dtype", "fp8"),
    ("head_dim", 100),
    ("head_dim", "64"),
    ("dropout", "no"),
    ("target", "sm_75"),
    (
        "kernel",
        "prefill",
    ),  # not a kind ("decode" was, until the decode family: some specs are valid decodes)
    ("heads", 8),
    ("mask", {"causal": "bottom-right"}),
    ("tile", {"block_m": 64, "block_n": 64, "warps": 3, "stages": 2}),
    # 16 warps: over the 8-warp limit whatever the head dim and target (a tile that is only
    # too big for shared memory depends on the head dim drawn, so it would not always be bad)
    ("tile", {"block_m": 256, "block_n": 256, "warps": 16, "stages": 3}),
    ("debug_keep_mask", True),
    ("head_dim", []),
]


@PROPERTY
@given(spec=valid_specs(), mutation=st.sampled_from(INVALID_FIELDS), position=st.integers(0, 2))
def test_invalid_specs_raise_spec_error_and_write_nothing(
    spec, mutation, position, tmp_path_factory
):
    """One bad entry among three valid ones: exit status 2, no output directory at all."""
    from flashgen.generator.cli import main

    root = tmp_path_factory.mktemp("inv")
    entries = [dict(spec.to_canonical()) for _ in range(3)]
    for i, e in enumerate(entries):
        del e["tile_auto"]
        e["allow_spills"] = i == 1
        e["instrument_io"] = i == 2
    key, value = mutation
    if key == "debug_keep_mask":
        entries[position]["dropout"] = False
    entries[position][key] = value
    (root / "s.yaml").write_text(yaml.safe_dump({"kernels": entries}))
    assert main(["generate", str(root / "s.yaml"), "-o", str(root / "gen")]) == 2
    assert not (root / "gen").exists()
    with pytest.raises(SpecError):
        load_spec_text((root / "s.yaml").read_text(), "s.yaml")


def test_editing_a_shared_jinja_macro_renames_the_kernel_in_the_same_process(templates):
    (templates / "common").mkdir()
    (templates / "common" / "m.j2").write_text("{% macro m() %}v1{% endmacro %}\n")
    cu = templates / "forward" / "kernel.cu.j2"
    cu.write_text('{% from "common/m.j2" import m %}' + cu.read_text())
    spec = spec_of(NAME_CASES[0][0])
    before = kernel_name(spec, templates)
    (templates / "common" / "m.j2").write_text("{% macro m() %}v2{% endmacro %}\n")
    os.utime(templates / "common" / "m.j2", ns=(1, 1))
    assert kernel_name(spec, templates) != before


def test_specs_that_retarget_to_one_kernel_are_built_once(tmp_path, templates):
    nvcc = fake_nvcc(tmp_path, CLEAN)
    specs = specs_of(
        "dtype: fp16\nhead_dim: 64\ntarget: [sm_89, sm_90]\n"
        "tile: {block_m: 64, block_n: 64, warps: 4, stages: 2}\n"
    )
    res = compile_specs(specs, tmp_path / "b", arch=Target.SM80, templates_dir=templates,
                        nvcc=str(nvcc), progress=False)  # fmt: skip
    assert len(res) == 1 and res[0].arch == "sm_80"
