"""Big copies of a replayed piece run on two streams and stay ordered with everything around them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync import Manifest, begin_update, record_metadata_for_reloading
from weight_sync.reload import replay
from weight_sync.reload.lanes import copy_pairs


def test_off_cuda_every_pair_is_copied() -> None:
    srcs = [torch.randn(5, 3) for _ in range(3)]
    dsts = [torch.empty(5, 3) for _ in range(3)]
    copy_pairs(list(zip(dsts, srcs)), -1)
    assert all(d.equal(s) for d, s in zip(dsts, srcs))


@pytest.mark.gpu
def test_copies_read_sources_made_just_before_and_finish_before_the_sources_are_reused() -> None:
    n = 8
    srcs = [torch.empty(4096, 4096, device="cuda") for _ in range(n)]
    dsts = [torch.empty_like(s) for s in srcs]
    x = torch.randn(4096, 4096, device="cuda")
    for s in srcs:
        torch.matmul(x, x, out=s)  # slow producers on the current stream, still running at the call
    expect = [s.clone() for s in srcs]
    copy_pairs(list(zip(dsts, srcs)), torch.cuda.current_device())
    for s in srcs:
        s.zero_()  # the caller reuses its buffers on the current stream as soon as the call returns
    torch.cuda.synchronize()
    assert all(d.equal(e) for d, e in zip(dsts, expect))


class _Wide(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1536, 1536, bias=False) for _ in range(n))  # 4.5 MB bf16: "big"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_replayed_update_failing_in_a_later_piece_rolls_back_the_pieces_copied_before(
    device: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    net = _Wide(260).to(device, torch.bfloat16)  # pieces of 128 and 132 keys: the first is written before the bad one
    record_metadata_for_reloading(net)

    def weights(seed: int) -> list[tuple[str, torch.Tensor]]:  # distinct per update and per key
        return [(k, torch.full(t.shape, seed + i / 256, dtype=torch.bfloat16, device=device))
                for i, (k, t) in enumerate(net.state_dict().items())]

    for seed in (1, 2):  # recorded, then replayed
        items = weights(seed)
        with begin_update(net, Manifest.from_named_tensors(items)) as s:
            s.load(items)
        assert all(net.state_dict()[k].equal(t) for k, t in items)
    before = {k: t.clone() for k, t in net.state_dict().items()}
    copied: list[int] = []

    def spy(pairs: list[tuple[torch.Tensor, torch.Tensor]], dev: int) -> None:
        copied.append(len(pairs))
        copy_pairs(pairs, dev)

    monkeypatch.setattr(replay, "copy_pairs", spy)
    items = weights(3)
    manifest = Manifest.from_named_tensors(items)
    items[-1] = (items[-1][0], items[-1][1][:, :-1])  # the last key arrives with the wrong shape
    s = begin_update(net, manifest, rollback=True)
    with pytest.raises(Exception, match=items[-1][0].replace(".", r"\.")):
        s.load(items)
    assert s.status == "aborted" and copied  # the replay wrote its first piece before the failure
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(net.state_dict()[k].equal(t) for k, t in before.items())
