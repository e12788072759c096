"""``enable_layerwise_offload``: put a model's blocks on the host and stream them; the handle undoes it.

Order of work, chosen so that every failure that can be detected happens before the model is touched:
topology -> gather group -> (online quantization of the block linears, undone on any failure up to the
digest check) -> layouts -> schedule digest compared across ranks -> host store (pin, vote) -> then
mutation: non-block tensors to the device, block tensors re-pointed at the slots, hooks on.
With AllGather the call guard goes on last: from then on every call of the pipeline (and ``disable``)
is agreed by the gather group before it queues a load (``weight_sync.offload.call_guard``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.layers import DeviceShim, device_shim, get_submodule_path, repoint
from weight_sync.offload.call_guard import CallGuard
from weight_sync.offload.config import OffloadConfig
from weight_sync.offload.gather_group import GatherGroup, build_gather_group
from weight_sync.offload.host_store import (
    HostStore,
    InPlaceStore,
    PackedStore,
    StagedStore,
)
from weight_sync.offload.host_weights import HOST_WEIGHTS_ATTR, HostWeights
from weight_sync.offload.layout import BlockLayout, layout_block, schedule_digest
from weight_sync.offload.metrics import OffloadMetrics, Span, Trace
from weight_sync.offload.pinned import InPlacePins, PinError, register_region
from weight_sync.offload.plan import Topology, resolve_topology
from weight_sync.offload.quantize import BlockQuantization, declare_requantization, quantize_blocks
from weight_sync.offload.streamer import BlockStreamer
from weight_sync.offload.update import OffloadUpdater

__all__ = [
    "OffloadHandle",
    "enable_layerwise_offload",
]

logger = logging.getLogger(__name__)

_HANDLE_ATTR = "_weight_sync_offload_handle"


class OffloadHandle:
    """A live offload: ``metrics()``, ``trace()``, and ``disable()`` to restore the resident model."""

    def __init__(
        self, *, root: nn.Module, config: OffloadConfig, topology: Topology, layouts: list[BlockLayout],
        store: HostStore | None, streamer: BlockStreamer | None, gather: GatherGroup, shim: DeviceShim,
        metrics: OffloadMetrics, trace: Trace | None, guard: CallGuard | None = None,
    ) -> None:
        self.root, self.config, self.topology, self.layouts = root, config, topology, layouts
        self.store, self.streamer, self.gather, self.shim = store, streamer, gather, shim
        self._metrics, self._trace = metrics, trace
        self.guard = guard  # None unless blocks stream with an active gather group
        self.enabled = True
        self.updater = OffloadUpdater(self)  # weight updates into host storage (offload/update.py)

    @property
    def device(self) -> torch.device:
        return self.shim.device

    @property
    def dp_rank(self) -> int:
        """This rank's index in its gather group (its DP rank when the group is the DP group)."""
        return self.gather.rank

    def metrics(self) -> dict[str, Any]:
        """Counters: ``h2d_bytes``, ``fabric_bytes``, ``slot_bytes``, ``landing_bytes`` and more."""
        return self._metrics.as_dict()

    def trace(self) -> list[Span]:
        """The recorded timeline (``trace=True`` in the config); synchronizes the device once."""
        if self._trace is None:
            raise ConfigError("this offload was enabled with trace=False; enable it with trace=True")
        return self._trace.spans()

    def reset_trace(self) -> None:
        """Start the timeline afresh (e.g. after warm-up)."""
        if self._trace is None:
            raise ConfigError("this offload was enabled with trace=False; enable it with trace=True")
        self._trace.reset()

    def disable(self) -> None:
        """Restore the resident model: every streamed block gets its own device tensors again.

        With AllGather this is collective: every rank of the gather group must call it. The ranks
        first agree that they are all here and have issued the same loads, because the restore loads
        gather too and would otherwise pair one rank's block with another block of its peer.
        """
        if not self.enabled:
            return
        self.updater.remove()  # refuses while an update is open, before any collective
        if self.guard is not None:
            self.guard.agree("disable()", [])
            self.guard.remove()
        self.shim.synchronize()
        if self.streamer is not None:
            self.streamer.detach()
            for lay in self.layouts:
                size = lay.padded_bytes if self.gather.active else lay.nbytes
                buf = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
                self.streamer.load_into(lay.index, buf)
                for p in lay.placements:
                    repoint(p.tensor, p.view(buf))
            self.streamer.close()
        if self.store is not None:
            # Unregister pinned ranges before the memory (an mmap, an arena) can be released.
            self.store.close()
            self.store = None
        self._metrics.pinned_bytes = 0
        self.enabled = False
        if self.config.quantization is not None:
            # disable() keeps kernel format: the resident model stays quantized, and its updates must
            # still requantize once this offload's hook is gone.
            for path in ("", *self.topology.owner_paths):
                declare_requantization(get_submodule_path(self.root, path), strict=False)
        if getattr(self.root, _HANDLE_ATTR, None) is self:
            delattr(self.root, _HANDLE_ATTR)

    def fingerprint(self, module: nn.Module | None = None) -> str:
        """``weight_sync.fingerprint`` of ``module`` (default: the offloaded root) as it serves now.

        Equal to the fingerprint of the same module resident with the same weights: streamed blocks are
        loaded one at a time into one device buffer (gathered, with AllGather: collective, every rank of
        the gather group calls it) and checksummed there; everything else is checksummed where it is.
        """
        from weight_sync.offload.fingerprint import offload_fingerprint

        if not self.enabled:
            raise ConfigError("fingerprint(): this offload is disabled; use weight_sync.fingerprint(model)")
        if self.guard is not None:
            self.guard.agree("fingerprint()", [])
        return offload_fingerprint(self, self.root if module is None else module)

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()


