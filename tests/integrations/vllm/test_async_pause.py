"""Weight updates under vLLM's pause, in-process engine core: the same schedule with and without weight_sync.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a test drives it one
scheduler step at a time and the update lands after exactly the same tokens in every run: the plain vLLM
engine (vLLM's own ``reload_weights``) and the weight_sync engine must produce identical tokens, finish
reasons and ``weight_versions`` spans. ``pause_scheduler`` / ``resume_scheduler`` are the engine-core calls
behind ``AsyncLLM.pause_generation`` / ``resume_generation`` (the in-process ``LLM`` has no public pause);
vLLM refuses ``mode="wait"`` in process, and so must weight_sync's engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm._async_oracle import LOGIT_TOLERANCE, KeptKVOracle, fresh_continuation
from tests.integrations.vllm.conftest import PROMPTS, checkpoint_items, start_llm, stop_llm

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 16
BEFORE = 4  # tokens each request has when the engine pauses


@dataclass(frozen=True, kw_only=True)
class Completion:
    """What a request returned: its prompt, tokens, finish reason and weight-version spans."""

    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str | None
    spans: list[tuple[str, int, int]] | None


def _completion(out: Any) -> Completion:
    o = out.outputs[0]
    spans = None if o.weight_versions is None else [(s.version, s.start, s.end) for s in o.weight_versions]
    return Completion(prompt_ids=list(out.prompt_token_ids), tokens=list(o.token_ids),
                      finish_reason=o.finish_reason, spans=spans)


@pytest.fixture(scope="module")
def engines(vllm_ckpts: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """Three in-process engines: weight_sync on A, plain vLLM on A, and a fresh plain B (the oracle)."""
    built = {
        "ws": start_llm(vllm_ckpts["a"]),
        "plain": start_llm(vllm_ckpts["a"], weight_sync=False),
        "fresh_b": start_llm(vllm_ckpts["b"], weight_sync=False),
    }
    try:
        yield built
    finally:
        for llm in built.values():
            stop_llm(llm)


@pytest.fixture(scope="module")
def kept_kv(vllm_ckpts: dict[str, Path]) -> KeptKVOracle:
    return KeptKVOracle(vllm_ckpts["a"], vllm_ckpts["b"])


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _back_to_a(llm: Any, ckpt_a: Path) -> None:
    """Serve A again with empty caches and the default label, as a freshly started engine would."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt_a)})
    llm.reset_prefix_cache()
    llm.llm_engine.set_weight_version("default")


