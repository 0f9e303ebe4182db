"""What spark-submit runs for every pgdecode Spark job: the job's module, named first, as ``__main__``.

    spark-submit [options] .../airflow_provider_pgdecode/spark/entry/pgdecode_spark_job.py \\
        airflow_provider_pgdecode.spark.merge_job --delta-root /data/delta --batch ...

Python puts the folder of the file it runs first on ``sys.path``. A job file inside the package
would put a package folder there, where a module may share its name with one of Python's or of
another distribution (the Spark job's own ``types.py`` once shadowed Python's ``types``, and no
job of an installed wheel started). This folder holds this file only and is no package; the job
is imported as a module of the installed package, like ``python -m``.
"""

import runpy
import sys

JOBS = (
    "airflow_provider_pgdecode.spark.merge_job",
    "airflow_provider_pgdecode.spark.verify_job",
    "airflow_provider_pgdecode.spark.maintenance_job",
)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in JOBS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(JOBS)}}} [job arguments]")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
