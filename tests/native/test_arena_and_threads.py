"""The delta passes' kept host memory (HostArena) and their threads (native.threads, parallel_map)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from weight_sync import native
from weight_sync.errors import ConfigError
from weight_sync.native import HostArena


def test_an_arena_hands_out_disjoint_aligned_slices_of_one_kept_buffer_once_it_has_grown() -> None:
    arena = HostArena()
    first = [arena.take(1000, np.int64), arena.take(3, np.int16)]  # nothing kept yet: fresh arrays
    assert arena.nbytes == 0
    arena.reset()  # grows to hold what the last update took
    assert arena.nbytes >= 1000 * 8 + 3 * 2
    a, b = arena.take(1000, np.int64), arena.take(3, np.int16)
    assert (a.dtype, a.size, b.dtype, b.size) == (np.int64, 1000, np.int16, 3)
    assert a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0
    a[:] = 7
    b[:] = -1
    assert (a == 7).all(), "the slices must not overlap"
    kept = arena.nbytes
    arena.reset()
    c = arena.take(1000, np.int64)
    assert c.ctypes.data == a.ctypes.data and arena.nbytes == kept  # the same memory again, not regrown
    del first


def test_an_update_larger_than_the_arena_gets_fresh_arrays_and_the_next_reset_makes_room_for_it() -> None:
    arena = HostArena()
    arena.take(10, np.uint8)
    arena.reset()
    small = arena.nbytes
    over = arena.take(100_000, np.uint8)  # beyond the kept buffer: a fresh array, still usable
    over[:] = 1
    assert over.size == 100_000 and (over == 1).all()
    arena.reset()
    assert arena.nbytes >= 100_000 > small


def test_threads_reads_the_environment_and_refuses_what_is_not_a_positive_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.THREADS_ENV, "3")
    assert native.threads() == 3
    monkeypatch.delenv(native.THREADS_ENV)
    assert 1 <= native.threads() <= 8
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv(native.THREADS_ENV, bad)
        with pytest.raises(ConfigError, match=native.THREADS_ENV):
            native.threads()


@pytest.mark.parametrize("count", ["1", "2", "4"])
def test_parallel_map_keeps_the_order_and_runs_every_call_before_raising_the_first_error(
        monkeypatch: pytest.MonkeyPatch, count: str) -> None:
    monkeypatch.setenv(native.THREADS_ENV, count)
    big = native.PARALLEL_MIN_BYTES
    assert native.parallel_map(lambda x: x * x, list(range(50)), big) == [x * x for x in range(50)]
    ran: list[int] = []
    lock = threading.Lock()

    def job(x: int) -> int:
        with lock:
            ran.append(x)
        if x in (3, 7):
            raise ValueError(f"job {x}")
        return x

    with pytest.raises(ValueError, match="job 3"):
        native.parallel_map(job, list(range(10)), big)
    assert sorted(ran) == list(range(10)), "every call runs, so a caller can record what each one wrote"


def test_parallel_map_runs_small_work_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.THREADS_ENV, "4")
    me = threading.get_ident()
    assert set(native.parallel_map(lambda _: threading.get_ident(), list(range(8)), 1 << 20)) == {me}
    many = set(native.parallel_map(lambda _: threading.get_ident(), list(range(8)), native.PARALLEL_MIN_BYTES))
    assert me not in many