def run_schedule(llm: Any, tag: str, update: Callable[[Any], None], *, mode: str | None,
                 clear_cache: bool = False) -> dict[str, Completion]:
    """Both prompts generate ``BEFORE`` tokens; pause (``mode``; None: no pause); a third request arrives;
    ``update``; resume; everything runs to the end. Returns each request's completion by id suffix."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    core = _core(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    ids = {f"{tag}-{i}": f"p{i}" for i in range(len(PROMPTS))}
    for rid, prompt in zip(ids, PROMPTS):
        engine.add_request(rid, prompt, params)
    seen: dict[str, Any] = {}
    while not all(rid in seen and len(seen[rid].outputs[0].token_ids) >= BEFORE for rid in ids):
        for out in engine.step():
            seen[out.request_id] = out
    assert {len(seen[rid].outputs[0].token_ids) for rid in ids} == {BEFORE}
    if mode is not None:
        core.pause_scheduler(mode=mode, clear_cache=clear_cache)
    # Arrives while paused (or during the update): it must be served by the new weights only.
    engine.add_request(f"{tag}-late", PROMPTS[0], params)
    ids[f"{tag}-late"] = "late"
    update(llm)
    if mode is not None:
        core.resume_scheduler()
    while core.scheduler.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out
    # Requests the engine core aborted (mode="abort") never reach an in-process output processor.
    engine.abort_request([rid for rid in ids if not seen.get(rid) or not seen[rid].finished])
    return {name: _completion(seen[rid]) for rid, name in ids.items() if rid in seen}


def _reload_b(ckpt_b: Path, version: str) -> Callable[[Any], None]:
    def update(llm: Any) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt_b)})
        llm.llm_engine.set_weight_version(version)

    return update


def _both(engines: dict[str, Any], ckpts: dict[str, Path], tag: str, **schedule: Any) -> tuple[dict, dict]:
    results = []
    for key in ("plain", "ws"):
        llm = engines[key]
        try:
            results.append(run_schedule(llm, f"{tag}-{key}", _reload_b(ckpts["b"], "v1"), **schedule))
        finally:
            _back_to_a(llm, ckpts["a"])
    return results[0], results[1]


def test_keep_without_clearing_continues_the_kept_requests_on_their_old_kv_as_plain_vllm_does(
    engines, vllm_ckpts, kept_kv
) -> None:
    plain, ws = _both(engines, vllm_ckpts, "keep", mode="keep", clear_cache=False)
    assert ws == plain
    for name in ("p0", "p1"):
        c = ws[name]
        assert c.finish_reason == "length"
        assert c.spans == [("default", 0, BEFORE), ("v1", BEFORE, MAX_TOKENS)]
        # The oracle: A's KV for the prefix, B's weights from the first new token on.
        assert max(kept_kv.deficits(c.prompt_ids, c.tokens, BEFORE)) <= LOGIT_TOLERANCE
        # Recomputing the prefix with B would have chosen other tokens: the schedule tells the two apart.
        assert max(kept_kv.deficits(c.prompt_ids, c.tokens, BEFORE, kept=False)) > 4 * LOGIT_TOLERANCE
        assert c.tokens[BEFORE:] != fresh_continuation(
            engines["fresh_b"], c.prompt_ids, c.tokens[:BEFORE], MAX_TOKENS - BEFORE)
    assert ws["late"].tokens == fresh_continuation(engines["fresh_b"], ws["late"].prompt_ids, [], MAX_TOKENS)
    assert ws["late"].spans == [("v1", 0, MAX_TOKENS)]


def test_keep_with_clear_cache_recomputes_the_kept_requests_with_the_new_weights(engines, vllm_ckpts) -> None:
    plain, ws = _both(engines, vllm_ckpts, "keepclear", mode="keep", clear_cache=True)
    assert ws == plain
    for name in ("p0", "p1", "late"):
        c = ws[name]
        before = c.tokens[:BEFORE] if name != "late" else []
        assert c.tokens[len(before):] == fresh_continuation(
            engines["fresh_b"], c.prompt_ids, before, MAX_TOKENS - len(before))
        assert c.spans == ([("default", 0, BEFORE)] if before else []) + [("v1", len(before), MAX_TOKENS)]


def test_abort_ends_the_running_requests_and_serves_later_ones_with_the_new_weights(engines, vllm_ckpts) -> None:
    plain, ws = _both(engines, vllm_ckpts, "abort", mode="abort", clear_cache=True)
    assert ws == plain
    assert {name: len(c.tokens) for name, c in ws.items()} == {"p0": BEFORE, "p1": BEFORE, "late": MAX_TOKENS}
    assert ws["late"].tokens == fresh_continuation(engines["fresh_b"], ws["late"].prompt_ids, [], MAX_TOKENS)
    assert ws["late"].spans == [("v1", 0, MAX_TOKENS)]


def test_wait_is_refused_in_process_by_weight_sync_as_by_vllm(engines) -> None:
    for key in ("plain", "ws"):
        with pytest.raises(ValueError, match="'wait' mode can't be used in inproc-engine mode"):
            _core(engines[key]).pause_scheduler(mode="wait", clear_cache=False)
        assert not _core(engines[key]).is_scheduler_paused()


def test_without_a_pause_weight_sync_recomputes_running_requests_and_labels_tokens_at_the_commit(
    engines, vllm_ckpts
) -> None:
    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient

    llm = engines["ws"]
    items = dict(checkpoint_items(vllm_ckpts["b"]))

    def push(llm: Any) -> None:
        with WeightSyncClient(LLMControl(llm)) as client:
            client.connect()
            client.push(items, version=7)

    try:
        ws = run_schedule(llm, "nopause", push, mode=None)
    finally:
        _back_to_a(llm, vllm_ckpts["a"])
    for name in ("p0", "p1", "late"):
        c = ws[name]
        before = c.tokens[:BEFORE] if name != "late" else []
        assert c.tokens[len(before):] == fresh_continuation(
            engines["fresh_b"], c.prompt_ids, before, MAX_TOKENS - len(before))
        assert c.spans == ([("default", 0, BEFORE)] if before else []) + [("7", len(before), MAX_TOKENS)]


def test_a_refused_update_while_kept_changes_no_served_token(engines, vllm_ckpts) -> None:
    import torch

    llm = engines["ws"]
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [(n, torch.zeros(128, 7, dtype=torch.bfloat16) if n == name else t)
           for n, t in checkpoint_items(vllm_ckpts["b"])]

    def refused(llm: Any) -> None:
        with pytest.raises(Exception, match=rf"{name}.*\(128, 7\)"):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bad})

    untouched = run_schedule(llm, "untouched", lambda llm: None, mode="keep", clear_cache=False)
    failed = run_schedule(llm, "refused", refused, mode="keep", clear_cache=False)
    assert failed == untouched
    assert {c.spans[-1][0] for c in failed.values() if c.spans} == {"default"}
    assert llm.collective_rpc("ws_status")[0]["torn"] is None


@pytest.mark.parametrize("user_call", ["keep", "resume"])
def test_a_pause_or_resume_during_weight_syncs_hold_takes_effect_at_the_commit_not_before(
    engines, vllm_ckpts, kept_kv, user_call
) -> None:
    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient

    llm = engines["ws"]
    core = _core(llm)
    items = dict(checkpoint_items(vllm_ckpts["b"]))

    held: list[bool] = []

    class UserCallsMidUpdate(LLMControl):
        """The user's pause_generation / resume_generation lands between start and finish."""

        def update_weights(self, update_info: dict[str, Any]) -> None:
            if user_call == "keep":
                core.pause_scheduler(mode="keep", clear_cache=False)
            else:
                core.resume_scheduler()
            held.append(core.is_scheduler_paused())  # (an assert here would leave the sender waiting)
            super().update_weights(update_info)

    def push(llm: Any) -> None:
        if user_call == "resume":
            core.pause_scheduler(mode="keep", clear_cache=False)  # the user paused before the update
        with WeightSyncClient(UserCallsMidUpdate(llm)) as client:
            client.connect()
            client.push(items, version=5)
        assert held == [True]  # nothing could step on half-written weights
        assert core.is_scheduler_paused() == (user_call == "keep")
        if user_call == "keep":
            core.resume_scheduler()

    try:
        ws = run_schedule(llm, f"midhold-{user_call}", push, mode=None)
    finally:
        if core.is_scheduler_paused():
            core.resume_scheduler()
        _back_to_a(llm, vllm_ckpts["a"])
    # Paused by the user at the commit (either way the update began paused or ended so): KV kept.
    for name in ("p0", "p1"):
        c = ws[name]
        assert c.spans == [("default", 0, BEFORE), ("5", BEFORE, MAX_TOKENS)]
        assert max(kept_kv.deficits(c.prompt_ids, c.tokens, BEFORE, kept=user_call == "keep")) <= LOGIT_TOLERANCE


def test_a_reload_with_a_version_labels_the_tokens_after_it_unless_the_user_paused(engines, vllm_ckpts) -> None:
    llm = engines["ws"]

    def reload_v3(llm: Any) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"]), "version": 3})

    try:
        unpaused = run_schedule(llm, "relabel", reload_v3, mode=None)
    finally:
        _back_to_a(llm, vllm_ckpts["a"])
    try:
        # Under a pause the label is the user's to set (vLLM's update_weight_version), as on plain vLLM.
        paused = run_schedule(llm, "nolabel", reload_v3, mode="keep", clear_cache=True)
    finally:
        _back_to_a(llm, vllm_ckpts["a"])
    assert unpaused["p0"].spans == [("default", 0, BEFORE), ("3", BEFORE, MAX_TOKENS)]
    assert unpaused["late"].spans == [("3", 0, MAX_TOKENS)]
    assert paused["p0"].spans == [("default", 0, MAX_TOKENS)]
    # The same weights served both runs' tokens after the update (both recomputed the prefix with B).
    assert unpaused["p0"].tokens == paused["p0"].tokens
