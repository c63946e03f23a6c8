"""Plot a forward or backward benchmark JSON (bench/fwd_bench.py / bwd_bench.py --out) as
TFLOP/s against seqlen.

python3 bench/plot.py bench/results/fwd_h200.json docs/fwd_h200.png
python3 bench/plot.py bench/results/bwd_h200.json docs/bwd_h200.png backward
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str, what: str = "forward") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(open(src).read())
    rows = data["rows"]
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


if __name__ == "__main__":
    main(*sys.argv[1:4])
