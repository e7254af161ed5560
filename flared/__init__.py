"""Flare's serving daemon."""
