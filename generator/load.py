"""YAML spec files -> validated `KernelSpec`s, with errors naming file, line, field and value.

A file holds one kernel mapping, or `kernels:` (a list of mappings) with an optional
`defaults:` mapping merged under each entry. Any scalar field, `tile`, and the sub-fields of
`tile` and `mask` may be lists: the entry then declares a family, the cross product of all
lists in field order (first field varies slowest). See docs/spec.md.

`load_paths(..., max_kernels=N)` counts every family before expanding it (the product of its
list lengths), so a huge family is refused at once, not after building its members. Hostile
files end in one `SpecError` too: over `MAX_SPEC_BYTES`, nested deeper than the parser can
follow, or merge keys (`<<`) that multiply a mapping past `MAX_MAPPING_KEYS`.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from flashgen.generator.families import family
from flashgen.generator.paths import checkout_root
from flashgen.generator.spec import (
    FIELD_BY_PATH,
    FIELDS,
    REQUIRED,
    FieldKind,
    KernelKind,
    KernelSpec,
    SpecError,
    Tile,
    build_spec,
)

__all__ = [
    "MAX_MAPPING_KEYS",
    "MAX_SPEC_BYTES",
    "TOP_KEYS",
    "TooManyKernels",
    "count_kernels",
    "display_path",
    "expand_paths",
    "load_paths",
    "load_spec_file",
    "load_spec_text",
    "specs_from_mapping",
]

# Every table below is derived from spec.FIELDS.
TOP_KEYS = tuple(dict.fromkeys(f.top for f in FIELDS))
SUB_KEYS = {
    top: tuple(f.sub for f in FIELDS if f.top == top and f.sub)
    for top in TOP_KEYS
    if any(f.top == top and f.sub for f in FIELDS)
}
TILE_FIELDS = Tile.FIELDS
_AUTO = "auto"
# Far above any real spec file (the shipped ones are a few KB), far below what hurts.
MAX_SPEC_BYTES = 4 * 1024 * 1024
MAX_MAPPING_KEYS = 10_000


class TooManyKernels(SpecError):
    """More kernels than a `max_kernels` cap, counted before any family was expanded.
    `per_file` is [(spec file, kernels it declares)], `total` their sum."""

    def __init__(self, per_file: list[tuple[str, int]], limit: int) -> None:
        self.per_file = per_file
        self.total = sum(n for _, n in per_file)
        self.limit = limit
        super().__init__(f"{self.total} kernels, more than the cap of {limit}")


# --------------------------------------------------------------------------------------------
# YAML with line numbers.
# --------------------------------------------------------------------------------------------


class LineDict(dict):
    """A mapping that remembers the (1-based) line of itself and of each key."""

    line: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_lines: dict[Any, int] = {}


class LineList(list):
    """A sequence that remembers the line of itself and of each item."""

    line: int = 0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.item_lines: list[int] = []


class _Loader(yaml.SafeLoader):
    """SafeLoader recording lines; booleans are only true/false (YAML 1.2), never yes/no/on."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != _BOOL_TAG]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


class _YamlTooLarge(Exception):
    def __init__(self, line: int, keys: int) -> None:
        super().__init__(keys)
        self.line, self.keys = line, keys


class _YamlDuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


def _flatten_mapping(loader: _Loader, node: yaml.MappingNode) -> None:
    """SafeLoader's merge-key (`<<`) flattening, refused once a mapping has more than
    MAX_MAPPING_KEYS keys (with PyYAML before 6.0.2 nested merges of aliases double a mapping
    per level: a YAML bomb)."""
    yaml.SafeLoader.flatten_mapping(loader, node)
    if len(node.value) > MAX_MAPPING_KEYS:
        raise _YamlTooLarge(node.start_mark.line + 1, len(node.value))


_Loader.flatten_mapping = _flatten_mapping  # also called on the nested merged mappings


def _construct_map(loader: _Loader, node: yaml.MappingNode):  # noqa: ANN202
    loader.flatten_mapping(node)
    data = LineDict()
    data.line = node.start_mark.line + 1
    yield data
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            hash(key)
        except TypeError:
            raise _YamlDuplicateKey(key, line, 0) from None
        if key in data:
            raise _YamlDuplicateKey(key, line, data.key_lines[key])
        data[key] = loader.construct_object(value_node, deep=True)
        data.key_lines[key] = line


