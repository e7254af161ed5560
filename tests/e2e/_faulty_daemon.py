"""`flare` with a fault injected into its executions, or its start held, for the tests of
engine failures and of clients that meet a starting daemon.

usage: python _faulty_daemon.py run BUNDLE [flare run options]
Environment: FLARE_TEST_FAULT = "raise" (the step raises) or "hang" (the step never returns);
FLARE_TEST_FAULT_FILE = a path: the fault fires on every step once that file exists, so a test
starts requests normally and then breaks the device under them. FLARE_TEST_HOLD_START_FILE =
a path: the engine's load waits (up to 120 s) until that file exists, so the daemon serves
with health "starting" for as long as a test needs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from flared.runner.runner import ModelRunner


def hold_start(release: Path) -> None:
    init = ModelRunner.__init__

    def held(self: ModelRunner, *args: Any, **kwargs: Any) -> None:
        deadline = time.monotonic() + 120
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        init(self, *args, **kwargs)

    ModelRunner.__init__ = held  # type: ignore[method-assign]


def main() -> int:
    if "FLARE_TEST_HOLD_START_FILE" in os.environ:
        hold_start(Path(os.environ["FLARE_TEST_HOLD_START_FILE"]))
    if "FLARE_TEST_FAULT" in os.environ:
        inject_fault(os.environ["FLARE_TEST_FAULT"], Path(os.environ["FLARE_TEST_FAULT_FILE"]))
    from flared.cli import main as flare_main

    return flare_main(sys.argv[1:])


def inject_fault(mode: str, trigger: Path) -> None:
    submit = ModelRunner.submit
    never = threading.Event()

    def faulty(self: ModelRunner, plan: Any, masks: Any = None) -> Any:
        if trigger.exists():
            if mode == "raise":
                raise RuntimeError("device fault (injected) in /opt/flare-secret/libdev.so.1")
            never.wait()  # a hung execution: no exception ever comes
        return submit(self, plan, masks)

    ModelRunner.submit = faulty  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
