"""`flashgen verify` and `flashgen bench`: the GPU-side commands.

`flashgen verify [pytest args...]` runs the GPU suite (tests/gpu) with pytest, writing one
verification record per kernel under verify/records/ (FLASHGEN_GPU_EXAMPLES sets the
Hypothesis examples per shipped spec, 200 by default). Without a usable GPU it runs nothing
and exits 1 with one line saying that nothing was verified and why; a run in which no GPU
test passed (all skipped or deselected) exits 1 the same way, so a zero exit status always
means that kernels were checked. `--collect-only` lists the suite without a GPU.
`flashgen verify --help` is the short help below; `--pytest-help` shows pytest's.

`flashgen bench [...]` runs the side-by-side forward benchmark (bench/fwd_bench.py). A missing
GPU package (pycuda, torch), a missing or invalid spec, a kernel not compiled yet: each ends
with one `flashgen: error: ...` line and a non-zero exit, never a traceback.

Both work from an installed package and from any working directory: every path here comes
from `flashgen.generator.paths`, every import is `flashgen.*`.
"""

from __future__ import annotations

import sys

from flashgen.generator import paths

# Import name -> how to get it, for the packages `flashgen bench` needs beyond flashgen's own.
# flashgen is on no package index: its extras install from a checkout (README, first lines).
_FROM_CHECKOUT = "(from a flashgen checkout)"
_INSTALL_HINTS = {
    "pycuda": f"pip install '.[gpu]' {_FROM_CHECKOUT}",
    "torch": f"pip install '.[gpu,torch]' {_FROM_CHECKOUT}",
    "triton": f"pip install '.[gpu,torch]' {_FROM_CHECKOUT}; Triton comes with PyTorch",
}


def _err(msg: str) -> None:
    print(f"flashgen: error: {msg}", file=sys.stderr)


VERIFY_HELP = """\
usage: flashgen verify [-h] [--pytest-help] [PYTEST_ARGS ...]

Run the GPU verification suite (tests/gpu) with pytest on the kernels of specs/ (build them
first with `flashgen compile specs/`), writing one record per kernel to verify/records/.
Needs a CUDA GPU, pycuda, pytest and hypothesis (pip install -e '.[dev,gpu]'). Without a
usable GPU nothing is verified and the exit status is 1; it is 0 only when GPU tests ran and
passed.

options:
  -h, --help       show this help and exit
  --pytest-help    show pytest's own help (every PYTEST_ARGS option) and exit
  PYTEST_ARGS      passed to pytest, e.g. -x, -k decode, --collect-only

environment:
  FLASHGEN_GPU_EXAMPLES   Hypothesis examples per shipped spec (default 200)
  FLASHGEN_SPECS          spec files or folders to check instead of specs/
  FLASHGEN_SHARD          i/n: this process's share of the kernels (run n processes)
  FLASHGEN_RECORDS_DIR    where records go (default: the checkout's verify/records)
  FLASHGEN_BUILD_DIR      where the kernel libraries are (default: build/kernels)
"""


class _Outcomes:
    """A pytest plugin counting the GPU tests that passed, failed and were skipped."""

    def __init__(self) -> None:
        self.passed = self.failed = self.skipped = 0
        self.skip_reasons: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 - pytest's TestReport
        if report.when == "call" and report.passed:
            self.passed += 1
        elif report.failed:
            self.failed += 1
        elif report.skipped:
            self.skipped += 1
            longrepr = report.longrepr
            if isinstance(longrepr, tuple) and len(longrepr) == 3:
                self.skip_reasons.append(str(longrepr[2]).removeprefix("Skipped: "))


def _nothing_verified(why: str) -> int:
    _err(f"nothing was verified: {why}")
    return 1


def verify_main(argv: list[str] | None = None) -> int:
    args = list(argv or [])
    if "-h" in args or "--help" in args:
        sys.stdout.write(VERIFY_HELP)
        return 0
    pytest_help = "--pytest-help" in args
    suite = paths.PACKAGE_ROOT / "tests" / "gpu"
    if not (suite / "conftest.py").is_file():
        _err(f"`flashgen verify` is unavailable: the GPU suite is not installed (no {suite})")
        return 2
    specs = paths.PACKAGE_ROOT / "specs"
    if not specs.is_dir():
        _err(
            "`flashgen verify` checks the kernels of the repository's specs/, which this "
            f"installed package does not include (no {specs}); run it from a checkout "
            "(pip install -e .)"
        )
        return 2
    try:
        import hypothesis  # noqa: F401 - the suite's strategies need it
        import pytest
    except ImportError as e:
        _err(
            f"`flashgen verify` needs {e.name}, which cannot be imported; install the test "
            "extra: pip install -e '.[test]' (from a checkout)"
        )
        return 1

    # Outside a checkout pytest's rootdir is inside site-packages: write no cache there.
    extra = [] if paths.checkout_root() else ["-p", "no:cacheprovider"]
    if pytest_help:
        return int(pytest.main([*extra, "--help"]))
    listing = "--collect-only" in args or "--co" in args
    if not listing:
        from flashgen.verify.runner import gpu_available

        ok, why = gpu_available()
        if not ok:
            return _nothing_verified(
                f"no usable GPU ({why}); run it on a host with a CUDA GPU and pycuda "
                "(pip install -e '.[gpu]'), or pass --collect-only to list the suite"
            )
    outcomes = _Outcomes()
    rc = int(pytest.main(["-q", *extra, str(suite), *args], plugins=[outcomes]))
    if rc == 0 and not listing and outcomes.passed == 0:
        reason = f": {outcomes.skip_reasons[0]}" if outcomes.skip_reasons else ""
        return _nothing_verified(f"no GPU test ran ({outcomes.skipped} skipped{reason})")
    return rc


def _missing_package(e: ImportError) -> str:
    top = (e.name or "").partition(".")[0]
    hint = _INSTALL_HINTS.get(top, f"pip install {top}")
    return f"`flashgen bench` needs {top}, which cannot be imported ({e}); install it: {hint}"


def bench_main(argv: list[str] | None = None) -> int:
    from flashgen.bench.fwd_bench import main
    from flashgen.generator.spec import SpecError
    from flashgen.verify.runner import RunnerError

    args = list(argv or [])
    try:
        return int(main(args) or 0)
    except SystemExit as e:  # argparse: --help, or a bad option (its message is printed)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except SpecError as e:
        msg = str(e)
        if "--specs" not in args:
            shipped = paths.PACKAGE_ROOT / "specs"
            msg += (
                " (the default --specs is relative to the current directory; pass --specs, "
                f"e.g. --specs {shipped})"
            )
        _err(msg)
        return 2
    except RunnerError as e:  # e.g. a kernel that `flashgen compile` has not built yet
        _err(str(e))
        return 1
    except ImportError as e:
        if not e.name or e.name.partition(".")[0] == "flashgen":
            raise  # flashgen's own modules: a bug, keep the traceback
        _err(_missing_package(e))
        return 1
    except OSError as e:  # a cubin directory or --out that cannot be read or written
        reason = e.strerror or str(e)
        _err(f"{e.filename}: {reason}" if e.filename else reason)
        return 1
    except Exception as e:
        if not type(e).__module__.startswith("pycuda"):
            raise
        _err(f"no usable GPU: pycuda {type(e).__name__}: {e}")  # e.g. cuInit failed
        return 1
