"""What the machine offers: a `Platform` description, and `read_platform()` that fills one.

Pure module: the standard library only. The device part comes from a `device_info` callable
the runner supplies (see flared/memory/device.py for the torch-backed one), so tests describe
an H200, a GB10 or a cgroup-limited box without either.

Sources (all under `root`, "/" in production, a fake tree in tests):
- /proc/meminfo: MemTotal, MemAvailable (kB).
- /proc/self/cgroup, then the memory controller: cgroup v2 `memory.max` / `memory.current` /
  `memory.stat`, or v1 `memory.limit_in_bytes` / `memory.usage_in_bytes` / `memory.stat`.
  The effective limit is the smallest limit on the path from our cgroup up to the root
  (a parent's limit binds its children). Usage is the working set: usage minus inactive page
  cache, which the kernel reclaims before it OOM-kills (what kubelet/docker report too) — a
  freshly read bundle sits in page cache and must not look like used memory.
- /dev/shm: statvfs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything this large is unlimited.
_UNLIMITED_BYTES = 1 << 60


@dataclass(frozen=True)
class DeviceInfo:
    """What the GPU driver says, at the moment it was asked."""

    name: str
    total_bytes: int
    free_bytes: int
    is_integrated: bool  # cudaDeviceProp.integrated: the GPU shares the host's memory (GB10)


@dataclass(frozen=True)
class Platform:
    """The physical backing the memory plan is made against. Plain ints, bytes.

    has_device=False is a CPU-only run: everything lives in host memory, planned like unified.
    cgroup_limit_bytes=None means no memory limit; shm_*_bytes=None means no /dev/shm mount.
    """

    host_total_bytes: int
    host_available_bytes: int  # MemAvailable
    has_device: bool = False
    is_integrated: bool = False
    device_name: str = ""
    device_total_bytes: int = 0
    device_free_bytes: int = 0
    cgroup_limit_bytes: int | None = None
    cgroup_usage_bytes: int = 0
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None

    @property
    def unified(self) -> bool:
        """Host and device allocations come out of one physical memory."""
        return self.is_integrated or not self.has_device

    @property
    def os_available_bytes(self) -> int:
        """What the OS can still hand us: MemAvailable, and the cgroup's headroom if limited."""
        available = self.host_available_bytes
        if self.cgroup_limit_bytes is not None:
            available = min(available, self.cgroup_limit_bytes - self.cgroup_usage_bytes)
        return max(0, available)

    def describe(self) -> str:
        if not self.has_device:
            return "CPU only (host memory)"
        kind = "unified memory" if self.is_integrated else "discrete GPU"
        return f"{kind}: {self.device_name or 'GPU'}"


def read_platform(
    root: Path | str = "/", device_info: Callable[[], DeviceInfo] | None = None
) -> Platform:
    """Describe this machine. `device_info` is None for a CPU-only run."""
    root = Path(root)
    meminfo = _read_meminfo(root / "proc" / "meminfo")
    total = meminfo.get("MemTotal", 0)
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    limit, usage = read_cgroup_memory(root)
    shm_total, shm_free = _read_shm(root / "dev" / "shm")
    dev = device_info() if device_info is not None else None
    return Platform(
        host_total_bytes=total,
        host_available_bytes=available,
        has_device=dev is not None,
        is_integrated=dev.is_integrated if dev is not None else False,
        device_name=dev.name if dev is not None else "",
        device_total_bytes=dev.total_bytes if dev is not None else 0,
        device_free_bytes=dev.free_bytes if dev is not None else 0,
        cgroup_limit_bytes=limit,
        cgroup_usage_bytes=usage,
        shm_total_bytes=shm_total,
        shm_free_bytes=shm_free,
    )


def _read_meminfo(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
            out[key.strip()] = int(fields[0]) * scale
    return out


def read_cgroup_memory(root: Path) -> tuple[int | None, int]:
    """(effective limit or None, working-set usage) of this process's memory cgroup."""
    v2_path, v1_path = _cgroup_paths(root / "proc" / "self" / "cgroup")
    base = root / "sys" / "fs" / "cgroup"
    if (base / "cgroup.controllers").exists() or (v2_path is not None and v1_path is None):
        return _cgroup_v2(base, v2_path or "/")
    return _cgroup_v1(base / "memory", v1_path or "/")


def _cgroup_paths(path: Path) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) from /proc/self/cgroup ("0::/a/b", "4:memory:/a/b")."""
    v2: str | None = None
    v1: str | None = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, cg = parts
        if hierarchy == "0" and controllers == "":
            v2 = cg
        elif "memory" in controllers.split(","):
            v1 = cg
    return v2, v1


def _ancestors(base: Path, cg: str) -> list[Path]:
    """Our cgroup directory and every parent up to `base`, deepest first. Inside a cgroup
    namespace the path may not exist under the mount; then only the mount root is used."""
    parts = [p for p in cg.strip("/").split("/") if p and p != ".."]
    dirs = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    existing = [d for d in dirs if d.is_dir()]
    return existing or [base]


def _cgroup_v2(base: Path, cg: str) -> tuple[int | None, int]:
    dirs = _ancestors(base, cg)
    limits = [v for v in (_read_int(d / "memory.max") for d in dirs) if v is not None]
    limit = min(limits) if limits else None
    usage = _read_int(dirs[0] / "memory.current") or 0
    inactive = _read_stat(dirs[0] / "memory.stat").get("inactive_file", 0)
    return _normalize_limit(limit), max(0, usage - inactive)


def _cgroup_v1(base: Path, cg: str) -> tuple[int | None, int]:
    dirs = _ancestors(base, cg)
    limits = [v for v in (_read_int(d / "memory.limit_in_bytes") for d in dirs) if v is not None]
    limit = min(limits) if limits else None
    usage = _read_int(dirs[0] / "memory.usage_in_bytes") or 0
    stat = _read_stat(dirs[0] / "memory.stat")
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return _normalize_limit(limit), max(0, usage - inactive)


def _normalize_limit(limit: int | None) -> int | None:
    return None if limit is None or limit >= _UNLIMITED_BYTES else limit


def _read_int(path: Path) -> int | None:
    """An integer file; "max" (v2's no-limit) and a missing/unreadable file give None."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _read_shm(path: Path) -> tuple[int | None, int | None]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
