"""The in-process engine's options (flared.llm_engine.Engine); the daemon builds them from its
config file (flared.config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    num_pages: int | None = None  # None: from the memory budget
    max_num_rows: int | None = None  # None: the largest decode capacity
    max_num_waiting: int = 256
    compile: bool | str = "bundle"  # see RunnerPlan.compile
    cuda_graphs: bool = True
    attention_backend: str = "auto"  # "auto" | "reference" | "triton"
    # "skinny" | "fused" | "folded" | "cublas" | "mlp" | "gemv" (prep.components.fused);
    # "folded": steps of more than decode_folded_rows decode rows run the skinny products over
    # the same folded weights (a row's arithmetic then depends on the decode batch: not batch
    # invariant below the largest capacity)
    decode_gemm: str = "skinny"
    decode_folded_rows: int = 16
    # "auto" | "none" | "folded" | "gemv" | "folded-gemv" (with decode_gemm "skinny"): a
    # decode step that runs one request without a seed (RequestParams.reproducible False)
    # takes these products instead; seeded requests and steps of more rows keep the
    # batch-invariant ones. auto: folded-gemv on CUDA beside skinny, else none
    decode_single_gemm: str = "auto"
    # "auto" | "two" | "one" | "qkv": how those one-row steps run a layer's attention and o
    # projection (prep.components.fused.SINGLE_ATTENTIONS; auto: AUTO_SINGLE_ATTENTION on CUDA)
    decode_single_attention: str = "auto"
    # "auto" | "on" | "off": a prefill chunk that starts its prompt (capacities of 2,048 tokens
    # and more) attends over its own keys through torch's attention, cuDNN's on CUDA, instead
    # of the paged kernel; auto: on with CUDA, the Triton backend and cuDNN, else off
    prefill_fresh: str = "auto"
    decode_pdl: bool = False  # decode kernels with programmatic dependent launch (SM90+)
    decode_pdl_trigger: str = "after_wait"  # "start" | "after_wait" | "end" (launch.py)
    # the one-row executions of decode_single_gemm alone launch their Flare kernels with PDL
    # (every other execution as decode_pdl says; config/flared.toml, README), each triggering
    # its dependents at decode_single_pdl_trigger: "start" | "after_wait" | "end" (launch.py;
    # at the end measured fastest on an H100: 1.7B c1 -3.0%, 8B -1.2% in medians)
    decode_single_pdl: bool = True
    decode_single_pdl_trigger: str = "end"
    decode_split_k: bool = False  # decode products of <= 8,192 outputs split K (skinny_gemm)
    decode_attention_prefetch: str = "auto"  # off|start|end|auto: o's weight into L2 (launch.py)
    # "ops" | "kernel": the candidate path's top-k, filters and draw as compiled operations or
    # in Flare's two-launch kernel (prep/components/candidate_draw.py; CUDA only)
    candidate_draw: str = "ops"
    # the engine thread's wait for a CUDA step: "spin" (the driver polls, a core busy) | "block"
    step_wait: str = "spin"  # (the driver sleeps the thread; config/flared.toml)
    # checkpoints + prefix cache; snapshot rows from memory.target_snapshots (0: the default of
    # flared.runner.sizing.default_snapshots)
    prefix_cache: bool = True
    memory: Any = None  # flared.memory.MemoryConfig; None = its defaults
    kv_memory_fraction: float = 0.5  # superseded by memory.budget_fraction; kept for old configs
    # Steps submitted ahead of the oldest result (CUDA: the device runs step N while the host
    # plans N+1). None: MAX_STEPS_IN_FLIGHT on CUDA, 1 on CPU, whose runner executes each step
    # inside its submit, so a second step in flight would only hold every result (the first
    # token included) back by one step.
    max_steps_in_flight: int | None = None
    # Python's GIL switch interval for this process while the engine runs (0: leave Python's
    # 5 ms). Every torch call of the engine thread releases the GIL; while another thread of the
    # process runs Python (the daemon renders chat templates on worker threads), each such call
    # waits up to the interval to get it back, dozens of times per step (benchmarks/gil_convoy.py,
    # H200, 2B hybrid: decode ITL 3.2 ms alone, 57 ms beside a rendering thread at 5 ms, 3.3 ms
    # at 0.2 ms).
    # The daemon sets 0.2 ms by default; the in-process engine leaves the embedding process's
    # setting alone unless asked.
    gil_switch_interval_s: float = 0.0
    # Cut prefill segments into chunks by the device time of each prefill capacity: "measured"
    # uses the times the runner measured at startup (CUDA graphs; none on CPU, where chunks
    # stay as long as the limit allows); a tuple of (capacity, ms) pairs gives them; () = off.
    prefill_chunk_costs: str | tuple[tuple[int, float], ...] = "measured"
    # After handing a step's events to their sinks while a later step still runs on the
    # device, release the GIL for this long (None: not at all; 0: one release) so that the
    # threads those events woke take it before the engine plans its next step. The second:
    # the same only after a step that delivered some request's first token (TTFT-critical).
    dispatch_yield_s: float | None = None
    first_token_yield_s: float | None = None
