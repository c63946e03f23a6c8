"""`KernelLibrary.pack` without a library or a GPU: the parameter struct it builds (its
`struct` fast path and the field-by-field conversions) against the plain per-field rule
`int(v)` (ptr and u64 wrapped to 64 bits) or `float(v)`, missing fields 0, unknown fields a
KeyError. `pack` reads only the family's tables, so it runs here on a stand-in object."""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import numpy as np
import pytest
from flashgen.generator.families import family
from flashgen.generator.load import load_spec_text
from flashgen.runtime.library import KernelLibrary, _packing, params_struct

SPECS = {
    "forward": load_spec_text("dtype: bf16\nhead_dim: 64\n")[0],
    "forward_sm90a": load_spec_text("dtype: bf16\nhead_dim: 64\ntarget: sm_90a\n")[0],
    "backward": load_spec_text("dtype: fp16\nhead_dim: 64\nkernel: backward\n")[0],
}


def _library(name: str):
    """What `pack` reads of a KernelLibrary (as its __init__ sets it), with no .so loaded."""
    fam = family(SPECS[name])
    return SimpleNamespace(family=fam, Params=params_struct(fam), _packing=_packing(fam))


def _pack(lib, values):
    return KernelLibrary.pack(lib, values)


def _reference(lib, values) -> bytes:
    """The struct as setattr per field after the documented conversion."""
    p = lib.Params()
    for f in lib.family.params:
        v = values.get(f.name, 0)
        if f.ctype == "f64":
            setattr(p, f.name, float(v))
        elif f.ctype in ("ptr", "u64"):
            setattr(p, f.name, int(v) & (2**64 - 1))
        else:
            setattr(p, f.name, int(v))
    return bytes(p)


def _fields(lib, ctype: str) -> list[str]:
    return [f.name for f in lib.family.params if f.ctype == ctype]


@pytest.fixture(params=sorted(SPECS))
def lib(request):
    return _library(request.param)


def test_every_field_type_is_covered(lib):
    assert {f.ctype for f in lib.family.params} <= {"ptr", "u64", "i64", "f64"}
    assert _fields(lib, "ptr") and _fields(lib, "i64") and _fields(lib, "f64")


def test_missing_fields_are_zero(lib):
    p = _pack(lib, {})
    assert isinstance(p, lib.Params)
    assert bytes(p) == bytes(ctypes.sizeof(lib.Params))


def test_plain_values_fill_their_fields(lib):
    values = {}
    for i, f in enumerate(lib.family.params):
        values[f.name] = {"f64": 0.125 * (i + 1), "i64": -i, "u64": 2**63 + i}.get(
            f.ctype, 0x7F00_0000_0000 + 256 * i
        )
    p = _pack(lib, values)
    assert bytes(p) == _reference(lib, values)
    for name, v in values.items():
        assert getattr(p, name) == v, name


@pytest.mark.parametrize(
    "kind",
    ["negative_pointer", "wide_pointer", "float_for_int", "int_for_float", "numpy", "bool",
     "string_float", "int64_extremes", "nan_inf"],
)  # fmt: skip
def test_conversions_match_the_per_field_rule(lib, kind):
    ptr, i64, f64 = _fields(lib, "ptr")[0], _fields(lib, "i64")[0], _fields(lib, "f64")[0]
    values = {
        "negative_pointer": {ptr: -16, i64: -1},
        "wide_pointer": {ptr: 2**64 + 48, i64: 2**63 - 1},
        "float_for_int": {ptr: 4096.0, i64: 7.9, f64: 2},
        "int_for_float": {f64: 3},
        "numpy": {ptr: np.uint64(2**63 + 16), i64: np.int64(-5), f64: np.float32(0.5)},
        "bool": {i64: True, f64: False},
        "string_float": {f64: "0.25"},
        "int64_extremes": {i64: -(2**63)},
        "nan_inf": {f64: math.nan, _fields(lib, "f64")[-1]: -math.inf},
    }[kind]
    assert bytes(_pack(lib, values)) == _reference(lib, values)


def test_i64_outside_its_range_wraps_like_ctypes(lib):
    i64 = _fields(lib, "i64")[0]
    for v in (2**63, 2**64 + 3, -(2**63) - 1):
        assert bytes(_pack(lib, {i64: v})) == _reference(lib, {i64: v})


def test_unknown_fields_are_a_key_error_naming_them_sorted(lib):
    struct_name = lib.family.params_struct
    known = lib.family.params[0].name
    with pytest.raises(KeyError, match=rf"unknown {struct_name} fields: \['aa', 'zz'\]"):
        _pack(lib, {"zz": 1, known: 1, "aa": 2})


def test_values_no_conversion_takes_raise_as_the_conversion_does(lib):
    ptr, f64 = _fields(lib, "ptr")[0], _fields(lib, "f64")[0]
    with pytest.raises(TypeError):
        _pack(lib, {ptr: None})
    with pytest.raises(ValueError, match="could not convert string to float"):
        _pack(lib, {f64: "x"})


def test_the_family_tables_are_built_once():
    fam = family(SPECS["forward"])
    assert _packing(fam) is _packing(fam)
    packing = _packing(fam)
    assert packing.names == tuple(f.name for f in fam.params)
    assert packing.known == frozenset(packing.names)
    assert packing.layout.size == ctypes.sizeof(params_struct(fam))