def _construct_seq(loader: _Loader, node: yaml.SequenceNode):  # noqa: ANN202
    data = LineList()
    data.line = node.start_mark.line + 1
    yield data
    for item in node.value:
        data.append(loader.construct_object(item, deep=True))
        data.item_lines.append(item.start_mark.line + 1)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)
_Loader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)


def _parse_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except _YamlTooLarge as e:
        raise SpecError(
            f"a mapping of {e.keys} keys (`<<` merges included), more than the "
            f"{MAX_MAPPING_KEYS} a spec file may have",
            file=file,
            line=e.line,
        ) from None
    except RecursionError:
        raise SpecError(
            "nested too deeply to parse (lists or mappings inside each other hundreds of "
            "levels deep; a spec needs three)",
            file=file,
        ) from None
    except _YamlDuplicateKey as e:
        if e.first == 0:
            raise SpecError(f"{e.key!r} is not a valid key", file=file, line=e.line) from None
        raise SpecError(
            f"duplicate key (first given on line {e.first})", file=file, line=e.line, field=e.key
        ) from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (NUL, ...)
        line = text.count("\n", 0, e.position) + 1
        char = f"U+{e.character:04X}" if isinstance(e.character, int) else repr(e.character)
        raise SpecError(
            f"invalid YAML: character {char} is not allowed", file=file, line=line
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"invalid YAML: {problem}", file=file, line=line) from None


# --------------------------------------------------------------------------------------------
# Paths.
# --------------------------------------------------------------------------------------------


