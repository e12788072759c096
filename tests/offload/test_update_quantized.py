"""Updates into a quantized (fp8-streamed) offload requantize: the host storage holds a fresh load's bytes.

Oracles: a fresh offloaded load of the new weights quantized the same way (its host arena, bitwise), and
the resident model quantized the same way (``quantize_linears`` on every block, no offload code): output
over several denoising steps and fingerprint.
"""

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
from weight_sync.quant.modules import quantize_linears
from weight_sync.reload import record_metadata_for_reloading, reload_weights, torn_reason
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

# hidden 160: fc1 / fc2 are 640 x 160, so 128 x 128 tiles have ragged edges.
DIT = DiTConfig(num_blocks=3, hidden=160, heads=4)


def _pipe(seed: int) -> SyntheticDiTPipeline:
    torch.manual_seed(seed)
    return SyntheticDiTPipeline(DIT).to(torch.bfloat16).eval()


def _config(quantization: str = "fp8_block", **kw: object) -> OffloadConfig:
    return OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu",
                         quantization=quantization, **kw)  # type: ignore[arg-type]


def _weights(pipe: SyntheticDiTPipeline) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}


def _out(pipe: SyntheticDiTPipeline) -> torch.Tensor:
    return pipe.generate(tokens=16, num_inference_steps=3, seed=7)


def _resident_quantized(weights: dict[str, torch.Tensor], name: str) -> SyntheticDiTPipeline:
    ref = _pipe(5)
    ref.transformer.load_state_dict(weights)
    for block in ref.transformer.blocks:
        quantize_linears(block, name)
    return ref


@pytest.fixture(scope="module")
def b() -> dict[str, torch.Tensor]:
    return _weights(_pipe(2))


def _arena(handle: object) -> torch.Tensor:
    return handle.store.arena.clone()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "resident_layers"),
                         [("fp8_block", 0), ("fp8_block", 1), ("fp8_per_channel", 0), ("fp8", 0), ("int8", 0)])
def test_an_update_requantizes_into_the_arena_exactly_the_bytes_of_a_fresh_quantized_load(
    b, name: str, resident_layers: int
) -> None:
    ref = _resident_quantized(b, name)
    expected, fp = _out(ref), weight_sync.fingerprint(ref.transformer)
    fresh = _pipe(5)
    fresh.transformer.load_state_dict(b)
    with enable_layerwise_offload(fresh, _config(name, dlo_resident_layers=resident_layers)) as hf:
        fresh_arena, fresh_out = _arena(hf), _out(fresh)

    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config(name, dlo_resident_layers=resident_layers))
    before = _out(pipe)
    report = reload_weights(pipe.transformer, weights_iterator=iter(b.items()), version="b")
    assert not torch.equal(before, expected)
    assert torch.equal(handle.store.arena, fresh_arena)  # type: ignore[union-attr]
    assert torch.equal(_out(pipe), expected) and torch.equal(fresh_out, expected)
    # Every block linear was requantized (streamed and resident), none written with a cast.
    linears = {f"blocks.{i}.{n}" for i in range(DIT.num_blocks) for n in ("qkv", "proj", "fc1", "fc2")}
    assert set(report.layers_processed) == linears
    assert report.fingerprint == fp and handle.fingerprint(pipe.transformer) == fp
    assert handle.metrics()["num_updates"] == 1
    handle.disable()
    assert torch.equal(_out(pipe), expected)


def test_repeated_updates_through_buckets_rewrite_the_same_arena_in_place(b) -> None:
    pipe = _pipe(1)
    a = _weights(pipe)
    handle = enable_layerwise_offload(pipe, _config())
    arena = handle.store.arena  # type: ignore[union-attr]
    ptr = arena.data_ptr()
    a_out = _out(pipe)
    b_out = _out(_resident_quantized(b, "fp8_block"))
    for version, (w, out) in enumerate([(b, b_out), (a, a_out), (b, b_out)]):
        items = list(w.items())
        with weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(items),
                                      version=version) as s:
            for k in range(0, len(items), 5):  # buckets that split layers, as a transport's do
                s.load(items[k : k + 5])
        assert torch.equal(_out(pipe), out)
    assert handle.store.arena.data_ptr() == ptr  # type: ignore[union-attr]
    handle.disable()


def test_requantizing_a_again_restores_its_arena_bitwise(b) -> None:
    pipe = _pipe(1)
    a = _weights(pipe)
    handle = enable_layerwise_offload(pipe, _config())
    a_bytes = _arena(handle)
    reload_weights(pipe.transformer, weights_iterator=iter(b.items()))
    assert not torch.equal(handle.store.arena, a_bytes)  # type: ignore[union-attr]
    reload_weights(pipe.transformer, weights_iterator=iter(a.items()))
    assert torch.equal(handle.store.arena, a_bytes)  # type: ignore[union-attr]
    handle.disable()


@pytest.mark.parametrize("bad", ["shape", "integer"])
def test_a_bad_manifest_is_refused_before_any_write_and_the_model_serves_as_before(b, bad: str) -> None:
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config())
    before, arena = _out(pipe), _arena(handle)
    wrong = dict(b)
    # The model format is the full-precision linear: neither a reshaped weight nor integer data (an
    # fp8 or int8 payload sent as if it were the weight) can stand for it.
    wrong["blocks.1.fc1.weight"] = (torch.zeros(7, DIT.hidden, dtype=torch.bfloat16) if bad == "shape"
                                    else torch.zeros_like(b["blocks.1.fc1.weight"], dtype=torch.int8))
    with pytest.raises(ManifestError, match=r"blocks\.1\.fc1\.weight"):
        weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(wrong.items()))
    assert torch.equal(handle.store.arena, arena)  # type: ignore[union-attr]
    assert torch.equal(_out(pipe), before)
    handle.disable()


