"""Host-weight loading: direct checkpoint mmap, its fallback, pin in place, staging, the runtime cache."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weight_sync.offload import OffloadConfig, enable_layerwise_offload, load_host_weights
from weight_sync.testing.dit import DiTConfig, SyntheticDiT, SyntheticDiTPipeline

DIT = DiTConfig(num_blocks=4)


def _config(**kw: object) -> OffloadConfig:
    return OffloadConfig(enable_distributed_layerwise_offload=True, device="cpu", **kw)  # type: ignore[arg-type]


@pytest.fixture()
def reference(tmp_path: Path) -> tuple[SyntheticDiTPipeline, Path]:
    """A resident pipeline and a checkpoint directory holding its transformer."""
    torch.manual_seed(0)
    ref = SyntheticDiTPipeline(DIT).eval()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {k: v.contiguous() for k, v in ref.transformer.state_dict().items()}
    save_file(state, str(ckpt / "model.safetensors"))
    return ref, ckpt


def _fresh(seed: int = 123) -> SyntheticDiTPipeline:
    torch.manual_seed(seed)  # different random init: only a real load makes outputs match
    return SyntheticDiTPipeline(DIT).eval()


class _HookedDiT(SyntheticDiT):
    calls: list[str]

    def post_load_weights(self) -> None:
        self.calls.append("post_load_weights")

    def validate_loaded_weights(self) -> None:
        self.calls.append("validate_loaded_weights")


def test_checkpoint_mmap_maps_every_tensor_and_keeps_buffers_and_hooks(reference) -> None:
    ref, ckpt = reference
    dit = _HookedDiT(DIT)
    dit.calls = []
    freqs = dit.time_freqs
    hw = load_host_weights(dit, ckpt, _config())
    assert hw.source == "checkpoint_mmap" and hw.num_fallbacks == 0
    assert dit.calls == ["post_load_weights", "validate_loaded_weights"]
    assert dit.time_freqs is freqs  # the non-persistent buffer survived the trip through meta
    file_bytes = (ckpt / "model.safetensors").stat().st_size
    storages = {p.untyped_storage().data_ptr() for p in dit.parameters()}
    assert len(storages) == 1  # every parameter is a view of the one mapped file
    assert next(iter(dit.parameters())).untyped_storage().nbytes() == file_bytes
    for (name, a), b in zip(ref.transformer.state_dict().items(), dit.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoint_mmap_streams_pinned_in_place_within_the_budget(reference) -> None:
    ref, ckpt = reference
    pipe = _fresh()
    load_host_weights(pipe.transformer, ckpt, _config())
    expected = ref.generate(tokens=8, num_inference_steps=3)
    with enable_layerwise_offload(pipe, _config(pin_in_place_budget_bytes=1 << 30)) as handle:
        assert torch.equal(pipe.generate(tokens=8, num_inference_steps=3), expected)
        m = handle.metrics()
    assert (m["host_weights_source"], m["host_storage"]) == ("checkpoint_mmap", "pinned_in_place")
    assert m["pinned_bytes"] == (ckpt / "model.safetensors").stat().st_size
    assert m["mapped_bytes"] == m["host_bytes"] > 0
    assert m["num_fallbacks"] == 0


def test_pinning_in_place_is_off_unless_a_budget_is_given(reference) -> None:
    ref, ckpt = reference
    pipe = _fresh()
    load_host_weights(pipe.transformer, ckpt, _config())
    with enable_layerwise_offload(pipe, _config()) as handle:
        assert torch.equal(pipe.generate(tokens=8, num_inference_steps=3),
                           ref.generate(tokens=8, num_inference_steps=3))
        assert handle.metrics()["host_storage"] == "staged"


def test_checkpoint_mmap_over_the_pin_budget_stages_through_two_buffers(reference) -> None:
    ref, ckpt = reference
    pipe = _fresh()
    load_host_weights(pipe.transformer, ckpt, _config())
    expected = ref.generate(tokens=8, num_inference_steps=3)
    with enable_layerwise_offload(pipe, _config(pin_in_place_budget_bytes=1024)) as handle:
        assert torch.equal(pipe.generate(tokens=8, num_inference_steps=3), expected)
        m = handle.metrics()
    assert m["host_storage"] == "staged"
    assert m["num_fallbacks"] == 1 and "budget" in m["fallback_reasons"][0]
    # Two staging buffers of the largest block, nothing model-sized.
    assert 0 < m["pinned_bytes"] <= 2 * m["slot_bytes"] < m["block_bytes"]


def test_checkpoint_mmap_fallback_leaves_the_model_intact(tmp_path: Path, reference) -> None:
    ref, _ = reference
    bad = tmp_path / "bad"
    bad.mkdir()
    state = {k: v.contiguous() for k, v in ref.transformer.state_dict().items()}
    state["blocks.1.fc1.weight"] = state["blocks.1.fc1.weight"][:, :-1].contiguous()  # wrong shape
    save_file(state, str(bad / "model.safetensors"))
    pipe = _fresh()
    dit = pipe.transformer
    before = {n: (t, t.data_ptr(), t.clone()) for n, t in dit.state_dict(keep_vars=True).items()}
    seen_untouched: list[bool] = []

    def ordinary(module: torch.nn.Module) -> None:
        now = module.state_dict(keep_vars=True)
        seen_untouched.append(all(
            now[n] is t and now[n].data_ptr() == ptr and torch.equal(now[n], val)
            for n, (t, ptr, val) in before.items()
        ))
        good = {k: v for k, v in ref.transformer.state_dict().items()}
        module.load_state_dict(good)

    hw = load_host_weights(dit, bad, _config(), ordinary_loader=ordinary)
    assert seen_untouched == [True]
    assert hw.source == "ordinary" and hw.num_fallbacks == 1
    assert "blocks.1.fc1.weight" in hw.fallback_reasons[0]
    expected = ref.generate(tokens=8, num_inference_steps=2)
    with enable_layerwise_offload(pipe, _config()) as handle:
        assert torch.equal(pipe.generate(tokens=8, num_inference_steps=2), expected)
        m = handle.metrics()
    assert (m["host_storage"], m["num_fallbacks"]) == ("packed", 1)


def test_a_checkpoint_with_foreign_tensors_falls_back_completely(tmp_path: Path, reference) -> None:
    ref, _ = reference
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    state = {k: v.contiguous() for k, v in ref.transformer.state_dict().items()}
    state["text_encoder.embed.weight"] = torch.zeros(4, 4)
    save_file(state, str(mixed / "model.safetensors"))
    dit = _fresh().transformer
    hw = load_host_weights(dit, mixed, _config(), ordinary_loader=lambda m: m.load_state_dict(
        ref.transformer.state_dict()))
    assert hw.source == "ordinary" and "does not own" in hw.fallback_reasons[0]


def test_tensor_parallel_loading_uses_the_ordinary_loader(reference) -> None:
    ref, ckpt = reference
    dit = _fresh().transformer
    calls: list[int] = []
    hw = load_host_weights(
        dit, ckpt, _config(tensor_parallel_size=2, dlo_use_allgather=False),
        ordinary_loader=lambda m: calls.append(1) or m.load_state_dict(ref.transformer.state_dict()),
    )
    assert calls == [1] and hw.source == "ordinary" and "requires TP1" in hw.fallback_reasons[0]


def test_default_ordinary_loader_copies_into_private_tensors(tmp_path: Path, reference) -> None:
    ref, _ = reference
    # A stride the checkpoint cannot map: the ordinary loader must run and copy.
    pipe = _fresh()
    w = pipe.transformer.blocks[0].fc1.weight
    pipe.transformer.blocks[0].fc1.weight = torch.nn.Parameter(w.detach().t().contiguous().t())
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in ref.transformer.state_dict().items()},
              str(ckpt / "model.safetensors"))
    hw = load_host_weights(pipe.transformer, ckpt, _config())
    assert hw.source == "ordinary" and "non-contiguous" in hw.fallback_reasons[0]
    assert torch.equal(pipe.generate(tokens=8, num_inference_steps=2),
                       ref.generate(tokens=8, num_inference_steps=2))


def test_runtime_cache_hit_skips_the_ordinary_loader_and_streams_staged(tmp_path: Path, reference) -> None:
    pytest.importorskip("weight_sync.offload.cache")
    ref, ckpt = reference
    cfg = _config(dlo_enable_runtime_cache=True, dlo_runtime_cache_dir=str(tmp_path / "cache"))
    expected = ref.generate(tokens=8, num_inference_steps=2)
    statuses, loads = [], []
    for _ in range(2):
        pipe = _fresh()
        hw = load_host_weights(
            pipe.transformer, ckpt, cfg,
            ordinary_loader=lambda m: loads.append(1) or m.load_state_dict(ref.transformer.state_dict()),
        )
        statuses.append(hw.cache_status)
        with enable_layerwise_offload(pipe, cfg) as handle:
            assert torch.equal(pipe.generate(tokens=8, num_inference_steps=2), expected)
            m = handle.metrics()
        assert (m["host_weights_source"], m["host_storage"]) == ("runtime_cache", "staged")
        assert m["mapped_bytes"] > 0
        hw.cache_result.close()
    assert statuses == ["published", "hit"]
    assert loads == [1]


def test_offload_keeps_working_after_disable_of_a_mapped_model(reference) -> None:
    ref, ckpt = reference
    pipe = _fresh()
    load_host_weights(pipe.transformer, ckpt, _config())
    handle = enable_layerwise_offload(pipe, _config())
    pipe.generate(tokens=8, num_inference_steps=1)
    handle.disable()
    assert handle.metrics()["pinned_bytes"] == 0
    assert torch.equal(pipe.generate(tokens=8, num_inference_steps=2),
                       ref.generate(tokens=8, num_inference_steps=2))
    copy.deepcopy(pipe)  # the restored model owns ordinary tensors again
