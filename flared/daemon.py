"""`flare run BUNDLE` / `flared`: bind the socket, load the engine, serve, drain on SIGTERM.

Order: plan memory from the bundle manifest and the device (an unsatisfiable plan exits 3 with
the planner's table before anything binds), bind (or inherit) the socket before any of our
threads starts (the umask is narrowed around bind()), start serving with health "starting", build the Engine and the text frontend on a
loader thread, report "ready" (and READY=1 to systemd). SIGTERM/SIGINT: health "draining",
stop accepting and remove the socket path, let requests finish within drain_timeout_s, cancel
the rest, close sessions, stop the engine, exit 0. Engine load failure exits 1.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import signal
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from flared import env
from flared.config import DaemonConfig
from flared.sdnotify import Notifier
from flared.server.acceptor import serve
from flared.server.listener import Listener, PeerPolicy, activated_socket, bind_socket
from flared.server.service import Service
from flared.watchdog import Watchdog
from shm_protocol.paths import daemon_socket_path

log = logging.getLogger("flared")

# Exit statuses (systemd/flared.service lists the permanent ones in RestartPreventExitStatus=)
EXIT_LOAD_FAILED = 1  # the engine failed to load: retried
EXIT_USAGE = 2  # not a bundle, a bad config, a socket that cannot be bound: permanent
EXIT_PLAN_DOES_NOT_FIT = 3  # the memory plan exceeds what is free now: retried (it may free up)


def open_listener(config: DaemonConfig, policy: PeerPolicy) -> Listener:
    inherited = activated_socket()
    if inherited is not None:
        return Listener(inherited, None, owned=False)
    path = Path(config.socket_path) if config.socket_path else daemon_socket_path()
    return bind_socket(path, policy.allowed_gid)


def plan_before_bind(bundle: Path, config: DaemonConfig) -> tuple[Any, Any]:
    """(EngineConfig, RunnerPlan) from the bundle and the memory planner, before the socket
    exists: a plan that cannot fit fails here with the planner's table, and nothing binds."""
    from flared.runner.sizing import plan_runner

    engine_config = config.engine_config(bundle)
    return engine_config, plan_runner(bundle, engine_config)


def freeze_loaded_objects() -> int:
    """Move every object alive after loading (model modules, tokenizer, templates: hundreds of
    thousands) out of the cyclic garbage collector's reach. A full collection walks all of
    them while holding the GIL: 220 ms for the tiny model's 360,000 objects on a 2-CPU machine,
    0.3 ms once frozen, and it can start inside any engine step. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    # back under the collector at exit, so that interpreter teardown frees them (native
    # extensions such as Triton's report every object still alive then as leaked)
    atexit.register(gc.unfreeze)
    n = gc.get_freeze_count()
    log.info("froze %d objects out of the cyclic GC", n)
    return n


def _load_in_thread(
    bundle: Path, engine_config: Any, runner_plan: Any
) -> Future[tuple[Any, Any, dict[str, Any]]]:
    """A daemon thread (not an executor) so that a SIGTERM during loading can still exit.
    The result is (engine, frontend, runtime facts for stats)."""
    fut: Future[tuple[Any, Any, dict[str, Any]]] = Future()

    def load() -> None:
        try:
            from flared.daemon_threads import configure_engine_threads
            from flared.frontend.text import TextFrontend
            from flared.llm_engine import Engine

            threads = configure_engine_threads()  # before the engine's thread exists
            log.info("engine CPU threads: %d", threads)
            engine = Engine(bundle, engine_config, runner_plan)
            frontend = TextFrontend.from_bundle(bundle)
            frozen = freeze_loaded_objects()
            engine.start()
            facts = {"engine_cpu_threads": threads, "gc_frozen_objects": frozen}
            fut.set_result((engine, frontend, facts))
        except BaseException as exc:
            fut.set_exception(exc)
        # the grammar compiler (xgrammar, seconds to import) is built by the first
        # response_format request, on the frontend pool: warming it here would hold the GIL
        # while the first requests are served

    threading.Thread(target=load, name="flare-loader", daemon=True).start()
    return fut


async def _main(
    bundle: Path, config: DaemonConfig, listener: Listener, policy: PeerPolicy, planned: Any
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    service = Service(config)
    notifier = Notifier.from_env()
    watchdog: Watchdog | None = None
    accept_task = loop.create_task(serve(service, listener.sock, policy))
    where = listener.path or "the socket-activated fd"
    log.info("listening on %s; loading %s", where, bundle)
    load = asyncio.wrap_future(_load_in_thread(bundle, *planned))
    stop_wait: asyncio.Future[Any] = loop.create_task(stop.wait())
    await asyncio.wait([load, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        exc = load.exception()
        log.error("engine failed to load: %s: %s", type(exc).__name__, exc)
        service.fail(f"{type(exc).__name__}: {exc}")
        notifier.status(f"failed: {exc}")
        code = EXIT_LOAD_FAILED
    elif load.done():
        service.attach(*load.result())
        notifier.ready(f"serving {bundle.name}")
        engine = service.engine
        watchdog = Watchdog.from_env(notifier, lambda: (engine.heartbeat, engine.state))
        if watchdog is not None:
            watchdog.start()
        log.info("ready on %s", where)
        await stop_wait
    log.info("draining")
    notifier.stopping("draining")
    accept_task.cancel()
    listener.close()  # new clients get ECONNREFUSED/ENOENT at once; accepted ones drain
    await service.drain()
    if service.engine is not None:
        await loop.run_in_executor(None, service.engine.shutdown)
    service.shutdown_pools()
    if watchdog is not None:
        watchdog.stop()
    log.info("stopped")
    return code


def _run_loop(main: Any) -> int:
    """uvloop's event loop where it is installed (the socket side's wake-ups and writes are
    cheaper there), else asyncio's own: the daemon works the same, a little slower."""
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: serving on asyncio's default event loop")
        return int(asyncio.run(main))
    return int(uvloop.run(main))


def run(bundle: Path | str, config: DaemonConfig) -> int:
    logging.basicConfig(
        level=(env.get(env.FLARE_LOG_LEVEL) or "INFO").upper(),
        format="%(asctime)s.%(msecs)03dZ flared[%(process)d] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    logging.Formatter.converter = time.gmtime  # timestamps in UTC, marked Z
    bundle = Path(bundle)
    if not (bundle / "manifest.json").is_file():
        print(f"flared: {bundle} is not a bundle (no manifest.json)", file=sys.stderr)
        return EXIT_USAGE
    from flared.memory import MemoryConfigError, PlanDoesNotFit
    from flared.server.listener import ListenerError

    try:
        planned = plan_before_bind(bundle, config)
    except PlanDoesNotFit as exc:
        print(f"flared: the memory plan does not fit; nothing was started\n{exc}", file=sys.stderr)
        return EXIT_PLAN_DOES_NOT_FIT
    except MemoryConfigError as exc:  # settings that contradict each other for this bundle
        print(f"flared: [memory] {exc}; nothing was started", file=sys.stderr)
        return EXIT_USAGE
    log.info("memory plan:\n%s", planned[1].memory.table() if planned[1].memory else "-")
    try:
        policy = PeerPolicy.build(config.allowed_group, config.allowed_uids)
        listener = open_listener(config, policy)
    except ListenerError as exc:
        print(f"flared: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run_loop(_main(bundle, config, listener, policy, planned))
    finally:
        listener.close()
