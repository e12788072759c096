"""Ray rollout workers: actors wrapping engines, and the trainer-side client that drives them.

The client owns the :class:`~weight_sync.transport.WeightSender`. Each phase is one RPC per actor,
issued before the sender enters the phase (the actor's call blocks in its receiver while the bytes
arrive over the transport), then the sender runs, then the actors' results are collected with a timeout.
Never one RPC per parameter: the data plane is the transport group, formed through the store the client
hosts at an address every actor can reach (its node IP, or 127.0.0.1 when all actors share its node).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch

from trainers.rollout import RolloutWorker, node_address
from weight_sync.errors import TransportError, TransportTimeout
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.transport import TransferReport, TransportConfig, WeightSender

__all__ = ["RayRolloutClient"]

log = logging.getLogger(__name__)


class RayRolloutClient:
    """Fan start/update/finish out to Ray rollout actors; ``launch`` creates the actors."""

    def __init__(self, workers: list[Any], transport: TransportConfig, *, rpc_timeout_s: float | None = None) -> None:
        if not workers:
            raise ValueError("RayRolloutClient needs at least one worker")
        self.workers = workers
        self.transport = transport
        self.rpc_timeout_s = rpc_timeout_s if rpc_timeout_s is not None else 2 * transport.timeout_s
        self.sender: WeightSender | None = None
        self._stores: list[Any] = []

    @classmethod
    def launch(
        cls,
        checkpoint: str,
        *,
        num_engines: int = 1,
        tp_size: int = 1,
        device: str = "cpu",
        quantization: Any = None,
        dtype: torch.dtype | None = None,
        transport: TransportConfig | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
    ) -> RayRolloutClient:
        """Create ``num_engines * tp_size`` RolloutWorker actors (TP workers of one engine form a group)."""
        import ray
        import torch.distributed as dist

        if not ray.is_initialized():
            raise TransportError("RayRolloutClient.launch needs ray.init() first")
        actor_cls = ray.remote(RolloutWorker)
        workers, stores = [], []
        for _ in range(num_engines):
            tp_address = None
            if tp_size > 1:
                store = dist.TCPStore("0.0.0.0", 0, None, is_master=True, timeout=timedelta(seconds=300),
                                      wait_for_workers=False)
                stores.append(store)
                tp_address = f"{node_address()}:{store.port}"
            for r in range(tp_size):
                workers.append(actor_cls.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(
                    checkpoint, device=device, dtype=dtype, quantization=quantization,
                    tp_rank=r, tp_size=tp_size, tp_address=tp_address,
                ))
        client = cls(workers, transport or TransportConfig(backend="gloo"))
        client._stores = stores
        return client

    # ------------------------------------------------------------------ plumbing
    def _get(self, refs: list[Any], phase: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.rpc_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TransportTimeout(f"{phase}: rollout workers did not answer within {self.rpc_timeout_s:.0f} s") from e
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise cause from None

    def _phase(self, phase: str, remote_calls: list[Any], local: Any) -> tuple[Any, list[Any]]:
        """Run ``local()`` (the sender's half) while the actors run theirs; raise the first failure."""
        try:
            result = local()
        except BaseException as local_error:
            try:
                self._get(remote_calls, phase)
            except Exception as remote_error:
                log.debug("%s: workers failed as well: %s", phase, remote_error)
            raise local_error
        return result, self._get(remote_calls, phase)

    # ------------------------------------------------------------------ lifecycle
    def init_weight_transfer(self, **receiver_options: Any) -> list[dict[str, Any]]:
        """Form the transport: host the store where the actors can reach it, connect everyone."""
        addresses = self._get([w.get_address.remote() for w in self.workers], "get_address")
        here = node_address()
        host = "127.0.0.1" if all(a["host"] == here for a in addresses) else here
        cfg = self.transport if self.transport.backend == "disk" else replace(self.transport, host=host)
        # A worker may host several receivers (a vLLM engine with TP > 1: one per worker process); each
        # worker gets the first of its consecutive ranks.
        sizes = [int(a.get("workers", 1)) for a in addresses]
        self.sender = WeightSender(cfg, num_receivers=sum(sizes))
        firsts = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        infos = [dict(receiver_options, address=self.sender.address, rank=r) for r in firsts]
        refs = [w.init_weight_transfer_engine.remote(info) for w, info in zip(self.workers, infos)]
        _, out = self._phase("init_weight_transfer_engine", refs, self.sender.connect)
        return out

    def _sender(self) -> WeightSender:
        if self.sender is None:
            raise TransportError("call init_weight_transfer() first")
        return self.sender

    def start_weight_update(self, manifest: Manifest | Iterable[TensorMeta], version: Any = None) -> Manifest:
        sender = self._sender()
        if sender.config.backend == "disk":
            return sender.start_weight_update(manifest, version)
        refs = [w.start_weight_update.remote() for w in self.workers]
        m, _ = self._phase("start_weight_update", refs, lambda: sender.start_weight_update(manifest, version))
        return m

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       names: Iterable[str] | None = None) -> int:
        sender = self._sender()
        if sender.config.backend == "disk":
            return sender.update_weights(named_tensors, names)
        refs = [w.update_weights.remote() for w in self.workers]
        n, _ = self._phase("update_weights", refs, lambda: sender.update_weights(named_tensors, names))
        return n

    def finish_weight_update(self) -> TransferReport:
        sender = self._sender()
        if sender.config.backend == "disk":
            report = sender.finish_weight_update()
            self._get([w.start_weight_update.remote(timeout_s=self.rpc_timeout_s) for w in self.workers],
                      "start_weight_update")
            self._get([w.update_weights.remote() for w in self.workers], "update_weights")
            receivers = self._get([w.finish_weight_update.remote() for w in self.workers], "finish_weight_update")
            return replace(report, receivers=_per_receiver(receivers))
        refs = [w.finish_weight_update.remote() for w in self.workers]
        report, _ = self._phase("finish_weight_update", refs, sender.finish_weight_update)
        return report

    def sync(self, source: Any, version: Any = None) -> TransferReport:
        """One whole update from a source with ``manifest()`` and ``__iter__`` (e.g. ModuleSource)."""
        self.start_weight_update(source.manifest(version), version)
        self.update_weights(source)
        return self.finish_weight_update()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker (vLLM's ``collective_rpc``); results in worker order."""
        return self._get([w.collective_rpc.remote(method, args, kwargs) for w in self.workers], f"collective_rpc({method})")

    def shutdown(self) -> None:
        import ray

        if self.sender is not None:
            self.sender.close()
            self.sender = None
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self._stores = []


def _per_receiver(answers: list[Any]) -> list[Any]:
    """Workers' finish answers, one per receiver: a worker hosting several (TP > 1) answers with a list."""
    out: list[Any] = []
    for a in answers:
        out.extend(a if isinstance(a, list) else [a])
    return out
