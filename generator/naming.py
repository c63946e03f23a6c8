"""Kernel names: readable parts plus a hash of exactly what determines the generated code.

`fa_fwd_d128_bf16_causalbr_m128n64w4s2_sm90_1a2b3c4d`: the name part of every spec field
that has one, in `spec.FIELDS` order (kind, head dim, dtype, features that are on, tile,
target), then 8 hex digits of sha256 over

- the canonical spec (JSON, sorted keys),
- the generator version,
- the family's render context (`Family.config(spec)`, the constants the templates see as
  `cfg`, JSON with sorted keys), so a change to a family's Python rules renames exactly
  the kernels whose generated code it can change,
- the bytes of the kernel's family templates (`templates/<family>/`), of the shared Jinja
  files they import (`templates/common/`) and of every header they include, transitively
  (`#include "include/flashgen/X"` in a template, `#include "X"` in a header), in sorted
  path order.

So editing a backward-only header renames backward kernels and leaves forward names (and
their verification records) alone, while a shared header renames every family that
includes it. The same string names the files, the exported symbols (`<name>_kernel`,
`<name>_launch`), the compile cache entry and the verification record.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from flashgen.generator import __version__
from flashgen.generator.families import family
from flashgen.generator.paths import PACKAGE_ROOT, TEMPLATES_DIR
from flashgen.generator.spec import FIELDS, KernelSpec

__all__ = [
    "PACKAGE_ROOT",
    "TEMPLATES_DIR",
    "INCLUDE_SUBDIR",
    "kernel_name",
    "kernel_sources",
    "readable_parts",
    "spec_hash",
]

INCLUDE_SUBDIR = Path("include") / "flashgen"

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_JINJA_RE = re.compile(r'{%-?\s*(?:include|import|from|extends)\s+"([^"]+)"')
_sources_cache: dict[tuple, tuple[tuple[str, bytes], ...]] = {}


def ignored(rel: Path) -> bool:
    """Editor/OS droppings that are not templates: hidden files and __pycache__."""
    return any(part.startswith(".") or part == "__pycache__" for part in rel.parts)


def _stat_key(paths: list[Path]) -> tuple:
    out = []
    for p in paths:
        try:
            st = p.stat()
            out.append((str(p), st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((str(p), -1, -1))
    return tuple(out)


def kernel_sources(spec: KernelSpec, templates_dir: Path | None = None) -> list[tuple[str, bytes]]:
    """(path relative to the templates dir, bytes) of every file the kernel's code comes
    from: its family's templates and the transitive closure of the headers they include."""
    root = Path(templates_dir or TEMPLATES_DIR).resolve()
    fam = family(spec)
    folder = root / fam.templates
    tmpl = (
        sorted(p for p in folder.rglob("*") if p.is_file() and not ignored(p.relative_to(root)))
        if folder.is_dir()
        else []
    )
    # Cached on the listing of every file under the templates root (family folders, shared
    # Jinja macros, headers), so an edit anywhere is seen by a long-lived process.
    everything = sorted(
        p for p in root.rglob("*") if p.is_file() and not ignored(p.relative_to(root))
    )
    key = (str(root), fam.templates, _stat_key(everything))
    cached = _sources_cache.get(key)
    if cached is not None:
        return list(cached)
    found: dict[str, bytes] = {}
    include_root = root / INCLUDE_SUBDIR
    pending = list(tmpl)
    while pending:
        path = pending.pop()
        rel = path.relative_to(root).as_posix()
        if rel in found:
            continue
        data = path.read_bytes()
        found[rel] = data
        text = data.decode("utf-8", "replace")
        for inc in _JINJA_RE.findall(text):  # a shared Jinja macro file (templates/common/)
            if (root / inc).is_file():
                pending.append((root / inc).resolve())
        for inc in _INCLUDE_RE.findall(text):
            if inc.startswith("include/flashgen/"):
                target = root / inc
            else:  # a header including a sibling header
                target = (path.parent / inc) if path.is_relative_to(include_root) else None
            if target is not None and target.is_file():
                pending.append(target.resolve())
    out = tuple(sorted(found.items()))
    _sources_cache[key] = out
    return list(out)


def spec_hash(spec: KernelSpec, templates_dir: Path | None = None) -> str:
    """8 hex digits identifying (canonical spec, generator version, render context, kernel
    sources)."""
    h = hashlib.sha256()
    h.update(json.dumps(spec.to_canonical(), sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    h.update(__version__.encode())
    h.update(b"\0")
    h.update(json.dumps(family(spec).config(spec), sort_keys=True, default=str).encode())
    for rel, data in kernel_sources(spec, templates_dir):
        h.update(f"\0{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:8]


def readable_parts(spec: KernelSpec) -> list[str]:
    """The name without its hash, as a list of parts."""
    parts = ["fa"]
    for f in FIELDS:
        if f.part is not None:
            part = f.part(f.get(spec))
            if part:
                parts.append(part)
    return parts


def kernel_name(spec: KernelSpec, templates_dir: Path | None = None) -> str:
    """The kernel's identity, e.g. `fa_fwd_d128_bf16_causalbr_m128n64w4s2_sm90_1a2b3c4d`."""
    return "_".join(readable_parts(spec) + [spec_hash(spec, templates_dir)])
