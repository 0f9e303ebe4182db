"""The event model: RowImage, the unchanged-TOAST marker, and the lossless JSON form of transaction items."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import fields
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_provider_pgdecode.decoding.events import (
    UNCHANGED_TOAST,
    Begin,
    Change,
    Commit,
    Message,
    Operation,
    Prepare,
    RowImage,
    Truncate,
    item_from_json,
    item_to_json,
)
from airflow_provider_pgdecode.decoding.lsn import Lsn


def through_json(item: object) -> object:
    """What spooling does: item -> dict -> JSON text -> dict -> item."""
    text = json.dumps(item_to_json(item), ensure_ascii=False, separators=(",", ":"))  # type: ignore[arg-type]
    return item_from_json(json.loads(text))


def image(**columns: tuple[str, object]) -> RowImage:
    """``image(id=("integer", "1"))``: a row image from name=(type, value) in order."""
    return RowImage(
        tuple(columns),
        tuple(t for t, _ in columns.values()),
        tuple(v for _, v in columns.values()),  # type: ignore[misc]
    )


# --- the unchanged-TOAST marker ----------------------------------------------------------------


def test_unchanged_toast_is_one_object_through_copies_and_pickles() -> None:
    marker_type = type(UNCHANGED_TOAST)
    assert marker_type() is UNCHANGED_TOAST
    assert copy.copy(UNCHANGED_TOAST) is UNCHANGED_TOAST
    assert copy.deepcopy(UNCHANGED_TOAST) is UNCHANGED_TOAST
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(UNCHANGED_TOAST, protocol)) is UNCHANGED_TOAST
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST"
    # It is neither NULL nor any text: a consumer cannot confuse it with a real value.
    assert UNCHANGED_TOAST is not None and not isinstance(UNCHANGED_TOAST, str)


def test_a_pickled_image_keeps_the_marker_identity() -> None:
    row = image(id=("integer", "1"), big=("text", UNCHANGED_TOAST), small=("integer", None))
    back = pickle.loads(pickle.dumps(row))
    assert back == row
    assert back.values[1] is UNCHANGED_TOAST
    assert back.unchanged_toast_columns() == ("big",)


# --- RowImage ----------------------------------------------------------------------------------


def test_row_image_as_dict_keeps_table_order_nulls_and_markers() -> None:
    row = image(id=("integer", "7"), note=("text", None), big=("text", UNCHANGED_TOAST), tag=("text", "null"))
    as_dict = row.as_dict()
    assert list(as_dict) == ["id", "note", "big", "tag"]
    assert as_dict["id"] == "7"
    assert as_dict["note"] is None  # SQL NULL
    assert as_dict["tag"] == "null"  # the text 'null', not NULL
    assert as_dict["big"] is UNCHANGED_TOAST


def test_unchanged_toast_columns_lists_only_marked_columns_in_order() -> None:
    row = image(a=("text", UNCHANGED_TOAST), b=("text", None), c=("text", ""), d=("bytea", UNCHANGED_TOAST))
    assert row.unchanged_toast_columns() == ("a", "d")
    assert image(a=("text", None), b=("text", "")).unchanged_toast_columns() == ()


def test_events_are_slotted_they_take_no_stray_attributes() -> None:
    for event in (
        Begin(Lsn(1), 5),
        Commit(Lsn(2), 5),
        Change(Lsn(3), 5, Operation.INSERT, "public", "t", None, image(id=("integer", "1"))),
        Truncate(Lsn(4), 5, (("public", "t"),)),
        Message(Lsn(5), 5, True, "p", b"x"),
        Prepare(Lsn(6), 5, "g"),
    ):
        assert not hasattr(event, "__dict__")
        with pytest.raises(AttributeError):
            event.not_a_field = 1  # type: ignore[attr-defined]


def test_operation_values_are_the_staged_op_letters() -> None:
    assert [op.value for op in Operation] == ["I", "U", "D"]
    assert Operation("U") is Operation.UPDATE


# --- JSON form: every item kind round trips exactly --------------------------------------------


def test_insert_round_trips() -> None:
    item = Change(
        Lsn.parse("16/B374D848"),
        731,
        Operation.INSERT,
        "public",
        "Odd Tbl",
        None,
        image(id=("integer", "1"), **{"Col A": ("text", 'it\'s a "test"\nline2')}, n=("numeric", "NaN")),
    )
    back = through_json(item)
    assert back == item
    assert isinstance(back.lsn, Lsn) and back.lsn == Lsn.parse("16/B374D848")
    assert back.operation is Operation.INSERT
    assert back.old is None


def test_update_with_old_key_and_unchanged_toast_round_trips() -> None:
    item = Change(
        Lsn(0x20),
        9,
        Operation.UPDATE,
        "sales",
        "docs",
        image(id=("integer", "1")),
        image(id=("integer", "10"), big=("text", UNCHANGED_TOAST), small=("integer", None)),
    )
    back = through_json(item)
    assert back == item
    assert back.new.values[1] is UNCHANGED_TOAST  # the marker, not a dict or None
    assert back.new.values[2] is None
    assert back.new.unchanged_toast_columns() == ("big",)


def test_delete_without_tuple_data_round_trips() -> None:
    item = Change(Lsn(0x30), None, Operation.DELETE, "public", "nokey", None, None, has_tuple_data=False)
    back = through_json(item)
    assert back == item
    assert back.has_tuple_data is False
    assert back.xid is None


def test_text_that_looks_like_the_marker_stays_text() -> None:
    # The JSON form marks TOAST with an object; a text value spelling it must not turn into the marker.
    tricky = json.dumps({"$toast": True})
    item = Change(
        Lsn(1), 1, Operation.INSERT, "public", "t", None, image(j=("jsonb", tricky), u=("text", "UNCHANGED_TOAST"))
    )
    back = through_json(item)
    assert back.new.values == (tricky, "UNCHANGED_TOAST")
    assert back.new.unchanged_toast_columns() == ()


def test_datetime_values_stay_the_text_postgres_printed() -> None:
    # Values are kept as text; a timestamp survives byte for byte (no reformatting, no time zone shift).
    stamps = ("2024-01-02 03:04:05.123456+00", "infinity", "0044-03-15 12:00:00 BC", "2024-02-29")
    item = Change(
        Lsn(2),
        2,
        Operation.INSERT,
        "public",
        "t",
        None,
        image(
            a=("timestamp with time zone", stamps[0]),
            b=("timestamp without time zone", stamps[1]),
            c=("timestamp without time zone", stamps[2]),
            d=("date", stamps[3]),
        ),
    )
    assert through_json(item).new.values == stamps


def test_truncate_round_trips_with_flags() -> None:
    for cascade in (False, True):
        for restart in (False, True):
            item = Truncate(Lsn(0x40), 12, (("public", "a"), ("Weird Schema", "b.c")), cascade, restart)
            back = through_json(item)
            assert back == item
            assert isinstance(back.relations, tuple) and all(isinstance(r, tuple) for r in back.relations)


@pytest.mark.parametrize("content", [b"", b"plain", bytes(range(256)), "héllo, sz: 3\n".encode(), b"\x00\xff\x00"])
def test_message_bytes_round_trip(content: bytes) -> None:
    for transactional in (True, False):
        item = Message(Lsn(0x50), 77 if transactional else None, transactional, "pfx.ü", content)
        back = through_json(item)
        assert back == item
        assert type(back.content) is bytes and back.content == content


def test_json_form_is_plain_json() -> None:
    item = Message(Lsn(1), 1, True, "p", bytes(range(256)))
    data = item_to_json(item)
    assert json.loads(json.dumps(data)) == data  # only JSON types (bytes are base64 text)
    assert all(isinstance(k, str) for k in data)


def test_largest_lsn_round_trips() -> None:
    item = Truncate(Lsn(Lsn.MAX), 1, (("public", "t"),))
    assert through_json(item).lsn == Lsn.MAX


def test_item_to_json_refuses_events_that_are_not_transaction_items() -> None:
    for event in (Begin(Lsn(1), 1), Commit(Lsn(1), 1, datetime(2024, 1, 1, tzinfo=UTC)), Prepare(Lsn(1), 1, "g")):
        with pytest.raises(TypeError, match="not a transaction item"):
            item_to_json(event)  # type: ignore[arg-type]


def test_item_from_json_refuses_unknown_kinds() -> None:
    data = item_to_json(Truncate(Lsn(1), 1, (("public", "t"),)))
    data["k"] = "commit"
    with pytest.raises(ValueError, match="unknown transaction item kind 'commit'"):
        item_from_json(data)


# --- a property: any change built from the model's value space round trips ----------------------

_values = st.one_of(st.none(), st.just(UNCHANGED_TOAST), st.text())
_names = st.text(min_size=1, max_size=8)


@st.composite
def _images(draw: st.DrawFn) -> RowImage | None:
    if draw(st.booleans()):
        return None
    names = draw(st.lists(_names, max_size=6, unique=True))
    types = [
        draw(st.sampled_from(["integer", "text", "bytea", "timestamp with time zone", "text[]", "mood"])) for _ in names
    ]
    values = [draw(_values) for _ in names]
    return RowImage(tuple(names), tuple(types), tuple(values))


@given(
    lsn=st.integers(0, Lsn.MAX),
    xid=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    op=st.sampled_from(list(Operation)),
    schema=st.text(),
    table=st.text(),
    old=_images(),
    new=_images(),
    has_tuple=st.booleans(),
)
def test_any_change_round_trips(lsn, xid, op, schema, table, old, new, has_tuple) -> None:
    item = Change(Lsn(lsn), xid, op, schema, table, old, new, has_tuple)
    back = through_json(item)
    assert back == item
    for before, after in ((item.old, back.old), (item.new, back.new)):
        if before is not None:
            assert after.unchanged_toast_columns() == before.unchanged_toast_columns()
            assert [v is None for v in after.values] == [v is None for v in before.values]


def test_every_item_kind_is_covered_by_the_json_form() -> None:
    # TransactionItem is Change | Truncate | Message; each has a JSON kind and every field survives.
    samples = [
        Change(
            Lsn(1),
            2,
            Operation.UPDATE,
            "s",
            "t",
            image(k=("integer", "1")),
            image(k=("integer", "2"), v=("text", UNCHANGED_TOAST)),
        ),
        Truncate(Lsn(3), 4, (("s", "t"),), True, True),
        Message(Lsn(5), 6, True, "p", b"\x00"),
    ]
    kinds = set()
    for item in samples:
        data = item_to_json(item)
        kinds.add(data["k"])
        back = item_from_json(data)
        assert type(back) is type(item)
        for f in fields(item):
            assert getattr(back, f.name) == getattr(item, f.name), f.name
    assert kinds == {"change", "truncate", "message"}
