"""An ``AsyncLLM`` (its event loop on another thread, as in a server) driven by the trainer-side client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import ENGINE_ARGS, MAX_TOKENS, PROMPTS, checkpoint_items

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def async_engine(vllm_ckpts: dict[str, Path], fresh_tokens) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from weight_sync.integrations.vllm import engine_kwargs

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    args = AsyncEngineArgs(model=str(vllm_ckpts["a"]), **ENGINE_ARGS, **engine_kwargs())

    async def build() -> Any:
        return AsyncLLM.from_engine_args(args)

    engine = asyncio.run_coroutine_threadsafe(build(), loop).result(600)
    try:
        yield engine, loop
    finally:
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)


def _generate(engine: Any, loop: asyncio.AbstractEventLoop) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def one(i: int, prompt: str) -> list[int]:
        final = None
        async for out in engine.generate(prompt, params, request_id=f"ws-test-{id(params)}-{i}"):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    async def all_prompts() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))

    return asyncio.run_coroutine_threadsafe(all_prompts(), loop).result(300)


def test_pushes_and_iterator_reloads_reach_an_async_engine(async_engine, vllm_ckpts, fresh_tokens) -> None:
    from weight_sync.integrations.vllm import AsyncLLMControl, WeightSyncClient

    engine, loop = async_engine
    assert _generate(engine, loop) == fresh_tokens["a"]
    with WeightSyncClient(AsyncLLMControl(engine, loop, timeout_s=300)) as client:
        client.connect()
        client.push(dict(checkpoint_items(vllm_ckpts["b"])), version="v1")
        assert _generate(engine, loop) == fresh_tokens["b"]
        assert client.weight_version() == "v1"
        # An iterator crosses AsyncLLM's RPC through a spool (tensors cannot be pickled to workers).
        [report] = client.reload_weights(weights_iterator=iter(checkpoint_items(vllm_ckpts["a"])))
        assert report["num_tensors"] == 25
        assert _generate(engine, loop) == fresh_tokens["a"]
