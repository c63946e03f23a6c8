"""The docs say what the code does: docs/spec.md against the spec's field table and the
families' rules, and every relative link of README.md and docs/*.md resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from flashgen.generator.families import family
from flashgen.generator.load import load_spec_text
from flashgen.generator.spec import FIELDS, FieldKind, KernelKind, SpecError, Target

REPO = Path(__file__).resolve().parent.parent
SPEC_MD = REPO / "docs" / "spec.md"
MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def section(text: str, title: str) -> str:
    """The body of the `## title` section."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """Cells of the body rows of the first Markdown table in `text`."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|"):
            if not set(line.strip()) <= set("|-: "):  # not the separator row
                cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
                rows.append([c.strip().replace("\\|", "|") for c in cells])
        elif rows:
            break
    return rows[1:]  # without the header


def field_rows() -> dict[str, list[str]]:
    rows = table_rows(section(SPEC_MD.read_text(), "Fields"))
    return {row[0].strip("`"): row for row in rows}


# --------------------------------------------------------------------------------------------
# docs/spec.md
# --------------------------------------------------------------------------------------------


def test_spec_md_documents_every_field_of_the_field_table_in_its_order():
    documented = list(field_rows())
    assert documented == [f.path for f in FIELDS]


def expected_type(f) -> str:
    if f.kind is FieldKind.ENUM:
        return " | ".join(f"`{v}`" for v in f.enum.allowed())
    return {
        FieldKind.BOOL: "bool",
        FieldKind.INT: "integer",
        FieldKind.TILE: "`auto` or mapping",
        FieldKind.EXPR: "expression",
        FieldKind.PARAMS: "mapping",
    }[f.kind]


@pytest.mark.parametrize("f", FIELDS, ids=[f.path for f in FIELDS])
def test_spec_md_gives_each_field_s_type_default_and_kernel_kinds(f):
    row = field_rows()[f.path]
    _, typ, default, kinds, meaning = row
    assert typ == expected_type(f)
    if f.optional:
        assert default == "absent"
    else:
        want = "required" if f.default is None else f"`{_yaml(f.yaml_value(f.default))}`"
        assert default == want
    assert kinds == ("all" if f.kinds is None else ", ".join(k.yaml for k in f.kinds))
    assert f"Example: `{f.top}: " in meaning or f"Example: `{f.path}: " in meaning


