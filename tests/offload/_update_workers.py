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


def transport_into_offloaded(rank: int, world: int, backend: str, dit: dict[str, Any],
                             quantization: str | None = None) -> dict[str, Any]:
    """Rank 0 sends B over ``backend``; rank 1 receives it into an offloaded (no-AllGather) A, its blocks
    quantized with ``quantization`` if given (the oracle is then B quantized the same way, resident)."""
    torch.set_num_threads(1)
    store = dist.distributed_c10d._get_default_store()
    b_pipe = _pipe(dit, 2)
    b = _weights(b_pipe)
    if quantization is not None:
        from weight_sync.quant.modules import quantize_linears

        for block in b_pipe.transformer.blocks:  # after _weights: the sender sends full precision
            quantize_linears(block, quantization)
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
        pipe, OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu",
                            quantization=quantization)
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


def quantized_allgather_update(rank: int, world: int, dit: dict[str, Any], name: str,
                               rollback: bool) -> dict[str, Any]:
    """dp=2 AllGather, blocks quantized with ``name``: reload B into offloaded A (no key list, then
    buckets with a manifest), compare with a fresh quantized offloaded B and the resident quantized B;
    then a killed update; then B again."""
    from weight_sync.quant.modules import quantize_linears

    torch.set_num_threads(1)
    config = OffloadConfig(enable_distributed_layerwise_offload=True, data_parallel_size=world, device="cpu",
                           quantization=name)

    def bf16(seed: int) -> SyntheticDiTPipeline:
        return _pipe(dit, seed).to(torch.bfloat16)

    b = _weights(bf16(2))
    ref = bf16(5)
    ref.transformer.load_state_dict(dict(b))
    for block in ref.transformer.blocks:
        quantize_linears(block, name)
    expected, fresh_fp = _out(ref, rank), weight_sync.fingerprint(ref.transformer)
    fresh = bf16(5)
    fresh.transformer.load_state_dict(dict(b))
    h = enable_layerwise_offload(fresh, config)
    fresh_shards = h.store.arena.clone()  # type: ignore[union-attr]
    fresh_out = _out(fresh, rank)
    h.disable()

    pipe = bf16(1)
    handle = enable_layerwise_offload(pipe, config)
    host_before = handle.metrics()["host_bytes"]
    a_out = _out(pipe, rank)
    # No key list: every layer is requantized at finish, each block's scratch held until then.
    reload_weights(pipe.transformer, weights_iterator=iter(b), version="b")
    m = handle.metrics()
    result: dict[str, Any] = {
        "differs_before": not torch.equal(a_out, expected),
        "shards_equal": torch.equal(handle.store.arena, fresh_shards),  # type: ignore[union-attr]
        "equal_resident": torch.equal(_out(pipe, rank), expected),
        "equal_offloaded": torch.equal(_out(pipe, rank), fresh_out),
        "fingerprint_equal": handle.fingerprint(pipe.transformer) == fresh_fp,
        "host_bytes": (host_before, m["host_bytes"]), "block_bytes": m["block_bytes"],
        "scratch_peak_no_keys": m["update_scratch_peak_bytes"],
        "largest_block": max(lay.padded_bytes for lay in handle.layouts),
        "all_blocks": sum(lay.padded_bytes for lay in handle.layouts),
    }
    # Buckets that split layers, with a manifest: blocks are written back as their last key arrives.
    a = _weights(bf16(1))
    with weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(a)) as s:
        for k in range(0, len(a), 5):
            s.load(a[k : k + 5])
    result["equal_a_after_buckets"] = torch.equal(_out(pipe, rank), a_out)
    with weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(b)) as s:
        for k in range(0, len(b), 5):
            s.load(b[k : k + 5])
    result["equal_after_buckets"] = torch.equal(_out(pipe, rank), expected)
    result["shards_equal_after_buckets"] = torch.equal(handle.store.arena, fresh_shards)  # type: ignore[union-attr]
    # A first update with a manifest, into a second offload: its scratch peak is its own.
    other = bf16(1)
    with enable_layerwise_offload(other, config) as h2:
        with weight_sync.begin_update(other.transformer, weight_sync.Manifest.from_named_tensors(b)) as s:
            for k in range(0, len(b), 5):
                s.load(b[k : k + 5])
        result["equal_first_buckets"] = torch.equal(_out(other, rank), expected)
        result["scratch_peak_buckets"] = h2.metrics()["update_scratch_peak_bytes"]
    try:
        reload_weights(pipe.transformer, weights_iterator=_failing(a, 20), rollback=rollback)
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
