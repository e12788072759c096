"""The finish audit re-checks the begin walk by index and still sees every way a tensor can move."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from weight_sync import (
    PointerChangedError,
    UpdateStateError,
    begin_update,
    record_metadata_for_reloading,
)
from weight_sync.layers import signatures
from weight_sync.reload import audit_ahead, forget_audit
from weight_sync.reload.api import register_update_hook, unregister_update_hook
from weight_sync.reload.audit import take_baseline, verify_baseline


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2, bias=False)
        self.register_buffer("scale", torch.ones(4))
        self.layers[1].workspace = torch.zeros(8)  # a plain tensor attribute is graph-visible too


@pytest.fixture(autouse=True, params=["one pass", "field by field"])
def checks(request, monkeypatch) -> str:
    """The re-check compares layouts and pointers in one C++ pass each where torch offers it, else field
    by field: every test holds either way."""
    if request.param == "field by field":
        monkeypatch.setattr("weight_sync.reload.audit.guards_available", lambda: False)
    return request.param


def test_the_baseline_checks_in_one_pass_where_torch_offers_it(checks: str) -> None:
    assert (take_baseline(Net()).guard is not None) == (checks == "one pass")


def test_a_parameter_that_stops_requiring_grad_makes_the_next_begin_walk_and_still_loads(monkeypatch,
                                                                                        checks: str) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    walked = _walks(monkeypatch)
    with begin_update(net) as s:
        s.load(_weights(1))
    net.head.weight.requires_grad_(False)  # not part of a signature: the walk finds nothing moved
    with begin_update(net) as s:
        s.load(_weights(2))
    # The one-pass check refuses the kept baseline (stricter than a signature) and walks again; field by
    # field keeps it. Either way the update loads.
    assert walked == ([1, 1] if checks == "one pass" else [1])
    state = dict(net.state_dict())
    for name, t in _weights(2):
        assert state[name].equal(t), name


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=g)) for n, t in Net().state_dict().items()]


def test_the_baseline_has_exactly_the_signatures_of_the_full_walk() -> None:
    net = Net()
    net.tied = net.layers[2]  # a module reachable twice is walked once, under its first name
    assert take_baseline(net).signatures == signatures(net)


def _rebind_parameter(net: Net) -> None:
    net.layers[1].weight = nn.Parameter(net.layers[1].weight.detach().clone())


def _swap_storage(net: Net) -> None:
    net.layers[2].bias.data = torch.zeros(4)


def _resize_in_place(net: Net) -> None:
    net.scale.resize_(8)


def _replace_module(net: Net) -> None:
    net.layers[0] = nn.Linear(4, 4)


def _rebind_attribute(net: Net) -> None:
    net.layers[1].workspace = torch.zeros(8)


def _replace_top_module(net: Net) -> None:
    net.head = nn.Linear(4, 2, bias=False)


def _set_nested_parameter(net: Net) -> None:
    with torch.no_grad():
        net.layers[0].weight.set_(torch.zeros(4, 4))  # same object, same shape: only its storage moved


def _shadow_attribute(net: Net) -> None:
    net.layers[1]._parameters["workspace"] = nn.Parameter(torch.zeros(8))  # found before the attribute


@pytest.mark.parametrize("move", [_rebind_parameter, _swap_storage, _resize_in_place, _replace_module,
                                  _rebind_attribute, _replace_top_module, _set_nested_parameter,
                                  _shadow_attribute])
def test_a_tensor_moved_while_the_update_is_open_fails_the_finish(move: Callable[[Net], None]) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    session = begin_update(net)
    session.load(_weights(1))
    move(net)  # the caller's own code, between loads: nothing of weight_sync ran there
    with pytest.raises(PointerChangedError, match="changed during the update"):
        session.finish()
    assert session.status == "aborted"


def test_an_unchanged_model_passes_the_indexed_check_without_the_full_walk(monkeypatch) -> None:
    net = Net()
    base = take_baseline(net)
    for p in net.parameters():
        p.data.add_(1.0)  # values change in place: addresses do not
    walked: list[int] = []
    monkeypatch.setattr("weight_sync.reload.audit.verify_signatures", lambda *a: walked.append(1))
    verify_baseline(net, base)
    assert walked == []


def test_layers_exempted_as_first_processed_may_get_new_tensors() -> None:
    net = Net()
    base = take_baseline(net)
    net.layers[0] = nn.Linear(4, 4)
    verify_baseline(net, base, ("layers.0.",))
    with pytest.raises(PointerChangedError, match=r"layers\.0\.weight"):
        verify_baseline(net, base, ("layers.1.",))


def _add_attribute(net: Net) -> None:
    net.layers[0].extra = torch.zeros(2)


def _add_buffer(net: Net) -> None:
    net.head.register_buffer("bias_scale", torch.ones(2))


def _add_module(net: Net) -> None:
    net.layers.append(nn.Linear(4, 4))


def _walks(monkeypatch) -> list[int]:
    import weight_sync.reload.session as session_mod

    walked: list[int] = []
    real = session_mod.take_baseline

    def counting(model: nn.Module):
        walked.append(1)
        return real(model)

    monkeypatch.setattr(session_mod, "take_baseline", counting)
    return walked


def test_the_next_update_reuses_the_committed_baseline_instead_of_walking(monkeypatch) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    walked = _walks(monkeypatch)
    for seed in (1, 2, 3):
        with begin_update(net) as s:
            s.load(_weights(seed))
    assert walked == [1]  # the first begin walks; the later ones re-check what it found
    assert net.layers[2].weight.equal(dict(_weights(3))["layers.2.weight"])


def test_a_layer_replaced_between_updates_is_refused_at_begin_naming_it() -> None:
    net = Net()
    record_metadata_for_reloading(net)
    with begin_update(net) as s:
        s.load(_weights(1))
    _replace_module(net)
    with pytest.raises(UpdateStateError, match=r"layer 'layers\.0'.*found another Linear"):
        begin_update(net)
    with pytest.raises(UpdateStateError, match=r"layer 'layers\.0'"):
        begin_update(net)  # still refused: nothing was written, and the replacement is still there


@pytest.mark.parametrize("change", [_rebind_parameter, _swap_storage, _rebind_attribute,
                                    _add_attribute, _add_buffer, _add_module])
def test_a_change_between_updates_makes_the_next_begin_walk_and_load_into_the_new_tensors(
    monkeypatch, change: Callable[[Net], None],
) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    walked = _walks(monkeypatch)
    with begin_update(net) as s:
        s.load(_weights(1))
    change(net)  # the caller's code between updates
    with begin_update(net) as s:
        s.load(_weights(2))
    assert walked == [1, 1]
    state = dict(net.state_dict())
    for name, t in _weights(2):
        assert state[name].equal(t), name


def test_a_tensor_added_between_updates_is_audited_by_the_next_update() -> None:
    net = Net()
    record_metadata_for_reloading(net)
    with begin_update(net) as s:
        s.load(_weights(1))
    _add_attribute(net)
    session = begin_update(net)
    session.load(_weights(2))
    net.layers[0].extra = torch.zeros(2)  # rebound during this update: it must be in this baseline
    with pytest.raises(PointerChangedError, match=r"layers\.0\.extra"):
        session.finish()


def _rechecks(monkeypatch) -> list[int]:
    import weight_sync.reload.api as api_mod
    import weight_sync.reload.session as session_mod

    checked: list[int] = []
    real = session_mod.still_holds

    def counting(base, model: nn.Module) -> bool:
        checked.append(1)
        return real(base, model)

    monkeypatch.setattr(session_mod, "still_holds", counting)
    monkeypatch.setattr(api_mod, "still_holds", counting)
    return checked


def test_a_recheck_done_ahead_spares_the_next_begin_only(monkeypatch) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    with begin_update(net) as s:
        s.load(_weights(1))
    checked = _rechecks(monkeypatch)
    assert audit_ahead(net)
    with begin_update(net) as s:  # the verdict found ahead: no second re-check
        s.load(_weights(2))
    assert checked == [1]
    with begin_update(net) as s:  # used once: the next begin re-checks
        s.load(_weights(3))
    assert checked == [1, 1]
    state = dict(net.state_dict())
    for name, t in _weights(3):
        assert state[name].equal(t), name


def test_a_forgotten_verdict_lets_the_next_begin_find_a_change_and_load_into_the_new_tensors(monkeypatch) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    walked = _walks(monkeypatch)
    with begin_update(net) as s:
        s.load(_weights(1))
    assert audit_ahead(net)
    forget_audit(net)  # the receiver's start ended without a begin (a timeout, a refusal)
    _rebind_parameter(net)
    with begin_update(net) as s:
        s.load(_weights(2))
    assert walked == [1, 1]
    assert net.layers[1].weight.equal(dict(_weights(2))["layers.1.weight"])


def test_a_tensor_moved_after_the_recheck_ahead_fails_the_finish_instead_of_loading_stale_storage() -> None:
    net = Net()
    record_metadata_for_reloading(net)
    with begin_update(net) as s:
        s.load(_weights(1))
    assert audit_ahead(net)
    _rebind_parameter(net)  # another thread, between the check and the begin
    session = begin_update(net)
    session.load(_weights(2))
    with pytest.raises(PointerChangedError, match=r"layers\.1\.weight"):
        session.finish()
    assert session.status == "aborted"


def test_nothing_is_checked_ahead_without_a_committed_update_or_with_an_update_hook() -> None:
    net = Net()
    assert not audit_ahead(net)  # no reload state at all
    record_metadata_for_reloading(net)
    assert not audit_ahead(net)  # nothing committed yet
    with begin_update(net) as s:
        s.load(_weights(1))
    _rebind_parameter(net)
    assert not audit_ahead(net)  # the re-check fails: the begin walks
    with begin_update(net) as s:
        s.load(_weights(2))

    class Hook:
        def before_begin(self, model: nn.Module) -> None: ...
        def opened(self, session) -> None: ...
        def closed(self, session) -> None: ...

    hook = Hook()
    register_update_hook(net, hook)
    try:
        assert not audit_ahead(net)  # a hook may present other tensors before the begin
    finally:
        unregister_update_hook(net, hook)
    assert audit_ahead(net)
