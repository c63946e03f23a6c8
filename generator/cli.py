"""`flashgen` command line: generate, show, compile, verify, bench."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
from flashgen.generator import __version__
from flashgen.generator.families import family
from flashgen.generator.load import TooManyKernels, expand_paths, load_paths
from flashgen.generator.naming import kernel_name
from flashgen.generator.paths import checkout_root
from flashgen.generator.spec import FIELDS, KernelKind, KernelSpec, SpecError, Target

if TYPE_CHECKING:
    from flashgen.generator.writer import Plan

__all__ = ["main"]

DEFAULT_GENERATED = Path("generated")
DEFAULT_MAX_KERNELS = 512
# `flashgen show`'s shape: a prefill-sized call, or for decode one new query over a 4k cache
# (decode takes 1..16 new queries).
DEFAULT_SEQLEN = 4096
DEFAULT_DECODE_SEQLEN_Q = 1


class UsageError(Exception):
    """A bad command line (output path, kernel cap): `main` prints it as one error line."""


def _err(msg: str) -> None:
    print(f"flashgen: error: {msg}", file=sys.stderr)


def _os_message(e: OSError) -> str:
    """`path: reason` of an OSError, without the errno noise."""
    reason = e.strerror or str(e)
    return f"{e.filename}: {reason}" if e.filename else reason


# --------------------------------------------------------------------------------------------
# Checks shared by generate and compile (before anything is written)
# --------------------------------------------------------------------------------------------


def _load(paths: Sequence[str | Path], limit: int, command: str) -> list[KernelSpec]:
    """`load_paths`, refusing more than `limit` kernels (0: no limit) before any family is
    expanded (a family of 200k kernels is refused at once)."""
    try:
        return load_paths(paths, max_kernels=limit)
    except TooManyKernels as e:
        per_file = sorted(e.per_file, key=lambda fn: -fn[1])
        raise _too_many([(f, n) for f, n in per_file if n], e.total, limit, command) from None


def _check_kernel_count(specs: Sequence[KernelSpec], limit: int, command: str) -> None:
    """Refuse more than `limit` kernels (0: no limit), naming the spec files that declare them."""
    if not limit or len(specs) <= limit:
        return
    per_file = Counter(s.source_file or "<unknown>" for s in specs).most_common()
    raise _too_many(per_file, len(specs), limit, command)


def _too_many(per_file: list[tuple[str, int]], total: int, limit: int, command: str) -> UsageError:
    if len(per_file) == 1:
        shown, verb = per_file[0][0], "declares"
    else:
        shown, verb = ", ".join(f"{f} ({n})" for f, n in per_file[:3]), "declare"
        if len(per_file) > 3:
            shown += f" and {len(per_file) - 3} more file(s)"
    return UsageError(
        f"{shown} {verb} {total} kernels, more than --max-kernels {limit}; narrow the "
        f"spec family, or pass --max-kernels {total} (0: no limit) to {command} them all"
    )


def _existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing ancestor."""
    p = path
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    return p


def _output_dir_problem(path: Path, *, write: bool) -> str | None:
    """Why `path` cannot be used (created if need be) as an output directory, else None."""
    base = _existing_ancestor(path)
    if not os.path.lexists(base):
        return None
    if not base.is_dir():
        if base == path:
            return f"{path}: exists and is not a directory"
        return f"{path}: {base} exists and is not a directory"
    if write and not os.access(base, os.W_OK | os.X_OK):
        if base == path:
            return f"{path}: directory is not writable"
        return f"{path}: cannot be created, {base} is not writable"
    return None


def _check_output_dirs(dirs: Sequence[Path], flag: str, *, write: bool = True) -> None:
    for d in dict.fromkeys(dirs):
        problem = _output_dir_problem(d, write=write)
        if problem is not None:
            raise UsageError(f"{flag} {problem}" if flag else f"cannot write into {problem}")


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------


KERNEL_TABLE_DOC = Path("docs") / "kernels.md"


