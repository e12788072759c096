"""Quantized block streaming: the registry's bytes on the host, on the link and in the slots.

The oracle is "the resident model quantized the same way": a copy of the same modules whose block
linears are replaced by ``weight_sync.quant.modules.QuantizedLinear`` (the registry's processor), kept resident,
built without any offload code.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.offload import _workers
from weight_sync.errors import ConfigError
from weight_sync.offload import OffloadConfig, enable_layerwise_offload, load_host_weights
from weight_sync.quant import make_linear_method
from weight_sync.quant.modules import QuantizedLinear, quantize_linears
from weight_sync.testing import run_distributed
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

NAMES = ["fp8", "fp8_per_channel", "fp8_block", "int8"]


def _config(**kw: object) -> OffloadConfig:
    return OffloadConfig(enable_distributed_layerwise_offload=True, device="cpu", **kw)  # type: ignore[arg-type]


def _base(**dit: int) -> SyntheticDiTPipeline:
    torch.manual_seed(0)
    opts = {"hidden": 128, "num_blocks": 3, **dit}
    return SyntheticDiTPipeline(DiTConfig(**opts)).to(torch.bfloat16).eval()


def _resident_quantized(base: SyntheticDiTPipeline, name: str) -> SyntheticDiTPipeline:
    ref = copy.deepcopy(base)
    for block in ref.transformer.blocks:
        quantize_linears(block, name)
    return ref


@pytest.mark.parametrize("name", NAMES)
def test_quantized_linear_holds_exactly_the_bytes_of_the_registrys_processor(name: str) -> None:
    # 200 x 300: ragged 128 x 128 tiles, so 'fp8_block' pads its edge tiles.
    torch.manual_seed(1)
    linear = nn.Linear(300, 200).to(torch.bfloat16)
    expected_q, expected_scale = make_linear_method(name).quantize(linear.weight.detach(), None)
    q = QuantizedLinear(linear, name)
    assert q.weight.dtype == expected_q.dtype != torch.bfloat16
    assert torch.equal(q.weight.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(q.weight_scale, expected_scale)
    assert q.bias is linear.bias
    assert type(linear.weight) is nn.Parameter and linear.weight.dtype == torch.bfloat16  # untouched


@pytest.mark.parametrize("name", NAMES)
def test_quantized_offload_output_is_bitwise_equal_to_the_resident_quantized_model_over_several_steps(
    name: str,
) -> None:
    base = _base()
    ref, off = _resident_quantized(base, name), copy.deepcopy(base)
    expected = ref.generate(tokens=16, num_inference_steps=3, seed=2)
    handle = enable_layerwise_offload(off, _config(quantization=name))
    seen: set[tuple[torch.dtype, int]] = set()

    def record(module: nn.Module, args: object) -> None:  # what the block computes from
        w = module.qkv.weight
        seen.add((w.dtype, w.untyped_storage().data_ptr()))

    hooks = [b.register_forward_pre_hook(record) for b in off.transformer.blocks]
    out = off.generate(tokens=16, num_inference_steps=3, seed=2)
    again = off.generate(tokens=16, num_inference_steps=3, seed=2)
    for h in hooks:
        h.remove()
    assert torch.equal(out, expected) and torch.equal(again, expected)
    assert handle.streamer is not None
    slots = {s.untyped_storage().data_ptr() for s in handle.streamer.slots}
    assert seen == {(ref.transformer.blocks[0].qkv.weight.dtype, p) for p in slots}
    m = handle.metrics()
    assert (m["quantization"], m["num_quantized_linears"], m["host_storage"]) == (name, 12, "packed")
    # Unquantized for comparison: the dense model is clearly different, so equality above means something.
    assert not torch.equal(base.generate(tokens=16, num_inference_steps=3, seed=2), expected)
    handle.disable()
    # disable() keeps kernel format: the resident model is the quantized one.
    assert torch.equal(off.generate(tokens=16, num_inference_steps=3, seed=2), expected)


def test_quantized_host_and_link_bytes_are_about_half_of_bf16() -> None:
    base = _base(hidden=256)
    dense, fp8 = copy.deepcopy(base), copy.deepcopy(base)
    with enable_layerwise_offload(dense, _config()) as hd:
        dense.generate(tokens=8, num_inference_steps=2)
        dm = hd.metrics()
    with enable_layerwise_offload(fp8, _config(quantization="fp8_block")) as hq:
        fp8.generate(tokens=8, num_inference_steps=2)
        qm = hq.metrics()
    # The fp8 weights are half of bf16; scales (one fp32 per 128 x 128 tile) and bf16 biases add ~1%.
    assert 0.49 <= qm["host_bytes"] / dm["host_bytes"] <= 0.52
    assert 0.49 <= qm["h2d_bytes"] / dm["h2d_bytes"] <= 0.52
    assert qm["num_block_loads"] == dm["num_block_loads"]
    assert qm["slot_bytes"] < 0.52 * dm["slot_bytes"]


@pytest.mark.parametrize("source", ["checkpoint_mmap", "runtime_cache"])
def test_quantized_blocks_of_mapped_host_weights_stage_through_two_buffers(source: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    base = _base()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in base.transformer.state_dict().items()}, str(ckpt / "model.safetensors"))
    ref = _resident_quantized(base, "fp8_block")
    expected = ref.generate(tokens=16, num_inference_steps=3)
    torch.manual_seed(5)  # different init: only the checkpoint can make the outputs equal
    off = SyntheticDiTPipeline(base.transformer.config).to(torch.bfloat16).eval()
    cache = {"dlo_enable_runtime_cache": True, "dlo_runtime_cache_dir": str(tmp_path / "cache")}
    config = _config(dlo_use_allgather=False, quantization="fp8_block", **(cache if source == "runtime_cache" else {}))
    host = load_host_weights(off.transformer, ckpt, config)
    assert host.source == source
    with enable_layerwise_offload(off, config) as handle:
        assert torch.equal(off.generate(tokens=16, num_inference_steps=3), expected)
        m = handle.metrics()
    assert m["host_storage"] == "staged" and m["host_weights_source"] == source
    # Only the unprocessed biases are still views of the mapping; the fp8 bytes are processor output.
    bias_bytes = sum(b.numel() * 2 for blk in base.transformer.blocks for b in
                     (blk.qkv.bias, blk.proj.bias, blk.fc1.bias, blk.fc2.bias))
    assert m["mapped_bytes"] == bias_bytes


def test_an_enable_that_fails_after_quantizing_leaves_the_linears_unquantized() -> None:
    off = _base()
    # A block bias tied to a non-block module: enable rejects it after the linears were replaced.
    off.transformer.proj_in.bias = off.transformer.blocks[0].fc2.bias
    with pytest.raises(ConfigError, match="also used outside the streamed blocks"):
        enable_layerwise_offload(off, _config(quantization="fp8"))
    assert all(type(m) is nn.Linear for b in off.transformer.blocks for m in b.children())
    assert off.transformer.blocks[0].fc2.weight.dtype == torch.bfloat16


def test_enabling_again_with_another_quantization_is_rejected_with_both_names() -> None:
    off = _base()
    enable_layerwise_offload(off, _config(quantization="fp8_block")).disable()
    with pytest.raises(ConfigError, match=r"quantization='int8' \(int8_channel\).*\['fp8_block'\]"):
        enable_layerwise_offload(off, _config(quantization="int8"))
    with enable_layerwise_offload(off, _config(quantization="fp8_block")) as handle:  # same scheme: fine
        assert handle.metrics()["num_quantized_linears"] == 12


@pytest.mark.parametrize("name", ["fp8", "fp8_block"])
def test_allgather_dp2_quantized_output_is_bitwise_equal_to_the_resident_quantized_model(name: str) -> None:
    results = run_distributed(_workers.quantized_allgather_equal, 2, {"num_blocks": 3, "hidden": 128}, name, 3)
    for r in results:
        assert r["equal"] and r["equal_after_disable"]
        m = r["metrics"]
        assert m["gather_group_size"] == 2 and m["host_storage"] == "packed"
        assert m["num_gathers"] >= 9 and m["fabric_bytes"] > 0
        # Each rank holds half of the quantized blocks: a quarter of their bf16 bytes.
        assert 0.49 * m["block_bytes"] <= m["host_bytes"] <= 0.55 * m["block_bytes"]
        assert 0.24 <= m["host_bytes"] / r["dense_block_bytes"] <= 0.28


def test_ranks_that_quantize_differently_fail_at_the_schedule_digest_unquantized() -> None:
    for msg in run_distributed(_workers.mismatched_quantization, 2, timeout_s=120):
        assert "transfer schedule differs" in msg
        assert msg.endswith("still nn.Linear: True")
