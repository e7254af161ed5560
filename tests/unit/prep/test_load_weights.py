"""Bundle weight loading (`prep.model.load_weights`): positional reads of safetensors files
straight into parameters, exact, with typed errors for malformed or mismatched files, and
without holding the file's pages on top of the weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prep.model import load_weights, safetensors_index


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(24, 40)
        self.head = torch.nn.Linear(40, 8, bias=False).to(torch.bfloat16)
        self.register_buffer("table", torch.zeros(5, dtype=torch.int64))


def _stored() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "proj.weight": torch.randn(40, 24, generator=g),
        "proj.bias": torch.randn(40, generator=g).to(torch.bfloat16),  # converted on load
        "head.weight": torch.randn(8, 40, generator=g).to(torch.bfloat16),
        "table": torch.arange(5, dtype=torch.int64) * 7,
    }


def test_every_tensor_lands_exactly_across_files(tmp_path: Path) -> None:
    stored = _stored()
    names = list(stored)
    save_file({n: stored[n] for n in names[:2]}, str(tmp_path / "a.safetensors"))
    save_file({n: stored[n] for n in names[2:]}, str(tmp_path / "b.safetensors"), {"k": "v"})
    net = _Net()
    total = load_weights(net, [tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert total == sum(t.nbytes for t in stored.values())
    assert torch.equal(net.proj.weight, stored["proj.weight"])
    assert net.proj.bias.dtype == torch.float32
    assert torch.equal(net.proj.bias, stored["proj.bias"].float())  # bf16 -> fp32 is exact
    assert torch.equal(net.head.weight, stored["head.weight"])
    assert torch.equal(net.table, stored["table"])
    index = safetensors_index(tmp_path / "b.safetensors")
    assert index["head.weight"][:2] == (torch.bfloat16, (8, 40))


def test_mismatched_files_fail_with_the_tensor_named(tmp_path: Path) -> None:
    stored = _stored()
    f = tmp_path / "w.safetensors"
    save_file({**stored, "stray.weight": torch.zeros(2)}, str(f))
    with pytest.raises(KeyError, match=r"stray\.weight"):
        load_weights(_Net(), [f])
    save_file({k: v for k, v in stored.items() if k != "table"}, str(f))
    with pytest.raises(KeyError, match="table"):
        load_weights(_Net(), [f])
    save_file({**stored, "proj.weight": torch.zeros(24, 40)}, str(f))
    with pytest.raises(ValueError, match=r"proj\.weight"):
        load_weights(_Net(), [f])


def test_malformed_headers_raise_value_errors(tmp_path: Path) -> None:
    f = tmp_path / "bad.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_index(f)
    f.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="exceeds the file"):
        safetensors_index(f)

    def with_header(header: dict, data: bytes) -> None:
        raw = json.dumps(header).encode()
        f.write_bytes(len(raw).to_bytes(8, "little") + raw + data)

    with_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, bytes(12))
    with pytest.raises(ValueError, match="inconsistent byte offsets"):
        safetensors_index(f)
    with_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    with pytest.raises(ValueError, match="inconsistent byte offsets"):  # past the file's end
        safetensors_index(f)
    with_header({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match="unsupported dtype"):
        safetensors_index(f)


LOAD_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path
    import torch
    from prep.model import load_weights

    parts, n = int(sys.argv[2]), int(sys.argv[3])
    net = torch.nn.Module()
    for i in range(parts):  # pages not resident until the load writes them
        setattr(net, f"w{i}", torch.nn.Parameter(torch.empty(n), requires_grad=False))
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:  # resident memory as it is now (a peak counter updates lazily)
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    t = threading.Thread(target=sample)
    t.start()
    load_weights(net, [Path(sys.argv[1])])
    peak[0] = max(peak[0], rss())
    done.set()
    t.join()
    assert float(net.w3[12345]) == 12345.0
    print(peak[0] - base)
    """
)


def test_loading_holds_the_weights_once(tmp_path: Path) -> None:
    """Resident memory grows by the weights, not by the weights plus the file's pages (a
    mapped file's touched pages are resident too: the two together would be twice)."""
    parts, n = 12, 4 << 20  # 12 tensors of 16 MiB
    f = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.arange(n, dtype=torch.float32) for i in range(parts)}, str(f))
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(f), str(parts), str(n)],
        check=True, capture_output=True, text=True, cwd=root, timeout=120,
    )  # fmt: skip
    grew = int(out.stdout.strip().splitlines()[-1])
    weights = parts * n * 4
    assert grew < 1.25 * weights, f"resident memory grew {grew / 2**20:.0f} MiB for 192 MiB"
