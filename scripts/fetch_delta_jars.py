#!/usr/bin/env python
"""Fetch Delta Lake's jars and hadoop-aws (with their dependencies) into the project-local Ivy cache.

    .venv/bin/python scripts/fetch_delta_jars.py [--force] [--maven]

The merge job resolves ``io.delta:delta-spark_<spark>_2.13:<delta>`` through Spark's packages
mechanism (``spark.jars.packages``) with ``spark.jars.ivy`` pointing at the project-local Ivy
directory (``.cache/ivy``, or ``$PGDECODE_IVY_DIR``); a run that reads or writes ``s3://`` adds
``org.apache.hadoop:hadoop-aws`` (the Hadoop of pip's pyspark; its AWS SDK comes with it). This
script resolves both once, so that tests and jobs started afterwards find every jar in the cache
and never go to the network; the stamp records both coordinates.

Idempotent and fast: when a previous run recorded the same coordinates and every recorded jar is
still there, it returns in well under a second without starting a JVM.

``--maven`` (also the automatic fallback when Ivy cannot resolve) copies the same artifact and
its transitive dependencies with ``mvn dependency:copy-dependencies`` into ``.cache/delta-jars``, and
hadoop-aws with its AWS SDK into ``.cache/delta-jars/object-store``; point ``$PGDECODE_DELTA_JARS`` at
that folder to make the job use ``spark.jars`` instead of Ivy (the sub-folder only for s3:// runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from airflow_provider_pgdecode.spark import session  # noqa: E402

STAMP_NAME = "pgdecode-delta-jars.json"


def _read_stamp(stamp: Path) -> dict[str, object] | None:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None


def cached_jars(ivy: Path, coordinates: str) -> list[Path] | None:
    """The jars a previous resolution of ``coordinates`` recorded, if all are still present."""
    recorded = _read_stamp(ivy / STAMP_NAME)
    if not recorded or recorded.get("coordinates") != coordinates:
        return None
    jars = [Path(p) for p in recorded.get("jars", [])]  # type: ignore[union-attr]
    if not jars or not all(jar.is_file() for jar in jars):
        return None
    return jars


def resolve_with_ivy(ivy: Path, coordinates: str, excludes: str | None = session.HADOOP_EXCLUDES) -> list[Path]:
    """Start a one-thread local Spark with ``spark.jars.packages`` so Ivy fills ``ivy``."""
    conf = {"spark.jars.packages": coordinates, "spark.jars.ivy": str(ivy)}
    if excludes:
        conf["spark.jars.excludes"] = excludes
    spark = session.build_spark_session("local[1]", app_name="pgdecode-fetch-delta-jars", extra_conf=conf)
    try:
        # A real Delta write: fails here if the Delta classes did not load.
        with tempfile.TemporaryDirectory() as probe:
            spark.range(1).write.format("delta").save(str(Path(probe) / "probe"))
        # And the S3A filesystem loads (no store is contacted).
        jvm = spark._jvm
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass("s3a", spark.sparkContext._jsc.hadoopConfiguration())
    finally:
        spark.stop()
    jars = sorted((ivy / "jars").glob("*.jar"))
    for prefix in ("io.delta_delta-spark_", "org.apache.hadoop_hadoop-aws-"):
        if not any(jar.name.startswith(prefix) for jar in jars):
            raise RuntimeError(f"Ivy finished but no {prefix}*.jar is in {ivy / 'jars'}")
    return jars


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
    parser.add_argument("--only", metavar="COORDINATES", help=argparse.SUPPRESS)  # one resolution, no excludes
    args = parser.parse_args(argv)
    if args.only:
        try:
            resolve_with_ivy(session.ivy_dir(), args.only, excludes=None)
        except Exception as error:  # noqa: BLE001
            # Ivy has filled the cache before the session starts; the probe write then fails with
            # two Hadoops on the classpath, which a run without hadoop-aws does not have.
            print(f"{args.only}: resolved; the probe write failed as expected ({type(error).__name__})")
        return 0

    delta = session.delta_maven_coordinates()
    hadoop_aws = session.hadoop_aws_maven_coordinates()
    coordinates = f"{delta},{hadoop_aws}"
    ivy = session.ivy_dir()
    stamp = ivy / STAMP_NAME
    if not args.force and not args.maven:
        jars = cached_jars(ivy, coordinates)
        if jars is not None:
            print(f"{coordinates}: {len(jars)} jars cached in {ivy}")
            return 0

    started = time.monotonic()
    method = "ivy"
    try:
        if args.maven:
            raise RuntimeError("--maven given")
        ivy.mkdir(parents=True, exist_ok=True)
        jars = resolve_with_ivy(ivy, coordinates)
        # A run without s3:// resolves Delta alone, without the Hadoop excludes, and Ivy then reads
        # Delta's own Hadoop client (hadoop-client-runtime 3.4.x) that the resolution above leaves
        # out: fetch it too, or that run goes to the network (a clean clone's offline spark-submit
        # failed so when it ran before any test that fetched it).
        # Its own process: a JVM takes spark.jars.packages only when it starts.
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--only", delta], check=True)
    except Exception as error:  # noqa: BLE001 - any Ivy failure falls back to Maven
        if not args.maven:
            print(f"Ivy could not resolve {coordinates}: {error}; trying Maven", file=sys.stderr)
        method = "maven"
        target = ivy.parent / "delta-jars"
        jars = resolve_with_maven(target, delta)
        jars += resolve_with_maven(target / session.OBJECT_STORE_JARS_DIR, hadoop_aws)
        print(f"{coordinates}: {len(jars)} jars copied to {target}; run jobs with {session.DELTA_JARS_ENV}={target}")
        return 0

    stamp.write_text(
        json.dumps(
            {"coordinates": coordinates, "method": method, "jars": [str(jar) for jar in jars]},
            indent=2,
            sort_keys=True,
        )
    )
    print(f"{coordinates}: {len(jars)} jars resolved into {ivy} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
