#!/usr/bin/env python
"""Fetch Delta Lake's jars and hadoop-aws (with their dependencies) into the project-local Ivy cache.

    .venv/bin/python scripts/fetch_delta_jars.py [--force] [--maven]

The merge job resolves ``io.delta:delta-spark_<spark>_2.13:<delta>`` through Spark's packages
mechanism (``spark.jars.packages``) with ``spark.jars.ivy`` pointing at the project-local Ivy
directory (``.cache/ivy``, or ``$PGDECODE_IVY_DIR``); a run that reads or writes ``s3://`` adds
``org.apache.hadoop:hadoop-aws`` (the Hadoop of pip's pyspark; its AWS SDK comes with it). This
script resolves both sets once, so that tests and jobs started afterwards load the jar files the
resolution recorded (``<ivy>/pgdecode-resolved-jars.json``, airflow_provider_pgdecode/spark/jars.py)
and neither go to the network nor run Ivy.

Idempotent and fast: when both sets are recorded and every recorded jar is still there, it returns
in well under a second without starting a JVM.

``--maven`` (also the automatic fallback when Ivy cannot resolve) copies the same artifact and
its transitive dependencies with ``mvn dependency:copy-dependencies`` into ``.cache/delta-jars``, and
hadoop-aws with its AWS SDK into ``.cache/delta-jars/object-store``; point ``$PGDECODE_DELTA_JARS`` at
that folder to make the job use ``spark.jars`` instead of Ivy (the sub-folder only for s3:// runs).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from airflow_provider_pgdecode.spark import session  # noqa: E402
from airflow_provider_pgdecode.spark.jars import RECORD_NAME  # noqa: E402


def resolve_with_ivy(*, object_store: bool) -> None:
    """In this process: a one-thread local Spark started with the packages of a run (with
    ``object_store``: hadoop-aws too), so that Ivy fills the cache and the session records the
    jars it resolved (airflow_provider_pgdecode/spark/jars.py); then a probe that they load."""
    spark = session.build_spark_session("local[1]", app_name="pgdecode-fetch-delta-jars", object_store=object_store)
    try:
        if object_store:  # The S3A filesystem loads (no store is contacted).
            jvm = spark._jvm
            jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass("s3a", spark.sparkContext._jsc.hadoopConfiguration())
        else:  # A real Delta write: fails here if the Delta classes did not load.
            with tempfile.TemporaryDirectory() as probe:
                spark.range(1).write.format("delta").save(str(Path(probe) / "probe"))
    finally:
        spark.stop()


def unresolved(*, object_store: bool) -> str | None:
    """The packages a run (with ``object_store``: on s3://) would still resolve through Ivy, or
    ``None`` when it loads recorded jar files (or ``$PGDECODE_DELTA_JARS``)."""
    return session.delta_jars_conf(object_store=object_store).get("spark.jars.packages")


def resolve_with_maven(target: Path, coordinates: str) -> list[Path]:
    """Copy ``coordinates`` (one artifact) and its runtime dependencies into ``target`` with Maven."""
    if shutil.which("mvn") is None:
        raise RuntimeError("mvn is not installed (apt-get install maven)")
    group, artifact, version = coordinates.split(":")
    pom = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>pgdecode</groupId><artifactId>delta-jars</artifactId><version>0</version>
  <dependencies>
    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{version}</version></dependency>
  </dependencies>
</project>
"""
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "pom.xml").write_text(pom)
        # Spark's own jars (provided scope in Delta's POM) are excluded by includeScope=runtime.
        subprocess.run(
            [
                "mvn",
                "-q",
                "-B",
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={target}",
            ],
            cwd=work,
            check=True,
        )
    return sorted(target.glob("*.jar"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1].strip())
    parser.add_argument("--force", action="store_true", help="resolve again even when cached")
    parser.add_argument("--maven", action="store_true", help="use Maven instead of Ivy")
    parser.add_argument("--resolve", choices=("local", "object-store"), help=argparse.SUPPRESS)  # one resolution
    args = parser.parse_args(argv)
    if args.resolve:
        resolve_with_ivy(object_store=args.resolve == "object-store")
        return 0

    ivy = session.ivy_dir()
    if args.force:
        (ivy / RECORD_NAME).unlink(missing_ok=True)
    started = time.monotonic()
    try:
        if args.maven:
            raise RuntimeError("--maven given")
        for kind in ("local", "object-store"):
            packages = unresolved(object_store=kind == "object-store")
            if packages is None:
                print(f"{kind} runs: their jars are recorded in {ivy / RECORD_NAME}, all present")
                continue
            # A process of its own per set: a JVM takes spark.jars.packages only when it starts.
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--resolve", kind], check=True)
            if unresolved(object_store=kind == "object-store") is not None:
                raise RuntimeError(f"Ivy resolved {packages}, but the session recorded no jars in {ivy}")
            print(f"{kind} runs: {packages} resolved into {ivy} in {time.monotonic() - started:.0f} s")
    except Exception as error:  # noqa: BLE001 - any Ivy failure falls back to Maven
        if not args.maven:
            print(f"Ivy could not resolve Delta's jars: {error}; trying Maven", file=sys.stderr)
        delta, hadoop_aws = session.delta_maven_coordinates(), session.hadoop_aws_maven_coordinates()
        target = ivy.parent / "delta-jars"
        jars = resolve_with_maven(target, delta)
        jars += resolve_with_maven(target / session.OBJECT_STORE_JARS_DIR, hadoop_aws)
        print(
            f"{delta},{hadoop_aws}: {len(jars)} jars copied to {target}; run jobs with {session.DELTA_JARS_ENV}={target}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
