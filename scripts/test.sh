#!/usr/bin/env bash
# Set up (if needed) and run Flare's checks and CPU test-suite: ruff, mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy --strict flared/engine flared/requests.py flared/prompts.py flared/engine_commands.py flared/engine_config.py flared/memory flared/sdnotify.py flared/watchdog.py flared/frontend shm_protocol libflare_client
# one pytest worker per core, at most four (each builds its own tiny models and compiles);
# FLARE_TEST_WORKERS=0 runs the tests in this process
workers=${FLARE_TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
[ "$workers" -gt 4 ] && workers=4
# the slowest tests are listed at the end: the suite is kept near 20 min on a 2-core machine
.venv/bin/python -m pytest -q -n "$workers" --dist worksteal --durations=15 "$@"
