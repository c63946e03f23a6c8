"""A small GPT trained twice in one run: attention by flashgen, then by PyTorch's SDPA.

nanoGPT's model (pre-LayerNorm blocks, tied embeddings, GELU MLP, AdamW with warm-up and
cosine decay) at 6 layers x 768 wide, 12 heads of 64, context 1024, bf16 autocast over fp32
weights, on a character-level corpus this script generates deterministically (a seeded
Markov chain over pseudo-words: spelling, word transitions and sentence structure to learn).
Both runs use the same seed, initial weights, batches and schedule; the only difference is
the attention call:

    flashgen:  flash_attn_func(q, k, v, causal=True)      q, k, v: (batch, seq, heads, 64)
    sdpa:      F.scaled_dot_product_attention(q, k, v, is_causal=True)   (batch, heads, ...)

A third run repeats SDPA (`--no-repeat` skips it): the spread between two runs of one
implementation is the bf16 noise the flashgen/SDPA difference is to be read against.

Writes the losses and throughputs to bench/results/train_h200.json and a plot to
docs/train_h200.png (when matplotlib is installed). About a minute on an H200 with the
kernels built ahead (`flashgen compile examples/torch_kernels.yaml`), else add the first-use
compile of two kernels.

    python examples/train_gpt.py [--steps 400] [--batch 16] [--context 1024] [--out ...]

`--context 4096 --batch 4` keeps the tokens per step of the default run at four times the
attention's share of the step (issue 21's second training shape).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from flashgen.torch import flash_attn_func

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Config:
    layers: int = 6
    d_model: int = 768
    heads: int = 12
    context: int = 1024
    vocab: int = 128  # ASCII
    dropout: float = 0.0


# -- data ------------------------------------------------------------------------------------------


def make_corpus(n_words: int, seed: int) -> bytes:
    """Deterministic pseudo-English: 3000 words of 1-3 syllables, each followed by one of
    its 8 successors with Zipf weights; sentences of capitalised words ending in '.'."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "an", "er", "on"]
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < 3000:
        w = "".join(rng.choice(syllables, size=int(rng.integers(1, 4))))
        if w not in seen:
            seen.add(w)
            words.append(w)
    succ = rng.integers(0, len(words), size=(len(words), 8))
    zipf = 1.0 / np.arange(1, 9)
    choice = rng.choice(8, size=n_words, p=zipf / zipf.sum())
    ends = rng.random(n_words) < 0.08
    out, w, start = [], 0, True
    for i in range(n_words):
        w = int(succ[w, choice[i]])
        word = words[w].capitalize() if start else words[w]
        out.append(word + (". " if ends[i] else " "))
        start = bool(ends[i])
    return "".join(out).encode("ascii")


# -- model ----------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: Config, impl: str) -> None:
        super().__init__()
        self.cfg, self.impl = cfg, impl
        self.heads, self.head_dim = cfg.heads, cfg.d_model // cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, self.head_dim)
        p = self.cfg.dropout if self.training else 0.0
        if self.impl == "flashgen":
            q, k, v = qkv.unbind(dim=2)  # (b, s, h, hd) views of the projection: no copy
            y = flash_attn_func(q, k, v, dropout_p=p, causal=True)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (b, h, s, hd) views
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            y = y.transpose(1, 2)
        return self.proj(y.reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, cfg: Config, impl: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, impl)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, impl: str) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, impl) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# -- training -------------------------------------------------------------------------------------


def sdpa_backend(cfg: Config) -> str:
    """The SDPA backend PyTorch picks for this model's attention call (profiled once): the
    baseline the tokens/s ratio is against."""
    from torch.profiler import ProfilerActivity, profile

    hd = cfg.d_model // cfg.heads
    q = torch.randn(2, cfg.heads, cfg.context, hd, device="cuda", dtype=torch.bfloat16)
    q.requires_grad_(True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = " ".join(e.key for e in prof.key_averages()).lower()
    for tag, backend in (("cudnn", "CUDNN"), ("flash", "FLASH"), ("fmha", "EFFICIENT")):
        if tag in names:
            return backend
    return "MATH or unknown"


def _environment() -> dict:
    try:
        from flashgen.bench.fwd_bench import environment

        return environment()
    except Exception as exc:  # the example runs without the bench package too
        return {"error": repr(exc)}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t)))


