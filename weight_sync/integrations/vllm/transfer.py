"""The ``weight_sync`` weight-transfer backend: vLLM's RL API over weight_sync transports.

vLLM's worker keeps its own lifecycle methods and delegates each to the configured backend; this backend
maps them onto a :class:`~weight_sync.transport.WeightReceiver` feeding a weight_sync update session of the
worker's model:

==============================================  ==========================================================
``llm.init_weight_transfer_engine(init_info)``  connect to the trainer's :class:`WeightSender` at
                                                ``init_info["address"]`` as rank ``rank_offset`` + the
                                                worker's global rank (DP index * TP*PP + rank)
``llm.start_weight_update()``                   wait for the sender's manifest and validate it against the
                                                model (a bad one is refused on every rank before a write)
``llm.update_weights({"update_info": info})``   receive one sender ``update_weights`` call; names, dtypes
                                                and shapes travel in the manifest, and vLLM's ``names`` /
                                                ``dtype_names`` / ``shapes`` in ``info`` (optional) are
                                                checked against it and the call before any write
``llm.finish_weight_update(weight_version=v)``  commit on every rank or none; the engine's version is set
``llm.start_draft_weight_update()``             as ``start_weight_update``, for the speculative draft model:
                                                the session's manifest is validated against the drafter's
                                                plan, and the calls up to ``finish_weight_update`` write,
                                                report and version the drafter only
==============================================  ==========================================================

Every wait is bounded (``WeightSyncOptions.update_timeout_s`` for the manifest, the sender's timeout for
data), so a dead trainer is reported to the caller instead of hanging the engine. The trainer side is
:class:`~weight_sync.integrations.vllm.clients.WeightSyncClient` (or a bare ``WeightSender``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import weight_sync
from weight_sync.errors import ConfigError, UpdateStateError, WeightSyncError
from weight_sync.integrations.vllm.model_hooks import kernel_fingerprint, record_report
from weight_sync.integrations.vllm.options import WeightSyncOptions
from weight_sync.transport import WeightReceiver

__all__ = [
    "WeightSyncInitInfo",
    "WeightSyncTransferEngine",
    "WeightSyncUpdateInfo",
    "register_transfer_backend",
]

log = logging.getLogger(__name__)

BACKEND = "weight_sync"


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of the weight_sync backend (JSON-able: it crosses HTTP and process boundaries).

    weight_sync's own fields: ``address`` (the sender's 'host:port' rendezvous store, or the disk
    directory), ``rank_offset`` (rank of this engine's first worker in the sender's group; the trainer is
    rank 0), ``connect_timeout_s``, ``backend`` ('disk' to force the disk reader).

    vLLM's fields are accepted so that an ``init_info`` built for vLLM's NCCL or IPC backends works
    unchanged: ``master_address`` + ``master_port`` name the sender's store (the same as ``address``);
    ``world_size``, ``packed_buffer_size_bytes`` and ``packed_num_buffers`` are must-agree wire
    parameters in vLLM and are checked against the ones the sender decided (refused at connect, naming
    the field, when they differ); ``packed`` is accepted either way (weight_sync's wire is always
    bucketed, ``packed=False`` only changes how vLLM's own backends cut the stream).
    ``nccl_unique_id_b64`` is refused: weight_sync's groups rendezvous through the sender's store.
    """

    address: str | None = None
    rank_offset: int = 1
    connect_timeout_s: float = 300.0
    backend: str | None = None
    master_address: str | None = None
    master_port: int | None = None
    world_size: int | None = None
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None
    nccl_unique_id_b64: str | None = None

    def __post_init__(self) -> None:
        if self.nccl_unique_id_b64 is not None:
            raise ConfigError(
                "init_info nccl_unique_id_b64: the weight_sync backend rendezvous through its sender's store; "
                "pass address='host:port' (or master_address and master_port), got an NCCL unique id"
            )
        if (self.master_address is None) != (self.master_port is None):
            raise ConfigError(
                "init_info master_address and master_port go together, got "
                f"master_address={self.master_address!r}, master_port={self.master_port!r}"
            )
        if self.master_address is not None:
            if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
                raise ConfigError(f"init_info master_port must be a port number, got {self.master_port!r}")
            from_master = f"{self.master_address}:{self.master_port}"
            if self.address is not None and self.address != from_master:
                raise ConfigError(
                    f"init_info address {self.address!r} contradicts master_address:master_port {from_master!r}"
                )
            self.address = from_master
        if not isinstance(self.address, str) or not self.address:
            raise ConfigError(
                "init_info needs the sender's address ('host:port' or a directory; or master_address and "
                f"master_port), got address={self.address!r}"
            )
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ConfigError(f"init_info rank_offset must be an int >= 1, got {self.rank_offset!r}")
        for name in ("world_size", "packed_buffer_size_bytes", "packed_num_buffers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"init_info {name} must be a positive int, got {value!r}")

    def check_wire(self, params: Any) -> None:
        """Refuse vLLM wire parameters that contradict the ones the sender decided (``WireParams``)."""
        agree = (
            ("world_size", self.world_size, params.world_size, "trainer + engine workers in the sender's group"),
            ("packed_buffer_size_bytes", self.packed_buffer_size_bytes, params.bucket_bytes,
             "the sender's TransportConfig.bucket_bytes"),
            ("packed_num_buffers", self.packed_num_buffers, params.num_buffers,
             "the sender's TransportConfig.num_buffers"),
        )
        for name, given, decided, what in agree:
            if given is not None and given != decided:
                raise ConfigError(f"init_info {name}: the sender at {self.address} has {decided} ({what}), "
                                  f"init_info says {given}")


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the weight_sync backend; every field is optional.

    Names, dtypes and shapes travel in the manifest that ``start_weight_update`` received and validated.
    vLLM's backends describe each ``update_weights`` call (a chunk, or the whole model) with
    ``names`` / ``dtype_names`` / ``shapes``; when given they are checked against the manifest and
    against the tensors the sender's call carries, before any of them is written: agreeing, the call is
    received; contradicting, the call is refused on every rank naming the field. IPC's ``ipc_handles``,
    ``ipc_handles_pickled`` and ``tensor_sizes`` are accepted and not used (the data comes over the
    sender's transport; a pickled handle is never unpickled).
    """

    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    ipc_handles: Any = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if self.names is None:
            given = [n for n in ("dtype_names", "shapes", "tensor_sizes") if getattr(self, n) is not None]
            if given:
                raise ConfigError(f"update_info {given[0]} needs names (which tensor each entry describes)")
            return
        if not isinstance(self.names, list) or not all(isinstance(n, str) for n in self.names):
            raise ConfigError(f"update_info names must be a list of tensor names, got {self.names!r:.200}")
        for field_name in ("dtype_names", "shapes", "tensor_sizes"):
            value = getattr(self, field_name)
            if value is not None and len(value) != len(self.names):
                raise ConfigError(
                    f"update_info {field_name} must have one entry per name ({len(self.names)}), got {len(value)}"
                )

    def check_call(self, metas: Any) -> None:
        """Refuse this description unless it matches ``metas``: the tensors of the sender's call."""
        if self.names is None:
            return
        by_name = {m.name: m for m in metas}
        for i, name in enumerate(self.names):
            meta = by_name.get(name)
            if meta is None:
                carried = ", ".join(list(by_name)[:3]) + (", ..." if len(by_name) > 3 else "")
                raise ConfigError(
                    f"update_info names[{i}] {name!r}: the sender's update_weights call carries {len(by_name)} "
                    f"tensor(s) ({carried or 'none'}), not this one"
                )
            if self.dtype_names is not None:
                dtype = str(self.dtype_names[i]).removeprefix("torch.")
                if dtype != str(meta.dtype).removeprefix("torch."):
                    raise ConfigError(
                        f"update_info dtype_names[{i}] ({name}): the sender's manifest announces "
                        f"{str(meta.dtype).removeprefix('torch.')}, update_info says {dtype}"
                    )
            if self.shapes is not None and tuple(self.shapes[i]) != tuple(meta.shape):
                raise ConfigError(
                    f"update_info shapes[{i}] ({name}): the sender's manifest announces {tuple(meta.shape)}, "
                    f"update_info says {tuple(self.shapes[i])}"
                )
        if len(set(self.names)) != len(self.names):
            twice = next(n for n in self.names if self.names.count(n) > 1)
            raise ConfigError(f"update_info names lists {twice!r} twice")
        if len(self.names) != len(by_name):
            missing = [n for n in by_name if n not in set(self.names)]
            raise ConfigError(
                f"update_info names: the sender's update_weights call carries {len(by_name)} tensor(s), "
                f"update_info describes {len(self.names)}; not described: {missing[:3]}"
            )


def receive_described_call(receiver: WeightReceiver, info: WeightSyncUpdateInfo) -> int:
    """Receive one sender call, refusing it on every rank before any write if ``info`` contradicts it.

    The tensors of a call are known from its control header (a run of the manifest), which
    ``WeightReceiver.update_weights`` reads and acts on in one step; to check a description against the
    header before any bucket is loaded this reads the header itself and hands it to the receiver's
    protocol as a failing rank when the check fails (the same path ``abort_weight_update`` takes).
    """
    if info.names is None:
        return receiver.update_weights()
    manifest = receiver._manifest
    if receiver._disk is not None or manifest is None:
        # The disk reader loads the whole update at once: the description must be the manifest.
        try:
            info.check_call(manifest.tensors if manifest is not None else ())
        except Exception as e:
            receiver.abort_weight_update(e)
            raise
        return receiver.update_weights()
    receiver._require("open")
    header = receiver._next_header("update_weights")  # (the call its start header carried, if any)
    error: BaseException | None = None
    if header.kind == "call":
        try:
            info.check_call(manifest.tensors[header.first: header.first + header.count])
        except Exception as e:
            error = e
    return receiver._handle(header, "call", error)


class _ModelTarget:
    """What a WeightReceiver updates: the backend's current target, a top-level vLLM model.

    A receiver given a bare module would update ``module.model`` when it has one (the reference engine's
    convention), which for vLLM's ``*ForCausalLM`` is the inner decoder; this wrapper names the model.
    The target is read when each session begins, so a draft session (vLLM's worker retargets the
    backend first) is begun on the draft model, and the next session on the target model again.
    """

    def __init__(self, engine: WeightSyncTransferEngine) -> None:
        self.engine = engine
        self.last_report: Any = None

    @property
    def model(self) -> torch.nn.Module:
        # The backend's current target: vLLM retargets it at the draft model for a draft session.
        return self.engine.model

    def begin_update(self, manifest: Any, **options: Any) -> Any:
        return weight_sync.begin_update(self.engine.model, manifest, **options)


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """Worker-side backend; created by vLLM's ``WeightTransferEngineFactory`` in every worker."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    # One receiver serves both models: each update session is begun on the backend's current target
    # (``_ModelTarget``), which vLLM's worker points at the draft model for a draft session before
    # ``start_weight_update`` and back at the target model after it (``reset_weight_update_target``).
    # The session, its plan, validation, report and version belong to the model it was begun on.
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        opts = WeightSyncOptions.from_vllm_config(vllm_config)
        self.options = opts if opts is not None else WeightSyncOptions()
        self.receiver: WeightReceiver | None = None

    @property
    def rank(self) -> int:
        """This worker's rank among all workers of all DP replicas (0-based)."""
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        self.shutdown()
        assert init_info.address is not None  # __post_init__ resolved it
        self.receiver = WeightReceiver(
            _ModelTarget(self),
            init_info.address,
            init_info.rank_offset + self.rank,
            rollback=self.options.rollback,
            budget_bytes=self.options.budget_bytes,
            fingerprint=False,  # the report's fingerprint is ours (KV caches excluded), added at finish
            connect_timeout_s=init_info.connect_timeout_s,
            backend=init_info.backend,
        )
        params = self.receiver.connect()
        if params is not None:
            try:
                init_info.check_wire(params)
            except ConfigError:
                self.shutdown()
                raise

    def _receiver(self) -> WeightReceiver:
        if self.receiver is None:
            raise UpdateStateError(
                "weight_sync transfer: init_weight_transfer_engine(init_info={'address': ...}) must connect "
                "to the trainer's WeightSender before a weight update"
            )
        return self.receiver

    def start_weight_update(self) -> None:
        manifest = self._receiver().start_weight_update(timeout_s=self.options.update_timeout_s)
        log.info("[rank %d] weight update %r started: %d tensors, %.1f MB",
                 self.rank, manifest.version, len(manifest), manifest.nbytes / 1e6)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # No device-wide synchronize as vLLM's base does: the receiver's session copies synchronously
        # on CPU and orders its copies on the compute stream on GPU, and finish verifies before commit.
        try:
            info = self.parse_update_info(update_info or {})
        except Exception as e:
            # The sender is in this call already: fail it on every rank now (the agreed error names
            # ``e``) instead of leaving it to wait out its timeout with the session open.
            self._receiver().abort_weight_update(e)
            raise
        self.receive_weights(info)

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        receive_described_call(self._receiver(), update_info)

    def finish_weight_update(self) -> None:
        report = self._receiver().finish_weight_update()
        out = report.to_dict()
        out["fingerprint"] = kernel_fingerprint(self.model) if self.options.fingerprint else None
        record_report(self.model, out)
        log.info("[rank %d] weight update committed: %s", self.rank, report.summary())

    def reset_weight_update_target(self) -> None:
        """vLLM's worker calls this when it ends a session: after a commit, and inside its handler of any
        exception in ``start_weight_update`` / ``update_weights``. A receiver still open then has not
        taken the sender's pending call (the worker failed before reaching this backend); the update is
        ended on every rank with the worker's exception, so weight_sync's state follows vLLM's."""
        super().reset_weight_update_target()
        receiver = self.receiver
        if receiver is None or not receiver.is_open:
            return
        error = sys.exc_info()[1]
        if error is None:
            error = UpdateStateError("vLLM ended the weight update session while weight_sync's was open")
        try:
            receiver.abort_weight_update(error)
        except WeightSyncError as e:
            # Expected: the agreed failure of the call. vLLM re-raises the worker's own exception; this
            # one is what the sender raised too (and what a torn model reports in ws_status).
            log.error("[rank %d] weight update ended by vLLM: %s", self.rank, e)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def register_transfer_backend() -> None:
    """Register the backend under ``"weight_sync"`` with vLLM's worker factory and, for trainers, with
    ``WeightTransferTrainerFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from weight_sync.integrations.vllm.trainer import register_trainer_engine

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, WeightSyncTransferEngine)
    register_trainer_engine()
