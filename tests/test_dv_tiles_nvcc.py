"""`tile: auto` at d_qk 192 / d_v 128 compiles without spills in the families that build it.

The feature combinations are tests/test_family_tiles_nvcc.py's (the register-hungriest of
each family: masks with varlen and GQA, dropout, the score modifiers, deterministic dQ), on
the mma.sync backward, the sm_90a forward and, with the sm_90a forward's combinations, the
mma.sync forward; each spec is the one the loader builds with `head_dim_v: 128`. An
nvcc_sweep test (minutes): `pytest -m nvcc_sweep tests/test_dv_tiles_nvcc.py`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
from flashgen.generator.load import load_spec_text
from flashgen.generator.spec import KernelSpec
from test_family_tiles_nvcc import FAMILIES  # (tests/ is on sys.path: rootdir-less import)

D, D_V = 192, 128
_COMBOS = {label: (kind, target, combos) for label, kind, target, combos in FAMILIES}
# (family label, kernel, target, combinations): the sm_90a backward and decode refuse d_v != d
DV_FAMILIES = (
    ("backward", *_COMBOS["backward"]),
    ("forward_sm90", *_COMBOS["forward_sm90"]),
    ("forward", "forward", "sm_90", _COMBOS["forward_sm90"][2]),
)


def spec_of(kind: str, target: str, fields: str) -> KernelSpec:
    text = (
        f"kernel: {kind}\ntarget: {target}\ndtype: bf16\nhead_dim: {D}\nhead_dim_v: {D_V}\n"
        f"tile: auto\n{fields}"
    )
    (spec,) = load_spec_text(text, f"dv-sweep-{kind}-{target}.yaml")
    return spec


CELLS = [
    (label, combo, spec_of(kind, target, fields))
    for label, kind, target, combos in DV_FAMILIES
    for combo, fields in combos.items()
]


def test_every_cell_is_a_d_v_spec_with_an_auto_tile():
    """No nvcc: the loader accepted every cell (spec_of raises otherwise)."""
    assert {label for label, _, _ in CELLS} == {"backward", "forward_sm90", "forward"}
    for _, _, spec in CELLS:
        assert spec.tile_auto and (spec.head_dim, spec.head_dim_vo) == (D, D_V)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Any]:
    from flashgen.generator.compile import compile_specs
    from flashgen.generator.naming import kernel_name

    out = os.environ.get("FLASHGEN_BUILD_DIR") or tmp_path_factory.mktemp("dv_tiles")
    specs = [spec for _, _, spec in CELLS]
    results = compile_specs(specs, out, jobs=os.cpu_count(), progress=False)
    return {kernel_name(s): r for s, r in zip(specs, results)}


@pytest.mark.nvcc
@pytest.mark.nvcc_sweep
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("label,combo,spec", CELLS, ids=[f"{c[0]}-{c[1]}" for c in CELLS])
def test_d_v_auto_tile_compiles_without_spills(label, combo, spec, compiled):  # noqa: ARG001
    from flashgen.generator.naming import kernel_name

    r = compiled[kernel_name(spec)]
    assert r.ok, f"{r.kernel} failed to compile:\n{r.error}"
    assert not (r.stack_frame or r.spill_stores or r.spill_loads), (
        f"tile: auto spills: {r.kernel}: {r.registers} registers, {r.stack_frame} B stack "
        f"frame, {r.spill_stores} B spill stores, {r.spill_loads} B spill loads"
    )
