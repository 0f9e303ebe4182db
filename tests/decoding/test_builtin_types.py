"""pgoutput sends a Type message for no type below OID 10000 (FirstGenbkiObjectId): the parser
names those from BUILTIN_TYPE_NAMES, which must hold every one a column can have, as each server
names it (a missing one made every probe and extract of such a table fail: issue 35)."""

from __future__ import annotations

import pytest

from airflow_provider_pgdecode.decoding.pgoutput import BUILTIN_TYPE_NAMES

pytestmark = pytest.mark.postgres


@pytest.mark.pg_matrix
def test_every_builtin_type_of_the_server_is_named_as_it_names_it(pg_conn) -> None:
    rows = pg_conn.execute(
        "select oid::int, format_type(oid, NULL) from pg_type where oid < 10000 and typtype <> 'p'"
    ).fetchall()
    server = dict(rows)
    assert len(server) > 150
    assert {oid: BUILTIN_TYPE_NAMES.get(oid) for oid in server} == server
    # Nothing named that the server does not have (a stale or mistyped entry).
    assert set(BUILTIN_TYPE_NAMES) <= set(server)
