"""Shared fixtures: tiny random-weight checkpoints and their prepared bundles, built once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples every run (a red run is a regression, never a newly
# drawn example); FLARE_HYPOTHESIS=explore draws fresh ones (see README, Tests).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("FLARE_HYPOTHESIS", "repeatable"))


class TinyModels:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._ckpts: dict[str, Path] = {}
        self._bundles: dict[tuple, Path] = {}

    def checkpoint(self, model_type: str = "qwen3") -> Path:
        from prep.tiny import make_tiny_checkpoint

        if model_type not in self._ckpts:
            self._ckpts[model_type] = make_tiny_checkpoint(
                self.root / f"ckpt-{model_type}", model_type
            )
        return self._ckpts[model_type]

    def bundle(self, model_type: str = "qwen3", **kw: object) -> Path:
        from prep.prepare import PrepConfig, prepare

        opts = dict(
            max_context_tokens=512,
            max_prefill_chunk_tokens=256,
            page_size=16,
            compile=False,
            device="cpu",
        )
        opts.update(kw)
        key = (model_type, tuple(sorted(opts.items())))
        if key not in self._bundles:
            out = self.root / f"bundle-{model_type}-{len(self._bundles)}"
            prepare(PrepConfig(checkpoint=self.checkpoint(model_type), out=out, **opts))  # type: ignore[arg-type]
            self._bundles[key] = out
        return self._bundles[key]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))
