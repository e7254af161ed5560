"""Runner sizing goes through the memory planner: KV pages from the plan, failure before load."""

from __future__ import annotations

import pytest

from flared.llm_engine import EngineConfig
from flared.memory import MemoryConfig, MemoryConfigError, PlanDoesNotFit, Platform
from flared.runner.sizing import kv_bytes_per_page, plan_runner
from prep.bundle import read_manifest

GIB = 1 << 30


def _h200() -> Platform:
    return Platform(host_total_bytes=128 * GIB, host_available_bytes=120 * GIB, has_device=True,
                    device_name="H200", device_total_bytes=141 * GIB, device_free_bytes=140 * GIB)  # fmt: skip


def test_cuda_plan_gives_the_remaining_memory_to_kv_pages(tiny):
    b = tiny.bundle("qwen3")
    plan = plan_runner(b, EngineConfig(device="cuda"), platform_reader=_h200)
    per_page = kv_bytes_per_page(read_manifest(b))
    assert plan.memory is not None and plan.num_pages == plan.memory.num_kv_pages
    assert plan.num_pages * per_page > 100 * GIB  # tiny weights: nearly the whole budget
    assert plan.attention_backend == "triton"
    assert "kv" in plan.memory.table().lower()


def test_plan_that_cannot_fit_fails_before_loading(tiny):
    b = tiny.bundle("qwen3")
    cfg = EngineConfig(device="cuda", memory=MemoryConfig(budget_bytes=1 << 20))
    with pytest.raises(PlanDoesNotFit):
        plan_runner(b, cfg, platform_reader=_h200)


def test_cpu_plan_is_bounded_and_explicit_pages_win(tiny):
    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu", num_pages=77)).num_pages == 77
    assert plan_runner(b, EngineConfig(device="cpu")).num_pages >= 8 * 33


