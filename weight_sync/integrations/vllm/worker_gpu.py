"""vLLM's GPU worker with weight_sync (``worker_cls`` for CUDA-like platforms)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from weight_sync.integrations.vllm.worker import WeightSyncWorkerMixin

__all__ = ["WeightSyncGPUWorker"]


class WeightSyncGPUWorker(WeightSyncWorkerMixin, Worker):
    """GPU Worker whose ``reload_weights`` and weight-transfer updates run weight_sync."""
