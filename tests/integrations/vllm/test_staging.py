"""Updates staged inside vLLM's worker while the engine generates, committed between two scheduler steps.

In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the test steps the engine itself, so the
staged update is in flight (its source held at a gate halfway) for a known number of steps, staged and
uncommitted for a few more, and committed after exactly ``k`` tokens. The worker's listener thread
receives from the trainer-side sender (a thread of this process) the whole time.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.vllm._async_oracle import fresh_continuation
from tests.integrations.vllm.conftest import (
    PROMPTS,
    checkpoint_items,
    driver_model,
    greedy,
    multiprocessing_env,
    start_llm,
    stop_llm,
)
from tests.integrations.vllm.trainer_process import run_trainer

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
BEFORE = 3  # tokens each request has when the push starts
IN_FLIGHT = 2  # steps while the update is being received into the twin
STAGED = 2  # steps while it is staged and not committed
SWITCH = BEFORE + IN_FLIGHT + STAGED  # tokens computed with the old version
TIMEOUT_S = 6.0


class GatedSource:
    """The update's tensors in manifest order; the first half, then it waits for ``release``."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        from weight_sync.layers.blocks import order_by_block

        mapping = dict(items)
        self.items = [(n, mapping[n]) for n in order_by_block(list(mapping))]
        self.reached = threading.Event()
        self.release = threading.Event()

    def manifest(self, version: Any) -> Any:
        from weight_sync.manifest import Manifest

        return Manifest.from_named_tensors(self.items, version=version)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.items):
            if i == len(self.items) // 2:
                self.reached.set()
                assert self.release.wait(60), "the test never released the gate"
            yield item


@pytest.fixture(scope="module")
def engines(vllm_ckpts: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """weight_sync's engine on A and a fresh plain engine on B (the oracle of the new version)."""
    built = {"ws": start_llm(vllm_ckpts["a"]), "fresh_b": start_llm(vllm_ckpts["b"], weight_sync=False)}
    try:
        yield built
    finally:
        for llm in built.values():
            stop_llm(llm)


@pytest.fixture(scope="module")
def client(engines: dict[str, Any]) -> Iterator[Any]:
    from weight_sync.integrations.vllm import LLMControl
    from weight_sync.integrations.vllm.staging import StagingClient
    from weight_sync.transport import TransportConfig

    transport = TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=TIMEOUT_S)
    with StagingClient(LLMControl(engines["ws"]), transport) as c:
        c.connect()
        yield c


@pytest.fixture(scope="module")
def served_a(engines: dict[str, Any]) -> dict[str, Any]:
    """What weight_sync's engine serves on A when nothing is staged: the schedule's tokens and spans."""
    return run_schedule(engines["ws"], "baseline", lambda: None)


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _back_to_a(llm: Any, ckpt_a: Path) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt_a)})
    llm.reset_prefix_cache()
    llm.llm_engine.set_weight_version("default")


