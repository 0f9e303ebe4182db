"""Operators of pgdecode: ensure the slot, extract a batch, merge it into Delta, confirm it, drain a
backlog batch by batch; the backfill
modes: an initial snapshot, a table snapshot request, a replay of staged batches."""

from __future__ import annotations

from airflow_provider_pgdecode.operators.confirm import PgDecodeConfirmOperator
from airflow_provider_pgdecode.operators.drain import PgDecodeDrainOperator
from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
from airflow_provider_pgdecode.operators.initial_snapshot import PgDecodeInitialSnapshotOperator
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.operators.replay import PgDecodeReplayOperator
from airflow_provider_pgdecode.operators.slot import PgDecodeEnsureSlotOperator
from airflow_provider_pgdecode.operators.table_snapshot import PgDecodeTableSnapshotOperator

__all__ = [
    "PgDecodeConfirmOperator",
    "PgDecodeDrainOperator",
    "PgDecodeEnsureSlotOperator",
    "PgDecodeExtractOperator",
    "PgDecodeInitialSnapshotOperator",
    "PgDecodeMergeOperator",
    "PgDecodeReplayOperator",
    "PgDecodeTableSnapshotOperator",
]
