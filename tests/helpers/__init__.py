"""Shared test helpers (tiny models on disk)."""
