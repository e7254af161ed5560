"""Frontend fixtures (the helpers live in frontend_support)."""

from frontend_support import *  # noqa: F403  (fixtures must be conftest attributes)