def test_default_snapshots_follow_the_snapshot_row_size(tiny):
    """A dense model's snapshot is a hidden vector: the default keeps thousands (an agent
    conversation publishes one per message); a hybrid's carries its recurrent state, so the
    default is the per-slot count unless 256 MiB holds more. Explicit targets win."""
    from flared.runner.sizing import (
        DEFAULT_SNAPSHOTS_PER_ROW,
        MAX_DEFAULT_SNAPSHOTS,
        default_snapshots,
        snapshot_row_bytes,
    )  # fmt: skip

    dense, hybrid = tiny.bundle("qwen3"), tiny.bundle("qwen3_5")
    plan = plan_runner(dense, EngineConfig(device="cuda"), platform_reader=_h200)
    assert plan.num_snapshot_rows == MAX_DEFAULT_SNAPSHOTS
    m = read_manifest(hybrid)
    rows = max(m.catalog.decode_capacities)
    expect = max(DEFAULT_SNAPSHOTS_PER_ROW * rows,
                 min(MAX_DEFAULT_SNAPSHOTS, (256 << 20) // snapshot_row_bytes(m)))  # fmt: skip
    assert default_snapshots(m, rows) == expect
    cfg = EngineConfig(device="cuda", memory=MemoryConfig(target_snapshots=5))
    assert plan_runner(dense, cfg, platform_reader=_h200).num_snapshot_rows == 5
    off = EngineConfig(device="cuda", prefix_cache=False)
    assert plan_runner(dense, off, platform_reader=_h200).num_snapshot_rows == 0


def test_cpu_keeps_a_memory_pin_and_honours_the_guarantee(tiny):
    b = tiny.bundle("qwen3")
    pinned = EngineConfig(device="cpu", memory=MemoryConfig(num_kv_pages=55))
    assert plan_runner(b, pinned).num_pages == 55
    guaranteed = EngineConfig(device="cpu", memory=MemoryConfig(guarantee_concurrency=True))
    plan = plan_runner(b, guaranteed)
    assert plan.memory is not None
    assert plan.memory.num_full_context_requests == plan.max_num_rows
    short = MemoryConfig(guarantee_concurrency=True, num_kv_pages=1)
    with pytest.raises(MemoryConfigError, match="pins fewer pages"):
        plan_runner(b, EngineConfig(device="cpu", memory=short))


def test_device_plans_share_the_page_pool_with_snapshot_rows(tiny):
    """Where pages take what is left, snapshots get up to 1/8 of what pages and snapshots take
    together, within 4 GiB: a 9B hybrid's 51.5 MB rows on an H200 (~104 GiB of pages) get 83
    rows instead of 16; a 24 GiB card's ~14 GiB gets 36; the count never drops below the
    default. Explicit targets and pinned page counts are left alone."""
    from flared.runner.sizing import auto_snapshots, default_snapshots, snapshot_row_bytes

    row = 51_500_000
    assert auto_snapshots(row, 104 * GIB, 16) == (4 * GIB) // row == 83
    assert auto_snapshots(row, 14 * GIB, 16) == int(14 * GIB / 8) // row == 36
    assert auto_snapshots(row, 1 * GIB, 16) == 16
    assert auto_snapshots(100, 104 * GIB, 16) == 4096
    hybrid = tiny.bundle("qwen3_5")
    m = read_manifest(hybrid)
    rows = max(m.catalog.decode_capacities)
    plan = plan_runner(hybrid, EngineConfig(device="cuda"), platform_reader=_h200)
    assert plan.memory is not None
    cache = plan.num_pages * kv_bytes_per_page(m) + plan.num_snapshot_rows * snapshot_row_bytes(m)
    assert plan.num_snapshot_rows == auto_snapshots(
        snapshot_row_bytes(m), cache, default_snapshots(m, rows)
    )
    assert plan.num_snapshot_rows >= default_snapshots(m, rows)
    pinned = EngineConfig(device="cuda", memory=MemoryConfig(num_kv_pages=4000))
    assert plan_runner(hybrid, pinned, platform_reader=_h200).num_snapshot_rows == (
        default_snapshots(m, rows)
    )


def test_the_step_wait_goes_from_the_config_file_to_the_runner_plan(tiny, tmp_path):
    """`[engine] step_wait`: "spin" (the default) or "block" reaches the runner plan, whose
    step executor builds its completion events from it; anything else is refused."""
    from flared.config import ConfigError, parse_config

    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).step_wait == "spin"
    cfg = parse_config({"engine": {"device": "cpu", "step_wait": "block"}})
    assert plan_runner(b, cfg.engine_config(b)).step_wait == "block"
    with pytest.raises(ConfigError, match="step_wait"):
        parse_config({"engine": {"step_wait": "nap"}})
    with pytest.raises(ValueError, match="step_wait"):  # in-process: before anything loads
        plan_runner(b, EngineConfig(device="cpu", step_wait="nap"))


def test_decode_split_k_goes_from_the_config_file_to_the_kernel_configuration(tiny):
    """`[engine] decode_split_k` reaches the runner plan (off by default), and the switch it
    sets makes the skinny GEMM's shape-only configuration split K for outputs of at most 8,192
    rows on a 132-SM device: 4 for the Qwen3-1.7B o and down projections (16 x 256 tiles, four
    resident per SM), 2 for its q|k|v and the 8B's q|k|v, o and down (32 x 256, three per SM),
    none for the wide gate|up and vocabulary products."""
    pytest.importorskip("triton")
    from flared.config import parse_config
    from prep.components import fused, skinny_gemm

    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).decode_split_k is False
    cfg = parse_config({"engine": {"device": "cpu", "decode_split_k": True}})
    assert plan_runner(b, cfg.engine_config(b)).decode_split_k is True
    shapes = {(2048, 2048): 4, (2048, 6144): 4, (4096, 2048): 2, (12288, 2048): 1,
              (6144, 4096): 2, (4096, 4096): 2, (4096, 12288): 2, (24576, 4096): 1,
              (151936, 2048): 1}  # fmt: skip
    try:
        fused.set_decode_split_k(True)
        for (n, k), splits in shapes.items():
            c = skinny_gemm.tile_config(n, k)
            assert c.split_k == splits, (n, k, c)
            assert skinny_gemm.split_plan(k, c)[0] == splits
            if splits > 1:  # one wave: every program resident at once
                per_sm = skinny_gemm.SMEM_PER_SM // skinny_gemm.pipeline_smem_bytes(c)
                assert -(-n // c.block_n) * splits <= 132 * per_sm, c
        skinny_gemm.set_split_k(True, sms=16)  # a small device: fewer splits
        assert skinny_gemm.tile_config(2048, 2048).split_k == 1
    finally:
        fused.set_decode_split_k(False)
    assert all(skinny_gemm.tile_config(n, k).split_k == 1 for n, k in shapes)


def test_decode_folded_rows_goes_from_the_config_file_to_the_plan(tiny):
    """`[engine] decode_folded_rows` (1-16, default 16: every decode step, so folded stays batch
    invariant) reaches the runner plan; anything else is refused before anything loads, and by
    set_decode_gemm itself. An unknown decode_gemm is refused before anything loads too."""
    from torch import nn

    from flared.config import parse_config
    from prep.components import fused

    b = tiny.bundle("qwen3")
    plan = plan_runner(b, EngineConfig(device="cpu"))
    assert (plan.decode_gemm, plan.decode_folded_rows) == ("skinny", 16)
    with pytest.raises(ValueError, match="decode_gemm"):
        plan_runner(b, EngineConfig(device="cpu", decode_gemm="fastest"))
    cfg = parse_config({"engine": {"device": "cpu", "decode_gemm": "folded",
                                   "decode_folded_rows": 3}})  # fmt: skip
    plan = plan_runner(b, cfg.engine_config(b))
    assert (plan.decode_gemm, plan.decode_folded_rows) == ("folded", 3)
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="decode_folded_rows"):
            plan_runner(b, EngineConfig(device="cpu", decode_folded_rows=bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="folded_rows"):
        fused.set_decode_gemm(nn.Linear(2, 2), "folded", 0)


def test_decode_single_gemm_goes_from_the_config_file_to_the_plan(tiny):
    """`[engine] decode_single_gemm` (auto | none | folded | gemv | folded-gemv, default auto:
    folded-gemv on CUDA beside skinny, none on CPU or beside another decode_gemm) reaches the
    runner plan; an unknown value, or one beside a decode_gemm other than skinny, is refused
    before anything loads, and by set_decode_gemm itself."""
    from torch import nn

    from flared.config import parse_config
    from prep.components import fused

    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).decode_single_gemm == "none"
    auto = plan_runner(b, EngineConfig(device="cuda"), platform_reader=_h200)
    assert (auto.decode_gemm, auto.decode_single_gemm) == ("skinny", "folded-gemv")
    for gemm in ("folded", "gemv", "cublas"):
        cfg = EngineConfig(device="cuda", decode_gemm=gemm)
        assert plan_runner(b, cfg, platform_reader=_h200).decode_single_gemm == "none"
    none = EngineConfig(device="cuda", decode_single_gemm="none")
    assert plan_runner(b, none, platform_reader=_h200).decode_single_gemm == "none"
    for single in ("folded", "gemv", "folded-gemv"):
        cfg = parse_config({"engine": {"device": "cpu", "decode_single_gemm": single}})
        plan = plan_runner(b, cfg.engine_config(b))
        assert (plan.decode_gemm, plan.decode_single_gemm) == ("skinny", single)
    with pytest.raises(ValueError, match="decode_single_gemm must be one of"):
        plan_runner(b, EngineConfig(device="cpu", decode_single_gemm="fastest"))
    for gemm in ("folded", "gemv", "cublas"):
        with pytest.raises(ValueError, match="beside decode_gemm 'skinny' only"):
            plan_runner(b, EngineConfig(device="cpu", decode_gemm=gemm, decode_single_gemm="gemv"))
    with pytest.raises(ValueError, match="unknown single-row GEMM"):
        fused.set_decode_gemm(nn.Linear(2, 2), "skinny", single="fastest")
    with pytest.raises(ValueError, match="needs decode GEMM 'skinny'"):
        fused.set_decode_gemm(nn.Linear(2, 2), "folded", single="folded")


