"""CPU cost of flare-http's own Python path, per request and per streamed token, without
sockets or a daemon: the real ASGI app is driven in-process (uvloop) with a stand-in for the
client's stream() that yields ready-made events (one per event-loop iteration), and an ASGI
send that only counts bytes.

    python benchmarks/http_stream_cost.py                      # this checkout
    python benchmarks/http_stream_cost.py --ref DIR            # and another checkout, same run

Each API streams requests of T and 2T one-token events; per-token cost = (t(2T) - t(T)) / T,
per-request cost = t(T) - T * per-token, with t the minimum CPU time over repeats and runs
(interference only adds to it; runs of the checkouts alternate). What the end-to-end benchmark (http_overhead.py) adds is the loopback socket: one
write per flushed batch of frames. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
APIS = {
    "completions": ("/v1/completions", {"prompt": [11, 12, 13]}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi"}),
}


def child(api: str, tokens: int, repeats: int) -> list[float]:
    """CPU seconds per streamed request (one per repeat), measured in this process."""
    import asyncio

    import uvloop

    from libflare_client import StreamEvent, Usage
    from libflare_client.http.app import Settings, build_app

    app = build_app(Settings(socket_path="/nonexistent/flared.sock"))
    client = app.state.client

    class Welcome:
        max_context_tokens, vocab_size = 4096, 1000

    class Conn:
        welcome = Welcome()

    async def connect() -> Any:
        return Conn()

    async def stream(*, request_id: str, **kw: Any) -> Any:
        parsed = "messages" in kw
        for _ in range(tokens - 1):
            await asyncio.sleep(0)  # one event per loop iteration, as from the daemon's ring
            yield StreamEvent(request_id, [7], "tok", [], content="tok" if parsed else "")
        yield StreamEvent(request_id, [7], "end", [], "length", Usage(3, tokens, 0),
                          content="end" if parsed else "")  # fmt: skip

    client.connect, client.stream = connect, stream
    path, extra = APIS[api]
    body = json.dumps({"model": "m", "max_tokens": tokens, "stream": True, **extra}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 5000),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}  # fmt: skip

    async def one() -> float:
        sent = [False]
        nbytes = 0
        gate = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gate.wait()  # the client stays connected
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            nonlocal nbytes
            nbytes += len(msg.get("body", b""))

        t0 = time.thread_time()  # CPU time: preemption by other processes does not count
        await app(scope, receive, send)
        dt = time.thread_time() - t0
        gate.set()
        assert nbytes > tokens, nbytes
        return dt

    async def run() -> list[float]:
        for _ in range(3):
            await one()
        return [await one() for _ in range(repeats)]

    return uvloop.run(run())


def measure(repo: Path, api: str, tokens: int, repeats: int) -> float:
    """Median seconds per request of `tokens` events, in a fresh interpreter on `repo`."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    cmd = [sys.executable, __file__, "--child", api, str(tokens), str(repeats)]
    out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(rec["module"]).is_relative_to(repo), (rec["module"], repo)
    return float(min(rec["seconds"]))  # interference only adds: the minimum is the cost


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--ref", type=Path, help="another checkout, measured as 'ref' in the same run")
    p.add_argument("--api", type=lambda s: s.split(","), default=list(APIS))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the checkouts")
    p.add_argument("--out", type=Path, help="append the records to this JSON-lines file")
    p.add_argument("--note", default="", help="free text stored with every record")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        import libflare_client

        secs = child(a.child[0], int(a.child[1]), int(a.child[2]))
        print(json.dumps({"module": libflare_client.__file__, "seconds": secs}))
        return
    repos = {"this": REPO, **({"ref": a.ref.resolve()} if a.ref else {})}
    rows = []
    for api in a.api:
        t: dict[tuple[str, int], list[float]] = {}
        for rnd in range(a.rounds):
            for name, repo in list(repos.items())[:: 1 if rnd % 2 == 0 else -1]:
                for n in (a.tokens, 2 * a.tokens):
                    t.setdefault((name, n), []).append(measure(repo, api, n, a.repeats))
        for name in repos:
            one, two = (min(t[(name, n)]) for n in (a.tokens, 2 * a.tokens))
            per_tok = (two - one) / a.tokens
            rec = {"kind": "http_stream_cost", "api": api, "code": name, "tokens": a.tokens,
                   "per_token_us": per_tok * 1e6, "per_request_us": (one - a.tokens * per_tok)
                   * 1e6, "request_ms": one * 1e3}  # fmt: skip
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    if a.out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()  # fmt: skip
        meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cpus": os.cpu_count(),
                "load_1m": os.getloadavg()[0], "note": a.note}  # fmt: skip
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")
    print(f"\n{'api':>12} {'code':>5} {'us/token':>9} {'us/request':>11}")
    for r in rows:
        print(
            f"{r['api']:>12} {r['code']:>5} {r['per_token_us']:>9.1f} {r['per_request_us']:>11.0f}"
        )


if __name__ == "__main__":
    main()
