"""flare-http --socket PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY]"""

from __future__ import annotations

import argparse
import logging
import math
import os


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flare-http", description=__doc__)
    p.add_argument("--socket", default=os.environ.get("FLARE_SOCKET"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("FLARE_HTTP_API_KEY"))
    p.add_argument("--model-name", default="flare", help="the id /v1/models reports")
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--keepalive-s", type=float, default=15.0)
    p.add_argument("--max-body-bytes", type=int, default=32 << 20,
                   help="larger request bodies get 413")  # fmt: skip
    p.add_argument("--max-choices", type=int, default=128,
                   help="/v1/completions: prompts x n per call")  # fmt: skip
    p.add_argument("--connect-timeout-s", type=float, default=300.0,
                   help="how long a request waits for a starting daemon")  # fmt: skip
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    if not (a.connect_timeout_s > 0 and math.isfinite(a.connect_timeout_s)):
        p.error("--connect-timeout-s must be a positive number of seconds")

    import uvicorn

    from libflare_client.http.app import Settings, build_app

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = build_app(
        Settings(
            socket_path=a.socket,
            api_key=a.api_key,
            model_name=a.model_name,
            default_max_tokens=a.default_max_tokens,
            keepalive_s=a.keepalive_s,
            max_body_bytes=a.max_body_bytes,
            max_choices=a.max_choices,
            connect_timeout_s=a.connect_timeout_s,
        )
    )
    uvicorn.run(
        app,
        host=a.host,
        port=a.port,
        loop="uvloop",
        http="httptools",
        log_level=a.log_level,
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
