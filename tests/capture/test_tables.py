"""Table selection: names and glob patterns, checked when written and expanded against a real
PostgreSQL catalog when a run starts (capture/tables.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.tables import (
    TableSelection,
    later_tables,
    parse_table_names,
    parse_table_pattern,
    resolve_tables,
    select_tables,
)
from airflow_provider_pgdecode.errors import CatalogError, ConfigurationError
from airflow_provider_pgdecode.postgres.catalog import Catalog
from airflow_provider_pgdecode.postgres.slot import SlotClient


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("public.orders", ("public", "orders")),
        ("orders", ("public", "orders")),
        ("public.order_*", ("public", "order_*")),
        ("sales.*", ("sales", "*")),
        ("*.orders", ("*", "orders")),
        ("public.t_202[45]", ("public", "t_202[45]")),
        ("public.t_[!0-9]?", ("public", "t_[!0-9]?")),
        ("Sales.Big$Table", ("Sales", "Big$Table")),
    ],
)
def test_valid_names_and_patterns(text: str, parts: tuple[str, str]) -> None:
    assert parse_table_pattern(text) == parts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("public.order%", "SQL's % is no wildcard here: use *"),
        ("public.order_.*", "'.*' is written '*'"),
        ("a.b.c", "more than one '.'"),
        ("public.", "the schema or the table part is empty"),
        (".orders", "the schema or the table part is empty"),
        ("public.order_[", "'[' is not closed by ']'"),
        ("public.order_]", "']' without '['"),
        ("public.t_[]", "'[]' matches no character"),
        ("public.(a|b)", "not a regular expression"),
        ("public.{a,b}", "braces are not expanded"),
        ("public.a,public.b", "one entry per table"),
        (" public.orders", "white space"),
        ('"Public".orders', "without SQL quotes"),
        ("", "non-empty string"),
    ],
)
def test_bad_patterns_say_why_and_what_a_valid_one_looks_like(text: str, why: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_table_pattern(text)
    message = str(info.value)
    assert why in message and f"{text!r} is not a valid table name or pattern" in message
    assert "'public.order_*'" in message  # an example of a valid one


def test_a_schema_can_be_required() -> None:
    with pytest.raises(ConfigurationError, match=r"names no schema \(write 'public.orders'"):
        parse_table_pattern("orders", require_schema=True)


def test_a_selection_matches_names_and_patterns_without_crossing_the_dot() -> None:
    selection = TableSelection.parse(["public.orders", ("odd", "a.b"), "sales.inv*", "*.log_?"])
    assert selection.matches("public", "orders") and selection.matches("odd", "a.b")
    assert selection.matches("sales", "invoices") and selection.matches("x", "log_1")
    assert not selection.matches("sales", "refunds") and not selection.matches("public", "log_10")
    assert not TableSelection.parse(["public.*"]).matches("public.x", "y")  # * stays in its part
    assert not TableSelection.parse([]) and TableSelection.parse(["a.*"])


def test_names_only_below_the_expansion() -> None:
    """The extract and the snapshots take names: a pattern that was not expanded is refused,
    since as a name it would match no table and load nothing, silently."""
    assert parse_table_names(["public.orders", "items"]) == {("public", "orders"), ("public", "items")}
    with pytest.raises(ConfigurationError, match="table patterns are expanded"):
        parse_table_names(["public.orders", "public.order_*"])


# --- expanded against a real catalog -------------------------------------------------------------


@pytest.fixture
def database(pg_cluster: Any) -> Iterator[psycopg.Connection[Any]]:
    """A database of its own: patterns see only this test's tables."""
    name = f"tbl_{uuid.uuid4().hex[:10]}"
    pg_cluster.create_database(name)
    with pg_cluster.connect(name) as conn:
        conn.execute(
            "CREATE SCHEMA sales;"
            " CREATE TABLE public.orders (id int PRIMARY KEY);"
            " CREATE TABLE public.order_items (id int PRIMARY KEY);"
            " CREATE TABLE public.order_archive (id int PRIMARY KEY);"
            " CREATE TABLE public.customers (id int PRIMARY KEY);"
            " CREATE TABLE public.order_log (at int, what text);"  # no key
            " CREATE TABLE sales.invoices (id int PRIMARY KEY);"
            " CREATE TABLE sales.refunds (id int PRIMARY KEY);"
            " CREATE PUBLICATION pub FOR TABLE public.orders, public.order_items, sales.invoices"
        )
        yield conn


def test_patterns_expand_against_the_catalog(database: psycopg.Connection[Any]) -> None:
    asked: list[int] = []

    def catalog() -> Catalog:
        asked.append(1)
        return Catalog(database)

    tables = resolve_tables(
        catalog,
        ["public.order_*", "public.orders", "sales.*"],
        exclude_tables=["public.order_archive", "*.refu*"],
        table_options={"public.order_log": {"mode": "append_only"}},
    )
    assert tables == [
        ("public", "order_items"),
        ("public", "order_log"),
        ("public", "orders"),
        ("sales", "invoices"),
    ]
    # names only: taken as given, the catalog is not asked (a renamed table keeps its old name)
    asked.clear()
    assert resolve_tables(catalog, ["public.gone", "orders"], exclude_tables=["public.gone"]) == [("public", "orders")]
    assert asked == []
    # nothing named: every table (the key rule applies), excluded ones by pattern left out
    assert resolve_tables(catalog, [], exclude_tables=["public.order_*", "sales.*"]) == [
        ("public", "customers"),
        ("public", "orders"),
    ]
    assert select_tables(Catalog(database), exclude_tables=["*.*"]) == []


