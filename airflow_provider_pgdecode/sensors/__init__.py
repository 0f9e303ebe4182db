"""Sensors of pgdecode: slot changes and slot health."""
