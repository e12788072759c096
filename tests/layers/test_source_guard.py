"""A replay's one-pass source checks accept exactly the tensors laid out as recorded, and its kept launch
tables are launched again only for sources at the same addresses, on the same stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync.layers import source_guard as sg
from weight_sync.layers.source_guard import (
    LaunchTables,
    guards_available,
    same_pointers,
    source_guard,
)


def _recorded() -> list[torch.Tensor]:
    return [torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(3), torch.zeros((), dtype=torch.int64),
            nn.Parameter(torch.randn(2, 2))]


def test_this_torch_offers_the_one_pass_check() -> None:
    # CI's torch and the device's both do; a torch that lost it would silently fall back to the slower
    # per-property checks, which this test makes visible.
    assert guards_available()


def test_a_guard_accepts_tensors_laid_out_as_recorded_wherever_they_live() -> None:
    recorded = _recorded()
    guard = source_guard(recorded)
    assert guard is not None
    elsewhere = [torch.empty(16, 8, dtype=torch.bfloat16)[4:8], torch.randn(3), torch.ones((), dtype=torch.int64),
                 nn.Parameter(torch.zeros(2, 2))]
    assert guard.check(recorded)
    assert guard.check(elsewhere)  # other storage, an offset view, other values: the same layout
    with torch.no_grad():
        assert guard.check(elsewhere)  # grad mode is not part of a tensor's layout


@pytest.mark.parametrize("change", ["dtype", "rows", "transposed", "one more dim", "strided", "subclass",
                                    "plain for a parameter", "requires_grad", "not a tensor", "meta device"])
def test_a_guard_refuses_any_other_layout(change: str) -> None:
    recorded = _recorded()
    guard = source_guard(recorded)
    assert guard is not None
    first = {
        "dtype": torch.randn(4, 8, dtype=torch.float16),
        "rows": torch.randn(3, 8, dtype=torch.bfloat16),
        "transposed": torch.randn(8, 4, dtype=torch.bfloat16),
        "one more dim": torch.randn(1, 4, 8, dtype=torch.bfloat16),
        "strided": torch.randn(4, 16, dtype=torch.bfloat16)[:, ::2],
        "subclass": torch.randn(4, 8, dtype=torch.bfloat16).as_subclass(_Sub),
        "plain for a parameter": None,
        "requires_grad": torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True),
        "not a tensor": 3,
        "meta device": torch.empty(4, 8, dtype=torch.bfloat16, device="meta"),
    }[change]
    checked: list = [first if first is not None else recorded[0], *recorded[1:]]
    if change == "plain for a parameter":
        checked[3] = torch.randn(2, 2, requires_grad=True)  # a plain tensor where a Parameter was
    assert not guard.check(checked)


class _Sub(torch.Tensor):
    pass


def test_a_guard_refuses_a_list_of_another_length() -> None:
    recorded = _recorded()
    guard = source_guard(recorded)
    assert guard is not None
    assert not guard.check(recorded[:-1])
    assert not guard.check([*recorded, recorded[0]])


def test_no_guard_is_made_for_non_contiguous_tensors_or_where_torch_offers_none(monkeypatch) -> None:
    assert source_guard([torch.randn(4, 8)[:, ::2]]) is None  # a pass must prove contiguity
    assert source_guard([]) is None
    monkeypatch.setattr(sg, "_tensor_guards", lambda tensors: (_ for _ in ()).throw(TypeError("no such API")))
    sg.guards_available.cache_clear()
    try:
        assert not guards_available()
        assert source_guard(_recorded()) is None
    finally:
        monkeypatch.undo()
        sg.guards_available.cache_clear()


def test_a_guard_whose_self_test_fails_is_never_used(monkeypatch) -> None:
    class Lenient:  # a guard that accepts everything: what a changed private API could turn into
        def check(self, *tensors: object) -> bool:
            return True

    monkeypatch.setattr(sg, "_tensor_guards", lambda tensors: Lenient())
    sg.guards_available.cache_clear()
    try:
        assert source_guard(_recorded()) is None
    finally:
        monkeypatch.undo()
        sg.guards_available.cache_clear()


def test_pointers_are_the_same_only_for_tensors_at_exactly_those_addresses() -> None:
    srcs = [torch.randn(4), torch.randn(8)]
    ptrs = [t.data_ptr() for t in srcs]
    assert same_pointers(srcs, ptrs)
    srcs[1].add_(1)  # new values, same memory
    assert same_pointers(srcs, ptrs)
    assert same_pointers([srcs[0].view(2, 2), srcs[1]], ptrs)  # another view of the same memory
    assert not same_pointers([srcs[0], srcs[1].clone()], ptrs)
    assert not same_pointers(srcs[:1], ptrs)


def test_launch_tables_are_never_reused_where_pointers_cannot_be_checked() -> None:
    tables = LaunchTables()
    srcs = [torch.randn(4), torch.randn(4)]
    tables.keep([t.data_ptr() for t in srcs], ("table",), torch.device("cpu"))
    assert not tables.reusable(srcs)  # host tensors: nothing is kept


@pytest.mark.gpu
def test_launch_tables_are_reused_only_for_the_same_addresses_on_the_same_stream() -> None:
    device = torch.device("cuda")
    srcs = [torch.randn(4, device=device), torch.randn(8, device=device)]
    assert same_pointers(srcs, [t.data_ptr() for t in srcs])
    tables = LaunchTables()
    assert not tables.reusable(srcs)  # nothing kept yet
    tables.keep([t.data_ptr() for t in srcs], ("table",), device)
    assert tables.reusable(srcs)
    srcs[1].add_(1)  # new values at the same addresses: the table still holds
    assert tables.reusable(srcs)
    assert not tables.reusable([srcs[0], torch.randn(8, device=device)])  # one source moved
    assert not tables.reusable(srcs[:1])
    with torch.cuda.stream(torch.cuda.Stream(device)):
        assert not tables.reusable(srcs)  # the kept table was copied in another stream's order
