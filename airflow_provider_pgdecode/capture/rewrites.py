"""Tables rewritten without their rows in the WAL: found at the extract, resnapshotted or refused.

Logical decoding carries row changes only. Some statements change a table's rows without
one: a volatile ``ADD COLUMN … DEFAULT`` (``random()``: every old row gets its own value), a
rewriting ``ALTER COLUMN … TYPE … USING``, and ``DROP TABLE`` + ``CREATE TABLE`` of the same
name (a new table whose Delta table holds the old one's rows). Each leaves a mark in the
catalog: a rewrite gives the table a new file node *and* changes its columns (a ``VACUUM FULL``,
``CLUSTER`` or ``TRUNCATE`` changes the file node only, and keeps the rows as decoded), and a
re-created table has a new OID where the same Delta table was fed by one now gone. The extract
records each staged table's file node and column signature with its OID (the manifest's
``table_oids``) and compares them with the catalog in every run. A table found rewritten is
handled by its ``on_rewrite`` option: ``resnapshot`` files a resnapshot request (the next runs
copy the table, replacing its Delta rows), ``stop`` stops the run until one is filed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from airflow_provider_pgdecode.batch.options import TableOptions, options_for
from airflow_provider_pgdecode.batch.storage import Storage
from airflow_provider_pgdecode.capture.renames import KnownTables
from airflow_provider_pgdecode.capture.table_snapshot import (
    list_snapshot_requests,
    read_snapshot_state,
    request_table_snapshot,
)
from airflow_provider_pgdecode.errors import CatalogError
from airflow_provider_pgdecode.postgres.catalog import Catalog

log = logging.getLogger(__name__)

Name = tuple[str, str]


@dataclass(frozen=True)
class Rewrite:
    """A table whose rows changed without row changes in the WAL."""

    name: Name
    """Its name now."""
    oid: int
    why: str


def find_rewrites(catalog: Catalog, known: KnownTables) -> list[Rewrite]:
    """The known tables rewritten or re-created since their last staged batch; records every
    live known table's file node and columns in ``known`` (for the next run)."""
    now = catalog.relation_names(list(known.names))
    files = catalog.relation_files(list(now))
    out: list[Rewrite] = []
    for oid, (filenode, columns) in sorted(files.items()):
        before = known.files.get(oid)
        if before is not None and filenode and before["filenode"] != filenode and before["columns"] != columns:
            out.append(Rewrite(now[oid], oid, "rewritten with new columns or types, its rows not in the WAL"))
        elif before is None:
            gone = [
                other
                for other, target in known.delta.items()
                if other != oid and target == known.delta.get(oid) and other in known.files and other not in now
            ]
            if gone:
                out.append(Rewrite(now[oid], oid, f"dropped and created again (OID {gone[-1]} -> {oid})"))
        known.files[oid] = {"filenode": filenode, "columns": columns}
    return out


def snapshot_pending(staging: Storage, slot: str) -> set[Name]:
    """Tables a filed snapshot request still has to copy."""
    out: set[Name] = set()
    for request in list_snapshot_requests(staging, slot):
        state = read_snapshot_state(staging, slot, request.id)
        if state is None or not state.get("done"):
            out.update(request.tables)
    return out


def handle_rewrites(
    rewrites: list[Rewrite], options: Mapping[Name, TableOptions], staging: Storage, slot: str
) -> list[str]:
    """Resnapshot or refuse each rewritten table by its ``on_rewrite`` option; returns the ids of
    the requests filed. Raises :class:`CatalogError` naming the ``stop`` tables."""
    if not rewrites:
        return []
    pending = snapshot_pending(staging, slot)
    stopped: list[Rewrite] = []
    filed: list[str] = []
    for rewrite in rewrites:
        dotted = ".".join(rewrite.name)
        if rewrite.name in pending:
            log.info("table %s was %s; the snapshot request filed for it replaces its Delta rows", dotted, rewrite.why)
        elif options_for(options, *rewrite.name).on_rewrite == "stop":
            stopped.append(rewrite)
        else:
            request = request_table_snapshot(staging, slot, [rewrite.name], "resnapshot")
            filed.append(request.id)
            log.warning(
                "table %s was %s: its Delta table no longer equals it. Filed resnapshot request %s (on_rewrite "
                "resnapshot): the next runs copy the table and replace its Delta rows",
                dotted,
                rewrite.why,
                request.id,
            )
    if stopped:
        names = [".".join(r.name) for r in stopped]
        reasons = "; ".join(f"{name}: {r.why}" for name, r in zip(names, stopped))
        raise CatalogError(
            f"table(s) {', '.join(names)} changed without their rows in the WAL "
            f"({reasons}), so their Delta tables no longer equal "
            "them. Nothing was staged and the slot was not advanced (table_options on_rewrite: stop). Resnapshot them "
            f"(pgdecode_backfill mode=resnapshot, tables={names}): once the request is filed the next run goes on "
            "and the snapshot replaces their Delta rows; or set on_rewrite to resnapshot to have that done for you"
        )
    return filed
