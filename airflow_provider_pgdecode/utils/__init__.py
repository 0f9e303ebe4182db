"""Airflow-side helpers shared by the operators, sensors and triggers."""
