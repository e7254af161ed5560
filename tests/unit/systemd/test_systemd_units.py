"""The systemd units: key directives of the real files, `systemd-analyze verify` on copies whose
binaries are stubs, sysusers/tmpfiles applied to a scratch root, and the example config file
documenting every option."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from flared.config import DaemonConfig, EngineOptions, parse_config
from flared.memory import MemoryConfig

REPO = Path(__file__).resolve().parents[3]
UNITS = REPO / "systemd"
UNIT_FILES = ("flared.service", "flared.socket", "flare-http.service", "flare-nvidia-nodes.service")
ENGINE_SHUTDOWN_S = 10  # flared.llm_engine.Engine.shutdown's default timeout
Unit = dict[str, dict[str, list[str]]]


def parse_unit(path: Path) -> Unit:
    """section -> key -> every value (DeviceAllow= and ExecStart= repeat)."""
    out: Unit = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key, []).append(value)
    return out


def one(unit: Unit, section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, (key, values)
    return values[0]


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        subprocess.run(["bash", str(REPO / "scripts" / "ci-system-deps.sh")], check=False)
        found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed and scripts/ci-system-deps.sh could not install it")
    return found


def test_flared_service_directives() -> None:
    u = parse_unit(UNITS / "flared.service")
    s = u["Service"]
    assert one(u, "Service", "Type") == "notify"
    assert one(u, "Service", "NotifyAccess") == "main"
    assert one(u, "Service", "ExecStart") == (
        "/usr/bin/flared /var/lib/flare/bundle --config /etc/flare/flared.toml"
    )
    assert seconds(one(u, "Service", "WatchdogSec")) >= 10
    assert (one(u, "Service", "User"), one(u, "Service", "Group")) == ("flare", "flare")
    assert one(u, "Service", "Restart") == "on-failure"
    assert "StartLimitIntervalSec" in u["Unit"] and "StartLimitBurst" in u["Unit"]
    assert one(u, "Service", "NoNewPrivileges") == "yes"
    assert one(u, "Service", "ProtectSystem") == "strict"
    for kind in ("State", "Cache", "Runtime"):
        assert one(u, "Service", f"{kind}Directory") == "flare"
        assert one(u, "Service", f"{kind}DirectoryMode") == "0750"
    # the socket lives in /run/flare: a restart must not delete it
    assert one(u, "Service", "RuntimeDirectoryPreserve") == "yes"
    # the GPU stays reachable
    assert s.get("PrivateDevices", ["no"]) == ["no"]
    assert one(u, "Service", "DevicePolicy") == "closed"
    allowed = {v.split()[0]: v.split()[1] for v in s["DeviceAllow"]}
    for node in (
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
        "char-nvidia-frontend",
        "char-nvidia-uvm",
    ):
        assert allowed.get(node) == "rw", node
    assert "flared.socket" in one(u, "Unit", "Requires")


def test_only_permanent_failures_are_kept_from_restarting() -> None:
    """A bad bundle, config or socket (exit 2) is not retried; a failed load (1) and a memory
    plan that does not fit what is free now (3) are, within StartLimitBurst."""
    from flared.daemon import EXIT_LOAD_FAILED, EXIT_PLAN_DOES_NOT_FIT, EXIT_USAGE

    u = parse_unit(UNITS / "flared.service")
    kept = set(one(u, "Service", "RestartPreventExitStatus").split())
    assert kept == {str(EXIT_USAGE)}
    assert str(EXIT_LOAD_FAILED) not in kept and str(EXIT_PLAN_DOES_NOT_FIT) not in kept
    text = (UNITS / "flared.service").read_text()
    for code in (EXIT_LOAD_FAILED, EXIT_USAGE, EXIT_PLAN_DOES_NOT_FIT):
        assert f"exit {code} " in text or f" {code} (" in text, code  # each one explained


def test_stop_timeout_covers_the_drain() -> None:
    u = parse_unit(UNITS / "flared.service")
    stop_s = seconds(one(u, "Service", "TimeoutStopSec"))
    example = tomllib.loads((REPO / "config" / "flared.toml").read_text())
    for drain_s in (DaemonConfig().drain_timeout_s, example["daemon"]["drain_timeout_s"]):
        assert stop_s >= drain_s + ENGINE_SHUTDOWN_S


def test_every_directive_of_flared_service_is_explained() -> None:
    """Each block of directives is preceded by a comment line (Description= and Documentation=
    explain themselves)."""
    lines = (UNITS / "flared.service").read_text().splitlines()
    for i, line in enumerate(lines):
        if not line or line.startswith(("#", "[", "Description=", "Documentation=")):
            continue
        j = i
        while j > 0 and lines[j - 1] and not lines[j - 1].startswith(("#", "[", "Desc", "Doc")):
            j -= 1
        assert j > 0 and lines[j - 1].startswith("#"), f"uncommented: {line}"


def test_socket_directives() -> None:
    u = parse_unit(UNITS / "flared.socket")
    assert one(u, "Socket", "ListenStream") == "/run/flare/flared.sock"
    assert one(u, "Socket", "SocketMode") == "0660"
    assert one(u, "Socket", "SocketGroup") == "flare"
    assert one(u, "Socket", "DirectoryMode") == "0750"
    assert one(u, "Install", "WantedBy") == "sockets.target"


def test_http_shim_directives() -> None:
    u = parse_unit(UNITS / "flare-http.service")
    assert "--socket /run/flare/flared.sock" in one(u, "Service", "ExecStart")
    assert one(u, "Service", "ExecStart").startswith("/usr/bin/flare-http ")
    assert "flared.socket" in one(u, "Unit", "Requires")
    assert "flared.socket" in one(u, "Unit", "After")
    assert one(u, "Service", "Group") == "flare"  # the socket's group: it may connect
    assert one(u, "Service", "NoNewPrivileges") == "yes"
    assert one(u, "Service", "ProtectSystem") == "strict"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    stub = tmp_path / "bin" / "stub"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    for name in UNIT_FILES:
        text = (UNITS / name).read_text()
        for binary in ("/usr/bin/flared", "/usr/bin/flare-http", "/usr/bin/nvidia-modprobe"):
            text = text.replace(binary, str(stub))
        (units / name).write_text(text)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", *(f"./{n}" for n in UNIT_FILES)],
        cwd=units,
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
        timeout=60,
    )
    # warnings ("Unknown key ... ignoring") do not change the exit status: require silence
    assert proc.returncode == 0 and not proc.stderr.strip() and not proc.stdout.strip(), (
        proc.stdout + proc.stderr
    )


def test_verify_catches_a_bad_directive(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    (tmp_path / "bad.service").write_text("[Service]\nType=notify\nExecStart=/bin/true\nBogus=1\n")
    proc = subprocess.run(
        [analyze, "verify", "--man=no", "./bad.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Bogus" in proc.stderr


def test_sysusers_and_tmpfiles(tmp_path: Path) -> None:
    sysusers = _tool("systemd-sysusers")
    tmpfiles = _tool("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()
    for kind in ("sysusers", "tmpfiles"):
        d = tmp_path / "usr" / "lib" / f"{kind}.d"
        d.mkdir(parents=True)
        shutil.copy(UNITS / f"flare.{kind}.conf", d / "flare.conf")
    subprocess.run([sysusers, f"--root={tmp_path}"], check=True, capture_output=True)
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    group = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/group").read_text().splitlines()
    }
    flare_gid = group["flare"][2]
    assert passwd["flare"][3] == flare_gid and passwd["flare-http"][3] == flare_gid
    assert passwd["flare"][6].endswith("nologin")
    subprocess.run([tmpfiles, "--create", f"--root={tmp_path}"], check=True, capture_output=True)
    for path in ("run/flare", "var/lib/flare", "var/cache/flare"):
        st = (tmp_path / path).stat()
        assert oct(st.st_mode & 0o777) == "0o750", path
        assert str(st.st_uid) == passwd["flare"][2] and str(st.st_gid) == flare_gid, path


def test_example_config_documents_every_option() -> None:
    text = (REPO / "config" / "flared.toml").read_text()
    data = tomllib.loads(text)
    daemon_fields = {f.name for f in dataclasses.fields(DaemonConfig)} - {"engine", "memory"}
    assert set(data["daemon"]) == daemon_fields
    assert set(data["engine"]) == {f.name for f in dataclasses.fields(EngineOptions)}
    assert set(data["memory"]) == {f.name for f in dataclasses.fields(MemoryConfig)}
    # defaults shown are the real defaults, except the shared system service's own two:
    # allowed_group "flare" and a per-uid connection cap
    cfg = parse_config({k: v for k, v in data.items() if k != "memory"})
    assert (cfg.allowed_group, cfg.max_sessions_per_uid) == ("flare", 128)
    assert dataclasses.replace(cfg, allowed_group="", max_sessions_per_uid=0) == DaemonConfig()
    assert MemoryConfig(**data["memory"]).validate() == MemoryConfig()
    # every key line has a comment directly above it
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+ = ", line):
            assert lines[i - 1].startswith("#"), f"undocumented option: {line}"
