"""Writing generated files: plan in memory, then write atomically and only what changed.

`plan_generate` renders every kernel, the include headers, `manifest.json` and the kernel
table of a Markdown file (docs/kernels.md, between its markers) into memory (any error:
nothing is written). `apply_plan` stages every changed file as a temp file beside its
destination, then renames them all into place and removes stale generated files with
SIGINT/SIGTERM held back, so an error or an interrupt leaves the folder as it was or
complete, and no temp file behind; `check_plan` compares the plan with the disk and returns
unified diffs instead (for `flashgen generate --check`). `output_lock` is the
advisory lock on the output folder that `flashgen generate` plans and applies under.

The output directory is a product of the specs: a kernel in the previous manifest is kept only
while its spec file still exists and was not among the files just processed (so
`flashgen generate specs/one.yaml` leaves the kernels of other spec files alone, and a kernel
removed from a processed spec file disappears).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import secrets
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashgen.generator import __version__, paths
from flashgen.generator.families import family
from flashgen.generator.features import SCORE_PARAMS_HEADER, render_score_params_h
from flashgen.generator.load import display_path
from flashgen.generator.render import BANNER_MARK, Renderer
from flashgen.generator.spec import FEATURE_FIELDS, FIELDS, FieldKind, KernelSpec, SpecError

__all__ = [
    "MANIFEST_NAME",
    "README_BEGIN",
    "README_END",
    "Plan",
    "apply_plan",
    "check_plan",
    "manifest_entry",
    "output_lock",
    "plan_generate",
    "readme_table",
    "replace_readme_table",
    "verification_status",
    "write_if_different",
]

MANIFEST_NAME = "manifest.json"
README_BEGIN = "<!-- kernels:begin -->"
README_END = "<!-- kernels:end -->"
# Staged files are `.<name>.<random>.flashgen-tmp` beside their destination; one left by a
# killed run (SIGKILL) is removed as stale by the next `generate` into that folder.
TEMP_SUFFIX = ".flashgen-tmp"


# --------------------------------------------------------------------------------------------
# Manifest and verification status.
# --------------------------------------------------------------------------------------------


def verification_status(name: str, records_dir: Path | str | None = None) -> str:
    """ "verified (<gpu>, <date>)", "failed" or "unverified", from `<records_dir>/<name>.json`."""
    path = Path(records_dir or paths.records_dir()) / f"{name}.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unverified"
    if not isinstance(record, dict) or record.get("kernel", name) != name:
        return "unverified"
    if record.get("passed") is True:
        return f"verified ({record.get('gpu', '?')}, {record.get('date', '?')})"
    return "failed"


def manifest_entry(spec: KernelSpec, name: str, status: str) -> dict[str, Any]:
    """One kernel's manifest entry."""
    return {
        "name": name,
        "spec": spec.to_canonical(),
        "source": spec.source_file,
        "hash": name.rsplit("_", 1)[-1],
        "entry_points": family(spec).entry_points(name),
        "launch": family(spec).launch_info(spec),
        "smem_bytes": spec.smem_bytes,
        "status": status,
    }


def _manifest_bytes(entries: Sequence[dict[str, Any]], includes: Sequence[str]) -> bytes:
    doc = {
        "generator_version": __version__,
        "include_files": sorted(includes),
        "kernels": sorted(entries, key=lambda e: e["name"]),
    }
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("kernels"), list) else None


# --------------------------------------------------------------------------------------------
# README table.
# --------------------------------------------------------------------------------------------


def spec_summary(canonical: dict[str, Any]) -> dict[str, str]:
    """Mask, features and tile of a canonical spec as short phrases (README table, `show`),
    derived from spec.FIELDS."""
    m, t = canonical["mask"], canonical["tile"]
    mask = [f"causal {m['causal']}"] if m["causal"] != "none" else []
    mask += [f.feature for f in FIELDS if f.top == "mask" and f.feature and m.get(f.sub)]
    feats = []
    for f in FEATURE_FIELDS:
        value = canonical.get(f.path)
        if f.path == "sparsity":
            if value not in (None, "none"):
                feats.append(f"{value} sparse")
        elif f.path != "allow_spills" and value is True:
            feats.append(f.feature)
        elif f.kind is FieldKind.EXPR and value is not None:  # score_mod, mask_mod
            feats.append(f.feature)
    tile = f"{t['block_m']}x{t['block_n']}, {t['warps']} warps, {t['stages']} stages"
    if canonical.get("tile_auto"):
        tile += " (auto)"
    return {
        "mask": ", ".join(mask) or "none",
        "features": ", ".join(feats) or "-",
        "tile": tile,
    }


def _dims(canonical: dict[str, Any]) -> str:
    """The table's d column: `d`, or `d / d_v` for a spec with head_dim_v."""
    d_v = canonical.get("head_dim_v")
    return f"{canonical['head_dim']}" if d_v is None else f"{canonical['head_dim']} / {d_v}"


