"""An engine that dies or stops mid-update, as the trainer sees it: a prompt timeout naming the engine,
the other engines torn or rolled back (never a silent mix), and a new sender that updates the survivors."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.transport.harness import (
    dying_engine_role,
    surviving_engine_role,
    trainer_of_dying_engines,
)


def _run_engine_failure(backend: str, signum: int, victim: int, qwen3_a: Path, qwen3_b: Path, timeout_s: float,
                        rollback: bool, device: str = "cpu") -> tuple[dict[str, Any], dict[str, Any], float]:
    """Trainer + two engines; engine ``victim`` kills or stops itself after loading 7 tensors. Returns
    (the trainer's outcome, the survivor's outcome, when the victim stopped)."""
    ctx = mp.get_context("spawn")
    results, addresses, survivor_addresses = ctx.Queue(), ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=trainer_of_dying_engines,
                          args=(backend, 2, str(qwen3_b), timeout_s, addresses, survivor_addresses, results),
                          daemon=True)
    trainer.start()
    engines = []
    try:
        for rank in (1, 2):
            address = addresses.get(timeout=120)
            if rank == victim:
                args: tuple = (address, rank, str(qwen3_a), signum, device, results)
                p = ctx.Process(target=dying_engine_role, args=args, daemon=True)
            else:
                args = (address, rank, str(qwen3_a), str(qwen3_b), rollback, device, survivor_addresses, results)
                p = ctx.Process(target=surviving_engine_role, args=args, daemon=True)
            p.start()
            engines.append(p)
        got: dict[str, Any] = {}
        deadline = time.monotonic() + 240
        while not {"trainer", "survivor"} <= set(got) and time.monotonic() < deadline:
            try:
                kind, _rank, payload = results.get(timeout=5)
            except queue.Empty:
                continue
            got[kind] = payload
        assert {"trainer", "survivor", "stopped"} <= set(got), f"missing reports: {got}"
        assert "victim" not in got, got["victim"]
        for kind in ("trainer", "survivor"):
            assert "setup_error" not in got[kind], got[kind]
        return got["trainer"], got["survivor"], got["stopped"]
    finally:
        for p in [trainer, *engines]:
            if p.is_alive():
                p.kill()  # a SIGSTOPped engine too: SIGKILL ends a stopped process
            p.join(timeout=10)


CASES = [
    pytest.param("gloo", signal.SIGKILL, 1, True, id="gloo-killed"),
    pytest.param("gloo", signal.SIGSTOP, 2, False, id="gloo-stopped"),
    pytest.param("shm", signal.SIGKILL, 2, False, id="shm-killed"),
    pytest.param("shm", signal.SIGSTOP, 1, True, id="shm-stopped"),
]


def _check(trainer: dict[str, Any], survivor: dict[str, Any], stopped_at: float, victim: int, timeout_s: float,
           rollback: bool) -> None:
    assert trainer["error"] == "TransportTimeout", trainer
    message = trainer["message"]
    assert f"receiver rank {victim}" in message, message
    assert "update_weights" in message, message  # the phase the trainer was in
    assert f"receiver rank {3 - victim}" not in message, f"the surviving engine is named as gone: {message}"
    assert trainer["raised_at"] - stopped_at <= 2 * timeout_s, (trainer["raised_at"] - stopped_at, message)
    # The surviving engine failed the update too and never serves a mix of versions.
    assert survivor["error"] in ("TransportError", "TransportTimeout"), survivor
    assert survivor["version"] == "initial", survivor
    if rollback:
        assert survivor["rolled_back"] and survivor["torn"] is None, survivor
    else:
        assert survivor["torn"] is not None or survivor["rolled_back"], survivor
    # A new sender connects to the survivor and its update lands whole.
    assert trainer["recovered"] == 2
    assert survivor["final"] == survivor["fresh_b"] and survivor["torn_final"] is None, survivor
    assert survivor["final_version"] == 2


@pytest.mark.parametrize(("backend", "signum", "victim", "rollback"), CASES)
def test_an_engine_dead_or_stopped_mid_update_fails_the_trainer_within_twice_the_timeout_naming_it(
    backend: str, signum: int, victim: int, rollback: bool, qwen3_a: Path, qwen3_b: Path
) -> None:
    timeout_s = 4.0
    trainer, survivor, stopped_at = _run_engine_failure(backend, signum, victim, qwen3_a, qwen3_b, timeout_s,
                                                        rollback)
    _check(trainer, survivor, stopped_at, victim, timeout_s, rollback)


@pytest.mark.gpu
@pytest.mark.parametrize(("signum", "victim"), [(signal.SIGKILL, 2), (signal.SIGSTOP, 1)], ids=["killed", "stopped"])
def test_an_ipc_engine_dead_or_stopped_mid_update_fails_the_trainer_within_twice_the_timeout_naming_it(
    signum: int, victim: int, qwen3_a: Path, qwen3_b: Path
) -> None:
    timeout_s = 6.0
    trainer, survivor, stopped_at = _run_engine_failure("ipc", signum, victim, qwen3_a, qwen3_b, timeout_s,
                                                        rollback=True, device="cuda:0")
    _check(trainer, survivor, stopped_at, victim, timeout_s, rollback=True)
