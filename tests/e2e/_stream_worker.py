"""A client in its own process: stream one request, report progress as JSON lines on stdout.

usage: python _stream_worker.py SOCKET REQUEST_ID MAX_TOKENS SEED
Lines: {"first": true} after the first token event, then {"done": ..., "n": ...} or
{"error": "ClassName", "message": ...}.
"""

from __future__ import annotations

import json
import sys

from libflare_client import Client, FlareError, SamplingParams


def main() -> int:
    sock, rid, max_tokens, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    n = 0
    reason = None
    try:
        with Client(sock) as c:
            for ev in c.stream(prompt_token_ids=[5, 6, seed % 400 + 1], max_tokens=max_tokens,
                               ignore_eos=True, sampling=SamplingParams(seed=seed),
                               request_id=rid):  # fmt: skip
                if n == 0 and ev.token_ids:
                    print(json.dumps({"first": True}), flush=True)
                n += len(ev.token_ids)
                reason = ev.finish_reason
    except FlareError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 1
    print(json.dumps({"done": reason, "n": n}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
