"""Sensors of pgdecode: slot changes, slot health, and table snapshot requests."""
