"""A real diffusers DiT (tiny Flux, random weights built locally) streamed bitwise-equal to resident."""

from __future__ import annotations

import copy

import pytest
import torch

from weight_sync.offload import OffloadConfig, OffloadPlan, enable_layerwise_offload
from weight_sync.testing.dit import tiny_flux_inputs, tiny_flux_transformer

pytest.importorskip("diffusers")


class _FluxPipeline(torch.nn.Module):
    """The two block lists of Flux in one ring, declared like a model would."""

    _offload_plan = OffloadPlan(
        block_attrs={"transformer": ("transformer_blocks", "single_transformer_blocks")}
    )

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    @torch.no_grad()
    def denoise(self, inputs: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
        x = inputs["hidden_states"]
        sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
        for i in range(steps):
            args = dict(inputs, hidden_states=x, timestep=torch.full((x.shape[0],), sigmas[i]))
            v = self.transformer(**args, return_dict=False)[0]
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        return x


@pytest.mark.parametrize("declared", [True, False], ids=["plan", "heuristic"])
def test_tiny_flux_offloaded_is_bitwise_equal_to_resident_over_several_steps(declared: bool) -> None:
    ref = _FluxPipeline(tiny_flux_transformer(seed=0))
    off = copy.deepcopy(ref) if declared else copy.deepcopy(ref.transformer)
    inputs = tiny_flux_inputs(seed=1)
    expected = ref.denoise(inputs, 3)
    cfg = OffloadConfig(enable_distributed_layerwise_offload=True, device="cpu")
    with enable_layerwise_offload(off, cfg) as handle:
        pipe = off if declared else _FluxPipeline(off)
        assert torch.equal(pipe.denoise(inputs, 3), expected)
        m = handle.metrics()
    # Declared: both block lists stream (2 + 2); the heuristic finds one uniform list (2).
    assert m["num_streamed_blocks"] == (4 if declared else 2)
    assert m["num_block_loads"] == 3 * m["num_streamed_blocks"]
    assert torch.equal(pipe.denoise(inputs, 3), expected)  # after disable


def test_reloading_weights_into_an_offloaded_tiny_flux_serves_exactly_a_fresh_resident_load() -> None:
    import weight_sync

    b = _FluxPipeline(tiny_flux_transformer(seed=3))
    inputs = tiny_flux_inputs(seed=1)
    expected = b.denoise(inputs, 2)
    off = _FluxPipeline(tiny_flux_transformer(seed=0))
    cfg = OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu")
    with enable_layerwise_offload(off, cfg) as handle:
        assert not torch.equal(off.denoise(inputs, 2), expected)
        weights = [(k, v.detach().clone()) for k, v in b.transformer.state_dict().items()]
        report = weight_sync.reload_weights(off.transformer, weights_iterator=iter(weights))
        assert torch.equal(off.denoise(inputs, 2), expected)
        assert report.fingerprint == weight_sync.fingerprint(b.transformer)
        assert handle.fingerprint(off.transformer) == report.fingerprint


def test_an_fp8_streamed_tiny_flux_requantizes_on_update_into_exactly_a_fresh_quantized_load() -> None:
    import weight_sync
    from weight_sync.quant.modules import quantize_linears

    b = _FluxPipeline(tiny_flux_transformer(seed=3))
    weights = [(k, v.detach().clone()) for k, v in b.transformer.state_dict().items()]
    ref = copy.deepcopy(b)  # the resident model quantized the same way (every block's linears)
    for blocks in (ref.transformer.transformer_blocks, ref.transformer.single_transformer_blocks):
        for block in blocks:
            quantize_linears(block, "fp8_block")
    inputs = tiny_flux_inputs(seed=1)
    expected = ref.denoise(inputs, 2)
    cfg = OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device="cpu",
                        quantization="fp8_block")
    with enable_layerwise_offload(copy.deepcopy(b), cfg) as fresh:
        fresh_arena = fresh.store.arena.clone()  # type: ignore[union-attr]
    off = _FluxPipeline(tiny_flux_transformer(seed=0))
    with enable_layerwise_offload(off, cfg) as handle:
        assert not torch.equal(off.denoise(inputs, 2), expected)
        weight_sync.reload_weights(off.transformer, weights_iterator=iter(weights))
        assert torch.equal(handle.store.arena, fresh_arena)  # type: ignore[union-attr]
        assert torch.equal(off.denoise(inputs, 2), expected)
        assert handle.fingerprint(off.transformer) == weight_sync.fingerprint(ref.transformer)