def _default_readme(outdir: Path) -> Path | None:
    """The repo's kernel table (docs/kernels.md) is kept in sync only when generating into the
    repo's `generated/`."""
    root = checkout_root()
    if root is None:
        return None
    readme = root / KERNEL_TABLE_DOC
    if outdir.resolve() == (root / "generated").resolve() and readme.is_file():
        return readme
    return None


def _generate_command(args: argparse.Namespace) -> str:
    """The `flashgen generate` command line that rewrites what `--check` found out of date."""
    cmd = ["flashgen", "generate", *map(str, args.specs)]
    if args.output != str(DEFAULT_GENERATED):
        cmd += ["-o", str(args.output)]
    if args.templates:
        cmd += ["--templates", str(args.templates)]
    if args.readme:
        cmd += ["--readme", str(args.readme)]
    if args.no_readme:
        cmd.append("--no-readme")
    if args.max_kernels != DEFAULT_MAX_KERNELS:
        cmd += ["--max-kernels", str(args.max_kernels)]
    return shlex.join(cmd)


def _changed_paths(plan: Plan) -> list[Path]:
    """The files `apply_plan` would write or remove."""
    out = []
    for path, data in plan.writes.items():
        try:
            if path.read_bytes() == data:
                continue
        except OSError:
            pass
        out.append(path)
    return out + [p for p in plan.removals if os.path.lexists(p)]


