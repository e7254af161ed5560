#!/usr/bin/env bash
# Set up (if needed) and run Flare's checks and CPU test-suite: ruff, mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy --strict flared/engine flared/requests.py flared/prompts.py flared/engine_commands.py flared/engine_config.py flared/memory flared/sdnotify.py flared/watchdog.py flared/frontend shm_protocol libflare_client
.venv/bin/python -m pytest -q "$@"
