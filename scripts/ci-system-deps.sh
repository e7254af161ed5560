#!/usr/bin/env bash
# System packages the CPU test-suite uses beyond the venv: systemd's offline tools
# (systemd-analyze verify, systemd-sysusers, systemd-tmpfiles) for tests/unit/systemd.
# Idempotent and quiet: a no-op when they are present. Never fails the caller: when they cannot
# be installed (no apt-get, not root and no passwordless sudo, no network) it says so on stderr
# and the tests that need them skip with that reason.
set -uo pipefail

if command -v systemd-analyze >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ci-system-deps: systemd-analyze missing and no apt-get; systemd unit tests will skip" >&2
  exit 0
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "ci-system-deps: not root and no passwordless sudo; systemd unit tests will skip" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
install() {
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends systemd >/dev/null 2>&1
}
if ! install; then
  "${SUDO[@]}" apt-get update -qq >/dev/null 2>&1 && install || \
    echo "ci-system-deps: apt-get install systemd failed; systemd unit tests will skip" >&2
fi
exit 0
