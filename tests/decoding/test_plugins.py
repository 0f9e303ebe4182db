"""One list of the output plugins pgdecode reads and one wording for any other, wherever it is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot
from airflow_provider_pgdecode.capture.verify import stage_verify_snapshot
from airflow_provider_pgdecode.decoding import SUPPORTED_PLUGINS, plugin_unknown
from airflow_provider_pgdecode.errors import SlotError
from airflow_provider_pgdecode.postgres import readiness
from airflow_provider_pgdecode.utils import sources

WORDING = "output plugin 'wal2json' is not one pgdecode reads: use test_decoding or pgoutput"


def test_every_list_of_plugins_is_the_decoding_core_s() -> None:
    assert readiness.PLUGINS is SUPPORTED_PLUGINS and sources.PLUGINS is SUPPORTED_PLUGINS
    assert plugin_unknown("wal2json") == WORDING


@pytest.mark.parametrize(
    "call",
    [
        lambda tmp: extract_batch(None, "s", tmp, plugin="wal2json"),  # type: ignore[arg-type]
        lambda tmp: stage_verify_snapshot("dbname=x", "s", tmp, ["public.t"], plugin="wal2json"),
        lambda tmp: create_slot_with_snapshot("dbname=x", "s", plugin="wal2json").__enter__(),
    ],
    ids=["extract", "verify", "snapshot slot"],
)
def test_each_entry_point_refuses_another_plugin_in_the_one_wording_before_connecting(
    call: Any, tmp_path: Path
) -> None:
    with pytest.raises(SlotError) as refused:
        call(tmp_path)
    assert str(refused.value) == WORDING