def run_schedule(llm: Any, tag: str, at: Callable[[], Any] | None = None, **hooks: Callable[[], Any]) -> dict[str, Any]:
    """Both prompts generate; ``hooks[f"after_{n}"]`` runs once every request has ``n`` tokens; a late
    request arrives after the last hook. Returns {name: (prompt_ids, tokens, spans)}."""
    from vllm import SamplingParams

    engine, core = llm.llm_engine, _core(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = {f"{tag}-{i}": f"p{i}" for i in range(len(PROMPTS))}
    for rid, prompt in zip(ids, PROMPTS):
        engine.add_request(rid, prompt, params)
    seen: dict[str, Any] = {}
    pending = sorted((int(k.split("_")[1]), fn) for k, fn in hooks.items())
    if at is not None:
        pending.insert(0, (0, at))

    def generated(rid: str) -> int:
        return len(seen[rid].outputs[0].token_ids) if rid in seen else 0

    while core.scheduler.has_unfinished_requests():
        while pending and all(generated(rid) >= pending[0][0] for rid in list(ids)):
            pending.pop(0)[1]()
            if not pending:
                engine.add_request(f"{tag}-late", PROMPTS[0], params)
                ids[f"{tag}-late"] = "late"
        for out in engine.step():
            seen[out.request_id] = out
    out = {}
    for rid, name in ids.items():
        o = seen[rid].outputs[0]
        spans = [(s.version, s.start, s.end) for s in o.weight_versions or []]
        out[name] = (list(seen[rid].prompt_token_ids), list(o.token_ids), spans)
    return out


def _steps_while(llm: Any, n: int) -> None:
    engine = llm.llm_engine
    for _ in range(n):
        engine.step()


def test_tokens_are_the_old_versions_while_staging_and_the_new_versions_from_the_commit_on(
    engines, client, served_a, vllm_ckpts
) -> None:
    from weight_sync.integrations.vllm.model_hooks import kernel_fingerprint

    llm = engines["ws"]
    source = GatedSource(checkpoint_items(vllm_ckpts["b"]))
    seen: dict[str, Any] = {}

    def start_push() -> None:
        seen["handle"] = client.push(source, version=2)
        assert source.reached.wait(30)
        # The sender is past its start (every worker's twin opened the update) and holds the rest back.
        seen["in_flight"] = client.status()[0]

    def release() -> None:
        source.release.set()
        seen["handle"].wait(60)
        seen["staged"] = client.status(version=2)[0]

    def commit() -> None:
        seen["commit"] = client.commit(version=2)[0]

    try:
        got = run_schedule(llm, "staged", None, **{f"after_{BEFORE}": start_push,
                                                    f"after_{BEFORE + IN_FLIGHT}": release,
                                                    f"after_{SWITCH}": commit})
        fingerprint = llm.collective_rpc("ws_fingerprint")[0]
    finally:
        source.release.set()
        _back_to_a(llm, vllm_ckpts["a"])
    assert seen["in_flight"]["staging"] and seen["in_flight"]["pending"] is None
    assert seen["staged"]["pending"] == 2 and seen["staged"]["committed"] is None
    assert seen["commit"]["version"] == 2 and seen["commit"]["num_bytes"] == seen["staged"]["num_bytes"] > 0
    fresh_b = engines["fresh_b"]
    for name in ("p0", "p1"):
        prompt_ids, tokens, spans = got[name]
        assert tokens[:SWITCH] == served_a[name][1][:SWITCH]
        # The commit reset the caches: the rest is B's continuation of prompt + the tokens before.
        assert tokens[SWITCH:] == fresh_continuation(fresh_b, prompt_ids, tokens[:SWITCH], MAX_TOKENS - SWITCH)
        assert spans == [("default", 0, SWITCH), ("2", SWITCH, MAX_TOKENS)]
    late_ids, late, late_spans = got["late"]
    assert late == fresh_continuation(fresh_b, late_ids, [], MAX_TOKENS)
    assert late_spans == [("2", 0, MAX_TOKENS)]
    assert fingerprint == kernel_fingerprint(driver_model(fresh_b))


def test_a_commit_under_a_keep_pause_continues_the_kept_requests_on_their_old_kv_and_labels_the_new_version(
    engines, client, vllm_ckpts
) -> None:
    from tests.integrations.vllm._async_oracle import LOGIT_TOLERANCE, KeptKVOracle

    llm = engines["ws"]
    core = _core(llm)

    def commit_under_pause() -> None:
        client.push(checkpoint_items(vllm_ckpts["b"]), version=4).wait(60)
        core.pause_scheduler(mode="keep", clear_cache=False)
        client.commit(version=4)
        core.resume_scheduler()

    try:
        got = run_schedule(llm, "kept", None, **{f"after_{BEFORE}": commit_under_pause})
    finally:
        _back_to_a(llm, vllm_ckpts["a"])
    oracle = KeptKVOracle(vllm_ckpts["a"], vllm_ckpts["b"])
    for name in ("p0", "p1"):
        prompt_ids, tokens, spans = got[name]
        assert spans == [("default", 0, BEFORE), ("4", BEFORE, MAX_TOKENS)]
        # A's KV for the prefix, B's weights from the first token after the commit on; not recomputed.
        assert max(oracle.deficits(prompt_ids, tokens, BEFORE)) <= LOGIT_TOLERANCE
        assert max(oracle.deficits(prompt_ids, tokens, BEFORE, kept=False)) > 4 * LOGIT_TOLERANCE
    late_ids, late, late_spans = got["late"]
    assert late_spans == [("4", 0, MAX_TOKENS)]
    assert late == fresh_continuation(engines["fresh_b"], late_ids, [], MAX_TOKENS)


def _bad_shape(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    name = "model.layers.0.mlp.down_proj.weight"
    return [(n, torch.zeros(128, 7, dtype=torch.bfloat16) if n == name else t) for n, t in items]


def _flip_a_byte(llm: Any) -> Callable[[], None]:
    """Corrupt one payload byte of bucket 1 on the worker after it arrived (a bad wire); returns the undo."""
    receiver = llm.llm_engine.model_executor.driver_worker.worker._ws_staging.receiver
    plane = receiver._plane
    real_wait = plane.wait

    def wait(k: int, i: int, host: bool = True) -> Any:
        out = real_wait(k, i, host)
        if k == 1:
            receiver._buffers[i][100] ^= 0x5A
        return out

    plane.wait = wait
    return lambda: setattr(plane, "wait", real_wait)


@pytest.mark.parametrize("failure", ["bad_manifest", "checksum"])
def test_a_staged_update_that_fails_changes_no_served_token_and_leaves_nothing_pending(
    engines, client, served_a, vllm_ckpts, failure
) -> None:
    from weight_sync.errors import WeightSyncError

    llm = engines["ws"]
    items = checkpoint_items(vllm_ckpts["b"])
    undo = _flip_a_byte(llm) if failure == "checksum" else (lambda: None)
    before = client.status()[0]
    seen: dict[str, Any] = {}

    def failing_push() -> None:
        handle = client.push(_bad_shape(items) if failure == "bad_manifest" else items, version=9)
        with pytest.raises(WeightSyncError, match=r"\(128, 7\)|hecksum") as e:
            handle.wait(60)
        seen["error"] = str(e.value)
        seen["status"] = client.status(version=9)[0]
        with pytest.raises(Exception, match=r"staged versions \['None'\]"):
            client.commit(version=9)

    try:
        got = run_schedule(llm, f"fails-{failure}", None, **{f"after_{BEFORE}": failing_push})
    finally:
        undo()
    assert got == {**served_a, "late": got["late"]}
    assert got["late"][1] == served_a["p0"][1]
    assert {s[0] for _, _, spans in got.values() for s in spans} == {"default"}
    status = seen["status"]
    assert status["pending"] is None and status["num_failed"] == before["num_failed"] + 1
    assert status["listening"] and status["last_error"]
    assert llm.collective_rpc("ws_status")[0]["torn"] is None


def test_a_trainer_killed_while_staging_changes_no_served_token_and_the_engine_keeps_serving(
    engines, client, served_a, vllm_ckpts
) -> None:
    llm = engines["ws"]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=run_trainer, args=(child, [("die", str(vllm_ckpts["b"]))], TIMEOUT_S))
    proc.start()
    try:
        assert conn.poll(120), "the trainer process did not answer within 120 s"
        address = conn.recv()

        def connect_to_the_dying_trainer() -> None:
            llm.collective_rpc("ws_stage_init", kwargs={"address": address})

        got = run_schedule(llm, "killed", connect_to_the_dying_trainer)
        proc.join(60)
        assert proc.exitcode == -9
        # The listener learns of the death within the wire timeout (a bounded wait on its own report).
        deadline = time.monotonic() + 4 * TIMEOUT_S
        while (status := llm.collective_rpc("ws_stage_status")[0])["listening"] and time.monotonic() < deadline:
            _steps_while(llm, 1)
        after = run_schedule(llm, "after-killed", lambda: None)
    finally:
        if proc.is_alive():
            proc.kill()
        client.connect()  # back to the module's sender for the tests after this one
    assert got == {**served_a, "late": got["late"]} and after == {**served_a, "late": after["late"]}
    assert not status["listening"] and status["pending"] is None and status["last_error"]
    assert llm.collective_rpc("ws_status")[0]["torn"] is None


def test_the_twin_is_refused_before_it_is_built_when_over_max_bytes_and_its_memory_is_reported(
    engines, client
) -> None:
    llm = engines["ws"]
    [connected] = client.connect()
    size = connected["estimate_bytes"]
    with pytest.raises(Exception, match=rf"about {size} bytes, over StagingConfig.max_bytes=1"):
        llm.collective_rpc("ws_stage_init", kwargs={"address": "127.0.0.1:1", "max_bytes": 1})
    status = client.status()[0]
    assert status["listening"] and status["num_bytes"] > 0 and size >= status["num_bytes"]


@pytest.fixture(scope="module")
def async_engine(vllm_ckpts: dict[str, Path]) -> Iterator[Any]:
    """A multiprocess AsyncLLM on A with weight_sync (engine core and worker in their own process)."""
    from tests.integrations.vllm.test_async_pause_mp import AsyncEngine

    with multiprocessing_env(True):
        eng = AsyncEngine(vllm_ckpts["a"], weight_sync=True)
    try:
        yield eng
    finally:
        eng.close()


def test_a_multiprocess_asyncllm_streams_the_old_version_while_staging_and_commits_between_two_steps(
    async_engine, vllm_ckpts
) -> None:
    import asyncio

    from vllm import SamplingParams

    from tests.integrations.vllm._async_oracle import LOGIT_TOLERANCE, KeptKVOracle
    from tests.integrations.vllm.test_async_pause import _completion
    from weight_sync.integrations.vllm import AsyncLLMControl
    from weight_sync.integrations.vllm.staging import StagingClient
    from weight_sync.transport import TransportConfig

    engine, long_tokens = async_engine.engine, 96
    transport = TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=TIMEOUT_S)
    client = StagingClient(AsyncLLMControl(engine, async_engine.loop, timeout_s=120), transport)
    source = GatedSource(checkpoint_items(vllm_ckpts["b"]))
    counts: dict[str, int] = {}

    async def schedule() -> dict[str, Any]:
        streamed = asyncio.Event()

        async def request(rid: str, prompt: str, max_tokens: int, at: int | None = None) -> Any:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            final = None
            async for out in engine.generate(prompt, params, request_id=rid):
                final = out
                if at is not None and len(out.outputs[0].token_ids) >= at:
                    streamed.set()
            return final

        await asyncio.to_thread(client.connect)
        running = asyncio.create_task(request("mp-long", PROMPTS[0], long_tokens, BEFORE))
        await streamed.wait()
        handle = client.push(source, version=5)
        assert await asyncio.to_thread(source.reached.wait, 30)
        # The engine keeps generating while the update is held mid-flight: wait for more tokens.
        counts["at_release"] = len((await _progress(engine, "mp-in-flight", PROMPTS[0])).outputs[0].token_ids)
        source.release.set()
        await asyncio.to_thread(handle.wait, 60)
        await asyncio.to_thread(client.commit, 5)
        late = await request("mp-late", PROMPTS[0], MAX_TOKENS)
        return {"long": _completion(await running), "late": _completion(late)}

    try:
        got = async_engine.run(schedule())
        status = async_engine.run(engine.collective_rpc("ws_stage_status"))[0]
    finally:
        source.release.set()
        async_engine.run(asyncio.to_thread(client.close))
    oracle = KeptKVOracle(vllm_ckpts["a"], vllm_ckpts["b"])
    long = got["long"]
    assert long.spans is not None and long.spans[0][:2] == ("default", 0)
    switch = long.spans[0][2]
    assert long.spans[1:] in ([], [("5", switch, long_tokens)])
    # Every token before the commit is A's, every one after it B's with the prefix recomputed.
    assert max(oracle.deficits(long.prompt_ids, long.tokens, switch, kept=False)) <= LOGIT_TOLERANCE
    assert counts["at_release"] == MAX_TOKENS and switch >= BEFORE
    assert got["late"].spans == [("5", 0, MAX_TOKENS)]
    assert max(oracle.deficits(got["late"].prompt_ids, got["late"].tokens, 0)) <= LOGIT_TOLERANCE
    assert status["committed"] == 5 and status["pending"] is None


