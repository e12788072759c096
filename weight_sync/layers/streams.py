"""A device/stream/event shim: real CUDA streams and events on GPU, no-ops with the same API on CPU.

Code that overlaps copies with compute (offload, transports) is written once against this interface and
tested on CPU, where every operation is synchronous and the ordering primitives have nothing to order.
Streams and events are created once by their owners and reused; nothing here allocates per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "DeviceShim",
    "Event",
    "Stream",
    "device_shim",
]


class Stream:
    """A CUDA stream, or a stand-in that runs everything immediately on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @property
    def raw(self) -> torch.cuda.Stream | None:
        return self._cuda

    def wait_event(self, event: Event) -> None:
        if self._cuda is not None and event._cuda is not None:
            self._cuda.wait_event(event._cuda)

    def wait_stream(self, other: Stream) -> None:
        if self._cuda is not None and other._cuda is not None:
            self._cuda.wait_stream(other._cuda)

    def synchronize(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize()

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Make this the current stream inside the block (no-op on CPU)."""
        if self._cuda is None:
            yield
        else:
            with torch.cuda.stream(self._cuda):
                yield


class _CurrentStream(Stream):
    """The stream that is current on the calling thread when the shim was made (the compute stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = torch.cuda.current_stream(device) if device.type == "cuda" else None


class Event:
    """A CUDA event, or a stand-in that is always complete on CPU."""

    def __init__(self, device: torch.device, *, timing: bool = False) -> None:
        self._cuda = (
            torch.cuda.Event(enable_timing=timing) if device.type == "cuda" else None
        )

    def record(self, stream: Stream | None = None) -> None:
        if self._cuda is not None:
            if stream is None or stream._cuda is None:
                self._cuda.record()
            else:
                self._cuda.record(stream._cuda)

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for this event without blocking the CPU."""
        if self._cuda is not None:
            if stream is None or stream._cuda is None:
                self._cuda.wait()
            else:
                self._cuda.wait(stream._cuda)

    def synchronize(self) -> None:
        """Block the CPU until the event completes (never on a hot path)."""
        if self._cuda is not None:
            self._cuda.synchronize()

    def query(self) -> bool:
        return True if self._cuda is None else bool(self._cuda.query())

    def elapsed_ms(self, end: Event) -> float:
        if self._cuda is None or end._cuda is None:
            return 0.0
        return float(self._cuda.elapsed_time(end._cuda))


class DeviceShim:
    """Factory for the streams and events of one device; ``is_cuda`` tells callers which world they are in."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def stream(self) -> Stream:
        return Stream(self.device)

    def current_stream(self) -> Stream:
        return _CurrentStream(self.device)

    def event(self, *, timing: bool = False) -> Event:
        return Event(self.device, timing=timing)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Return a pinned copy of a host tensor when a CUDA device will read it, else ``t`` itself."""
        return t.pin_memory() if self.is_cuda and not t.is_pinned() else t


def device_shim(device: torch.device | str) -> DeviceShim:
    """Return the shim for ``device`` ('cpu', 'cuda', 'cuda:1', ...)."""
    return DeviceShim(device)
