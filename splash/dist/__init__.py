"""Process groups and the collectives every rank runs (Comm)."""
