"""Capture: from a replication slot (or a table snapshot) to staged batches."""