def readme_table(entries: Sequence[dict[str, Any]]) -> str:
    """Markdown table of shipped kernels (name, kind, dtype, d, mask, features, tile,
    target, status)."""
    lines = [
        "| kernel | kind | dtype | d | mask | features | tile | target | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in sorted(entries, key=lambda e: e["name"]):
        s = e["spec"]
        summary = spec_summary(s)
        lines.append(
            f"| `{e['name']}` | {s.get('kernel', 'forward')} | {s['dtype']} | {_dims(s)} "
            f"| {summary['mask']} | {summary['features']} | {summary['tile']} "
            f"| {s['target']} | {e['status']} |"
        )
    if not entries:
        lines.append("| (none) | | | | | | | | |")
    return "\n".join(lines) + "\n"


def replace_readme_table(text: str, entries: Sequence[dict[str, Any]]) -> str | None:
    """`text` with the block between the kernel markers replaced; None if markers are absent."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        return None
    head = text[: begin + len(README_BEGIN)]
    return head + "\n" + readme_table(entries) + text[end:]


# --------------------------------------------------------------------------------------------
# Planning.
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Everything `generate` would do: files with their content, files to remove."""

    outdir: Path
    writes: dict[Path, bytes] = field(default_factory=dict)
    removals: list[Path] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return sorted(e["name"] for e in self.entries)


def _source_exists(source: str) -> bool:
    root = paths.checkout_root()
    return bool(source) and (
        (root is not None and (root / source).is_file()) or Path(source).is_file()
    )


def _stale_temp_files(folder: Path) -> Iterator[Path]:
    for p in folder.iterdir():
        if p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX) and p.is_file():
            yield p


