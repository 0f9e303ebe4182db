"""Errors pgdecode raises. Each message says what is wrong and what to do about it."""

from __future__ import annotations


class PgDecodeError(Exception):
    """Base class of every pgdecode error."""


class DecodingError(PgDecodeError):
    """A row from the slot could not be parsed (a malformed or unexpected line)."""

    def __init__(self, message: str, *, lsn: object = None, data: str | bytes | None = None) -> None:
        detail = message
        if lsn is not None:
            detail += f" (row at LSN {lsn})"
        if data is not None:
            shown = data if len(data) <= 300 else data[:300] + ("..." if isinstance(data, str) else b"...")
            detail += f": {shown!r}"
        super().__init__(detail)
        self.lsn = lsn
        self.data = data


class AssemblyError(PgDecodeError):
    """The events of a slot do not form valid transactions (or need state that was lost)."""


class SlotError(PgDecodeError):
    """A replication slot is missing, of the wrong kind, lost, or cannot be used as asked."""


class CatalogError(PgDecodeError):
    """A source table cannot be staged as asked (no usable key, a reserved column name, ...)."""


class StagingError(PgDecodeError):
    """A batch cannot be written or read back (incomplete, malformed, or inconsistent)."""


class ValueConversionError(StagingError):
    """A decoded value cannot be converted to its staged type."""
