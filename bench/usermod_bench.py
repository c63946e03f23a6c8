"""User-defined score_mods (compile_variant) against FlexAttention and flashgen's built-ins.

In one run on a GPU, each shipped score_mod variant (`VARIANTS`: generator/usermod/examples.py's
score_mods) is timed forward and backward, at d 64 and 128, each sequence length, bf16, causal
and not, for three implementations of the same attention:

- `flashgen`: `flashgen.torch.compile_variant(spec)` (kernels compiled on first use into the
  kernel cache);
- `FLEX`: `torch.nn.attention.flex_attention` under `torch.compile`, with the same score_mod
  written in torch (and a causal block mask);
- `builtin`: flashgen's built-in modifier through `flash_attn_func` where one exists
  (`alibi_slopes=`, `softcap=`), else null.

`--check` first compares each variant's output and gradients with the built-in's (or
FlexAttention's) on a small problem and stops if they differ by more than `--tolerance`
(relative Frobenius error): a smoke test beside the GPU suite, which is the verification.

    python3 -m flashgen.bench.usermod_bench --check --out bench/results/usermod_h200.json

Rows: {"variant", "d", "seqlen", "causal", "pass": "fwd" | "bwd",
"tflops": {"flashgen": x, "FLEX": y, "builtin": z | null}, "flex_options": the
FlexAttention kernel_options used, null for its defaults (`FLEX_LADDER`)} (backward FLOPs are
2.5x the forward's), with "env" (fwd_bench.environment) and "command". Timings: triton's do_bench
(median of 100 repetitions after 25 warm-up ones), as the other benches.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flashgen.bench.fwd_bench import environment, flops

__all__ = ["VARIANTS", "Variant", "main", "measure"]

BACKENDS = ("flashgen", "FLEX", "builtin")
PASSES = ("fwd", "bwd")
SOFTCAP = 30.0
# the default head dims and masks (tests/test_variant_prebuild.py holds
# examples/variant_kernels.yaml to the kernels they need)
DIMS = (64, 128)
CAUSALS = {"both": [False, True], "yes": [True], "no": [False]}
T5_FACTOR = 2.8853900817779268  # (16 - 8) / ln(128 / 8): docs/usermod.md, Examples


@dataclass(frozen=True)
class Variant:
    """One shipped variant: its score_mod and params (the spec's), how to draw the parameter
    values (`values(heads, device)`), the same modifier for FlexAttention
    (`flex(values)` -> score_mod(score, b, h, q_idx, kv_idx)) and flash_attn_func's keyword
    arguments of the built-in (`builtin(values)`, None where there is none)."""

    score_mod: str
    params: dict
    values: Callable[[int, Any], dict]
    flex: Callable[[dict], Callable]
    builtin: Callable[[dict], dict] | None = None

    def spec(self, d: int) -> str:
        params = ", ".join(f"{n}: {k}" for n, k in self.params.items())
        return (
            f"kernel: [forward, backward]\ndtype: bf16\nhead_dim: {d}\n"
            f"score_mod: {json.dumps(self.score_mod)}\nparams: {{{params}}}\n"
        )


def _slopes(heads, device):
    import torch

    s = [2.0 ** (-8.0 * (k + 1) / heads) for k in range(heads)]
    return {"slopes": torch.tensor(s, device=device, dtype=torch.float32)}


def _table(columns):
    def values(heads, device):
        import torch

        g = torch.Generator(device="cpu").manual_seed(0)
        return {"bias": torch.randn(heads, columns, generator=g).to(device)}

    return values


def _flex_alibi(p):
    slopes = p["slopes"]

    def mod(score, b, h, q, kv):  # equal lengths: i + seqlen_k - seqlen_q - j = q - kv
        return score - slopes[h] * (q - kv).abs()

    return mod


def _flex_softcap(p):
    cap = p["cap"]

    def mod(score, b, h, q, kv):
        return cap * (score / cap).tanh()

    return mod


def _flex_bucketed(p):
    import torch

    bias = p["bias"]

    def mod(score, b, h, q, kv):
        return score + bias[h, torch.clamp((q - kv).abs() // 8, max=31)]

    return mod


def _flex_t5(p):
    import torch

    bias = p["bias"]

    def mod(score, b, h, q, kv):
        n = (kv - q).abs()
        far = 8 + torch.floor(torch.log(n.clamp(min=1) / 8.0) * T5_FACTOR + 0.001).to(n.dtype)
        bucket = torch.where(kv > q, 16, 0) + torch.where(n < 8, n, torch.clamp(far, max=15))
        return score + bias[h, bucket]

    return mod


VARIANTS: dict[str, Variant] = {
    "alibi": Variant(
        "s - slopes[h] * abs(i + seqlen_k - seqlen_q - j)",
        {"slopes": "per_head"},
        _slopes,
        _flex_alibi,
        lambda p: {"alibi_slopes": p["slopes"]},
    ),
    "softcap": Variant(
        "cap * tanh(s / cap)",
        {"cap": "scalar"},
        lambda heads, device: {"cap": SOFTCAP},
        _flex_softcap,
        lambda p: {"softcap": p["cap"]},
    ),
    "bucketed_bias": Variant(
        "s + bias[h, min(abs(i - j) // 8, 31)]", {"bias": "table"}, _table(32), _flex_bucketed
    ),
    "t5_bias": Variant(
        "s + bias[h, where(j > i, 16, 0) + where(abs(j - i) < 8, abs(j - i), "
        f"min(8 + floor(log(abs(j - i) / 8) * {T5_FACTOR} + 0.001), 15))]",
        {"bias": "table"},
        _table(32),
        _flex_t5,
    ),
}


# -- the three implementations --------------------------------------------------------------------

_COMPILED: dict = {}


def _flashgen(name: str, d: int):
    key = (name, d)
    if key not in _COMPILED:
        from flashgen.torch import compile_variant

        _COMPILED[key] = compile_variant(VARIANTS[name].spec(d))
    return _COMPILED[key]


_FLEX: list = []


def _flex_fn():
    if not _FLEX:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        # every (variant, shape, mask) is a recompile: keep them all compiled (past the
        # default limit dynamo would fall back to eager flex_attention, far slower)
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 4096)
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


# FlexAttention's kernel options, tried in turn: its default tiles first, then smaller ones
# where the default asks for more shared memory than the GPU has (Triton's "out of resource";
# seen on the H200 for the bucketed table variant). The options used go into the row.
FLEX_LADDER: tuple[dict | None, ...] = (
    None,
    {"num_stages": 1},
    {"num_stages": 1, "BLOCK_M": 64, "BLOCK_N": 64},
    {"num_stages": 1, "BLOCK_M": 32, "BLOCK_N": 32,
     "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32},
)  # fmt: skip


def _out_of_resource(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return "out of resource" in text or "No valid triton configs" in text


def first_that_compiles(backend: str, attempt: Callable[[dict | None], Any]) -> tuple[Any, Any]:
    """(attempt(options), options) for the first FLEX_LADDER entry whose kernels compile
    (flashgen and builtin take no options: one attempt). Other errors propagate."""
    ladder = FLEX_LADDER if backend == "FLEX" else (None,)
    for i, options in enumerate(ladder):
        try:
            return attempt(options), options
        except Exception as exc:  # torch._inductor.exc.InductorError wraps Triton's
            if i + 1 == len(ladder) or not _out_of_resource(exc):
                raise
            print(f"usermod_bench: FLEX options {options} do not fit "
                  f"({str(exc).splitlines()[-1][:120]}); trying {ladder[i + 1]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    raise AssertionError("unreachable")


def attention(backend: str, name: str, d: int, causal: bool, values: dict,
              flex_options: dict | None = None):  # fmt: skip
    """fn(q, k, v) -> out, (batch, seqlen, heads, d) tensors, of `backend`; None where the
    backend has no such variant (builtin). `flex_options`: FlexAttention's kernel_options."""
    variant = VARIANTS[name]
    if backend == "flashgen":
        var = _flashgen(name, d)
        return lambda q, k, v: var(q, k, v, causal=causal, **values)
    if backend == "builtin":
        if variant.builtin is None:
            return None
        from flashgen.torch import flash_attn_func

        kw = variant.builtin(values)
        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, **kw)
    from torch.nn.attention.flex_attention import create_block_mask

    flex, mod = _flex_fn(), variant.flex(values)
    masks: dict = {}

    def run(q, k, v):
        block_mask = None
        if causal:
            shape = (q.shape[1], k.shape[1])
            if shape not in masks:
                masks[shape] = create_block_mask(
                    lambda b, h, qi, kv: qi >= kv, None, None, *shape, device=q.device
                )
            block_mask = masks[shape]
        out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=mod,
                   block_mask=block_mask, kernel_options=flex_options)  # fmt: skip
        return out.transpose(1, 2)

    return run


