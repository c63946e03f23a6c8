"""nvcc compilation of generated kernels, with a cache and a ptxas resource report.

Each kernel compiles to a host shared library `<out>/<name>.so` (the device code embedded as
machine code for its target plus PTX, and the generated C launcher `<name>_check` /
`<name>_launch`), with its report `<out>/<name>.json`. Python runs kernels through that
library (`verify.launch`), so tests, benchmarks and users take one launch path. The cache
key ("stamp") is sha256 of the kernel name (which already hashes spec, sources and
generator version), the nvcc version, the flags and the rendered source; a library whose
report carries the same stamp is not rebuilt. No GPU is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flashgen.generator import paths
from flashgen.generator.families import family
from flashgen.generator.render import Renderer
from flashgen.generator.spec import FIELDS, KernelSpec, SpecError, Target
from flashgen.generator.writer import write_if_different

__all__ = [
    "CompileResult",
    "FunctionResources",
    "compile_specs",
    "nvcc_flags",
    "nvcc_version",
    "parse_ptxas",
]

LIB_SUFFIX = ".so"


@dataclass
class FunctionResources:
    """What ptxas reports for one function (bytes, except registers)."""

    name: str
    entry: bool = False
    registers: int = 0
    smem_static: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0 or self.stack_frame > 0


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> dict[str, FunctionResources]:
    """Per-function resources from `-Xptxas -v` output, in order of appearance."""
    funcs: dict[str, FunctionResources] = {}
    current: FunctionResources | None = None
    for line in text.splitlines():
        if m := _RE_ENTRY.search(line):
            current = funcs.setdefault(m.group(1), FunctionResources(m.group(1)))
            current.entry = True
        elif m := _RE_PROPS.search(line):
            current = funcs.setdefault(m.group(1), FunctionResources(m.group(1)))
        elif (m := _RE_STACK.search(line)) and current is not None:
            current.stack_frame, current.spill_stores, current.spill_loads = (
                int(g) for g in m.groups()
            )
        elif (m := _RE_USED.search(line)) and current is not None:
            current.registers = int(m.group(1))
            if s := _RE_SMEM.search(line):
                current.smem_static = int(s.group(1))
    return funcs


def nvcc_version(nvcc: str = "nvcc") -> str:
    """The last line of `nvcc --version` (e.g. "Build cuda_13.0.r13.0/compiler.36424714_0")."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown"


def nvcc_flags(target: Target) -> list[str]:
    """Flags of every kernel compile (besides -o and the source)."""
    return [
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-O3",
        "-std=c++17",
        "-gencode",
        target.gencode,
        "-Xptxas",
        "-v",
        "-lineinfo",
    ]


@dataclass
class CompileResult:
    """One kernel's compile outcome and resource report (`<out>/<name>.json`)."""

    kernel: str
    arch: str
    allow_spills: bool
    cached: bool = False
    ok: bool = True
    error: str = ""
    registers: int = 0
    smem_static: int = 0
    smem_dynamic: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    functions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0 or self.stack_frame > 0

    @property
    def spill_error(self) -> bool:
        """Spills that the spec does not allow."""
        return self.ok and self.spills and not self.allow_spills


def _report(result: CompileResult, stamp: str, command: Sequence[str], nvcc: str) -> bytes:
    doc = {
        "kernel": result.kernel,
        "arch": result.arch,
        "stamp": stamp,
        "nvcc": nvcc,
        "command": list(command),
        "registers": result.registers,
        "smem_static": result.smem_static,
        "smem_dynamic": result.smem_dynamic,
        "stack_frame": result.stack_frame,
        "spill_stores": result.spill_stores,
        "spill_loads": result.spill_loads,
        "spills": result.spills,
        "allow_spills": result.allow_spills,
        "functions": result.functions,
    }
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode()


def _fill(result: CompileResult, funcs: dict[str, FunctionResources]) -> None:
    result.functions = [asdict(f) for f in funcs.values()]
    entry = next((f for f in funcs.values() if f.name == f"{result.kernel}_kernel"), None)
    entry = entry or next((f for f in funcs.values() if f.entry), None)
    if entry is not None:
        result.registers = entry.registers
        result.smem_static = entry.smem_static
    # spills anywhere in the cubin count (a non-inlined device function spills for the kernel)
    result.stack_frame = max((f.stack_frame for f in funcs.values()), default=0)
    result.spill_stores = sum(f.spill_stores for f in funcs.values())
    result.spill_loads = sum(f.spill_loads for f in funcs.values())


def _from_report(result: CompileResult, doc: dict[str, Any]) -> None:
    for key in ("registers", "smem_static", "stack_frame", "spill_stores", "spill_loads"):
        setattr(result, key, int(doc.get(key, 0)))
    result.functions = list(doc.get("functions", []))


