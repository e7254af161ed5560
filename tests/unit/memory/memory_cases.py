"""Made-up machines and measurements shared by the memory tests (numbers are plausible, not
measured)."""

from __future__ import annotations

from flared.memory import Measurements, Platform
from flared.memory.units import GIB, MIB

H200_TOTAL_BYTES = 150_754_820_096  # what cudaMemGetInfo reports for a 141 GB H200


def h200() -> Platform:
    return Platform(
        host_total_bytes=128 * GIB,
        host_available_bytes=120 * GIB,
        has_device=True,
        is_integrated=False,
        device_name="NVIDIA H200",
        device_total_bytes=H200_TOTAL_BYTES,
        device_free_bytes=H200_TOTAL_BYTES - 600 * MIB,  # the CUDA context
        shm_total_bytes=64 * GIB,
        shm_free_bytes=64 * GIB,
    )


def spark() -> Platform:
    """A 128 GB unified-memory machine (DGX Spark / GB10): the driver reports system memory."""
    return Platform(
        host_total_bytes=119 * GIB,
        host_available_bytes=100 * GIB,
        has_device=True,
        is_integrated=True,
        device_name="NVIDIA GB10",
        device_total_bytes=119 * GIB,
        device_free_bytes=110 * GIB,
        shm_total_bytes=60 * GIB,
        shm_free_bytes=60 * GIB,
    )


def cgroup_limited() -> Platform:
    """A discrete 48 GB GPU in a container limited to 24 GiB, 6 GiB of it in use."""
    return Platform(
        host_total_bytes=512 * GIB,
        host_available_bytes=400 * GIB,
        has_device=True,
        device_name="NVIDIA L40S",
        device_total_bytes=48 * GIB,
        device_free_bytes=47 * GIB,
        cgroup_limit_bytes=24 * GIB,
        cgroup_usage_bytes=6 * GIB,
        shm_total_bytes=GIB,
        shm_free_bytes=GIB,
    )


def qwen3_8b() -> Measurements:
    """An 8B attention-only model: 36 layers, 8 KV heads × 128, bf16, 16-token pages."""
    return Measurements(
        weights_bytes=16 * GIB,
        kv_bytes_per_page=2 * 36 * 16 * 8 * 128 * 2,
        page_tokens=16,
        max_context_tokens=32768,
        max_num_rows=64,
        operator_scratch_bytes=2 * GIB,
        graph_pool_bytes=GIB,
        request_state_bytes_per_row=152064 * 4 * 2,
        pinned_host_bytes=256 * MIB,
        ring_bytes_per_session=(1 << 20) + (1 << 18),
        max_num_sessions=256,
    )


def hybrid_30b() -> Measurements:
    """A hybrid (linear-attention + attention) model with recurrent state rows and snapshots."""
    return Measurements(
        weights_bytes=60 * GIB,
        kv_bytes_per_page=2 * 12 * 16 * 4 * 256 * 2,
        page_tokens=16,
        max_context_tokens=65536,
        max_num_rows=32,
        operator_scratch_bytes=3 * GIB,
        graph_pool_bytes=2 * GIB,
        request_state_bytes_per_row=4 * MIB,
        state_row_bytes=48 * MIB,
        snapshot_row_bytes=48 * MIB + 2 * 12 * 16 * 4 * 256 * 2,
        verify_width=4,
        pinned_host_bytes=512 * MIB,
        ring_bytes_per_session=(1 << 20) + (1 << 18),
        max_num_sessions=256,
    )
