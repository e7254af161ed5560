#!/usr/bin/env bash
# Set up (if needed) and run the main job: build the small built-in model, prep it into a bundle,
# start flared on a private socket, stream one chat reply through it, and stop the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flare demo "$@"