def display_path(path: str | Path) -> str:
    """`path` relative to the repository root if inside it, else to the cwd, else as given."""
    p = Path(path)
    resolved = p.resolve()
    for base in (checkout_root(), Path.cwd().resolve()):
        if base is None:
            continue
        try:
            return resolved.relative_to(base).as_posix()
        except ValueError:
            pass
    return p.as_posix()


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given; a directory means all *.yaml / *.yml in it, sorted. Duplicates dropped."""
    out: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        try:
            found = _spec_files(p, str(raw))
        except OSError as e:  # e.g. a directory without read or search permission
            what = "directory" if os.path.isdir(p) else "path"
            raise SpecError(f"cannot read {what}: {e.strerror or e}", file=str(raw)) from None
        for q in found:
            key = q.resolve()
            if key not in seen:
                seen.add(key)
                out.append(q)
    return out


def _spec_files(p: Path, raw: str) -> list[Path]:
    if p.is_dir():
        found = sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml") and q.is_file())
        if not found:
            raise SpecError("directory holds no *.yaml or *.yml spec files", file=raw)
        return found
    if p.is_file():
        return [p]
    if p.exists():
        raise SpecError("is not a regular file or a directory", file=raw)
    raise SpecError("no such file or directory", file=raw)


# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------


def _parse_doc(text: str, file: str) -> Any:
    doc = _parse_yaml(text, file)
    if doc is None:
        raise SpecError("file is empty (expected a kernel mapping or `kernels:` list)", file=file)
    return doc


def load_spec_text(text: str, file: str = "<string>") -> list[KernelSpec]:
    """All kernels declared by YAML `text`; `file` is used in messages and `spec.source`."""
    return specs_from_mapping(_parse_doc(text, file), file)


def _read_spec_text(path: str | Path, file: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"cannot read: {e.strerror or e}", file=file) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(
            f"is larger than {MAX_SPEC_BYTES // (1024 * 1024)} MiB, far more than a spec "
            "file needs (is it a spec file?)",
            file=file,
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError("is not UTF-8 text", file=file) from None


def load_spec_file(path: str | Path) -> list[KernelSpec]:
    """All kernels declared by one spec file (sources relative to the repository root)."""
    file = display_path(path)
    return load_spec_text(_read_spec_text(path, file), file)


def load_paths(paths: Iterable[str | Path], *, max_kernels: int = 0) -> list[KernelSpec]:
    """Kernels of every spec file (directories expanded); a kernel declared twice is an error.

    `max_kernels` > 0: raise `TooManyKernels` if the files declare more kernels than that,
    counted before any family is expanded or validated member by member."""
    parsed = []
    for p in expand_paths(paths):
        file = display_path(p)
        parsed.append((file, _parse_doc(_read_spec_text(p, file), file)))
    if max_kernels:
        per_file = [(file, count_kernels(doc, file)) for file, doc in parsed]
        if sum(n for _, n in per_file) > max_kernels:
            raise TooManyKernels(per_file, max_kernels)
    specs: list[KernelSpec] = []
    where: dict[KernelSpec, str] = {}
    for file, doc in parsed:
        for s in specs_from_mapping(doc, file):
            if s in where:
                file, _, line = s.source.rpartition(":")
                raise SpecError(
                    f"duplicate kernel: the same spec is already declared at {where[s]}",
                    file=file,
                    line=int(line) if line.isdigit() else None,
                )
            where[s] = s.source
            specs.append(s)
    return specs


def specs_from_mapping(doc: Any, file: str = "<mapping>") -> list[KernelSpec]:
    """Kernels of an already parsed document (a mapping, or one with `kernels:`)."""
    entries = _entries(doc, file)
    if len(entries) == 1 and not entries[0][1]:  # one kernel mapping, no `kernels:` list
        return _expand_entry(entries[0][0], file, "")
    specs: list[KernelSpec] = []
    where: dict[KernelSpec, str] = {}
    for merged, label in entries:
        for s in _expand_entry(merged, file, label):
            if s in where:
                raise SpecError(
                    f"duplicate kernel: the same spec is already declared at {where[s]}",
                    file=file,
                    line=int(s.source.rpartition(":")[2]),
                    field=label,
                )
            where[s] = s.source
            specs.append(s)
    return specs


def count_kernels(doc: Any, file: str = "<mapping>") -> int:
    """How many kernels an already parsed document declares: the product of each entry's
    list lengths, summed over entries, without building any of them (the fields are checked
    as far as counting needs; duplicates are not detected here)."""
    total = 0
    for merged, _ in _entries(doc, file):
        total += math.prod(len(alts) for _, alts in _entry_axes(merged, file, tiles=False))
    return total


def _entries(doc: Any, file: str) -> list[tuple[LineDict, str]]:
    """The kernel entries of a document, `defaults:` merged in, with their field labels
    (`kernels[i]`; "" for a file that is one kernel mapping)."""
    try:
        return _entries_of(doc, file)
    except RecursionError:
        raise SpecError("nested too deeply", file=file) from None


def _entries_of(doc: Any, file: str) -> list[tuple[LineDict, str]]:
    if not isinstance(doc, Mapping):
        raise SpecError(
            f"top level must be a mapping (one kernel, or `kernels:` list), got {_kind(doc)}",
            file=file,
            line=getattr(doc, "line", None),
        )
    doc = _as_linedict(doc)
    if "kernels" not in doc:
        if "defaults" in doc:
            raise SpecError(
                "only allowed together with a top-level `kernels:` list",
                file=file,
                line=doc.key_lines.get("defaults"),
                field="defaults",
            )
        return [(doc, "")]
    extra = [k for k in doc if k not in ("kernels", "defaults")]
    if extra:
        raise SpecError(
            "unexpected top-level key next to `kernels:` (allowed: kernels, defaults); "
            "put kernel fields inside the entries or under `defaults:`",
            file=file,
            line=doc.key_lines.get(extra[0]),
            field=str(extra[0]),
        )
    defaults = doc.get("defaults", LineDict())
    if not isinstance(defaults, Mapping):
        raise SpecError(
            f"expected a mapping, got {_kind(defaults)}",
            file=file,
            line=doc.key_lines.get("defaults"),
            field="defaults",
        )
    defaults = _as_linedict(defaults)
    entries = doc["kernels"]
    if not isinstance(entries, list) or not entries:
        raise SpecError(
            f"expected a non-empty list of kernel mappings, got {_kind(entries)}",
            file=file,
            line=doc.key_lines.get("kernels"),
            field="kernels",
        )
    entries = _as_linelist(entries)
    out: list[tuple[LineDict, str]] = []
    for i, entry in enumerate(entries):
        line = entries.item_lines[i] if i < len(entries.item_lines) else None
        if not isinstance(entry, Mapping):
            raise SpecError(
                f"expected a kernel mapping, got {_kind(entry)}",
                file=file,
                line=line,
                field=f"kernels[{i}]",
            )
        out.append((_merge(defaults, _as_linedict(entry)), f"kernels[{i}]"))
    return out


# --------------------------------------------------------------------------------------------
# One entry -> its family.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Alt:
    """One alternative value of one axis, with where it came from."""

    value: Any
    lines: tuple[tuple[str, int], ...]  # (field path, line) pairs this value came from
    label: str  # how to show it in a family member description


def _entry_err(entry: LineDict, file: str) -> Callable[[str, str | None, int | None], SpecError]:
    def err(msg: str, fld: str | None, line: int | None) -> SpecError:
        return SpecError(msg, file=file, line=line or entry.line or None, field=fld)

    return err


def _entry_axes(entry: LineDict, file: str, *, tiles: bool = True) -> list[tuple[str, list]]:
    """(field path, alternatives) per axis of one entry, in field order. `tiles=False`:
    the tile axis holds one placeholder per tile instead of the tiles (for counting: a tile
    mapping of lists is the product of its lists, built only when expanding)."""
    err = _entry_err(entry, file)
    _reject_unknown_keys(entry, TOP_KEYS, "", None, err)
    for key in REQUIRED:
        if key not in entry:
            raise err(f"required field is missing (e.g. {key}: {_EXAMPLES[key]})", key, None)

    axes: list[tuple[str, list[_Alt]]] = []
    for top in TOP_KEYS:
        line = entry.key_lines.get(top, entry.line)
        if top in SUB_KEYS:  # a mapping of sub-fields (mask)
            raw = entry.get(top, {})
            if isinstance(raw, list):
                raise err(
                    "expected a mapping; to declare a family put lists inside it "
                    f"(e.g. {top}: {{{SUB_KEYS[top][0]}: [a, b]}})",
                    top,
                    line,
                )
            if not isinstance(raw, Mapping):
                raise err(f"expected a mapping, got {_kind(raw)}", top, line)
            raw = _as_linedict(raw)
            _reject_unknown_keys(raw, SUB_KEYS[top], f"{top}.", line, err)
            for sub in SUB_KEYS[top]:
                f = FIELD_BY_PATH[f"{top}.{sub}"]
                sub_line = raw.key_lines.get(sub, line)
                value = raw.get(sub, f.yaml_value(f.default))
                axes.append((f.path, _scalar_alts(f.path, value, sub_line, err)))
            continue
        f = FIELD_BY_PATH[top]
        raw = entry.get(top, f.yaml_value(f.default))
        if f.kind is FieldKind.PARAMS:  # one mapping, never a family axis
            axes.append((top, [_params_alt(raw, line, err)]))
        elif f.kind is FieldKind.TILE:
            axes.append((top, _tile_alts(raw, line, err) if tiles else _tile_count(raw)))
        else:
            axes.append((top, _scalar_alts(top, raw, line, err)))
    return axes


def _expand_entry(entry: LineDict, file: str, where: str) -> list[KernelSpec]:
    err = _entry_err(entry, file)
    axes = _entry_axes(entry, file)
    varying = {name for name, alts in axes if len(alts) > 1}
    source = f"{file}:{entry.line}" if entry.line else file
    specs: list[KernelSpec] = []
    seen: dict[KernelSpec, str] = {}
    for combo in itertools.product(*(alts for _, alts in axes)):
        values = {name: alt.value for (name, _), alt in zip(axes, combo, strict=True)}
        lines: dict[str, int] = {}
        for alt in combo:
            lines.update(dict(alt.lines))
        member = ", ".join(
            f"{n}={a.label}" for (n, _), a in zip(axes, combo, strict=True) if n in varying
        )
        try:
            spec = _build(values, source)
        except SpecError as e:
            fld = e.field or ""
            line = _line_for(fld, lines) or entry.line
            suffix = f" (in family member {member})" if member else ""
            raise SpecError(e.message + suffix, file=file, line=line, field=e.field) from None
        if spec in seen:
            varying_lines = [
                ln
                for alt, (n, _) in zip(combo, axes, strict=True)
                if n in varying
                for _, ln in alt.lines[-1:]
            ]
            raise err(
                f"duplicate kernel in family: member {member} repeats {seen[spec]}",
                where or None,
                max(varying_lines, default=entry.line),
            )
        seen[spec] = member
        specs.append(spec)
    return specs


def _build(values: dict[str, Any], source: str) -> KernelSpec:
    tile_auto = values["tile"] == _AUTO
    if tile_auto:
        kind: KernelKind = values["kernel"]
        try:
            fam = family(kind, values["target"])
        except SpecError as e:
            raise SpecError(e.message, field="kernel") from None
        # An invalid head_dim is reported by the family; a legal tile stands in meanwhile.
        if fam.head_dims_ok(values):  # (sized for max(d, d_v): Family.auto_tile_of)
            values["tile"] = fam.auto_tile_of(values)
        else:
            values["tile"] = Tile(64, 64, 4, 2)
    return build_spec(values, tile_auto=tile_auto, source=source)


def _line_for(fld: str, lines: dict[str, int]) -> int | None:
    while fld:
        if fld in lines:
            return lines[fld]
        fld = fld.rpartition(".")[0]
    return None


def _items(value: Any, line: int) -> list[tuple[Any, int, str]]:
    """(item, line, index suffix) of a family list, or the value itself."""
    if isinstance(value, list):
        item_lines = getattr(value, "item_lines", [])
        return [
            (v, item_lines[i] if i < len(item_lines) else line, f"[{i}]")
            for i, v in enumerate(value)
        ]
    return [(value, line, "")]


def _scalar_alts(fld: str, value: Any, line: int, err: Any) -> list[_Alt]:
    if isinstance(value, list) and not value:
        raise err("empty list: a family needs at least one value", fld, line)
    alts = []
    for item, item_line, idx in _items(value, line):
        alts.append(
            _Alt(_parse_scalar(fld, item, item_line, idx, err), ((fld, item_line),), _label(item))
        )
    return alts


def _parse_scalar(fld: str, v: Any, line: int, idx: str, err: Any) -> Any:
    shown = fld + idx
    f = FIELD_BY_PATH[fld]
    if isinstance(v, (list, Mapping)):
        what = "a nested list" if idx and isinstance(v, list) else _kind(v)
        raise err(f"expected a single value, got {what}", shown, line)
    if f.kind is FieldKind.ENUM and v is None and f.optional:
        return None  # absent (kv_dtype: the q dtype)
    if f.kind is FieldKind.ENUM:
        allowed = ", ".join(f.enum.allowed())
        if not isinstance(v, str):
            raise err(f"{_show(v)} is {_kind(v)}, expected one of: {allowed}", shown, line)
        try:
            return f.enum.from_yaml(v)
        except SpecError as e:
            raise err(e.message, shown, line) from None
    if f.kind is FieldKind.BOOL:
        if not isinstance(v, bool):
            raise err(f"{_show(v)} is {_kind(v)}, expected true or false", shown, line)
        return v
    if f.kind is FieldKind.EXPR:  # parsed with the entry's params when the spec is built
        if v is not None and not isinstance(v, str):
            raise err(
                f"{_show(v)} is {_kind(v)}, expected an expression string "
                f'(e.g. score_mod: "s - slopes[h] * abs(i - j)", docs/usermod.md)',
                shown,
                line,
            )
        return v
    if f.kind is FieldKind.INT:
        if v is None and f.optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise err(
                f"{_show(v)} is {_kind(v)}, expected an integer (allowed: multiples of 8 "
                f"in 8..256)",
                shown,
                line,
            )
        return v
    raise AssertionError(fld)  # pragma: no cover


def _params_alt(raw: Any, line: int, err: Any) -> _Alt:
    """The `params` mapping ({name: kind}) as one alternative, with each name's line."""
    if raw is None:
        return _Alt(None, (("params", line),), "none")
    if not isinstance(raw, Mapping):
        raise err(
            f"expected a mapping of parameter names to kinds (e.g. params: {{slopes: "
            f"per_head}}), got {_kind(raw)}",
            "params",
            line,
        )
    raw = _as_linedict(raw)
    lines = (("params", line),) + tuple((f"params.{k}", raw.key_lines.get(k, line)) for k in raw)
    return _Alt({k: v for k, v in raw.items()}, lines, "params")


