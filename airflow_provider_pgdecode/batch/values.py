"""Typed staging of decoded values: PostgreSQL text output to Arrow arrays, column-wise.

The decoding core keeps values as the text PostgreSQL printed. Here each column of a batch
part is converted at once, with Arrow's vectorised casts where they parse PostgreSQL's text
exactly (integers, floats, dates, timestamps) and small Python functions where they do not
(booleans, bytea, arrays, infinities). Which Arrow type a PostgreSQL type is staged as is
decided by :mod:`airflow_provider_pgdecode.typemap` (documented in docs/merge.md); this module
only turns its names into pyarrow types and picks the converter by the Arrow type.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_pgdecode import typemap
from airflow_provider_pgdecode.errors import ValueConversionError

Converter = Callable[[Sequence[Any]], pa.Array]

# What infinity and -infinity become (the ends of Spark's range); in a key column a bad value
# instead (batch/badvalues.py): clamped, it would be the same Delta row as a key of that value.
_DATE_MAX = "9999-12-31"
_DATE_MIN = "0001-01-01"
_TIMESTAMP_MAX = "9999-12-31 23:59:59.999999"
_TIMESTAMP_MIN = "0001-01-01 00:00:00"
_INFINITIES = {
    "infinity": "max",
    "-infinity": "min",
}

# The Arrow types the type map names (pyarrow's own spelling of each).
_ARROW_TYPES: dict[str, pa.DataType] = {
    str(t): t
    for t in (
        pa.int16(),
        pa.int32(),
        pa.int64(),
        pa.float32(),
        pa.float64(),
        pa.bool_(),
        pa.date32(),
        pa.timestamp("us"),
        pa.timestamp("us", tz="UTC"),
        pa.binary(),
        pa.string(),
    )
}
_LIST_PREFIX = "list<item: "


def resolve_arrow_type(name: str) -> pa.DataType:
    """The pyarrow type of a type-map Arrow name (``int32``, ``list<item: string>`` ...)."""
    if name.startswith(_LIST_PREFIX) and name.endswith(">"):
        return pa.list_(resolve_arrow_type(name[len(_LIST_PREFIX) : -1]))
    try:
        return _ARROW_TYPES[name]
    except KeyError:
        raise ValueError(f"{name!r} is not an Arrow type the type map uses") from None


@lru_cache(maxsize=1024)
def arrow_type(pg_type: str, staging: typemap.Staging = typemap.DEFAULT_STAGING) -> pa.DataType:
    """The Arrow type a column of PostgreSQL type ``pg_type`` (format_type's name) is staged as
    (``staging``: the table's options, see :func:`typemap.staged_arrow_type`)."""
    return resolve_arrow_type(typemap.staged_arrow_type(pg_type, staging))


def convert_column(
    pg_type: str, values: Sequence[Any], column: str = "?", staging: typemap.Staging = typemap.DEFAULT_STAGING
) -> pa.Array:
    """Convert one column's text values (``None`` = NULL) to an Arrow array of :func:`arrow_type`."""
    try:
        return _convert(pg_type, values, staging)
    except ValueConversionError as exc:
        raise ValueConversionError(f"column {column!r} ({pg_type}): {exc}") from None


def _convert(pg_type: str, values: Sequence[Any], staging: typemap.Staging = typemap.DEFAULT_STAGING) -> pa.Array:
    if staging.arrays == typemap.ARRAYS_AS_JSON and typemap.array_element(pg_type) is not None:
        element = typemap.array_element(pg_type) or ""
        if typemap.array_staged_as_list(element):
            return _convert_arrays_to_json(arrow_type(element, staging.of_elements), values)
    return _convert_to(arrow_type(pg_type, staging), values)


def bad_values(
    pg_type: str, values: pa.Array, staging: typemap.Staging = typemap.DEFAULT_STAGING
) -> list[tuple[int, str]]:
    """The rows of a text column that cannot be converted, each with the reason (the slow path,
    taken only after :func:`convert_column` of the whole column failed)."""
    bad: list[tuple[int, str]] = []
    for index, value in enumerate(_as_text(values).to_pylist()):
        if value is None:
            continue
        try:
            _convert(pg_type, [value], staging)
        except ValueConversionError as exc:
            bad.append((index, str(exc)))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            bad.append((index, f"cannot convert {value[:80]!r} ({exc})"))
    return bad


_INFINITY_TEXTS = pa.array(list(_INFINITIES), pa.string())
# ±infinity as an element of an array literal (PostgreSQL prints it unquoted; quotes allowed).
_INFINITY_ELEMENT = r'[{,]"?-?infinity"?[,}]'


def clamped_infinities(
    pg_type: str, values: pa.Array, staging: typemap.Staging = typemap.DEFAULT_STAGING
) -> pa.Array | None:
    """Which values of a text column staging clamps from ``infinity`` / ``-infinity`` to an end of
    Spark's range (a column staged as a date or a timestamp, or a list of them where an element
    is one): a boolean mask, or ``None`` when there is none. A type the table's ``type_map``
    keeps as text, or arrays staged as JSON, keep the text: nothing is clamped there."""
    target = arrow_type(pg_type, staging)
    element = target.value_type if pa.types.is_list(target) else None
    temporal = element if element is not None else target
    if not (pa.types.is_date(temporal) or pa.types.is_timestamp(temporal)):
        return None
    text = _as_text(values)
    if text.null_count == len(text):
        return None
    if element is None:
        mask = pc.is_in(text, value_set=_INFINITY_TEXTS)
    else:
        mask = pc.match_substring_regex(text, _INFINITY_ELEMENT)
    mask = pc.fill_null(mask, False)
    return mask if pc.any(mask).as_py() else None


def infinity_bounds(pg_type: str) -> tuple[str, str]:
    """What ``infinity`` and ``-infinity`` of a date or timestamp type (or of an array of one) are
    clamped to outside a key column, as text: ``(max, min)`` (docs/merge.md, "Type mapping")."""
    element = typemap.array_element(pg_type) or pg_type
    if pa.types.is_date(arrow_type(element)):
        return _DATE_MAX, _DATE_MIN
    return _TIMESTAMP_MAX, _TIMESTAMP_MIN


def _convert_to(target: pa.DataType, values: Sequence[Any]) -> pa.Array:
    if pa.types.is_list(target):
        return _convert_array(target.value_type, values)
    text = _as_text(values)
    if pa.types.is_string(target):
        return text
    if pa.types.is_boolean(target):
        return _convert_bool(text)
    if pa.types.is_binary(target):
        return _convert_bytea(text.to_pylist())
    try:
        return pc.cast(text, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    if pa.types.is_date(target) or pa.types.is_timestamp(target):
        return _convert_temporal(text.to_pylist(), target)
    raise ValueConversionError(_first_bad(text.to_pylist(), lambda v: pc.cast(pa.array([v]), target)))


def _first_bad(values: Sequence[Any], check: Callable[[Any], Any]) -> str:
    for value in values:
        if value is None:
            continue
        try:
            check(value)
        except Exception:
            return f"cannot convert {value!r}"
    return "conversion failed"


_BOOLS = {"true": True, "t": True, "false": False, "f": False, None: None}


_BOOL_TEXTS = pa.array(["true", "t", "false", "f"])


def _convert_bool(text: pa.Array) -> pa.Array:
    # pgoutput prints t/f (two comparisons settle it: a third of the general check's time),
    # test_decoding true/false.
    is_t = pc.equal(text, "t")
    if pc.all(pc.or_(is_t, pc.equal(text, "f"))).as_py() is not False:
        return is_t
    known = pc.or_(pc.is_in(text, value_set=_BOOL_TEXTS), pc.is_null(text))
    if pc.all(known).as_py() is not False:
        return pc.equal(pc.utf8_slice_codeunits(text, 0, 1), "t")
    raise ValueConversionError(_first_bad(text.to_pylist(), lambda v: _BOOLS[v]))


def _bytea(value: str) -> bytes:
    if value.startswith("\\x"):
        return bytes.fromhex(value[2:])
    raise ValueError("bytea not in hex format")


def _convert_bytea(values: Sequence[Any]) -> pa.Array:
    try:
        return pa.array([None if v is None else _bytea(v) for v in values], pa.binary())
    except ValueError:
        raise ValueConversionError(
            _first_bad(values, _bytea) + " (bytea must be hex; the decoding session pins bytea_output=hex)"
        ) from None


def _convert_temporal(values: Sequence[Any], target: pa.DataType) -> pa.Array:
    """Slow path: infinities are clamped to the ends of the Arrow/Spark range; BC dates refused."""
    fixed: list[Any] = []
    for value in values:
        if value is None:
            fixed.append(None)
            continue
        bound = _INFINITIES.get(value)
        if bound is not None:
            if pa.types.is_date(target):
                fixed.append(_DATE_MAX if bound == "max" else _DATE_MIN)
            else:
                zone = "+00" if target.tz else ""
                fixed.append((_TIMESTAMP_MAX if bound == "max" else _TIMESTAMP_MIN) + zone)
            continue
        if value.endswith(" BC"):
            raise ValueConversionError(
                f"cannot stage {value!r}: dates before year 1 (BC) have no Spark form (Spark holds 0001-01-01 "
                "to 9999-12-31)"
            )
        if _YEAR_BEYOND_9999.match(value):
            raise ValueConversionError(
                f"cannot stage {value!r}: dates after year 9999 have no Spark form (Spark holds 0001-01-01 "
                "to 9999-12-31)"
            )
        fixed.append(value)
    try:
        return pc.cast(pa.array(fixed, pa.string()), target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise ValueConversionError(_first_bad(fixed, lambda v: pc.cast(pa.array([v]), target))) from None


_YEAR_BEYOND_9999 = re.compile(r"^\d{5,}-")


def _convert_array(element_type: pa.DataType, values: Sequence[Any]) -> pa.Array:
    text = _as_text(values)
    braced = pc.and_(pc.starts_with(text, "{"), pc.ends_with(text, "}"))
    if pc.all(braced).as_py() is not False:
        # The braces are ASCII: cutting them off bytewise leaves valid UTF-8.
        inner = pc.binary_slice(text.view(pa.binary()), 1, -1).view(pa.string())
        if _plain_braced(text) or not pc.any(pc.match_substring_regex(inner, r'["\\{}]')).as_py():
            return _convert_simple_arrays(element_type, text, inner)
    offsets = [0]
    elements: list[Any] = []
    mask: list[bool] = []
    for value in text.to_pylist():
        if value is None:
            mask.append(True)
            offsets.append(len(elements))
            continue
        mask.append(False)
        elements.extend(parse_array_literal(value))
        offsets.append(len(elements))
    flat = _convert_to(element_type, elements)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat, mask=pa.array(mask, pa.bool_()))


def _plain_braced(text: pa.Array) -> bool:
    """Whether no value of ``text`` (each one ``{...}``) holds a quote, a backslash or a brace
    inside, judged on the column's bytes at once: as many ``{`` and ``}`` as values and no ``"`` or
    ``\\`` (a few memchr passes, where a regular expression per value costs half the array's
    conversion). ``False`` only means "look closer": bytes under null slots count too."""
    if not pa.types.is_string(text.type) or len(text) == 0:
        return False
    _, offsets, data = text.buffers()
    if data is None:
        return False
    bounds = memoryview(offsets).cast("i")
    region = memoryview(data)[bounds[text.offset] : bounds[text.offset + len(text)]].tobytes()
    valid = len(text) - text.null_count
    return region.count(b"{") == valid and region.count(b"}") == valid and b'"' not in region and b"\\" not in region


def _convert_simple_arrays(element_type: pa.DataType, text: pa.Array, inner: pa.Array) -> pa.Array:
    """Vectorised path for arrays whose elements need no unquoting (the common case)."""
    empty = pc.equal(inner, "")
    lists = pc.split_pattern(pc.if_else(empty, pa.scalar(None, pa.string()), inner), ",")
    lengths = pc.fill_null(pc.list_value_length(lists), 0)
    offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(lengths).cast(pa.int64())])
    flat = pc.list_flatten(lists)
    flat = pc.if_else(pc.equal(flat, "NULL"), pa.scalar(None, pa.string()), flat)
    elements = _convert_to(element_type, flat)
    return pa.ListArray.from_arrays(offsets.cast(pa.int32()), elements, mask=pc.is_null(text))


def _as_text(values: Sequence[Any] | pa.Array) -> pa.Array:
    if isinstance(values, pa.Array):
        return values
    return pa.array(values, pa.string())


def parse_array_literal(text: str) -> list[str | None]:
    """Parse a one-dimensional PostgreSQL array literal into element texts (``None`` = NULL).

    Handles quoted elements with backslash escapes, unquoted ``NULL`` and explicit bounds
    (``[0:1]={a,b}``). Multi-dimensional arrays are refused with a clear error.
    """
    if text.startswith("["):
        eq = text.find("=")
        if eq < 0:
            raise ValueConversionError(f"malformed array literal {text[:80]!r}")
        text = text[eq + 1 :]
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueConversionError(f"malformed array literal {text[:80]!r}")
    if text == "{}":
        return []
    if '"' not in text and "\\" not in text and "{" not in text[1:]:
        # Fast path: no quoting, no nesting. PostgreSQL quotes elements with (ASCII) white
        # space around them, so unquoted ones are taken as they are, never stripped.
        return [None if t == "NULL" else t for t in text[1:-1].split(",")]
    if text.startswith("{{"):
        raise ValueConversionError(MULTI_DIMENSIONAL.format(text=text[:80]))
    out: list[str | None] = []
    pos = 1
    end = len(text) - 1
    while pos <= end:
        if text[pos] == '"':
            pos += 1
            chunks = []
            while True:
                quote = text.find('"', pos)
                backslash = text.find("\\", pos, quote if quote >= 0 else end)
                if quote < 0:
                    raise ValueConversionError(f"unterminated quoted element in {text[:80]!r}")
                if backslash >= 0:
                    chunks.append(text[pos:backslash])
                    chunks.append(text[backslash + 1])
                    pos = backslash + 2
                    continue
                chunks.append(text[pos:quote])
                pos = quote + 1
                break
            out.append("".join(chunks))
        else:
            comma = text.find(",", pos, end)
            stop = end if comma < 0 else comma
            token = text[pos:stop]
            if token == "{" or "{" in token:
                raise ValueConversionError(MULTI_DIMENSIONAL.format(text=text[:80]))
            out.append(None if token == "NULL" else token)
            pos = stop
        if pos < end and text[pos] == ",":
            pos += 1
        elif pos == end:
            break
        elif pos < end:
            raise ValueConversionError(f"malformed array literal {text[:80]!r}")
    return out


MULTI_DIMENSIONAL = (
    "multi-dimensional array {text!r} does not fit the column's one-dimensional list; stage the table's "
    "arrays as JSON text (table option arrays: json)"
)


def parse_array_nested(text: str) -> list[Any]:
    """Parse a PostgreSQL array literal of any number of dimensions into nested lists of element
    texts (``None`` = NULL). Explicit bounds (``[0:1][1:2]={...}``) are dropped."""
    if text.startswith("["):
        eq = text.find("=")
        if eq < 0:
            raise ValueConversionError(f"malformed array literal {text[:80]!r}")
        text = text[eq + 1 :]
    if not text.startswith("{"):
        raise ValueConversionError(f"malformed array literal {text[:80]!r}")
    value, pos = _parse_level(text, 0)
    if pos != len(text):
        raise ValueConversionError(f"malformed array literal {text[:80]!r}")
    return value


def _parse_level(text: str, pos: int) -> tuple[list[Any], int]:
    """One ``{...}`` starting at ``pos``; returns its items and the position after its ``}``."""
    out: list[Any] = []
    pos += 1
    end = len(text)
    if pos < end and text[pos] == "}":
        return out, pos + 1
    while pos < end:
        char = text[pos]
        if char == "{":
            item, pos = _parse_level(text, pos)
            out.append(item)
        elif char == '"':
            pos += 1
            chunks = []
            while pos < end and text[pos] != '"':
                if text[pos] == "\\" and pos + 1 < end:
                    pos += 1
                chunks.append(text[pos])
                pos += 1
            if pos >= end:
                raise ValueConversionError(f"unterminated quoted element in {text[:80]!r}")
            pos += 1
            out.append("".join(chunks))
        else:
            stop = pos
            while stop < end and text[stop] not in ",}":
                stop += 1
            token = text[pos:stop]
            out.append(None if token == "NULL" else token)
            pos = stop
        if pos < end and text[pos] == ",":
            pos += 1
            continue
        if pos < end and text[pos] == "}":
            return out, pos + 1
        break
    raise ValueConversionError(f"malformed array literal {text[:80]!r}")


def _json_element(element_type: pa.DataType) -> Callable[[str], Any]:
    if pa.types.is_integer(element_type):
        return int
    if pa.types.is_boolean(element_type):
        return lambda v: _BOOLS[v]
    if pa.types.is_floating(element_type):
        return lambda v: number if math.isfinite(number := float(v)) else v
    return lambda v: v


def _convert_arrays_to_json(element_type: pa.DataType, values: Sequence[Any]) -> pa.Array:
    """Arrays of any dimensions as JSON text (the table option ``arrays: json``; docs/merge.md)."""
    element = _json_element(element_type)

    def typed(item: Any) -> Any:
        if isinstance(item, list):
            return [typed(i) for i in item]
        return None if item is None else element(item)

    out: list[str | None] = []
    for value in _as_text(values).to_pylist():
        if value is None:
            out.append(None)
            continue
        try:
            out.append(json.dumps(typed(parse_array_nested(value)), ensure_ascii=False, separators=(",", ":")))
        except (KeyError, ValueError) as exc:
            if isinstance(exc, ValueConversionError):
                raise
            raise ValueConversionError(f"cannot convert {value[:80]!r} ({exc})") from None
    return pa.array(out, pa.string())


def python_value(pg_type: str, value: Any, staging: typemap.Staging = typemap.DEFAULT_STAGING) -> Any:
    """One value converted as staging would (for tests and tools; staging itself works column-wise)."""
    return convert_column(pg_type, [value], staging=staging)[0].as_py()


def json_value(pg_type: str, text: str, staging: typemap.Staging = typemap.DEFAULT_STAGING) -> Any:
    """The value PostgreSQL printed as ``text``, converted as staging converts it, in a JSON form
    the merge turns back into its Delta type: dates and timestamps as ISO 8601 text, ``bytea`` as
    hex, arrays as lists; numbers, booleans and text as themselves (a manifest's ``missing``)."""
    return _jsonable(python_value(pg_type, text, staging))


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


__all__ = [
    "arrow_type",
    "bad_values",
    "clamped_infinities",
    "convert_column",
    "infinity_bounds",
    "json_value",
    "parse_array_literal",
    "parse_array_nested",
    "python_value",
]
