"""Fixtures for the daemon end-to-end tests (the helpers live in e2e_support)."""

import os

from e2e_support import *  # noqa: F403  (fixtures must be conftest attributes)
from hypothesis import settings

# Property tests draw the same examples every run (a red run is a regression, never a newly
# drawn example); FLARE_HYPOTHESIS=explore draws fresh ones (see README, Tests).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("FLARE_HYPOTHESIS", "repeatable"))