def test_the_pdl_trigger_goes_from_the_config_file_to_the_launches(tiny, monkeypatch):
    """`[engine] decode_pdl_trigger` (start | after_wait | end, default after_wait) reaches the
    runner plan and `launch.set_pdl`; anything else is refused before anything loads. Off
    CUDA (or without decode_pdl) every launch's PDL constexpr stays 0."""
    import torch

    from flared.config import ConfigError, parse_config
    from prep.components import launch

    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).decode_pdl_trigger == "after_wait"
    cfg = parse_config({"engine": {"device": "cpu", "decode_pdl_trigger": "end"}})
    assert plan_runner(b, cfg.engine_config(b)).decode_pdl_trigger == "end"
    with pytest.raises(ConfigError, match="decode_pdl_trigger"):
        parse_config({"engine": {"decode_pdl_trigger": "early"}})
    with pytest.raises(ValueError, match="decode_pdl_trigger"):
        plan_runner(b, EngineConfig(device="cpu", decode_pdl_trigger="early"))
    with pytest.raises(ValueError, match="trigger"):
        launch.set_pdl(True, "early")
    assert launch.PDL_TRIGGERS == {"start": 1, "after_wait": 2, "end": 3}
    try:
        launch.set_pdl(True, "end")
        assert launch.pdl_mode(torch.device("cpu")) == 0  # SM90 only
        monkeypatch.setattr(launch, "enabled", lambda device, requested=None: True)
        assert launch.pdl_mode(torch.device("cpu")) == 3
        assert launch.pdl_mode(torch.device("cpu"), trigger="start") == 1
    finally:
        launch.set_pdl(False, "after_wait")


