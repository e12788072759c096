"""Topology discovery: declared plans, _layerwise_offload_blocks_attrs, the heuristic, resident layers."""

from __future__ import annotations

import pytest
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.offload import OffloadPlan, resolve_topology
from weight_sync.testing.dit import DiTConfig, SyntheticDiT, SyntheticDiTPipeline


class _TwoLists(nn.Module):
    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("dual", "single")}, offload_submodules={"encoder": "layers"},
    )

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.dual = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.transformer.single = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_declared_plan_gives_one_ring_per_dit_and_per_offloaded_submodule() -> None:
    topo = resolve_topology(_TwoLists())
    assert topo.source == "plan"
    assert [[n for n, _ in r.blocks] for r in topo.rings] == [
        ["transformer.dual.0", "transformer.dual.1", "transformer.single.0",
         "transformer.single.1", "transformer.single.2"],
        ["encoder.layers.0", "encoder.layers.1"],
    ]
    assert topo.owner_paths == ("transformer", "encoder")


def test_blocks_attrs_then_heuristic_without_a_plan() -> None:
    dit = SyntheticDiT(DiTConfig(num_blocks=3))
    topo = resolve_topology(dit)
    assert topo.source == "blocks_attrs"
    assert [n for n, _ in topo.rings[0].blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    seq = nn.Sequential()
    seq.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    seq.big = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    topo = resolve_topology(seq)
    assert topo.source == "heuristic"
    assert [n for n, _ in topo.rings[0].blocks] == ["big.0", "big.1"]


def test_a_model_without_blocks_is_rejected_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="found no transformer blocks"):
        resolve_topology(nn.Linear(3, 3))


def test_resident_layers_need_declared_resident_paths() -> None:
    with pytest.raises(ConfigError, match="declares none"):
        resolve_topology(SyntheticDiT(DiTConfig(num_blocks=3)), resident_layers=1)
    topo = resolve_topology(SyntheticDiTPipeline(DiTConfig(num_blocks=4)), resident_layers=1)
    assert [n for n, _ in topo.resident_blocks] == ["transformer.blocks.0"]
    assert len(topo.rings[0].blocks) == 3
    with pytest.raises(ConfigError, match="exceeds the 4 blocks"):
        resolve_topology(SyntheticDiTPipeline(DiTConfig(num_blocks=4)), resident_layers=5)


def test_fewer_than_two_streamable_blocks_stay_resident() -> None:
    topo = resolve_topology(SyntheticDiTPipeline(DiTConfig(num_blocks=3)), resident_layers=2)
    assert topo.rings == ()
    assert len(topo.resident_blocks) == 3


def test_invalid_plans_are_rejected() -> None:
    with pytest.raises(ConfigError, match="at least one DiT module"):
        OffloadPlan(block_attrs={})
    with pytest.raises(ConfigError, match="non-empty tuple"):
        OffloadPlan(block_attrs={"transformer": "blocks"})  # type: ignore[dict-item]
