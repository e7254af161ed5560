"""`flare` (prep, run, chat, status, demo) and `flared` (= `flare run`).

Light at import: nothing here imports torch, prep's heavy modules or the engine; `prep` and
the demo's model building run in child processes that exit and take their memory with them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flared import env

DEMO_PROMPT = "Hello! Say something about foxes."


def _sub(p: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str) -> Any:
    return p.add_parser(name, help=text, description=text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flare", description="Flare local inference daemon")
    sub = p.add_subparsers(dest="command", required=True)
    _sub(sub, "prep", "prepare a checkpoint into a bundle (runs `python -m prep ARGS`)")
    run = _sub(sub, "run", "run the daemon on a bundle")
    _run_args(run)
    chat = _sub(sub, "chat", "chat with the daemon (one-shot with MESSAGE, else interactive)")
    chat.add_argument("message", nargs="?")
    chat.add_argument("--socket")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float)
    chat.add_argument("--seed", type=int)
    chat.add_argument("--system", help="a system message")
    status = _sub(sub, "status", "daemon health and stats as JSON")
    status.add_argument("--socket")
    demo = _sub(sub, "demo", "build the tiny built-in model, serve it, chat once, stop")
    demo.add_argument("--message", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--cache-dir", type=Path, help="where the model and bundle are kept")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    return p


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=Path)
    p.add_argument("--socket", help="socket path (default: INTERFACES.md resolution)")
    p.add_argument("--config", type=Path, help="TOML file (see flared/config.py)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "prep":  # everything after `prep` belongs to prep's own parser
        return subprocess.call([sys.executable, "-m", "prep", *argv[1:]])
    args = build_parser().parse_args(argv)
    handler = {"run": cmd_run, "chat": cmd_chat, "status": cmd_status, "demo": cmd_demo}
    try:
        return int(handler[args.command](args))
    except KeyboardInterrupt:
        return 130


def flared_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flared", description="the Flare daemon (= flare run)")
    _run_args(p)
    return cmd_run(p.parse_args(sys.argv[1:] if argv is None else argv))


def cmd_run(args: argparse.Namespace) -> int:
    from flared.config import ConfigError, load_config, with_overrides
    from flared.daemon import EXIT_USAGE, run

    try:
        cfg = with_overrides(load_config(args.config), socket_path=args.socket, device=args.device)
    except ConfigError as exc:
        print(f"flared: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run(args.bundle, cfg)


def cmd_status(args: argparse.Namespace) -> int:
    from libflare_client import Client, FlareError

    client = Client(args.socket)
    try:
        stats = client.stats()
    except FlareError as exc:
        print(json.dumps({"health": "unreachable", "socket": str(client.socket_path),
                          "error": str(exc)}))  # fmt: skip
        return 1
    finally:
        client.close()
    print(json.dumps({"socket": str(client.socket_path), **stats}, indent=2, sort_keys=True))
    return 0 if stats.get("health") == "ready" else 1


def _stream_reply(conv: Any) -> None:
    """Print one reply of a conversation as it streams (the conversation records it)."""
    for ev in conv.stream():
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        if ev.finish_reason is not None:
            sys.stdout.write("\n")
            if ev.finish_reason != "stop":
                print(f"[{ev.finish_reason}]", file=sys.stderr)


def _conversation(client: Any, args: argparse.Namespace, system: str | None = None) -> Any:
    from libflare_client import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    return client.conversation(system=system, max_tokens=args.max_tokens, sampling=sampling)


def cmd_chat(args: argparse.Namespace) -> int:
    from libflare_client import Client, FlareError

    client = Client(args.socket)
    conv = _conversation(client, args, args.system or None)
    try:
        if args.message is not None:
            _stream_reply(conv.user(args.message))
            return 0
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            sys.stdout.write("flare> ")
            _stream_reply(conv.user(line))
    except FlareError as exc:
        print(f"flare chat: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _cache_dir(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    if env.get(env.FLARE_CACHE_DIR):
        return Path(str(env.get(env.FLARE_CACHE_DIR)))
    base = env.get(env.XDG_CACHE_HOME) or str(Path.home() / ".cache")
    return Path(base) / "flare" / "demo"


def _demo_bundle(cache: Path) -> Path:
    """Build (once) the tiny checkpoint and its CPU bundle, each in a child process."""
    ckpt, bundle = cache / "tiny-qwen3", cache / "tiny-qwen3.bundle"
    if not (ckpt / "config.json").is_file():
        print(f"building the tiny model in {ckpt}", file=sys.stderr)
        code = (
            "import sys; from prep.tiny import make_tiny_checkpoint as m; m(sys.argv[1], 'qwen3')"
        )
        subprocess.run([sys.executable, "-c", code, str(ckpt)], check=True)
    if not (bundle / "manifest.json").is_file():
        print(f"preparing {bundle}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "prep", str(ckpt), "--out", str(bundle), "--device", "cpu",
             "--max-context", "512", "--prefill-chunk", "256", "--no-compile"],
            check=True,
        )  # fmt: skip
    return bundle


def cmd_demo(args: argparse.Namespace) -> int:
    from libflare_client import Client, FlareError

    bundle = _demo_bundle(_cache_dir(args.cache_dir))
    with tempfile.TemporaryDirectory(prefix="flare-demo-") as tmp:
        sock = Path(tmp) / "flared.sock"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "flared.cli", "run", str(bundle), "--socket", str(sock),
             "--device", "cpu"],
        )  # fmt: skip
        client = Client(sock)
        try:
            _wait_ready(client, daemon, args.timeout)
            print(f"you> {args.message}\nflare> ", end="", flush=True)
            ns = argparse.Namespace(max_tokens=args.max_tokens, temperature=None, seed=1)
            _stream_reply(_conversation(client, ns).user(args.message))
        except (FlareError, TimeoutError) as exc:
            print(f"flare demo: {type(exc).__name__}: {exc}", file=sys.stderr)
            daemon.kill()
            daemon.wait()
            return 1
        finally:
            client.close()
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=60)
        print(f"daemon stopped (exit {code})", file=sys.stderr)
        return 0 if code == 0 else 1


def _wait_ready(client: Any, daemon: subprocess.Popen[bytes], timeout_s: float) -> None:
    from libflare_client import ConnectionLost

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise TimeoutError(f"the daemon exited with {daemon.returncode} before ready")
        try:
            state = client.health()
            if state == "ready":
                return
            if state == "failed":
                raise TimeoutError("the daemon reported failed")
        except ConnectionLost:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the daemon was not ready within {timeout_s}s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
