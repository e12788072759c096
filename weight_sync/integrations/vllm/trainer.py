"""The trainer side of the ``weight_sync`` backend in vLLM's own trainer API.

vLLM 0.32 drives a weight sync from the trainer with ``WeightTransferTrainerFactory.trainer_init(init_info,
client=..., source=...)`` and ``engine.send_weights()``; the backend is chosen by the class of
``init_info``. Importing this module registers :class:`WeightSyncTrainerEngine` under ``"weight_sync"``,
so code written for vLLM's NCCL backend changes only its init info::

    from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightSyncTrainerInitInfo(world_size=world_size, rank=0, transport="gloo"),
        client=HTTPVLLMWeightSyncClient(base_url),  # or RayVLLMWeightSyncClient, or an LLM-like object
        source=ModuleSource(model),
    )
    engine.send_weights()

The trainer engine owns a :class:`~weight_sync.transport.WeightSender` (the data plane) and drives the
engine through ``client`` (the control plane: any object with vLLM's four ``VLLMWeightSyncClient``
methods). Each phase runs the engine's call on a helper thread and the sender's half here, because each
blocks until the other side has taken part; the sender's error wins, and an engine that does not answer
within ``2 * timeout_s`` is reported as a timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from weight_sync.errors import ConfigError, TransportError
from weight_sync.integrations.vllm.clients import run_phase
from weight_sync.manifest import Manifest, TensorMeta, dtype_to_str
from weight_sync.transport import TransferReport, TransportConfig, WeightSender
from weight_sync.transport.delta_sync import DeltaSender

__all__ = ["WeightSyncTrainerEngine", "WeightSyncTrainerInitInfo", "register_trainer_engine"]


BACKEND = "weight_sync"


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``weight_sync`` backend (vLLM's ``NCCLTrainerInitInfo`` fields plus
    the transport).

    world_size: the trainer's sender plus every engine worker (TP x PP x DP), as in vLLM.
    master_address / master_port: where the sender's rendezvous store listens (port 0: the OS picks one).
    transport: the weight_sync backend on the wire ('gloo' on CPU, 'nccl', 'ipc', 'shm').
    packed_buffer_size_bytes / packed_num_buffers: bucket size and buffer count (the worker is told, and
    checks them). packed: accepted for vLLM's signature; weight_sync's wire is always bucketed.
    timeout_s: bound on every blocking wait of the transport. checksum / zero_copy: as
    :class:`~weight_sync.transport.TransportConfig`. rank_offset: rank of the engine's first worker.
    delta / delta_base: delta sync (``TransportConfig(delta=True)``): from the second update on,
    ``send_weights`` ships each tensor's exact byte changes against the version every worker committed;
    the start header carries the base (vLLM's ``update_info`` stays empty for a delta), and a worker
    that does not hold that base refuses before any write, after which the same weights go in full.
    """

    backend: ClassVar[str] = BACKEND

    world_size: int
    master_address: str = "127.0.0.1"
    master_port: int = 0
    transport: str = "gloo"
    packed: bool = True
    packed_buffer_size_bytes: int = 64 << 20
    packed_num_buffers: int = 2
    timeout_s: float = 120.0
    checksum: bool = True
    zero_copy: bool = False
    rank_offset: int = 1
    delta: bool = False
    delta_base: str = "pinned"

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ConfigError(
                f"WeightSyncTrainerInitInfo world_size must count the trainer and at least one engine worker "
                f"(>= 2), got {self.world_size!r}"
            )
        if self.transport == "disk":
            raise ConfigError("WeightSyncTrainerInitInfo transport 'disk' is not driven by trainer_init; use "
                              "WeightSyncClient with TransportConfig(backend='disk')")

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            backend=self.transport, bucket_bytes=self.packed_buffer_size_bytes,
            num_buffers=self.packed_num_buffers, timeout_s=self.timeout_s, host=self.master_address,
            port=self.master_port, checksum=self.checksum and not self.zero_copy, zero_copy=self.zero_copy,
            delta=self.delta, delta_base=self.delta_base,
        )


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """vLLM's trainer engine over a weight_sync sender: full resyncs of a ``WeightSource``, or deltas
    (``WeightSyncTrainerInitInfo(delta=True)``).

    ``send_weights()`` is one update: the source's ``metadata()`` becomes the manifest (validated by every
    worker before any write), its iteration the data (checked against the manifest as it is sent), and
    the engine's ``update_weights`` call carries vLLM's ``names`` / ``dtype_names`` / ``shapes``
    description, which the workers check against the manifest too. Non-sender trainer ranks only iterate
    the source (their gathers are collectives the sender's iteration needs).
    """

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, init_info: WeightSyncTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.sender: WeightSender | None = None
        self.num_updates = 0
        self.last_report: TransferReport | None = None
        self._rpc_timeout_s = 2 * (init_info.timeout_s if init_info is not None else 120.0)
        # Delta sync: the base (what every worker last committed), driven phase by phase here.
        self.delta: DeltaSender | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-engine-rpc")

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightSyncTrainerEngine:
        if source is None:
            raise ConfigError("the weight_sync trainer engine sends full updates: trainer_init needs source=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        config = init_info.transport_config()
        sender = WeightSender(config, num_receivers=init_info.world_size - 1)
        engine.sender = sender
        if config.delta:
            engine.delta = DeltaSender(base=config.delta_base, chunk_elems=config.delta_chunk_elems)
        worker_info = {
            "address": sender.address, "rank_offset": init_info.rank_offset, "world_size": init_info.world_size,
            "packed": init_info.packed, "packed_buffer_size_bytes": init_info.packed_buffer_size_bytes,
            "packed_num_buffers": init_info.packed_num_buffers,
        }
        try:
            engine._phase("init_weight_transfer_engine",
                          lambda: client.init_weight_transfer_engine(worker_info), sender.connect)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _phase(self, phase: str, engine_call: Callable[[], Any], sender_call: Callable[[], Any]) -> Any:
        return run_phase(self._pool, self._rpc_timeout_s, phase, engine_call, sender_call)

    def send_weights(self, *, weight_version: str | None = None) -> None:
        """Push the source to every worker (start, one described call, finish). ``weight_version`` (an
        extension of vLLM's signature) becomes the engine's weight version."""
        assert self.source is not None  # trainer_init requires it
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        assert self.sender is not None, "trainer_init() connects the sender"
        sender = self.sender
        self.num_updates += 1
        version = self.num_updates
        manifest = Manifest(tuple(TensorMeta(m.name, m.dtype, tuple(m.shape)) for m in meta), version=version)
        update_info = {
            "names": [m.name for m in meta],
            "dtype_names": [dtype_to_str(m.dtype) for m in meta],
            "shapes": [list(m.shape) for m in meta],
        }
        client = self.client
        if self.delta is not None:
            self.last_report = self._send_delta(source, manifest, version, update_info, weight_version)
            return
        self._phase("start_weight_update", client.start_weight_update,
                    lambda: sender.start_weight_update(manifest, version))
        self._phase("update_weights", lambda: client.update_weights(update_info),
                    lambda: sender.update_weights(iter(source)))
        self.last_report = self._phase("finish_weight_update",
                                       lambda: client.finish_weight_update(weight_version),
                                       sender.finish_weight_update)

    def _send_delta(self, source: WeightSource, manifest: Manifest, version: int, update_info: dict[str, Any],
                    weight_version: str | None) -> TransferReport:
        """One update with delta sync over vLLM's three calls: encoded before start (the header names the
        base and the encoded sizes), sent in full when the workers refuse the base or there is none."""
        assert self.sender is not None and self.delta is not None
        sender, delta, client = self.sender, self.delta, self.client
        update = delta.begin(iter(source), manifest, version)
        try:
            self._phase("start_weight_update", client.start_weight_update,
                        lambda: sender.start_weight_update(manifest, version, delta=update.info))
        except TransportError as e:
            # vLLM ends its session when its start raises: the full update's start is a new one.
            update = delta.refused(update, e)
            self._phase("start_weight_update", client.start_weight_update,
                        lambda: sender.start_weight_update(manifest, version, delta=update.info))
        # A delta's tensors travel as encodings: the description of the model's tensors stays out.
        info = {} if update.info.get("mode") == "delta" else update_info
        self._phase("update_weights", lambda: client.update_weights(info), lambda: sender.update_weights(update.items()))
        report = self._phase("finish_weight_update", lambda: client.finish_weight_update(weight_version),
                             sender.finish_weight_update)
        return delta.committed(update, report)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def register_trainer_engine() -> None:
    """Register the trainer engine with vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, WeightSyncTrainerEngine)


register_trainer_engine()
