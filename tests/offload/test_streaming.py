"""Single-rank streaming on CPU: bitwise equality with the resident model, slots, hooks, restore."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.offload import OffloadConfig, OffloadPlan, enable_layerwise_offload
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline


def _config(**kw: object) -> OffloadConfig:
    return OffloadConfig(enable_distributed_layerwise_offload=True, device="cpu", **kw)  # type: ignore[arg-type]


def _pair(dtype: torch.dtype = torch.float32, **dit: int) -> tuple[SyntheticDiTPipeline, SyntheticDiTPipeline]:
    torch.manual_seed(0)
    ref = SyntheticDiTPipeline(DiTConfig(**dit)).to(dtype).eval()
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("num_blocks", [4, 5], ids=["even", "odd"])
def test_offloaded_output_is_bitwise_equal_to_resident_over_several_steps(num_blocks: int) -> None:
    ref, off = _pair(num_blocks=num_blocks)
    expected = ref.generate(tokens=24, num_inference_steps=4, seed=3)
    handle = enable_layerwise_offload(off, _config())
    out = off.generate(tokens=24, num_inference_steps=4, seed=3)
    assert torch.equal(out, expected)
    again = off.generate(tokens=24, num_inference_steps=4, seed=3)
    assert torch.equal(again, expected)
    m = handle.metrics()
    assert m["num_block_loads"] == 2 * 4 * num_blocks
    # Only the very first block of the first step was not prefetched.
    assert m["num_prefetch_misses"] == 1
    handle.disable()


def test_bf16_offloaded_output_is_bitwise_equal_to_resident() -> None:
    ref, off = _pair(torch.bfloat16, num_blocks=3)
    expected = ref.generate(tokens=16, num_inference_steps=3)
    with enable_layerwise_offload(off, _config()):
        assert torch.equal(off.generate(tokens=16, num_inference_steps=3), expected)


def test_exactly_two_slots_are_allocated_and_blocks_only_ever_live_in_them() -> None:
    ref, off = _pair(num_blocks=5)
    handle = enable_layerwise_offload(off, _config())
    seen: set[int] = set()

    def record(module: nn.Module, args: object) -> None:
        seen.update(p.untyped_storage().data_ptr() for p in module.parameters())

    hooks = [b.register_forward_pre_hook(record) for b in off.transformer.blocks]
    off.generate(tokens=8, num_inference_steps=3)
    for h in hooks:
        h.remove()
    assert handle.metrics()["num_slots_allocated"] == 2
    assert handle.streamer is not None
    assert seen == {s.untyped_storage().data_ptr() for s in handle.streamer.slots}
    slot_bytes = handle.metrics()["slot_bytes"]
    largest = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in ref.transformer.blocks)
    assert largest <= slot_bytes < largest + 64 * 512  # the largest block plus per-tensor alignment
    handle.disable()


def test_parameters_keep_their_objects_and_strides_while_streaming() -> None:
    ref, off = _pair(num_blocks=3)
    # A transposed weight, as fp8 GEMMs keep them: the slot view must keep the stride.
    for model in (ref, off):
        for b in model.transformer.blocks:
            w = b.fc1.weight
            b.fc1.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
    params_before = {n: p for n, p in off.named_parameters()}
    strides = {n: p.stride() for n, p in params_before.items()}
    expected = ref.generate(tokens=8, num_inference_steps=2)
    seen_strides: dict[str, tuple[int, ...]] = {}

    def record(module: nn.Module, args: object) -> None:
        for n, p in module.named_parameters():
            seen_strides[f"{id(module)}.{n}"] = p.stride()

    handle = enable_layerwise_offload(off, _config())
    hooks = [b.register_forward_pre_hook(record) for b in off.transformer.blocks]
    assert torch.equal(off.generate(tokens=8, num_inference_steps=2), expected)
    for h in hooks:
        h.remove()
    assert {n: p for n, p in off.named_parameters()} == params_before
    fc1 = off.transformer.blocks[0].fc1.weight
    assert fc1.stride() == strides["transformer.blocks.0.fc1.weight"] and not fc1.is_contiguous()
    assert seen_strides[f"{id(off.transformer.blocks[0])}.fc1.weight"] == fc1.stride()
    handle.disable()


def test_disable_restores_the_resident_model_and_removes_the_hooks() -> None:
    ref, off = _pair(num_blocks=4)
    expected = ref.generate(tokens=8, num_inference_steps=2)
    handle = enable_layerwise_offload(off, _config())
    off.generate(tokens=8, num_inference_steps=2)
    slots = {s.untyped_storage().data_ptr() for s in handle.streamer.slots}  # type: ignore[union-attr]
    handle.disable()
    ptrs = {p.untyped_storage().data_ptr() for p in off.transformer.blocks.parameters()}
    assert not ptrs & slots
    assert len(ptrs) == 4  # one device buffer per block
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in off.transformer.blocks)
    assert torch.equal(off.generate(tokens=8, num_inference_steps=2), expected)
    for (n, a), b in zip(ref.state_dict().items(), off.state_dict().values()):
        assert torch.equal(a, b), n
    handle.disable()  # idempotent
    # Enabling again after disable works.
    with enable_layerwise_offload(off, _config()):
        assert torch.equal(off.generate(tokens=8, num_inference_steps=2), expected)


def test_a_block_run_out_of_ring_order_is_loaded_on_demand() -> None:
    ref, off = _pair(num_blocks=4)
    x = torch.randn(1, 8, 64)
    expected_block = ref.transformer.blocks[2](x)
    expected = ref.generate(tokens=8, num_inference_steps=2)
    with enable_layerwise_offload(off, _config()) as handle:
        with torch.no_grad():
            assert torch.equal(off.transformer.blocks[2](x), expected_block)
        assert torch.equal(off.generate(tokens=8, num_inference_steps=2), expected)
        assert handle.metrics()["num_prefetch_misses"] == 2


def test_inference_mode_forward_is_bitwise_equal() -> None:
    ref, off = _pair(num_blocks=3)
    expected = ref.generate(tokens=8, num_inference_steps=2)
    with enable_layerwise_offload(off, _config()), torch.inference_mode():
        assert torch.equal(off.generate(tokens=8, num_inference_steps=2), expected)


def test_resident_leading_layers_stay_in_place_and_are_not_streamed() -> None:
    ref, off = _pair(num_blocks=5)
    expected = ref.generate(tokens=8, num_inference_steps=3)
    resident_ptrs = [p.data_ptr() for p in off.transformer.blocks[0].parameters()]
    with enable_layerwise_offload(off, _config(dlo_use_allgather=False, dlo_resident_layers=2)) as h:
        assert torch.equal(off.generate(tokens=8, num_inference_steps=3), expected)
        m = h.metrics()
        assert (m["num_streamed_blocks"], m["num_resident_blocks"]) == (3, 2)
        assert m["num_block_loads"] == 9
        assert [p.data_ptr() for p in off.transformer.blocks[0].parameters()] == resident_ptrs
        assert not off.transformer.blocks[1]._forward_pre_hooks


def test_trace_records_overlapping_compute_and_h2d_spans() -> None:
    _, off = _pair(num_blocks=4)
    with enable_layerwise_offload(off, _config(trace=True)) as handle:
        off.generate(tokens=8, num_inference_steps=2)
        spans = handle.trace()
    kinds = {s.kind for s in spans}
    assert kinds == {"compute", "h2d"}
    assert sum(s.kind == "compute" for s in spans) == 8
    assert all(s.end_ms >= s.start_ms for s in spans)


def test_trace_without_trace_enabled_is_a_config_error() -> None:
    _, off = _pair(num_blocks=2)
    with enable_layerwise_offload(off, _config()) as handle, pytest.raises(ConfigError, match="trace=True"):
        handle.trace()


def test_enabling_twice_or_with_dlo_disabled_is_rejected() -> None:
    _, off = _pair(num_blocks=2)
    with pytest.raises(ConfigError, match="enable_distributed_layerwise_offload"):
        enable_layerwise_offload(off, OffloadConfig(device="cpu"))
    with enable_layerwise_offload(off, _config()), pytest.raises(ConfigError, match="already"):
        enable_layerwise_offload(off, _config())


def test_keyword_options_mirror_the_flags() -> None:
    ref, off = _pair(num_blocks=3)
    expected = ref.generate(tokens=8, num_inference_steps=2)
    handle = enable_layerwise_offload(
        off, enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu"
    )
    assert torch.equal(off.generate(tokens=8, num_inference_steps=2), expected)
    assert handle.config.dlo_use_allgather is False
    handle.disable()


def test_host_weights_are_packed_once_into_one_pinned_arena() -> None:
    _, off = _pair(num_blocks=4)
    with enable_layerwise_offload(off, _config()) as handle:
        off.generate(tokens=8, num_inference_steps=2)
        m = handle.metrics()
    assert m["host_storage"] == "packed"
    assert m["host_bytes"] >= m["block_bytes"]
    assert m["pinned_bytes"] >= m["host_bytes"]  # accounted on CPU, registered on CUDA
    assert m["h2d_bytes"] >= 8 * (m["block_bytes"] // 4)
    assert m["fabric_bytes"] == 0 and m["num_fallbacks"] == 0


def test_a_tensor_tied_across_blocks_cannot_stream() -> None:
    _, off = _pair(num_blocks=3)
    off.transformer.blocks[1].fc2.bias = off.transformer.blocks[0].fc2.bias
    with pytest.raises(ConfigError, match="shared between streamed blocks"):
        enable_layerwise_offload(off, _config())


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_any_module_with_a_plan_or_a_uniform_block_list_streams() -> None:
    torch.manual_seed(0)
    ref = _Bare()
    x = torch.randn(2, 8)
    expected = ref(x)
    for plan in (None, OffloadPlan(block_attrs={"": ("layers",)})):
        off = copy.deepcopy(ref)
        if plan is not None:
            off._offload_plan = plan  # type: ignore[assignment]
        with enable_layerwise_offload(off, _config()) as handle, torch.no_grad():
            assert torch.equal(off(x), expected)
            assert handle.topology.source == ("plan" if plan else "heuristic")