def _tile_count(raw: Any) -> range:
    """As many placeholders as `_tile_alts(raw)` gives tiles (malformed parts count as one:
    expanding reports them)."""
    n = 0
    for item, _, _ in _items(raw, 0):
        if isinstance(item, Mapping):
            n += math.prod(max(len(v), 1) if isinstance(v, list) else 1 for v in item.values())
        else:
            n += 1
    return range(max(n, 1))


def _tile_alts(raw: Any, line: int, err: Any) -> list[_Alt]:
    if isinstance(raw, list) and not raw:
        raise err("empty list: a family needs at least one value", "tile", line)
    alts: list[_Alt] = []
    for item, item_line, idx in _items(raw, line):
        fld = "tile" + idx
        if item == _AUTO:
            alts.append(_Alt(_AUTO, (("tile", item_line),), "auto"))
            continue
        if isinstance(item, list):
            raise err("expected auto or a mapping, got a nested list", fld, item_line)
        if not isinstance(item, Mapping):
            raise err(
                f"{_show(item)} is not allowed (allowed: auto, or a mapping "
                f"{{block_m: 128, block_n: 64, warps: 4, stages: 2}})",
                fld,
                item_line,
            )
        item = _as_linedict(item)
        _reject_unknown_keys(item, TILE_FIELDS, f"{fld}.", item_line, err)
        per_field: list[list[tuple[int, int]]] = []
        for sub in TILE_FIELDS:
            if sub not in item:
                raise err(
                    f"missing {sub} (a tile gives all of {', '.join(TILE_FIELDS)}, or is auto)",
                    f"{fld}.{sub}",
                    item_line,
                )
            sub_line = item.key_lines.get(sub, item_line)
            value = item[sub]
            if isinstance(value, list) and not value:
                raise err("empty list: a family needs at least one value", f"{fld}.{sub}", sub_line)
            options = []
            for v, v_line, sub_idx in _items(value, sub_line):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise err(
                        f"{_show(v)} is {_kind(v)}, expected an integer",
                        f"{fld}.{sub}{sub_idx}",
                        v_line,
                    )
                options.append((v, v_line))
            per_field.append(options)
        for combo in itertools.product(*per_field):
            tile = Tile(*(v for v, _ in combo))
            lines = (("tile", item_line),) + tuple(
                (f"tile.{sub}", v_line) for sub, (_, v_line) in zip(TILE_FIELDS, combo, strict=True)
            )
            alts.append(_Alt(tile, lines, tile.short))
    return alts


