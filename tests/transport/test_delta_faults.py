"""A trainer killed in the middle of a delta update: every engine raises within twice the timeout and is
rolled back (or torn, without rollback) - never a mix of the base and the delta - and the next full update
from a reconnected trainer leaves it bitwise equal to a fresh load."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.manifest import Manifest
from weight_sync.reload import torn_reason
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender

TIMEOUT_S = 6.0
KILL_AFTER = 12  # of 25 encoded tensors: several 16 KB buckets have reached the engines by then


def _nudged(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The next version: ~2% of every tensor's elements moved (a delta, not a full update)."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, t in weights.items():
        t = t.clone()
        mask = torch.rand(t.shape, generator=g) < 0.02
        t[mask] += (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)[mask]
        out[name] = t
    return out


def _connected_delta_sender(num_receivers: int, addresses: Any) -> WeightSender:
    """A delta sender whose address every engine gets from ``addresses``, connected to all of them."""
    sender = WeightSender(TransportConfig(backend="gloo", bucket_bytes=16 << 10, timeout_s=TIMEOUT_S, delta=True,
                                          delta_chunk_elems=1024), num_receivers=num_receivers)
    for _ in range(num_receivers):
        addresses.put(sender.address)
    sender.connect()
    return sender


def trainer(ckpt: str, num_receivers: int, addresses: Any, results: Any) -> None:
    """v1 in full (it becomes the delta base), then v2 as a delta that dies after KILL_AFTER tensors."""
    sender = _connected_delta_sender(num_receivers, addresses)
    v1 = dict(CheckpointSource(ckpt))
    manifest = Manifest.from_named_tensors(v1.items())
    report = sender.send(v1.items(), manifest, version=1)
    results.put(("v1", 0, report.delta["mode"]))
    real_update = sender.update_weights

    def dying_update(named_tensors: Any, *args: Any, **kwargs: Any) -> Any:
        def items() -> Any:
            for i, item in enumerate(named_tensors):
                if i == KILL_AFTER:
                    results.put(("stopped", 0, time.time()))
                    results.close()
                    results.join_thread()  # delivered before the kill
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item

        return real_update(items(), *args, **kwargs)

    sender.update_weights = dying_update  # type: ignore[method-assign]
    sender.send(_nudged(v1).items(), manifest, version=2)


def healthy_trainer(ckpt: str, num_receivers: int, addresses: Any, results: Any) -> None:
    """The reconnected trainer: a new sender has no base, so v2 goes in full."""
    sender = _connected_delta_sender(num_receivers, addresses)
    v1 = dict(CheckpointSource(ckpt))
    report = sender.send(_nudged(v1).items(), Manifest.from_named_tensors(v1.items()), version=2)
    results.put(("v2", 0, report.delta["mode"]))
    sender.close()


def engine(rank: int, ckpt: str, rollback: bool, addresses: Any, results: Any) -> None:
    try:
        eng = ReferenceEngine.from_checkpoint(ckpt)
        receiver = WeightReceiver(eng, addresses.get(timeout=120), rank, rollback=rollback)
        receiver.connect()
        receiver.receive_update(timeout_s=60)
        v1 = eng.fingerprint()
        outcome: dict[str, Any] = {}
        try:
            receiver.receive_update(timeout_s=60)
            outcome["error"] = None
        except Exception as e:
            outcome.update(error=type(e).__name__, message=str(e), raised_at=time.time())
        outcome.update(rolled_back=eng.fingerprint() == v1, torn=torn_reason(eng.model) is not None,
                       version=receiver.weight_version)
        receiver.close()
        receiver = WeightReceiver(eng, addresses.get(timeout=120), rank, rollback=rollback)
        receiver.connect()
        receiver.receive_update(timeout_s=60)
        config = json.loads((Path(ckpt) / "config.json").read_text())
        fresh = ReferenceEngine.from_config(config, weights=_nudged(dict(CheckpointSource(ckpt))).items())
        outcome.update(final_equals_fresh=eng.fingerprint() == fresh.fingerprint(),
                       torn_final=torn_reason(eng.model), final_version=receiver.weight_version)
        receiver.close()
        results.put(("engine", rank, outcome))
    except BaseException as e:
        results.put(("engine", rank, {"setup_error": f"{type(e).__name__}: {e}"}))


def _run(ckpt: Path, rollback: bool, num_receivers: int = 2) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=trainer, args=(str(ckpt), num_receivers, addresses, results), daemon=True)]
    procs += [ctx.Process(target=engine, args=(r, str(ckpt), rollback, addresses, results), daemon=True)
              for r in range(1, num_receivers + 1)]
    for p in procs:
        p.start()
    events: dict[str, Any] = {}
    engines: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 300
    try:
        while len(engines) < num_receivers and time.monotonic() < deadline:
            try:
                kind, rank, payload = results.get(timeout=5)
            except queue.Empty:
                continue
            if kind == "engine":
                engines[rank] = payload
            else:
                events[kind] = payload
            if kind == "stopped":  # the dying trainer is gone: its successor connects
                procs[0].join(timeout=30)
                p = ctx.Process(target=healthy_trainer, args=(str(ckpt), num_receivers, addresses, results),
                                daemon=True)
                p.start()
                procs.append(p)
        return events, engines
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


@pytest.mark.parametrize("rollback", [True, False])
def test_a_trainer_killed_mid_delta_leaves_every_engine_rolled_back_or_torn_and_the_next_update_lands(
    rollback: bool, qwen3_a: Path
) -> None:
    events, engines = _run(qwen3_a, rollback)
    assert events["v1"] == "full" and "stopped" in events, events
    assert events.get("v2") == "full", events  # a new sender keeps no base: the next update is full
    assert len(engines) == 2, engines
    for o in engines.values():
        assert "setup_error" not in o, o
        assert o["error"] in ("TransportError", "TransportTimeout"), o
        assert o["raised_at"] - events["stopped"] <= 2 * TIMEOUT_S, o
        assert o["version"] == 1
        if rollback:
            assert o["rolled_back"] and not o["torn"], o
        else:  # tensors of the delta were written: torn, refusing to serve, never silently mixed
            assert o["torn"] and not o["rolled_back"], o
        assert o["final_equals_fresh"] and o["torn_final"] is None and o["final_version"] == 2, o