def test_a_forward_during_an_open_quantized_update_is_refused_naming_it(b) -> None:
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config())
    items = list(b.items())
    session = weight_sync.begin_update(pipe.transformer, weight_sync.Manifest.from_named_tensors(items),
                                       version="v9")
    session.load(items[:9])
    with pytest.raises(UpdateStateError, match="'v9' is open"):
        _out(pipe)
    session.load(items[9:])
    session.finish()
    assert torch.equal(_out(pipe), _out(_resident_quantized(b, "fp8_block")))
    handle.disable()


def _failing(items: list[tuple[str, torch.Tensor]], after: int):
    for i, item in enumerate(items):
        if i == after:
            raise OSError("sender killed")
        yield item


@pytest.mark.parametrize("rollback", [True, False])
def test_a_sender_that_dies_mid_update_leaves_the_quantized_offload_rolled_back_or_torn(b, rollback: bool) -> None:
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config())
    before, arena = _out(pipe), _arena(handle)
    items = list(b.items())
    manifest = weight_sync.Manifest.from_named_tensors(items)
    with pytest.raises(SourceError, match="sender killed"):  # 20 keys: two blocks requantized, one half
        reload_weights(pipe.transformer, weights_iterator=_failing(items, 20), manifest=manifest,
                       rollback=rollback)
    if rollback:
        assert torn_reason(pipe.transformer) is None
        assert torch.equal(handle.store.arena, arena)  # type: ignore[union-attr]
        assert torch.equal(_out(pipe), before)
    else:
        assert torn_reason(pipe.transformer) is not None
        assert not torch.equal(handle.store.arena, arena)  # type: ignore[union-attr]
        with pytest.raises(TornModelError):
            _out(pipe)
    reload_weights(pipe.transformer, weights_iterator=iter(items))
    assert torch.equal(_out(pipe), _out(_resident_quantized(b, "fp8_block")))
    handle.disable()


def test_reload_metadata_recorded_before_quantizing_still_requantizes(b) -> None:
    # Recorded while the linears were nn.Linear: the update must not write into the replaced modules.
    pipe = _pipe(1)
    record_metadata_for_reloading(pipe.transformer)
    handle = enable_layerwise_offload(pipe, _config())
    reload_weights(pipe.transformer, weights_iterator=iter(b.items()))
    assert torch.equal(_out(pipe), _out(_resident_quantized(b, "fp8_block")))
    handle.disable()


@pytest.mark.parametrize("source", ["checkpoint_mmap", "runtime_cache"])
def test_a_quantized_offload_of_mapped_host_weights_moves_to_a_private_arena_and_never_writes_the_file(
    b, tmp_path: Path, source: str
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in _weights(_pipe(1)).items()}, str(ckpt / "model.safetensors"))
    original = (ckpt / "model.safetensors").read_bytes()
    cache = {"dlo_enable_runtime_cache": True, "dlo_runtime_cache_dir": str(tmp_path / "cache")}
    config = _config(**(cache if source == "runtime_cache" else {}))
    pipe = _pipe(9)
    assert load_host_weights(pipe.transformer, ckpt, config).source == source
    handle = enable_layerwise_offload(pipe, config)
    assert handle.metrics()["host_storage"] == "staged" and handle.metrics()["mapped_bytes"] > 0
    reload_weights(pipe.transformer, weights_iterator=iter(b.items()))
    m = handle.metrics()
    assert (m["host_storage"], m["mapped_bytes"], m["num_storage_moves"]) == ("packed", 0, 1)
    assert torch.equal(_out(pipe), _out(_resident_quantized(b, "fp8_block")))
    assert (ckpt / "model.safetensors").read_bytes() == original
    handle.disable()


def test_a_quantized_linear_the_offload_did_not_quantize_is_refused_before_any_write(b) -> None:
    pipe = _pipe(1)
    for block in pipe.transformer.blocks:  # quantized by hand: its full-precision layout is unknown
        quantize_linears(block, "fp8_block")
    handle = enable_layerwise_offload(pipe, _config())
    before, arena = _out(pipe), _arena(handle)
    with pytest.raises(ConfigError, match=r"blocks\.0\.qkv: .*full-precision layout"):
        reload_weights(pipe.transformer, weights_iterator=iter(b.items()))
    assert torch.equal(handle.store.arena, arena)  # type: ignore[union-attr]
    assert torch.equal(_out(pipe), before)
    handle.disable()


def test_with_every_block_resident_an_update_still_requantizes(b) -> None:
    pipe = _pipe(1)
    handle = enable_layerwise_offload(pipe, _config(dlo_resident_layers=DIT.num_blocks))
    assert handle.streamer is None
    reload_weights(pipe.transformer, weights_iterator=iter(b.items()))
    ref = _resident_quantized(b, "fp8_block")
    assert torch.equal(_out(pipe), _out(ref))
    assert weight_sync.fingerprint(pipe.transformer) == weight_sync.fingerprint(ref.transformer)
    handle.disable()


def test_after_disable_the_resident_quantized_model_still_requantizes_on_update(b) -> None:
    pipe = _pipe(1)
    enable_layerwise_offload(pipe, _config()).disable()  # kernel format stays: a resident fp8 model
    reload_weights(pipe.transformer, weights_iterator=iter(b.items()))
    ref = _resident_quantized(b, "fp8_block")
    assert torch.equal(_out(pipe), _out(ref))
    assert weight_sync.fingerprint(pipe.transformer) == weight_sync.fingerprint(ref.transformer)
