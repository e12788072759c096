"""Tiny transformers models matching the shared tiny checkpoints (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def load_hf(path: Path, dtype: torch.dtype = torch.bfloat16):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


@pytest.fixture
def hf_b(qwen3_b: Path):
    return load_hf(qwen3_b)
