"""Kernel names: readable parts plus a hash of everything that determines the generated code.

`fa_fwd_d128_bf16_causalbr_m128n64w4s2_sm90_1a2b3c4d`: kind, head dim, dtype, the features
that are on (causal short, `win`, `varlen`, `gqa`, `drop`, `dropdbg`, `sparse`, `io`), tile,
target, then 8 hex digits of sha256(canonical spec JSON with sorted keys, the bytes of every
file under `templates/` in sorted relative-path order, the generator version). Any template
edit therefore renames every kernel; the same string names the files, the exported symbols
(`<name>_kernel`, `<name>_launch`), the compile cache entry and the verification record.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from generator import __version__
from generator.spec import KernelSpec

__all__ = ["TEMPLATES_DIR", "REPO_ROOT", "kernel_name", "spec_hash", "templates_digest"]

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "templates"

_digest_cache: dict[tuple, bytes] = {}


def _ignored(rel: Path) -> bool:
    """Editor/OS droppings that are not templates: hidden files and __pycache__."""
    return any(part.startswith(".") or part == "__pycache__" for part in rel.parts)


def templates_digest(templates_dir: Path | None = None) -> bytes:
    """sha256 over (relative path, bytes) of every file under `templates_dir`, sorted by path.

    Cached on the (path, size, mtime) listing, so an edited template is rehashed.
    """
    root = Path(templates_dir or TEMPLATES_DIR).resolve()
    files = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*")
        if p.is_file() and not _ignored(p.relative_to(root))
    )
    key_parts = []
    for rel, p in files:
        st = p.stat()
        key_parts.append((rel, st.st_size, st.st_mtime_ns))
    key = (str(root), tuple(key_parts))
    cached = _digest_cache.get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for rel, p in files:
        data = p.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    digest = h.digest()
    _digest_cache[key] = digest
    return digest


def spec_hash(spec: KernelSpec, templates_dir: Path | None = None) -> str:
    """8 hex digits identifying (canonical spec, templates, generator version)."""
    h = hashlib.sha256()
    h.update(json.dumps(spec.to_canonical(), sort_keys=True, separators=(",", ":")).encode())
    h.update(b"\0")
    h.update(templates_digest(templates_dir))
    h.update(b"\0")
    h.update(__version__.encode())
    return h.hexdigest()[:8]


def readable_parts(spec: KernelSpec) -> list[str]:
    """The name without its hash, as a list of parts."""
    parts = ["fa", spec.kernel.short, f"d{spec.head_dim}", spec.dtype.short]
    features = [
        spec.mask.causal.short,
        "win" if spec.mask.window else "",
        "varlen" if spec.mask.varlen else "",
        "gqa" if spec.gqa else "",
        "drop" if spec.dropout else "",
        "dropdbg" if spec.debug_keep_mask else "",
        spec.sparsity.short,
        "io" if spec.instrument_io else "",
    ]
    parts += [f for f in features if f]
    parts += [spec.tile.short, spec.target.short]
    return parts


def kernel_name(spec: KernelSpec, templates_dir: Path | None = None) -> str:
    """The kernel's identity, e.g. `fa_fwd_d128_bf16_causalbr_m128n64w4s2_sm90_1a2b3c4d`."""
    return "_".join(readable_parts(spec) + [spec_hash(spec, templates_dir)])