def _yaml(value) -> str:
    return {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else value


def test_spec_md_yaml_example_names_every_top_level_field():
    block = section(SPEC_MD.read_text(), "Fields").split("```yaml", 1)[1].split("```", 1)[0]
    keys = [line.split(":", 1)[0] for line in block.splitlines() if line and line[0] != " "]
    assert sorted(keys) == sorted({f.top for f in FIELDS})


def expand(cell: str) -> set[int]:
    """`16, 32, ..., 128, 160` -> {16, 32, 48, ..., 128, 160}."""
    parts = [p.strip() for p in cell.split(",")]
    out: list[int] = []
    for i, p in enumerate(parts):
        if p == "...":
            step = out[-1] - out[-2]
            stop = int(parts[i + 1])
            out.extend(range(out[-1] + step, stop, step))
        else:
            out.append(int(p))
    return set(out)


def head_dim_rows() -> list[tuple[KernelKind, list[Target], str]]:
    rows = table_rows(section(SPEC_MD.read_text(), "Head dims"))
    return [
        (KernelKind.from_yaml(k), [Target.from_yaml(t.strip()) for t in ts.split(",")], dims)
        for k, ts, dims, *_ in rows  # (the fourth column, on chip, is prose)
    ]


def test_spec_md_head_dims_cover_every_kind_and_target():
    covered = [(k, t) for k, targets, _ in head_dim_rows() for t in targets]
    assert sorted(covered, key=str) == sorted([(k, t) for k in KernelKind for t in Target], key=str)


@pytest.mark.parametrize("row", head_dim_rows(), ids=lambda r: f"{r[0].yaml}-{r[1][0].yaml}")
def test_spec_md_head_dims_are_the_families_rules(row):
    kind, targets, dims = row
    for target in targets:
        spec = f"kernel: {kind.yaml}\ndtype: bf16\nhead_dim: 64\ntarget: {target.yaml}\n"
        if dims.startswith("refused"):
            with pytest.raises(SpecError) as exc:
                load_spec_text(spec)
            assert exc.value.field == "target"
            continue
        fam = family(kind, target)
        assert expand(dims) == {d for d in range(1, 513) if fam.head_dim_ok(d)}, target


def test_spec_md_shared_memory_limits_are_the_targets():
    tiles = section(SPEC_MD.read_text(), "Tiles")
    for t in Target:
        if not t.value.suffix:
            assert f"{t.yaml} {t.info.max_smem_per_block}" in tiles


def test_spec_md_name_parts_are_in_field_order():
    names = " ".join(section(SPEC_MD.read_text(), "Kernel names").split())
    listed = names.split("(in this order: ", 1)[1].split(")", 1)[0]
    parts = re.findall(r"`([a-z0-9]+)`", listed)
    want = []
    for f in FIELDS:
        if (
            f.part is None
            or f.kind not in (FieldKind.BOOL, FieldKind.ENUM)
            or f.path
            in (
                "kernel",
                "dtype",
                "target",
            )
        ):
            continue
        if f.kind is FieldKind.BOOL:
            want.append(f.part(True))
        else:
            want += [p for p in (f.part(v) for v in f.enum) if p]
    assert parts == want


@pytest.mark.parametrize(
    "stale",
    [
        "Only `forward` has a template",
        "backward` is rejected",
        "the backward and decode families refuse it",
        "every file under `templates/`",
        "declares one or more forward attention kernels",
    ],
)
def test_spec_md_has_no_stale_claim(stale):
    assert stale not in " ".join(SPEC_MD.read_text().split())


def test_every_kind_has_templates_as_spec_md_says():
    text = SPEC_MD.read_text()
    for kind in KernelKind:
        for target in Target:
            fam = family(kind, target)
            folder = REPO / "templates" / fam.templates
            assert (folder / "kernel.cu.j2").is_file(), folder
            assert f"`templates/{fam.templates}/`" in text


# --------------------------------------------------------------------------------------------
# docs/design.md
# --------------------------------------------------------------------------------------------


def test_design_md_family_table_has_a_column_per_kind():
    text = (REPO / "docs" / "design.md").read_text()
    header = next(ln for ln in text.splitlines() if ln.startswith("| the family owns"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == [k.yaml for k in KernelKind]
    assert "the obvious next step" not in text


# --------------------------------------------------------------------------------------------
# Generated numbers (bench/readme_perf.py)
# --------------------------------------------------------------------------------------------


def test_readme_numbers_and_performance_md_are_up_to_date():
    from flashgen.bench import readme_perf

    stale = [p.relative_to(REPO).as_posix() for p in readme_perf.stale()]
    assert stale == [], "run: python3 bench/readme_perf.py"


def test_readme_verification_counts_come_from_the_records():
    import json

    from flashgen.bench import readme_perf

    text = readme_perf.verification()
    kernels = json.loads((REPO / "generated" / "manifest.json").read_text())["kernels"]
    assert f"of the {len(kernels)} shipped kernels" in text
    assert text in (REPO / "README.md").read_text()


def test_final_loss_has_one_meaning():
    perf = (REPO / "docs" / "performance.md").read_text()
    assert "final loss" not in perf and "final loss" not in (REPO / "README.md").read_text()
    assert "training loss, last step" in perf and "mean of the last 20 steps" in perf


# --------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _CODE.sub("", path.read_text())
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def links(path: Path) -> list[str]:
    text = _CODE.sub("", path.read_text())
    return [a or b for a, b in _LINK.findall(text)]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(doc):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == []
