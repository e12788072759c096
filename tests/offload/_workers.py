"""Module-level rank functions for the multi-rank offload tests (spawned by ``run_distributed``)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from weight_sync.errors import ConfigError, TransportTimeout, WeightSyncError
from weight_sync.offload import (
    DenoiseRequest,
    OffloadConfig,
    enable_layerwise_offload,
    form_waves,
    run_wave,
)
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline, make_latents


def _models(dit: dict[str, Any], device: str = "cpu") -> tuple[SyntheticDiTPipeline, SyntheticDiTPipeline]:
    torch.manual_seed(0)  # every rank builds the same weights, as if loaded from one checkpoint
    ref = SyntheticDiTPipeline(DiTConfig(**dit)).eval().to(device)
    return ref, copy.deepcopy(ref)


def _config(world: int, device: str, **kw: Any) -> OffloadConfig:
    opts: dict[str, Any] = dict(enable_distributed_layerwise_offload=True, data_parallel_size=world, device=device)
    opts.update(kw)
    return OffloadConfig(**opts)


def _rank_device(rank: int, opts: dict[str, Any]) -> str:
    """This rank's device from ``opts['device']`` (popped): 'cpu', or its own GPU made current."""
    device = opts.pop("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    return device


def allgather_equal(rank: int, world: int, dit: dict[str, Any], opts: dict[str, Any], steps: int) -> dict[str, Any]:
    """Offloaded (AllGather) vs resident output on this rank, with metrics and the post-disable output."""
    torch.set_num_threads(1)
    device = _rank_device(rank, opts)
    ref, off = _models(dit, device)
    expected = ref.generate(tokens=24, num_inference_steps=steps, seed=rank)
    handle = enable_layerwise_offload(off, _config(world, device, **opts))
    out = off.generate(tokens=24, num_inference_steps=steps, seed=rank)
    metrics = handle.metrics()
    handle.disable()
    after = off.generate(tokens=24, num_inference_steps=steps, seed=rank)
    return {
        "equal": torch.equal(out, expected),
        "equal_after_disable": torch.equal(after, expected),
        "metrics": metrics,
    }


def mismatched_schedule(rank: int, world: int) -> str:
    """Rank 1 builds a wider model: every rank must fail at the digest check, before any gather."""
    torch.set_num_threads(1)
    _, off = _models({"num_blocks": 4, "hidden": 64 if rank == 0 else 96})
    try:
        enable_layerwise_offload(off, _config(world, "cpu"))
    except ConfigError as e:
        return str(e)
    return "no error"


def pin_failure_vote(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 cannot pin host memory; the vote must move both ranks to pageable shards."""
    torch.set_num_threads(1)
    import weight_sync.offload.handle as handle_mod
    from weight_sync.offload.pinned import PinError

    if rank == 1:
        def refuse(t: torch.Tensor, *, device: torch.device, read_only: bool = False) -> Any:
            raise PinError("injected: cannot page-lock memory on rank 1")

        handle_mod.register_region = refuse  # type: ignore[assignment]
    ref, off = _models({"num_blocks": 3})
    expected = ref.generate(tokens=16, num_inference_steps=2, seed=rank)
    handle = enable_layerwise_offload(off, _config(world, "cpu"))
    out = off.generate(tokens=16, num_inference_steps=2, seed=rank)
    m = handle.metrics()
    handle.disable()
    return {"equal": torch.equal(out, expected), "metrics": m}


def dp_wave(rank: int, world: int, steps_per_request: list[int | None]) -> dict[str, Any]:
    """Run one wave of ``world`` requests (one per rank) in lockstep; or report the rejection."""
    torch.set_num_threads(1)
    ref, off = _models({"num_blocks": 3})
    handle = enable_layerwise_offload(off, _config(world, "cpu"))
    requests = [
        DenoiseRequest(request_id=f"req{i}", num_inference_steps=s, seed=100 + i)
        for i, s in enumerate(steps_per_request)
    ]
    gathers_before = handle.metrics()["num_gathers"]
    try:
        waves = form_waves(requests, world)
    except ConfigError as e:
        return {"rejected": str(e), "gathers_before": gathers_before,
                "gathers_after": handle.metrics()["num_gathers"]}

    def run(req: DenoiseRequest | None, steps: int) -> torch.Tensor:
        seed = req.seed if req is not None else 0
        return off.generate(tokens=16, num_inference_steps=steps, seed=seed)

    results = [run_wave(w, dp_rank=handle.dp_rank, run=run) for w in waves]
    mine = results[0]
    assert mine is not None
    req = waves[0].request_for(handle.dp_rank)
    assert req is not None
    expected = ref.generate(tokens=16, num_inference_steps=waves[0].num_inference_steps, seed=req.seed)
    handle.disable()
    return {"rejected": "", "equal": torch.equal(mine, expected), "request": req.request_id}


def landing_equal(rank: int, world: int, dit: dict[str, Any], opts: dict[str, Any], steps: int) -> dict[str, Any]:
    """AllGather with landing buffers: outputs, metrics, and where every gather read from / wrote to."""
    torch.set_num_threads(1)
    import weight_sync.offload.submitter as submitter_mod

    device = _rank_device(rank, opts)
    gathers: list[tuple[int, int]] = []  # (input storage, output storage) of every block gather
    real_gather = submitter_mod.all_gather_bytes

    def recording(out: torch.Tensor, inp: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
        gathers.append((inp.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()))
        return real_gather(out, inp, group, async_op=async_op)

    submitter_mod.all_gather_bytes = recording  # type: ignore[assignment]
    ref, off = _models(dit, device)
    expected = ref.generate(tokens=24, num_inference_steps=steps, seed=rank)
    handle = enable_layerwise_offload(off, _config(world, device, dlo_landing_buffers=True, **opts))
    assert handle.streamer is not None
    slots = {s.untyped_storage().data_ptr() for s in handle.streamer.slots}
    landing = {b.untyped_storage().data_ptr() for b in handle.streamer.landing}
    weights_seen: set[int] = set()

    def record_weights(module: torch.nn.Module, args: Any) -> None:
        weights_seen.update(p.untyped_storage().data_ptr() for p in module.parameters())

    hooks = [b.register_forward_pre_hook(record_weights) for b in off.transformer.blocks]
    out = off.generate(tokens=24, num_inference_steps=steps, seed=rank)
    again = off.generate(tokens=24, num_inference_steps=steps, seed=rank)
    for h in hooks:
        h.remove()
    metrics = handle.metrics()
    handle.disable()  # restore loads: in place, into fresh per-block buffers (the slots still exist)
    after = off.generate(tokens=24, num_inference_steps=steps, seed=rank)
    # A gather into a slot streamed a block (the last prefetch may still have been in flight when the
    # metrics were read); any other gather restored one.
    streamed = [(i, o) for i, o in gathers if o in slots]
    restored = [(i, o) for i, o in gathers if o not in slots]
    return {
        "equal": torch.equal(out, expected) and torch.equal(again, expected),
        "equal_after_disable": torch.equal(after, expected),
        "metrics": metrics,
        "weights_only_in_slots": weights_seen == slots,
        "num_landing_buffers": len(landing),
        "streamed_gathers_out_of_place": all(i in landing for i, _ in streamed),
        "num_streamed_gathers": len(streamed),
        "restore_gathers_in_place": all(i == o for i, o in restored),
        "num_restore_gathers": len(restored),
    }


def mismatched_landing(rank: int, world: int) -> str:
    """Only rank 0 turns landing buffers on: every rank must fail at the digest check, before any gather."""
    torch.set_num_threads(1)
    _, off = _models({"num_blocks": 3})
    try:
        enable_layerwise_offload(off, _config(world, "cpu", dlo_landing_buffers=rank == 0))
    except ConfigError as e:
        return str(e)
    return "no error"


def landing_allocations(rank: int, world: int, dit: dict[str, Any]) -> dict[str, int]:
    """CUDA: device allocations of one offloaded forward with landing buffers vs one resident forward."""
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    ref, off = _models(dit, device)
    x = torch.randn(1, 256, ref.transformer.config.in_channels, device=device)
    t = torch.full((1,), 0.5, device=device)

    def allocations(fn: Any) -> int:
        fn()  # warm-up (kernels, workspaces, the communicator's first use)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.memory_stats()["allocation.all.allocated"] - before)

    with torch.no_grad():
        theirs = allocations(lambda: ref.transformer(x, t))
        handle = enable_layerwise_offload(off, _config(world, device, dlo_landing_buffers=True))
        ours = allocations(lambda: off.transformer(x, t))
        handle.disable()
    return {"ours": ours, "theirs": theirs}


def guarded_call(rank: int, world: int, steps_by_rank: list[int | None], tokens_by_rank: list[int]) -> dict[str, Any]:
    """Call the offloaded pipeline directly (no waves) with this rank's step count and token count.

    Reports the call's result or error, what it transferred, and whether a corrected call that every
    rank makes alike (2 steps, 16 tokens) and ``disable`` still work afterwards.
    """
    torch.set_num_threads(1)
    ref, off = _models({"num_blocks": 3})
    timeout_s = 30.0
    handle = enable_layerwise_offload(off, _config(world, "cpu", transfer_timeout_s=timeout_s))
    assert handle.streamer is not None
    latents = make_latents(batch=1, tokens=tokens_by_rank[rank], channels=16, seed=rank,
                           dtype=torch.float32, device="cpu")
    loads_before = handle.streamer.num_loads_issued
    result: dict[str, Any] = {"timeout_s": timeout_s, "error": ""}
    t0 = time.monotonic()
    try:
        out = off(latents, num_inference_steps=steps_by_rank[rank])
    except ConfigError as e:
        result["error"] = str(e)
        result["seconds"] = time.monotonic() - t0
        result["loads_queued"] = handle.streamer.num_loads_issued - loads_before
    else:
        result["equal"] = torch.equal(out, ref(latents, num_inference_steps=steps_by_rank[rank]))
    result["agreements"] = handle.metrics()["num_call_agreements"]
    same = make_latents(batch=1, tokens=16, seed=rank, channels=16, dtype=torch.float32, device="cpu")
    result["corrected_equal"] = torch.equal(off(same, num_inference_steps=2), ref(same, num_inference_steps=2))
    result["agreements_after_corrected"] = handle.metrics()["num_call_agreements"]
    handle.disable()
    result["equal_after_disable"] = torch.equal(off(same, num_inference_steps=2), ref(same, num_inference_steps=2))
    return result


def missing_peer_call(rank: int, world: int, calls_by_rank: list[int]) -> dict[str, Any]:
    """Each rank calls the offloaded transformer itself ``calls_by_rank[rank]`` times (a per-step loop).

    A rank that calls once more than its peers must get a timeout from the agreement, not a hang, with
    no load of that call queued; afterwards its guard refuses calls and ``disable`` without waiting.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    _, off = _models({"num_blocks": 3})
    timeout_s = 3.0
    handle = enable_layerwise_offload(off, _config(world, "cpu", transfer_timeout_s=timeout_s))
    assert handle.streamer is not None
    x = make_latents(batch=1, tokens=16, channels=16, seed=rank, dtype=torch.float32, device="cpu")
    t = torch.full((1,), 0.5)
    common = min(calls_by_rank)
    result: dict[str, Any] = {"timeout_s": timeout_s, "error": ""}
    with torch.no_grad():
        for _ in range(common):
            off.transformer(x, t)
        result["agreements"] = handle.metrics()["num_call_agreements"]
        loads_before = handle.streamer.num_loads_issued
        if calls_by_rank[rank] > common:
            t0 = time.monotonic()
            try:
                off.transformer(x, t)
            except TransportTimeout as e:
                result["error"] = str(e)
                result["seconds"] = time.monotonic() - t0
                result["loads_queued"] = handle.streamer.num_loads_issued - loads_before
                for retry in (lambda: off.transformer(x, t), handle.disable):
                    try:
                        retry()
                    except WeightSyncError as refused:
                        result.setdefault("refusals", []).append(str(refused))
    # The default group, not a sleep: every rank returns only once the timed-out rank has reported.
    dist.barrier()
    return result


def quantized_allgather_equal(
    rank: int, world: int, dit: dict[str, Any], name: str, steps: int, device: str = "cpu"
) -> dict[str, Any]:
    """AllGather with the block linears quantized as ``name``, against the resident quantized model.

    The oracle is built with ``weight_sync.quant`` alone: the same modules, every block ``nn.Linear``
    replaced by the registry's ``QuantizedLinear`` (quantized on the host, as DLO does), kept on the device.
    """
    from weight_sync.quant.modules import quantize_linears

    torch.set_num_threads(1)
    device = _rank_device(rank, {"device": device})
    torch.manual_seed(0)
    base = SyntheticDiTPipeline(DiTConfig(**dit)).to(torch.bfloat16).eval()
    dense_block_bytes = sum(p.numel() * p.element_size() for p in base.transformer.blocks.parameters())
    ref, off = copy.deepcopy(base), copy.deepcopy(base)
    for block in ref.transformer.blocks:
        quantize_linears(block, name)
    ref = ref.to(device)
    expected = ref.generate(tokens=16, num_inference_steps=steps, seed=rank)
    handle = enable_layerwise_offload(off, _config(world, device, quantization=name))
    out = off.generate(tokens=16, num_inference_steps=steps, seed=rank)
    metrics = handle.metrics()
    handle.disable()
    after = off.generate(tokens=16, num_inference_steps=steps, seed=rank)
    return {"equal": torch.equal(out, expected), "equal_after_disable": torch.equal(after, expected),
            "metrics": metrics, "dense_block_bytes": dense_block_bytes}


def mismatched_quantization(rank: int, world: int) -> str:
    """Rank 0 quantizes per tensor, rank 1 per channel: every rank fails at the digest, left unquantized."""
    torch.set_num_threads(1)
    _, off = _models({"num_blocks": 3})
    try:
        enable_layerwise_offload(off, _config(world, "cpu", quantization="fp8" if rank == 0 else "fp8_per_channel"))
    except ConfigError as e:
        linears = all(type(b.qkv) is torch.nn.Linear for b in off.transformer.blocks)
        return f"{e} | still nn.Linear: {linears}"
    return "no error"
