"""Triggers of pgdecode."""
