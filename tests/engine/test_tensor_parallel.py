"""Tensor parallelism over gloo: two spawned ranks give the logits and tokens of one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from weight_sync.engine import ReferenceEngine
from weight_sync.testing import make_checkpoint, run_distributed

PROMPT = [[5, 6, 7, 8, 9, 10]]


def _tp_logits(rank: int, world: int, path: str) -> tuple[torch.Tensor, list[list[int]]]:
    engine = ReferenceEngine.from_checkpoint(path, dtype=torch.float32, tp_group=dist.group.WORLD)
    return engine.logits(PROMPT), engine.generate(PROMPT, 6)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tp2_logits_equal_tp1(arch: str, tmp_path: Path) -> None:
    # llama tiny is tied; kv heads (2) == tp (2); qwen3 with kv heads 1 < tp replicates KV heads.
    overrides = {"num_key_value_heads": 1} if arch == "qwen3" else {}
    path = make_checkpoint(tmp_path / arch, arch=arch, vocab_size=1000, **overrides)
    ref = ReferenceEngine.from_checkpoint(path, dtype=torch.float32)
    results = run_distributed(_tp_logits, 2, str(path))
    for logits, tokens in results:
        torch.testing.assert_close(logits, ref.logits(PROMPT))
        assert tokens == ref.generate(PROMPT, 6)
