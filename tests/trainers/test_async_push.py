"""Non-blocking pushes: the handle's done()/wait() semantics, and an engine that generates while one runs."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ManifestError, TransportTimeout, UpdateStateError
from weight_sync.manifest import Manifest
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.transport import (
    PushHandle,
    TransportConfig,
    WeightReceiver,
    WeightSender,
    push,
    push_client,
    push_to_staging,
)

PROMPTS = [[5, 6, 7], [8, 9]]


def _gated(items: list[tuple[str, torch.Tensor]], after: int, gate: threading.Event,
           reached: threading.Event) -> Iterator[tuple[str, torch.Tensor]]:
    """``items``, pausing after the first ``after`` of them until ``gate`` is set."""
    for i, item in enumerate(items):
        if i == after:
            reached.set()
            assert gate.wait(60), "the test never opened the gate"
        yield item


def test_a_handle_is_not_done_until_its_push_ends_and_wait_returns_its_result() -> None:
    gate = threading.Event()
    handle = PushHandle(lambda: gate.wait(60) and "report", version=7)
    assert not handle.done() and handle.seconds is None
    with pytest.raises(TransportTimeout, match="version 7 still running"):
        handle.wait(timeout_s=0.01)
    gate.set()
    assert handle.wait(timeout_s=60) == "report"
    assert handle.done() and handle.seconds is not None and handle.seconds > 0


def test_wait_re_raises_the_error_of_a_failed_push() -> None:
    def fail() -> None:
        raise ManifestError("x.weight: manifest announced (2,) float32, got (3,) float32")

    handle = PushHandle(fail, version=3)
    with pytest.raises(ManifestError, match=r"x\.weight"):
        handle.wait(timeout_s=60)
    assert handle.done()


class GatedClient:
    """A client whose blocking push waits for a gate and records what it was given."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.pushed: list[tuple[dict[str, torch.Tensor], Any]] = []

    def push(self, weights: Any, *, version: Any = None) -> str:
        assert self.gate.wait(60), "the test never opened the gate"
        self.pushed.append(({n: t.clone() for n, t in weights}, version))
        return f"report of {version}"


def test_a_client_push_runs_in_the_background_one_at_a_time_and_snapshots_on_request() -> None:
    client = GatedClient()
    weight = torch.ones(3)
    handle = push_client(client, [("w", weight)], version=4, snapshot=True)
    with pytest.raises(UpdateStateError, match="version 4 is still being pushed"):
        push_client(client, [("w", weight)], version=5)
    weight.add_(1)  # the snapshot was taken before push_client returned
    client.gate.set()
    assert handle.wait(timeout_s=60) == "report of 4"
    (sent, version), = client.pushed
    assert version == 4 and torch.equal(sent["w"], torch.ones(3))
    assert push_client(client, [("w", weight)], version=5).wait(timeout_s=60) == "report of 5"
    with pytest.raises(TypeError, match="needs a client with a push"):
        push_client(object(), [], version=6)


def test_the_engine_serves_the_committed_version_while_a_push_is_staged_and_the_new_one_after(
    qwen3_a: Path, qwen3_b: Path,
) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    staging = engine.enable_staging()
    old = engine.generate(PROMPTS, 6)
    items = list(iter_checkpoint(qwen3_b))
    gate, reached = threading.Event(), threading.Event()
    handle = push_to_staging(staging, _gated(items, len(items) // 2, gate, reached),
                             Manifest.from_named_tensors(items), version=2)
    assert reached.wait(60)
    # Half of version 2 is on the twin: the engine still serves version 'initial', whole.
    assert not handle.done()
    assert engine.generate_with_versions(PROMPTS, 6)[0].weight_versions[0].version == "initial"
    assert engine.generate(PROMPTS, 6) == old
    with pytest.raises(UpdateStateError, match="still being pushed"):
        push_to_staging(staging, items, Manifest.from_named_tensors(items), version=3)
    gate.set()
    report = handle.wait(timeout_s=60)
    assert report.version == 2
    fresh = ReferenceEngine.from_checkpoint(qwen3_b)
    assert engine.generate(PROMPTS, 6) == fresh.generate(PROMPTS, 6)
    assert engine.weight_version == 2 and engine.fingerprint() == fresh.fingerprint()


def test_a_failed_push_to_staging_raises_from_wait_and_leaves_the_served_tokens(qwen3_a: Path, qwen3_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    staging = engine.enable_staging()
    old = engine.generate(PROMPTS, 6)
    items = list(iter_checkpoint(qwen3_b))
    bad = [*items[:4], (items[4][0], torch.zeros(1))]
    handle = push_to_staging(staging, bad, Manifest.from_named_tensors(items), version=2)
    with pytest.raises(ManifestError, match=items[4][0]):
        handle.wait(timeout_s=60)
    assert engine.generate(PROMPTS, 6) == old and engine.weight_version == "initial"


def _engine_process(ckpt: str, conn: Any) -> None:
    """An engine that generates on its main thread while its receiver takes an update on another."""
    try:
        engine = ReferenceEngine.from_checkpoint(ckpt)
        receiver = WeightReceiver(engine.enable_staging(), conn.recv(), 1)
        receiver.connect()
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                receiver.receive_update()
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=receive)
        thread.start()
        rounds = []
        while True:
            done = not thread.is_alive()  # read before generating: this round commits what is staged
            rounds.append([(r.token_ids, [(s.version, s.start, s.end) for s in r.weight_versions])
                           for r in engine.generate_with_versions(PROMPTS, 6)])
            if done:
                break
        thread.join()
        receiver.close()
        conn.send(("error", repr(errors[0])) if errors else ("ok", rounds, engine.fingerprint()))
    except BaseException as e:
        conn.send(("error", repr(e)))


def test_a_push_over_gloo_is_staged_while_the_engine_process_generates(qwen3_a: Path, qwen3_b: Path) -> None:
    items = list(iter_checkpoint(qwen3_b))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_process, args=(str(qwen3_a), child), daemon=True)
    proc.start()
    sender = WeightSender(TransportConfig(backend="gloo", timeout_s=60), num_receivers=1)
    try:
        parent.send(sender.address)
        sender.connect()
        handle = push(sender, items, Manifest.from_named_tensors(items), version=2)
        report = handle.wait(timeout_s=120)
        assert parent.poll(120), "the engine process sent nothing back"
        result = parent.recv()
    finally:
        sender.close()
        proc.join(30)
    assert result[0] == "ok", result
    _, rounds, fingerprint = result
    fresh = ReferenceEngine.from_checkpoint(qwen3_b)
    assert report.fingerprints == [fresh.fingerprint()] == [fingerprint]
    # Every token of every round came from one committed version, 'initial' before version 2.
    for rnd in rounds:
        for _, spans in rnd:
            assert [v for v, _, _ in spans] in (["initial"], [2], ["initial", 2])
            assert spans[0][1] == 0 and spans[-1][2] == 6
            assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
    assert [t for t, _ in rounds[-1]] == fresh.generate(PROMPTS, 6)
