"""The test oracle reads text-like columns as PostgreSQL prints them (their output function, as both
plugins send them), not as a ``::text`` cast, which differs for some types."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgdecode_testing.compare import source_rows

pytestmark = pytest.mark.postgres


def test_source_rows_are_the_output_functions_text(pg_conn: psycopg.Connection[Any]) -> None:
    c = pg_conn
    c.execute(
        "drop table if exists cmp_text; create table cmp_text (id int, host inet, doc xml, hosts inet[], dims inet[])"
    )
    c.execute(
        "insert into cmp_text values (1, '10.0.0.1', '<?xml version=\"1.0\"?><r/>', '{10.0.0.1,NULL,10.0.0.0/8}',"
        " '{{10.0.0.1},{::1}}'), (2, null, null, null, null), (3, '::1/128', '', '{}', '[0:0]={10.0.0.2}')"
    )
    names, rows = source_rows(c, "public", "cmp_text")
    assert names == ["id", "host", "doc", "hosts", "dims"]
    # host::text would be '10.0.0.1/32', doc::text would keep the XML declaration.
    assert sorted(rows) == [
        (1, "10.0.0.1", "<r/>", ["10.0.0.1", None, "10.0.0.0/8"], [["10.0.0.1/32"], ["::1/128"]]),
        (2, None, None, None, None),
        (3, "::1", "", [], ["10.0.0.2"]),
    ]
