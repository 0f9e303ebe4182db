"""The decoding core: LSNs, the event model, one module per output plugin, the transaction
assembler and the spool. Plain Python: no driver, Spark or Airflow."""

from __future__ import annotations

SUPPORTED_PLUGINS: tuple[str, ...] = ("test_decoding", "pgoutput")
"""The output plugins pgdecode reads, one parser module each."""


def plugin_unknown(plugin: str) -> str:
    """The one wording for an output plugin pgdecode does not read."""
    return f"output plugin {plugin!r} is not one pgdecode reads: use {' or '.join(SUPPORTED_PLUGINS)}"
