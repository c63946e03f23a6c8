"""compute-sanitizer over a sample of shipped kernels (one per kernel kind and feature family).

    compute-sanitizer --tool memcheck python3 bench/sanitize.py run [i/n] > memcheck_i.txt
    compute-sanitizer --tool racecheck python3 bench/sanitize.py run [i/n] > racecheck_i.txt
    compute-sanitizer --tool synccheck python3 bench/sanitize.py run [i/n] > synccheck_i.txt
    python3 bench/sanitize.py merge memcheck_*.txt racecheck_*.txt   # into verify/records/

`run` launches each sampled kernel (every n-th from the i-th, so n processes share the
sample) on small odd-length problems and prints `ran <kernel>` after each; `merge` reads each
output's tool summary ("ERROR SUMMARY: N errors" / "RACECHECK SUMMARY: N hazards") and stores
it in the records of the kernels that output ran (a summary covers its whole process, so an
error marks every kernel of that process). Families other than forward and backward bring
their own sanitizer cases (their GPU tests' hostile inputs) and are not sampled here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import PACKAGE_ROOT, records_dir

REPO = PACKAGE_ROOT


def _same_tokens(spec) -> bool:
    """Whether the spec reads a `per_token` parameter, one id per token read at queries and
    keys alike: its calls need the same tokens on both sides (seqlen_q == seqlen_k, equal
    cu_seqlens)."""
    from flashgen.generator.usermod import ParamKind

    mods = (getattr(spec, "score_mod", None), getattr(spec, "mask_mod", None))
    return any(k is ParamKind.PER_TOKEN for m in mods if m is not None for _, k in m.params)


def sample_specs():
    """One spec per family key below; with FLASHGEN_SANITIZE_FEATURES=1 only those with a score
    modifier (a session that changed the score stage alone); with FLASHGEN_SANITIZE_ONLY=KIND
    or KIND:TARGET (`backward`, `forward:sm_90a`) only that kernel kind on that target (a
    session that changed one mainloop); with FLASHGEN_SANITIZE_MATCH=REGEX only kernels whose
    name matches it (a change to one feature of a mainloop, e.g. `_det_`)."""
    import os

    from flashgen.generator.load import load_paths

    features_only = os.environ.get("FLASHGEN_SANITIZE_FEATURES") == "1"
    only = os.environ.get("FLASHGEN_SANITIZE_ONLY", "")
    kind, _, target = only.partition(":")
    if kind not in ("", "forward", "backward"):
        raise SystemExit(f"FLASHGEN_SANITIZE_ONLY={only!r}: the kind is forward or backward")
    try:
        match = re.compile(os.environ.get("FLASHGEN_SANITIZE_MATCH", ""))
    except re.error as e:
        raise SystemExit(f"FLASHGEN_SANITIZE_MATCH is not a regular expression: {e}") from None

    picked, seen = [], set()
    for s in load_paths([REPO / "specs"]):
        if s.kernel.yaml not in ("forward", "backward") or (features_only and not s.features):
            continue
        if (kind and s.kernel.yaml != kind) or (target and s.target.yaml != target):
            continue
        if not match.search(kernel_name(s)):
            continue
        family = (
            s.kernel,
            s.target.value.suffix,  # the sm_90a (wgmma/TMA) mainloop is its own family
            s.deterministic,
            s.gqa,
            s.tile.warps,
            s.mask.window,
            s.mask.varlen,
            s.dropout,
            s.debug_keep_mask,
            s.sparse,
            s.instrument_io,
            s.mask.causal.yaml != "none",
            s.head_dim > 128,
            s.features,  # each combination of score modifiers (the dsink kernel with sinks)
            getattr(s, "score_mod", None) is not None,  # a spec's own expressions
            getattr(s, "mask_mod", None) is not None,
            _same_tokens(s),  # a mask_mod's per_token vectors (document ids)
        )
        if family not in seen:
            seen.add(family)
            picked.append(s)
    return picked


def inputs(spec, rng) -> tuple[tuple, dict]:
    """The arguments of the sanitized call of `spec`: (q, k, v[, o, lse, dout]) and the
    runner's keywords. Small odd-length problems whose sk spans at least 3 K/V tiles past the
    pipeline depth, so the shared-memory ring wraps."""
    from flashgen.verify.blocksparse import compact_layout_for_spec
    from flashgen.verify.strategies import fixed_score_args

    d, d_v = spec.head_dim, spec.head_dim_vo  # q, k; v, o and dO
    sq, sk = 257, (spec.tile.stages + 3) * spec.tile.block_n + 13
    same = _same_tokens(spec)
    if same:  # per_token ids are read at queries and keys: the same tokens on both sides
        sq = sk = max(sq, sk)
    kw = {}
    if spec.mask.varlen:
        q = rng.standard_normal((sq, 2, d)).astype(np.float32)
        k = rng.standard_normal((sk, 2, d)).astype(np.float32)
        v = rng.standard_normal((sk, 2, d_v)).astype(np.float32)
        kw.update(
            cu_seqlens_q=np.array([0, 31, sq], np.int32),
            cu_seqlens_k=np.array([0, 31 if same else sk - 7, sk], np.int32),
        )
        tokens = (sq, sk)
    else:
        q = rng.standard_normal((2, sq, 2, d)).astype(np.float32)
        k = rng.standard_normal((2, sk, 2, d)).astype(np.float32)
        v = rng.standard_normal((2, sk, 2, d_v)).astype(np.float32)
        tokens = (2 * sq, 2 * sk)
    if spec.mask.window:
        kw["window"] = (20, 3)
    if spec.dropout:
        kw.update(dropout_p=0.3, seed=5, offset=6)
    if spec.sparse:
        tr, tc = -(-sq // spec.tile.block_m), -(-sk // spec.tile.block_n)
        mask = rng.random((1, tr, tc)) < 0.6
        kw["layout"] = compact_layout_for_spec(
            mask, spec, seqlen_q=sq, seqlen_k=sk, window=kw.get("window", (-1, -1))
        )
    kw.update(fixed_score_args(spec, 2, q.shape[-2], tokens).kwargs())
    if spec.kernel.yaml != "backward":
        return (q, k, v), kw
    # O and LSE need not be a forward's for memory and race checking: any finite values
    # exercise every load, atomic and store of the three kernels.
    lse = rng.standard_normal(q.shape[:-1]).astype(np.float32)
    lse = lse.transpose(1, 0) if spec.mask.varlen else lse.transpose(0, 2, 1)
    o = rng.standard_normal(q.shape[:-1] + (d_v,)).astype(np.float32)  # also dO
    return (q, k, v, o, np.ascontiguousarray(lse), o), kw


def run(shard: str = "0/1") -> None:
    from flashgen.verify.runner import load_kernel
    from flashgen.verify.runner_bwd import load_bwd_kernel

    i, n = (int(x) for x in shard.split("/"))
    rng = np.random.default_rng(i)
    for spec in sample_specs()[i::n]:
        backward = spec.kernel.yaml == "backward"
        kernel = load_bwd_kernel(spec) if backward else load_kernel(spec)
        args, kw = inputs(spec, rng)
        kernel.run(*args, **kw)
        print("ran", kernel_name(spec), flush=True)


def merge(paths: list[str]) -> dict[str, dict[str, str]]:
    """kernel -> {tool: summary} from the tools' outputs, written into the records."""
    verdicts: dict[str, dict[str, str]] = {}
    for p in paths:
        text = Path(p).read_text()
        name = Path(p).name
        tool = next((t for t in ("racecheck", "synccheck") if t in name), "memcheck")
        if tool == "memcheck" and "RACECHECK" in text:
            tool = "racecheck"
        m = re.search(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors|hazards)", text)
        summary = m.group(0) if m else "no summary (tool did not finish)"
        for name in re.findall(r"^ran (\S+)$", text, re.MULTILINE):
            verdicts.setdefault(name, {})[tool] = summary
    records = records_dir()
    for name, v in verdicts.items():
        path = records / f"{name}.json"
        if path.exists():
            rec = json.loads(path.read_text())
            rec["sanitizer"] = v
            path.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    print(json.dumps(verdicts, indent=1))
    return verdicts


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(*sys.argv[2:3])
    else:
        merge(sys.argv[2:])
