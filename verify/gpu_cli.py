"""`flashgen verify` and `flashgen bench`: the GPU-side commands.

`flashgen verify [pytest args...]` runs the GPU suite (tests/gpu) with pytest, writing one
verification record per kernel under verify/records/ (FLASHGEN_GPU_EXAMPLES sets the
Hypothesis examples per shipped spec, 200 by default). Without a GPU it says so and exits 0
with every GPU test skipped.

`flashgen bench [...]` runs the side-by-side forward benchmark (bench/fwd_bench.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def verify_main(argv: list[str] | None = None) -> int:
    import pytest

    args = list(argv or [])
    return int(pytest.main(["-q", str(REPO / "tests" / "gpu"), *args]))


def bench_main(argv: list[str] | None = None) -> int:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from flashgen.bench.fwd_bench import main

    return main(argv)
