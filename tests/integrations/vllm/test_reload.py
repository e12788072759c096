"""``collective_rpc("reload_weights", ...)`` on a real vLLM engine runs weight_sync's lifecycle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integrations.vllm.conftest import (
    PROMPTS,
    checkpoint_items,
    driver_model,
    greedy,
    start_llm,
    stop_llm,
)

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def llm(vllm_ckpts: dict[str, Path], fresh_tokens):
    engine = start_llm(vllm_ckpts["a"])
    yield engine
    stop_llm(engine)


@pytest.fixture
def on_a(llm, vllm_ckpts):
    """The engine serving A at the start of the test (whatever the previous test left)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    return llm


def _with(items, name, tensor):
    return [(n, tensor if n == name else t) for n, t in items]


def test_reload_from_a_path_serves_like_a_fresh_engine_and_a_to_b_to_a_is_exact(
    on_a, vllm_ckpts, fresh_tokens
) -> None:
    fp_a = on_a.collective_rpc("ws_fingerprint")[0]
    assert greedy(on_a) == fresh_tokens["a"]  # prefix cache now holds A's blocks of the long prompt
    [report] = on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"]),
                                                            "version": "b1"})
    assert report["version"] == "b1" and report["num_tensors"] == 25 and not report["partial"]
    assert greedy(on_a) == fresh_tokens["b"]
    assert on_a.collective_rpc("ws_fingerprint")[0] != fp_a
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    assert greedy(on_a) == fresh_tokens["a"]
    assert on_a.collective_rpc("ws_fingerprint")[0] == fp_a


@pytest.mark.parametrize("order", ["in_order", "reversed", "lazy"])
def test_reload_from_an_iterator_in_any_order_serves_like_a_fresh_engine(order, on_a, vllm_ckpts, fresh_tokens) -> None:
    items = checkpoint_items(vllm_ckpts["b"])
    source = {"in_order": items, "reversed": items[::-1], "lazy": iter(items)}[order]
    [report] = on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": source})
    assert report["num_tensors"] == len(items)
    assert greedy(on_a) == fresh_tokens["b"]
    assert on_a.collective_rpc("ws_last_report")[0]["num_tensors"] == len(items)


def test_the_prefix_cache_is_invalidated_after_every_update(on_a, vllm_ckpts, fresh_tokens) -> None:
    long_prompt = [PROMPTS[1]]
    assert greedy(on_a, long_prompt) == fresh_tokens["a"][1:]
    scheduler = on_a.llm_engine.engine_core.engine_core.scheduler
    cached_blocks = len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert cached_blocks > 0
    on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_items(vllm_ckpts["b"])})
    assert len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0
    assert greedy(on_a, long_prompt) == fresh_tokens["b"][1:]


def test_a_wrong_shape_is_refused_before_any_write_naming_the_tensor_and_the_expectation(
    on_a, vllm_ckpts, fresh_tokens
) -> None:
    bad = _with(checkpoint_items(vllm_ckpts["b"]), K_PROJ, torch.zeros(7, 128, dtype=torch.bfloat16))
    with pytest.raises(Exception, match=rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": bad})
    assert on_a.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(on_a) == fresh_tokens["a"]
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
    assert greedy(on_a) == fresh_tokens["b"]


def test_a_missing_tensor_is_refused_by_name_and_nothing_changes(on_a, vllm_ckpts, fresh_tokens) -> None:
    items = [(n, t) for n, t in checkpoint_items(vllm_ckpts["b"]) if n != K_PROJ]
    with pytest.raises(Exception, match=rf"lacks .*{K_PROJ}"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    assert greedy(on_a) == fresh_tokens["a"]


def test_a_lazy_source_that_breaks_mid_stream_makes_the_engine_refuse_requests_until_a_good_update(
    on_a, vllm_ckpts, fresh_tokens
) -> None:
    from weight_sync import TornModelError

    items = checkpoint_items(vllm_ckpts["b"])
    wrong = torch.zeros(7, 128, dtype=torch.bfloat16)

    def stream():
        for name, tensor in items:
            yield name, (wrong if name == K_PROJ else tensor)

    with pytest.raises(Exception, match=rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
    assert K_PROJ in on_a.collective_rpc("ws_status")[0]["torn"]
    with pytest.raises(TornModelError, match=r"refused: update .* failed"):
        greedy(on_a)
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
    assert on_a.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(on_a) == fresh_tokens["b"]


def test_with_rollback_a_broken_source_leaves_the_previous_weights_serving(on_a, vllm_ckpts, fresh_tokens) -> None:
    items = checkpoint_items(vllm_ckpts["b"])
    fp_a = on_a.collective_rpc("ws_fingerprint")[0]

    def stream():
        yield from items[: len(items) - 3]  # most layers complete (and swap their prepacked handles)
        raise ConnectionResetError("trainer went away")

    with pytest.raises(Exception, match=r"the weights source failed after .*trainer went away"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "rollback": True})
    assert on_a.collective_rpc("ws_status")[0]["torn"] is None
    assert on_a.collective_rpc("ws_fingerprint")[0] == fp_a
    assert greedy(on_a) == fresh_tokens["a"]


def test_every_graph_visible_tensor_keeps_its_address_across_updates(on_a, vllm_ckpts) -> None:
    from weight_sync.layers import signatures

    model = driver_model(on_a)
    before = signatures(model)
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
    on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_items(vllm_ckpts["a"])[::-1]})
    assert signatures(model) == before