def _bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure(backend: str, name: str, d: int, n: int, causal: bool, pass_: str,
            tokens: int, hidden: int) -> tuple[float | None, dict | None]:  # fmt: skip
    """(TFLOP/s, FlexAttention kernel options used) of one backend on one case (TFLOP/s None:
    the backend has no such variant)."""
    import torch

    batch, heads = max(1, tokens // n), hidden // d
    torch.manual_seed(0)
    values = VARIANTS[name].values(heads, "cuda")
    if attention(backend, name, d, causal, values) is None:
        return None, None
    grad = pass_ == "bwd"
    q, k, v = (torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=grad) for _ in range(3))  # fmt: skip

    def compiled(options):
        fn = attention(backend, name, d, causal, values, flex_options=options)
        if grad:
            out = fn(q, k, v)
            dout = torch.randn_like(out)

            def step():
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        else:

            def step():
                with torch.no_grad():
                    fn(q, k, v)

        step()  # compile (first use) outside the timing
        return step

    step, options = first_that_compiles(backend, compiled)
    ms = _bench_ms(step)
    work = flops(batch, heads, n, d, causal) * (2.5 if grad else 1.0)
    return work / (ms * 1e-3) / 1e12, options


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check(name: str, d: int, causal: bool) -> dict:
    """Relative errors of the flashgen variant's output and gradients against the built-in
    (or FlexAttention where there is none) on one small problem."""
    import torch

    torch.manual_seed(1)
    b, h, n = 2, 4, 1031
    values = VARIANTS[name].values(h, "cuda")
    other = "builtin" if VARIANTS[name].builtin is not None else "FLEX"
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dout = torch.randn_like(q)
    out = {}
    results = []
    for backend in ("flashgen", other):

        def run(options, backend=backend):
            o = attention(backend, name, d, causal, values, flex_options=options)(q, k, v)
            return o, torch.autograd.grad(o, (q, k, v), dout)

        results.append(first_that_compiles(backend, run)[0])
    (o1, g1), (o2, g2) = results
    out["against"] = other
    out["o"] = _rel(o1, o2)
    for nm, a, b_ in zip(("dq", "dk", "dv"), g1, g2):
        out[nm] = _rel(a, b_)
    return out


