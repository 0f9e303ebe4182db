from __future__ import annotations

import pickle

import pytest

from airflow_provider_pgdecode.decoding.lsn import Lsn


@pytest.mark.parametrize(
    "text, value",
    [
        ("0/0", 0),
        ("0/16B6C50", 0x16B6C50),
        ("16/B374D848", (0x16 << 32) | 0xB374D848),
        ("FFFFFFFF/FFFFFFFF", 2**64 - 1),
    ],
)
def test_parse_and_format_round_trip(text: str, value: int) -> None:
    lsn = Lsn.parse(text)
    assert int(lsn) == value
    assert str(lsn) == text
    assert Lsn(text) == lsn


def test_compares_numerically_not_as_text() -> None:
    assert Lsn.parse("0/9") < Lsn.parse("0/10")
    assert "0/9" > "0/10"  # why string comparison is wrong
    assert max(Lsn.parse("1/0"), Lsn.parse("0/FFFFFFFF")) == Lsn.parse("1/0")


def test_byte_arithmetic() -> None:
    lsn = Lsn.parse("0/FFFFFFF0")
    moved = lsn + 0x20
    assert isinstance(moved, Lsn)
    assert str(moved) == "1/10"
    assert moved - lsn == 0x20
    assert isinstance(moved - 0x20, Lsn)
    assert moved - 0x20 == lsn


@pytest.mark.parametrize("bad", ["", "0", "0/", "/0", "G/0", "0/1/2", "123456789/0", "x"])
def test_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="not an LSN"):
        Lsn.parse(bad)


def test_out_of_range() -> None:
    with pytest.raises(ValueError):
        Lsn(-1)
    with pytest.raises(ValueError):
        Lsn(2**64)


def test_pickles_and_coerces() -> None:
    lsn = Lsn.parse("2/A")
    assert pickle.loads(pickle.dumps(lsn)) == lsn
    assert isinstance(pickle.loads(pickle.dumps(lsn)), Lsn)
    assert Lsn.coerce("2/A") == lsn
    assert Lsn.coerce(int(lsn)) == lsn
    assert repr(lsn) == "Lsn('2/A')"
