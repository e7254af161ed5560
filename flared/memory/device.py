"""The torch-backed `device_info` for read_platform(). The only module here that touches torch,
and only when called: the runner passes `lambda: cuda_device_info(index)`."""

from __future__ import annotations

from typing import Any

from flared.memory.platform import DeviceInfo


def cuda_device_info(index: int = 0) -> DeviceInfo:
    import torch

    cuda: Any = torch.cuda
    free_bytes, total_bytes = cuda.mem_get_info(index)
    props = cuda.get_device_properties(index)
    return DeviceInfo(
        name=str(props.name),
        total_bytes=int(total_bytes),
        free_bytes=int(free_bytes),
        is_integrated=bool(getattr(props, "is_integrated", False)),
    )
