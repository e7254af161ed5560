"""Fixtures for the daemon end-to-end tests (the helpers live in e2e_support)."""

from e2e_support import *  # noqa: F403  (fixtures must be conftest attributes)
