"""Suite-wide collection order: the tests marked slow (interpreted kernels, CPU compiles) run
first, so that with several workers (scripts/test.sh runs pytest-xdist) the long ones start
together and the many short ones fill in around them, instead of one long test starting last."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: else as found
