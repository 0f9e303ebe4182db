"""PostgreSQL log sequence numbers."""

from __future__ import annotations

from typing import Any


class Lsn(int):
    """A WAL position: an unsigned 64-bit byte offset, written ``X/Y`` by PostgreSQL.

    Compare LSNs as numbers, never as strings (``'0/9' > '0/10'`` as text). Adding or
    subtracting an ``int`` moves by that many bytes; ``Lsn - Lsn`` is the distance in bytes.

    >>> Lsn.parse("16/B374D848") > Lsn.parse("16/B374D84")
    True
    >>> str(Lsn.parse("0/16B6C50") + 16)
    '0/16B6C60'
    >>> Lsn.parse("0/20") - Lsn.parse("0/10")
    16
    """

    __slots__ = ()

    MAX = (1 << 64) - 1

    def __new__(cls, value: int | str | Lsn = 0) -> Lsn:
        if isinstance(value, str):
            return cls.parse(value)
        value = int(value)
        if not 0 <= value <= cls.MAX:
            raise ValueError(f"LSN out of range (0 .. 2^64-1): {value}")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> Lsn:
        """Parse PostgreSQL's ``X/Y`` form (two hexadecimal halves of up to 8 digits each)."""
        high, sep, low = text.strip().partition("/")
        if not sep or not high or not low or len(high) > 8 or len(low) > 8:
            raise ValueError(f"not an LSN (expected X/Y in hexadecimal, like 0/16B6C50): {text!r}")
        try:
            return int.__new__(cls, (int(high, 16) << 32) | int(low, 16))
        except ValueError:
            raise ValueError(f"not an LSN (expected X/Y in hexadecimal, like 0/16B6C50): {text!r}") from None

    @classmethod
    def coerce(cls, value: Any) -> Lsn:
        """An LSN from an ``Lsn``, an ``int`` or an ``X/Y`` string."""
        if isinstance(value, Lsn):
            return value
        return cls(value)

    def __str__(self) -> str:
        value = int(self)
        return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"

    def __add__(self, other: object) -> Lsn:
        if isinstance(other, Lsn) or not isinstance(other, int):
            return NotImplemented
        return Lsn(int(self) + other)

    __radd__ = __add__

    def __sub__(self, other: object) -> Any:
        if isinstance(other, Lsn):
            return int(self) - int(other)
        if isinstance(other, int):
            return Lsn(int(self) - other)
        return NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        return (Lsn, (int(self),))


ZERO = Lsn(0)


def describe_bytes(n: int | None) -> str:
    """A byte count (a WAL distance, a slot's lag) in words: ``512 bytes``, ``1.5 MiB``."""
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} bytes"  # pragma: no cover