def test_with_a_publication_patterns_see_its_tables_only(database: psycopg.Connection[Any]) -> None:
    tables = resolve_tables(lambda: Catalog(database), ["public.order*", "sales.*"], publication="pub")
    assert tables == [("public", "order_items"), ("public", "orders"), ("sales", "invoices")]
    with pytest.raises(CatalogError) as info:
        resolve_tables(lambda: Catalog(database), ["public.customer*"], publication="pub")
    assert "publication 'pub'" in str(info.value) and "add the tables to the publication" in str(info.value)


def test_a_pattern_matching_no_table_names_it_and_the_tables_there_are(database: psycopg.Connection[Any]) -> None:
    with pytest.raises(CatalogError) as info:
        resolve_tables(lambda: Catalog(database), ["public.orders", "public.ordr_*", "shop.*"])
    message = str(info.value)
    assert "table pattern(s) 'public.ordr_*', 'shop.*' match no table of database 'tbl_" in message
    assert "Tables there: public.customers, public.order_archive" in message and "sales.refunds" in message
    assert "nothing was staged" in message and "Correct the pattern" in message
    # a pattern whose tables are all excluded matched: no error, nothing from it
    assert resolve_tables(lambda: Catalog(database), ["sales.*"], exclude_tables=["sales.*"]) == []


def test_a_pattern_brings_the_key_rule_with_it(database: psycopg.Connection[Any]) -> None:
    """A keyless table a pattern matches is refused by name, as with no tables named; a name is
    the user's explicit choice and is taken as given (the extract checks it later)."""
    with pytest.raises(CatalogError) as info:
        resolve_tables(lambda: Catalog(database), ["public.order_*"])
    assert "1 table(s) cannot be loaded" in str(info.value) and "public.order_log" in str(info.value)
    assert resolve_tables(lambda: Catalog(database), ["public.order_log"]) == [("public", "order_log")]


def test_later_tables_follow_the_selection_minus_the_exclusions() -> None:
    assert later_tables(["public.orders", ("sales", "x")]) is None  # names only: nothing is added
    by_pattern = later_tables(["public.orders", "public.order_*"], ["public.order_tmp*"])
    assert by_pattern is not None
    assert by_pattern("public", "order_notes") and not by_pattern("public", "order_tmp1")
    assert not by_pattern("public", "orders_2") and not by_pattern("sales", "order_x")
    every = later_tables([], ["sales.*"])
    assert every is not None and every("public", "anything") and not every("sales", "invoices")


@pytest.mark.parametrize("native", [True, False])
def test_a_table_created_while_a_run_reads_the_slot_is_staged_when_the_selection_takes_it(
    database: psycopg.Connection[Any], tmp_path: Any, native: bool
) -> None:
    """The run chose its tables before the table existed: a pattern (or every table) takes it
    from its first change, a list of names leaves it out and says so, and the key rule holds."""
    slot = f"later_{uuid.uuid4().hex[:8]}"
    SlotClient(database).create(slot)
    options = {"public.order_log": {"mode": "append_only"}}
    chosen = resolve_tables(lambda: Catalog(database), ["public.order_*"], table_options=options)
    assert ("public", "order_notes") not in chosen
    database.execute("CREATE TABLE public.order_notes (id int PRIMARY KEY, note text)")
    database.execute("INSERT INTO public.order_notes VALUES (1, 'a'), (2, 'b')")
    database.execute("INSERT INTO public.orders VALUES (1)")  # not matched by the pattern
    database.execute("INSERT INTO public.order_items VALUES (7)")

    def extract(name: str, tables: list[Any], later: Any) -> Any:
        return extract_batch(
            database, slot, tmp_path / name, tables=tables, later_tables=later, table_options=options, native=native
        )

    manifest = extract("pattern", chosen, later_tables(["public.order_*"]))
    staged = {(t.schema, t.table): t.rows for t in manifest.tables}
    assert staged == {("public", "order_items"): 1, ("public", "order_notes"): 2}
    assert manifest.excluded_tables == ["public.orders"]
    assert manifest.skipped["excluded_table_changes"] == 1

    named = extract("names", [("public", "order_items")], later_tables(["public.order_items"]))
    assert {(t.schema, t.table) for t in named.tables} == {("public", "order_items")}
    assert named.excluded_tables == ["public.order_notes", "public.orders"]

    # A keyless table the pattern takes is refused by name, as it would be at the run's start.
    database.execute("CREATE TABLE public.order_tmp (a int)")
    database.execute("INSERT INTO public.order_tmp VALUES (1)")
    with pytest.raises(CatalogError, match="order_tmp"):
        extract("keyless", chosen, later_tables(["public.order_*"]))
    assert not any((tmp_path / "keyless").rglob("manifest.json"))