def cases(variants, dims, seqlens, causals) -> list[tuple]:
    return [(name, d, n, c) for name in variants for d in dims for c in causals for n in seqlens]


_ENV: list[dict] = []


def write(path: str, rows: list, checks: list, argv: list[str] | None) -> None:
    if not _ENV:
        _ENV.append(environment())
    doc = {
        "rows": rows,
        "env": _ENV[0],
        "command": "python3 -m flashgen.bench.usermod_bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "checks": checks,
    }
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="usermod_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--passes", nargs="+", default=list(PASSES), choices=list(PASSES))
    ap.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen")
    ap.add_argument("--hidden", type=int, default=2048, help="heads = hidden // d")
    ap.add_argument("--check", action="store_true", help="compare outputs first")
    ap.add_argument("--tolerance", type=float, default=3e-2)
    ap.add_argument("--out", default=None, help="the JSON file (e.g. usermod_h200.json)")
    args = ap.parse_args(argv)
    causals = CAUSALS[args.causal]

    checks = []
    if args.check:
        for name in args.variants:
            for d in args.dims:
                for c in causals:
                    err = check(name, d, c)
                    checks.append({"variant": name, "d": d, "causal": c, **err})
                    worst = max(v for k, v in err.items() if k != "against")
                    print(f"check {name} d={d} causal={int(c)} vs {err['against']}: "
                          + " ".join(f"{k}={v:.2e}" for k, v in err.items() if k != "against"),
                          flush=True)  # fmt: skip
                    if not worst <= args.tolerance:
                        print(f"usermod_bench: {name} d={d} differs from {err['against']} by "
                              f"{worst:.3g} > {args.tolerance}", file=sys.stderr)  # fmt: skip
                        return 1
    rows = []
    for name, d, n, causal in cases(args.variants, args.dims, args.seqlens, causals):
        for pass_ in args.passes:
            got = {be: measure(be, name, d, n, causal, pass_, args.tokens, args.hidden)
                   for be in BACKENDS}  # fmt: skip
            tf = {be: x for be, (x, _) in got.items()}
            rows.append({"variant": name, "d": d, "seqlen": n, "causal": causal, "pass": pass_,
                         "tflops": tf, "flex_options": got["FLEX"][1]})  # fmt: skip
            if args.out:  # after every row, so that a run cut short keeps what it measured
                write(args.out, rows, checks, argv)
            shown = " ".join(f"{be}={'-' if x is None else f'{x:.1f}'}" for be, x in tf.items())
            print(f"{name:14s} {pass_} d={d:3d} causal={int(causal)} n={n:5d}: {shown} TFLOP/s",
                  flush=True)  # fmt: skip
    if args.out:
        write(args.out, rows, checks, argv)
    for be in ("FLEX", "builtin"):
        ratios = [r["tflops"]["flashgen"] / r["tflops"][be] for r in rows
                  if r["tflops"].get(be) and r["tflops"].get("flashgen")]  # fmt: skip
        if ratios:
            print(f"flashgen / {be}: worst {min(ratios):.3f}, geomean "
                  f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
