"""RolloutWorker: one engine worker behind vLLM's method names, used directly or as a Ray actor.

The worker owns a :class:`~weight_sync.engine.ReferenceEngine` (a vLLM engine plugs in through the vLLM
integration) and a :class:`~weight_sync.transport.WeightReceiver`. Its public methods are the control
plane, one call per phase: ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, ``get_weight_version``, ``reload_weights``; ``collective_rpc(method, args,
kwargs)`` dispatches to them by name, so rollout code written against vLLM's ``collective_rpc`` runs
unchanged. The weights themselves never pass through these calls: they travel over the transport.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ConfigError, UpdateStateError
from weight_sync.transport import WeightReceiver
from weight_sync.transport.group import node_address

__all__ = ["RPC_METHODS", "RolloutWorker", "node_address"]

RPC_METHODS = (
    "finish_weight_update",
    "fingerprint",
    "generate",
    "get_address",
    "get_weight_version",
    "init_weight_transfer_engine",
    "receive_update",
    "reload_weights",
    "shutdown",
    "start_weight_update",
    "update_weights",
)


def _report_dict(report: Any) -> dict[str, Any]:
    return report.to_dict() if hasattr(report, "to_dict") else dict(report or {})


class RolloutWorker:
    """An engine worker. ``RolloutWorker(checkpoint, device=..., quantization=...)`` loads a reference
    engine; with ``tp_size > 1`` the workers of one engine first form a gloo/NCCL TP group through the
    store at ``tp_address`` ('host:port'). ``engine=`` wraps an engine built elsewhere instead.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        *,
        engine: Any = None,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        quantization: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_address: str | None = None,
        tp_backend: str | None = None,
    ) -> None:
        if (checkpoint is None) == (engine is None):
            raise ConfigError("RolloutWorker needs exactly one of checkpoint or engine")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        group = None
        if tp_size > 1:
            group = self._init_tp(tp_rank, tp_size, tp_address, tp_backend or ("nccl" if "cuda" in device else "gloo"))
            if "cuda" in device and ":" not in device:
                device = f"cuda:{torch.cuda.current_device()}"
        if engine is None:
            engine = ReferenceEngine.from_checkpoint(
                checkpoint, dtype=dtype, device=device, quantization=quantization, tp_group=group
            )
        self.engine = engine
        self.receiver: WeightReceiver | None = None

    @staticmethod
    def _init_tp(rank: int, size: int, address: str | None, backend: str) -> Any:
        import torch.distributed as dist

        if address is None:
            raise ConfigError(f"tp_size={size} needs tp_address='host:port' of a rendezvous store")
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=300))
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.PrefixStore("tp", store), rank=rank, world_size=size,
                                    timeout=timedelta(seconds=300))
        return dist.group.WORLD

    # ------------------------------------------------------------------ vLLM-style control plane
    def get_address(self) -> dict[str, Any]:
        """Where this worker runs: node IP, pid, device (the client places the rendezvous accordingly)."""
        return {"host": node_address(), "pid": os.getpid(), "device": str(self.engine.device),
                "tp_rank": self.tp_rank, "tp_size": self.tp_size}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Connect to the trainer's sender. init_info: address, rank, and optionally rollback,
        budget_bytes, allow_partial, connect_timeout_s."""
        if self.receiver is not None:
            self.receiver.close()
        opts = {k: init_info[k] for k in ("rollback", "budget_bytes", "allow_partial", "connect_timeout_s",
                                           "fingerprint", "backend") if k in init_info}
        self.receiver = WeightReceiver(self.engine, init_info["address"], int(init_info.get("rank", 1)), **opts)
        params = self.receiver.connect()
        return {"backend": params.backend if params else "disk", "rank": self.receiver.rank}

    def _recv(self) -> WeightReceiver:
        if self.receiver is None:
            raise UpdateStateError("init_weight_transfer_engine must be called before a weight update")
        return self.receiver

    def start_weight_update(self, timeout_s: float | None = None, **_: Any) -> dict[str, Any]:
        """Receive and validate the manifest; vLLM's options (e.g. is_checkpoint_format) are accepted."""
        manifest = self._recv().start_weight_update(timeout_s)
        return {"version": manifest.version, "num_tensors": len(manifest), "num_bytes": manifest.nbytes}

    def update_weights(self, update_info: dict[str, Any] | None = None) -> int:
        """Receive one sender call (its names come from the sender's announcement, not from here)."""
        return self._recv().update_weights()

    def finish_weight_update(self) -> dict[str, Any]:
        return _report_dict(self._recv().finish_weight_update())

    def receive_update(self, timeout_s: float | None = None) -> dict[str, Any]:
        """One whole update (start, every call, finish) as the trainer's sender drives it."""
        return _report_dict(self._recv().receive_update(timeout_s))

    def get_weight_version(self) -> Any:
        if self.receiver is not None and self.receiver.weight_version is not None:
            return self.receiver.weight_version
        report = getattr(self.engine, "last_report", None)
        return getattr(report, "version", None)

    def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None, **options: Any) -> dict[str, Any]:
        """Reload from a checkpoint directory or an iterable (vLLM's ``reload_weights``)."""
        return _report_dict(self.engine.reload_weights(weights_path=weights_path, weights_iterator=weights_iterator,
                                                       **options))

    def fingerprint(self) -> str:
        return self.engine.fingerprint()

    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int, **sampling: Any) -> list[list[int]]:
        """The engine's generate (sampling options such as temperature and seed pass through)."""
        return self.engine.generate(prompt_token_ids, max_new_tokens, **sampling)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Call ``method`` (one of RPC_METHODS, or a callable taking the worker first) like vLLM does."""
        kwargs = kwargs or {}
        if callable(method):
            return method(self, *args, **kwargs)
        if method not in RPC_METHODS:
            raise ValueError(f"collective_rpc: unknown method {method!r}; supported: {list(RPC_METHODS)}")
        return getattr(self, method)(*args, **kwargs)
