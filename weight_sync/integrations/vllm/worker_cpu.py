"""vLLM's CPU worker with weight_sync (``worker_cls`` for the CPU platform)."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from weight_sync.integrations.vllm.worker import WeightSyncWorkerMixin

__all__ = ["WeightSyncCPUWorker"]


class WeightSyncCPUWorker(WeightSyncWorkerMixin, CPUWorker):
    """CPUWorker whose ``reload_weights`` and weight-transfer updates run weight_sync."""
