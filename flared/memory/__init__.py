"""The memory planner: one physical budget for every consumer (DESIGN.md "Memory"). Pure CPU:
importing this package never imports torch (device.py imports it only when called)."""

from flared.memory.inputs import Measurements, MemoryConfig, MemoryConfigError
from flared.memory.planner import Budget, Consumer, MemoryPlan, PlanDoesNotFit, plan_memory
from flared.memory.platform import DeviceInfo, Platform, read_platform

__all__ = [
    "Budget",
    "Consumer",
    "DeviceInfo",
    "Measurements",
    "MemoryConfig",
    "MemoryConfigError",
    "MemoryPlan",
    "PlanDoesNotFit",
    "Platform",
    "plan_memory",
    "read_platform",
]
