"""Weight updates under ``AsyncLLM.pause_generation``, multiprocess: plain vLLM and weight_sync, all three modes.

An ``AsyncLLM`` (engine core and worker in their own processes, its event loop on a thread as in a server)
generates one long request; once it has streamed ``BEFORE`` tokens the test pauses, updates to B, and a
second request arrives before ``resume_generation``. The engine runs on by itself, so where the update
lands is read from the final output's ``weight_versions`` spans, and every token is checked against the
two-model oracle of ``_async_oracle`` at that point (old model's KV kept, or the prefix recomputed by the
new model), teacher-forced: this worker process's bf16 kernels and an in-process engine's pick different
tokens at near-ties, so exact comparisons across engines are made in ``test_async_pause.py`` (in process,
same schedule) only. Every scenario runs on plain vLLM first (the reference), then through weight_sync's
reload and its RL API; each also checks that the other KV hypothesis is rejected.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm._async_oracle import LOGIT_TOLERANCE, KeptKVOracle
from tests.integrations.vllm.conftest import ENGINE_ARGS, PROMPTS, checkpoint_items
from tests.integrations.vllm.test_async_pause import BEFORE, MAX_TOKENS, Completion, _completion

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LONG, SHORT = PROMPTS[1], PROMPTS[0]


class AsyncEngine:
    """An AsyncLLM whose event loop runs on its own thread; ``run`` waits for a coroutine on it."""

    def __init__(self, model: Path, *, weight_sync: bool) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from weight_sync.integrations.vllm import engine_kwargs

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        args = AsyncEngineArgs(model=str(model), **ENGINE_ARGS, **(engine_kwargs() if weight_sync else {}))

        async def build() -> Any:
            return AsyncLLM.from_engine_args(args)

        self.engine = self.run(build())

    def run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)  # type: ignore[arg-type]

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


@pytest.fixture(scope="module")
def engines(vllm_ckpts: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """AsyncLLMs on A with and without weight_sync, started together."""
    with ThreadPoolExecutor(2) as pool:
        ws = pool.submit(AsyncEngine, vllm_ckpts["a"], weight_sync=True)
        plain = pool.submit(AsyncEngine, vllm_ckpts["a"], weight_sync=False)
        built: dict[str, Any] = {"ws": ws.result(), "plain": plain.result()}
    try:
        yield built
    finally:
        for eng in built.values():
            eng.close()


@pytest.fixture(scope="module")
def kept_kv(vllm_ckpts: dict[str, Path]) -> KeptKVOracle:
    return KeptKVOracle(vllm_ckpts["a"], vllm_ckpts["b"])


Update = Callable[[Any], Awaitable[None]]


def reload_to(ckpt: Path, version: str) -> Update:
    async def update(engine: Any) -> None:
        await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)})
        await engine.update_weight_version(version)

    return update


async def _schedule(engine: Any, tag: str, update: Update, mode: str | None, clear_cache: bool) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    started = asyncio.Event()

    async def request(rid: str, prompt: str, signal: bool) -> Any:
        final = None
        async for out in engine.generate(prompt, params, request_id=rid):
            final = out
            if signal and len(out.outputs[0].token_ids) >= BEFORE:
                started.set()
        return final

    running = asyncio.create_task(request(f"{tag}-long", LONG, True))
    await started.wait()
    if mode is not None:
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
    finished_at_pause = running.done()
    late = asyncio.create_task(request(f"{tag}-late", SHORT, False))
    await update(engine)
    if mode is not None:
        await engine.resume_generation()
    return {"long": _completion(await running), "late": _completion(await late),
            "finished_at_pause": finished_at_pause}


def run_schedule(engines: dict[str, Any], key: str, tag: str, update: Update, *, mode: str | None,
                 clear_cache: bool = False, restore: Path) -> dict:
    """One scenario on ``engines[key]``; afterwards the engine serves ``restore`` again, caches empty."""
    eng = engines[key]
    try:
        return eng.run(_schedule(eng.engine, f"{tag}-{key}", update, mode, clear_cache))
    finally:
        eng.run(eng.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(restore)}))
        eng.run(eng.engine.reset_prefix_cache())
        eng.run(eng.engine.update_weight_version("default"))


def switch_of(c: Completion, old: str, new: str) -> int:
    """Where the tokens' label changes from ``old`` to ``new`` (asserting exactly those two spans)."""
    assert c.spans is not None and len(c.spans) == 2, c.spans
    (v0, s0, e0), (v1, s1, e1) = c.spans
    assert (v0, s0, v1, e1) == (old, 0, new, MAX_TOKENS) and e0 == s1
    return s1


def assert_tokens(oracle: KeptKVOracle, c: Completion, switch: int, *, kept: bool) -> None:
    """Every token is the oracle's greedy choice (within tolerance) and the other KV hypothesis is not."""
    assert max(oracle.deficits(c.prompt_ids, c.tokens, switch, kept=kept)) <= LOGIT_TOLERANCE
    if 0 < switch < len(c.tokens):
        assert max(oracle.deficits(c.prompt_ids, c.tokens, switch, kept=not kept)) > 4 * LOGIT_TOLERANCE


