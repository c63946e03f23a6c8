"""The sm_90a forward ablation (bench/ablation_bench.py) without a GPU or nvcc: its variants,
their specs and -D flags, the nvcc commands it runs, and the switches in the kernel header."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
from flashgen.bench import ablation_bench as ab
from flashgen.generator.compile import nvcc_flags
from flashgen.generator.families import family
from flashgen.generator.load import load_paths
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import PACKAGE_ROOT, TEMPLATES_DIR


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_auto_spec_is_the_shipped_kernel(head_dim, causal):
    spec = ab.auto_spec(head_dim, causal)
    assert spec.tile_auto and spec.tile.stages == 3
    shipped = {kernel_name(s) for s in load_paths([PACKAGE_ROOT / "specs" / "fwd_sm90a.yaml"])}
    assert kernel_name(spec) in shipped


def test_variants_flags_and_tiles():
    spec = ab.auto_spec(128, False)
    out = {label: (s, flags) for label, s, flags in ab.variants(spec)}
    assert list(out) == list(ab.VARIANTS)
    assert out["full"] == (spec, [])
    for label, macro in [
        ("no_pingpong", "NO_PINGPONG"),
        ("no_overlap", "NO_OVERLAP"),
        ("no_setmaxnreg", "NO_SETMAXNREG"),
    ]:
        assert out[label] == (spec, [f"-DFG_SM90_ABLATE_{macro}=1"])
    for label, stages in [("stages2", 2), ("stages1", 1)]:
        s, flags = out[label]
        assert flags == [] and s.tile.stages == stages
        assert s.replace(tile=spec.tile, tile_auto=True) == spec  # only the stages differ
        assert not family(s).problems(s)  # a valid sm_90a tile
        assert kernel_name(s) != kernel_name(spec)


def test_a_stage_count_equal_to_the_specs_is_not_a_variant():
    spec = ab.auto_spec(128, False)
    two = spec.replace(tile=dataclasses.replace(spec.tile, stages=2))
    assert "stages2" not in [label for label, _, _ in ab.variants(two)]


def test_the_header_defines_every_switch_off_by_default():
    text = (TEMPLATES_DIR / "include" / "flashgen" / "fwd_sm90_kernel.cuh").read_text()
    for _, macros in ab.VARIANTS.values():
        for m in macros:
            assert f"#ifndef {ab.MACRO}{m}\n#define {ab.MACRO}{m} 0\n#endif" in text


def test_build_runs_one_nvcc_per_variant_into_its_own_folder(tmp_path, monkeypatch):
    commands = []

    def fake_run(cmd, cwd, **kwargs):
        commands.append((list(cmd), cwd))
        name = cmd[-1].removesuffix(".cu")
        ptxas = (
            f"ptxas info    : Compiling entry function '{name}_kernel' for 'sm_90a'\n"
            f"ptxas info    : Function properties for {name}_kernel\n"
            "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 168 registers, used 1 barriers, 64 bytes smem\n"
        )
        return subprocess.CompletedProcess(cmd, 0, "", ptxas)

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    spec = ab.auto_spec(64, True)
    jobs = ab.variants(spec)
    built = ab.build(jobs, tmp_path, workers=2)
    assert [b["variant"] for b in built] == list(ab.VARIANTS)
    labels = [label for label, _, _ in jobs]
    commands.sort(key=lambda c: labels.index(Path(c[0][-2]).parent.name))  # by output folder
    for (label, s, flags), b, (cmd, cwd) in zip(jobs, built, commands):
        name = kernel_name(s)
        assert cwd == tmp_path / "src" and (cwd / f"{name}.cu").is_file()
        lib = str(tmp_path / label / f"{name}.so")
        assert cmd == ["nvcc", *nvcc_flags(s.target), *flags, "-o", lib, f"{name}.cu"]
        assert (b["kernel"], b["ok"], b["head_dim"], b["causal"]) == (name, True, 64, True)
        resources = (b["registers"], b["spill_stores"], b["spill_loads"], b["stack_frame"])
        assert resources == (168, 4, 4, 8)


def test_format_table_has_one_column_per_variant():
    rows = [
        {"head_dim": 64, "causal": True, "seqlen": 4096, "variant": v, "tflops": t}
        for v, t in [("full", 400.0), ("sdpa_cudnn", 410.0), ("stages1", None)]
    ]
    lines = ab.format_table(rows).splitlines()
    assert lines[0] == "| d | causal | seqlen | full | sdpa_cudnn | stages1 |"
    assert lines[2] == "| 64 | yes | 4096 | 400 | 410 | - |"