def _host_weights_of(root: nn.Module, topology: Topology) -> HostWeights:
    for owner in topology.owner_paths:
        hw = getattr(get_submodule_path(root, owner), HOST_WEIGHTS_ATTR, None)
        if hw is not None:
            return hw
    return getattr(root, HOST_WEIGHTS_ATTR, None) or HostWeights("ordinary")


def _check_no_sharing(
    layouts: Sequence[BlockLayout], owners: Sequence[tuple[str, nn.Module]]
) -> None:
    where: dict[int, str] = {}
    for lay in layouts:
        for p in lay.placements:
            if id(p.tensor) in where:
                raise ConfigError(
                    f"{p.name} is the same tensor as {where[id(p.tensor)]}: a tensor shared between "
                    "streamed blocks cannot live in two slots; untie it or keep one block resident"
                )
            where[id(p.tensor)] = p.name
    prefixes = tuple(lay.name + "." for lay in layouts)
    for owner_path, owner in owners:
        named: list[tuple[str, torch.Tensor]] = list(owner.named_parameters(remove_duplicate=False))
        named += list(owner.named_buffers(remove_duplicate=False))
        for name, t in named:
            qual = f"{owner_path}.{name}" if owner_path else name
            if id(t) in where and not qual.startswith(prefixes):
                raise ConfigError(
                    f"{where[id(t)]} is also used outside the streamed blocks (as {qual!r}); a tensor "
                    "tied to a non-block module cannot stream"
                )


def _build_store(
    layouts: list[BlockLayout], sources: list[list[torch.Tensor]], *, config: OffloadConfig,
    gather: GatherGroup, shim: DeviceShim, host: HostWeights, metrics: OffloadMetrics,
    quant: BlockQuantization | None = None,
) -> HostStore:
    reasons: list[str] = []
    # With quantization the processor's output (weights, scales) is private memory of this process;
    # only the unprocessed tensors (biases, norms) may still be views of the mapping.
    mapped_bytes = None
    if quant is not None:
        mapped_bytes = sum(
            p.span_bytes for lay in layouts for p in lay.placements if id(p.tensor) not in quant.produced_ids
        ) if host.mapped else 0
    if gather.active or not host.mapped:
        # Private arena (AllGather: this rank's shards only), pinned unless that fails.
        shard = (gather.rank, gather.size) if gather.active else None
        offsets, sizes = PackedStore.arena_plan(layouts, alignment=config.alignment_bytes, shard=shard)
        arena = torch.zeros(max(offsets[-1] + sizes[-1], 1), dtype=torch.uint8)
        region, error = None, ""
        try:
            region = register_region(arena, device=shim.device)
        except PinError as e:
            error = str(e)
        # Every rank must copy the same way, or the gather group's transfers drift apart: the
        # decision to pin is a vote, and one rank's failure moves all ranks to pageable shards.
        if not gather.all_agree(region is not None):
            if region is not None:
                region.unregister()
                region = None
            reasons.append(
                f"[rank {gather.global_rank}] pinning the host arena failed on "
                f"{'this rank' if error else 'a peer'}{': ' + error if error else ''}; "
                "all ranks use pageable host memory"
            )
        store: HostStore = PackedStore(
            layouts, sources, arena=arena, region=region, alignment=config.alignment_bytes, shard=shard,
        )
    elif host.source == "checkpoint_mmap" and quant is None:
        storages = list({s.untyped_storage().data_ptr(): s for srcs in sources for s in srcs}.values())
        pins = InPlacePins(storages, device=shim.device, budget_bytes=config.resolved_pin_budget_bytes())
        store = None  # type: ignore[assignment]
        if pins.active:
            try:
                store = InPlaceStore(layouts, sources, pins)
            except ConfigError as e:
                pins.release()
                reasons.append(f"pin in place: {e}")
        else:
            reasons.append(f"pin in place: {pins.reason}")
        if store is None:
            store = StagedStore(layouts, sources, shim=shim, pinned=True, mapped=True)
    else:
        # Runtime cache: pageable mmap views, packed through two pinned staging buffers. Quantized blocks
        # of mapped host weights stage the same way: the store follows how the host weights were loaded
        # (bounded pinned memory: two staging buffers, not a model-sized arena); pinning in place does
        # not apply, the quantized bytes are not in the mapping.
        if quant is not None and host.source == "checkpoint_mmap" and config.resolved_pin_budget_bytes():
            reasons.append("pin in place: the quantized block bytes are processor output, not in the "
                           "mapped checkpoint; staging them through two pinned buffers")
        store = StagedStore(layouts, sources, shim=shim, pinned=True, mapped=True, mapped_bytes=mapped_bytes)
    if isinstance(store, StagedStore) and store.pin_error:
        reasons.append(f"staging buffers are pageable: {store.pin_error}")
    metrics.num_fallbacks += len(reasons)
    metrics.fallback_reasons += tuple(reasons)
    for r in reasons:
        logger.warning(r)
    return store


