"""Shared fixtures: tiny checkpoints made once per session (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync.testing import make_checkpoint


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def qwen3_a(ckpt_dir: Path) -> Path:
    return make_checkpoint(ckpt_dir / "qwen3_a", arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def qwen3_b(ckpt_dir: Path) -> Path:
    return make_checkpoint(ckpt_dir / "qwen3_b", arch="qwen3", seed=1)


@pytest.fixture(scope="session")
def llama_tied(ckpt_dir: Path) -> Path:
    return make_checkpoint(ckpt_dir / "llama_tied", arch="llama", seed=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def llama_tied_b(ckpt_dir: Path) -> Path:
    return make_checkpoint(ckpt_dir / "llama_tied_b", arch="llama", seed=3, tie_word_embeddings=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU-marked tests where CUDA is absent (CI); they run on the device machine."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_check.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def staged_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 linears without bands: every processed layer is staged whole and processed at its last key
    (as per-tensor layers split over a TP group are), for tests of staging, budgets and spilling."""
    from weight_sync.quant import Fp8LinearMethod

    monkeypatch.setattr(Fp8LinearMethod, "row_bands", lambda self, layer, name, shape: None)
