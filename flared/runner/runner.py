"""ModelRunner: owns the device tensors, the prepared calls, and step submission.

Load order (all before ready): read the bundle, build the canonical model with prepared
attention and copy the weights in, allocate KV pages and the request state once, build one
prepared call per catalog entry (decode capacities, prefill capacities, admit, page writes),
compile them (persisted Inductor cache), and on CUDA capture a CUDA graph for each. After that
`submit()` only stages metadata into pinned buffers, uploads it, and replays.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flared.engine.plan import StepPlan, StepResult
from flared.runner.prepared import PreparedCall
from flared.runner.steps import StepBuilder
from prep.bundle import Manifest, read_manifest
from prep.calls import FRESH_SUFFIX, build_call_specs, fresh_chunk_min, with_products
from prep.compiling import FORWARD_MODES, cache_mismatch, configure, mark_pages_dynamic
from prep.components import launch, sampling
from prep.components.fused import (
    set_decode_gemm,
    set_decode_pdl,
    set_decode_split_k,
    set_single_attention,
)
from prep.components.paged_attention import PagedKVCache
from prep.components.state_pool import StatePool
from prep.executions import Completion, Executions, RequestState
from prep.model import DTYPES, build_model, load_config, load_weights
from prep.rss import peak_rss_bytes

log = logging.getLogger("flared.runner")

# how far prefill{C}_fresh may be from prefill{C} on the startup check (relative L2 of the last
# attention layer's keys and values and the last hidden vector): the two attentions round
# differently (measured: fp32 6e-7; bf16 4.5e-3 on a 2-layer model, 3.5e-2 on a random-weight
# Qwen3-8B shape, its 36 layers amplifying the rounding); a broken attention (no causal mask,
# zeros) is off by O(1)
FRESH_CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.2}


@dataclass(frozen=True)
class RunnerPlan:
    """Derived at startup (memory planner output), passed down; never mutated."""

    device: str
    num_pages: int
    max_num_rows: int
    # "bundle": the mode prep compiled and cached (none for --no-compile bundles);
    # False/"none"; "forward": the decoder stack compiled inside every execution;
    # "decode-forward": only inside decode executions; True/"all": every execution compiled
    # whole; "decode": decode executions compiled whole.
    compile: bool | str
    cuda_graphs: bool
    attention_backend: str = "reference"  # "reference" | "triton"
    decode_gemm: str = "skinny"  # skinny | fused | folded | cublas | mlp | gemv: decode products
    decode_folded_rows: int = 16  # folded: the largest decode step that runs the folded layers
    # one-row decode steps of a request without a seed: none | folded | gemv | folded-gemv
    decode_single_gemm: str = "none"
    # their attention and o projection: two | one | qkv (prep.components.fused.SINGLE_ATTENTIONS)
    decode_single_attention: str = "two"
    # prefill{C}_fresh executions: a chunk that starts its prompt attends over its own keys
    # through torch's attention (cuDNN on CUDA) instead of the paged kernel (AttentionMeta.fresh)
    prefill_fresh: bool = False
    decode_pdl: bool = False  # decode kernels with programmatic dependent launch (SM90+)
    decode_pdl_trigger: str = "after_wait"  # where a PDL kernel lets the next one start
    # the one-row executions of decode_single_gemm launch their Flare kernels with PDL, each
    # triggering its dependents at decode_single_pdl_trigger (start | after_wait | end)
    decode_single_pdl: bool = False
    decode_single_pdl_trigger: str = "end"
    decode_split_k: bool = False  # decode products split K over programs (skinny_gemm)
    # where the decode attention warms the o projection's weight in L2: off | start | end
    decode_attention_prefetch: str = "auto"
    # how the candidate path draws on CUDA: "ops" | "kernel" (sampling.CANDIDATE_DRAWS)
    candidate_draw: str = "ops"
    step_wait: str = "spin"  # "spin" | "block": the completion event's wait (steps.py)
    num_snapshot_rows: int = 0  # checkpoint snapshot rows of the state pool (0: no prefix cache)
    memory: Any = None  # the flared.memory.MemoryPlan this plan was derived from


class ModelRunner:
    def __init__(self, bundle_dir: Path | str, plan: RunnerPlan) -> None:
        t0 = time.perf_counter()
        self.bundle_dir = Path(bundle_dir)
        self.manifest: Manifest = read_manifest(self.bundle_dir)
        self.plan = plan
        self.device = torch.device(plan.device)
        m = self.manifest
        geo, cat = m.geometry, m.catalog
        self.page_size = geo.page_size
        # one page beyond the context: the admission reservation of a maximal prompt
        self.max_pages_per_row = -(-cat.max_context_tokens // geo.page_size) + 1
        self.dtype = DTYPES[m.dtype]
        # device bytes at each load stage (CUDA): the load-peak and graph-pool measurements
        self.memory_report: dict[str, int] = {}
        self._mark("start")
        config = load_config(self.bundle_dir)
        self.model = build_model(config, self.device, self.dtype, m.layout)
        files = [self.bundle_dir / e for e in sorted({t.file for t in m.tensors})]
        self.weight_bytes = load_weights(self.model, files)
        set_decode_gemm(
            self.model, plan.decode_gemm, plan.decode_folded_rows, plan.decode_single_gemm
        )
        set_single_attention(plan.decode_single_attention)  # process-wide, read when traced
        set_decode_pdl(plan.decode_pdl, plan.decode_pdl_trigger)  # process-wide: one per process
        set_decode_split_k(plan.decode_split_k, self.device)
        launch.set_attention_prefetch(plan.decode_attention_prefetch)  # process-wide too
        sampling.set_candidate_draw(plan.candidate_draw)  # process-wide, read when traced
        self._mark("weights")
        kv_dtype = DTYPES[m.kv_dtype]
        shape = (plan.num_pages + 1, geo.page_size, geo.num_kv_heads, geo.head_dim)
        self.kv = PagedKVCache(
            k_pages=[torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in geo.attention_layers],
            v_pages=[torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in geo.attention_layers],
            page_size=geo.page_size,
        )  # fmt: skip
        self.state = RequestState.allocate(
            plan.max_num_rows, geo.vocab_size, geo.hidden_size, self.max_pages_per_row,
            cat.max_stop_token_ids, m.frontend.eos_token_ids, self.dtype, self.device,
        )  # fmt: skip
        self.pool: StatePool | None = None
        if geo.state_tensors or plan.num_snapshot_rows:
            # live row r = request row r; snapshot i = pool row first_snapshot_row + i
            self.pool = StatePool.allocate(
                geo.state_tensors, plan.max_num_rows, plan.num_snapshot_rows, geo.hidden_size,
                self.dtype, self.device,
            )  # fmt: skip
        self._mark("storage")
        backend: Any = None
        recurrent: Any = None  # GDN layers: None = the PyTorch reference
        if plan.attention_backend == "triton":
            from prep.components.triton_attention import TritonAttentionBackend

            backend = TritonAttentionBackend()
            if geo.state_tensors:
                from prep.components.gdn_triton import TritonGDN

                recurrent = TritonGDN()
        elif plan.attention_backend != "reference":
            raise ValueError(f"unknown attention backend {plan.attention_backend!r}")
        self.backend = backend
        self.ex = Executions(
            self.model, self.state, self.kv,
            {layer: i for i, layer in enumerate(geo.attention_layers)},
            cat.max_context_tokens, cat.max_top_logprobs, backend,
            # "all"/"decode" compile whole executions (below), not the stack inside them
            compile_forward=FORWARD_MODES.get(self._resolve_compile(plan.compile), "none"),
            state_pool=self.pool, recurrent_backend=recurrent,
        )  # fmt: skip
        self.stream: Any = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.compile_mode = self._resolve_compile(plan.compile)
        if plan.compile == "bundle" and (
            why := cache_mismatch(self.manifest.compile, self.device.type, torch.__version__)
        ):
            log.warning("%s", why)
        if self.compile_mode != "none":
            # the bundle's Inductor cache; static per capacity
            configure(self.bundle_dir, self.device.type)
            mark_pages_dynamic([*self.kv.k_pages, *self.kv.v_pages])
        self.calls: dict[str, PreparedCall] = {}
        # device ms of each prefill capacity (CUDA graphs: measured at startup; else empty)
        self.prefill_ms: dict[int, float] = {}
        self.completions: dict[str, Completion] = {}
        # prefill{C}_fresh executions the startup check dropped (_check_fresh_prefills), and
        # the relative L2 it measured for each
        self.fresh_dropped: list[str] = []
        self.fresh_check: dict[str, float] = {}
        # capacity -> (the fewest tokens that take prefill{C}_fresh, ms it saved against
        # prefill{C} on the startup check's causal chunk): chunking.ChunkCosts' fresh bonus
        self.fresh_bonus: dict[int, tuple[int, float]] = {}
        self._build_calls()
        self.steps = StepBuilder(self)
        self._mark("prepared")
        self.load_s = time.perf_counter() - t0
        log.info("runner ready in %.2fs (%d calls)", self.load_s, len(self.calls))
        log.info(
            "load memory: %s",
            ", ".join(f"{k}={v / 2**30:.2f}GiB" for k, v in self.memory_report.items()),
        )

    def _mark(self, stage: str) -> None:
        # host: peak resident set of this process so far (its own: prep.rss)
        self.memory_report[f"{stage}_host_peak_rss_bytes"] = peak_rss_bytes()
        if self.device.type != "cuda":
            return
        self.memory_report[f"{stage}_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        self.memory_report[f"{stage}_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
        self.memory_report[f"{stage}_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(
            self.device
        )

    # -- catalog ---------------------------------------------------------------------------
    def _build_calls(self) -> None:
        single = self.plan.decode_single_gemm
        for spec in build_call_specs(
            self.ex, self.manifest.catalog, self.device, self.manifest.geometry.vocab_size,
            single_row=single != "none", fresh_prefill=self.plan.prefill_fresh,
        ):  # fmt: skip
            fn = torch.compile(spec.fn, dynamic=False) if self._compiles(spec.name) else spec.fn
            # warmed and captured inside
            fn = with_products(
                spec.name, fn, single,
                self.plan.decode_single_pdl, self.plan.decode_single_pdl_trigger,
            )  # fmt: skip
            self.calls[spec.name] = PreparedCall(spec.name, fn, spec.inputs, self.device)
            if spec.completion is not None:
                self.completions[spec.name] = spec.completion
        self._prepare_all()

    def _resolve_compile(self, mode: bool | str) -> str:
        """ "bundle" = what prep compiled (and cached); True = "all"; False = "none"."""
        if mode == "bundle":
            info = self.manifest.compile
            return info.mode if info.enabled and info.device_kind == self.device.type else "none"
        if mode is True:
            return "all"
        name = "none" if mode is False else str(mode)
        if name not in FORWARD_MODES and name not in ("all", "decode"):
            raise ValueError(f"unknown compile mode {name!r} (one of {', '.join(FORWARD_MODES)})")
        return name

    def _compiles(self, name: str) -> bool:
        """Whether the whole execution `name` is compiled (see RunnerPlan.compile)."""
        mode = self._resolve_compile(self.plan.compile)
        if mode in (True, "all"):
            return True
        return mode == "decode" and name.startswith("decode")

    def _prepare_all(self) -> None:
        """Warm every call (compiles on first run) and, on CUDA, capture its graph."""
        t0 = time.perf_counter()
        self._warm_fresh_prefills()
        if self.device.type == "cuda" and self.plan.cuda_graphs:
            pool = torch.cuda.graph_pool_handle()
            with torch.cuda.stream(self.stream):
                for call in self.calls.values():
                    call.capture(pool, self.stream)
            # timed on fresh request state: the warm-up admit leaves row 0 with zeroed sampling
            # parameters, under which a sampling replay indexes out of bounds
            self.reset_state()
            self.prefill_ms = self._time_prefills()
        else:
            for call in self.calls.values():
                call.run()
        self.reset_state()
        self._check_fresh_prefills()
        self.prepare_s = time.perf_counter() - t0

    def _warm_fresh_prefills(self) -> None:
        """Run each prefill{C}_fresh once before anything is captured: one whose fused
        attention the platform's library refuses (no kernel for the shape, dtype or device, a
        compile error) raises here, with nothing captured yet, and is dropped with a warning
        (its chunks take the paged kernel) instead of failing the start."""
        for name in [n for n in self.calls if n.endswith(FRESH_SUFFIX)]:
            try:
                self._run_and_wait(name)
            except Exception as e:  # an optional execution: the paged one serves its chunks
                # (torch's "no available kernel", Triton's compile and resource errors)
                self._drop_fresh(name, f"failed its first run ({type(e).__name__}: {e})")

    def _run_and_wait(self, name: str) -> None:
        """Run the call `name` once (its graph where captured) on the runner's stream and
        wait for it."""
        with contextlib.ExitStack() as stack:
            if self.stream is not None:
                stack.enter_context(torch.cuda.stream(self.stream))
            self.calls[name].run()
        if self.stream is not None:
            self.stream.synchronize()

    def _drop_fresh(self, name: str, why: str) -> None:
        log.warning("%s %s: not served, such chunks take the paged kernel", name, why)
        del self.calls[name]
        self.completions.pop(name, None)
        self.fresh_dropped.append(name)

    def _check_fresh_prefills(self) -> None:
        """Each prefill{C}_fresh against prefill{C} on one synthetic chunk from position 0
        (row 0, pages 0..) as short as the router lets fresh chunks be (7/8 of C, the rest
        padding rows): the last attention layer's keys and values on the chunk's slots (they
        carry every row's attention in the layers below) and the last token's hidden vector
        must agree within the execution dtype's rounding, else the fresh execution is dropped
        (logged, listed in `fresh_dropped`) and its chunks take the paged kernel. A guard
        against the fused attention misbehaving on a machine (its kernels come from the
        platform's library), where a wrong prefill would corrupt answers silently."""
        names = [n for n in self.calls if n.endswith(FRESH_SUFFIX)]
        if not names:
            return
        tol = FRESH_CHECK_TOL[self.dtype]
        gen = torch.Generator().manual_seed(0)
        pages = self.kv.trash_page if self.kv.k_pages else 0
        for name in names:
            cap = int(name[len("prefill") : -len(FRESH_SUFFIX)])
            n = fresh_chunk_min(cap)
            need = -(-n // self.page_size)
            if need > min(pages, self.max_pages_per_row):
                err = float("inf")  # cannot be checked in this pool: not served
            else:
                self.state.page_table[0, :need] = torch.arange(need, device=self.device)
                tokens = torch.zeros(cap, dtype=torch.int64)
                tokens[:n] = torch.randint(
                    0, self.manifest.geometry.vocab_size, (n,), generator=gen
                )
                positions = torch.zeros(cap, dtype=torch.int64)
                positions[:n] = torch.arange(n)
                slots = torch.full((cap,), -1, dtype=torch.int64)
                slots[:n] = torch.arange(n)  # pages 0.. in order
                seen = []
                for call_name in (f"prefill{cap}", name):
                    inp = self.calls[call_name].inputs
                    inp["tokens"].copy_(tokens)
                    inp["positions"].copy_(positions)
                    inp["slots"].copy_(slots)
                    inp["row"].fill_(0)
                    inp["num_valid"].fill_(n)
                    self._run_and_wait(call_name)
                    k, v = self.kv.k_pages[-1], self.kv.v_pages[-1]
                    rows = [t.reshape(-1, *t.shape[2:])[:n].flatten() for t in (k, v)]
                    seen.append(torch.cat([*rows, self.state.hidden[0]]).float())
                err = float(torch.linalg.vector_norm(seen[1] - seen[0]))
                err /= max(float(torch.linalg.vector_norm(seen[0])), 1e-30)
            self.fresh_check[name] = err
            if not err <= tol:
                self._drop_fresh(
                    name, f"disagrees with prefill{cap} on a synthetic chunk (rel L2 {err:.3g} "
                    f"> {tol:.3g})",
                )  # fmt: skip
            elif self.device.type == "cuda":  # both calls still hold the causal chunk
                with torch.cuda.stream(self.stream):
                    paged, fresh = self._replay_ms(f"prefill{cap}"), self._replay_ms(name)
                self.fresh_bonus[cap] = (n, max(0.0, paged - fresh))
                log.info("prefill%d on a %d-token causal chunk: %.2f ms paged, %.2f fresh",
                         cap, n, paged, fresh)  # fmt: skip
            self.reset_state()

    def _time_prefills(self, repeats: int = 3) -> dict[int, float]:
        """Device milliseconds of one replay of each prefill capacity's graph (the median of
        `repeats`, after one untimed replay), for the scheduler's cut of prompts into chunks.
        A replay runs the whole padded shape, as every served chunk of that capacity does."""
        out: dict[int, float] = {}
        with torch.cuda.stream(self.stream):
            for cap in self.manifest.catalog.prefill_capacities:
                out[cap] = self._replay_ms(f"prefill{cap}", repeats)
        log.info("prefill device ms: %s", ", ".join(f"{c}={t:.2f}" for c, t in out.items()))
        return out

    def _replay_ms(self, name: str, repeats: int = 3) -> float:
        """Device milliseconds of one run of the call `name` on its current inputs (its graph
        where captured): the median of `repeats` after one untimed run, on the runner's stream
        (current in the caller)."""
        call = self.calls[name]
        call.run()
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            call.run()
            end.record(self.stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def reset_state(self) -> None:
        """Return request state and KV pages to their initial values (after warm-up)."""
        fresh = RequestState.allocate(
            self.plan.max_num_rows, self.state.hist.shape[1], self.state.hidden.shape[1],
            self.max_pages_per_row, self.state.stop_ids.shape[1],
            self.manifest.frontend.eos_token_ids, self.dtype, self.device,
        )  # fmt: skip
        for name in vars(fresh):
            getattr(self.state, name).copy_(getattr(fresh, name))
        del fresh
        for t in (*self.kv.k_pages, *self.kv.v_pages):
            t.zero_()
        if self.pool is not None:
            for spec, t in zip(self.pool.specs, self.pool.tensors, strict=True):
                t.fill_(spec.fill)
            self.pool.consumed.zero_()
            self.pool.hidden.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- serving -----------------------------------------------------------------------------
    def submit(self, plan: StepPlan, masks: dict[int, torch.Tensor] | None = None) -> Any:
        """Enqueue a step; returns a handle for `wait`. On CPU the step runs synchronously.

        masks: request row -> grammar bitmask (int32 [ceil(V/32)]) applied to that row's sample;
        a step carrying masks depends on the host, so the caller keeps one step in flight."""
        return self.steps.submit(plan, masks)

    def wait(self, handle: Any) -> StepResult:
        return self.steps.wait(handle)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.wait(self.submit(plan))