def test_the_attention_prefetch_goes_from_the_config_file_to_the_decode_launch(tiny):
    """`[engine] decode_attention_prefetch` (off | start | end | auto, default auto) reaches the
    runner plan and `launch.set_attention_prefetch`; anything else is refused before anything
    loads. The decode attention's PREFETCH constexpr is the switch's code on CUDA (auto: after
    the partials for a weight of 16 MiB or more, else none) and 0 elsewhere (the interpreter
    has no PTX), and the weight is passed as int32 words or not at all."""
    import torch

    from flared.config import ConfigError, parse_config
    from prep.components import launch

    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).decode_attention_prefetch == "auto"
    assert parse_config({}).engine.decode_attention_prefetch == "auto"
    cfg = parse_config({"engine": {"device": "cpu", "decode_attention_prefetch": "end"}})
    assert plan_runner(b, cfg.engine_config(b)).decode_attention_prefetch == "end"
    with pytest.raises(ConfigError, match="decode_attention_prefetch"):
        parse_config({"engine": {"decode_attention_prefetch": "early"}})
    with pytest.raises(ValueError, match="decode_attention_prefetch"):
        plan_runner(b, EngineConfig(device="cpu", decode_attention_prefetch="early"))
    with pytest.raises(ValueError, match="attention prefetch"):
        launch.set_attention_prefetch("early")
    cuda, cpu, small, large = torch.device("cuda", 0), torch.device("cpu"), 8 << 20, 32 << 20
    try:
        for where, code, auto_small in (
            ("off", 0, 0), ("start", 1, 1), ("end", 2, 2), ("auto", 2, 0)
        ):  # fmt: skip
            launch.set_attention_prefetch(where)
            assert launch.attention_prefetch(cuda, large) == code
            assert launch.attention_prefetch(cuda, small) == auto_small
            assert launch.attention_prefetch(cpu, large) == 0
    finally:
        launch.set_attention_prefetch("auto")
    w = torch.zeros(6, 4, dtype=torch.bfloat16)
    words = launch.prefetch_words(w)
    assert words is not None and words.dtype == torch.int32 and words.numel() == 12
    assert words.data_ptr() == w.data_ptr()  # a view, not a copy
    assert launch.prefetch_words(w[:0]) is None  # nothing to warm
    assert launch.prefetch_words(w.t()) is None  # not contiguous
    assert launch.prefetch_words(torch.zeros(3, dtype=torch.bfloat16)) is None  # 6 bytes
    assert launch.prefetch_words(None) is None


def test_the_candidate_draw_goes_from_the_config_file_to_the_sampling(tiny):
    """`[engine] candidate_draw` (ops | kernel, default ops) reaches the runner plan; anything
    else is refused before anything loads; the config file's choices are the sampling's."""
    from flared import config
    from flared.config import ConfigError, parse_config
    from prep.components import sampling

    assert config.CANDIDATE_DRAWS == sampling.CANDIDATE_DRAWS
    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).candidate_draw == "ops"
    assert parse_config({}).engine.candidate_draw == "ops"
    cfg = parse_config({"engine": {"device": "cpu", "candidate_draw": "kernel"}})
    assert plan_runner(b, cfg.engine_config(b)).candidate_draw == "kernel"
    with pytest.raises(ConfigError, match="candidate_draw"):
        parse_config({"engine": {"candidate_draw": "fast"}})
    with pytest.raises(ValueError, match="candidate_draw"):
        plan_runner(b, EngineConfig(device="cpu", candidate_draw="fast"))


