"""Throwaway servers and oracles for pgdecode's tests, demo and benchmarks: a PostgreSQL cluster,
the PostgreSQL-against-Delta comparison, local S3 and Spark Connect servers, a real Airflow deployment.

Part of the checkout, not of the wheel: users install the provider without them.
"""
