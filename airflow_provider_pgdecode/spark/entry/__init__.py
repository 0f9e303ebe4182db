"""spark-submit's entry file for pgdecode's Spark jobs, alone in its folder (see :mod:`.pgdecode_spark_job`)."""
