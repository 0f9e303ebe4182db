"""Partitioned tables land as their root: one Delta table per partitioned table (docs/merge.md).

test_decoding names the leaf partition of every change, and so does pgoutput unless the
publication sets ``publish_via_partition_root``. The extract sends every partition's changes to
the Delta table of the partitioned table at the top of its tree (the staged entry's Delta table,
as for a renamed table: :mod:`.renames`), selects the partitions of a selected root, and gives
them the root's table options. A row moving to another partition is a DELETE in one and an INSERT
in the other, in one transaction: the root's Delta table applies both in order.

What no row change carries is found in the catalog at each extract, per root: a partition
attached with rows of its own, one detached or dropped (its rows leave the root), one truncated
(a new file node; pgoutput does not even send a partition's TRUNCATE when it publishes through the
root). Each is handled as a rewrite (:mod:`.rewrites`, the root's ``on_rewrite`` option): the
root is resnapshotted, replacing its Delta rows. So a partition's TRUNCATE is never staged as one:
it would empty the whole root's Delta table.

A partitioned table whose ``partitions`` option is ``leaves`` keeps its leaves apart instead: each
leaf partition lands in a Delta table of its own name (:func:`landing_roots` leaves them out of the
root mapping, :func:`.tables.expand_kept_leaves` lists them where the root was selected), its TRUNCATE is
decoded as any table's, and only a partition attached with rows of its own is found in the catalog
(resnapshotted by the leaf's ``on_rewrite``); one detached keeps its Delta table as last merged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from airflow_provider_pgdecode.batch.options import TableOptions
from airflow_provider_pgdecode.capture.renames import KnownTables
from airflow_provider_pgdecode.capture.rewrites import Rewrite
from airflow_provider_pgdecode.capture.tables import kept_as_leaves
from airflow_provider_pgdecode.postgres.catalog import Catalog

Name = tuple[str, str]
#: A partition's ``(schema, table)`` -> ``(root OID, root (schema, table))`` (:meth:`Catalog.partition_roots`).
Roots = Mapping[Name, tuple[int, Name]]


def with_partitions(selected: set[Name] | None, roots: Roots) -> set[Name] | None:
    """The ``tables`` selection with the partitions of every selected partitioned table (their
    changes carry the partitions' names)."""
    if selected is None:
        return None
    leaves = {leaf for leaf, (_, root) in roots.items() if root in selected}
    return set(selected) | leaves if leaves else selected


def with_root_options(options: Mapping[Name, TableOptions], roots: Roots) -> dict[Name, TableOptions]:
    """Table options with each partition given its root's (a partition's own entry wins)."""
    out = dict(options)
    for leaf, (_, root) in roots.items():
        if root in options and leaf not in options:
            out[leaf] = options[root]
    return out


def landing_roots(roots: Roots, options: Mapping[Name, TableOptions]) -> Roots:
    """``roots`` without the partitions of roots kept as leaves: the partitions whose changes land
    in their root's Delta table."""
    kept = kept_as_leaves(options)
    return {leaf: root for leaf, root in roots.items() if root[1] not in kept} if kept else roots


def selected_kept_roots(
    selected: set[Name] | None, roots: Roots, options: Mapping[Name, TableOptions]
) -> dict[Name, int]:
    """The roots kept as leaves that ``selected`` takes (the root or any of its partitions; every
    one when ``None``), with their OIDs."""
    kept = kept_as_leaves(options)
    return {
        root: oid
        for leaf, (oid, root) in roots.items()
        if root in kept and (selected is None or root in selected or leaf in selected)
    }


def partition_changes(catalog: Catalog, known: KnownTables, kept: Collection[Name] = ()) -> list[Rewrite]:
    """The partitioned tables of ``known`` whose rows changed without row changes in the WAL since
    the last extract (a partition attached with rows, detached or dropped, truncated); records
    each one's partitions in ``known`` for the next run (the first record compares with nothing).
    For a root of ``kept`` (kept as leaves) only the partitions attached with rows: each of them."""
    candidates = sorted(set(known.names) | set(known.partitions))
    now = catalog.relation_names(candidates)
    leaves_now = catalog.partition_leaves([oid for oid in candidates if oid in now])
    # A partitioned table all of whose partitions were detached has no leaves to list.
    tracked = sorted(set(leaves_now) | {oid for oid, leaves in known.partitions.items() if leaves and oid in now})
    out: list[Rewrite] = []
    for oid in tracked:
        leaves = leaves_now.get(oid, {})
        before = known.partitions.get(oid)
        if now[oid] in kept:
            out.extend(_attached_leaves(catalog, now[oid], before, leaves))
        elif before is not None and (why := _partition_change(before, leaves)):
            out.append(Rewrite(now[oid], oid, why))
        known.partitions[oid] = {leaf: filenode for leaf, (filenode, _) in leaves.items()}
    return out


def _partition_change(before: Mapping[int, int], now: Mapping[int, tuple[int, bool]]) -> str | None:
    """What happened to a root's partitions (by OID) that no row change carries; ``None``: nothing."""
    gone = sorted(set(before) - set(now))
    attached = sorted(leaf for leaf, (_, was_attached) in now.items() if leaf not in before and was_attached)
    truncated = sorted(leaf for leaf, (filenode, _) in now.items() if leaf in before and before[leaf] != filenode)
    reasons = []
    if gone:
        reasons.append(f"partition(s) with OID {_oids(gone)} detached or dropped: their rows left it")
    if attached:
        reasons.append(f"partition(s) with OID {_oids(attached)} attached: their rows joined it")
    if truncated:
        reasons.append(f"partition(s) with OID {_oids(truncated)} truncated or rewritten")
    return "; ".join(reasons) or None


def _attached_leaves(
    catalog: Catalog, root: Name, before: Mapping[int, int] | None, now: Mapping[int, tuple[int, bool]]
) -> list[Rewrite]:
    """The partitions of a root kept as leaves attached since ``before`` with rows of their own."""
    if before is None:
        return []
    attached = sorted(leaf for leaf, (_, was_attached) in now.items() if leaf not in before and was_attached)
    names = catalog.relation_names(attached)
    why = f"attached to {root[0]}.{root[1]} with rows of its own, which no change carries (partitions = 'leaves')"
    return [Rewrite(names[leaf], leaf, why) for leaf in attached if leaf in names]


def _oids(oids: list[int]) -> str:
    return ", ".join(str(oid) for oid in oids)
