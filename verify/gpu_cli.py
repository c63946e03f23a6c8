"""`flashgen verify` and `flashgen bench`: the GPU-side commands.

`flashgen verify [pytest args...]` runs the GPU suite (tests/gpu) with pytest, writing one
verification record per kernel under verify/records/ (FLASHGEN_GPU_EXAMPLES sets the
Hypothesis examples per shipped spec, 200 by default). Without a GPU it says so and exits 0
with every GPU test skipped.

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
_GPU_EXTRA = "pip install 'flashgen[gpu]'"
_INSTALL_HINTS = {
    "pycuda": _GPU_EXTRA,
    "torch": f"{_GPU_EXTRA} torch",
    "triton": f"{_GPU_EXTRA} torch (Triton comes with PyTorch)",
}


def _err(msg: str) -> None:
    print(f"flashgen: error: {msg}", file=sys.stderr)


def verify_main(argv: list[str] | None = None) -> int:
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
    import pytest

    # Outside a checkout pytest's rootdir is inside site-packages: write no cache there.
    extra = [] if paths.checkout_root() else ["-p", "no:cacheprovider"]
    return int(pytest.main(["-q", *extra, str(suite), *(argv or [])]))


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