def _is_generated(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return BANNER_MARK.encode() in head


def plan_generate(
    specs: Iterable[KernelSpec],
    outdir: Path | str = "generated",
    *,
    spec_files: Iterable[str | Path] | None = None,
    templates_dir: Path | str | None = None,
    records_dir: Path | str | None = None,
    readme: Path | str | None = None,
) -> Plan:
    """Render all `specs` into memory and work out the writes and removals under `outdir`.

    `spec_files`: the spec files processed (default: the specs' sources); previous manifest
    entries from other, still existing spec files are kept. `readme`: a README whose
    kernel-table markers are rewritten (None: leave READMEs alone). Raises SpecError or
    jinja2 errors before anything is written.
    """
    outdir = Path(outdir)
    specs = list(specs)
    renderer = Renderer(templates_dir)
    plan = Plan(outdir=outdir)

    processed = {display_path(p) for p in spec_files} if spec_files is not None else set()
    processed |= {s.source_file for s in specs}

    by_name: dict[str, str] = {}  # kernel name -> where it is declared
    for spec in specs:
        rendered = renderer.render(spec)
        if rendered.name in by_name:
            raise SpecError(
                f"kernel {rendered.name} is declared twice (also at {by_name[rendered.name]})",
                file=spec.source_file or None,
            )
        by_name[rendered.name] = spec.source
        for rel, data in rendered.files.items():
            plan.writes[outdir / rel] = data
        plan.entries.append(
            manifest_entry(spec, rendered.name, verification_status(rendered.name, records_dir))
        )

    includes = renderer.include_files()
    # score_params.h is rendered from the feature registry (generator/features/): its template
    # copy is brought up to date (so kernel names hash the current struct) and vendored.
    score_h = render_score_params_h().encode("utf-8")
    # (only the project's own templates: another templates folder is the caller's, and its
    # kernels vendor the rendered header all the same)
    source_h = renderer.templates_dir / SCORE_PARAMS_HEADER
    own = renderer.templates_dir == paths.TEMPLATES_DIR.resolve()
    if own and (not source_h.is_file() or source_h.read_bytes() != score_h):
        plan.writes[source_h] = score_h
    includes[SCORE_PARAMS_HEADER] = score_h
    for rel, data in includes.items():
        plan.writes[outdir / rel] = data

    previous = _read_manifest(outdir / MANIFEST_NAME)
    if previous is not None:
        for e in previous["kernels"]:
            try:
                name, source = e["name"], e.get("source", "")
                kept = (
                    name not in by_name
                    and source not in processed
                    and _source_exists(source)
                    and (outdir / f"{name}.cu").is_file()
                )
            except (KeyError, TypeError):
                continue
            if kept:
                e = dict(e, status=verification_status(name, records_dir))
                plan.entries.append(e)
                by_name[name] = source  # its files stay as they are
        for rel in previous.get("include_files", []):
            if isinstance(rel, str) and rel not in includes and (outdir / rel).is_file():
                plan.removals.append(outdir / rel)

    if outdir.is_dir():
        for p in sorted(outdir.iterdir()):
            if (
                p.suffix in (".cu", ".h")
                and p.is_file()
                and p.stem not in by_name
                and _is_generated(p)
            ):
                plan.removals.append(p)
    for folder in dict.fromkeys(p.parent for p in plan.writes):
        if folder.is_dir():
            plan.removals += sorted(_stale_temp_files(folder))

    plan.writes[outdir / MANIFEST_NAME] = _manifest_bytes(plan.entries, list(includes))

    if readme is not None:
        readme = Path(readme)
        try:
            text = readme.read_text(encoding="utf-8")
        except OSError:
            plan.warnings.append(f"{display_path(readme)}: not found, kernel table not updated")
        else:
            new = replace_readme_table(text, plan.entries)
            if new is None:
                plan.warnings.append(
                    f"{display_path(readme)}: no {README_BEGIN} / {README_END} markers, "
                    "kernel table not updated"
                )
            else:
                plan.writes[readme] = new.encode("utf-8")
    return plan


# --------------------------------------------------------------------------------------------
# Applying and checking.
# --------------------------------------------------------------------------------------------


def write_if_different(path: Path, data: bytes) -> bool:
    """Atomically replace `path` with `data` unless it already holds exactly that."""
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


@contextlib.contextmanager
def output_lock(
    outdir: Path | str, *, shared: bool = False, on_wait: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold an advisory lock (flock) on the directory `outdir` itself for the block, so
    nothing is written into the folder for it: exclusive to plan and apply, `shared` to
    check. A run that finds it held calls `on_wait` once and waits its turn. No lock where
    the directory does not exist or the platform has no flock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        fd = os.open(outdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        yield  # nothing to lock, or a folder this run cannot read (its plan says so)
        return
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, mode)
        except OSError:  # a file system without locks: run unlocked
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back for the block and acted on when it ends.

    In the main thread their handlers are swapped for one that only records the signal (so
    no thread of the process acts on it meanwhile), then the original handlers run, or the
    default action is taken; elsewhere the signals are blocked for this thread."""
    wanted = [getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
    if threading.current_thread() is not threading.main_thread():
        try:
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
        except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
            yield
            return
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return
    pending: list[tuple[int, Any]] = []
    old = {sig: signal.getsignal(sig) for sig in wanted}
    for sig in wanted:
        signal.signal(sig, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum, frame in pending:
            handler = old[signum]
            if callable(handler):
                handler(signum, frame)  # e.g. KeyboardInterrupt for SIGINT
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)  # the default action, now that all is written


def _stage(path: Path, data: bytes, temps: list[Path], made_dirs: list[Path]) -> None:
    """Write `data` to a new temp file beside `path`, recorded in `temps` before it exists
    (so a cleanup never misses it); directories created on the way go to `made_dirs`."""
    missing = []
    parent = path.parent
    while not parent.exists() and parent.parent != parent:
        missing.append(parent)
        parent = parent.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        made_dirs.append(d)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    temps.append(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)  # whatever the umask


def apply_plan(plan: Plan) -> list[Path]:
    """Write changed files (manifest and README last), remove stale ones; return what changed.

    Two phases. Staging writes each changed file to a temp file beside its destination; any
    error or interrupt there removes the temp files (and the directories it created), leaving
    the disk as it was. Committing renames them into place in order and removes the stale
    files, with SIGINT/SIGTERM/SIGHUP held back until it is done: it only renames, so it is
    quick, and what it leaves is complete.
    """
    last = [p for p in plan.writes if p.name == MANIFEST_NAME or p.suffix == ".md"]
    order = [p for p in plan.writes if p not in last] + last
    todo: list[Path] = []
    for path in order:
        try:
            if path.read_bytes() == plan.writes[path]:
                continue
        except OSError:
            pass
        todo.append(path)
    temps: list[Path] = []
    made_dirs: list[Path] = []
    changed: list[Path] = []
    committed = False
    try:
        for path in todo:
            _stage(path, plan.writes[path], temps, made_dirs)
        with _signals_held():
            for path, tmp in zip(todo, temps):
                os.replace(tmp, path)
                changed.append(path)
            temps.clear()
            committed = True
            for path in plan.removals:
                try:
                    path.unlink()
                    changed.append(path)
                except FileNotFoundError:
                    pass
    finally:
        for tmp in temps:
            try:
                tmp.unlink()
            except OSError:
                pass
        if not committed:
            for d in reversed(made_dirs):
                try:
                    d.rmdir()
                except OSError:
                    pass
    return changed


def check_plan(plan: Plan) -> list[str]:
    """Unified diffs (one string per differing file) between the plan and the disk."""
    diffs: list[str] = []
    for path in sorted(plan.writes):
        want = plan.writes[path]
        try:
            have: bytes | None = path.read_bytes()
        except OSError:
            have = None
        if have == want:
            continue
        shown = display_path(path)
        old = [] if have is None else have.decode("utf-8", "replace").splitlines(keepends=True)
        new = want.decode("utf-8", "replace").splitlines(keepends=True)
        text = "".join(
            difflib.unified_diff(
                old,
                new,
                fromfile=f"a/{shown}" if have is not None else "/dev/null",
                tofile=f"b/{shown}",
            )
        )
        diffs.append(text if text.endswith("\n") else text + "\n")
    for path in plan.removals:
        if path.exists():
            diffs.append(f"stale file (would be removed): {display_path(path)}\n")
    return diffs
