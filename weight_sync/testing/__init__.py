"""Shipped test helpers: tiny local checkpoints and multi-rank launching (no network, CPU first)."""

from weight_sync.testing.checkpoint import (
    ARCHS,
    PRESETS,
    hf_config,
    make_checkpoint,
    random_weights,
    write_tokenizer,
)
from weight_sync.testing.compare import assert_bitwise_equal, bitwise_equal, kernel_tensors
from weight_sync.testing.distributed import DistributedFailure, run_distributed

__all__ = [
    "ARCHS",
    "PRESETS",
    "DistributedFailure",
    "assert_bitwise_equal",
    "bitwise_equal",
    "hf_config",
    "kernel_tensors",
    "make_checkpoint",
    "random_weights",
    "run_distributed",
    "write_tokenizer",
]
