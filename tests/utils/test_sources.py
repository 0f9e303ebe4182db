"""The sources file: a good one read into its sources, and each kind of broken one refused by an
error that names the file, the line, the source and the field (utils/sources.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from airflow_provider_pgdecode.errors import ConfigurationError
from airflow_provider_pgdecode.utils.sources import DEFAULT_POOL, load_sources, parse_sources, sources_file

GOOD = """\
defaults:
  pool: pgdecode_spark
  spark_conn_id: spark_connect
  max_batch_changes: 50000

sources:
  shop:
    postgres_conn_id: shop_db
    slot: pgdecode_shop
    plugin: test_decoding
    tables: [public.customers, "public.order_*"]
    exclude_tables: [public.order_archive]
    table_options:
      public.audit_log: {mode: append_only}
    delta_root: /data/shop/delta
    schedule: "*/5 * * * *"
  billing:
    postgres_conn_id: billing_db
    slot: pgdecode_billing
    plugin: pgoutput
    publication: billing_pub
    delta_root: s3://lake/billing/delta
    staging_uri: s3://lake/billing/staging
    storage_conn_id: lake
    max_batch_changes: null
    retention_days: null
  crm:
    postgres_conn_id: crm_db
    slot: pgdecode_crm
    plugin: test_decoding
    tables: ["sales.*"]
    schedule: event
    poll_interval: 5
    pool: default_pool
"""


def parse(text: str, path: str = "dags/pgdecode_sources.yaml"):
    return parse_sources(textwrap.dedent(text), path, data_dir="/var/pgdecode")


def refused(text: str) -> str:
    with pytest.raises(ConfigurationError) as info:
        parse(text)
    return str(info.value)


def test_a_good_file_gives_its_sources_in_order() -> None:
    config = parse(GOOD)
    assert config.path == Path("dags/pgdecode_sources.yaml")
    shop, billing, crm = config.sources
    assert [s.name for s in config] == ["shop", "billing", "crm"]
    assert (shop.postgres_conn_id, shop.slot, shop.plugin, shop.publication) == (
        "shop_db",
        "pgdecode_shop",
        "test_decoding",
        None,
    )
    assert shop.tables == ["public.customers", "public.order_*"] and shop.exclude_tables == ["public.order_archive"]
    assert shop.table_options == {"public.audit_log": {"mode": "append_only"}}
    assert type(shop.table_options["public.audit_log"]) is dict  # plain, for the DAG params
    # defaults apply unless the source gives its own; locations default under data_dir/<name>
    assert (shop.pool, shop.spark_conn_id, shop.max_batch_changes) == ("pgdecode_spark", "spark_connect", 50000)
    assert (shop.staging_uri, shop.delta_root) == ("/var/pgdecode/shop/staging", "/data/shop/delta")
    assert (crm.staging_uri, crm.delta_root) == ("/var/pgdecode/crm/staging", "/var/pgdecode/crm/delta")
    assert crm.pool == DEFAULT_POOL and crm.is_event_driven and crm.poll_interval == 5
    assert shop.schedule == "*/5 * * * *" and not shop.is_event_driven
    # null is a value (no bound, keep every batch); what is not given takes the settings later
    assert billing.max_batch_changes is None and billing.given("retention_days") and billing.retention_days is None
    assert not billing.given("schedule") and not billing.given("wait_seconds") and shop.given("max_batch_changes")
    assert (billing.publication, billing.storage_conn_id) == ("billing_pub", "lake")


def test_an_empty_sources_mapping_is_no_source() -> None:
    assert parse("sources: {}\n").sources == ()


# --- broken files: each error names the file, the line, the source and the field ------------------

SOURCE = """\
sources:
  shop:
    postgres_conn_id: shop_db
    slot: pgdecode_shop
    plugin: test_decoding