def assert_late_served_by_b(oracle: KeptKVOracle, out: dict, version: str) -> None:
    assert out["late"].spans == [(version, 0, MAX_TOKENS)]
    assert_tokens(oracle, out["late"], 0, kept=False)


@pytest.fixture(scope="module")
def rl_client(engines: dict[str, Any]) -> Iterator[Any]:
    """A trainer-side client of the weight_sync AsyncLLM, connected once (vLLM's RL API over gloo)."""
    from weight_sync.integrations.vllm import AsyncLLMControl, WeightSyncClient

    eng = engines["ws"]
    with WeightSyncClient(AsyncLLMControl(eng.engine, eng.loop, timeout_s=300)) as client:
        client.connect()
        yield client


def rl_push(client: Any, ckpt: Path, version: int) -> Update:
    """An update through vLLM's RL API (start / update / finish with the version) from a trainer thread."""
    items = dict(checkpoint_items(ckpt))

    async def update(engine: Any) -> None:
        await asyncio.to_thread(client.push, items, version=version)

    return update


VARIANTS = ("plain", "ws reload", "ws rl api")


def _update_for(variant: str, ckpts: dict[str, Path], client: Any) -> tuple[str, Update]:
    if variant == "ws rl api":
        return "ws", rl_push(client, ckpts["b"], 1)
    return variant.split()[0], reload_to(ckpts["b"], "1")


@pytest.mark.parametrize("variant", VARIANTS)
def test_keep_continues_the_request_on_its_old_kv(engines, vllm_ckpts, kept_kv, rl_client, variant) -> None:
    key, update = _update_for(variant, vllm_ckpts, rl_client)
    out = run_schedule(engines, key, "keep", update, mode="keep", restore=vllm_ckpts["a"])
    long = out["long"]
    assert not out["finished_at_pause"] and long.finish_reason == "length"
    assert_tokens(kept_kv, long, switch_of(long, "default", "1"), kept=True)
    assert_late_served_by_b(kept_kv, out, "1")


@pytest.mark.parametrize("variant", VARIANTS)
def test_keep_with_clear_cache_recomputes_the_request_with_the_new_weights(
    engines, vllm_ckpts, kept_kv, rl_client, variant
) -> None:
    key, update = _update_for(variant, vllm_ckpts, rl_client)
    out = run_schedule(engines, key, "keepclear", update, mode="keep", clear_cache=True, restore=vllm_ckpts["a"])
    long = out["long"]
    assert not out["finished_at_pause"] and long.finish_reason == "length"
    assert_tokens(kept_kv, long, switch_of(long, "default", "1"), kept=False)
    assert_late_served_by_b(kept_kv, out, "1")


@pytest.mark.parametrize("variant", VARIANTS)
def test_abort_ends_the_request_before_the_update(engines, vllm_ckpts, kept_kv, rl_client, variant) -> None:
    key, update = _update_for(variant, vllm_ckpts, rl_client)
    out = run_schedule(engines, key, "abort", update, mode="abort", restore=vllm_ckpts["a"])
    long = out["long"]
    assert out["finished_at_pause"] and long.finish_reason == "abort"
    assert BEFORE <= len(long.tokens) < MAX_TOKENS
    assert long.spans == [("default", 0, len(long.tokens))]
    assert_tokens(kept_kv, long, len(long.tokens), kept=True)
    assert_late_served_by_b(kept_kv, out, "1")


@pytest.mark.parametrize("variant", VARIANTS)
def test_wait_lets_the_request_finish_on_the_old_weights_first(
    engines, vllm_ckpts, kept_kv, rl_client, variant
) -> None:
    key, update = _update_for(variant, vllm_ckpts, rl_client)
    out = run_schedule(engines, key, "wait", update, mode="wait", restore=vllm_ckpts["a"])
    long = out["long"]
    assert out["finished_at_pause"] and long.finish_reason == "length"
    assert long.spans == [("default", 0, MAX_TOKENS)]
    assert_tokens(kept_kv, long, MAX_TOKENS, kept=True)
    assert_late_served_by_b(kept_kv, out, "1")


def test_without_a_pause_weight_sync_holds_recomputes_and_labels_every_token_with_its_version(
    engines, vllm_ckpts, kept_kv, rl_client
) -> None:
    out = run_schedule(engines, "ws", "nopause", rl_push(rl_client, vllm_ckpts["b"], 9), mode=None,
                       restore=vllm_ckpts["a"])
    long = out["long"]
    assert long.finish_reason == "length"
    assert_tokens(kept_kv, long, switch_of(long, "default", "9"), kept=False)
    # Without a pause the second request may start before the update does.
    late = out["late"]
    assert_tokens(kept_kv, late, 0 if late.spans == [("9", 0, MAX_TOKENS)] else switch_of(late, "default", "9"),
                  kept=False)
