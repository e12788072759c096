"""Weight updates into an offloaded model (one process): host storage is written, the next forward serves it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weight_sync
from weight_sync.errors import (
    ConfigError,
    ManifestError,
    SourceError,
    TornModelError,
    UpdateStateError,
)
from weight_sync.offload import OffloadConfig, enable_layerwise_offload, load_host_weights
from weight_sync.reload import reload_weights, torn_reason
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

DIT = DiTConfig(num_blocks=4, hidden=64, heads=4)


def _pipe(seed: int) -> SyntheticDiTPipeline:
    torch.manual_seed(seed)
    return SyntheticDiTPipeline(DIT).eval()


def _config(**kw: object) -> OffloadConfig:
    return OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu",
                         **kw)  # type: ignore[arg-type]


def _weights(pipe: SyntheticDiTPipeline) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}


def _out(pipe: SyntheticDiTPipeline) -> torch.Tensor:
    return pipe.generate(tokens=12, num_inference_steps=3, seed=7)


@pytest.fixture(scope="module")
def b() -> tuple[dict[str, torch.Tensor], torch.Tensor, str]:
    """Weights B, the output of a fresh resident B, and its fingerprint."""
    pipe = _pipe(2)
    return _weights(pipe), _out(pipe), weight_sync.fingerprint(pipe.transformer)


def _fresh_offloaded_b_out(b_weights: dict[str, torch.Tensor], **kw: object) -> torch.Tensor:
    pipe = _pipe(5)
    pipe.transformer.load_state_dict(b_weights)
    handle = enable_layerwise_offload(pipe, _config(**kw))
    try:
        return _out(pipe)
    finally:
        handle.disable()


@pytest.mark.parametrize("resident_layers", [0, 1])
def test_reload_into_an_offloaded_model_serves_exactly_a_fresh_offloaded_and_a_fresh_resident_load(
    b, resident_layers: int
) -> None:
    weights, expected, fp = b
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config(dlo_resident_layers=resident_layers))
    before = _out(pipe)
    report = reload_weights(pipe.transformer, weights_iterator=iter(weights.items()), version="b")
    after = _out(pipe)
    assert not torch.equal(before, expected)
    assert torch.equal(after, expected)
    assert torch.equal(after, _fresh_offloaded_b_out(weights, dlo_resident_layers=resident_layers))
    # Between updates the streamed parameters are views of the arena: the report hashes the new weights.
    assert report.fingerprint == fp
    assert handle.fingerprint(pipe.transformer) == fp
    m = handle.metrics()
    assert m["num_updates"] == 1 and m["host_storage"] == "packed"
    handle.disable()
    assert torch.equal(_out(pipe), expected)


def test_updates_write_the_packed_arena_in_place_and_repeat(b) -> None:
    weights, expected, _ = b
    pipe = _pipe(1)
    a = _weights(pipe)
    handle = enable_layerwise_offload(pipe, _config())
    arena = handle.store.arena  # type: ignore[union-attr]
    ptr, nbytes = arena.data_ptr(), handle.metrics()["host_bytes"]
    a_out = _out(pipe)
    for version, (w, out) in enumerate([(weights, expected), (a, a_out), (weights, expected)]):
        with weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(w.items()),
                                      version=version) as s:
            s.load(list(w.items()))
        assert torch.equal(_out(pipe), out)
    assert handle.store.arena.data_ptr() == ptr  # type: ignore[union-attr]
    assert handle.metrics()["host_bytes"] == nbytes
    handle.disable()


def test_a_bad_manifest_is_refused_before_any_write_and_the_model_serves_as_before(b) -> None:
    weights, _, _ = b
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config())
    before = _out(pipe)
    arena = handle.store.arena.clone()  # type: ignore[union-attr]
    bad = dict(weights)
    bad["blocks.1.fc1.weight"] = torch.zeros(7, 64)
    with pytest.raises(ManifestError, match=r"blocks\.1\.fc1\.weight"):
        weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(bad.items()))
    assert torch.equal(handle.store.arena, arena)  # type: ignore[union-attr]
    assert torch.equal(_out(pipe), before)
    handle.disable()


def test_a_forward_during_an_open_update_is_refused_naming_it(b) -> None:
    weights, expected, _ = b
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config())
    session = weight_sync.begin_update(pipe.transformer, version="v9")
    session.load(list(weights.items())[:5])
    with pytest.raises(UpdateStateError, match="'v9' is open"):
        _out(pipe)
    with pytest.raises(ConfigError, match="open"):
        handle.disable()
    session.load(list(weights.items())[5:])
    session.finish()
    assert torch.equal(_out(pipe), expected)
    handle.disable()


def _failing(items: list[tuple[str, torch.Tensor]], after: int):
    for i, item in enumerate(items):
        if i == after:
            raise OSError("sender killed")
        yield item


@pytest.mark.parametrize("rollback", [True, False])
def test_a_sender_that_dies_mid_update_leaves_the_offloaded_model_rolled_back_or_torn(b, rollback: bool) -> None:
    weights, expected, _ = b
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config())
    before = _out(pipe)
    with pytest.raises(SourceError, match="sender killed"):
        reload_weights(pipe.transformer, weights_iterator=_failing(list(weights.items()), 20),
                       rollback=rollback)
    if rollback:
        assert torn_reason(pipe.transformer) is None
        assert torch.equal(_out(pipe), before)
    else:
        assert torn_reason(pipe.transformer) is not None
        with pytest.raises(TornModelError):
            _out(pipe)
    reload_weights(pipe.transformer, weights_iterator=iter(weights.items()))
    assert torch.equal(_out(pipe), expected)
    handle.disable()


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    pipe = _pipe(1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}, str(ckpt / "model.safetensors"))
    return ckpt


@pytest.mark.parametrize("pin_budget", [0, 1 << 30])
def test_an_update_of_mmap_host_weights_moves_to_a_private_arena_and_never_writes_the_file(
    b, checkpoint: Path, pin_budget: int
) -> None:
    weights, expected, _ = b
    file = checkpoint / "model.safetensors"
    original = file.read_bytes()
    pipe = _pipe(9)
    config = _config(pin_in_place_budget_bytes=pin_budget)
    assert load_host_weights(pipe.transformer, checkpoint, config).source == "checkpoint_mmap"
    handle = enable_layerwise_offload(pipe, config)
    assert handle.metrics()["mapped_bytes"] > 0
    reload_weights(pipe.transformer, weights_iterator=iter(weights.items()))
    m = handle.metrics()
    assert (m["host_storage"], m["mapped_bytes"], m["num_storage_moves"]) == ("packed", 0, 1)
    assert torch.equal(_out(pipe), expected)
    assert file.read_bytes() == original
    handle.disable()


def test_an_update_of_mmap_host_weights_over_the_host_budget_is_refused_with_the_reason(
    b, checkpoint: Path
) -> None:
    weights, _, _ = b
    pipe = _pipe(9)
    config = _config(update_host_budget_bytes=1024)
    load_host_weights(pipe.transformer, checkpoint, config)
    handle = enable_layerwise_offload(pipe, config)
    before = _out(pipe)
    with pytest.raises(ConfigError, match=r"read-only mappings .* never written.*update_host_budget_bytes"):
        reload_weights(pipe.transformer, weights_iterator=iter(weights.items()))
    assert handle.metrics()["host_storage"] == "staged"
    assert torn_reason(pipe.transformer) is None
    assert torch.equal(_out(pipe), before)
    handle.disable()

