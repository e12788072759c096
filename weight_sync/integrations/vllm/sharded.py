"""The sharded data plane inside vLLM: every worker of an engine is one engine rank of a ShardedReceiver.

A vLLM engine with ``tensor_parallel_size=n`` runs ``n`` worker processes, each holding its TP shard.
On the sharded plane (:mod:`weight_sync.transport.sharded`) each of them is an engine rank of its own:
it joins the trainer ranks' transport, announces the boxes its reload plan reads of every checkpoint
tensor (:func:`~weight_sync.transport.routes_layouts.needs_from_model`, fused layers included: a
``qkv_proj`` shard needs rows of q, k and v) and receives only those, from every trainer rank at once.
The update is one transaction over every engine rank of every engine connected to the transport.

The worker RPCs (``ws_sharded_connect`` / ``ws_sharded_update`` / ``ws_sharded_close``, see
:mod:`.worker`) call the functions here; one ``collective_rpc`` reaches every worker of the engine, so
they receive in parallel. ``ws_sharded_update`` is a whole update in one call (start, data, commit): the
engine core does not step during it, and the engine hooks treat it as a commit (caches reset, version
relabelled) or, when it fails, as a failed update (a torn model refuses requests).

Engine ranks: worker ``w`` of DP replica ``i`` is ``engine_rank_offset + i * world_size + w``, so engine
``j`` of ``k`` TP=n engines takes ``engine_rank_offset = j * n``.

Limitations: no draft-model updates on this plane; an update of vLLM's RL API (``start_weight_update``)
must not be open at the same time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from weight_sync.errors import ConfigError, UpdateStateError

__all__ = ["close_worker", "connect_worker", "receive_on_worker"]

log = logging.getLogger(__name__)

# The attribute of a vLLM worker that holds its ShardedReceiver.
_ATTR = "_ws_sharded_receiver"


def engine_rank_of(worker: Any, engine_rank_offset: int) -> int:
    """The engine rank the route plan knows ``worker`` by (see the module docstring)."""
    pc = worker.vllm_config.parallel_config
    return engine_rank_offset + pc.data_parallel_index * pc.world_size + pc.rank


def connect_worker(worker: Any, address: str, engine_rank_offset: int = 0, connect_timeout_s: float = 300.0,
                   rollback: bool | None = None) -> dict[str, Any]:
    """Join the sharded transport at ``address`` (trainer rank 0's store) as this worker's engine rank.

    Blocks until every rank of the transport joined (the trainer ranks connect at the same time).
    ``rollback``: whether a failed update restores the previous weights (default: the engine's option).
    """
    from weight_sync.integrations.vllm.options import WeightSyncOptions
    from weight_sync.transport.sharded_receiver import ShardedReceiver

    if not isinstance(engine_rank_offset, int) or isinstance(engine_rank_offset, bool) or engine_rank_offset < 0:
        raise ConfigError(f"engine_rank_offset must be an int >= 0, got {engine_rank_offset!r}")
    close_worker(worker)
    opts = WeightSyncOptions.from_vllm_config(worker.vllm_config) or WeightSyncOptions()
    rank = engine_rank_of(worker, engine_rank_offset)
    receiver = ShardedReceiver(
        worker.get_model(), address, rank,
        rollback=opts.rollback if rollback is None else rollback,
        budget_bytes=opts.budget_bytes,
        # The session's own fingerprint would hash KV caches; the report gets ours (kernel tensors only).
        fingerprint=False,
        connect_timeout_s=connect_timeout_s,
    )
    config = receiver.connect()
    setattr(worker, _ATTR, receiver)
    log.info("[rank %d] joined the sharded transport at %s as engine rank %d of %d", worker.rank, address, rank,
             config.num_engine_ranks)
    return {"engine_rank": rank, "tp_rank": worker.rank, "num_engine_ranks": config.num_engine_ranks,
            "backend": config.backend, "pid": os.getpid()}


def receive_on_worker(worker: Any, timeout_s: float | None = None) -> dict[str, Any]:
    """Run one whole sharded update on this worker, as the trainer ranks drive it; its summary.

    The summary: ``engine_rank``, ``version``, ``mode``, ``region_bytes`` (by trainer rank, as str keys:
    the bytes of regions received, which a TP rank's shard bounds), ``wire_bytes``, ``seconds`` and
    ``report`` (the update report, as ``ws_last_report`` returns it afterwards).
    """
    from vllm.config import set_current_vllm_config

    from weight_sync.integrations.vllm.model_hooks import kernel_fingerprint, record_report
    from weight_sync.integrations.vllm.options import WeightSyncOptions

    receiver = getattr(worker, _ATTR, None)
    if receiver is None:
        raise UpdateStateError(
            f"[rank {worker.rank}] ws_sharded_update: connect to the trainers' sharded transport first "
            "(ws_sharded_connect(address=...)); got no connection on this worker"
        )
    if getattr(worker, "_weight_update_active", False):
        raise UpdateStateError(
            f"[rank {worker.rank}] ws_sharded_update: an update of vLLM's RL API is open "
            "(start_weight_update without finish_weight_update); finish it first"
        )
    # Processing after loading (vLLM's process_weights_after_loading) reads the current vLLM config.
    with set_current_vllm_config(worker.vllm_config):
        report = receiver.receive_update(timeout_s)
    worker._ws_after_update()
    model = worker.get_model()
    opts = WeightSyncOptions.from_vllm_config(worker.vllm_config) or WeightSyncOptions()
    out = report.to_dict()
    out["fingerprint"] = kernel_fingerprint(model) if opts.fingerprint else None
    record_report(model, out)
    last = receiver.last_report
    log.info("[rank %d] sharded update %r committed: %d region bytes from %d trainer rank(s)", worker.rank,
             report.version, sum(last.region_bytes.values()), len(last.region_bytes))
    return {"engine_rank": receiver.rank, "version": report.version, "mode": last.mode,
            "region_bytes": {str(k): v for k, v in last.region_bytes.items()}, "wire_bytes": last.wire_bytes,
            "seconds": last.seconds, "report": out}


def close_worker(worker: Any) -> None:
    """Leave the sharded transport (local; nothing when the worker is not connected)."""
    receiver = getattr(worker, _ATTR, None)
    if receiver is not None:
        receiver.close()
        setattr(worker, _ATTR, None)
