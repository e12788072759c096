"""Liveness of the receivers: a heartbeat each one keeps in the sender's store, read only after a failure.

A collective that one rank never joins looks the same to the sender whichever rank it is: a gloo or NCCL
broadcast or all-gather does not say who is missing, and a killed peer's socket error names an address,
not a rank. So that a trainer whose engine died or was stopped mid-update learns *which* engine, every
receiver runs a daemon thread that increments its counter ``weight_sync/alive/<rank>`` in the sender's
rendezvous store every ``heartbeat_interval_s(timeout_s)`` (at most 1 s, a tenth of the timeout), over a
store connection of its own (the main thread's may be blocked in a wait). The thread stops with the
process, whether it was killed (SIGKILL), stopped (SIGSTOP) or closed its transport; it keeps running
while the engine's main thread computes, since the GIL is released between bytecodes and in every wait.

The sender reads the counters only when a wait failed (the hot path never touches the store): it reads
them twice, ``3`` intervals apart, and names every rank whose counter did not move as dead or stopped.
A receiver that closes marks itself closed (``weight_sync/closed/<rank>``) before its heartbeat stops:
when one engine dies, the others fail the update too and may close within that window, and they must
not be named with it. A rank that is alive but stuck (its main thread blocked) keeps beating and is not
named either; the failure then names every receiver, as the wait itself does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from weight_sync.errors import TransportError, TransportTimeout
from weight_sync.transport.group import Channel, join_store
from weight_sync.transport.wire import Hello

__all__ = ["Heartbeat", "heartbeat_interval_s", "naming_unresponsive", "unresponsive_ranks"]

log = logging.getLogger(__name__)

PREFIX = "weight_sync"
# Counters that did not move over this many intervals belong to a process that is not running: a live
# thread is late by a fraction of an interval even on a loaded host.
WINDOW_INTERVALS = 3


def heartbeat_interval_s(timeout_s: float) -> float:
    """How often a receiver beats: a tenth of the timeout, within [50 ms, 1 s], so that reading the
    counters after a failure (``WINDOW_INTERVALS`` of these) stays well inside the timeout."""
    return min(1.0, max(0.05, timeout_s / 10.0))


def _key(rank: int) -> str:
    return f"{PREFIX}/alive/{rank}"


def _closed_key(rank: int) -> str:
    return f"{PREFIX}/closed/{rank}"


class Heartbeat:
    """A receiver's heartbeat: a daemon thread incrementing its counter in the sender's store."""

    def __init__(self, address: str, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.interval_s = heartbeat_interval_s(timeout_s)
        self._store: Any = join_store(address, timeout_s)
        self._store.add(_key(rank), 1)  # counted from connect on, before the sender can need it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ws-heartbeat-rank{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(_key(self.rank), 1)
            except Exception as e:
                # The sender's store is gone, so is the sender: there is nobody left to tell.
                log.debug("[rank %d] heartbeat stopped: the sender's store is gone: %s", self.rank, e)
                return

    def stop(self) -> None:
        """Stop beating, at close: marked closed first, so that the sender does not take this receiver
        for a dead one."""
        try:
            self._store.set(_closed_key(self.rank), "1")
        except Exception as e:
            log.debug("[rank %d] cannot mark the heartbeat closed: the sender's store is gone: %s", self.rank, e)
        self._stop.set()
        self._thread.join(2 * self.interval_s)
        self._store = None


def unresponsive_ranks(store: Any, ranks: list[int], timeout_s: float) -> tuple[list[int], float]:
    """The ranks in ``ranks`` whose heartbeat did not advance over ``WINDOW_INTERVALS`` intervals,
    except those that closed their receiver.

    Returns (those ranks, the window in seconds). Blocks for the window: it is called only after a
    failure, to name the engine that caused it.
    """
    window_s = WINDOW_INTERVALS * heartbeat_interval_s(timeout_s)
    try:
        # add(key, 0) reads a counter (creating it at 0 for a rank that never beat) in one round trip.
        before = {r: store.add(_key(r), 0) for r in ranks}
        # An observation window, not a synchronization: whether a counter moves during it is the answer.
        time.sleep(window_s)
        after = {r: store.add(_key(r), 0) for r in ranks}
        stalled = [r for r in ranks if after[r] == before[r]]
        return [r for r in stalled if not store.check([_closed_key(r)])], window_s
    except Exception as e:
        log.warning("[rank 0] cannot read the receivers' heartbeats: %s", e)
        return [], window_s


@contextlib.contextmanager
def naming_unresponsive(channel: Channel | None, store: Any, peers: list[Hello], timeout_s: float) -> Iterator[None]:
    """Turn a communication failure of the wrapped call into a timeout naming the receivers that are gone.

    A collective one receiver never joins fails the same way whichever receiver it is (a timeout, or
    a socket error naming an address). When this call broke the channel, the receivers' heartbeats
    tell which processes stopped running (``peers[r - 1]`` is rank r); those are named, and the error
    is a ``TransportTimeout`` however the wait ended: for the caller a dead engine and a stopped one are
    the same, a peer that will not answer within the timeout.
    """
    was_broken = channel is None or channel.broken is not None
    try:
        yield
    except TransportError as e:
        if was_broken or channel is None or channel.broken is None or store is None:
            raise  # an agreed failure (the channel is fine), or one already diagnosed
        gone, window_s = unresponsive_ranks(store, list(range(1, len(peers) + 1)), timeout_s)
        if not gone:
            raise
        who = ", ".join(f"receiver {peers[r - 1].describe()}" for r in gone)
        raise TransportTimeout(
            f"{e}; {who}: no heartbeat within {window_s:.1f} s (the process is dead or stopped, or it "
            "closed its transport)"
        ) from e
