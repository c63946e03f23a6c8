"""Plot a benchmark JSON: forward or backward (bench/fwd_bench.py / bwd_bench.py --out) as
TFLOP/s against seqlen, decode (bench/decode_bench.py --out) as GB/s against context.

python3 bench/plot.py bench/results/fwd_h200.json docs/fwd_h200.png
python3 bench/plot.py bench/results/fwd_sm90a_h200.json docs/fwd_sm90a_h200.png forward \
    --exclude m128n128w8s2
python3 bench/plot.py bench/results/bwd_h200.json docs/bwd_h200.png backward
python3 bench/plot.py bench/results/decode_h200.json docs/decode_h200.png decode

--exclude drops the rows whose kernel name contains the given text (the sm_90a JSON also
times the plain-loop twin of the d = 128 auto tile; the plot shows the auto tiles).
"""

from __future__ import annotations

import argparse
import json


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(src: str, dst: str, what: str = "forward", exclude: str = "") -> None:
    if what == "decode":
        return decode(src, dst)
    plt = _plt()
    data = json.loads(open(src).read())
    rows = [r for r in data["rows"] if not (exclude and exclude in r["kernel"])]
    panels = sorted({(r["d"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True)
    for ax, (d, causal) in zip(axes, panels):
        sel = sorted(
            (r for r in rows if r["d"] == d and r["causal"] == causal), key=lambda r: r["seqlen"]
        )
        labels = [
            k
            for k in ("flashgen", "FLASH", "CUDNN", "FLEX", "EFFICIENT", "MATH")
            if any(r["tflops"].get(k) for r in sel)
        ]
        for lab in labels:
            pts = [(r["seqlen"], r["tflops"][lab]) for r in sel if r["tflops"].get(lab)]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                lw=2.5 if lab == "flashgen" else 1.2,
                label=lab,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("seqlen (batch*seqlen = 16k)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"TFLOP/s (bf16 {what})")
    axes[-1].legend(fontsize=8)
    env = data["environment"]
    fig.suptitle(f"{env['gpu']}, torch {env['torch']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def decode(src: str, dst: str, heads: int = 32) -> None:
    """One panel per batch: flashgen (contiguous and paged, page 16), the fastest SDPA backend
    of each shape, the device-to-device copy, and 80% of the copy; `heads` query heads."""
    plt = _plt()
    data = json.loads(open(src).read())
    rows = []
    for r in data["rows"] if isinstance(data, dict) else data:  # issue 20's form, or a list
        if r.get("kind", "decode") != "decode" or r["heads"] != heads:
            continue
        if "flashgen_paged" in r["gbps"]:  # a paged row: its own kernel's bandwidth
            r = {**r, "gbps": {**r["gbps"], "flashgen": r["gbps"]["flashgen_paged"]}}
        rows.append(r)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.4 * len(batches), 3.8), sharey=True)
    for ax, b in zip(axes, batches):
        sel = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["context"])
        ctx = sorted({r["context"] for r in sel})

        def at(page, key, sel=sel, ctx=ctx):
            by = {r["context"]: r for r in sel if r["page_size"] == page}
            return [by[c]["gbps"][key] for c in ctx]

        contiguous = [r for r in sel if r["page_size"] == 0]
        best = [max((v, k) for k, v in r["gbps"].items() if k in ("FLASH", "EFFICIENT", "CUDNN"))
                for r in contiguous]  # fmt: skip
        copy = at(0, "copy")
        ax.plot(ctx, at(0, "flashgen"), marker="o", lw=2.5, label="flashgen, contiguous")
        ax.plot(ctx, at(16, "flashgen"), marker=".", lw=1.2, label="flashgen, paged (16)")
        ax.plot(ctx, [v for v, _ in best], marker="s", lw=1.2, label="fastest SDPA")
        for c, (v, k) in zip(ctx, best):
            ax.annotate(k, (c, v), textcoords="offset points", xytext=(0, 5), fontsize=6,
                        ha="center")  # fmt: skip
        ax.plot(ctx, copy, marker="^", lw=1.2, color="gray", label="copy (read+write)")
        ax.plot(ctx, [0.8 * c for c in copy], ls="--", lw=1, color="gray", label="80% of copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}, {heads} heads / 8 KV heads, d=128")
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (K/V bytes / time; copy: 2 x bytes / time)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("decode, bf16, one query per sequence", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("what", nargs="?", default="forward", choices=("forward", "backward", "decode"))
    ap.add_argument("--exclude", default="", help="drop rows whose kernel name contains this")
    a = ap.parse_args()
    main(a.src, a.dst, a.what, a.exclude)