def _waiting(outdir: Path) -> None:
    print(
        f"flashgen: waiting for another flashgen generate writing into {outdir}",
        file=sys.stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from flashgen.generator.writer import output_lock, plan_generate

    files = expand_paths(args.specs)
    specs = _load(files, args.max_kernels, "generate")
    outdir = Path(args.output)
    _check_output_dirs([outdir], "-o", write=False)  # writability: per changed file, below
    readme = Path(args.readme) if args.readme else _default_readme(outdir)
    if args.no_readme:
        readme = None

    def plan() -> Plan:
        made = plan_generate(
            specs, outdir, spec_files=files, readme=readme, templates_dir=args.templates
        )
        for w in made.warnings:
            print(f"flashgen: warning: {w}", file=sys.stderr)
        return made

    # The plan reads the previous manifest and the folder, so it is made under the folder's
    # lock (shared for --check): runs into one folder take turns instead of interleaving.
    if args.check:
        with output_lock(outdir, shared=True, on_wait=lambda: _waiting(outdir)):
            return _check_generated(plan(), args)
    if os.path.isdir(outdir):
        with output_lock(outdir, on_wait=lambda: _waiting(outdir)):
            return _apply_generated(plan(), outdir)
    # A new folder: render everything first (an invalid spec creates nothing), then create
    # the folder, lock it, and plan again if another run wrote into it meanwhile.
    first = plan()
    _check_output_dirs([outdir], "-o")
    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _err(f"cannot create the output directory: {_os_message(e)}")
        return 1
    try:
        with output_lock(outdir, on_wait=lambda: _waiting(outdir)):
            return _apply_generated(first if not any(outdir.iterdir()) else plan(), outdir)
    finally:
        try:
            outdir.rmdir()  # only if nothing was written into it (interrupted, failed)
        except OSError:
            pass


def _check_generated(plan: Plan, args: argparse.Namespace) -> int:
    from flashgen.generator.writer import check_plan

    diffs = check_plan(plan)
    if diffs:
        sys.stdout.write("".join(diffs))
        _err(f"{len(diffs)} generated file(s) out of date; run: {_generate_command(args)}")
        return 1
    print(f"{len(plan.entries)} kernels up to date in {plan.outdir}")
    return 0


def _apply_generated(plan: Plan, outdir: Path) -> int:
    from flashgen.generator.writer import apply_plan

    # Every directory that a changed file goes into must be writable before the first write.
    _check_output_dirs([p.parent for p in _changed_paths(plan)], "")
    try:
        changed = apply_plan(plan)
    except OSError as e:
        _err(f"writing the generated files failed: {_os_message(e)}")
        return 1
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
        if f.path in ("kernel", "dtype", "head_dim", "head_dim_v", "target")
        and f.get(spec) is not None  # head_dim_v only when the spec has one
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
    seqlen_q, seqlen_k = _show_seqlens(spec, args)
    shape = dict(batch=args.batch, heads=args.heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
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


def _show_seqlens(spec: KernelSpec, args: argparse.Namespace) -> tuple[int, int]:
    """(seqlen_q, seqlen_k) of `show`'s call: the options, else the kind's defaults (decode:
    one new query over a cache of DEFAULT_SEQLEN keys; otherwise seqlen_k = seqlen_q)."""
    decode = spec.kernel is KernelKind.DECODE
    seqlen_q = args.seqlen_q
    if seqlen_q is None:
        seqlen_q = DEFAULT_DECODE_SEQLEN_Q if decode else DEFAULT_SEQLEN
    seqlen_k = args.seqlen_k
    if seqlen_k is None:
        seqlen_k = DEFAULT_SEQLEN if decode else seqlen_q
    return seqlen_q, seqlen_k


def _check_show_shape(args: argparse.Namespace, specs: Sequence[KernelSpec]) -> None:
    """Shape options that depend on each other or on the spec (argparse-style errors)."""
    parser: argparse.ArgumentParser = args.parser
    if args.kv_heads is None:
        return
    if args.heads % args.kv_heads:
        divisors = ", ".join(str(k) for k in range(1, args.heads + 1) if args.heads % k == 0)
        parser.error(
            f"argument --kv-heads: must divide --heads {args.heads} "
            f"(allowed: {divisors}), got {args.kv_heads}"
        )
    for spec in specs:
        if not spec.gqa and args.kv_heads != args.heads:
            parser.error(
                f"argument --kv-heads: {kernel_name(spec)} ({spec.source}) has gqa: false, so "
                f"--kv-heads must equal --heads ({args.heads}), got {args.kv_heads}"
            )


def cmd_show(args: argparse.Namespace) -> int:
    specs = _load([args.spec], 0, "show")
    _check_show_shape(args, specs)
    for i, spec in enumerate(specs):
        if i:
            print()
        print("\n".join(_describe(spec) + _io_lines(spec, args)))
    return 0


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------


def cmd_compile(args: argparse.Namespace) -> int:
    from flashgen.generator.compile import compile_specs, retarget

    arch = Target.from_yaml(args.arch) if args.arch else None
    # With --arch the count is checked after retargeting (which leaves sm_90a kernels out).
    specs = _load(args.specs, 0 if arch else args.max_kernels, "compile")
    if arch is not None:  # refused here (SpecError) before nvcc is looked for or a file written
        built = retarget(specs, arch)
        left_out = len(specs) - len(built)  # architecture-specific kernels (sm_90a)
        if left_out:
            print(
                f"flashgen compile: left out {left_out} kernel(s) of an architecture-specific "
                f"target: they have no {arch.yaml} build",
                file=sys.stderr,
            )
            if not built:
                raise SpecError(f"nothing to build for {arch.yaml}")
        specs = built
    _check_kernel_count(specs, args.max_kernels, "compile")
    out = Path(args.output)
    _check_output_dirs([out, out / "src"], "-o")
    try:
        results = compile_specs(
            specs,
            out,
            arch=arch,
            jobs=args.jobs,
            templates_dir=args.templates,
            nvcc=args.nvcc,
        )
    except OSError as e:  # nvcc not found, or a file that cannot be written
        _err(str(e) if e.errno is None else _os_message(e))
        return 1
    rows = [("kernel", "arch", "regs", "smem static+dyn", "stack", "spill st/ld", "")]
    for r in results:
        state = "FAILED" if not r.ok else ("SPILLS" if r.spill_error else "ok")
        if r.ok and r.spills and r.allow_spills:
            state = "spills (allowed)"
        elif r.spill_error and args.accept_spills:
            state = "spills (accepted)"
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
    spilled = [r for r in results if r.spill_error and not args.accept_spills]
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


def _int_at_least(low: int, *, unbounded: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer >= `low` (or exactly `unbounded`, e.g. -1)."""
    allowed = f"an integer >= {low}" + (
        f", or {unbounded} for unbounded" if unbounded is not None else ""
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low and value != unbounded:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def _add_max_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-kernels",
        type=_int_at_least(0),
        default=DEFAULT_MAX_KERNELS,
        metavar="N",
        help=f"refuse spec families of more than N kernels (default {DEFAULT_MAX_KERNELS}; "
        "0: no limit)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashgen",
        description="Generate specialised CUDA FlashAttention kernels from YAML specs.",
    )
    p.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate", help="render kernels (.cu + .h), manifest.json and the kernel table"
    )
    g.add_argument("specs", nargs="+", metavar="SPEC_OR_DIR", help="spec files or directories")
    g.add_argument("-o", "--output", default=str(DEFAULT_GENERATED), help="default: generated/")
    g.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a diff if out of date"
    )
    g.add_argument(
        "--readme",
        metavar="MARKDOWN",
        help="Markdown file whose kernel table (between the kernels:begin/end markers) to "
        f"rewrite (default: the repo's {KERNEL_TABLE_DOC.as_posix()}, when writing to the "
        "repo's generated/)",
    )
    g.add_argument("--no-readme", action="store_true", help="rewrite no kernel table")
    g.add_argument("--templates", help="template directory (default: the repo's templates/)")
    _add_max_kernels(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("show", help="resolved spec(s), tile, smem, name, predicted HBM bytes")
    s.add_argument("spec", metavar="SPEC")
    s.add_argument("--batch", type=_int_at_least(1), default=1)
    s.add_argument("--heads", type=_int_at_least(1), default=16)
    s.add_argument(
        "--kv-heads",
        type=_int_at_least(1),
        default=None,
        help="default: --heads; must divide it (other values need a gqa: true spec)",
    )
    s.add_argument(
        "--seqlen-q",
        type=_int_at_least(0),
        default=None,
        help=f"default: {DEFAULT_SEQLEN} (decode: {DEFAULT_DECODE_SEQLEN_Q})",
    )
    s.add_argument(
        "--seqlen-k",
        type=_int_at_least(0),
        default=None,
        help=f"default: --seqlen-q (decode: {DEFAULT_SEQLEN}, the cache length)",
    )
    s.add_argument("--window-left", type=_int_at_least(0, unbounded=-1), default=None)
    s.add_argument("--window-right", type=_int_at_least(0, unbounded=-1), default=None)
    s.set_defaults(func=cmd_show, parser=s)

    c = sub.add_parser(
        "compile",
        help="nvcc each kernel into a host library <name>.so and report its resources",
    )
    c.add_argument("specs", nargs="+", metavar="SPEC_OR_DIR")
    c.add_argument("--arch", choices=Target.allowed(), help="default: each spec's target")
    c.add_argument(
        "-j", "--jobs", type=_int_at_least(1), default=None, metavar="N", help="default: CPU count"
    )
    c.add_argument("-o", "--output", default="build/kernels", help="default: build/kernels")
    c.add_argument("--templates", help="template directory (default: the repo's templates/)")
    c.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="default: $NVCC or nvcc")
    c.add_argument(
        "--accept-spills",
        action="store_true",
        help="report spills without failing (prebuilding the kernels flashgen.torch derives: "
        "their specs never say allow_spills, which would change the kernel's name)",
    )
    _add_max_kernels(c)
    c.set_defaults(func=cmd_compile)

    for which, help_ in (
        ("verify", "run the GPU verification suite on the compiled kernels (needs a GPU)"),
        ("bench", "benchmark the forward kernels against SDPA (needs a GPU)"),
    ):
        sub.add_parser(which, help=f"{help_}; `flashgen {which} --help`", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("verify", "bench"):
        return _dispatch_gpu(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, UsageError) as e:
        _err(str(e))
        return 2
    except jinja2.TemplateError as e:
        where = f"{e.filename}:{e.lineno}: " if getattr(e, "filename", None) else ""
        _err(f"rendering failed: {where}{type(e).__name__}: {e}")
        return 1
    except BrokenPipeError:  # e.g. `flashgen show ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # generate: the folder is as it was, or complete (writer.py)
        _err("interrupted")
        return 130
    except OSError as e:  # a file or folder that cannot be read or written: one line
        _err(_os_message(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
