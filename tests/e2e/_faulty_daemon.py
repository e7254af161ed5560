"""`flare` with a fault injected into its executions, for the engine-failure tests.

usage: python _faulty_daemon.py run BUNDLE [flare run options]
Environment: FLARE_TEST_FAULT = "raise" (the step raises) or "hang" (the step never returns);
FLARE_TEST_FAULT_FILE = a path: the fault fires on every step once that file exists, so a test
starts requests normally and then breaks the device under them.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from flared.runner.runner import ModelRunner


def main() -> int:
    mode, trigger = os.environ["FLARE_TEST_FAULT"], Path(os.environ["FLARE_TEST_FAULT_FILE"])
    submit = ModelRunner.submit
    never = threading.Event()

    def faulty(self: ModelRunner, plan: Any, masks: Any = None) -> Any:
        if trigger.exists():
            if mode == "raise":
                raise RuntimeError("device fault (injected) in /opt/flare-secret/libdev.so.1")
            never.wait()  # a hung execution: no exception ever comes
        return submit(self, plan, masks)

    ModelRunner.submit = faulty  # type: ignore[method-assign]
    from flared.cli import main as flare_main

    return flare_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
