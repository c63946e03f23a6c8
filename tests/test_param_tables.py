"""Lists that cross the C/Python border have one source of truth each, and these tests hold the
other side to it:

- a family's `params` table (Python packing, verify/runner.py) against the C struct its
  launcher takes (`params_struct` in `templates/include/flashgen/<params_header>`): same fields,
  same order, same kind and width;
- a family's `io_keys` (the instrument_io counters) against the kernel's C enum of counter
  slots (`io_enum` in `io_header` when the family names them, else the forward's `IoTensor` in
  `tile_io.cuh`).

The parsers are deliberately small: they read the plain declarations flashgen's headers use
and fail loudly on anything else, rather than guess.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from flashgen.generator.families import Family, ParamField, families
from flashgen.generator.paths import TEMPLATES_DIR

INCLUDE_DIR = TEMPLATES_DIR / "include" / "flashgen"
DEFAULT_IO_HEADER = "tile_io.cuh"  # where the forward keeps its counter enum
DEFAULT_IO_ENUM = "IoTensor"

# C spelling (qualifiers dropped) -> ParamField.ctype, for the non-pointer fields.
SCALAR_KINDS = {"int64_t": "i64", "uint64_t": "u64", "double": "f64"}


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def struct_body(text: str, struct: str) -> str:
    """The text between the braces of `struct <struct> { ... }` (typedef'd or not)."""
    m = re.search(rf"\bstruct\s+{re.escape(struct)}\s*\{{(?P<body>[^{{}}]*)\}}", text)
    assert m, f"no `struct {struct} {{...}}` found"
    return m["body"]


def c_struct_fields(text: str, struct: str) -> list[tuple[str, str]]:
    """(name, C type) of every field of `struct`, in declaration order. `int64_t a, b;`
    declares two fields; the `*` belongs to each declarator, as in C (`int64_t *a, b;` is a
    pointer and an integer). C types are spelled without qualifiers, e.g. `void*`."""
    fields = []
    for decl in struct_body(strip_comments(text), struct).split(";"):
        if not decl.strip():
            continue
        assert re.fullmatch(r"[\w\s*,]+", decl), f"unsupported declaration: {decl.strip()!r}"
        first, *others = decl.split(",")
        *specifiers, first_name = re.findall(r"\*|\w+", first)
        words = [w for w in specifiers if w not in ("*", "const", "volatile")]
        base = " ".join(words)
        assert words, f"no type in {decl.strip()!r}"
        for declarator, name in [(first, first_name)] + [(d, d.split()[-1]) for d in others]:
            fields.append((name.lstrip("*"), base + "*" * declarator.count("*")))
    return fields


# Structs a parameter struct embeds as one member, and the header that declares each: the
# member stands for the embedded struct's fields, in order (the layout is the same, since
# every field is 8 bytes wide).
EMBEDDED = {"fg_score_params": "score_params.h"}


def flat_struct_fields(header: Path, struct: str) -> list[tuple[str, str]]:
    """`c_struct_fields` with embedded structs (EMBEDDED) replaced by their fields."""
    out = []
    for name, ctype in c_struct_fields(header.read_text(), struct):
        if ctype in EMBEDDED:
            out.extend(flat_struct_fields(header.parent / EMBEDDED[ctype], ctype))
        else:
            out.append((name, ctype))
    return out


def assert_struct_matches(header: Path, struct: str, params: tuple[ParamField, ...]) -> None:
    """The C struct `struct` of `header` and a family's `params` table agree field by field:
    name, order, and kind (pointer / int64 / uint64 / double, all 8 bytes wide)."""
    c_fields = flat_struct_fields(header, struct)
    c_names = [name for name, _ in c_fields]
    py_names = [p.name for p in params]
    assert c_names == py_names, (
        f"{struct} ({header.name}) and the PARAMS table list different fields or orders:\n"
        f"  only in C:      {[n for n in c_names if n not in py_names]}\n"
        f"  only in Python: {[n for n in py_names if n not in c_names]}"
    )
    for (name, ctype), param in zip(c_fields, params):
        kind = "ptr" if ctype.endswith("*") else SCALAR_KINDS.get(ctype)
        assert kind == param.ctype, f"{struct}.{name}: C type {ctype} but PARAMS says {param.ctype}"
        assert ctype in ParamField.C_TYPES[kind], (
            f"{struct}.{name}: {ctype} is not one of the 8-byte {kind} types "
            f"{ParamField.C_TYPES[kind]} (ParamField.C_TYPES)"
        )


def c_enum_names(text: str, enum: str) -> list[str]:
    """The enumerators of `enum <enum> { ... }` in value order, checking that they run 0, 1, 2,
    ... (implicit or explicit values)."""
    m = re.search(
        rf"\benum\s+(?:class\s+|struct\s+)?{re.escape(enum)}\s*(?::\s*\w+\s*)?\{{(?P<body>[^}}]*)\}}",
        strip_comments(text),
    )
    assert m, f"no `enum {enum} {{...}}` found"
    names, value = [], 0
    for item in filter(None, (s.strip() for s in m["body"].split(","))):
        name, _, explicit = (s.strip() for s in item.partition("="))
        if explicit:
            value = int(explicit, 0)
        assert value == len(names), f"{enum}::{name} = {value}, expected {len(names)}"
        names.append(name)
        value += 1
    return names


def io_slot_key(name: str) -> str:
    """`kKeepMask` and `KEEP_MASK` both become `keepmask`."""
    if re.match(r"k[A-Z]", name):
        name = name[1:]
    return name.replace("_", "").lower()


def assert_io_enum_matches(header: Path, enum: str, io_keys: tuple[str, ...]) -> None:
    """The counter enum lists `io_keys` in order, followed by its count (`kNum...`)."""
    names = c_enum_names(header.read_text(), enum)
    assert names and re.match(r"k?Num", names[-1]), f"{enum} should end with its count kNum..."
    slots = names[:-1]
    assert [io_slot_key(n) for n in slots] == [io_slot_key(k) for k in io_keys], (
        f"{enum} ({header.name}) {slots} and io_keys {list(io_keys)} differ"
    )


FAMILIES = pytest.mark.parametrize("fam", families(), ids=lambda f: f.templates)


@FAMILIES
def test_params_table_matches_the_c_struct(fam: Family):
    assert_struct_matches(INCLUDE_DIR / fam.params_header, fam.params_struct, fam.params)


def test_score_params_header_is_the_rendering_of_the_feature_registry():
    """score_params.h is rendered from generator/features/ (`flashgen generate` rewrites it):
    the committed copy is that rendering, byte for byte."""
    from flashgen.generator.features import SCORE_PARAMS_HEADER, render_score_params_h

    assert (TEMPLATES_DIR / SCORE_PARAMS_HEADER).read_text() == render_score_params_h()


# Fields a struct grew after its head dims (the structs only grow at their end, so an older
# launcher reads its own prefix of today's: ab_bench runs an earlier version's kernels so).
GROWN_AFTER_HEAD_DIMS = {
    "fg_bwd_params": ("total_q", "total_k"),
    "fg_decode_params": ("trap_on_error",),
}


@FAMILIES
def test_every_params_struct_ends_with_the_score_params_then_the_head_dims(fam: Family):
    from flashgen.generator.families import SCORE_PARAM_FIELDS, SHAPE_PARAM_FIELDS

    tail = SCORE_PARAM_FIELDS + SHAPE_PARAM_FIELDS
    grown = GROWN_AFTER_HEAD_DIMS.get(fam.params_struct, ())
    end = len(fam.params) - len(grown)
    assert tuple(f.name for f in fam.params[end:]) == grown
    assert fam.params[end - len(tail) : end] == tail


@FAMILIES
def test_io_keys_match_the_kernel_counter_enum(fam: Family):
    header = INCLUDE_DIR / getattr(fam, "io_header", DEFAULT_IO_HEADER)
    assert_io_enum_matches(header, getattr(fam, "io_enum", DEFAULT_IO_ENUM), fam.io_keys)


@FAMILIES
def test_io_model_counts_the_family_io_keys(fam: Family):
    """The family's IO model (flashgen show, the tiled model) names the same counters."""
    module = importlib.import_module(fam.io_model.split(":")[0])
    if hasattr(module, "IO_KEYS"):
        assert tuple(module.IO_KEYS) == tuple(fam.io_keys)


# -- the parsers themselves ----------------------------------------------------------------------

TRICKY = """
/* a comment with int64_t fake; inside */
typedef struct demo {
  const void* q;            // a pointer
  int64_t a, b,
      c;                    /* three fields */
  int64_t *p, n;            /* a pointer and an integer, as in C */
  unsigned long long* counters;
  double scale;
} demo;
enum Slots { kA = 0, kKeepMask, kNumSlots };
"""


def test_struct_parser_reads_comma_declarations_and_per_declarator_pointers():
    assert c_struct_fields(TRICKY, "demo") == [
        ("q", "void*"),
        ("a", "int64_t"),
        ("b", "int64_t"),
        ("c", "int64_t"),
        ("p", "int64_t*"),
        ("n", "int64_t"),
        ("counters", "unsigned long long*"),
        ("scale", "double"),
    ]
    assert c_enum_names(TRICKY, "Slots") == ["kA", "kKeepMask", "kNumSlots"]


def test_checks_name_the_mismatch(tmp_path):
    header = tmp_path / "demo.h"
    header.write_text(
        "typedef struct demo { const void* q; int64_t a, b; double scale; } demo;\n"
        "enum Slots { kA = 0, kKeepMask, kNumSlots };\n"
    )
    table = (
        ParamField("q", "ptr"),
        ParamField("a", "i64"),
        ParamField("b", "i64"),
        ParamField("scale", "f64"),
    )
    assert_struct_matches(header, "demo", table)
    with pytest.raises(AssertionError, match="demo.scale: C type double but PARAMS says i64"):
        assert_struct_matches(header, "demo", table[:-1] + (ParamField("scale", "i64"),))
    with pytest.raises(AssertionError, match=r"only in Python: \['extra'\]"):
        assert_struct_matches(header, "demo", table + (ParamField("extra", "u64"),))
    with pytest.raises(AssertionError, match="different fields or orders"):
        assert_struct_matches(header, "demo", (table[1], table[0]) + table[2:])
    assert_io_enum_matches(header, "Slots", ("A", "KEEP_MASK"))
    with pytest.raises(AssertionError, match="differ"):
        assert_io_enum_matches(header, "Slots", ("A", "DROP_MASK"))
