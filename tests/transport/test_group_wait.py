"""Control-plane waits on gloo works: block in slices, wake on completion, honour the deadline."""

from __future__ import annotations

from datetime import timedelta

import pytest

from weight_sync.errors import TransportTimeout
from weight_sync.transport.group import Deadline, wait_gloo


class _Work:
    """A gloo-like work: ``wait(timeout)`` raises "timed out" for ``slices`` calls, then completes."""

    def __init__(self, slices: int, error: str | None = None) -> None:
        self.slices, self.error, self.calls, self.done = slices, error, 0, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.calls += 1
        if self.done:  # a completed work returns (or raises) its result at once, with or without a timeout
            if self.error is not None:
                raise RuntimeError(self.error)
            return True
        assert timeout is not None and timeout.total_seconds() <= 0.05
        if self.error is not None:
            self.done = True
            raise RuntimeError(self.error)
        if self.calls <= self.slices:
            raise RuntimeError("Operation timed out!")
        self.done = True
        return True


def _never() -> BaseException:
    raise AssertionError("the deadline must not be reached")


def test_a_wait_resumes_after_timed_out_slices_until_the_work_completes() -> None:
    work = _Work(slices=3)
    assert wait_gloo(work, Deadline(10.0), _never) is True
    assert work.calls == 4


def test_a_completed_work_is_not_waited_for() -> None:
    work = _Work(slices=0)
    work.done = True
    assert wait_gloo(work, Deadline(10.0), _never) is False and work.calls == 0


def test_a_work_that_never_completes_raises_the_callers_timeout_at_the_deadline() -> None:
    class Stuck(_Work):
        def wait(self, timeout: timedelta | None = None) -> bool:
            self.calls += 1
            raise RuntimeError("Operation timed out!")

    with pytest.raises(TransportTimeout, match="gave up"):
        wait_gloo(Stuck(slices=0), Deadline(0.01), lambda: TransportTimeout("gave up"))


def test_a_failed_collective_propagates_its_error_instead_of_being_retried() -> None:
    work = _Work(slices=0, error="Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(RuntimeError, match="Connection closed"):
        wait_gloo(work, Deadline(10.0), _never)
    assert work.calls == 2  # the failing slice, then the completed work's own result


class _CompletesAsTheSliceEnds(_Work):
    """The slice times out, and the work completes before the waiter looks again (a loaded host)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done and timeout is not None:
            self.calls += 1
            self.done = True
            raise RuntimeError("Operation timed out!")
        return super().wait(timeout)


def test_a_work_completing_as_a_slice_times_out_counts_as_completed_not_timed_out() -> None:
    assert wait_gloo(_CompletesAsTheSliceEnds(slices=0), Deadline(10.0), _never) is True


def test_a_work_failing_as_a_slice_times_out_raises_its_own_error() -> None:
    work = _CompletesAsTheSliceEnds(slices=0, error="Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed"):
        wait_gloo(work, Deadline(10.0), _never)
