"""Module-level rank functions for multi-process update tests of offloaded models (``run_distributed``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import weight_sync
from weight_sync.errors import SourceError, TornModelError
from weight_sync.offload import OffloadConfig, enable_layerwise_offload
from weight_sync.reload import reload_weights, torn_reason
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender


def _pipe(dit: dict[str, Any], seed: int) -> SyntheticDiTPipeline:
    torch.manual_seed(seed)
    return SyntheticDiTPipeline(DiTConfig(**dit)).eval()


def _out(pipe: SyntheticDiTPipeline, seed: int) -> torch.Tensor:
    return pipe.generate(tokens=12, num_inference_steps=3, seed=seed)


def _weights(pipe: SyntheticDiTPipeline) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.detach().clone()) for k, v in pipe.transformer.state_dict().items()]


def _failing(items: list[tuple[str, torch.Tensor]], after: int):
    for i, item in enumerate(items):
        if i == after:
            raise OSError("sender killed")
        yield item


def allgather_update(rank: int, world: int, dit: dict[str, Any], rollback: bool) -> dict[str, Any]:
    """dp=2 AllGather: reload B into offloaded A, compare; then a killed update; then B again."""
    torch.set_num_threads(1)
    config = OffloadConfig(enable_distributed_layerwise_offload=True, data_parallel_size=world, device="cpu")
    b_pipe = _pipe(dit, 2)
    b, expected = _weights(b_pipe), _out(b_pipe, rank)
    fresh_fp = weight_sync.fingerprint(b_pipe.transformer)
    fresh_off = _pipe(dit, 5)
    fresh_off.transformer.load_state_dict(dict(b))
    h = enable_layerwise_offload(fresh_off, config)
    fresh_off_out = _out(fresh_off, rank)
    h.disable()

    pipe = _pipe(dit, 1)
    handle = enable_layerwise_offload(pipe, config)
    host_before = handle.metrics()["host_bytes"]
    a_out = _out(pipe, rank)
    reload_weights(pipe.transformer, weights_iterator=iter(b), version="b")  # one tensor per load call
    after = _out(pipe, rank)
    m = handle.metrics()
    result: dict[str, Any] = {
        "differs_before": not torch.equal(a_out, expected),
        "equal_resident": torch.equal(after, expected),
        "equal_offloaded": torch.equal(after, fresh_off_out),
        "fingerprint_equal": handle.fingerprint(pipe.transformer) == fresh_fp,
        "host_bytes": (host_before, m["host_bytes"]), "block_bytes": m["block_bytes"],
        "scratch_peak": m["update_scratch_peak_bytes"],
        "largest_block": max(lay.padded_bytes for lay in handle.layouts),
    }
    # Whole buckets (lists) through the transaction API, as the transports load them.
    with weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(b)) as s:
        for k in range(0, len(b), 7):
            s.load(b[k : k + 7])
    result["equal_after_buckets"] = torch.equal(_out(pipe, rank), expected)
    a = _weights(_pipe(dit, 1))
    try:
        reload_weights(pipe.transformer, weights_iterator=_failing(a, 30), rollback=rollback)
        result["source_error"] = False
    except SourceError:
        result["source_error"] = True
    result["torn"] = torn_reason(pipe.transformer) is not None
    try:
        result["equal_after_failure"] = torch.equal(_out(pipe, rank), expected)
    except TornModelError:
        result["equal_after_failure"] = "refused"
    reload_weights(pipe.transformer, weights_iterator=iter(b))
    result["equal_after_recovery"] = torch.equal(_out(pipe, rank), expected)
    result["host_bytes_end"] = handle.metrics()["host_bytes"]
    handle.disable()
    return result


def transport_into_offloaded(rank: int, world: int, backend: str, dit: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 sends B over ``backend``; rank 1 receives it into an offloaded (no-AllGather) A."""
    torch.set_num_threads(1)
    store = dist.distributed_c10d._get_default_store()
    b_pipe = _pipe(dit, 2)
    b = _weights(b_pipe)
    if rank == 0:
        sender = WeightSender(TransportConfig(backend=backend, bucket_bytes=64 << 10, timeout_s=60.0),
                              num_receivers=1)
        store.set("address", sender.address)
        sender.connect()
        report = sender.send(b, weight_sync.Manifest.from_named_tensors(b), version=1)
        sender.close()
        return {"fingerprints": report.fingerprints}
    pipe = _pipe(dit, 1)
    handle = enable_layerwise_offload(
        pipe, OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu")
    )
    receiver = WeightReceiver(pipe.transformer, store.get("address").decode(), 1)
    receiver.connect()
    report = receiver.receive_update()
    out = {
        "equal": torch.equal(_out(pipe, 0), _out(b_pipe, 0)),
        "fingerprint": report.fingerprint,
        "fresh": weight_sync.fingerprint(b_pipe.transformer),
        "version": receiver.weight_version,
    }
    receiver.close()
    handle.disable()
    return out
