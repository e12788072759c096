"""Trainer-side clients: push weights into vLLM engines over weight_sync transports, reload, inspect.

A client pairs a :class:`~weight_sync.transport.WeightSender` (the data plane: gloo on CPU, nccl / ipc /
shm on GPU hosts, or disk) with an *engine control* (the control plane: one call per phase). Engine
controls exist for every way vLLM is driven:

- :class:`LLMControl` - an offline ``vllm.LLM`` in this process (its workers may be other processes);
- :class:`AsyncLLMControl` - an ``AsyncLLM`` whose event loop runs in another thread;
- :class:`HTTPControl` - an OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (its RL routes and
  ``/collective_rpc``);
- :class:`RayControl` - Ray actor handles of ``LLM`` / ``AsyncLLM`` (or anything with their methods).

Each engine phase blocks until the weights have crossed the transport, so the client issues it on a
helper thread while the sender runs its half on the calling thread, then joins both; the sender's error
wins, an engine that does not answer within ``rpc_timeout_s`` is reported as a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import torch

from weight_sync.errors import ConfigError, TransportError, TransportTimeout
from weight_sync.integrations.vllm.handoff import share_weights
from weight_sync.layers.blocks import order_by_block
from weight_sync.manifest import Manifest
from weight_sync.transport import TransferReport, TransportConfig, WeightSender

__all__ = [
    "AsyncLLMControl",
    "EngineControl",
    "HTTPControl",
    "LLMControl",
    "RayControl",
    "WeightSyncClient",
    "run_phase",
]

log = logging.getLogger(__name__)


class EngineControl(Protocol):
    """The control plane of one vLLM engine (all methods block until the engine has done the phase)."""

    #: whether weight spools written by this process are readable by the engine (same host)
    shares_host: bool

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def get_weight_version(self) -> str: ...

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]: ...


class LLMControl:
    """An offline ``vllm.LLM`` built with :func:`~weight_sync.integrations.vllm.engine_kwargs`."""

    shares_host = True

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.llm.collective_rpc(method, kwargs=kwargs)


class AsyncLLMControl:
    """An ``AsyncLLM`` whose event loop ``loop`` runs in another thread (as in a server process)."""

    shares_host = True

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, *, timeout_s: float | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.timeout_s = timeout_s

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def start_draft_weight_update(self) -> None:
        self._run(self.engine.start_draft_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))

    def get_weight_version(self) -> str:
        return self._run(self.engine.get_weight_version())

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, kwargs=kwargs))


class HTTPControl:
    """An OpenAI-compatible vLLM server in dev mode (``VLLM_SERVER_DEV_MODE=1``), by its base URL.

    ``shares_host``: whether the server runs on this host (iterator reloads are spooled to /dev/shm
    and only the spool's handle crosses HTTP; elsewhere reload from a path the server can read).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, shares_host: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.shares_host = shares_host

    def _request(self, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.base_url}/{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise TransportError(f"{method} {self.base_url}/{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError) as e:
            raise TransportError(f"{method} {self.base_url}/{path}: {e}") from e
        return json.loads(raw) if raw else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._request("start_draft_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._request("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def get_weight_version(self) -> str:
        return self._request("weight_info", method="GET")["weight_version"]

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        # The dev route forwards JSON values as they are; handles travel as JSON text to be safe.
        out = self._request("collective_rpc", {"method": method, "kwargs": kwargs or {}})
        return [] if out is None else out["results"]


class RayControl:
    """Ray actor handles of ``LLM`` (or objects with its methods); every call goes to every handle."""

    shares_host = False

    def __init__(self, handles: Any, *, timeout_s: float | None = None) -> None:
        self.handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        self.timeout_s = timeout_s

    def _all(self, call: Callable[[Any], Any]) -> list[Any]:
        import ray

        return ray.get([call(h) for h in self.handles], timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if len(self.handles) > 1:
            # Each engine's workers need their own ranks in the sender's group.
            raise TransportError(
                f"RayControl got {len(self.handles)} engines; connect one engine per control (each with its "
                "own rank_offset) or use trainers.RayRolloutClient with VLLMRolloutWorker actors"
            )
        self._all(lambda h: h.init_weight_transfer_engine.remote({"init_info": init_info}))

    def start_weight_update(self) -> None:
        self._all(lambda h: h.start_weight_update.remote())

    def start_draft_weight_update(self) -> None:
        self._all(lambda h: h.start_draft_weight_update.remote())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all(lambda h: h.update_weights.remote({"update_info": update_info}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda h: h.finish_weight_update.remote(weight_version))

    def get_weight_version(self) -> str:
        return self._all(lambda h: h.get_weight_version.remote())[0]

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [r for rs in self._all(lambda h: h.collective_rpc.remote(method, kwargs=kwargs)) for r in rs]


def _manifest_and_tensors(weights: Any, version: Any) -> tuple[Manifest, Any]:
    """A block-ordered manifest plus what to iterate for it, from a source, a mapping or pairs."""
    if hasattr(weights, "manifest") and callable(weights.manifest):
        return weights.manifest(version), weights  # e.g. trainers.ModuleSource: already in block order
    mapping: Mapping[str, torch.Tensor] = weights if isinstance(weights, Mapping) else dict(weights)
    names = order_by_block(list(mapping))
    manifest = Manifest.from_named_tensors(((n, mapping[n]) for n in names), version=version)
    return manifest, mapping


def run_phase(pool: ThreadPoolExecutor, rpc_timeout_s: float, phase: str,
              engine_call: Callable[[], Any], sender_call: Callable[[], Any]) -> Any:
    """One lifecycle phase: the engine's half on ``pool``'s thread, the sender's half here (both block
    until the other side takes part); the first failure is raised, and an engine that does not answer
    within ``rpc_timeout_s`` is a :class:`TransportTimeout` naming the phase."""

    def join(fut: Future) -> Any:
        try:
            return fut.result(timeout=rpc_timeout_s)
        except FutureTimeout:
            raise TransportTimeout(f"{phase}: the engine did not answer within {rpc_timeout_s:.0f} s") from None

    fut = pool.submit(engine_call)
    try:
        result = sender_call()
    except BaseException:
        try:
            join(fut)
        except Exception as engine_error:  # the engine agrees on the failure; the sender's error says why
            log.debug("%s: the engine failed as well: %s", phase, engine_error)
        raise
    join(fut)
    return result


class WeightSyncClient:
    """Push weights from this (trainer) process into one vLLM engine through a weight_sync transport.

    ``num_workers``: the engine's worker count (TP * PP * DP); each worker is one receiver.
    """

    def __init__(
        self,
        control: EngineControl,
        transport: TransportConfig | None = None,
        *,
        num_workers: int = 1,
        rpc_timeout_s: float | None = None,
    ) -> None:
        self.control = control
        self.transport = transport if transport is not None else TransportConfig(backend="gloo")
        self.num_workers = num_workers
        self.rpc_timeout_s = rpc_timeout_s if rpc_timeout_s is not None else 2 * self.transport.timeout_s
        self.sender: WeightSender | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-engine-rpc")

    # ------------------------------------------------------------------ plumbing
    def _phase(self, phase: str, engine_call: Callable[[], Any], sender_call: Callable[[], Any]) -> Any:
        return run_phase(self._pool, self.rpc_timeout_s, phase, engine_call, sender_call)

    def _sender(self) -> WeightSender:
        if self.sender is None:
            raise TransportError("WeightSyncClient: call connect() before pushing weights")
        return self.sender

    # ------------------------------------------------------------------ transfer
    def connect(self) -> None:
        """Create the sender and connect the engine's workers to it (vLLM's init_weight_transfer_engine)."""
        if self.sender is not None:
            self.sender.close()
        self.sender = WeightSender(self.transport, num_receivers=self.num_workers)
        init_info: dict[str, Any] = {"address": self.sender.address, "rank_offset": 1}
        if self.transport.backend == "disk":
            init_info["backend"] = "disk"
            self.control.init_weight_transfer_engine(init_info)
            self.sender.connect()
            return
        self._phase("init_weight_transfer_engine",
                    lambda: self.control.init_weight_transfer_engine(init_info), self.sender.connect)

    def push(self, weights: Any, *, version: int | str | None = None, draft: bool = False) -> TransferReport:
        """One whole update: the manifest, then the tensors, then an all-or-nothing commit.

        ``weights``: (name, tensor) pairs, a mapping, or a source with ``manifest(version)`` and
        ``__iter__`` in block order (``trainers.ModuleSource``). The engine's weight version becomes
        ``str(version)`` when given. ``draft=True`` updates the engine's speculative draft model instead
        (vLLM's ``start_draft_weight_update``): ``weights`` are then the drafter's, in its own names.
        """
        sender = self._sender()
        start = self.control.start_weight_update
        if draft:
            start_draft = getattr(self.control, "start_draft_weight_update", None)
            if not callable(start_draft):
                raise ConfigError(
                    f"WeightSyncClient.push(draft=True): the engine control {type(self.control).__name__} "
                    "needs vLLM's start_draft_weight_update() method, and has none"
                )
            start = start_draft
        manifest, tensors = _manifest_and_tensors(weights, version)
        weight_version = None if version is None else str(version)
        if sender.config.backend == "disk":
            sender.start_weight_update(manifest, version)
            sender.update_weights(tensors)
            report = sender.finish_weight_update()
            start()
            self.control.update_weights({})
            self.control.finish_weight_update(weight_version)
            return report
        self._phase("start_draft_weight_update" if draft else "start_weight_update", start,
                    lambda: sender.start_weight_update(manifest, version))
        self._phase("update_weights", lambda: self.control.update_weights({}),
                    lambda: sender.update_weights(tensors))
        return self._phase("finish_weight_update",
                           lambda: self.control.finish_weight_update(weight_version),
                           sender.finish_weight_update)

    # ------------------------------------------------------------------ reload and inspection
    def reload_weights(
        self,
        *,
        weights_path: str | None = None,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        **options: Any,
    ) -> list[dict[str, Any]]:
        """The engine's ``reload_weights`` (weight_sync's); returns every worker's update report."""
        kwargs: dict[str, Any] = dict(options)
        if weights_path is not None:
            kwargs["weights_path"] = str(weights_path)
        if weights_iterator is None or not isinstance(self.control, (HTTPControl, RayControl)):
            if weights_iterator is not None:
                kwargs["weights_iterator"] = weights_iterator
            return self.control.collective_rpc("reload_weights", kwargs)
        if not self.control.shares_host:
            raise TransportError(
                "reload_weights(weights_iterator=...) needs the engine on this host (the iterator is spooled "
                "to shared memory); push() the weights over a transport or reload from a path instead"
            )
        with share_weights(weights_iterator) as spool:
            kwargs["weights_iterator"] = json.dumps(spool.handle)
            return self.control.collective_rpc("reload_weights", kwargs)

    def fingerprint(self) -> list[str]:
        """Every worker's kernel fingerprint."""
        return self.control.collective_rpc("ws_fingerprint")

    def last_report(self) -> list[dict[str, Any] | None]:
        """Every worker's report of its last committed update."""
        return self.control.collective_rpc("ws_last_report")

    def status(self) -> list[dict[str, Any]]:
        """Every worker's ``{"torn", "version", "updating"}``."""
        return self.control.collective_rpc("ws_status")

    def weight_version(self) -> str:
        """The engine's committed weight version (vLLM's ``get_weight_version``)."""
        return self.control.get_weight_version()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

