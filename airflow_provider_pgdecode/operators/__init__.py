"""Operators of pgdecode: ensure the slot, extract a batch, merge it into Delta, confirm it."""

from __future__ import annotations

from airflow_provider_pgdecode.operators.confirm import PgDecodeConfirmOperator
from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator
from airflow_provider_pgdecode.operators.slot import PgDecodeEnsureSlotOperator

__all__ = [
    "PgDecodeConfirmOperator",
    "PgDecodeEnsureSlotOperator",
    "PgDecodeExtractOperator",
    "PgDecodeMergeOperator",
]
