"""Training-step throughput of a transformers Llama with flashgen's attention against SDPA's.

    python -m flashgen.bench.llama_step [--seqlens 1024 4096] [--steps 30] [--out result.json]

A random-weight `LlamaForCausalLM` built from a config (nothing is downloaded; issue 21's
shape: hidden 1024, 16 query heads and 4 KV heads of 64, 4 layers, vocab 32000), bf16
weights, AdamW. For each sequence length the same model (same seed, same weights, same
batches) is trained once with `attn_implementation="sdpa"` and once with flashgen's
(`flashgen.torch.register_transformers()`), in one process, alternating the two `--rounds`
times so that clock drift falls on both; tokens/s is the median over rounds of
`batch * seqlen * steps / seconds` (CUDA events around `steps` timed steps after
`--warmup` untimed ones). The sequence lengths' batches hold `--tokens` tokens per step.
The losses of the two runs' first steps are kept, to show they train the same model.

Writes `{"environment", "command", "config", "rows": [{"seqlen", "batch", "tokens_per_s":
{"flashgen", "sdpa"}, "ratio", "sdpa_backend", "loss_first_steps": {...}}]}`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before each round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    for name in ("tokens", "steps", "rounds", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    for s in args.seqlens:
        if s < 16 or args.tokens % s:
            ap.error(f"--seqlens: {s} must be >= 16 and divide --tokens ({args.tokens})")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("llama_step needs a CUDA GPU")
    import flashgen.torch as fgt
    import transformers
    from flashgen.bench.fwd_bench import environment

    name = fgt.register_transformers(strict=True)  # a refused call raises, not falls back
    dev = torch.device("cuda")
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=max(args.seqlens),
    )

    def build(impl: str):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=impl
        ).to(dev, torch.bfloat16)
        assert model.config._attn_implementation == impl
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def steps(model, opt, batches) -> tuple[float, list[float]]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        losses = []
        for i, ids in enumerate(batches):
            if i == args.warmup:
                begin.record()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        end.record()
        torch.cuda.synchronize()
        seconds = begin.elapsed_time(end) / 1e3
        return seconds, [float(x) for x in losses[:5]]

    rows = []
    for seqlen in args.seqlens:
        batch = args.tokens // seqlen
        gen = torch.Generator(device=dev).manual_seed(1)
        total = args.warmup + args.steps
        batches = [
            torch.randint(0, config.vocab_size, (batch, seqlen), device=dev, generator=gen)
            for _ in range(total)
        ]
        rates: dict[str, list[float]] = {"flashgen": [], "sdpa": []}
        first: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for label, impl in (("sdpa", "sdpa"), ("flashgen", name)):
                model, opt = build(impl)
                seconds, losses = steps(model, opt, batches)
                rates[label].append(batch * seqlen * args.steps / seconds)
                first.setdefault(label, losses)
                del model, opt
                torch.cuda.empty_cache()
        tps = {k: statistics.median(v) for k, v in rates.items()}
        row = {
            "seqlen": seqlen,
            "batch": batch,
            "tokens_per_s": tps,
            "tokens_per_s_rounds": rates,
            "ratio": tps["flashgen"] / tps["sdpa"],
            "sdpa_backend": _sdpa_backend(torch, batch, seqlen),
            "loss_first_steps": first,
        }
        rows.append(row)
        print(
            f"seq {seqlen:>6} batch {batch:>3}: flashgen {tps['flashgen']:,.0f} tokens/s, "
            f"sdpa {tps['sdpa']:,.0f} ({row['sdpa_backend']}): {row['ratio']:.3f}x",
            file=sys.stderr,
        )
    doc = {
        "environment": environment(),
        "command": "python -m flashgen.bench.llama_step " + " ".join(argv or sys.argv[1:]),
        "config": {
            "hidden": config.hidden_size,
            "heads": 16,
            "kv_heads": 4,
            "head_dim": 64,
            "layers": args.layers,
            "vocab": config.vocab_size,
            "dtype": "bfloat16 weights, AdamW (fused)",
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "tokens_per_step": args.tokens,
            "attn_implementation": name,
        },
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return doc


def _sdpa_backend(torch, batch: int, seqlen: int) -> str:
    """The SDPA backend PyTorch picks for the Llama's attention call (a profiled causal GQA
    forward + backward of the same shape)."""
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(batch, 16, seqlen, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 4, seqlen, 64, device="cuda", dtype=torch.bfloat16)
    q.requires_grad_(True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum().backward()
        torch.cuda.synchronize()
    names = " ".join(e.key for e in prof.key_averages()).lower()
    for tag, backend in (("cudnn", "CUDNN"), ("flash", "FLASH"), ("fmha", "EFFICIENT")):
        if tag in names:
            return backend
    return "MATH or unknown"


if __name__ == "__main__":
    main()
