"""Host memory kept across updates and handed out in slices: the delta passes' large outputs.

A delta update on CPU writes tens of megabytes of positions, old values and encodings. Fresh buffers of
that size cost their page faults on every update, and on a virtual machine's host (this project's CI
and benchmark machine) a first-touched page costs 2-30 us: measured there, decoding a 2% delta of a
0.6B model took 0.3-1 s into fresh buffers against 0.04 s into kept ones. An arena keeps one buffer, grown
to the largest update it served, so every later update writes memory that is already mapped.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["HostArena"]

_ALIGN = 64  # a cache line: slices of different threads never share one


class HostArena:
    """Slices of one kept host buffer for the outputs of one update at a time (thread-safe).

    :meth:`take` hands out the next free bytes, or a fresh array once the buffer is used up (counted,
    so that :meth:`reset` grows the buffer to hold the whole update next time). Slices are valid until
    :meth:`reset`, which the owner calls when the update that took them has ended. Memory: the largest
    update's outputs, kept until the arena is dropped.
    """

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self._used = 0
        self._overflow = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes the arena keeps."""
        return int(self._buf.nbytes)

    def take(self, n: int, dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized array of ``n`` elements of ``dtype``, valid until :meth:`reset`."""
        dtype = np.dtype(dtype)
        nbytes = (n * dtype.itemsize + _ALIGN - 1) // _ALIGN * _ALIGN
        with self._lock:
            at = self._used
            if at + nbytes > self._buf.nbytes:
                self._overflow += nbytes
                fresh = None
            else:
                self._used = at + nbytes
                fresh = self._buf[at : at + n * dtype.itemsize]
        if fresh is None:
            return np.empty(n, dtype=dtype)
        return fresh.view(dtype)

    def reset(self) -> None:
        """Every slice handed out is free again; a buffer an update outgrew is replaced by one that holds
        it all (a quarter more, so that a slightly larger next update fits too)."""
        with self._lock:
            if self._overflow:
                need = self._used + self._overflow
                self._buf = np.empty(0, dtype=np.uint8)  # the old buffer freed before the new one is made
                raw = np.empty(need + need // 4 + _ALIGN, dtype=np.uint8)
                skip = -raw.ctypes.data % _ALIGN
                self._buf = raw[skip : skip + need + need // 4]
            self._used = 0
            self._overflow = 0
