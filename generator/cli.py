"""`flashgen` command line: generate, show, compile, verify, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import jinja2
from flashgen.generator import __version__
from flashgen.generator.families import family
from flashgen.generator.load import expand_paths, load_paths
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import checkout_root
from flashgen.generator.spec import FIELDS, KernelSpec, SpecError, Target

__all__ = ["main"]

DEFAULT_GENERATED = Path("generated")


def _err(msg: str) -> None:
    print(f"flashgen: error: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


def _default_readme(outdir: Path) -> Path | None:
    """The repo README is kept in sync only when generating into the repo's `generated/`."""
    root = checkout_root()
    if root is None:
        return None
    readme = root / "README.md"
    if outdir.resolve() == (root / "generated").resolve() and readme.is_file():
        return readme
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from flashgen.generator.writer import apply_plan, check_plan, plan_generate

    files = expand_paths(args.specs)
    specs = load_paths(files)
    outdir = Path(args.output)
    readme = Path(args.readme) if args.readme else _default_readme(outdir)
    if args.no_readme:
        readme = None
    plan = plan_generate(
        specs, outdir, spec_files=files, readme=readme, templates_dir=args.templates
    )
    for w in plan.warnings:
        print(f"flashgen: warning: {w}", file=sys.stderr)
    if args.check:
        diffs = check_plan(plan)
        if diffs:
            sys.stdout.write("".join(diffs))
            cmd = " ".join(["flashgen", "generate", *map(str, args.specs)])
            _err(f"{len(diffs)} generated file(s) out of date; run: {cmd}")
            return 1
        print(f"{len(plan.entries)} kernels up to date in {outdir}")
        return 0
    changed = apply_plan(plan)
    removed = sum(1 for p in changed if not p.exists())
    print(
        f"{len(plan.entries)} kernels in {outdir}: "
        f"{len(changed) - removed} file(s) written, {removed} removed"
    )
    return 0


# --------------------------------------------------------------------------------------------
# show
# --------------------------------------------------------------------------------------------


def _describe(spec: KernelSpec) -> list[str]:
    from flashgen.generator.writer import spec_summary

    name = kernel_name(spec)
    info = spec.target.info
    canonical = spec.to_canonical()
    summary = spec_summary(canonical)
    core = ", ".join(
        f"{f.path} {f.yaml_value(f.get(spec))}"
        for f in FIELDS
        if f.path in ("kernel", "dtype", "head_dim", "target")
    )
    entries = ", ".join(family(spec).entry_points(name).values())
    return [
        name,
        f"  source:     {spec.source}",
        f"  spec:       {core}",
        f"  mask:       {summary['mask']}",
        f"  features:   {summary['features']}",
        f"  tile:       {summary['tile']}",
        f"  threads:    {spec.threads}",
        f"  smem:       {spec.smem_bytes} bytes of {info.max_smem_per_block} per block",
        f"  entries:    {entries}",
    ]


def _io_lines(spec: KernelSpec, args: argparse.Namespace) -> list[str]:
    """Predicted HBM bytes of one call (verify.io_model), and the unfused baseline."""
    module, _, func = family(spec).io_model.partition(":")
    try:
        import importlib

        io_model = importlib.import_module(module)
        predict = getattr(io_model, func)
    except (ImportError, AttributeError):
        return ["  io:         io model unavailable"]
    if spec.sparse:
        return ["  io:         not predicted: block-sparse traffic depends on the runtime layout"]
    seqlen_k = args.seqlen_k or args.seqlen_q
    shape = dict(batch=args.batch, heads=args.heads, seqlen_q=args.seqlen_q, seqlen_k=seqlen_k)
    kv_heads = args.kv_heads or args.heads
    extra = {}
    if args.window_left is not None or args.window_right is not None:
        extra["window"] = (
            -1 if args.window_left is None else args.window_left,
            -1 if args.window_right is None else args.window_right,
        )
    shown = ", ".join(f"{k}={v}" for k, v in {**shape, "kv_heads": kv_heads, **extra}.items())
    out = [f"  io ({shown}), HBM bytes of one call:"]
    try:
        fb = dict(predict(spec, kv_heads=kv_heads, **shape, **extra))
    except Exception as e:  # the model is someone else's code: report, don't crash
        return [f"  io:         io model failed: {type(e).__name__}: {e}"]
    total = int(fb.pop("total", sum(int(v) for v in fb.values())))
    out += [f"    {k:<12}{int(v):>16,d}" for k, v in fb.items()]
    out.append(f"    {'total':<12}{total:>16,d}")
    try:
        std = io_model.standard_attention_bytes(**shape, d=spec.head_dim, elt=spec.dtype.nbytes)
        std_total = int(std["total"]) if isinstance(std, dict) else int(std)
        ratio = f" ({std_total / total:.1f}x this kernel)" if total else ""
        out.append(f"    {'standard':<12}{std_total:>16,d}  unfused attention{ratio}")
    except Exception as e:
        out.append(f"    standard attention model failed: {type(e).__name__}: {e}")
    return out


