"""Typed staging of decoded values: PostgreSQL text output to Arrow arrays, column-wise.

The decoding core keeps values as the text PostgreSQL printed. Here each column of a batch
part is converted at once, with Arrow's vectorised casts where they parse PostgreSQL's text
exactly (integers, floats, dates, timestamps) and small Python functions where they do not
(booleans, bytea, arrays, infinities). The mapping is documented in docs/staging-format.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from airflow_provider_pgdecode.errors import ValueConversionError

Converter = Callable[[Sequence[Any]], pa.Array]

_TIMESTAMP_MAX = "9999-12-31 23:59:59.999999"
_TIMESTAMP_MIN = "0001-01-01 00:00:00"
_INFINITIES = {
    "infinity": "max",
    "-infinity": "min",
}

_SCALAR_TYPES: dict[str, pa.DataType] = {
    "smallint": pa.int16(),
    "integer": pa.int32(),
    "bigint": pa.int64(),
    "oid": pa.int64(),
    "real": pa.float32(),
    "double precision": pa.float64(),
    "boolean": pa.bool_(),
    "date": pa.date32(),
    "timestamp without time zone": pa.timestamp("us"),
    "timestamp with time zone": pa.timestamp("us", tz="UTC"),
    "bytea": pa.binary(),
}

# Array element types whose literal uses a delimiter other than ',' (box uses ';'): staged as text.
_TEXT_ONLY_ARRAYS = {"box[]"}


def arrow_type(pg_type: str) -> pa.DataType:
    """The Arrow type a column of PostgreSQL type ``pg_type`` (format_type's name) is staged as."""
    if pg_type.endswith("[]") and pg_type not in _TEXT_ONLY_ARRAYS:
        return pa.list_(arrow_type(pg_type[:-2]))
    return _SCALAR_TYPES.get(pg_type, pa.string())


def convert_column(pg_type: str, values: Sequence[Any], column: str = "?") -> pa.Array:
    """Convert one column's text values (``None`` = NULL) to an Arrow array of :func:`arrow_type`."""
    try:
        return _convert(pg_type, values)
    except ValueConversionError as exc:
        raise ValueConversionError(f"column {column!r} ({pg_type}): {exc}") from None


def _convert(pg_type: str, values: Sequence[Any]) -> pa.Array:
    if pg_type.endswith("[]") and pg_type not in _TEXT_ONLY_ARRAYS:
        return _convert_array(pg_type[:-2], values)
    target = _SCALAR_TYPES.get(pg_type)
    text = _as_text(values)
    if target is None:
        return text
    if pg_type == "boolean":
        return _convert_bool(text)
    if pg_type == "bytea":
        return _convert_bytea(text.to_pylist())
    try:
        return pc.cast(text, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    if pg_type in ("date", "timestamp without time zone", "timestamp with time zone"):
        return _convert_temporal(pg_type, text.to_pylist(), target)
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
    # test_decoding prints true/false, pgoutput t/f.
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


def _convert_temporal(pg_type: str, values: Sequence[Any], target: pa.DataType) -> pa.Array:
    """Slow path: infinities are clamped to the ends of the Arrow/Spark range; BC dates refused."""
    fixed: list[Any] = []
    for value in values:
        if value is None:
            fixed.append(None)
            continue
        bound = _INFINITIES.get(value)
        if bound is not None:
            if pg_type == "date":
                fixed.append("9999-12-31" if bound == "max" else "0001-01-01")
            else:
                zone = "+00" if target.tz else ""
                fixed.append((_TIMESTAMP_MAX if bound == "max" else _TIMESTAMP_MIN) + zone)
            continue
        if value.endswith(" BC"):
            raise ValueConversionError(f"cannot stage {value!r}: dates before year 1 have no Arrow or Spark form")
        fixed.append(value)
    try:
        return pc.cast(pa.array(fixed, pa.string()), target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise ValueConversionError(_first_bad(fixed, lambda v: pc.cast(pa.array([v]), target))) from None


def _convert_array(element_type: str, values: Sequence[Any]) -> pa.Array:
    text = _as_text(values)
    inner = pc.utf8_slice_codeunits(text, 1, -1)
    braced = pc.and_(pc.starts_with(text, "{"), pc.ends_with(text, "}"))
    special = pc.match_substring_regex(inner, r'["\\{}]')
    if pc.all(braced).as_py() is not False and not pc.any(special).as_py():
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
    flat = _convert(element_type, elements)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat, mask=pa.array(mask, pa.bool_()))


def _convert_simple_arrays(element_type: str, text: pa.Array, inner: pa.Array) -> pa.Array:
    """Vectorised path for arrays whose elements need no unquoting (the common case)."""
    empty = pc.equal(inner, "")
    lists = pc.split_pattern(pc.if_else(empty, pa.scalar(None, pa.string()), inner), ",")
    lengths = pc.fill_null(pc.list_value_length(lists), 0)
    offsets = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(lengths).cast(pa.int64())])
    flat = pc.list_flatten(lists)
    flat = pc.if_else(pc.equal(flat, "NULL"), pa.scalar(None, pa.string()), flat)
    elements = _convert(element_type, flat)
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
        raise ValueConversionError(
            f"multi-dimensional array {text[:80]!r} cannot be staged; only one-dimensional arrays are supported"
        )
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
                raise ValueConversionError(f"multi-dimensional array {text[:80]!r} cannot be staged")
            out.append(None if token == "NULL" else token)
            pos = stop
        if pos < end and text[pos] == ",":
            pos += 1
        elif pos == end:
            break
        elif pos < end:
            raise ValueConversionError(f"malformed array literal {text[:80]!r}")
    return out


def python_value(pg_type: str, value: Any) -> Any:
    """One value converted as staging would (for tests and tools; staging itself works column-wise)."""
    return convert_column(pg_type, [value])[0].as_py()


__all__ = ["arrow_type", "convert_column", "parse_array_literal", "python_value"]
