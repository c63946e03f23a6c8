"""`tile: auto` gives every valid forward spec a legal tile, and nvcc compiles it without spills.

The fast tests (no nvcc) check that `auto_tile` returns a tile that fits (`tile_fits`) for
every head dim x dtype x forward target x register class, and that the loader hands the
spec's features to it.

The nvcc test compiles the auto tile of a covering subset of the spec matrix and asserts the
ptxas report shows no stack frame and no spill stores or loads. Why this subset covers the
matrix (measurements in docs/tiles.md, nvcc 13.0):

- dtype does not change register allocation: fp16 and bf16 kernels got identical registers
  and spills on all 654 pairs compiled both ways (they differ only in the mma and convert
  opcodes). The subset is bf16.
- sm_86 and sm_89 got identical registers and spills on all 183 pairs compiled for both (same
  ptxas model, same shared memory limit, so the same tiles): sm_86 stands for sm_89. sm_80
  and sm_90 each differ; all three are in.
- head dim is not monotone (d = 112, 224 and 240 cost more than their neighbours: their rows
  of 14, 28 and 30 16-byte chunks are indexed with divisions), so every head dim is in.
- features: `tiles.register_class` groups them into dense / masked / heavy / debug. Near 255
  registers ptxas is not monotone in features (dropping one can add a spill), so no single
  combination is the worst case. The REGISTER_SAFE rows were checked on sm_90 against every
  combination of the class at d = 96, 112, 208, 224, 240 and 256 (the edges) and against the
  most register-hungry ones elsewhere; the subset keeps, per class, the combinations that
  used the most registers or spilled first in those sweeps: the full mask set (bottom-right
  causal + window + varlen + GQA) with and without every heavy feature, varlen with causal,
  window/varlen with dropout and IO counters or the debug keep-mask.

3 targets x 22 head dims (`SWEEP_DIMS`) x 9 combinations = 594 kernels: about 10 minutes
from a cold cache on 2 cores (docs/tiles.md), seconds when warm. So the nvcc tests are
marked `nvcc_sweep`, which the default run leaves out: `python -m pytest -m nvcc_sweep tests`
runs them (CI does, as a step of its own, .ci/run). Kernels go to a temporary folder of the test
session (nothing is left in the checkout), or, when `$FLASHGEN_BUILD_DIR` is set, to that
build directory, the cache `flashgen compile` uses, so unchanged kernels are not rebuilt
across runs (a kernel's name hashes its templates).
`FLASHGEN_AUTO_TILES=full` compiles the whole matrix instead (every feature combination, both
dtypes, all four targets: 36,864 kernels, for a many-core machine after a kernel change).
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from flashgen.generator.families.forward import HEAD_DIMS
from flashgen.generator.load import load_spec_text
from flashgen.generator.spec import (
    Causal,
    Dtype,
    KernelKind,
    KernelSpec,
    Mask,
    Sparsity,
    Target,
)
from flashgen.generator.tiles import (
    REGISTER_CLASSES,
    REGISTER_GROUP,
    REGISTER_SAFE,
    auto_tile,
    register_class,
    tile_fits,
)

FORWARD_TARGETS = [t for t in Target if not t.value.suffix]
FULL = os.environ.get("FLASHGEN_AUTO_TILES", "") == "full"
# The nvcc sweep's head dims: the multiples of 16, plus the odd multiples of 8 the suite keeps
# records for (a head dim of 8 * odd takes the tile of the multiple of 16 it runs on, so its
# registers are that dim's but for the padded column's guards). FLASHGEN_AUTO_TILES_DIMS (a
# comma-separated list) overrides it, e.g. every odd multiple of 8 on a many-core machine.
SWEEP_DIMS = tuple(
    int(d) for d in os.environ.get("FLASHGEN_AUTO_TILES_DIMS", "").split(",") if d.strip()
) or tuple(d for d in HEAD_DIMS if d % 16 == 0 or d in (40, 72, 104, 136, 200, 248))

# -- feature combinations ---------------------------------------------------------------------

Features = dict[str, Any]


def features(spelled: str) -> Features:
    """`"cbr+window+drop"` -> the loader's values for those features (all others off).
    Parts: ctl, cbr (causal top_left / bottom_right), window, varlen, gqa, drop, dbg (debug
    keep-mask, implies drop), sparse, io."""
    parts = set(spelled.split("+")) - {"plain"}
    causal = {"ctl": Causal.TOP_LEFT, "cbr": Causal.BOTTOM_RIGHT}
    return {
        "mask.causal": next((c for p, c in causal.items() if p in parts), Causal.NONE),
        "mask.window": "window" in parts,
        "mask.varlen": "varlen" in parts,
        "gqa": "gqa" in parts,
        "dropout": "drop" in parts or "dbg" in parts,
        "debug_keep_mask": "dbg" in parts,
        "sparsity": Sparsity.BLOCK if "sparse" in parts else Sparsity.NONE,
        "instrument_io": "io" in parts,
    }


def all_features() -> Iterator[Features]:
    """Every valid feature combination (3 x 2 x 2 x 2 x 3 x 2 x 2 = 288)."""
    for causal, window, varlen, gqa, drop, sparse, io in itertools.product(
        ("", "ctl", "cbr"), ("", "window"), ("", "varlen"), ("", "gqa"),
        ("", "drop", "dbg"), ("", "sparse"), ("", "io"),
    ):  # fmt: skip
        yield features("+".join(p for p in (causal, window, varlen, gqa, drop, sparse, io) if p))


# Per register class, the combinations that were the most register-hungry (or the first to
# spill) in the exhaustive sm_90 sweep; see the module docstring.
SUBSET = (
    # dense
    "plain", "cbr",
    # masked
    "cbr+window+varlen+gqa", "cbr+varlen",
    # heavy
    "cbr+window+varlen+gqa+drop+sparse+io", "window+varlen+drop+io",
    # debug
    "cbr+window+varlen+gqa+drop+dbg+sparse+io", "window+drop+dbg+io", "window+varlen+dbg",
)  # fmt: skip
# Combinations that spill with every tile the kernel can take (docs/tiles.md, "Known spills"):
# strict xfails, so a kernel change that fixes them fails here until the list is updated.
# The debug builds at d 232 (240 on chip, the smallest debug tile): 12-48 bytes.
KNOWN_SPILLS = (
    (Target.SM90, 240, "drop+dbg"),
    # the philox seed/offset pointers (dropout under CUDA-graph capture) moved these debug
    # builds over the edge, 4-12 bytes (docs/tiles.md, Known spills); sm_90 d 240
    # cbr+gqa+drop+dbg stopped spilling at the same change
    (Target.SM80, 240, "window+varlen+drop+dbg"),
    (Target.SM90, 208, "window+varlen+drop+dbg"),
    (Target.SM90, 200, "cbr+window+varlen+gqa+drop+dbg+sparse+io"),
    (Target.SM80, 232, "cbr+window+varlen+gqa+drop+dbg+sparse+io"),
    (Target.SM90, 232, "cbr+window+varlen+gqa+drop+dbg+sparse+io"),
    (Target.SM90, 232, "window+drop+dbg+io"),
    (Target.SM90, 232, "window+varlen+dbg"),
)
SUBSET_TARGETS = (Target.SM80, Target.SM86, Target.SM90)


def spec_for(target: Target, dtype: Dtype, head_dim: int, feats: Features) -> KernelSpec:
    """The spec `tile: auto` gives these features (what the loader builds)."""
    return KernelSpec(
        kernel=KernelKind.FORWARD,
        dtype=dtype,
        head_dim=head_dim,
        tile=auto_tile(target, dtype, head_dim, features=feats),
        tile_auto=True,
        mask=Mask(feats["mask.causal"], feats["mask.window"], feats["mask.varlen"]),
        dropout=feats["dropout"],
        debug_keep_mask=feats["debug_keep_mask"],
        sparsity=feats["sparsity"],
        gqa=feats["gqa"],
        target=target,
        instrument_io=feats["instrument_io"],
    )


def matrix() -> list[tuple[Target, int, list[KernelSpec]]]:
    """(target, head_dim, specs) cells the nvcc test compiles (known spills left out)."""
    if FULL:
        combos, targets, dtypes = list(all_features()), FORWARD_TARGETS, list(Dtype)
    else:
        combos, targets, dtypes = [features(s) for s in SUBSET], SUBSET_TARGETS, [Dtype.BF16]
    known = {(t, d, dt, tuple(features(s).items())) for t, d, s in KNOWN_SPILLS for dt in Dtype}
    return [
        (target, d, [spec_for(target, dt, d, f) for dt in dtypes for f in combos
                     if (target, d, dt, tuple(f.items())) not in known])
        for target in targets
        for d in (HEAD_DIMS if FULL else SWEEP_DIMS)
    ]  # fmt: skip


# -- fast: legal tiles, no nvcc ---------------------------------------------------------------

CLASS_EXAMPLES = {
    "dense": "cbr",
    "masked": "cbr+window+varlen+gqa",
    "heavy": "cbr+window+varlen+gqa+drop+sparse+io",
    "debug": "drop+dbg",
}


def test_register_class_of_features():
    assert register_class(None) == register_class({}) == "dense"
    assert [register_class(features(CLASS_EXAMPLES[c])) for c in REGISTER_CLASSES] == list(
        REGISTER_CLASSES
    )
    assert register_class(features("gqa")) == "masked"
    for lone in ("drop", "sparse", "io"):
        assert register_class(features(f"ctl+{lone}")) == "heavy"
    assert sorted({register_class(f) for f in all_features()}) == sorted(REGISTER_CLASSES)


@pytest.mark.parametrize("target", FORWARD_TARGETS, ids=lambda t: t.yaml)
@pytest.mark.parametrize("dtype", list(Dtype), ids=lambda d: d.yaml)
@pytest.mark.parametrize("reg_class", REGISTER_CLASSES)
def test_auto_tile_is_legal_for_every_head_dim(target, dtype, reg_class):
    feats = features(CLASS_EXAMPLES[reg_class])
    for d in HEAD_DIMS:
        tile = auto_tile(target, dtype, d, features=feats)
        assert tile_fits(tile, target, dtype, d), (target.yaml, dtype.yaml, d, reg_class, tile)
        spec = spec_for(target, dtype, d, feats)  # validates (raises SpecError otherwise)
        assert spec.smem_bytes <= target.info.max_smem_per_block


def test_register_safe_rows_cover_every_head_dim_and_fit_shared_memory_rows_first():
    for group, rows_by_class in REGISTER_SAFE.items():
        assert set(rows_by_class) == set(REGISTER_CLASSES), group
        for reg_class, rows in rows_by_class.items():
            bounds = [max_d for max_d, _ in rows]
            assert bounds == sorted(bounds) and bounds[-1] == HEAD_DIMS[-1], (group, reg_class)
    assert set(REGISTER_GROUP[t] for t in FORWARD_TARGETS) == set(REGISTER_SAFE)
    # sm_86 d=256: the sm_90 row (128x16, 8 warps) fits 101376 bytes exactly; block_m stays
    t = auto_tile(Target.SM86, Dtype.BF16, 256, features=features("drop+sparse"))
    assert (t.block_m, t.warps) == (128, 8)


def test_a_heavier_class_never_gets_more_query_rows_per_warp_or_keys():
    """Features only ever shrink the tile (rows per warp, block_n) at a head dim."""
    for target, dtype, d in itertools.product(FORWARD_TARGETS, Dtype, HEAD_DIMS):
        tiles = [auto_tile(target, dtype, d, features=features(CLASS_EXAMPLES[c]))
                 for c in REGISTER_CLASSES]  # fmt: skip
        mts = [t.block_m // (16 * t.warps) for t in tiles]
        bns = [t.block_n for t in tiles[1:]]  # dense may use a measured (speed) tile
        assert mts == sorted(mts, reverse=True), (target.yaml, d, tiles)
        assert bns == sorted(bns, reverse=True), (target.yaml, d, tiles)


@pytest.mark.parametrize("spelled", list(CLASS_EXAMPLES.values()) + ["varlen", "io"])
def test_the_loader_passes_the_features_to_auto_tile(spelled):
    f = features(spelled)
    mask = (f"{{causal: {f['mask.causal'].yaml}, window: {str(f['mask.window']).lower()}, "
            f"varlen: {str(f['mask.varlen']).lower()}}}")  # fmt: skip
    text = (
        f"dtype: bf16\nhead_dim: [128, 224]\ntile: auto\ntarget: sm_90\nmask: {mask}\n"
        f"gqa: {str(f['gqa']).lower()}\ndropout: {str(f['dropout']).lower()}\n"
        f"debug_keep_mask: {str(f['debug_keep_mask']).lower()}\n"
        f"sparsity: {f['sparsity'].yaml}\ninstrument_io: {str(f['instrument_io']).lower()}\n"
    )
    for spec in load_spec_text(text):
        assert spec.tile_auto
        assert spec.tile == auto_tile(Target.SM90, Dtype.BF16, spec.head_dim, features=f), (
            "the forward family must call auto_tile(..., features=values)"
        )


# -- nvcc: no spills ---------------------------------------------------------------------------

CELLS = matrix()


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Any:
    """Where the sweep's kernels go: $FLASHGEN_BUILD_DIR (a cache kept across runs) when set,
    else a temporary folder of the session."""
    env = os.environ.get("FLASHGEN_BUILD_DIR")
    return env if env else tmp_path_factory.mktemp("auto_tiles")


@pytest.fixture(scope="module")
def compiled(sweep_dir) -> dict[str, Any]:
    """Compile every cell's specs at once (all cores)."""
    from flashgen.generator.compile import compile_specs
    from flashgen.generator.naming import kernel_name

    specs = list({s: None for _, _, cell in CELLS for s in cell})  # unique, in order
    results = compile_specs(specs, sweep_dir, jobs=os.cpu_count(), progress=False)
    return {kernel_name(s): r for s, r in zip(specs, results)}


