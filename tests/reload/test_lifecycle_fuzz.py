"""Stateful fuzzing of the reload lifecycle (issue 13): an engine serves one committed version or refuses.

Machines (see ``_fuzz_machines.py`` / ``_fuzz_drivers.py``): the reference engine of a tiny dense Qwen3
in fp8 (online quantization), bf16 and fp32, and of a tiny Qwen3-MoE (8 experts) in fp8 with per-tensor
and with block scales, TP=1 in process; a plain ``nn.Module`` with one processed layer; the fp8
engine at TP=2 over gloo as random replays on two spawned ranks; a transport whose sender is killed
after a random number of tensors. Rules: full updates (path, iterator, transaction API in any order and
chunking, with or without manifest, rollback on or off), partial updates, updates with an injected fault,
the seed's aliases (with a failing ``load_weights``), serving calls (also mid-update), and a session kept
open across steps (load, finish, abort, the caller crashing). After every step: the kernel tensors equal
a fresh load of the expected version bitwise, or every serving call refuses naming the failure; no
graph-visible tensor moved; no session or shim is left behind. After every sequence: the next good full
update succeeds and nothing leaked.

CI runs a bounded, derandomized number of examples (no example database); ``WS_FUZZ_SCALE`` multiplies
them. The long run is ``benchmarks/bench_reliability.py``.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.reload._fuzz_drivers import EngineDriver, PlainDriver, failing_source
from tests.reload._fuzz_machines import MACHINES, Fp8EngineMachine, machine_settings
from tests.reload._fuzz_spawned import replay_tp, run_killed_sender
from tests.reload._fuzz_world import (
    BadUpdateAccepted,
    Hygiene,
    Leaked,
    MixedVersionsServed,
    PointerMoved,
    ServedDuringOpenUpdate,
    ShimLeft,
    TornAfterGoodUpdate,
    assets,
    base_key,
)
from weight_sync import IncompleteUpdateError, SourceError
from weight_sync.reload import register_post_update_hook
from weight_sync.testing import run_distributed

SCALE = float(os.environ.get("WS_FUZZ_SCALE", "1"))
EXAMPLES = {"fp8": 8, "bf16": 6, "fp32": 4, "moe_fp8": 12, "moe_fp8_block": 8, "plain": 8}
STEPS = 12


def _examples(n: int) -> int:
    return max(1, round(n * SCALE))


@pytest.mark.parametrize("machine", ["fp8", "bf16", "fp32", "moe_fp8", "moe_fp8_block", "plain"])
def test_every_step_leaves_one_committed_version_or_a_refusal(machine: str) -> None:
    run_state_machine_as_test(MACHINES[machine], settings=machine_settings(_examples(EXAMPLES[machine]), STEPS))


def test_tp2_replays_keep_each_shard_on_one_committed_version_or_refusing() -> None:
    seeds = list(range(_examples(2)))
    results = run_distributed(replay_tp, 2, "fp8", seeds, 10, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["violations"] == [], f"rank {rank}: {r['violations']}"
    assert results[0]["steps"] == results[1]["steps"] > 0


@pytest.mark.parametrize(("backend", "rollback", "seed"), [("shm", False, 0), ("gloo", True, 1)])
def test_a_sender_killed_at_a_random_tensor_leaves_the_engine_recoverable_and_nothing_behind(
    backend: str, rollback: bool, seed: int
) -> None:
    a = assets()
    after = __import__("random").Random(seed).randrange(1, len(a.names))
    v = run_killed_sender(backend, "fp8", rollback, after, str(a.paths[0]), str(a.paths[1]))
    assert v.get("error") is None, v
    assert v["raised"] is not None and v["problems"] == [], v
    assert v["shm_left"] == [] and v["children_left"] == [], v


# ------------------------------------------------------------------ the checker detects what it must
def test_the_checker_reports_a_model_holding_tensors_of_two_versions() -> None:
    d = EngineDriver("bf16")
    d.check()
    v1 = d.fresh(base_key(1, d.names)).kernel
    with torch.no_grad():
        d.model.model.norm.weight.copy_(v1["model.norm.weight"])  # one layer of v1 in a v0 engine
    with pytest.raises(MixedVersionsServed, match=r"model\.norm\.weight holds v1"):
        d.check()


def test_the_checker_reports_a_plain_module_holding_tensors_of_two_versions() -> None:
    d = PlainDriver()
    d.check()
    with torch.no_grad():
        d.model.proc.weight.copy_(d.fresh(base_key(2, d.names)).kernel["proc.weight"])
    with pytest.raises(MixedVersionsServed, match=r"proc\.weight holds v2"):
        d.check()


def test_the_checker_reports_a_torn_engine_where_no_failure_allowed_it() -> None:
    d = EngineDriver("bf16")
    items = d.items_of(1)
    with pytest.raises(SourceError):  # behind the world's back: the world still expects v0, servable
        d.engine.reload_weights(weights_iterator=failing_source(items, 5))
    with pytest.raises(TornAfterGoodUpdate, match="trainer died"):
        d.check()


def test_the_checker_reports_an_engine_that_serves_while_an_update_is_open(monkeypatch) -> None:
    d = EngineDriver("bf16")
    monkeypatch.setattr(d.engine, "_check_servable", lambda: None)  # an engine without the guard
    d.session, d.open = d.engine.begin_update(), {"pending": [], "loaded": 0, "rollback": False}
    with pytest.raises(ServedDuringOpenUpdate):
        d.check()
    d.session.abort()


def test_the_checker_reports_a_moved_graph_visible_tensor() -> None:
    d = EngineDriver("fp32")
    p = d.model.model.norm.weight
    p.data = p.data.clone()
    with pytest.raises(PointerMoved, match=r"model\.norm\.weight"):
        d.check()


def test_the_checker_reports_a_routing_shim_left_on_the_model() -> None:
    d = PlainDriver()
    d.model.__dict__["load_weights"] = lambda weights: None
    with pytest.raises(ShimLeft):
        d.check()


def test_the_checker_reports_a_faulty_update_that_commits() -> None:
    d = PlainDriver()
    with pytest.raises(BadUpdateAccepted, match="IncompleteUpdateError"):
        d.expect("an incomplete update", lambda: None, IncompleteUpdateError)


def test_the_checker_reports_a_leaked_thread() -> None:
    before = Hygiene.take()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="leaky")
    t.start()
    try:
        with pytest.raises(Leaked, match="leaky"):
            before.check("a sequence")
    finally:
        stop.set()
        t.join()


def test_the_checker_reports_a_leaked_file_but_not_a_library_opened_once_for_the_process(tmp_path) -> None:
    before = Hygiene.take()
    with open(tmp_path / "model.safetensors", "wb") as leaked, open(torch.__file__, "rb"):
        with pytest.raises(Leaked, match=r"model\.safetensors"):
            before.check("a sequence")
        # The checkpoint closed, the library file still open: code opening a file of the installed
        # packages on first use (and keeping it) is not the sequence's leak.
        leaked.close()
        before.check("a sequence")


def test_the_checker_reports_a_socket_left_open_but_not_one_that_another_thread_closes_soon(monkeypatch) -> None:
    import socket

    from tests.reload import _fuzz_world

    monkeypatch.setattr(_fuzz_world, "_SOCKET_GRACE_S", 0.3)
    before = Hygiene.take()
    kept = socket.socket()
    with kept, pytest.raises(Leaked, match=rf"socket:\[{os.fstat(kept.fileno()).st_ino}\]"):
        before.check("a sequence")
    # A socket some library's own thread (alive before the sequence) opens and closes at its pace: here
    # just after the check has listed it open.
    close_it = threading.Event()
    held: list[socket.socket] = []
    listed = _fuzz_world._fd_targets

    def listing_then_closing() -> tuple[str, ...]:
        out = listed()
        if held:
            close_it.set()
        return out

    def library_thread() -> None:
        close_it.wait()
        held[0].close()

    t = threading.Thread(target=library_thread, name="library")
    t.start()
    before = Hygiene.take()
    monkeypatch.setattr(_fuzz_world, "_fd_targets", listing_then_closing)
    held.append(socket.socket())
    held_target = f"socket:[{os.fstat(held[0].fileno()).st_ino}]"
    try:
        before.check("a sequence")
    except Leaked as e:
        # Other tests' threads in this process may open descriptors meanwhile (the checker rightly
        # reports those); what this test holds the checker to is that the socket closed soon is not one.
        assert held_target not in str(e)
    finally:
        close_it.set()
        t.join()
    assert held[0].fileno() == -1


class _CorruptingFp8Machine(Fp8EngineMachine):
    """An engine whose every commit leaves one layer on the bytes of another version."""

    def make_driver(self):
        d = super().make_driver()
        other = d.fresh(base_key(3, d.names)).kernel["model.norm.weight"]

        def corrupt(model) -> None:
            with torch.no_grad():
                model.model.norm.weight.copy_(other)

        register_post_update_hook(d.model, corrupt)
        return d


def test_the_machine_finds_an_engine_that_commits_a_mix() -> None:
    quick = settings(machine_settings(3, 4), phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(MixedVersionsServed, match=r"model\.norm\.weight holds v3"):
        run_state_machine_as_test(_CorruptingFp8Machine, settings=quick)
