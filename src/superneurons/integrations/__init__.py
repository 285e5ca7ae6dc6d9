"""Integrations with training frameworks (optional dependencies, imported on demand)."""
