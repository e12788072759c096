"""A trainer rank or an engine rank killed in the middle of a sharded update: every other party raises
within twice the timeout, the engine ranks are rolled back (or torn, without rollback) and never serve a
mix, and the next update over a reconnected transport leaves every engine rank bitwise equal to a fresh load."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from pathlib import Path
from typing import Any

import pytest

from tests.transport import _sharded_ranks
from tests.transport._sharded_ranks import FAULT_TIMEOUT_S, fault_rank
from weight_sync.testing import make_checkpoint

WORLD = 4  # trainer ranks 0, 1; engine ranks 2, 3 (one engine, TP=2)


def _run(ckpt: str, victim: int) -> list[tuple]:
    """Run the four ranks, start the victim's replacement at round 2 once it died; every event, in order."""
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    inboxes = {r: ctx.Queue() for r in range(1, WORLD)}
    procs = {r: ctx.Process(target=fault_rank, args=(r, victim, 1, inboxes.get(r), events, ckpt), daemon=True)
             for r in range(WORLD)}
    for p in procs.values():
        p.start()
    seen: list[tuple] = []
    addresses: dict[int, str] = {}
    done: set[int] = set()
    replaced = False
    deadline = time.monotonic() + 240
    try:
        while len(done) < WORLD:
            assert time.monotonic() < deadline, f"ranks {sorted(set(range(WORLD)) - done)} never finished: {seen}"
            dead = [r for r, p in procs.items() if r not in done and not p.is_alive()]
            if dead == [victim] and not replaced and any(e[0] == "died" for e in seen):
                # The victim is gone: its replacement joins the reconnected transport (round 2).
                inbox = inboxes.get(victim)
                procs[victim] = ctx.Process(target=fault_rank, args=(victim, victim, 2, inbox, events, ckpt),
                                            daemon=True)
                procs[victim].start()
                replaced = True
                if 2 in addresses and inbox is not None:
                    inbox.put(("address", 2, addresses[2]))
            elif dead and any(r != victim or replaced for r in dead):
                raise AssertionError(f"ranks {dead} died: {seen}")
            try:
                ev = events.get(timeout=1.0)
            except queue.Empty:
                continue
            seen.append(ev)
            if ev[0] == "address":
                addresses[ev[1]] = ev[2]
                for r, box in inboxes.items():
                    if not (r == victim and ev[1] == 2 and not replaced):
                        box.put(ev)
            elif ev[0] == "done":
                done.add(ev[1])
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    return seen


@pytest.mark.parametrize("victim", [pytest.param(1, id="trainer-rank-1"), pytest.param(3, id="engine-rank-1")])
def test_a_rank_killed_mid_update_makes_every_party_raise_and_the_next_update_succeeds(tmp_path: Path,
                                                                                        victim: int) -> None:
    ckpt = str(make_checkpoint(tmp_path / "m", arch="qwen3", preset="tiny", tokenizer=False))
    seen = _run(ckpt, victim)
    died = [e[2] for e in seen if e[0] == "died"]
    assert len(died) == 1
    raised = {e[1]: e for e in seen if e[0] == "raised"}
    survivors = set(range(WORLD)) - {victim}
    assert set(raised) == survivors, seen
    for rank, (_, _, version, at, _, _, state) in raised.items():
        assert version == 2
        assert at - died[0] <= 2 * FAULT_TIMEOUT_S, (rank, at - died[0])
        if rank == 2:  # rollback=True: back to v1 bitwise
            assert state == {"torn": False, "rolled_back": True}
        elif rank == 3:  # no rollback: torn, refusing to serve
            assert state["torn"]
    committed = {(e[1], e[2]): e[3] for e in seen if e[0] == "committed"}
    for rank in range(WORLD):
        assert committed[(rank, 3)] == [], rank  # the next update after reconnecting, bitwise
    assert all(committed[(r, 1)] == [] for r in range(WORLD))
    assert _sharded_ranks.KILL_AFTER >= 1