def _to_device(module: nn.Module, device: torch.device, skip: set[int], *, copy: bool) -> None:
    """Give every tensor of ``module`` not in ``skip`` device storage of its own.

    ``copy`` forces a private copy even when the tensor already is on ``device`` (a CPU "device" over
    an mmap'd checkpoint): resident weights must not depend on the mapping staying alive, and kernels
    see the allocator's alignment rather than a file offset's.
    """
    done: set[int] = set()
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for t in table.values():
                if t is None or id(t) in skip or id(t) in done:
                    continue
                done.add(id(t))
                if t.device != device or copy:
                    repoint(t, t.detach().to(device, copy=True))


def enable_layerwise_offload(
    module_or_pipeline: nn.Module,
    config: OffloadConfig | None = None,
    *,
    host_weights: HostWeights | None = None,
    **kwargs: Any,
) -> OffloadHandle:
    """Stream the transformer blocks of ``module_or_pipeline`` from host memory through two device slots.

    ``config`` (or keyword arguments mirroring the flags, e.g. ``enable_distributed_layerwise_offload=
    True, dlo_use_allgather=False``) must enable DLO. ``host_weights`` overrides what
    ``load_host_weights`` recorded on the module. With AllGather every rank of the gather group must call
    this (it compares schedules and votes), in the same order.
    """
    if config is None:
        config = OffloadConfig.from_kwargs(**kwargs)
    elif kwargs:
        raise ConfigError(f"pass either config or keyword options, not both (got {sorted(kwargs)})")
    if not config.enable_distributed_layerwise_offload:
        raise ConfigError(
            "enable_distributed_layerwise_offload is False in the config; set it to True "
            "(--enable-distributed-layerwise-offload) to enable DLO"
        )
    root = module_or_pipeline
    if getattr(root, _HANDLE_ATTR, None) is not None:
        raise ConfigError(f"{type(root).__name__} already has layerwise offload enabled; disable it first")
    shim = device_shim(config.resolved_device())
    topology = resolve_topology(root, resident_layers=config.dlo_resident_layers)
    gather = build_gather_group(config, shim.device)
    metrics = OffloadMetrics(gather_group_size=gather.size)
    host = host_weights or _host_weights_of(root, topology)
    metrics.host_weights_source = host.source
    metrics.num_fallbacks += host.num_fallbacks
    metrics.fallback_reasons += host.fallback_reasons

    streamed = topology.streamed_blocks
    quant = None
    if config.quantization is not None:
        # "Online at load": the block linears become kernel format from the host weights, before the
        # layouts are made, so the host store, the link and the slots only ever see quantized bytes.
        with torch.no_grad():
            quant = quantize_blocks([*streamed, *topology.resident_blocks], config.quantization)
        metrics.quantization = config.quantization
        metrics.num_quantized_linears = quant.num_linears
    try:
        layouts = [
            layout_block(i, name, block, alignment=config.alignment_bytes, group_size=gather.size)
            for i, (name, block) in enumerate(streamed)
        ]
        owners = [(p, get_submodule_path(root, p)) for p in topology.owner_paths]
        _check_no_sharing(layouts, owners)
        index_of = {name: i for i, (name, _) in enumerate(streamed)}
        rings = [[index_of[name] for name, _ in ring.blocks] for ring in topology.rings]
        # Before the first AllGather (and before any mutation): all ranks must share one schedule.
        landing = config.dlo_landing_buffers and gather.active  # inert with a group of one
        schedule = schedule_digest(layouts, rings, group_size=gather.size, alignment=config.alignment_bytes,
                                   landing_buffers=landing, quantization=quant.method if quant else None)
        gather.check_same_schedule(schedule)
    except BaseException:
        if quant is not None:
            quant.revert()  # the model is left as it was given
        raise
    metrics.num_streamed_blocks = len(layouts)
    metrics.num_resident_blocks = len(topology.resident_blocks)
    metrics.block_bytes = sum(lay.nbytes for lay in layouts)

    streamed_ids = {id(p.tensor) for lay in layouts for p in lay.placements}
    store: HostStore | None = None
    streamer: BlockStreamer | None = None
    trace = Trace(shim, config.trace_capacity) if config.trace else None
    if layouts:
        with torch.no_grad():
            sources = [[p.tensor.detach() for p in lay.placements] for lay in layouts]
            try:
                store = _build_store(
                    layouts, sources, config=config, gather=gather, shim=shim, host=host, metrics=metrics,
                    quant=quant,
                )
            except BaseException:
                if quant is not None:
                    quant.revert()
                raise
            del sources
            metrics.host_storage = store.kind
            metrics.host_bytes = store.host_bytes
            metrics.mapped_bytes = store.mapped_bytes
            metrics.pinned_bytes = store.pinned_bytes
            streamer = BlockStreamer(
                layouts=layouts, rings=rings, modules=[b for _, b in streamed], store=store,
                gather=gather, shim=shim, metrics=metrics, trace=trace,
                timeout_s=config.transfer_timeout_s, landing_buffers=landing,
            )
    if quant is not None:
        quant.commit()  # the host store holds the quantized bytes: the full-precision weights may go
    with torch.no_grad():
        for _, owner in owners:
            _to_device(owner, shim.device, streamed_ids, copy=host.mapped)
        for lay in layouts:
            for p, view in zip(lay.placements, streamer.views[lay.index][0] if streamer else ()):
                # Point at a slot right away so the loader's private host copy is released now; the
                # pre-hook re-points to the slot that actually holds the block before each forward.
                repoint(p.tensor, view)
        _move_loose_tensors(layouts, streamed, shim.device)
    guard = None
    if streamer is not None:
        streamer.attach()
        if gather.active:
            guard = _install_call_guard(root, topology, streamed, streamer, gather, schedule, metrics)
    handle = OffloadHandle(
        root=root, config=config, topology=topology, layouts=layouts, store=store, streamer=streamer,
        gather=gather, shim=shim, metrics=metrics, trace=trace, guard=guard,
    )
    setattr(root, _HANDLE_ATTR, handle)
    if streamer is not None or quant is not None:
        # begin_update on the root or on any DiT that owns a ring writes host storage (offload/update.py);
        # with quantization (streamed blocks or not) it requantizes.
        handle.updater.install([root, *(get_submodule_path(root, p) for p in topology.owner_paths)])
    logger.info(
        "[rank %d] DLO on %s: %d streamed / %d resident blocks, %s host storage (%s), group %d, "
        "slot %.1f MB, landing buffers %.1f MB",
        gather.global_rank, type(root).__name__, len(layouts), len(topology.resident_blocks),
        metrics.host_storage or "none", host.source, gather.size, metrics.slot_bytes / 1e6,
        metrics.num_landing_buffers_allocated * metrics.landing_bytes / 1e6,
    )
    return handle


def _install_call_guard(
    root: nn.Module, topology: Topology, streamed: Sequence[tuple[str, nn.Module]],
    streamer: BlockStreamer, gather: GatherGroup, schedule: bytes, metrics: OffloadMetrics,
) -> CallGuard:
    """Guard every entry a call can take: the root, each ring owner, each streamed block on its own."""
    plan = getattr(root, "_offload_plan", None)
    guard = CallGuard(
        gather=gather, schedule_digest=schedule, loads_issued=lambda: streamer.num_loads_issued,
        metrics=metrics, rank_local_args=plan.rank_local_args if plan is not None else (),
    )
    entries = [(type(root).__name__, root)]
    entries += [(p, get_submodule_path(root, p)) for p in topology.owner_paths if p]
    guard.install([*entries, *streamed])
    return guard


def _move_loose_tensors(
    layouts: Sequence[BlockLayout], streamed: Sequence[tuple[str, nn.Module]], device: torch.device
) -> None:
    """Plain tensor attributes of streamed blocks (not parameters or buffers) stay on the device."""
    for _, block in streamed:
        for mod in block.modules():
            for name, v in list(vars(mod).items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.device != device:
                    object.__setattr__(mod, name, v.to(device))
