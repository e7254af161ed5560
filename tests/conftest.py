"""Suite-wide collection order: the tests marked slow (interpreted kernels, CPU compiles) run
first, so that with several workers (scripts/test.sh runs pytest-xdist, worksteal) none of them
starts last and lengthens the run's tail: the other workers take the short tests meanwhile. The
compiled-execution tests then stay on one worker and share its bundles' compile caches."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: else as found
