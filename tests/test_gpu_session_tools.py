"""The GPU session's helpers that need no GPU: sharding the suite, merging sanitizer verdicts
into records, reading Nsight Compute's CSV, and building for another target."""

from __future__ import annotations

import json

import pytest
from flashgen.bench import hbm_fwdbwd, sanitize
from flashgen.generator.compile import retarget
from flashgen.generator.load import load_spec_text
from flashgen.generator.naming import kernel_name
from flashgen.generator.spec import Target


def test_retarget_leaves_architecture_specific_kernels_out():
    portable = load_spec_text("dtype: bf16\nhead_dim: 64\n")[0]
    hopper = load_spec_text("dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n")[0]
    out = retarget([portable, hopper], Target.SM80)
    assert [s.target for s in out] == [Target.SM80]
    assert retarget([hopper], Target.SM90A) == [hopper.replace(target=Target.SM90A)]


def test_sanitizer_verdicts_land_in_the_records_of_the_kernels_each_process_ran(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FLASHGEN_RECORDS_DIR", str(tmp_path / "rec"))
    (tmp_path / "rec").mkdir()
    for name in ("fa_a", "fa_b", "fa_c"):
        (tmp_path / "rec" / f"{name}.json").write_text(json.dumps({"kernel": name}))
    (tmp_path / "memcheck_0.txt").write_text(
        "ran fa_a\nran fa_b\n========= ERROR SUMMARY: 0 errors\n"
    )
    (tmp_path / "memcheck_1.txt").write_text("ran fa_c\n========= ERROR SUMMARY: 2 errors\n")
    (tmp_path / "racecheck_0.txt").write_text("ran fa_a\n========= RACECHECK SUMMARY: 0 hazards\n")
    (tmp_path / "synccheck_0.txt").write_text("ran fa_b\n")  # the tool never finished
    verdicts = sanitize.merge([str(p) for p in sorted(tmp_path.glob("*.txt"))])
    assert verdicts["fa_a"] == {
        "memcheck": "ERROR SUMMARY: 0 errors",
        "racecheck": "RACECHECK SUMMARY: 0 hazards",
    }
    assert verdicts["fa_b"]["synccheck"] == "no summary (tool did not finish)"
    assert verdicts["fa_c"] == {"memcheck": "ERROR SUMMARY: 2 errors"}
    rec = json.loads((tmp_path / "rec" / "fa_c.json").read_text())
    assert rec["sanitizer"] == verdicts["fa_c"]


def test_sanitizer_samples_one_kernel_per_family_including_the_hopper_forward():
    specs = sanitize.sample_specs()
    kinds = {(s.kernel.yaml, s.target.yaml) for s in specs}
    assert ("forward", "sm_90a") in kinds and ("backward", "sm_90") in kinds
    assert all(s.kernel.yaml != "decode" for s in specs)
    assert len({kernel_name(s) for s in specs}) == len(specs)
    assert any(s.mask_mod is not None for s in specs)  # the user modifiers have families too
    assert any(s.score_mod is not None for s in specs)
    assert any(sanitize._same_tokens(s) for s in specs)


def test_sanitizer_sample_narrows_to_a_kind_a_target_and_a_name(monkeypatch):
    monkeypatch.setenv("FLASHGEN_SANITIZE_ONLY", "backward:sm_90a")
    monkeypatch.setenv("FLASHGEN_SANITIZE_MATCH", "_det_")
    specs = sanitize.sample_specs()
    assert specs and all(s.deterministic and s.target.yaml == "sm_90a" for s in specs)
    assert any(s.mask.causal.yaml != "none" for s in specs)
    monkeypatch.setenv("FLASHGEN_SANITIZE_MATCH", "([")
    with pytest.raises(SystemExit, match="FLASHGEN_SANITIZE_MATCH is not a regular expression"):
        sanitize.sample_specs()


def test_every_sanitized_call_passes_the_runners_validation():
    """What `sanitize run` hands each sampled kernel is accepted by the runners' validation
    (no GPU needed): on an H200 three of four sanitizer processes once stopped at the first
    mask_mod kernel, whose keyword the runners did not take."""
    import numpy as np
    from flashgen.verify import runner, runner_bwd

    rng = np.random.default_rng(0)
    for spec in sanitize.sample_specs():
        args, kw = sanitize.inputs(spec, rng)
        seed, offset = kw.pop("seed", 0), kw.pop("offset", 0)  # checked by run() itself
        assert 0 <= seed < 2**64 and 0 <= offset < 2**32
        if spec.kernel.yaml == "backward":
            runner_bwd.validate_bwd(spec, *args, **kw)
        else:
            runner.validate(spec, *args, **kw)


HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
    '"Metric Value"'
)


def _row(kid: str, metric: str, unit: str, value: str) -> str:
    return (
        f'"{kid}","1","python3","h","k{kid}","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0",'
        f'"Command line profiler metrics","{metric}","{unit}","{value}"'
    )


NCU_CSV = "\n".join(
    [
        "==PROF== Connected to process 1",
        HEAD,
        _row("0", "dram__bytes_read.sum", "Mbyte", "1.50"),
        _row("0", "dram__bytes_write.sum", "Kbyte", "512"),
        _row("1", "dram__bytes_read.sum", "byte", "1,024"),
    ]
)


def test_ncu_csv_is_summed_per_direction_and_kernel_count():
    got = hbm_fwdbwd._ncu_bytes(NCU_CSV)
    assert got == {"read": 1.5e6 + 1024, "write": 512e3, "kernels": 2}
    with pytest.raises(ValueError, match="no ncu CSV"):
        hbm_fwdbwd._ncu_bytes("==PROF== nothing profiled\n")