def cmd_show(args: argparse.Namespace) -> int:
    specs = load_paths([args.spec])
    for i, spec in enumerate(specs):
        if i:
            print()
        print("\n".join(_describe(spec) + _io_lines(spec, args)))
    return 0


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------


def cmd_compile(args: argparse.Namespace) -> int:
    from flashgen.generator.compile import compile_specs

    specs = load_paths(args.specs)
    arch = Target.from_yaml(args.arch) if args.arch else None
    try:
        results = compile_specs(
            specs,
            Path(args.output),
            arch=arch,
            jobs=args.jobs,
            templates_dir=args.templates,
            nvcc=args.nvcc,
        )
    except FileNotFoundError as e:
        _err(str(e))
        return 1
    rows = [("kernel", "arch", "regs", "smem static+dyn", "stack", "spill st/ld", "")]
    for r in results:
        state = "FAILED" if not r.ok else ("SPILLS" if r.spill_error else "ok")
        if r.ok and r.spills and r.allow_spills:
            state = "spills (allowed)"
        if r.cached and r.ok:
            state += " (cached)"
        rows.append(
            (
                r.kernel,
                r.arch,
                str(r.registers) if r.ok else "-",
                f"{r.smem_static}+{r.smem_dynamic}" if r.ok else "-",
                str(r.stack_frame) if r.ok else "-",
                f"{r.spill_stores}/{r.spill_loads}" if r.ok else "-",
                state,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    failed = [r for r in results if not r.ok]
    spilled = [r for r in results if r.spill_error]
    for r in failed:
        _err(f"nvcc failed for {r.kernel}:\n{r.error}")
    for r in spilled:
        _err(
            f"{r.kernel} spills ({r.spill_stores} bytes stores, {r.spill_loads} bytes loads, "
            f"{r.stack_frame} bytes stack); set allow_spills: true in its spec to accept"
        )
    return 1 if failed or spilled else 0


# --------------------------------------------------------------------------------------------
# verify / bench (GPU suites, written in verify/gpu_cli.py)
# --------------------------------------------------------------------------------------------


def _dispatch_gpu(which: str, argv: list[str]) -> int:
    try:
        from flashgen.verify import gpu_cli
    except ImportError as e:
        _err(f"`flashgen {which}` is unavailable: verify.gpu_cli cannot be imported ({e})")
        return 1
    fn = getattr(gpu_cli, f"{which}_main", None)
    if fn is None:
        _err(f"`flashgen {which}` is unavailable: verify.gpu_cli has no {which}_main")
        return 1
    rc = fn(argv)
    return int(rc or 0)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashgen",
        description="Generate specialised CUDA FlashAttention kernels from YAML specs.",
    )
    p.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="render kernels, manifest and README table")
    g.add_argument("specs", nargs="+", metavar="SPEC_OR_DIR", help="spec files or directories")
    g.add_argument("-o", "--output", default=str(DEFAULT_GENERATED), help="default: generated/")
    g.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a diff if out of date"
    )
    g.add_argument(
        "--readme",
        help="README whose kernel table to rewrite (default: the repo's, "
        "when writing to the repo's generated/)",
    )
    g.add_argument("--no-readme", action="store_true", help="leave READMEs alone")
    g.add_argument("--templates", help="template directory (default: the repo's templates/)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("show", help="resolved spec(s), tile, smem, name, predicted HBM bytes")
    s.add_argument("spec", metavar="SPEC")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--heads", type=int, default=16)
    s.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    s.add_argument("--seqlen-q", type=int, default=4096)
    s.add_argument("--seqlen-k", type=int, default=None, help="default: --seqlen-q")
    s.add_argument("--window-left", type=int, default=None)
    s.add_argument("--window-right", type=int, default=None)
    s.set_defaults(func=cmd_show)

    c = sub.add_parser("compile", help="nvcc each kernel to a cubin and report resources")
    c.add_argument("specs", nargs="+", metavar="SPEC_OR_DIR")
    c.add_argument("--arch", choices=Target.allowed(), help="default: each spec's target")
    c.add_argument("-j", "--jobs", type=int, default=None, help="default: CPU count")
    c.add_argument("-o", "--output", default="build/kernels", help="default: build/kernels")
    c.add_argument("--templates", help="template directory (default: the repo's templates/)")
    c.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="default: $NVCC or nvcc")
    c.set_defaults(func=cmd_compile)

    for which, help_ in (("verify", "run the GPU verification suite"), ("bench", "benchmark")):
        sub.add_parser(which, help=f"{help_} (arguments go to verify.gpu_cli)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("verify", "bench"):
        return _dispatch_gpu(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        _err(str(e))
        return 2
    except jinja2.TemplateError as e:
        where = f"{e.filename}:{e.lineno}: " if getattr(e, "filename", None) else ""
        _err(f"rendering failed: {where}{type(e).__name__}: {e}")
        return 1
    except BrokenPipeError:  # e.g. `flashgen show ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
