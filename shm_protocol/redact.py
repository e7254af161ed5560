"""What error text may cross to clients: filesystem paths (shared-memory names, the socket's
and the bundle's paths, library files) become <path>. The daemon's and the shim's own logs
keep the original text."""

from __future__ import annotations

import re

# two or more segments (/dev/shm/x, /opt/lib/x.so): a lone "/v1" or "/no_think" is not a path
_PATH = re.compile(r"(?<![\w.~:/-])/(?:[\w.@+~-]+/)+[\w.@+~-]+")


def redact(text: str) -> str:
    return _PATH.sub("<path>", text)
