"""DaemonConfig: every daemon option, frozen, loaded from TOML. No I/O beyond reading the file.

Example (every key optional; shown with its default):

    [daemon]
    socket_path = ""               # "" = $FLARE_SOCKET / system / $XDG_RUNTIME_DIR default
    allowed_group = ""             # a group whose members may connect besides the daemon's
                                   # own uid and root ("" = none); the socket is chown'ed to it
    allowed_uids = []              # extra uids that may connect
    drain_timeout_s = 30.0         # SIGTERM: time in-flight requests get to finish
    handshake_timeout_s = 5.0      # a connection must send OpenSession within this
    max_sessions = 256             # concurrent client connections (handshaking ones too)
    max_sessions_per_uid = 0       # of those, one uid's at most (0 = no per-uid cap; the
                                   # shipped system config sets 128 for a shared daemon)
    max_frame_bytes = 1048576      # largest control frame, checked before decoding
    event_ring_bytes = 262144      # per-session daemon->client event ring (power of two)
    request_ring_bytes = 1048576   # per-session client->daemon prompt ring (power of two)
    max_backlog_records = 4096     # events waiting for ring space, per session
    stall_timeout_s = 10.0         # a session whose ring stays full this long has its
                                   # requests cancelled (others are unaffected)
    engine_stall_timeout_s = 0.0   # an engine loop that makes no progress this long (a hung
                                   # execution) fails: its requests get EngineError at once
                                   # (0 = 60 s on CUDA, off on CPU, where a step of a large
                                   # model may legitimately take minutes)
    max_socket_buffer_bytes = 8388608  # socket-transport sessions: unsent bytes before a stall
    frontend_workers = 4           # tokenize/render/admission worker threads
    max_pending_frontend_jobs = 512    # beyond this, Submit gets Busy
    detok_lanes = 2                # detokenizer threads (a request always uses one lane)

    [engine]                       # flared.llm_engine.EngineConfig
    device = "auto"                # auto | cpu | cuda
    num_pages = 0                  # 0 = from the memory budget
    max_num_rows = 0               # 0 = the largest decode capacity
    max_num_waiting = 256
    compile = "auto"               # auto (= what the bundle was prepared with) | on | off | decode
    cuda_graphs = true
    attention_backend = "auto"
    decode_gemm = "skinny"         # skinny | fused | folded | cublas | mlp | gemv: decode-sized
                                   # projections on CUDA (fused: experimental, 2.4x slower on
                                   # the H200; see README)
    decode_folded_rows = 16        # folded: decode steps of more rows run the skinny products
                                   # (below the largest capacity: not batch invariant; see README)
    decode_single_gemm = "auto"    # auto | none | folded | gemv | folded-gemv: one-row decode
                                   # steps of a request without a seed (seeded: batch
                                   # invariant); auto: folded-gemv on CUDA beside skinny
    decode_single_attention = "auto"  # auto | two | one | qkv: those one-row steps' attention
                                   # and o projection in two launches, one, or one with q|k|v
    prefill_fresh = "auto"         # auto | on | off: a chunk of >= 2,048 tokens that starts its
                                   # prompt attends over its own keys (cuDNN on CUDA)
    decode_pdl = false             # decode kernels with programmatic dependent launch (SM90+)
    decode_pdl_trigger = "after_wait"  # start | after_wait | end: where a PDL kernel lets the next start
    decode_single_pdl = true       # the one-row steps of decode_single_gemm alone with PDL
    decode_single_pdl_trigger = "end"  # start | after_wait | end: those steps' PDL trigger
    decode_split_k = false         # decode products of <= 8,192 outputs split K over programs
    decode_attention_prefetch = "auto" # off | start | end | auto: decode attention warms o's weight in L2
    candidate_draw = "ops"         # ops | kernel: the candidate path's top-k, filters and draw as
                                   # compiled operations or in one two-launch kernel (CUDA)
    step_wait = "spin"             # spin | block: how the engine thread waits for a CUDA step
                                   # (block: the driver puts it to sleep, freeing its core)
    prefix_cache = true            # checkpoints at message ends / prompt end, reused by later requests
    chunk_by_cost = true           # cut prefill into the chunks of least measured time (CUDA)
    gil_switch_interval_ms = 0.2   # GIL hand-off bound: render threads stall the engine up to this per call
    kv_memory_fraction = 0.5       # accepted for older files; superseded by [memory]

    [memory]                       # flared.memory.MemoryConfig (see flared/memory/inputs.py)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

STEP_WAITS = ("spin", "block")  # flared.runner.steps: how the host waits for a CUDA step
PDL_TRIGGERS = ("start", "after_wait", "end")  # prep.components.launch
ATTENTION_PREFETCH = ("off", "start", "end", "auto")  # prep.components.launch
CANDIDATE_DRAWS = ("ops", "kernel")  # prep.components.sampling
SINGLE_ATTENTIONS = ("two", "one", "qkv")  # prep.components.fused


class ConfigError(ValueError):
    """The configuration file is invalid; the message names the key."""


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"
    num_pages: int = 0
    max_num_rows: int = 0
    max_num_waiting: int = 256
    compile: str = "auto"
    cuda_graphs: bool = True
    attention_backend: str = "auto"
    decode_gemm: str = "skinny"
    decode_folded_rows: int = 16
    decode_single_gemm: str = "auto"
    decode_single_attention: str = "auto"
    prefill_fresh: str = "auto"
    decode_pdl: bool = False
    decode_pdl_trigger: str = "after_wait"
    decode_single_pdl: bool = True
    decode_single_pdl_trigger: str = "end"
    decode_split_k: bool = False
    decode_attention_prefetch: str = "auto"
    candidate_draw: str = "ops"
    step_wait: str = "spin"
    prefix_cache: bool = True
    chunk_by_cost: bool = True
    # 0.2 ms, not Python's 5: see config/flared.toml and benchmarks/gil_convoy.py
    gil_switch_interval_ms: float = 0.2
    kv_memory_fraction: float = 0.5


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str = ""
    allowed_group: str = ""
    allowed_uids: tuple[int, ...] = ()
    drain_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    max_sessions: int = 256
    max_sessions_per_uid: int = 0
    max_frame_bytes: int = 1 << 20
    event_ring_bytes: int = 1 << 18
    request_ring_bytes: int = 1 << 20
    max_backlog_records: int = 4096
    stall_timeout_s: float = 10.0
    engine_stall_timeout_s: float = 0.0
    max_socket_buffer_bytes: int = 8 << 20
    frontend_workers: int = 4
    max_pending_frontend_jobs: int = 512
    detok_lanes: int = 2
    engine: EngineOptions = field(default_factory=EngineOptions)
    memory: Any = None  # flared.memory.MemoryConfig; None = its defaults

    def validate(self) -> DaemonConfig:
        for name in ("event_ring_bytes", "request_ring_bytes"):
            v = getattr(self, name)
            if v < 4096 or v & (v - 1):
                raise ConfigError(f"daemon.{name} must be a power of two >= 4096, got {v}")
        for name in ("max_sessions", "frontend_workers", "detok_lanes", "max_backlog_records"):
            if getattr(self, name) < 1:
                raise ConfigError(f"daemon.{name} must be >= 1")
        for name in ("stall_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"daemon.{name} must be > 0")
        if not self.engine_stall_timeout_s >= 0:
            raise ConfigError("daemon.engine_stall_timeout_s must be >= 0 (0 = by device)")
        if self.max_sessions_per_uid < 0:
            raise ConfigError("daemon.max_sessions_per_uid must be >= 0 (0 = no per-uid cap)")
        if self.max_frame_bytes < 4096:
            raise ConfigError("daemon.max_frame_bytes must be >= 4096")
        if not 0 <= self.engine.gil_switch_interval_ms <= 100:
            raise ConfigError("engine.gil_switch_interval_ms must be within [0, 100]")
        if self.engine.compile not in ("auto", "on", "off", "decode"):
            raise ConfigError(
                f"engine.compile must be auto, on, off or decode, got {self.engine.compile!r}"
            )
        if self.engine.step_wait not in STEP_WAITS:
            raise ConfigError(
                f"engine.step_wait must be spin or block, got {self.engine.step_wait!r}"
            )
        for key in ("decode_pdl_trigger", "decode_single_pdl_trigger"):
            if getattr(self.engine, key) not in PDL_TRIGGERS:
                raise ConfigError(
                    f"engine.{key} must be start, after_wait or end, got "
                    f"{getattr(self.engine, key)!r}"
                )
        if self.engine.decode_attention_prefetch not in ATTENTION_PREFETCH:
            raise ConfigError(
                "engine.decode_attention_prefetch must be off, start, end or auto, got "
                f"{self.engine.decode_attention_prefetch!r}"
            )
        if self.engine.decode_single_attention not in ("auto", *SINGLE_ATTENTIONS):
            raise ConfigError(
                "engine.decode_single_attention must be auto, two, one or qkv, got "
                f"{self.engine.decode_single_attention!r}"
            )
        if self.engine.candidate_draw not in CANDIDATE_DRAWS:
            raise ConfigError(
                f"engine.candidate_draw must be ops or kernel, got {self.engine.candidate_draw!r}"
            )
        if self.engine.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(
                f"engine.device must be auto, cpu or cuda, got {self.engine.device!r}"
            )
        return self

    def engine_config(self, bundle_dir: Path | str) -> Any:
        """The flared.llm_engine.EngineConfig these options describe for this bundle ("auto"
        device and compile resolved; reads the bundle's manifest)."""
        from flared.llm_engine import EngineConfig

        e = self.engine
        modes: dict[str, bool | str] = {"auto": "bundle", "on": True, "off": False}
        compile_mode = modes.get(e.compile, e.compile)
        device = e.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return EngineConfig(
            device=device,
            num_pages=e.num_pages or None,
            max_num_rows=e.max_num_rows or None,
            max_num_waiting=e.max_num_waiting,
            compile=compile_mode,
            cuda_graphs=e.cuda_graphs,
            attention_backend=e.attention_backend,
            decode_gemm=e.decode_gemm,
            decode_folded_rows=e.decode_folded_rows,
            decode_single_gemm=e.decode_single_gemm,
            decode_single_attention=e.decode_single_attention,
            prefill_fresh=e.prefill_fresh,
            decode_pdl=e.decode_pdl,
            decode_pdl_trigger=e.decode_pdl_trigger,
            decode_single_pdl=e.decode_single_pdl,
            decode_single_pdl_trigger=e.decode_single_pdl_trigger,
            decode_split_k=e.decode_split_k,
            decode_attention_prefetch=e.decode_attention_prefetch,
            candidate_draw=e.candidate_draw,
            step_wait=e.step_wait,
            prefix_cache=e.prefix_cache,
            prefill_chunk_costs="measured" if e.chunk_by_cost else (),
            memory=self.memory,
            gil_switch_interval_s=e.gil_switch_interval_ms / 1e3,
        )


def _typed(section: str, cls: type, table: dict[str, Any]) -> dict[str, Any]:
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known or key in ("engine", "memory"):
            raise ConfigError(f"unknown option {section}.{key}")
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(value, list):
                raise ConfigError(f"{section}.{key} must be a list")
            value = tuple(value)
        elif isinstance(default, bool) != isinstance(value, bool) or (
            not isinstance(value, type(default))
            and not (isinstance(default, float) and isinstance(value, int))
        ):
            raise ConfigError(f"{section}.{key} must be {type(default).__name__}, got {value!r}")
        out[key] = float(value) if isinstance(default, float) else value
    return out


def parse_config(data: dict[str, Any]) -> DaemonConfig:
    unknown = set(data) - {"daemon", "engine", "memory"}
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)}; expected daemon/engine/memory")
    engine = EngineOptions(**_typed("engine", EngineOptions, data.get("engine", {})))
    memory = None
    if "memory" in data:
        from flared.memory import MemoryConfig, MemoryConfigError

        try:
            memory = MemoryConfig(**_typed("memory", MemoryConfig, data["memory"])).validate()
        except MemoryConfigError as exc:
            raise ConfigError(str(exc)) from exc
    daemon = _typed("daemon", DaemonConfig, data.get("daemon", {}))
    return DaemonConfig(**daemon, engine=engine, memory=memory).validate()


def load_config(path: Path | str | None) -> DaemonConfig:
    if path is None:
        return DaemonConfig().validate()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    return parse_config(data)


def with_overrides(
    cfg: DaemonConfig, *, socket_path: str | None = None, device: str | None = None
) -> DaemonConfig:
    """Command-line flags win over the file."""
    if socket_path:
        cfg = replace(cfg, socket_path=socket_path)
    if device:
        cfg = replace(cfg, engine=replace(cfg.engine, device=device))
    return cfg.validate()
