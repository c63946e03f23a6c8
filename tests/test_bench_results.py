"""The result JSON the benches write (bench/fwd_bench.py `write_result`): an environment
block, the convention and the rows, written only when a path is given. No GPU needed: the
environment is mocked."""

from __future__ import annotations

import json

from flashgen.bench import fwd_bench


def test_write_result_writes_environment_convention_and_rows(monkeypatch, tmp_path):
    monkeypatch.setattr(fwd_bench, "environment", lambda: {"gpu": "mock", "torch": "x"})
    out = tmp_path / "deep" / "r.json"
    result = fwd_bench.write_result(str(out), "TFLOP/s = x", [{"d": 64}])
    doc = json.loads(out.read_text())
    assert doc == result == {
        "environment": {"gpu": "mock", "torch": "x"},
        "convention": "TFLOP/s = x",
        "rows": [{"d": 64}],
    }
    assert fwd_bench.write_result(None, "c", [])["rows"] == []
    assert sorted(p.name for p in tmp_path.rglob("*.json")) == ["r.json"]