def _compile_one(
    spec: KernelSpec,
    name: str,
    src_dir: Path,
    out_dir: Path,
    target: Target,
    nvcc: str,
    version: str,
) -> CompileResult:
    result = CompileResult(
        kernel=name, arch=target.arch, allow_spills=spec.allow_spills, smem_dynamic=spec.smem_bytes
    )
    lib = out_dir / f"{name}{LIB_SUFFIX}"
    report = out_dir / f"{name}.json"
    flags = nvcc_flags(target)
    # The rendered source is part of the stamp: the name hashes the spec and the template
    # files, but a family's Python render context could change the text under the same name.
    source = (src_dir / f"{name}.cu").read_bytes()
    stamp = hashlib.sha256(
        "\0".join([name, version, *flags]).encode() + b"\0" + source
    ).hexdigest()[:16]
    command = [nvcc, *flags, "-o", str(lib.resolve()), f"{name}.cu"]
    if lib.is_file():
        try:
            doc = json.loads(report.read_text())
        except (OSError, ValueError):
            doc = {}
        if doc.get("stamp") == stamp:
            result.cached = True
            _from_report(result, doc)
            return result
    proc = subprocess.run(command, cwd=src_dir, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        result.ok = False
        result.error = text.strip() or f"nvcc exited with status {proc.returncode}"
        lib.unlink(missing_ok=True)
        return result
    _fill(result, parse_ptxas(text))
    shown = ["nvcc", *flags, "-o", f"{name}{LIB_SUFFIX}", f"{name}.cu"]
    write_if_different(report, _report(result, stamp, shown, version))
    return result


class _Progress:
    """A textual progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if self.total <= 1:
            return
        if self.tty:
            width = 30
            filled = width * self.done // self.total
            bar = "#" * filled + "." * (width - filled)
            end = "\n" if self.done == self.total else ""
            print(f"\r{self.label} [{bar}] {self.done}/{self.total}", end=end, file=sys.stderr)
        else:
            print(f"{self.label} [{self.done}/{self.total}] {what}", file=sys.stderr)
        sys.stderr.flush()


def retarget(specs: Sequence[KernelSpec], arch: Target) -> list[KernelSpec]:
    """The specs built for another target: new specs (so new names, never another kernel's
    cache entry), validated against that target's limits (SpecError naming the kernel). An
    auto tile is chosen again for the new target; an explicit one is kept (and refused when
    it does not fit). Kernels of an architecture-specific target (sm_90a) have no build for
    another target and are left out."""
    out = []
    for s in specs:
        if s.target.value.suffix and s.target is not arch:
            continue
        try:
            tile = s.tile
            if s.tile_auto:
                values = {f.path: f.get(s) for f in FIELDS} | {"target": arch}
                tile = family(s.kernel, arch).auto_tile_of(values)
            out.append(s.replace(target=arch, tile=tile))
        except SpecError as e:
            raise SpecError(
                f"cannot build for {arch.yaml}: {e.message}",
                file=s.source_file or None,
                field=e.field,
            ) from None
    return out


def library_path(name: str, out_dir: Path | str | None = None) -> Path:
    """Where `compile_specs` puts the kernel's host library."""
    return Path(out_dir or paths.build_dir()) / f"{name}{LIB_SUFFIX}"


def compile_specs(
    specs: Sequence[KernelSpec],
    out_dir: Path | str | None = None,
    *,
    arch: Target | None = None,
    jobs: int | None = None,
    templates_dir: Path | str | None = None,
    nvcc: str = "nvcc",
    progress: bool = True,
    on_result: Callable[[CompileResult], None] | None = None,
) -> list[CompileResult]:
    """Render `specs` into `<out_dir>/src/`, compile each to `<out_dir>/<name>.so` in parallel.

    `arch` retargets every spec (`retarget`). Results come back in the order of `specs`.
    Raises FileNotFoundError when nvcc is missing.
    """
    if shutil.which(nvcc) is None:
        raise FileNotFoundError(f"{nvcc} not found on PATH")
    if arch is not None:
        # Two specs can become one (sm_89 and sm_90 with one explicit tile): build it once.
        specs = list(dict.fromkeys(retarget(specs, arch)))
    out_dir = Path(out_dir or paths.build_dir())
    src_dir = out_dir / "src"
    renderer = Renderer(templates_dir)
    rendered = [renderer.render(s) for s in specs]
    for rel, data in renderer.include_files().items():
        write_if_different(src_dir / rel, data)
    for r in rendered:
        for rel, data in r.files.items():
            write_if_different(src_dir / rel, data)
    version = nvcc_version(nvcc)
    jobs = max(1, jobs or os.cpu_count() or 1)
    bar = _Progress(len(rendered), "compile") if progress else None
    results: dict[str, CompileResult] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {
            pool.submit(
                _compile_one, r.spec, r.name, src_dir, out_dir, r.spec.target, nvcc, version
            ): r.name
            for r in rendered
        }
        for fut in as_completed(futures):
            res = fut.result()
            results[res.kernel] = res
            if bar is not None:
                bar.step(res.kernel)
            if on_result is not None:
                on_result(res)
    return [results[r.name] for r in rendered]
