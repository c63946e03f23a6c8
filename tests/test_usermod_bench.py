"""bench/usermod_bench.py without a GPU: its argument parsing, the JSON it writes (timings
mocked) and that each shipped variant's spec is a valid flashgen spec with a score_mod. The
bench itself runs on a GPU only (never as a test)."""

from __future__ import annotations

import json

import pytest
from flashgen.bench import usermod_bench as ub
from flashgen.generator.load import load_spec_text


@pytest.mark.parametrize("name", sorted(ub.VARIANTS))
@pytest.mark.parametrize("d", [64, 128])
def test_each_variant_spec_loads_with_its_score_mod(name, d):
    specs = load_spec_text(ub.VARIANTS[name].spec(d))
    assert {s.kernel.yaml for s in specs} == {"forward", "backward"}
    assert {s.score_mod.canonical for s in specs} == {specs[0].score_mod.canonical}
    assert [n for n, _ in specs[0].score_mod.params] == sorted(ub.VARIANTS[name].params)


def test_rows_and_env_have_the_issues_schema(monkeypatch, tmp_path):
    seen = []

    def measure(backend, name, d, n, causal, pass_, tokens, hidden):
        seen.append((backend, name, d, n, causal, pass_))
        if backend == "builtin" and ub.VARIANTS[name].builtin is None:
            return None, None
        options = {"num_stages": 1} if backend == "FLEX" and d == 128 else None
        return {"flashgen": 300.0, "FLEX": 200.0, "builtin": 310.0}[backend], options

    monkeypatch.setattr(ub, "measure", measure)
    monkeypatch.setattr(ub, "environment", lambda: {"gpu": "mock", "torch": "x"})
    out = tmp_path / "usermod.json"
    args = ["--variants", "alibi", "t5_bias", "--seqlens", "4096", "8192", "--out", str(out)]
    assert ub.main(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"rows", "env"} and doc["env"]["gpu"] == "mock"
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 * 2  # variants x dims x causal x seqlens x passes
    for row in rows:
        assert set(row) == {"variant", "d", "seqlen", "causal", "pass", "tflops", "flex_options"}
        assert row["flex_options"] == ({"num_stages": 1} if row["d"] == 128 else None)
        assert row["pass"] in ("fwd", "bwd") and row["d"] in (64, 128)
        assert set(row["tflops"]) == {"flashgen", "FLEX", "builtin"}
        want = None if row["variant"] == "t5_bias" else 310.0
        assert row["tflops"]["builtin"] == want
    assert doc["command"].endswith(" ".join(args))
    assert len(seen) == len(rows) * 3


def test_flex_falls_back_to_smaller_tiles_only_when_out_of_resource(capsys):
    tried = []

    def attempt(options):
        tried.append(options)
        if len(tried) < 3:
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource")
        return "ran"

    assert ub.first_that_compiles("FLEX", attempt) == ("ran", ub.FLEX_LADDER[2])
    assert tried == list(ub.FLEX_LADDER[:3])
    assert "do not fit" in capsys.readouterr().err

    def other(options):
        raise ValueError("a real bug")

    with pytest.raises(ValueError):
        ub.first_that_compiles("FLEX", other)

    def always(options):
        tried.append(options)
        raise RuntimeError("out of resource")

    tried.clear()
    with pytest.raises(RuntimeError):  # the last rung's error is the caller's
        ub.first_that_compiles("FLEX", always)
    assert tried == list(ub.FLEX_LADDER)
    tried.clear()
    with pytest.raises(RuntimeError):  # flashgen takes no options: one attempt
        ub.first_that_compiles("flashgen", always)
    assert tried == [None]


def test_check_stops_on_a_variant_that_differs(monkeypatch, capsys):
    monkeypatch.setattr(ub, "check", lambda name, d, c: {"against": "FLEX", "o": 0.5, "dq": 0.0})
    monkeypatch.setattr(ub, "measure", lambda *a: pytest.fail("measured after a failed check"))
    assert ub.main(["--check", "--variants", "softcap", "--dims", "64"]) == 1
    assert "differs from FLEX" in capsys.readouterr().err


def test_arguments_outside_the_choices_are_refused():
    with pytest.raises(SystemExit):
        ub.main(["--variants", "nope"])
    with pytest.raises(SystemExit):
        ub.main(["--passes", "both"])


@pytest.mark.parametrize("name", sorted(ub.VARIANTS))
def test_the_flex_score_mods_compute_the_spec_expression(name):
    """The torch score_mod FlexAttention runs is the spec's expression (float64 evaluator),
    on every (h, i, j) of a small square problem."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from flashgen.generator import usermod as U

    var = ub.VARIANTS[name]
    mod = U.parse_score_mod(var.score_mod, var.params)
    heads, n = 3, 300
    values = var.values(heads, "cpu")
    s = torch.randn(heads, n, n, dtype=torch.float64)
    h = torch.arange(heads)[:, None, None]
    i = torch.arange(n)[None, :, None]
    j = torch.arange(n)[None, None, :]
    got = var.flex(values)(s, torch.tensor(0), h, i, j)
    env = {"s": s.numpy(), "b": 0, "h": h.numpy(), "i": i.numpy(), "j": j.numpy(),
           "seqlen_q": n, "seqlen_k": n}  # fmt: skip
    params = {k: (v.double().numpy() if isinstance(v, torch.Tensor) else v)
              for k, v in values.items()}  # fmt: skip
    want = U.evaluate(mod.tree, env, params)
    np.testing.assert_allclose(got.double().numpy(), np.broadcast_to(want, got.shape), rtol=1e-6,
                               atol=1e-6)  # fmt: skip