@pytest.mark.nvcc
@pytest.mark.nvcc_sweep
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize(
    "target,head_dim,specs", CELLS, ids=[f"{t.yaml}-d{d}" for t, d, _ in CELLS]
)
def test_auto_tile_compiles_without_spills(target, head_dim, specs, compiled):
    from flashgen.generator.naming import kernel_name

    bad = []
    for spec in specs:
        r = compiled[kernel_name(spec)]
        assert r.ok, f"{r.kernel} failed to compile:\n{r.error}"
        if r.stack_frame or r.spill_stores or r.spill_loads:
            bad.append(
                f"{r.kernel}: {r.registers} registers, {r.stack_frame} B stack frame, "
                f"{r.spill_stores} B spill stores, {r.spill_loads} B spill loads"
            )
    assert not bad, (
        f"tile: auto spills on {target.yaml} d={head_dim} (generator/tiles.py REGISTER_SAFE, "
        "docs/tiles.md):\n" + "\n".join(bad)
    )


@pytest.mark.nvcc
@pytest.mark.nvcc_sweep
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize(
    "target,head_dim,spelled", KNOWN_SPILLS, ids=[f"{t.yaml}-d{d}-{s}" for t, d, s in KNOWN_SPILLS]
)
@pytest.mark.xfail(strict=True, reason="spills with every tile (docs/tiles.md, Known spills)")
def test_known_spills_still_spill(target, head_dim, spelled, sweep_dir):
    from flashgen.generator.compile import compile_specs

    (r,) = compile_specs([spec_for(target, Dtype.BF16, head_dim, features(spelled))],
                         sweep_dir, progress=False)  # fmt: skip
    assert r.ok, r.error
    assert not (r.stack_frame or r.spill_stores or r.spill_loads), r