def train(impl: str, cfg: Config, args, data: torch.Tensor, starts: torch.Tensor,
          eval_starts: torch.Tensor) -> dict:  # fmt: skip
    torch.manual_seed(args.seed)
    model = GPT(cfg, impl).cuda()
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    offsets = torch.arange(cfg.context + 1, device="cuda")
    losses = torch.empty(args.steps, device="cuda")
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = time.monotonic()
    model.train()
    for step in range(args.steps):
        if step == args.warmup_steps:
            begin.record()
        chunk = data[starts[step][:, None] + offsets]  # (batch, context + 1)
        x, y = chunk[:, :-1].long(), chunk[:, 1:].long()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.lr_warmup)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
    end.record()
    torch.cuda.synchronize()
    seconds = begin.elapsed_time(end) / 1e3
    timed = args.steps - args.warmup_steps
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ev = []
        for s in eval_starts:
            chunk = data[s[:, None] + offsets]
            logits = model(chunk[:, :-1].long())
            ev.append(
                F.cross_entropy(logits.float().view(-1, cfg.vocab), chunk[:, 1:].reshape(-1).long())
            )
        eval_loss = float(torch.stack(ev).mean())
    values = [float(x) for x in losses.cpu()]
    result = {
        "final_loss": values[-1],
        "final_loss_mean_last20": float(np.mean(values[-20:])),
        "eval_loss": eval_loss,
        "tokens_per_s": args.batch * cfg.context * timed / seconds,
        "ms_per_step": 1e3 * seconds / timed,
        "wall_s": time.monotonic() - wall,
        "losses": values,
    }
    print(
        f"{impl:>8}: final loss {result['final_loss']:.4f} (last 20: "
        f"{result['final_loss_mean_last20']:.4f}), eval {eval_loss:.4f}, "
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['ms_per_step']:.1f} ms/step",
        file=sys.stderr,
    )
    del model, opt
    torch.cuda.empty_cache()
    return result


def plot(results: dict, steps: int, path: Path, device: str, context: int) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, (ax, axd) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    x = np.arange(1, steps + 1)
    for impl, res in results.items():
        label = f"{impl} ({res['tokens_per_s'] / 1e3:,.0f}k tokens/s)"
        ax.plot(x, res["losses"], label=label, lw=1.2, alpha=0.85)
    ax.set_ylabel("training loss (nats/char)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"GPT 6 x 768, context {context}, bf16 autocast, {device}")
    base = np.array(results["sdpa"]["losses"])
    for impl, res in results.items():
        if impl != "sdpa":
            axd.plot(x, np.array(res["losses"]) - base, lw=0.8, label=f"{impl} - sdpa")
    axd.axhline(0.0, color="k", lw=0.5)
    axd.set_xlabel("step")
    axd.set_ylabel("loss difference")
    axd.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-warmup", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=20, help="steps left out of tokens/s")
    ap.add_argument("--context", type=int, default=1024, help="sequence length of a batch row")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--words", type=int, default=1_500_000, help="corpus size in words")
    ap.add_argument("--no-repeat", action="store_true", help="skip the second SDPA run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_h200.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "train_h200.png")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.steps <= args.warmup_steps:
        ap.error("--steps must exceed --warmup-steps")
    if not 16 <= args.context <= 65536:
        ap.error(f"--context must be in 16..65536, got {args.context}")
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = Config(context=args.context, dropout=args.dropout)

    corpus = make_corpus(args.words, args.seed)
    split = int(0.9 * len(corpus))
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).cuda()
    rng = np.random.default_rng(args.seed)
    starts = torch.tensor(rng.integers(0, split - cfg.context - 1, (args.steps, args.batch)))
    eval_starts = torch.tensor(rng.integers(split, len(corpus) - cfg.context - 1, (10, args.batch)))
    starts, eval_starts = starts.cuda(), eval_starts.cuda()
    print(
        f"corpus {len(corpus) / 1e6:.1f} M chars; {args.steps} steps of {args.batch} x "
        f"{cfg.context} tokens",
        file=sys.stderr,
    )

    runs = [("flashgen", "flashgen"), ("sdpa", "sdpa")]
    if not args.no_repeat:
        runs.append(("sdpa_repeat", "sdpa"))
    results = {name: train(impl, cfg, args, data, starts, eval_starts) for name, impl in runs}

    def diff(a: str, b: str) -> dict:
        x, y = np.array(results[a]["losses"]), np.array(results[b]["losses"])
        return {
            "max_abs": float(np.abs(x - y).max()),
            "mean_abs_last100": float(np.abs(x - y)[-100:].mean()),
        }

    device = torch.cuda.get_device_name()
    doc = {
        "steps": args.steps,
        "impls": {k: results[k] for k in ("flashgen", "sdpa")},
        "loss_difference": {"flashgen_vs_sdpa": diff("flashgen", "sdpa")},
        "config": {
            **asdict(cfg),
            "batch": args.batch,
            "lr": args.lr,
            "seed": args.seed,
            "corpus_chars": len(corpus),
            "warmup_steps_untimed": args.warmup_steps,
            "precision": "bf16 autocast, fp32 weights",
        },  # fmt: skip
        "device": device,
        "torch": torch.__version__,
        "environment": _environment(),
        "sdpa_backend": sdpa_backend(cfg),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python examples/train_gpt.py " + " ".join(argv or sys.argv[1:]),
    }
    if "sdpa_repeat" in results:
        doc["noise"] = {"sdpa_repeat": results["sdpa_repeat"]}
        doc["loss_difference"]["sdpa_vs_sdpa_repeat"] = diff("sdpa", "sdpa_repeat")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    curves = {k: results[k] for k in ("flashgen", "sdpa")}
    if plot(curves, args.steps, args.plot, device, cfg.context):
        print(f"wrote {args.plot}", file=sys.stderr)
    print(json.dumps(doc["loss_difference"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
