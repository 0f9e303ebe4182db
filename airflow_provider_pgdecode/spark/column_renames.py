"""A column renamed in the source is renamed in Delta, its values kept (``RENAME COLUMN``).

A column's name changes; its attribute number (``pg_attribute.attnum``) does not. The extract
records each live column's number in the manifest (``attnum``), and the merge records the
numbers it has seen in the Delta table's property ``pgdecode.columnNumbers`` (name -> number,
former names kept). A manifest column whose number the Delta table holds under another name is
that column renamed: the merge renames the Delta column (column mapping, a metadata change, the
data files stay) before it writes, and reads values staged under the former name (changes
decoded before the ``ALTER``) as the new one. A column dropped and added again under its old name
has a new number: it is not a rename. Pure functions over names and numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

NUMBERS_PROPERTY = "pgdecode.columnNumbers"


def recorded_numbers(properties: Mapping[str, str]) -> dict[str, int]:
    """The column numbers a Delta table's property holds (name -> attnum; empty when none)."""
    text = properties.get(NUMBERS_PROPERTY)
    return {str(k): int(v) for k, v in json.loads(text).items()} if text else {}


def staged_numbers(columns: Iterable[tuple[str, int | None]]) -> dict[str, int]:
    """Live columns' numbers from the manifests' (name, attnum) pairs, newest last."""
    return {name: attnum for name, attnum in columns if attnum is not None}


def renames(
    live: Mapping[str, int], recorded: Mapping[str, int], delta_columns: Iterable[str]
) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """``(to_rename, staged_as)``: Delta columns to rename (former name -> name now), and for each
    column now named ``N`` the former names its earlier changes may be staged under.

    ``live``: the manifests' columns with their numbers now; ``recorded``: the Delta table's
    numbers; ``delta_columns``: its column names."""
    in_delta = set(delta_columns)
    to_rename: dict[str, str] = {}
    staged_as: dict[str, tuple[str, ...]] = {}
    for name, attnum in live.items():
        former = tuple(old for old, number in recorded.items() if number == attnum and old != name and old not in live)
        if not former:
            continue
        held = [old for old in former if old in in_delta]
        if name not in in_delta and len(held) == 1:
            to_rename[held[0]] = name
        staged_as[name] = former
    return to_rename, staged_as


def numbers_after(recorded: Mapping[str, int], live: Mapping[str, int]) -> dict[str, int]:
    """The property's numbers once this run's are added (former names stay: a later run may still
    read changes staged under them)."""
    return {**recorded, **live}


def numbers_property(numbers: Mapping[str, int]) -> str:
    return json.dumps(dict(sorted(numbers.items())), separators=(",", ":"))
