"""Replay staged batches: select the retained chain between two LSNs for a merge elsewhere.

Staged batches are kept as a replay log (``batch/retention.py`` decides for how long). Merging
the chain of retained batches between two LSNs into another Delta root rebuilds its tables
(from the initial load at ``0/0``) or brings a copy forward; the slot is neither read nor
advanced. The chain is selected by :func:`airflow_provider_pgdecode.batch.chains.select_batch_chain`:
each batch starts where the previous one ended, and a gap, or a range retention already
removed, fails the task and says so.

Example::

    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
    from airflow_provider_pgdecode.operators.replay import PgDecodeReplayOperator

    replay = PgDecodeReplayOperator(
        task_id="replay",
        slot_name="pgdecode_shop",
        staging_root="/data/staging",
        start_lsn="0/0",
    )
    merge = PgDecodeMergeOperator(
        task_id="merge",
        batch_paths="{{ ti.xcom_pull(task_ids='replay') }}",
        delta_root="/data/delta_rebuilt",
    )
    replay >> merge
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context

from airflow_provider_pgdecode.batch.chains import select_batch_chain
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.utils.fail_fast import fail_fast


def _lsn(name: str, value: str | None) -> Lsn | None:
    if value is None or not str(value).strip():
        return None
    try:
        return Lsn.parse(str(value))
    except ValueError as exc:
        raise ConfigurationError(f"{name}: {exc}; leave it empty for the whole retained range") from None


class PgDecodeReplayOperator(BaseOperator):
    """Return the paths of a slot's retained batches from ``start_lsn`` to ``end_lsn``, in LSN order.

    Batches a failed run staged and a later run replaced (same start, smaller end) are passed
    over. A chain that does not start at ``start_lsn``, has a gap, or ends before ``end_lsn``
    fails the task without a retry, naming the LSNs where the retained batches start or end.
    Nothing is read from PostgreSQL.

    Returns (to XCom) the list of batch paths, for
    :class:`~airflow_provider_pgdecode.operators.merge.PgDecodeMergeOperator`.

    Example::

        from airflow_provider_pgdecode.operators.replay import PgDecodeReplayOperator

        replay = PgDecodeReplayOperator(
            task_id="replay",
            slot_name="pgdecode_shop",
            staging_root="/data/staging",
            start_lsn="{{ params.start_lsn }}",
            end_lsn="{{ params.end_lsn }}",
        )

    :param slot_name: the slot whose batches are replayed. (templated)
    :param staging_root: the root of staged batches: a local directory or ``s3://bucket/prefix``.
        (templated)
    :param start_lsn: where the chain starts, ``X/Y`` (a batch must start there); empty or
        ``None``: at the first retained batch. (templated)
    :param end_lsn: where the chain ends, ``X/Y``; empty or ``None``: at the last retained
        batch. (templated)
    :param storage_conn_id: the Airflow ``aws`` connection of a staging root on object storage
        (``s3://bucket/prefix``; ``endpoint_url`` in its extra for an S3-compatible store); empty:
        a local staging root, or the ``AWS_*`` environment for ``s3://``. Resolved when the task
        runs; no secret enters the task's fields, its log or XCom. (templated)
    """

    template_fields: Sequence[str] = ("slot_name", "staging_root", "start_lsn", "end_lsn", "storage_conn_id")
    ui_color = "#e3eaf7"

    def __init__(
        self,
        *,
        slot_name: str,
        staging_root: str,
        start_lsn: str | None = None,
        end_lsn: str | None = None,
        storage_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.slot_name = slot_name
        self.staging_root = staging_root
        self.start_lsn = start_lsn
        self.end_lsn = end_lsn
        self.storage_conn_id = storage_conn_id

    def execute(self, context: Context) -> list[str]:
        with fail_fast():
            start, end = _lsn("start_lsn", self.start_lsn), _lsn("end_lsn", self.end_lsn)
            staging = storage_for(str(self.staging_root), self.storage_conn_id)
            chain = select_batch_chain(staging, str(self.slot_name), start, end)
        self.log.info("replay: %d batch(es) from %s to %s", len(chain), chain[0].start_lsn, chain[-1].end_lsn)
        return [str(m.path) for m in chain]
