"""``"char"`` values PostgreSQL 14 prints as bytes that are not text.

A ``"char"`` holds one byte. PostgreSQL 15 and later print a byte above 127 as a backslash and
three octal digits (``'ü'::"char"`` stores 0xC3 and prints ``\\303``); PostgreSQL 14 prints the
byte itself, which in a UTF-8 database is not UTF-8, in both plugins' output and in COPY's. Such
a value is read here as the newer servers print it, so a ``"char"`` column stages the same text
whatever the server's version (and an upgrade from 14 changes nothing in Delta). In an array,
the element is quoted as PostgreSQL 15 prints it (``{"\\\\303",a}``).

Any other value that is not valid in the database's encoding is not something PostgreSQL prints
(its other types' output functions validate text): :class:`InvalidText` says which column.
"""

from __future__ import annotations

CHAR = '"char"'
CHAR_ARRAY = '"char"[]'
CHAR_TYPES = frozenset({CHAR, CHAR_ARRAY})
"""The ``"char"`` type and its array, as ``format_type`` names them (both plugins' type names)."""


class InvalidText(ValueError):
    """A value of a type other than ``"char"`` whose bytes are not valid in the database encoding."""


def _octal(byte: int, in_array: bool) -> str:
    escaped = f"\\{byte:03o}"
    return f'"\\{escaped}"' if in_array else escaped


def char_text(raw: bytes, pg_type: str, encoding: str = "utf-8", column: str = "?") -> str:
    """``raw`` (a value's bytes as the server printed them) as text: decoded in ``encoding``, and
    for a ``"char"`` (or ``"char"[]``) each byte that does not decode as PostgreSQL 15+ prints it.
    :class:`InvalidText` for another type's undecodable value."""
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        if pg_type not in CHAR_TYPES:
            raise InvalidText(
                f"the value of column {column!r} ({pg_type}) is not valid {encoding} text ({exc.reason} at byte "
                f"{exc.start}): PostgreSQL printed bytes its encoding does not allow"
            ) from None
    text = raw.decode(encoding, "surrogateescape")  # each undecodable byte as U+DC80..U+DCFF
    in_array = pg_type == CHAR_ARRAY
    return "".join(_octal(ord(c) - 0xDC00, in_array) if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


def has_undecodable(text: str) -> bool:
    """Whether ``text`` (decoded with ``surrogateescape``) holds a byte its encoding did not allow."""
    return any(0xDC80 <= ord(c) <= 0xDCFF for c in text)


__all__ = ["CHAR", "CHAR_ARRAY", "CHAR_TYPES", "InvalidText", "char_text", "has_undecodable"]
