"""GPU suite fixtures: skip cleanly without a GPU, compile every needed kernel once per session,
and collect one verification record per kernel.

Environment:
  FLASHGEN_GPU_EXAMPLES   Hypothesis examples per shipped spec (default 200)
  FLASHGEN_RECORDS_DIR    where records are written (default: the checkout's verify/records)
  FLASHGEN_BUILD_DIR      where the kernel libraries are (default: the checkout's build/kernels)
  FLASHGEN_SANITIZER      set by the sanitizer driver to the tool's verdict (recorded as is)
  FLASHGEN_SPECS          spec files or folders (os.pathsep-separated) to use instead of the
                          shipped specs/ folder, e.g. specs/fwd_sm90a.yaml for one family
  FLASHGEN_SHARD          `i/n`: run only the shipped kernels whose index (in name order) is
                          i mod n, and the tests that take no shipped kernel only in shard 0,
                          so n processes share the suite (the float64 references are CPU-bound)
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess

import pytest
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import PACKAGE_ROOT, build_dir, records_dir
from flashgen.generator.spec import KernelSpec
from flashgen.verify.runner import gpu_available

REPO = PACKAGE_ROOT  # the checkout, or the installed flashgen package (same layout)
CUBIN_DIR = build_dir()
RECORDS_DIR = records_dir()

_ok, _why = gpu_available()


def shard() -> tuple[int, int]:
    """(i, n) from FLASHGEN_SHARD=i/n; (0, 1) when unset."""
    text = os.environ.get("FLASHGEN_SHARD", "").strip()
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"FLASHGEN_SHARD={text!r}: expected i/n, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise pytest.UsageError(f"FLASHGEN_SHARD={text!r}: need n >= 1 and 0 <= i < n")
    return i, n


def pytest_collection_modifyitems(config, items):
    i, n = shard()
    if i != 0:  # tests that take no shipped kernel run in shard 0 only
        keep, drop = [], []
        for item in items:
            spec = getattr(getattr(item, "callspec", None), "params", {}).get("spec")
            gpu = "tests/gpu" in str(item.fspath).replace(os.sep, "/")
            (keep if not gpu or isinstance(spec, KernelSpec) else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if _ok:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU for the flashgen GPU suite ({_why})")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def shipped_specs(sharded: bool = True):
    """The shipped specs; FLASHGEN_TARGET=sm_80 (say) runs the suite on their builds for
    that target instead (on a newer GPU the driver JIT-compiles the embedded PTX). With
    FLASHGEN_SHARD, only this shard's kernels unless `sharded` is False (a test that needs a
    companion kernel, such as a dropout kernel's dense twin, looks among all of them)."""
    from flashgen.generator.compile import retarget
    from flashgen.generator.load import load_paths
    from flashgen.generator.spec import Target

    chosen = [p for p in os.environ.get("FLASHGEN_SPECS", "").split(os.pathsep) if p]
    specs = load_paths(chosen or [REPO / "specs"])
    target = os.environ.get("FLASHGEN_TARGET")
    specs = retarget(specs, Target.from_yaml(target)) if target else specs
    i, n = shard()
    if n > 1 and sharded:
        names = sorted(kernel_name(s) for s in specs)
        mine = set(names[i::n])
        specs = [s for s in specs if kernel_name(s) in mine]
    return specs


def ensure_cubins(specs) -> None:
    """Build the kernel libraries that are missing (the device build normally carries them)."""
    missing = [s for s in specs if not (CUBIN_DIR / f"{kernel_name(s)}.so").exists()]
    if not missing:
        return
    from flashgen.generator.compile import compile_specs

    compile_specs(missing, out_dir=CUBIN_DIR, jobs=os.cpu_count() or 2)


class Recorder:
    """Aggregates, per kernel, the examples run and the worst pass-rule ratio per output."""

    def __init__(self) -> None:
        self.kernels: dict[str, dict] = {}

    def add(self, spec, verdicts: dict, test: str) -> None:
        rec = self.kernels.setdefault(
            kernel_name(spec),
            {
                "kernel": kernel_name(spec),
                "examples": 0,
                "worst_ratio": {},
                "failures": 0,
                "tests": {},
            },
        )
        rec["target_cc"] = spec.target.cc
        rec["examples"] += 1
        rec["tests"][test] = rec["tests"].get(test, 0) + 1
        for out, v in verdicts.items():
            rec["worst_ratio"][out] = max(rec["worst_ratio"].get(out, 0.0), float(v.ratio))
            if not v.passed:
                rec["failures"] += 1

    def fail(self, spec, test: str) -> None:
        rec = self.kernels.setdefault(
            kernel_name(spec),
            {
                "kernel": kernel_name(spec),
                "examples": 0,
                "worst_ratio": {},
                "failures": 0,
                "tests": {},
            },
        )
        rec["failures"] += 1
        rec["tests"][test] = rec["tests"].get(test, 0)

    def write(self, session_failed: bool) -> None:
        if not self.kernels:
            return
        RECORDS_DIR.mkdir(parents=True, exist_ok=True)
        env = _environment()
        for name, rec in self.kernels.items():
            out = dict(rec)
            out.update(env)
            out["passed"] = rec["failures"] == 0 and not session_failed and rec["examples"] > 0
            out["sanitizer"] = os.environ.get("FLASHGEN_SANITIZER", "not run in this session")
            target_cc = rec.get("target_cc")
            if target_cc and "%d" % target_cc != env["compute_capability"].replace(".", ""):
                out["ran_as"] = (
                    f"compute_{target_cc} PTX, JIT-compiled by the driver for "
                    f"sm_{env['compute_capability'].replace('.', '')}"
                )
            path = RECORDS_DIR / f"{name}.json"
            path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


def _environment() -> dict:
    from flashgen.verify.runner import Gpu

    gpu = Gpu.get()
    cuda = gpu.cuda
    env = {
        "gpu": gpu.device.name(),
        "compute_capability": "%d.%d" % gpu.device.compute_capability(),
        "driver": cuda.get_driver_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
    }
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=False)
        env["nvcc"] = out.stdout.strip().splitlines()[-1] if out.stdout else "unknown"
    except OSError:
        env["nvcc"] = "unknown"
    return env


RECORDER = Recorder()


@pytest.fixture(scope="session")
def recorder():
    return RECORDER


_SHARED_FAILED: list[str] = []  # failed tests that take no shipped kernel


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001
    """A failed test parametrized by a spec marks that kernel's record failed; a failed test
    that takes no shipped kernel (drawn specs, the PyTorch op) marks every record failed."""
    outcome = yield
    report = outcome.get_result()
    spec = getattr(getattr(item, "callspec", None), "params", {}).get("spec")
    if report.failed:
        if isinstance(spec, KernelSpec):
            RECORDER.fail(spec, item.name)
        else:
            _SHARED_FAILED.append(item.nodeid)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    """Records are written for a complete session only (an interrupted one writes none): a
    kernel's record passes when every test of that kernel passed and no shared test failed."""
    interrupted = int(exitstatus) in (2, 3, 4)  # interrupted, internal error, usage error
    if _ok and not interrupted and os.environ.get("FLASHGEN_WRITE_RECORDS", "1") == "1":
        RECORDER.write(session_failed=bool(_SHARED_FAILED))


@pytest.fixture(scope="session")
def specs():
    s = shipped_specs()
    ensure_cubins(s)
    return s
