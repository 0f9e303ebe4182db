"""The batch format: the one definition of a staged batch (docs/staging-format.md)."""