def _worker_model_config(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_config


@pytest.fixture(scope="module")
def torch_file_ckpt_b(vllm_ckpts, tmp_path_factory) -> Path:
    """Checkpoint B as ``pytorch_model.bin`` (no safetensors), as older HF checkpoints are saved."""
    out = tmp_path_factory.mktemp("torch_ckpt_b")
    torch.save(dict(checkpoint_items(vllm_ckpts["b"])), out / "pytorch_model.bin")
    (out / "config.json").write_text((vllm_ckpts["b"] / "config.json").read_text())
    return out


def test_reload_from_a_pytorch_model_bin_checkpoint_serves_like_a_fresh_engine_and_resets_model_config(
    on_a, torch_file_ckpt_b, vllm_ckpts, fresh_tokens
) -> None:
    config = _worker_model_config(on_a)
    config.revision, config.model_weights = "stale-revision", "s3://bucket/old-model"
    [report] = on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(torch_file_ckpt_b)})
    assert report["num_tensors"] == 25
    assert greedy(on_a) == fresh_tokens["b"]
    # As vLLM's reload: the new path, and no revision or object-storage source of the old model.
    assert (config.model, config.revision, config.model_weights) == (str(torch_file_ckpt_b), None, "")
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    assert greedy(on_a) == fresh_tokens["a"]
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(torch_file_ckpt_b)})
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    # An argument-less reload reads the checkpoint loaded last.
    on_a.collective_rpc("reload_weights", kwargs={"version": "again"})
    assert greedy(on_a) == fresh_tokens["a"]


class TrainingState:
    """An arbitrary object in a torch file: loading it would mean running its pickle."""

    step = 3


def test_a_torch_file_holding_more_than_tensors_is_refused_without_unpickling_it(on_a, tmp_path, fresh_tokens) -> None:
    torch.save({"model.norm.weight": torch.ones(128), "state": TrainingState()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match=r"weights-only torch file"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path)})
    assert greedy(on_a) == fresh_tokens["a"]


def test_a_hub_id_is_read_from_the_local_cache_only_and_refused_clearly_when_not_cached(
    on_a, vllm_ckpts, fresh_tokens, tmp_path, monkeypatch
) -> None:
    import shutil

    huggingface_hub = pytest.importorskip("huggingface_hub")
    repo = tmp_path / "models--ws-test--tiny-b"
    shutil.copytree(vllm_ckpts["b"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(Exception, match=r"'ws-test/not-cached' is not a local path and not in the local Hugging Face"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_path": "ws-test/not-cached"})
    assert greedy(on_a) == fresh_tokens["a"]
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": "ws-test/tiny-b"})
    assert greedy(on_a) == fresh_tokens["b"]
    assert _worker_model_config(on_a).model == "ws-test/tiny-b"


def test_upstream_style_low_level_calls_on_a_vllm_model_commit_what_was_sent_like_a_path_reload(
    on_a, vllm_ckpts, fresh_tokens
) -> None:
    # vLLM's own NCCL backend: initialize_layerwise_reload, loads (here half as direct weight_loader
    # calls, half through model.load_weights), finalize_layerwise_reload(model, model_config).
    from vllm.config import set_current_vllm_config

    from weight_sync.reload import finalize_layerwise_reload, initialize_layerwise_reload

    worker = on_a.llm_engine.model_executor.driver_worker.worker
    model = worker.get_model()
    params = dict(model.named_parameters())
    items = checkpoint_items(vllm_ckpts["b"])
    direct = [(n, t) for n, t in items if n in params]  # names vLLM keeps unfused: norms, o/down_proj, ...
    through_model = [(n, t) for n, t in items if n not in params]  # q/k/v and gate/up: fused by load_weights
    assert direct and through_model
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        for name, tensor in direct:
            params[name].weight_loader(params[name], tensor)
        model.load_weights(through_model)
        report = finalize_layerwise_reload(model, worker.model_config)
    assert report.to_dict()["num_tensors"] == len(items)
    on_a.reset_prefix_cache()  # outside the engine's RPCs the caller invalidates the cache, as with vLLM
    assert greedy(on_a) == fresh_tokens["b"]
    fp = on_a.collective_rpc("ws_fingerprint")[0]
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
    assert on_a.collective_rpc("ws_fingerprint")[0] == fp


def test_the_first_update_after_vllms_own_load_is_held_to_the_checkpoint_vllm_loaded(vllm_ckpts, fresh_tokens) -> None:
    engine = start_llm(vllm_ckpts["a"])
    try:
        items = checkpoint_items(vllm_ckpts["b"])
        gate = next(n for n, _ in items if n.endswith("layers.0.mlp.gate_proj.weight"))
        # A first update lacking a layer used to be accepted (nothing to check coverage against) ...
        lacking = [(n, t) for n, t in items if ".layers.1." not in n]
        with pytest.raises(Exception, match=r"lacks .*model\.layers\.1\."):
            engine.collective_rpc("reload_weights", kwargs={"weights_iterator": lacking})
        # ... and so was a tensor larger than its parameter, which vLLM's TP=1 loader narrows.
        oversized = _with(items, gate, torch.zeros(dict(items)[gate].shape[0] + 128, dict(items)[gate].shape[1],
                                                   dtype=torch.bfloat16))
        with pytest.raises(Exception, match=rf"{gate}: engine expects"):
            engine.collective_rpc("reload_weights", kwargs={"weights_iterator": oversized})
        assert engine.collective_rpc("ws_status")[0]["torn"] is None
        assert greedy(engine) == fresh_tokens["a"]
    finally:
        stop_llm(engine)