def test_the_single_row_attention_goes_from_the_config_file_to_the_switches(tiny):
    """`[engine] decode_single_attention` (auto | two | one | qkv; auto: fused's
    AUTO_SINGLE_ATTENTION on CUDA, two on CPU) reaches the runner plan, and the runner sets
    the one launch's switches from it; anything else is refused before anything loads; the
    config file's choices are fused's."""
    from flared import config
    from flared.config import ConfigError, parse_config
    from prep.components import fused

    assert config.SINGLE_ATTENTIONS == fused.SINGLE_ATTENTIONS
    b = tiny.bundle("qwen3")
    assert plan_runner(b, EngineConfig(device="cpu")).decode_single_attention == "two"
    auto = plan_runner(b, EngineConfig(device="cuda"), platform_reader=_h200)
    assert auto.decode_single_attention == fused.AUTO_SINGLE_ATTENTION
    assert parse_config({}).engine.decode_single_attention == "auto"
    for mode in fused.SINGLE_ATTENTIONS:
        cfg = parse_config({"engine": {"device": "cpu", "decode_single_attention": mode}})
        assert plan_runner(b, cfg.engine_config(b)).decode_single_attention == mode
    with pytest.raises(ConfigError, match="decode_single_attention must be"):
        parse_config({"engine": {"decode_single_attention": "three"}})
    with pytest.raises(ValueError, match="decode_single_attention must be one of"):
        plan_runner(b, EngineConfig(device="cpu", decode_single_attention="three"))
    with pytest.raises(ValueError, match="unknown single-row attention"):
        fused.set_single_attention("three")
    attention_o = pytest.importorskip("prep.components.attention_o")
    try:
        for mode, on, qkv in (("one", True, False), ("qkv", True, True), ("two", False, False)):
            fused.set_single_attention(mode)
            assert (attention_o.enabled(), attention_o.with_qkv()) == (on, qkv), mode
    finally:
        fused.set_single_attention("two")


def test_single_row_pdl_goes_from_the_config_file_to_the_one_row_executions_alone(tiny):
    """`[engine] decode_single_pdl` (default true) and `decode_single_pdl_trigger` (default
    end) reach the runner plan where the one-row executions exist (decode_single_gemm not
    none), and `with_products` turns PDL on with that trigger inside those executions alone,
    both switches as they were after (also when the execution raises)."""
    from flared.config import ConfigError, parse_config
    from prep.calls import with_products
    from prep.components import launch

    b = tiny.bundle("qwen3")
    engine = parse_config({}).engine
    assert (engine.decode_single_pdl, engine.decode_single_pdl_trigger) == (True, "end")
    cpu = plan_runner(b, EngineConfig(device="cpu"))  # auto: no one-row executions on CPU
    assert cpu.decode_single_gemm == "none" and cpu.decode_single_pdl is False
    on = parse_config({"engine": {"device": "cpu", "decode_single_gemm": "gemv",
                                  "decode_single_pdl_trigger": "after_wait"}})  # fmt: skip
    plan = plan_runner(b, on.engine_config(b))
    assert (plan.decode_single_pdl, plan.decode_single_pdl_trigger) == (True, "after_wait")
    cuda = plan_runner(b, EngineConfig(device="cuda"), platform_reader=_h200)  # folded-gemv
    assert (cuda.decode_single_pdl, cuda.decode_single_pdl_trigger) == (True, "end")
    assert cuda.decode_pdl is False  # every other step without PDL
    off = EngineConfig(device="cuda", decode_single_pdl=False)
    assert plan_runner(b, off, platform_reader=_h200).decode_single_pdl is False
    no_single = EngineConfig(device="cuda", decode_single_gemm="none")
    assert plan_runner(b, no_single, platform_reader=_h200).decode_single_pdl is False
    with pytest.raises(ConfigError, match="decode_single_pdl"):
        parse_config({"engine": {"decode_single_pdl": "yes"}})
    with pytest.raises(ConfigError, match="decode_single_pdl_trigger"):
        parse_config({"engine": {"decode_single_pdl_trigger": "middle"}})
    with pytest.raises(ValueError, match="decode_single_pdl_trigger"):
        plan_runner(b, EngineConfig(device="cpu", decode_single_pdl_trigger="middle"))

    seen: list[tuple[bool, str]] = []

    def execution() -> None:
        seen.append((bool(launch._STATE["pdl"]), str(launch._STATE["trigger"])))

    def failing() -> None:
        execution()
        raise RuntimeError("boom")

    with_products("decode1_lean_single", execution, "gemv", pdl=True, trigger="end")()
    with_products("decode1_lean_single", execution, "gemv", pdl=True)()  # set_pdl's trigger
    with_products("decode1_lean_single", execution, "gemv", pdl=False, trigger="end")()
    with_products("decode1_lean", execution, "gemv", pdl=True, trigger="end")()  # not one-row
    with pytest.raises(RuntimeError, match="boom"):
        with_products("decode1_single", failing, "gemv", pdl=True, trigger="start")()
    assert seen == [
        (True, "end"), (True, "after_wait"), (False, "after_wait"), (False, "after_wait"),
        (True, "start"),
    ]  # fmt: skip
    assert launch._STATE == {"pdl": False, "trigger": "after_wait"}
    with pytest.raises(ValueError, match="PDL trigger"):
        launch.pdl_launches("middle")
