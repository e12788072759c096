"""Shipped test helpers: tiny local checkpoints and multi-rank launching (no network, CPU first)."""

from weight_sync.testing.checkpoint import (
    ARCHS,
    MOE_PRESETS,
    PRESETS,
    hf_config,
    make_checkpoint,
    random_weights,
    write_tokenizer,
)
from weight_sync.testing.compare import assert_bitwise_equal, bitwise_equal, kernel_tensors
from weight_sync.testing.distributed import DistributedFailure, rank_context, run_distributed
from weight_sync.testing.dit import (
    DiTBlock,
    DiTConfig,
    SyntheticDiT,
    SyntheticDiTPipeline,
    make_latents,
    tiny_flux_inputs,
    tiny_flux_transformer,
)

__all__ = [
    "ARCHS",
    "MOE_PRESETS",
    "PRESETS",
    "DiTBlock",
    "DiTConfig",
    "DistributedFailure",
    "SyntheticDiT",
    "SyntheticDiTPipeline",
    "assert_bitwise_equal",
    "bitwise_equal",
    "hf_config",
    "kernel_tensors",
    "make_checkpoint",
    "make_latents",
    "random_weights",
    "rank_context",
    "run_distributed",
    "tiny_flux_inputs",
    "tiny_flux_transformer",
    "write_tokenizer",
]
