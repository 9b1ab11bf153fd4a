"""Layouts: the ownership model (pure data) and the four attention forwards (registry)."""