# --------------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------------

_EXAMPLES = {"dtype": "bf16", "head_dim": 128}


def _reject_unknown_keys(
    mapping: LineDict, allowed: Sequence[str], prefix: str, line: int | None, err: Any
) -> None:
    """SpecError (through `err`) for the first key of `mapping` not in `allowed`, with the
    allowed keys and a did-you-mean; `prefix` makes the field path (`mask.`, `tile.`)."""
    for key in mapping:
        if key not in allowed:
            raise err(
                f"unknown key {key!r} (allowed: {', '.join(allowed)})"
                + _did_you_mean(key, allowed),
                f"{prefix}{key}",
                mapping.key_lines.get(key, line),
            )


def _did_you_mean(text: Any, choices: Sequence[str]) -> str:
    if not isinstance(text, str):
        return ""
    close = difflib.get_close_matches(text, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return type(v).__name__


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return repr(v)


def _label(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _as_linedict(m: Mapping) -> LineDict:
    if isinstance(m, LineDict):
        return m
    d = LineDict(m)
    return d


def _as_linelist(seq: list) -> LineList:
    if isinstance(seq, LineList):
        return seq
    return LineList(seq)


def _merge(defaults: LineDict, entry: LineDict) -> LineDict:
    """`entry` over `defaults`; `mask` and `tile` mappings are merged one level deep."""
    out = LineDict()
    out.line = entry.line
    for src in (defaults, entry):
        for k, v in src.items():
            if (
                k in (*SUB_KEYS, "tile")
                and isinstance(v, Mapping)
                and isinstance(out.get(k), Mapping)
            ):
                merged = LineDict()
                merged.line = getattr(v, "line", 0)
                for part in (_as_linedict(out[k]), _as_linedict(v)):
                    merged.update(part)
                    merged.key_lines.update(part.key_lines)
                out[k] = merged
            else:
                out[k] = v
            if k in src.key_lines:
                out.key_lines[k] = src.key_lines[k]
    return out


def canonical_json(spec: KernelSpec) -> str:
    """The canonical spec as compact JSON with sorted keys (what the name hash covers)."""
    return json.dumps(spec.to_canonical(), sort_keys=True, separators=(",", ":"))
