"""Notifiers: pgdecode's alerts handed to Airflow's own notifiers (Slack, email, ...)."""
