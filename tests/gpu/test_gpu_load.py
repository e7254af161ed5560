"""GPU: bundle weights load onto CUDA through the pinned staging buffers exactly (tensors larger
than one buffer, odd sizes, several per buffer, dtype conversion). Run with `-m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_weights_load_onto_cuda_exactly(tmp_path: Path, monkeypatch) -> None:
    from safetensors.torch import save_file

    from prep import model as prep_model

    monkeypatch.setattr(prep_model, "STAGING_BYTES", 1 << 20)  # many chunks, both buffers
    g = torch.Generator().manual_seed(0)
    stored = {
        "big": torch.randn(3_000_001, generator=g),  # ~11.4 buffers, a ragged last chunk
        "small": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "cast": torch.randn(1000, generator=g).to(torch.bfloat16),  # into an fp32 place
        "ids": torch.arange(513, dtype=torch.int64),
    }
    save_file(stored, str(tmp_path / "w.safetensors"))
    net = torch.nn.Module()
    for name, t in stored.items():
        dtype = torch.float32 if name == "cast" else t.dtype
        net.register_buffer(name, torch.empty(t.shape, dtype=dtype, device="cuda"))
    total = prep_model.load_weights(net, [tmp_path / "w.safetensors"])
    assert total == sum(t.nbytes for t in stored.values())
    for name, t in stored.items():
        got = getattr(net, name).cpu()
        assert torch.equal(got, t.to(got.dtype)), name
