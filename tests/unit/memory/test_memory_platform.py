"""read_platform() on fake /proc, cgroup v2/v1 trees and /dev/shm, with an injected device."""

from __future__ import annotations

import os
from pathlib import Path

from flared.memory import DeviceInfo, read_platform
from flared.memory.units import GIB, MIB

MEMINFO = """\
MemTotal:       131072000 kB
MemFree:         1000000 kB
MemAvailable:   104857600 kB
Buffers:          123456 kB
"""


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _base(root: Path, cgroup: str) -> None:
    _write(root, "proc/meminfo", MEMINFO)
    _write(root, "proc/self/cgroup", cgroup)
    (root / "dev" / "shm").mkdir(parents=True)


def test_meminfo_and_shm(tmp_path: Path) -> None:
    _base(tmp_path, "0::/\n")
    p = read_platform(tmp_path)
    assert p.host_total_bytes == 131072000 * 1024
    assert p.host_available_bytes == 100 * GIB
    assert not p.has_device and p.unified
    st = os.statvfs(tmp_path / "dev" / "shm")
    assert p.shm_total_bytes == st.f_blocks * st.f_frsize
    assert p.cgroup_limit_bytes is None  # no cgroup files: unlimited


def test_cgroup_v2_limit_is_the_smallest_ancestor_and_usage_is_working_set(
    tmp_path: Path,
) -> None:
    _base(tmp_path, "0::/system.slice/flared.service\n")
    cg = "sys/fs/cgroup"
    _write(tmp_path, f"{cg}/cgroup.controllers", "cpu memory\n")
    _write(tmp_path, f"{cg}/system.slice/memory.max", f"{32 * GIB}\n")
    _write(tmp_path, f"{cg}/system.slice/flared.service/memory.max", "max\n")
    _write(tmp_path, f"{cg}/system.slice/flared.service/memory.current", f"{10 * GIB}\n")
    stat = f"anon {6 * GIB}\nfile {4 * GIB}\ninactive_file {3 * GIB}\nactive_file {GIB}\n"
    _write(tmp_path, f"{cg}/system.slice/flared.service/memory.stat", stat)
    p = read_platform(tmp_path)
    assert p.cgroup_limit_bytes == 32 * GIB
    assert p.cgroup_usage_bytes == 7 * GIB
    assert p.os_available_bytes == 25 * GIB  # below MemAvailable's 100 GiB


def test_cgroup_v2_in_a_namespace_uses_the_mount_root(tmp_path: Path) -> None:
    _base(tmp_path, "0::/\n")
    _write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "memory\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", f"{8 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{GIB}\n")
    p = read_platform(tmp_path)
    assert (p.cgroup_limit_bytes, p.cgroup_usage_bytes) == (8 * GIB, GIB)


def test_cgroup_v1_fallback_and_unlimited(tmp_path: Path) -> None:
    _base(tmp_path, "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n0::/\n")
    mem = "sys/fs/cgroup/memory/docker/abc"
    _write(tmp_path, f"{mem}/memory.limit_in_bytes", f"{16 * GIB}\n")
    _write(tmp_path, f"{mem}/memory.usage_in_bytes", f"{4 * GIB}\n")
    _write(tmp_path, f"{mem}/memory.stat", f"cache 1\ntotal_inactive_file {512 * MIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    p = read_platform(tmp_path)
    assert p.cgroup_limit_bytes == 16 * GIB
    assert p.cgroup_usage_bytes == 4 * GIB - 512 * MIB


def test_cgroup_v1_no_limit(tmp_path: Path) -> None:
    _base(tmp_path, "5:memory:/\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert read_platform(tmp_path).cgroup_limit_bytes is None


def test_missing_files_give_conservative_empty_values(tmp_path: Path) -> None:
    p = read_platform(tmp_path)
    assert p.host_total_bytes == 0 and p.host_available_bytes == 0
    assert p.shm_free_bytes is None and p.cgroup_limit_bytes is None


def test_device_info_is_injected(tmp_path: Path) -> None:
    _base(tmp_path, "0::/\n")
    gb10 = DeviceInfo("NVIDIA GB10", 119 * GIB, 110 * GIB, is_integrated=True)
    p = read_platform(tmp_path, device_info=lambda: gb10)
    assert p.has_device and p.is_integrated and p.unified
    assert (p.device_total_bytes, p.device_free_bytes) == (119 * GIB, 110 * GIB)
    h200 = DeviceInfo("NVIDIA H200", 141 * GIB, 140 * GIB, is_integrated=False)
    assert not read_platform(tmp_path, device_info=lambda: h200).unified


def test_this_machine(tmp_path: Path) -> None:
    p = read_platform()
    assert p.host_total_bytes > 0 and 0 <= p.os_available_bytes <= p.host_total_bytes
