"""StagedWeights on any module: updates land on the twin, the live model changes only at commit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.reload import (
    StagedWeights,
    StagingConfig,
    begin_update,
    record_metadata_for_reloading,
)


class Tiny(nn.Module):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, device=device)
        self.b = nn.Linear(3, 2, bias=False, device=device)


def _live(seed: int) -> Tiny:
    torch.manual_seed(seed)
    model = Tiny()
    record_metadata_for_reloading(model)
    items = list(model.state_dict().items())
    with begin_update(model, version="v1") as s:  # a first full update: the model's reference layout
        s.load(items)
    return model


def _new(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(Tiny().state_dict())


def test_the_live_model_keeps_its_bytes_until_the_commit_and_then_holds_the_staged_ones() -> None:
    live = _live(0)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    staging = StagedWeights(live, Tiny)
    assert staging.seeded and staging.committed_version == "v1"
    new = _new(1)
    with staging.begin_update(version="v2") as s:
        s.load(list(new.items()))
    assert staging.pending_version == "v2"
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())
    report = staging.commit()
    assert report is not None and report.version == "v2" and report.num_tensors == 3
    assert all(torch.equal(live.state_dict()[k], v) for k, v in new.items())
    assert staging.commit() is None and staging.pending_version is None


def test_a_twin_over_max_bytes_is_refused_naming_its_size() -> None:
    with pytest.raises(ConfigError, match=r"takes 84 bytes on cpu, over StagingConfig.max_bytes=83"):
        StagedWeights(_live(0), Tiny, config=StagingConfig(max_bytes=83))
    assert StagedWeights(_live(0), Tiny, config=StagingConfig(max_bytes=84)).num_bytes == 84


@pytest.mark.parametrize("kwargs, message", [
    ({"placement": "disk"}, "placement must be one of"),
    ({"max_bytes": -1}, "max_bytes must be None or an int >= 0"),
    ({"device_budget_bytes": 1.5}, "device_budget_bytes must be None or an int >= 0"),
])
def test_a_staging_config_out_of_range_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StagingConfig(**kwargs)


class Cast(nn.Module):
    """A layer processed after loading: its kernel weight is the loaded one cast to ``kernel_dtype``."""

    def __init__(self, kernel_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.kernel_dtype = kernel_dtype
        self.weight = nn.Parameter(torch.zeros(2, 4, device=device), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.weight = nn.Parameter(self.weight.data.to(self.kernel_dtype), requires_grad=False)


def test_a_staged_update_whose_kernel_layout_differs_from_the_live_model_fails_before_any_commit() -> None:
    live = Cast(torch.float16)
    record_metadata_for_reloading(live)
    with begin_update(live, version="v1") as s:
        s.load([("weight", torch.ones(2, 4))])
    staging = StagedWeights(live, lambda device: Cast(torch.bfloat16, device))
    assert not staging.seeded  # model format (float32) on the twin, float16 kernels on the live model
    session = staging.begin_update(version="v2")
    with pytest.raises(LayoutMismatchError, match=r"weight: live \(\(2, 4\), torch.float16\), staged "
                                                  r"\(\(2, 4\), torch.bfloat16\)"):
        session.load([("weight", torch.full((2, 4), 2.0))])
        session.finish()
    assert staging.pending_version is None and staging.commit() is None
    assert torch.equal(live.weight, torch.ones(2, 4, dtype=torch.float16))
