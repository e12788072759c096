"""Shared fixtures: tiny checkpoints made once per session (no network)."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


@pytest.fixture(scope="module", params=["native", "numpy"])
def cpu_delta_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's tests twice: with delta sync's native CPU kernels, then with their numpy twins
    (``WEIGHT_SYNC_NATIVE``, which ranks spawned meanwhile inherit)."""
    from weight_sync import native

    before = os.environ.get("WEIGHT_SYNC_NATIVE")
    os.environ["WEIGHT_SYNC_NATIVE"] = "1" if request.param == "native" else "0"
    if request.param == "native" and not native.enabled():
        pytest.fail("the native delta kernels did not build here (see tests/native)")
    try:
        yield request.param
    finally:
        if before is None:
            os.environ.pop("WEIGHT_SYNC_NATIVE", None)
        else:
            os.environ["WEIGHT_SYNC_NATIVE"] = before