async def _progress(engine: Any, rid: str, prompt: str) -> Any:
    """A whole request generated while the update is held mid-flight (the engine did not stop for it)."""
    from vllm import SamplingParams

    final = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), request_id=rid):
        final = out
    return final


def test_an_fp8_engine_quantizes_the_staged_update_in_its_twin_as_a_direct_reload_would(vllm_ckpts) -> None:
    from weight_sync.integrations.vllm import LLMControl
    from weight_sync.integrations.vllm.staging import StagingClient

    # Per-tensor fp8 takes one dynamic activation scale over the batch, so a prefix-cache hit (a shorter
    # prefill) changes tokens: every run here computes its whole prompt.
    llm = start_llm(vllm_ckpts["a"], quantization="fp8", options={"cpu_fp8_fallback": True},
                    enable_prefix_caching=False)
    try:
        served_a = greedy(llm)
        with StagingClient(LLMControl(llm)) as staging:
            staging.connect()
            staging.push(checkpoint_items(vllm_ckpts["b"]), version=2).wait(60)
            while_staged = greedy(llm)
            staging.commit(version=2)
            staged = (greedy(llm), llm.collective_rpc("ws_fingerprint")[0])
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
        llm.reset_prefix_cache()
        direct = (greedy(llm), llm.collective_rpc("ws_fingerprint")[0])
    finally:
        stop_llm(llm)
    assert while_staged == served_a
    assert staged == direct and staged[0] != served_a
