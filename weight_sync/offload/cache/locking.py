"""POSIX ``flock`` locks: the per-layout publisher lock and the readers' shared entry lease.

``flock`` locks belong to an open file description and the kernel drops them when the last descriptor
closes, including when the process is killed with SIGKILL, so a crashed writer never leaves a lock
behind. Locks are advisory between cooperating processes; every cache participant goes through here.
Lock files are never deleted: deleting one while another process waits on it would let two processes
"hold" locks on different inodes of the same name.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path

from weight_sync.errors import CacheError

__all__ = [
    "LockTimeout",
    "acquire_exclusive",
    "release",
    "try_lock",
]

logger = logging.getLogger(__name__)

# Back-off bounds while polling a contended lock: flock has no timed wait, and a blocking flock cannot
# be interrupted portably from a non-main thread, so the wait polls with exponential back-off.
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.05


class LockTimeout(CacheError, TimeoutError):
    """A cache lock stayed held by another process past the caller's timeout."""


def try_lock(fd: int, *, shared: bool) -> bool:
    """Take a shared or exclusive flock on ``fd`` without blocking; False if another holder conflicts."""
    op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    try:
        fcntl.flock(fd, op)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def acquire_exclusive(path: Path, *, timeout_s: float, what: str) -> int:
    """Open (creating, 0600) and exclusively lock ``path``; return the descriptor that holds the lock.

    Raises :class:`LockTimeout` naming ``what`` and the timeout if another process holds it that long.
    """
    if timeout_s < 0:
        raise CacheError(f"lock timeout for {what} must be >= 0 s, got: {timeout_s}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        delay = _POLL_MIN_S
        while not try_lock(fd, shared=False):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockTimeout(
                    f"{what}: lock {path} still held by another process after {timeout_s:g} s "
                    f"(expected it to be released within the timeout)"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX_S)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    """Release a lock by closing its descriptor (closing drops the flock atomically)."""
    os.close(fd)
