"""Delta's jars straight from the Ivy cache, for tests that spark-submit many short jobs."""

from __future__ import annotations

OBJECT_STORE_JAR_PREFIXES = ("org.apache.hadoop_hadoop-aws-", "software.amazon.")


def cached_delta_jars() -> str | None:
    """A ``$PGDECODE_DELTA_JARS`` value: the Ivy cache's jars that ``spark.jars.packages`` resolves
    for a run on local disks (hadoop-aws and the AWS SDK bundle left out: a run touching S3
    resolves its packages), or ``None`` when the cache is not filled. Resolution through Ivy costs
    seconds per spark-submit; it is proven by tests/spark/test_spark_submit.py."""
    from airflow_provider_pgdecode.spark.session import ivy_dir

    folder = ivy_dir() / "jars"
    jars = sorted(str(j) for j in folder.glob("*.jar") if not j.name.startswith(OBJECT_STORE_JAR_PREFIXES))
    return ",".join(jars) if any("io.delta_delta-spark" in j for j in jars) else None
