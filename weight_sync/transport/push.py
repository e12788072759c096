"""Non-blocking pushes: start sending an update, keep working, ``wait()`` for its report later.

``push(sender, named_tensors, manifest, version)`` runs :meth:`WeightSender.send` on a thread of its own
and returns a :class:`PushHandle` at once; ``push_to_staging(staging, ...)`` does the same into an
in-process :class:`~weight_sync.reload.staged.StagedWeights` (the engine keeps generating and commits
the version between two of its steps). ``handle.done()`` says whether the push ended (either way);
``handle.wait()`` returns its report or re-raises its error in the caller's thread.
``push_client(client, weights, version=...)`` does it for a client with a blocking ``push`` (vLLM's
:class:`~weight_sync.integrations.vllm.WeightSyncClient`, whose engines then receive while they serve
their own way).

The tensors are read while the push runs: the caller must not change them until ``done()`` (e.g. the
next optimizer step), or pass ``snapshot=True`` to push copies (one more model's memory, made before
the call returns). One push at a time per sender: a WeightSender is a protocol state machine, not a
queue. On CUDA the push runs on a side stream of its own, so it overlaps the caller's kernels.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from weight_sync.errors import TransportTimeout, UpdateStateError
from weight_sync.manifest import Manifest, TensorMeta

if TYPE_CHECKING:
    from weight_sync.reload.staged import StagedWeights
    from weight_sync.transport.sender import TransferReport, WeightSender

__all__ = ["PushHandle", "push", "push_client", "push_to_staging"]

T = TypeVar("T")

# The push in flight on each sender (or staging twin), to refuse a second one.
_IN_FLIGHT: weakref.WeakKeyDictionary[Any, PushHandle[Any]] = weakref.WeakKeyDictionary()
_IN_FLIGHT_LOCK = threading.Lock()


class PushHandle(Generic[T]):
    """One push running on its own thread; ``wait()`` for its result, ``done()`` to poll."""

    def __init__(self, fn: Callable[[], T], *, version: Any, device: torch.device | None = None) -> None:
        self.version = version
        self._fn = fn
        self._device = device
        self._result: T | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"weight_sync-push-{version}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._device is not None and self._device.type == "cuda":
                # A stream of its own: the push overlaps the caller's work on the default stream.
                with torch.cuda.stream(torch.cuda.Stream(self._device)):
                    self._result = self._fn()
                    torch.cuda.current_stream(self._device).synchronize()
            else:
                self._result = self._fn()
        except BaseException as e:  # re-raised by wait() in the caller's thread
            self._error = e
        finally:
            self._fn = None  # type: ignore[assignment]  # let the tensors go
            self._t1 = time.perf_counter()
            self._finished.set()

    @property
    def seconds(self) -> float | None:
        """How long the push ran, start to end (None while it runs)."""
        return None if self._t1 is None else self._t1 - self._t0

    def done(self) -> bool:
        """Whether the push has ended (succeeded or failed); never blocks."""
        return self._finished.is_set()

    def wait(self, timeout_s: float | None = None) -> T:
        """Block until the push ends; return its report or raise its error.

        Raises TransportTimeout when ``timeout_s`` passes first (the push keeps running; wait again).
        """
        if not self._finished.wait(timeout_s):
            raise TransportTimeout(f"push of version {self.version!r} still running after {timeout_s} s")
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def _start(target: Any, version: Any, fn: Callable[[], T], device: torch.device | None) -> PushHandle[T]:
    """Start ``fn`` as the push to ``target``, unless another push to it is still running."""
    with _IN_FLIGHT_LOCK:
        running = _IN_FLIGHT.get(target)
        if running is not None and not running.done():
            raise UpdateStateError(
                f"push of version {version!r}: version {running.version!r} is still being pushed to this "
                f"{type(target).__name__}; wait() for it first"
            )
        handle = PushHandle(fn, version=version, device=device)
        _IN_FLIGHT[target] = handle
        return handle


def _materialize(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                 snapshot: bool) -> Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]:
    if not snapshot:
        return named_tensors
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    with torch.no_grad():
        return [(name, t.detach().clone()) for name, t in items]


def push(
    sender: WeightSender,
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    manifest: Manifest | Iterable[TensorMeta],
    version: Any = None,
    *,
    snapshot: bool = False,
) -> PushHandle[TransferReport]:
    """Start ``sender.send(named_tensors, manifest, version)`` and return at once (see the module
    docstring); the handle's ``wait()`` gives the TransferReport."""
    source = _materialize(named_tensors, snapshot)
    device = getattr(sender, "device", None)
    return _start(sender, version, lambda: sender.send(source, manifest, version=version),
                  device if isinstance(device, torch.device) else None)


def push_client(
    client: Any,
    weights: Any,
    *,
    version: Any = None,
    snapshot: bool = False,
    **options: Any,
) -> PushHandle[Any]:
    """Start ``client.push(weights, version=version, **options)`` and return at once; ``wait()`` gives
    what it returns (a TransferReport for vLLM's WeightSyncClient). ``weights`` as the client takes
    them; ``snapshot`` copies (name, tensor) pairs or a mapping first."""
    if not callable(getattr(client, "push", None)):
        raise TypeError(f"push_client needs a client with a push(weights, version=...) method, got "
                        f"{type(client).__name__}")
    source = _materialize(weights, snapshot) if snapshot else weights
    sender = getattr(client, "sender", None)
    device = getattr(sender, "device", None)
    return _start(client, version, lambda: client.push(source, version=version, **options),
                  device if isinstance(device, torch.device) else None)


def push_to_staging(
    staging: StagedWeights,
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    manifest: Manifest | Iterable[TensorMeta] | None,
    version: Any = None,
    *,
    snapshot: bool = False,
    **options: Any,
) -> PushHandle[Any]:
    """Stage an update on ``staging`` on a thread of its own (``begin_update`` / ``load`` / ``finish``
    with ``options``); the handle's ``wait()`` gives the twin's UpdateReport. The engine commits it."""
    source = _materialize(named_tensors, snapshot)

    def run() -> Any:
        items = source.items() if isinstance(source, Mapping) else source
        with staging.begin_update(manifest, version=version, **options) as session:
            session.load(items)
        return session.report

    return _start(staging, version, run, staging.device)
