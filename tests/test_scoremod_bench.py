"""bench/scoremod_bench.py without a GPU: which plain kernel each shipped score modifier is
timed against. The bench itself runs on a GPU only (never as a test)."""

from __future__ import annotations

import pytest
from flashgen.bench import scoremod_bench as sb
from flashgen.generator.load import load_paths
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import PACKAGE_ROOT

SPECS = PACKAGE_ROOT / "specs"


@pytest.fixture(scope="module")
def shipped():
    every = load_paths([SPECS])
    return {s: s for s in every if s.plain}


def _mods():
    return [s for s in load_paths([SPECS / "scoremod.yaml"]) if sb.single_mod(s)]


@pytest.mark.parametrize("spec", _mods(), ids=kernel_name)
def test_each_modifier_has_a_plain_twin_of_its_own_kind_and_determinism(spec, shipped):
    twin = spec.replace(features=frozenset())
    plain = shipped.get(twin) or sb.plain_twin(shipped, twin)
    assert plain is not None, f"no plain twin for {kernel_name(spec)}"
    assert not plain.features and plain.score_mod is None
    key = ("kernel", "target", "dtype", "head_dim", "mask", "gqa", "deterministic")
    assert [getattr(plain, k) for k in key] == [getattr(spec, k) for k in key]


def test_a_deterministic_backward_is_never_the_twin_of_a_non_deterministic_one(shipped):
    dets = [s for s in shipped if s.kernel.yaml == "backward" and s.deterministic]
    assert dets, "the shipped specs have deterministic backwards (specs/bwd_det.yaml)"
    for d in dets:
        twin = d.replace(deterministic=False, tile=d.tile)
        found = sb.plain_twin(shipped, twin)
        assert found is None or not found.deterministic
