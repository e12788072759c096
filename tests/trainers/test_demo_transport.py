"""``weight-sync demo`` across processes: engines in worker processes, verified every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from weight_sync.cli import main


def test_demo_over_gloo_with_an_engine_process_passes_its_fingerprint_checks(tmp_path: Path) -> None:
    assert main(["demo", "--steps", "2", "--transport", "gloo", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.json").exists()


def test_demo_over_zero_copy_shm_with_two_engine_processes_passes_its_fingerprint_checks(tmp_path: Path) -> None:
    # The trainer's parameters move into shared memory once; the optimizer keeps updating them in place.
    assert main(["demo", "--steps", "3", "--transport", "shm", "--zero-copy", "--workers", "2",
                 "--out", str(tmp_path)]) == 0


def test_demo_exits_non_zero_when_an_engine_differs_from_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    import trainers.demo

    monkeypatch.setattr(trainers.demo, "_fresh_fingerprint", lambda *a, **k: "0" * 64)
    assert main(["demo", "--steps", "1", "--transport", "shm", "--workers", "2", "--out", str(tmp_path)]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.gpu
def test_demo_over_ipc_on_one_gpu_passes_its_fingerprint_checks(tmp_path: Path) -> None:
    from trainers.cli import main as trainers_main

    assert trainers_main(["demo", "--steps", "2", "--transport", "ipc", "--out", str(tmp_path)]) == 0
    assert trainers_main(["demo", "--steps", "2", "--transport", "ipc", "--zero-copy", "--out", str(tmp_path)]) == 0


@pytest.mark.multi_gpu
def test_demo_over_nccl_into_an_engine_on_the_second_gpu_passes_its_fingerprint_checks(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from trainers.cli import main as trainers_main

    assert trainers_main(["demo", "--steps", "2", "--transport", "nccl", "--out", str(tmp_path)]) == 0
