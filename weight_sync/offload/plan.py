"""Topology: which blocks of a model or pipeline stream, in which rings, and which stay resident.

A pipeline declares an :class:`OffloadPlan` as ``_offload_plan``. Without one, discovery uses the DiT
modules' ``_layerwise_offload_blocks_attrs`` and then a heuristic (the largest ModuleList of same-typed
blocks). Each DiT module and each offloaded submodule forms its own *ring*: the hook on a ring's last
block prefetches the ring's first block, which is what the next denoising step runs first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.layers import find_block_lists, get_submodule_path, largest_uniform_module_list

__all__ = [
    "OffloadPlan",
    "StreamRing",
    "Topology",
    "resolve_topology",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """A model's declared offload topology.

    ``block_attrs`` maps a DiT module attribute of the pipeline (``""`` for the root itself) to the paths
    of its block lists, in execution order: ``{"transformer": ("transformer_blocks",
    "single_transformer_blocks")}``. ``offload_submodules`` streams the block list of other components
    (``{"context_encoder": "layers"}``). ``resident_dit_paths`` names the block lists (relative to the
    root, e.g. ``"transformer.blocks"``) whose leading blocks ``--dlo-resident-layers`` may keep resident.
    ``rank_local_args`` names call arguments that are per-request data and may differ across the ranks of
    a gather group (an int ``seed``); the call guard records only that they were passed (see
    ``weight_sync.offload.call_guard``).
    """

    block_attrs: Mapping[str, tuple[str, ...]]
    offload_submodules: Mapping[str, str] = field(default_factory=dict)
    resident_dit_paths: tuple[str, ...] = ()
    rank_local_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.block_attrs:
            raise ConfigError("OffloadPlan.block_attrs must name at least one DiT module, got {}")
        for owner, attrs in self.block_attrs.items():
            if isinstance(attrs, str) or not attrs or not all(isinstance(a, str) and a for a in attrs):
                raise ConfigError(
                    f"OffloadPlan.block_attrs[{owner!r}] must be a non-empty tuple of attribute paths, "
                    f"got: {attrs!r}"
                )
        for owner, attr in self.offload_submodules.items():
            if not isinstance(attr, str) or not attr:
                raise ConfigError(
                    f"OffloadPlan.offload_submodules[{owner!r}] must be a block-list attribute path, "
                    f"got: {attr!r}"
                )
        for name in ("resident_dit_paths", "rank_local_args"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"OffloadPlan.{name} must be a tuple of strings, got the string {value!r}")


@dataclass(frozen=True)
class StreamRing:
    """Blocks that stream in a cycle: the last one prefetches the first."""

    owner_path: str  # module whose non-block tensors become resident ("" = the root)
    blocks: tuple[tuple[str, nn.Module], ...]  # (qualified name, block) in execution order


@dataclass(frozen=True)
class Topology:
    """What streams (rings), what stays resident, and where the discovery came from."""

    rings: tuple[StreamRing, ...]
    resident_blocks: tuple[tuple[str, nn.Module], ...]
    owner_paths: tuple[str, ...]  # modules whose non-block tensors live on the device
    source: str  # "plan", "blocks_attrs" or "heuristic"

    @property
    def streamed_blocks(self) -> list[tuple[str, nn.Module]]:
        return [b for ring in self.rings for b in ring.blocks]


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _plan_of(root: nn.Module) -> OffloadPlan | None:
    plan = getattr(root, "_offload_plan", None)
    if plan is not None and not isinstance(plan, OffloadPlan):
        raise ConfigError(
            f"{type(root).__name__}._offload_plan must be an OffloadPlan, got {type(plan).__name__}"
        )
    return plan


_RingLists = list[tuple[str, list[tuple[str, nn.ModuleList]]]]


def _rings_from_plan(root: nn.Module, plan: OffloadPlan) -> _RingLists:
    out: _RingLists = []
    for owner, attrs in plan.block_attrs.items():
        owner_mod = get_submodule_path(root, owner)
        lists = [(_join(owner, p), m) for p, m in find_block_lists(owner_mod, attrs)]
        out.append((owner, lists))
    for owner, attr in plan.offload_submodules.items():
        owner_mod = get_submodule_path(root, owner)
        lists = [(_join(owner, p), m) for p, m in find_block_lists(owner_mod, (attr,))]
        out.append((owner, lists))
    return out


def _dit_paths(root: nn.Module) -> list[str]:
    declared = getattr(root, "_dit_modules", None)
    if declared:
        return list(declared)
    transformer = getattr(root, "transformer", None)
    if isinstance(transformer, nn.Module):
        return ["transformer"]
    return [""]


def _discover(root: nn.Module) -> tuple[_RingLists, str]:
    out: _RingLists = []
    source = "blocks_attrs"
    for owner in _dit_paths(root):
        dit = get_submodule_path(root, owner)
        attrs = getattr(dit, "_layerwise_offload_blocks_attrs", None)
        if attrs:
            lists = [(_join(owner, p), m) for p, m in find_block_lists(dit, tuple(attrs))]
        else:
            source = "heuristic"
            found = largest_uniform_module_list(dit)
            lists = [] if found is None else [(_join(owner, found[0]), found[1])]
        if lists:
            out.append((owner, lists))
    return out, source


def resolve_topology(root: nn.Module, *, resident_layers: int = 0) -> Topology:
    """Find the streamed rings and resident blocks of ``root`` (a pipeline or a bare module)."""
    plan = _plan_of(root)
    if plan is not None:
        ring_lists, source = _rings_from_plan(root, plan), "plan"
    else:
        ring_lists, source = _discover(root)
    if not ring_lists:
        raise ConfigError(
            f"{type(root).__name__}: found no transformer blocks to offload; declare an OffloadPlan as "
            "_offload_plan or _layerwise_offload_blocks_attrs on the DiT module (the heuristic looks for "
            "a ModuleList of at least 2 same-typed blocks)"
        )
    resident_paths = plan.resident_dit_paths if plan is not None else ()
    if resident_layers and not resident_paths:
        raise ConfigError(
            f"dlo_resident_layers={resident_layers} needs a model OffloadPlan that declares eligible "
            f"resident_dit_paths; {type(root).__name__} declares none (discovery: {source})"
        )
    seen: set[int] = set()
    rings: list[StreamRing] = []
    resident: list[tuple[str, nn.Module]] = []
    for i, (owner, lists) in enumerate(ring_lists):
        blocks: list[tuple[str, nn.Module]] = []
        for list_path, mlist in lists:
            for j, block in enumerate(mlist):
                if id(block) in seen:
                    raise ConfigError(f"block {list_path}.{j} is listed twice in the offload topology")
                seen.add(id(block))
                blocks.append((f"{list_path}.{j}", block))
        if i == 0 and resident_layers:
            if resident_layers > len(blocks):
                raise ConfigError(
                    f"dlo_resident_layers={resident_layers} exceeds the {len(blocks)} blocks of the main "
                    f"DiT {owner or type(root).__name__!r}"
                )
            for name, _ in blocks[:resident_layers]:
                if not any(name.startswith(p + ".") for p in resident_paths):
                    raise ConfigError(
                        f"dlo_resident_layers={resident_layers} would keep block {name!r} resident, but "
                        f"it is not under a declared resident_dit_paths entry {list(resident_paths)}"
                    )
            resident.extend(blocks[:resident_layers])
            blocks = blocks[resident_layers:]
        if len(blocks) < 2:
            # One streamed block would prefetch itself into the other slot: no overlap, twice the
            # traffic. Keeping it resident costs one block of device memory and nothing else.
            logger.info("ring %r has %d streamable block(s); keeping them resident", owner, len(blocks))
            resident.extend(blocks)
            continue
        rings.append(StreamRing(owner, tuple(blocks)))
    owners = tuple(dict.fromkeys(owner for owner, _ in ring_lists))
    return Topology(tuple(rings), tuple(resident), owners, source)
