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
``llm.update_weights({"update_info": {}})``     receive one sender ``update_weights`` call (names, dtypes
                                                and shapes travel in the manifest, not in update_info)
``llm.finish_weight_update(weight_version=v)``  commit on every rank or none; the engine's version is set
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

    address: the sender's ``address`` ('host:port' of its rendezvous store, or the disk directory).
    rank_offset: rank of this engine's first worker in the sender's group (1 for a single engine; the
        trainer is rank 0). connect_timeout_s: how long to wait for the sender's store.
    """

    address: str
    rank_offset: int = 1
    connect_timeout_s: float = 300.0
    backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ConfigError(f"init_info address must be 'host:port' or a directory, got {self.address!r}")
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ConfigError(f"init_info rank_offset must be an int >= 1, got {self.rank_offset!r}")


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the weight_sync backend: nothing is needed (the manifest came first)."""


class _ModelTarget:
    """What a WeightReceiver updates: vLLM's top-level model.

    A receiver given a bare module would update ``module.model`` when it has one (the reference engine's
    convention), which for vLLM's ``*ForCausalLM`` is the inner decoder; this wrapper names the model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.last_report: Any = None

    def begin_update(self, manifest: Any, **options: Any) -> Any:
        return weight_sync.begin_update(self.model, manifest, **options)


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """Worker-side backend; created by vLLM's ``WeightTransferEngineFactory`` in every worker."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    # The receiver is bound to one model at connect time; draft models would need a second receiver.
    supports_draft_weight_update = False

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
        self.receiver = WeightReceiver(
            _ModelTarget(self.model),
            init_info.address,
            init_info.rank_offset + self.rank,
            rollback=self.options.rollback,
            budget_bytes=self.options.budget_bytes,
            fingerprint=False,  # the report's fingerprint is ours (KV caches excluded), added at finish
            connect_timeout_s=init_info.connect_timeout_s,
            backend=init_info.backend,
        )
        self.receiver.connect()

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
        self._receiver().update_weights()

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
    """Register the backend with vLLM's factory under ``"weight_sync"`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, WeightSyncTransferEngine)