"""


def test_a_missing_field() -> None:
    message = refused("sources:\n  shop:\n    slot: pgdecode_shop\n    plugin: test_decoding\n")
    assert message == (
        "dags/pgdecode_sources.yaml:2: source 'shop': field 'postgres_conn_id': missing: every source needs the "
        "Airflow connection (type pgdecode; postgres works too) of its database"
    )
    message = refused("sources:\n  shop:\n    postgres_conn_id: db\n    slot: s\n")
    assert "source 'shop': field 'plugin': missing: every source needs its output plugin, one of test_decoding, " in (
        message
    )


def test_an_unknown_plugin() -> None:
    message = refused(SOURCE.replace("plugin: test_decoding", "plugin: wal2json"))
    assert message == (
        "dags/pgdecode_sources.yaml:5: source 'shop': field 'plugin': must be one of test_decoding, pgoutput "
        "(got 'wal2json')"
    )


def test_a_slot_used_by_two_sources() -> None:
    """Slots are cluster-wide and two connection ids may reach one cluster: unique in the file."""
    text = SOURCE + "  billing:\n    postgres_conn_id: billing_db\n    slot: pgdecode_shop\n    plugin: test_decoding\n"
    message = refused(text)
    assert message.startswith(
        "dags/pgdecode_sources.yaml:8: source 'billing': field 'slot': slot 'pgdecode_shop' is also the slot of "
        "source 'shop': each source needs a slot of its own"
    )
    assert "slots are cluster-wide" in message
    assert "a slot name is 1 to 63 lower-case letters" in refused(SOURCE.replace("pgdecode_shop", "Shop-Slot"))
    # A source with problems of its own still has its slot compared: both are said at once.
    typo = text + "    tabels: [public.x]\n"  # in billing, the last source
    lines = refused(typo).splitlines()
    assert any("source 'billing': field 'slot': slot 'pgdecode_shop' is also the slot of" in line for line in lines)
    assert any("source 'billing': field 'tabels': unknown field (did you mean 'tables'?)" in line for line in lines)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("public.order_[", "'[' is not closed by ']'"),
        ("public.order%", "use *"),
        ("orders", "names no schema (write 'public.orders'"),
        ("public.order_.*", "'.*' is written '*'"),
    ],
)
def test_a_bad_table_pattern(entry: str, why: str) -> None:
    message = refused(SOURCE + f'    tables: [public.customers, "{entry}"]\n')
    assert message.startswith(
        f"dags/pgdecode_sources.yaml:6: source 'shop': field 'tables': entry 2: {entry!r} is not a valid table "
        "name or pattern: "
    )
    assert why in message and "e.g. 'public.orders', 'public.order_*', 'sales.*'" in message
    message = refused(SOURCE + f'    exclude_tables: ["{entry}"]\n')
    assert "source 'shop': field 'exclude_tables': entry 1:" in message


def test_an_unknown_option() -> None:
    message = refused(SOURCE + "    table_options:\n      public.audit_log: {mdoe: append_only}\n")
    assert message.startswith(
        "dags/pgdecode_sources.yaml:6: source 'shop': field 'table_options': table_options['public.audit_log'] is "
        "invalid (mdoe: Extra inputs are not permitted)"
    )
    message = refused(SOURCE + "    table_options:\n      public.audit_log: {mode: upsert}\n")
    assert "field 'table_options': table_options['public.audit_log'] is invalid (mode: Input should be" in message
    message = refused(SOURCE + "    table_options:\n      public.log_*: {mode: append_only}\n")
    assert "field 'table_options': 'public.log_*': options are given per table, by its name" in message
    # an unknown field of a source, with the one meant
    message = refused(SOURCE + "    max_batch_change: 10\n")
    assert message.startswith(
        "dags/pgdecode_sources.yaml:6: source 'shop': field 'max_batch_change': unknown field (did you mean "
        "'max_batch_changes'?); the fields are postgres_conn_id, slot, plugin, publication, tables"
    )


def test_bad_yaml_names_the_line() -> None:
    message = refused(SOURCE + "    tables: [public.a\n  billing: {}\n")
    assert message.startswith("dags/pgdecode_sources.yaml:7: not valid YAML: ")
    assert "column" in message


def test_a_source_defined_twice() -> None:
    """PyYAML keeps the last of two equal keys silently; the file is refused instead."""
    message = refused(SOURCE + "  shop:\n    postgres_conn_id: other\n    slot: other\n    plugin: pgoutput\n")
    assert message == "dags/pgdecode_sources.yaml:6: source 'shop' is defined twice (lines 2 and 6)"
    message = refused(SOURCE + "    slot: pgdecode_shop2\n")
    assert message == "dags/pgdecode_sources.yaml:6: source 'shop': field 'slot': given twice (lines 4 and 6)"


def test_the_publication_goes_with_pgoutput() -> None:
    message = refused(SOURCE.replace("test_decoding", "pgoutput"))
    assert message == (
        "dags/pgdecode_sources.yaml:2: source 'shop': field 'publication': required with plugin pgoutput: the "
        "publication its slot reads (CREATE PUBLICATION name FOR TABLE ...)"
    )
    message = refused(SOURCE + "    publication: pub\n")
    assert "source 'shop': field 'publication': test_decoding reads no publication" in message


def test_more_refusals() -> None:
    two = SOURCE + "  crm:\n    postgres_conn_id: crm\n    slot: crm\n    plugin: test_decoding\n"
    message = refused(two.replace("plugin: test_decoding\n", "plugin: test_decoding\n    delta_root: /d/x\n"))
    assert "source 'crm': field 'delta_root': /d/x is (or nests with) the Delta root of source 'shop'" in message
    message = refused(SOURCE + "    delta_root: data/delta\n")
    assert "source 'shop': field 'delta_root': must be an absolute path or a URI" in message
    message = refused(SOURCE + '    schedule: "every 5 minutes"\n')
    assert "source 'shop': field 'schedule': must be a cron expression" in message and "'event'" in message
    assert "field 'schedule'" in refused(SOURCE + '    schedule: "61 * * * *"\n')
    message = refused(SOURCE + "    max_batch_changes: 0\n")
    assert "source 'shop': field 'max_batch_changes': Input should be greater than or equal to 1 (got 0)" in message
    assert "field 'drain': Input should be a valid boolean (got 'yes please')" in refused(
        SOURCE + "    drain: yes please\n"
    )
    message = refused("defaults:\n  slot: x\n  plugn: test_decoding\n" + SOURCE)
    assert "dags/pgdecode_sources.yaml:2: defaults: field 'slot': not allowed in defaults" in message
    assert "dags/pgdecode_sources.yaml:3: defaults: field 'plugn': unknown field (did you mean 'plugin'?)" in message
    assert "unknown key 'source'" in refused("source:\n  shop: {}\nsources: {}\n")
    assert "'sources' must map each source's name to its fields" in refused("sources:\n  - name: shop\n")
    assert refused("") == (
        "dags/pgdecode_sources.yaml: must be a mapping with the key 'sources' (and optionally 'defaults'), not an "
        "empty file; see docs/sources.md"
    )
    assert "a source is named by its key" in refused(SOURCE + "    name: shop\n")
    assert "source name 'my shop'" in refused(SOURCE.replace("shop:", "my shop:"))


def test_every_problem_at_once_in_the_files_order() -> None:
    text = SOURCE.replace("wal", "x") + "    plugin: wal2json\n    tables: [orders]\n"
    lines = refused(text.replace("    plugin: test_decoding\n", "")).splitlines()
    assert [line.split(":")[1] for line in lines] == ["5", "6"]
    assert "field 'plugin'" in lines[0] and "field 'tables'" in lines[1]


# --- which file --------------------------------------------------------------------------------------


def test_which_file_is_read(tmp_path: Path) -> None:
    default = tmp_path / "dags" / "pgdecode_sources.yaml"
    default.parent.mkdir()
    assert sources_file("", default) is None  # no file: no DAG, no error
    default.write_text(SOURCE)
    assert sources_file("", default) == default
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(SOURCE)
    assert sources_file("../conf/mine.yaml", default) == tmp_path / "conf" / "mine.yaml"  # from the DAG file's folder
    assert sources_file(str(tmp_path / "conf" / "mine.yaml"), default) == tmp_path / "conf" / "mine.yaml"
    with pytest.raises(ConfigurationError) as info:
        sources_file("missing.yaml", default)
    assert f"the sources file {tmp_path / 'dags' / 'missing.yaml'} does not exist" in str(info.value)
    assert "PGDECODE_SOURCES" in str(info.value)
    assert load_sources(default, data_dir="/d").sources[0].name == "shop"
